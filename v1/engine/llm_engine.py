"""The synchronous frontend, vLLM's `LLMEngine`: processor -> engine core client -> output
processor (`add_request`, then `step()` while `has_unfinished_requests()`).

Callers name requests by their own ids; the core knows each by the internal id the processor
gives it. With `log_stats`, per-request latencies go to the metrics `get_metrics()` reads. With
data parallelism a core that dies fails only its requests: `step()` raises its
`EngineCoreDeadError` once it has forgotten them, and the engine serves on.
"""

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from v1 import envs
from v1.config import EngineArgs
from v1.config.limits import DEFAULT_LIMITS, InputLimits
from v1.engine.core_client import EngineCoreClient, InprocClient, SyncMPClient
from v1.engine.dp_client import DPSyncMPClient
from v1.engine.dp_router import check_data_parallel_rank
from v1.engine.exceptions import EngineCoreDeadError
from v1.engine.output_processor import IterationStats, OutputProcessor
from v1.engine.processor import Processor, PromptType, logits_processor_classes
from v1.lora.request import LoRARequest
from v1.metrics.prometheus import PrometheusMetrics
from v1.metrics.reader import Metric, get_metrics_snapshot
from v1.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput, SchedulerStats
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams

if TYPE_CHECKING:
    from v1.models.loader import LoadedModel
    from v1.sample.logits_processor import LogitsProcessor


class LLMEngine:
    def __init__(
        self,
        client: EngineCoreClient,
        limits: InputLimits = DEFAULT_LIMITS,
        log_stats: bool = False,
        logits_processors: Sequence[type["LogitsProcessor"]] = (),
    ) -> None:
        """`limits`: what one request may ask for (`EngineArgs.input_limits`); `log_stats`:
        gather the metrics `get_metrics()` returns; `logits_processors`: the engine's custom
        ones (their `validate_params` checks requests)."""
        self.client = client
        info = client.model_info
        self.tokenizer = info.tokenizer
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.processor = Processor(
            info.tokenizer,
            info.max_model_len,
            info.vocab_size,
            info.eos_token_id,
            info.stop_token_ids,
            info.scheduling_policy,
            limits,
            info.pooler,
            logits_processors,
        )
        self.output_processor = OutputProcessor(info.tokenizer)
        self.metrics = (
            PrometheusMetrics(info.model_name, info.max_model_len) if log_stats else None
        )
        # Dropping the engine (`del llm`, then a collection: vLLM's
        # cleanup_dist_env_and_memory) shuts its client down: the client's receiver thread
        # keeps the client itself alive, so the client's own finalizer would wait for exit.
        self._finalizer = weakref.finalize(self, client.shutdown)

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs,
        *,
        enable_multiprocessing: bool | None = None,
        loaded_model: "LoadedModel | None" = None,
    ) -> "LLMEngine":
        """vLLM's: an engine with the options of `engine_args`. Its engine core runs in a
        process of its own (`SyncMPClient`; several behind a `DPSyncMPClient` with
        data_parallel_size > 1) unless `enable_multiprocessing` is False (default: True
        unless V1_ENABLE_MULTIPROCESSING=0, or `loaded_model`, a `LoadedModel` of this
        process, is given: its weights are reused, in this process)."""
        if enable_multiprocessing is None:
            enable_multiprocessing = (
                loaded_model is None and envs.read().enable_multiprocessing
            )
        if enable_multiprocessing and loaded_model is not None:
            raise ValueError(
                "loaded_model needs multiprocess=False (enable_multiprocessing=False): its "
                "weights live here"
            )
        if engine_args.data_parallel_size > 1 and not enable_multiprocessing:
            raise ValueError(
                "data_parallel_size > 1 needs engine processes (multiprocess=True, "
                "enable_multiprocessing=True)"
            )
        client: EngineCoreClient = (
            DPSyncMPClient(engine_args)
            if engine_args.data_parallel_size > 1
            else SyncMPClient(engine_args)
            if enable_multiprocessing
            else InprocClient(engine_args, loaded_model)
        )
        return cls(
            client, engine_args.input_limits(), not engine_args.disable_log_stats,
            logits_processor_classes(engine_args.logits_processors),
        )

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,  # required: None names the order
        *,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """vLLM's order: the caller's id (what outputs carry and `abort_requests` takes; it
        is returned), the prompt, its SamplingParams (whose `output_kind` says what each
        output of `step()` carries), or a pooling engine's PoolingParams."""
        if not isinstance(request_id, str) or not isinstance(
            params, SamplingParams | PoolingParams
        ):
            raise TypeError(
                "add_request takes (request_id, prompt, params), as vLLM's; got "
                f"({type(request_id).__name__}, {type(prompt).__name__}, "
                f"{type(params).__name__})"
            )
        check_data_parallel_rank(data_parallel_rank, self.client.data_parallel_size)
        request, text = self.processor.process_inputs(
            request_id, prompt, params, None, priority, lora_request=lora_request
        )
        core_requests = self.output_processor.add_request(request, text)
        try:
            for core_request in core_requests:
                self.client.add_request(core_request, data_parallel_rank)
        except BaseException:  # e.g. its pinned core is dead
            self.abort_requests([request_id])
            raise
        return request_id

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        self.client.abort_requests(self.output_processor.abort_requests(request_ids))

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """vLLM's name: abort these requests (by the caller's ids; one id or several)."""
        self.abort_requests([request_ids] if isinstance(request_ids, str) else request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        """vLLM's: the requests added and not yet finished or aborted (n > 1: each of the
        n sequences counts)."""
        return self.output_processor.get_num_unfinished_requests()

    def get_tokenizer(self) -> Any:
        """vLLM's: the model's tokenizer (also `.tokenizer`)."""
        return self.tokenizer

    def step(self) -> list[RequestOutput | PoolingRequestOutput[PoolingOutput]]:
        try:
            outputs = self.client.get_output()
        except EngineCoreDeadError as e:  # one core of several died
            states = self.output_processor.request_states
            failed = {states[i].external_req_id for i in e.request_ids if i in states}
            if not failed:
                return []  # none of them live here any more
            self.abort_requests(list(failed))  # n > 1: siblings on other cores too
            raise
        stats = IterationStats() if self.metrics is not None else None
        processed = self.output_processor.process_outputs(outputs.outputs, stats)
        if processed.reqs_to_abort:  # stop strings: the core does not know them
            self.client.abort_requests(processed.reqs_to_abort)
        if self.metrics is not None and stats is not None:
            self.metrics.record(stats)
        return processed.request_outputs

    def get_metrics(self) -> list[Metric]:
        """vLLM's: the engine's metrics as of now (`v1.metrics.reader`'s objects, under
        the names GET /metrics uses): the engine core's counters and gauges, and the
        latency histograms of the requests finished so far. Needs log_stats."""
        if self.metrics is None:
            raise ValueError("metrics are off: make the engine with disable_log_stats=False")
        self.metrics.set_scheduler_stats(self.get_stats())
        return get_metrics_snapshot(self.metrics.registry)

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """vLLM's (`EngineCore.reset_prefix_cache`)."""
        return self.client.call_utility(
            "reset_prefix_cache", reset_running_requests, reset_connector
        )

    def get_stats(self) -> SchedulerStats:
        return self.client.call_utility("get_stats")

    # LoRA adapters, as vLLM's LLMEngine: load (a ValueError if it cannot be served),
    # unload, list the ids.
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.client.call_utility("add_lora", lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.client.call_utility("remove_lora", lora_id)

    def list_loras(self) -> set[int]:
        return self.client.call_utility("list_loras")

    def shutdown(self) -> None:
        self._finalizer()
