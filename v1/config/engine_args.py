"""`EngineArgs`: the engine's options under vLLM's flat names and defaults, as users pass them
(`LLM(max_model_len=..., enable_prefix_caching=...)`, `v1 serve --max-model-len`). Making
one builds every group (v1.config.model, cache, scheduler, parallel, speculative, limits,
lora), whose checks raise a ValueError naming the bad option, and keeps the values they make
canonical; the engine builds the groups again from it. Its own rules are the mapping's only:
vLLM's second spellings of two options, and the one rule across groups (no disk tier with
LoRA)."""

import argparse
import os
from dataclasses import dataclass, field, fields
from typing import Any

from v1.config.cache import CacheConfig, load_preload_prompts
from v1.config.checks import check_choice, check_int
from v1.config.cli_args import add_engine_args
from v1.config.ignored_options import IGNORED_OPTIONS, check_ignored_option, ignored_help
from v1.config.limits import DEFAULT_LIMITS, InputLimits
from v1.config.lora import LoRAConfig
from v1.config.model import HfOverrides, ModelConfig, PoolerConfig
from v1.config.parallel import ParallelConfig
from v1.config.scheduler import SchedulerConfig
from v1.config.speculative import SpeculativeConfig
from v1.reasoning import REASONING_PARSERS

# long_prefill_token_threshold's default on CPU, where it caps a request alone too: in
# 2048-token steps a 6000-token prompt held a user's request arriving meanwhile for up to
# 11 s (a whole step's wait, or the whole prompt's without a cap); alone, it prefills in
# 0.904x the time in 512-token steps (docs/serving.md, "Long prompts beside other users").
CPU_LONG_PREFILL_TOKENS = 512


def option(default: Any, help: str) -> Any:
    """An EngineArgs field: its default and its command-line help."""
    return field(default=default, metadata={"help": help})


