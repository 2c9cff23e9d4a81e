"""`LLM`: offline batched generation, used like vLLM's."""

import copy
import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from v1.beam_search import BeamSearchOutput, beam_search, eos_token_ids
from v1.config import EngineArgs
from v1.engine.llm_engine import LLMEngine
from v1.engine.processor import PromptType, prompt_list
from v1.entrypoints.llm_pooling import PoolingMixin
from v1.lora.request import LoRARequest
from v1.metrics.reader import Metric
from v1.models.model_files import resolve_model
from v1.outputs import RequestOutput, SchedulerStats
from v1.pooling_params import PoolingParams
from v1.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from v1.models.loader import LoadedModel

Messages = Sequence[Mapping[str, Any]]


class LLM(PoolingMixin):
    """Generate text from prompts with the engine; or, made with runner="pooling", embed,
    classify and score them (`PoolingMixin`).

    >>> llm = LLM()  # the default model, SmolLM2-135M-Instruct
    >>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    >>> out[0].outputs[0].text

    Keyword arguments are the engine options of `EngineArgs` (vLLM's names; those of vLLM's
    that mean nothing here are accepted as `v1.config.ignored_options` says). As in vLLM, metrics
    are off unless `disable_log_stats=False`; then `get_metrics()` reads them.
    As in vLLM, the engine core runs in its own process (`SyncMPClient`), which `shutdown()`
    (or leaving a `with` block, or the interpreter's exit) terminates. `multiprocess=False`,
    or V1_ENABLE_MULTIPROCESSING=0 in the environment, runs it in this process instead.
    `loaded_model` reuses weights already loaded in this process (several engines, one copy),
    so it implies in-process.

    Lengths, as in vLLM's `LLM`: a prompt may have up to `max_model_len` tokens (a longer one
    raises ValueError), and max_tokens is capped to fit: generation stops with finish_reason
    "length" when prompt plus output reach `max_model_len`, whatever max_tokens asks. So a
    prompt of exactly `max_model_len` tokens gets one token (it needs no KV slot), and
    max_tokens=None means all the room left. (The OpenAI server rejects a request whose
    max_tokens does not fit with a 400 instead.)

    Data parallelism, as vLLM's: `data_parallel_size=N` starts N engine-core processes
    (each with its own KV cache and cores // N torch threads) behind one client that routes
    each request by prefix affinity with a load guard (`data_parallel_routing`, see
    `v1.engine.dp_router`); `generate(..., data_parallel_rank=i)` pins requests to core i;
    `get_stats()` gives the total with each core's own in `.engines`.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        loaded_model: "LoadedModel | None" = None,
        multiprocess: bool | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = set(kwargs) - set(EngineArgs.__slots__)
        if unknown:
            raise ValueError(f"unknown engine options {sorted(unknown)}")
        kwargs.setdefault("disable_log_stats", True)  # vLLM's LLM default
        self.engine_args = EngineArgs(model=model, **kwargs)
        if loaded_model is None:
            # A path or hub id that is not there fails here, before an engine starts.
            resolve_model(model, self.engine_args.revision)
        self.llm_engine = LLMEngine.from_engine_args(
            self.engine_args, enable_multiprocessing=multiprocess, loaded_model=loaded_model
        )
        self._request_ids = map(str, itertools.count())
        try:  # generation_config.json's sampling defaults ("auto"), or none ("vllm")
            self.default_sampling_params = self.engine_args.get_diff_sampling_param(
                self.llm_engine.client.model_info.model_dir
            )
        except BaseException:
            self.shutdown()
            raise

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams, as vLLM's: the
        model's generation_config.json defaults (temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens as max_tokens) over SamplingParams' own, unless
        the engine was made with generation_config="vllm"."""
        return SamplingParams(**self.default_sampling_params)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = True,
        data_parallel_rank: int | Sequence[int | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of `prompts`.

        One `SamplingParams` applies to all prompts, or pass one per prompt; `priority` (one
        per prompt, lower first) matters under scheduling_policy="priority". Each request's
        max_tokens is capped to what `max_model_len` leaves after its prompt (see the class).
        `data_parallel_rank` (one for all prompts, or one per prompt; None routes) pins
        requests to an engine core under data parallelism. `lora_request` (one for all
        prompts, or one per prompt; None: the base model) runs prompts with a LoRA adapter
        (the engine made with enable_lora=True); each adapter is loaded and checked first, so
        a bad one raises ValueError before anything runs.
        """
        prompts = prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if not all(isinstance(p, SamplingParams) for p in params):  # a dict's keys, ...
                raise ValueError(
                    "sampling_params must be a SamplingParams or a list of them (one per "
                    f"prompt), got {type(sampling_params).__name__}"
                )
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} sampling params for {len(prompts)} prompts"
                )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        ranks: list[int | None]
        if not isinstance(data_parallel_rank, Sequence) or isinstance(data_parallel_rank, str):
            ranks = [data_parallel_rank] * len(prompts)  # one for all (checked per request)
        else:
            ranks = list(data_parallel_rank)
            if len(ranks) != len(prompts):
                raise ValueError(
                    f"got {len(ranks)} data_parallel_ranks for {len(prompts)} prompts"
                )
        loras: list[LoRARequest | None]
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        elif isinstance(lora_request, Sequence) and all(
            lr is None or isinstance(lr, LoRARequest) for lr in lora_request
        ):
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        else:
            raise ValueError(
                "lora_request must be a LoRARequest, a list of them (or None) one per prompt, "
                f"or None, got {lora_request!r:.80}"
            )
        # Keyed by id and path, not by LoRARequest equality (the name alone, as vLLM's): two
        # requests of one name may be two adapters, and each must be checked here.
        unique = {(lr.lora_int_id, lr.lora_path): lr for lr in loras if lr is not None}
        for lora in unique.values():
            self.llm_engine.add_lora(lora)
        return self._run(prompts, params, priority, use_tqdm, ranks, loras)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's: the `params.beam_width` most likely sequences for each prompt (text, token
        ids, or a dict with "prompt" or "prompt_token_ids"; one prompt alone as `generate`
        takes it), best first, in the order of `prompts`.
        Each step's beams run as one-token requests in the engine's batched steps, sharing
        their common prefix's KV blocks through the prefix cache (see `v1.beam_search`);
        `concurrency_limit` bounds how many prompts are searched at once; `lora_request`, one
        adapter for every prompt's beams (None: the base model)."""
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be one LoRARequest for all prompts or None, got "
                f"{type(lora_request).__name__}"
            )
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params)}")
        processor = self.llm_engine.processor
        params.check_limits(processor.limits)
        tokenizer = self.get_tokenizer()
        return beam_search(
            prompt_list(prompts), params,
            generate=lambda batch, step: self.generate(
                batch, step, use_tqdm=False, lora_request=lora_request
            ),
            tokenize=processor.prompt_token_ids,
            eos_token_ids=eos_token_ids(processor),
            max_model_len=processor.max_model_len,
            decode=None if tokenizer is None else tokenizer.decode,
            use_tqdm=use_tqdm, concurrency_limit=concurrency_limit,
        )

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate.

        As vLLM's: `chat_template` (Jinja text) replaces the model's; with
        `continue_final_message=True` (and `add_generation_prompt=False`) the model goes on
        with the last message instead of answering it; `chat_template_kwargs` are extra
        template variables; `tools` (OpenAI-style function definitions) reach the template;
        `lora_request` as in `generate`.
        """
        if messages and isinstance(messages[0], Mapping):
            messages = [messages]  # type: ignore[list-item]
        processor = self.llm_engine.processor
        prompts = [
            processor.apply_chat_template(
                conv, chat_template, add_generation_prompt, continue_final_message,  # type: ignore[arg-type]
                chat_template_kwargs, tools,
            )
            for conv in messages
        ]
        token_prompts = [
            {"prompt": p, "prompt_token_ids": processor.encode_conversation(p)} for p in prompts
        ]
        return self.generate(
            token_prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request
        )

    def _run(
        self,
        prompts: list[PromptType],
        params: Sequence[SamplingParams | PoolingParams],
        priority: Sequence[int] | None,
        use_tqdm: bool,
        ranks: Sequence[int | None],
        loras: Sequence[LoRARequest | None],
    ) -> list[Any]:  # RequestOutput, or PoolingRequestOutput for PoolingParams
        engine = self.llm_engine
        ids: list[str] = []
        try:
            # Validate and add all first: a bad prompt raises before anything runs.
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                if isinstance(p, SamplingParams):
                    p = copy.copy(p)  # the caller's params stay as they are
                    p.output_kind = RequestOutputKind.FINAL_ONLY
                ids.append(engine.add_request(
                    next(self._request_ids), prompt, p,
                    priority=priority[i] if priority else 0, data_parallel_rank=ranks[i],
                    lora_request=loras[i],
                ))
        except Exception:
            engine.abort_requests(ids)
            raise
        order = {request_id: i for i, request_id in enumerate(ids)}
        results: list[Any] = [None] * len(ids)
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            try:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            results[order[out.request_id]] = out
                            bar.update(1)
            except BaseException:
                engine.abort_requests([i for i, r in zip(ids, results) if r is None])
                raise
        return [r for r in results if r is not None]

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """vLLM's: forget the cached prefixes; False (nothing done) while requests hold
        blocks, unless `reset_running_requests` preempts them first (they recompute). The
        disk tier (kv_cache_dir) is kept, as it outlives restarts, unless `reset_connector`
        (vLLM's external cache): then its files for this model and KV setting are removed
        too (False without a tier)."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def get_stats(self) -> SchedulerStats:
        """The engine core's scheduler stats; with data parallelism a `DPSchedulerStats`:
        the total over the cores, each core's own in `.engines` (None for a dead core)."""
        return self.llm_engine.get_stats()

    def get_metrics(self) -> list[Metric]:
        """vLLM's: a snapshot of the engine's metrics (`v1.metrics.reader`'s Counter, Gauge,
        Histogram and Vector, under the names of the server's GET /metrics). Needs
        `LLM(..., disable_log_stats=False)`: metrics are off by default, as in vLLM."""
        return self.llm_engine.get_metrics()

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