@dataclass(slots=True)
class EngineArgs:
    """The user-facing engine options, named as vLLM names them. Each field's `help` is its
    command-line help (`add_cli_args`: `--max-model-len` for `max_model_len`); the options
    in `IGNORED_OPTIONS` are vLLM's that mean nothing here (v1.config.ignored_options)."""

    model: str | None = option(
        None, "a GGUF file, an HF model directory, or a hub id in the local HF cache "
        "(default: SmolLM2-135M-Instruct, GGUF)",
    )
    hf_overrides: HfOverrides | None = option(
        None, "changes to the model's HF config (config.json) before the model is built, as "
        "a JSON object of its keys (a nested config's keys as an object under its name); "
        "in Python, a function of the config returning it is accepted too",
    )
    revision: str | None = option(
        None, "with a hub id as the model: the branch, tag or commit to find in the local "
        "HF cache",
    )
    generation_config: str = option(
        "auto", "where requests' default sampling parameters come from: 'auto' (the model's "
        "generation_config.json), 'vllm' (SamplingParams' own) or a directory holding a "
        "generation_config.json",
    )
    override_generation_config: dict[str, Any] | None = option(
        None, "generation_config.json keys set over the file's (or alone, with "
        "--generation-config vllm), as a JSON object: temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens",
    )
    max_model_len: int | None = option(
        None, "the longest prompt plus output, in tokens (default: the model's context length)"
    )
    max_num_seqs: int = option(256, "the most requests running at once")
    max_num_batched_tokens: int | None = option(
        None, "the token budget of one step (default: 2048 on CPU, 8192 on GPU)"
    )
    block_size: int = option(16, "tokens per KV cache block")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = option(
        True, "split long prompts over several steps, beside the running decodes"
    )
    long_prefill_token_threshold: int | None = option(
        None, "the most prompt tokens one request computes per step (0: no cap; default: "
        "512 on CPU with chunked prefill, where it holds for a request alone too; else 0; on "
        "GPU a request alone is exempt)"
    )
    scheduling_policy: str = option(
        "fcfs", "'fcfs' or 'priority' (lower priority values first)"
    )
    enable_prefix_aware_scheduling: bool = option(
        True, "waiting requests whose prefix is cached or being computed go first (bounded: "
        "see SchedulerConfig); off: FCFS",
    )
    preload_prompts: str | list[Any] | None = option(
        None, "declared prefixes (v1/engine/preload.py), computed at start-up and pinned in "
        "the prefix cache: the path of a JSON list of prompts (text, a conversation, or token "
        "ids), or the list itself",
    )
    preload_max_fraction: float = option(
        0.5, "the largest fraction of the KV blocks the preloaded prompts may pin"
    )
    async_scheduling: bool = option(
        False, "schedule step N+1 while step N runs on the device"
    )
    num_gpu_blocks: int | None = option(
        None, "the number of KV cache blocks (default: from kv_cache_memory)"
    )
    kv_cache_memory: int | None = option(
        None, "the KV cache's bytes (default: the device's budget)"
    )
    num_gpu_blocks_override: int | None = option(None, "vLLM's spelling of num_gpu_blocks")
    kv_cache_memory_bytes: int | None = option(None, "vLLM's spelling of kv_cache_memory")
    gpu_memory_utilization: float | None = option(
        None, "on GPU, the fraction of its memory the engine may use, weights included "
        "(default: the KV cache gets 85%% of what is free after loading); unused on CPU",
    )
    device: str = option("auto", "'auto', 'cpu', 'cuda' or 'cuda:N'")
    dtype: str = option(
        "auto", "the weights' and activations' dtype: 'auto' (float32 on CPU, bfloat16 on "
        "GPU), 'float32'/'float', 'bfloat16' or 'float16'/'half'",
    )
    kv_cache_dtype: str = option(
        "auto", "the KV cache's dtype: 'auto' (the model's), 'bfloat16'/'bf16', "
        "'float16'/'fp16' or 'float32'/'fp32'; a 16-bit cache under an fp32 model holds "
        "twice the tokens in the same memory",
    )
    quantization: str | None = option(
        None, "quantized weights, CPU only: 'gguf' (a GGUF file's Q4_1 / Q8_0 blocks as "
        "stored), 'int8' (a float checkpoint quantized to Q8_0 at load) or 'none' (float "
        "weights); default: 'gguf' for a .gguf file with the native kernels built, else none",
    )
    kv_cache_dir: str | None = option(
        None, "the disk tier under the prefix cache: full blocks are kept in this directory "
        "and read back when a prompt's prefix is there, across restarts and processes",
    )
    kv_cache_disk_bytes: int | None = option(
        None, "the disk tier's size bound in bytes (LRU; default: 8 GiB)"
    )
    seed: int = option(0, "the seed of requests that set none")
    runner: str = option(
        "generate", "what the engine does with prompts: 'generate' (sample tokens), 'pooling' "
        "(one vector per prompt: LLM.embed / encode / classify / score, the server's "
        "/v1/embeddings, /pooling, /score, /rerank) or 'auto' (pooling for checkpoints "
        "without an LM head)",
    )
    pooler_config: dict[str, Any] | PoolerConfig | None = option(
        None, "the pooler's settings over the model's, as a JSON object: pooling_type "
        "(LAST, CLS, MEAN), normalize",
    )
    logits_processors: list[Any] | None = option(
        None, "custom logits processors (vLLM's V1 interface, "
        "v1.v1.sample.logits_processor.LogitsProcessor), each a 'module:Class' name (in "
        "Python, the class itself too); a request's `extra_args` reach them",
    )
    reasoning_parser: str | None = option(
        None, "how the model's output splits into reasoning and answer, which the chat API "
        f"returns apart (`reasoning`, `reasoning_content`): {', '.join(REASONING_PARSERS)}. "
        "Structured output still constrains the whole output (which then has no reasoning)",
    )
    speculative_config: dict[str, Any] | None = option(
        None, "speculative decoding, as a JSON object, e.g. {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4} (methods: ngram, suffix)",
    )
    data_parallel_size: int = option(
        1, "engine-core processes, each with its own scheduler, KV cache and share of the "
        "cores, behind one client that routes each request",
    )
    data_parallel_routing: str = option(
        "affinity", "how a request picks a core: 'affinity' (the core most likely to hold "
        "its prompt's cached prefix; a new prefix's home is the core with the least prefix "
        "footprint per block of KV cache; with a load guard), 'round_robin' or 'least_loaded'",
    )
    data_parallel_load_ratio: float = option(
        2.0, "the load guard (affinity): go to the least-loaded core when the affinity core's "
        "load exceeds ratio x the least-loaded's + slack + the cached blocks it would lose",
    )
    data_parallel_load_slack: float = option(8.0, "the load guard's slack (see the ratio)")
    data_parallel_kv_threshold: float = option(
        0.95, "the load guard: leave a core whose KV cache would pass this fraction of its "
        "blocks with the request's uncached blocks, while another's would not"
    )
    data_parallel_size_local: int | None = option(
        None, "of the cores, how many run on this host (default: all); others register "
        "from headless hosts",
    )
    data_parallel_start_rank: int = option(0, "the rank of this host's first core")
    data_parallel_address: str = option(
        "127.0.0.1", "where the frontend listens for headless hosts' cores"
    )
    data_parallel_rpc_port: int = option(29550, "the port of data_parallel_address")
    data_parallel_backend: str = option(
        "mp", "'mp' (this host's cores are local processes) or 'ray' (every core a Ray actor)"
    )
    disable_log_stats: bool = option(
        False, "turn metrics off: no per-request latencies are gathered (the server's "
        "/metrics then shows the engine core's gauges and counters only; LLM.get_metrics() "
        "raises). LLM's default, as in vLLM",
    )
    # vLLM's options that mean nothing here (IGNORED_OPTIONS says why): accepted, and logged.
    enforce_eager: bool = option(False, ignored_help("enforce_eager"))
    trust_remote_code: bool = option(False, ignored_help("trust_remote_code"))
    tensor_parallel_size: int = option(1, ignored_help("tensor_parallel_size"))
    pipeline_parallel_size: int = option(1, ignored_help("pipeline_parallel_size"))
    swap_space: float = option(4.0, ignored_help("swap_space"))
    compilation_config: dict[str, Any] | None = option(None, ignored_help("compilation_config"))
    hf_token: str | None = option(None, ignored_help("hf_token"))
    download_dir: str | None = option(None, ignored_help("download_dir"))
    tokenizer: str | None = option(None, ignored_help("tokenizer"))
    enable_expert_parallel: bool = option(False, ignored_help("enable_expert_parallel"))
    tokenizer_mode: str = option("auto", ignored_help("tokenizer_mode"))
    distributed_executor_backend: str | None = option(
        None, ignored_help("distributed_executor_backend")
    )
    disable_custom_all_reduce: bool = option(False, ignored_help("disable_custom_all_reduce"))
    max_seq_len_to_capture: int = option(8192, ignored_help("max_seq_len_to_capture"))
    task: str = option("auto", ignored_help("task"))
    load_format: str = option("auto", ignored_help("load_format"))
    enable_log_requests: bool = option(False, ignored_help("enable_log_requests"))
    disable_log_requests: bool = option(False, ignored_help("disable_log_requests"))
    tokenizer_revision: str | None = option(None, ignored_help("tokenizer_revision"))
    logprobs_mode: str = option("raw_logprobs", ignored_help("logprobs_mode"))
    skip_tokenizer_init: bool = option(False, ignored_help("skip_tokenizer_init"))
    # What one request may ask for (the frontend checks); the help is `InputLimits`'.
    max_logprobs: int = DEFAULT_LIMITS.max_logprobs
    max_n_sequences: int = DEFAULT_LIMITS.max_n_sequences
    max_stop_strings: int = DEFAULT_LIMITS.max_stop_strings
    max_stop_string_len: int = DEFAULT_LIMITS.max_stop_string_len
    max_num_bad_words: int = DEFAULT_LIMITS.max_num_bad_words
    max_bad_word_len: int = DEFAULT_LIMITS.max_bad_word_len
    max_json_schema_depth: int = DEFAULT_LIMITS.max_json_schema_depth
    max_structured_output_len: int = DEFAULT_LIMITS.max_structured_output_len
    max_structured_output_choices: int = DEFAULT_LIMITS.max_structured_output_choices
    max_chars_per_unbounded_token: int = DEFAULT_LIMITS.max_chars_per_unbounded_token
    max_request_token_ids: int = DEFAULT_LIMITS.max_request_token_ids
    # LoRA adapters (v1/lora): see `LoRAConfig` for the three bounds.
    enable_lora: bool = option(
        False, "requests may name a PEFT LoRA adapter (LoRARequest; the server's --lora-modules)"
    )
    max_loras: int = option(1, "at most this many distinct LoRA adapters in one step")
    max_lora_rank: int = option(16, "the largest LoRA rank an adapter may have")
    max_cpu_loras: int | None = option(
        None, "LoRA adapters kept loaded in memory (LRU; default: max_loras)"
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in IGNORED_OPTIONS:
                check_ignored_option(f.name, getattr(self, f.name), f.default, self)
        model = self.model_config()
        self.dtype, self.pooler_config = model.dtype, model.pooler_config
        self.parallel_config()
        # The model's context length is not known before it loads: the scheduler's and the
        # cache's options are checked here against max_model_len as given (1 if not), and
        # against the model's when the engine builds them.
        self.create_configs(1 if self.max_model_len is None else self.max_model_len, False)
        self.input_limits()
        if self.lora_config() is not None and self.kv_cache_dir is not None:
            # Blocks are keyed by lora_int_id, which names an adapter for one engine's life
            # only: on disk, across restarts, an id could come back naming another adapter.
            raise ValueError("kv_cache_dir (the disk tier) cannot be combined with enable_lora")
        self.speculative()
        self._check_logits_processors()
        if self.reasoning_parser is not None:
            check_choice("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)
        if self.preload_prompts is not None:
            self.preload_prompts = load_preload_prompts(self.preload_prompts)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """vLLM's: a flag for each option (`--max-model-len` for max_model_len), with its
        default and help; returns the parser."""
        return add_engine_args(parser, cls)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """vLLM's: the options of a command line parsed with `add_cli_args`'s flags."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    # -- the groups ------------------------------------------------------------------------

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            model=self.model, revision=self.revision, generation_config=self.generation_config,
            override_generation_config=self.override_generation_config,
            device=self.device, dtype=self.dtype, quantization=self.quantization,
            seed=self.seed, runner=self.runner, pooler_config=self.pooler_config,
            hf_overrides=self.hf_overrides,
        )

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(**{f.name: getattr(self, f.name) for f in fields(ParallelConfig)})

    def speculative(self) -> SpeculativeConfig | None:
        """The validated `speculative_config`, or None when speculation is off."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    def lora_config(self) -> LoRAConfig | None:
        """The validated LoRA bounds, or None when enable_lora is off."""
        if not self.enable_lora:
            return None
        return LoRAConfig(
            self.max_loras, self.max_lora_rank,
            self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras,
        )

    def input_limits(self) -> InputLimits:
        return InputLimits(**{f.name: getattr(self, f.name) for f in fields(InputLimits)})

    def create_configs(
        self, model_max_len: int, on_gpu: bool
    ) -> tuple[SchedulerConfig, CacheConfig]:
        """The scheduler's and the cache's groups for a model of context length
        `model_max_len`, on a GPU or not (the default step budget differs)."""
        max_model_len = model_max_len if self.max_model_len is None else self.max_model_len
        if max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's context length "
                f"{model_max_len} (or the max_model_len it was loaded for)"
            )
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 8192 if on_gpu else 2048
            if not self.enable_chunked_prefill:
                batched = max(batched, max_model_len)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=(
                (CPU_LONG_PREFILL_TOKENS if not on_gpu and self.enable_chunked_prefill else 0)
                if self.long_prefill_token_threshold is None
                else self.long_prefill_token_threshold
            ),
            cap_lone_prefill=not on_gpu,
            policy=self.scheduling_policy,
            async_scheduling=self.async_scheduling,
            enable_prefix_aware_scheduling=self.enable_prefix_aware_scheduling,
            max_loras=self.max_loras if self.enable_lora else 0,
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            num_gpu_blocks=self._either("num_gpu_blocks", "num_gpu_blocks_override"),
            kv_cache_memory=self._either("kv_cache_memory", "kv_cache_memory_bytes"),
            enable_prefix_caching=self.enable_prefix_caching,
            preload_max_fraction=self.preload_max_fraction,
            cache_dtype=self.kv_cache_dtype,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_dir=self.kv_cache_dir,
            kv_cache_disk_bytes=self.kv_cache_disk_bytes,
        )
        return scheduler_config, cache_config

    def _either(self, name: str, vllm_name: str) -> int | None:
        """An option given under our name or vLLM's (both: they must agree). vLLM's spelling
        is checked here, under its name; ours by the group."""
        ours, vllms = getattr(self, name), getattr(self, vllm_name)
        if vllms is not None:
            check_int(vllm_name, vllms)
        if ours is not None and vllms is not None and ours != vllms:
            raise ValueError(f"{name}={ours} and {vllm_name}={vllms} disagree: give one")
        return vllms if ours is None else ours

    def _check_logits_processors(self) -> None:
        """Each entry a class or a "module:Class" name (loaded by the engine); none with
        speculative decoding (a drafted request samples several rows a step, which the
        interface has no way to say)."""
        if not self.logits_processors:
            return
        for spec in self.logits_processors:
            if not isinstance(spec, type) and not (isinstance(spec, str) and ":" in spec):
                raise ValueError(
                    f"logits_processors entries must be classes or 'module:Class' names, "
                    f"got {spec!r}"
                )
        if self.speculative_config is not None:
            raise ValueError("custom logits_processors cannot be combined with "
                             "speculative_config")

    def get_diff_sampling_param(self, model_dir: str | os.PathLike[str]) -> dict[str, Any]:
        """vLLM's: `ModelConfig.get_diff_sampling_param`."""
        return self.model_config().get_diff_sampling_param(model_dir)
