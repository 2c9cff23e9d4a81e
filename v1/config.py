"""Engine configuration, with vLLM's option names. Plain data: every layer may read it."""

import argparse
import json
import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from v1.cli_args import add_engine_args
from v1.ignored_options import IGNORED_OPTIONS, check_ignored_option, ignored_help
from v1.limits import DEFAULT_LIMITS, InputLimits
from v1.speculative_config import SpeculativeConfig

logger = logging.getLogger("v1")

# generation_config.json's keys that become default sampling parameters (vLLM's list), and
# the SamplingParams field each sets.
GENERATION_CONFIG_DEFAULTS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


# How a data-parallel client picks an engine core for each request (EngineArgs'
# data_parallel_routing; v1.engine.dp_router).
DP_ROUTING_POLICIES = ("affinity", "round_robin", "least_loaded")

# quantization's choices (EngineArgs; v1.models.loader): "gguf" runs a GGUF file's Q4_1 /
# Q8_0 blocks as stored, "int8" quantizes a float checkpoint's weight matrices to Q8_0 at load.
QUANTIZATION_METHODS = ("gguf", "int8")
# EngineArgs.quantization's value for float weights, a GGUF file's too (its dequantized copy).
NO_QUANTIZATION = "none"

# kv_cache_dtype's accepted spellings -> the dtype's name ("auto": the model's dtype).
KV_CACHE_DTYPES = {
    "auto": "auto",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16",
    "float32": "float32", "fp32": "float32",
}


# dtype's accepted spellings (vLLM's: "half", "float") -> the torch dtype's name. A
# torch.dtype is taken too (`LLM(dtype=torch.float16)`), by that name.
DTYPES = {
    "auto": "auto",
    "bfloat16": "bfloat16",
    "float16": "float16", "half": "float16",
    "float32": "float32", "float": "float32",
}


def dtype_name(dtype: Any) -> str:
    """The canonical name of a dtype spelling ("half" -> "float16", torch.float32 ->
    "float32"); ValueError for others."""
    spelling = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    name = DTYPES.get(spelling)
    if name is None:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return name


# device's accepted values ("cuda:N" too).
DEVICES = ("auto", "cpu", "cuda")


def check_device(device: str) -> None:
    if not isinstance(device, str) or (
        device not in DEVICES and not (device.startswith("cuda:") and device[5:].isdigit())
    ):
        raise ValueError(f"device must be one of {', '.join(DEVICES)} or 'cuda:N', got {device!r}")


def check_positive_ints(options: Any, required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    """ValueError naming the first option of `required` that is not an integer >= 1, or of
    `optional` that is neither that nor None."""
    for name in required + optional:
        value = getattr(options, name)
        if value is None and name in optional:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


SCHEDULING_POLICIES = ("fcfs", "priority")


def kv_cache_dtype_name(kv_cache_dtype: str) -> str:
    """The canonical name of a kv_cache_dtype spelling ("bf16" -> "bfloat16"); ValueError
    for others (fp8 among them: no kernel here reads it)."""
    name = KV_CACHE_DTYPES.get(kv_cache_dtype)
    if name is None:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return name


# kv_cache_disk_bytes when kv_cache_dir is given alone.
DEFAULT_KV_CACHE_DISK_BYTES = 8 << 30


def check_kv_cache_dir(path: str) -> Path:
    """The disk tier's directory, created if need be; ValueError naming it when it cannot be
    written."""
    root = Path(path).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"kv_cache_dir {path!r} cannot be created: {e}") from e
    if not root.is_dir() or not os.access(root, os.W_OK | os.X_OK):
        raise ValueError(f"kv_cache_dir {path!r} is not a writable directory")
    return root


def cache_root() -> Path:
    """Where converted weights and built kernels are kept: $V1_CACHE_DIR, else ~/.cache/v1."""
    return Path(os.environ.get("V1_CACHE_DIR") or Path.home() / ".cache" / "v1").expanduser()


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    # Caps one request's prefill chunk per step (0: no cap) so several prompts progress.
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"  # "fcfs" | "priority"
    async_scheduling: bool = False
    # Prefix-aware admission (v1/core/sched/prefix_aware.py; SGLang's cache-aware policy,
    # bounded): among the first `prefix_aware_window` waiting requests, those with the
    # longest prefix cached or being computed go first, and one whose next uncached block a
    # running request is computing waits for it. A request passed over (or deferred) in
    # `prefix_aware_max_skips` steps makes admission FCFS until it is admitted. Under the
    # priority policy only requests tied with the head's priority are reordered. Needs
    # prefix caching (a no-op without it).
    enable_prefix_aware_scheduling: bool = True
    prefix_aware_window: int = 32
    prefix_aware_max_skips: int = 16
    # LoRA (EngineArgs.enable_lora): at most this many distinct adapters in one step (vLLM's
    # rule: a waiting request of another adapter waits); 0: LoRA off.
    max_loras: int = 0

    def __post_init__(self) -> None:
        check_positive_ints(
            self,
            ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "prefix_aware_window",
             "prefix_aware_max_skips"),
            (),
        )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0, "
                f"got {self.long_prefill_token_threshold}"
            )
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when chunked prefill is off, "
                "or the longest prompt could never be scheduled"
            )


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """LoRA serving (vLLM's options): `max_loras` adapters run in one step (the GPU slots),
    each of rank <= `max_lora_rank`; `max_cpu_loras` (>= max_loras) stay loaded in memory,
    least recently used evicted beyond that."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: derive from kv_cache_memory
    kv_cache_memory: int | None = None  # bytes; None: the device's default budget
    enable_prefix_caching: bool = True
    # Declared prefixes (`--preload-prompts`) may pin at most this fraction of the blocks.
    preload_max_fraction: float = 0.5
    # What the KV cache stores (vLLM's name): "auto" (the model's dtype), "bfloat16",
    # "float16" or "float32"; any spelling of KV_CACHE_DTYPES, kept canonical.
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        self.cache_dtype = kv_cache_dtype_name(self.cache_dtype)
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if not 0 < self.preload_max_fraction <= 1:
            raise ValueError(
                f"preload_max_fraction must be in (0, 1], got {self.preload_max_fraction}"
            )
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")


# EngineArgs.runner's choices (vLLM's): "generate" samples tokens; "pooling" returns one
# vector per prompt (embeddings, classification, scores: v1/models/pooler.py); "auto" is
# "pooling" for checkpoints that have no LM head (an encoder, a base `*Model`, a
# `*ForSequenceClassification`), else "generate".
RUNNER_TYPES = ("auto", "generate", "pooling")


@dataclass(slots=True)
class PoolerConfig:
    """vLLM's `pooler_config` (`--pooler-config '{"pooling_type": "MEAN"}'`): overrides the
    pooler the model's files give (v1/models/pooler.py); None keeps theirs."""

    pooling_type: str | None = None  # "LAST" | "CLS" | "MEAN"
    normalize: bool | None = None

    @classmethod
    def from_dict(cls, config: "dict[str, Any] | PoolerConfig") -> "PoolerConfig":
        if isinstance(config, PoolerConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"pooler_config must be a dict, got {config!r}")
        unknown = set(config) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(
                f"unknown pooler_config keys {sorted(unknown)} (known: normalize, pooling_type)"
            )
        pooling_type = config.get("pooling_type")
        if pooling_type is not None and pooling_type not in ("LAST", "CLS", "MEAN"):
            raise ValueError(
                f"pooler_config pooling_type must be LAST, CLS or MEAN, got {pooling_type!r}"
            )
        normalize = config.get("normalize")
        if normalize is not None and not isinstance(normalize, bool):
            raise ValueError(f"pooler_config normalize must be a bool, got {normalize!r}")
        return cls(pooling_type, normalize)


def load_preload_prompts(spec: str | list[Any]) -> list[Any]:
    """The prompts of `preload_prompts` (v1/engine/preload.py): a list, or the path of a JSON
    file holding one, read here so that a bad one fails before the model loads."""
    if isinstance(spec, str):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ValueError(
                f"preload_prompts: {spec!r} is not a file (give the path of a JSON list of "
                "prompts, or a list of prompts)"
            )
        try:
            spec = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"preload_prompts: cannot read {spec}: {e}") from e
    if not isinstance(spec, list):
        raise ValueError(f"preload_prompts must be a list of prompts, got {type(spec).__name__}")
    return spec


def option(default: Any, help: str) -> Any:
    """An EngineArgs field: its default and its command-line help."""
    return field(default=default, metadata={"help": help})


@dataclass(slots=True)
class EngineArgs:
    """The user-facing engine options, named as vLLM names them. Each field's `help` is its
    command-line help (`add_cli_args`: `--max-model-len` for `max_model_len`); the options
    in `IGNORED_OPTIONS` are vLLM's that mean nothing here (see v1/ignored_options.py)."""

    model: str | None = option(
        None, "a GGUF file, an HF model directory, or a hub id in the local HF cache "
        "(default: SmolLM2-135M-Instruct, GGUF)",
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
    long_prefill_token_threshold: int = option(
        0, "the most prompt tokens one request computes per step (0: no cap)"
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
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise ValueError(
                f"data_parallel_size must be an integer >= 1, got {self.data_parallel_size!r}"
            )
        if self.data_parallel_routing not in DP_ROUTING_POLICIES:
            raise ValueError(
                f"data_parallel_routing must be one of {', '.join(DP_ROUTING_POLICIES)}, "
                f"got {self.data_parallel_routing!r}"
            )
        if self.data_parallel_load_ratio < 1 or self.data_parallel_load_slack < 0:
            raise ValueError(
                "data_parallel_load_ratio must be >= 1 and data_parallel_load_slack >= 0, got "
                f"{self.data_parallel_load_ratio} and {self.data_parallel_load_slack}"
            )
        local, start = self.data_parallel_size_local, self.data_parallel_start_rank
        if local is not None and not 0 <= local <= self.data_parallel_size:
            raise ValueError(
                f"data_parallel_size_local must be in [0, data_parallel_size "
                f"{self.data_parallel_size}], got {local}"
            )
        if not 0 <= start or start + (local or 0) > self.data_parallel_size:
            raise ValueError(
                f"data_parallel_start_rank {start} + data_parallel_size_local {local} exceeds "
                f"data_parallel_size {self.data_parallel_size}"
            )
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(
                f"data_parallel_backend must be 'mp' or 'ray', got {self.data_parallel_backend!r}"
            )
        if self.data_parallel_backend == "ray" and local is not None:
            raise ValueError("data_parallel_size_local is for the mp backend: Ray places cores")
        if not 0 < self.data_parallel_rpc_port < 65536:
            raise ValueError(f"data_parallel_rpc_port must be a TCP port, got "
                             f"{self.data_parallel_rpc_port}")
        if not 0 < self.data_parallel_kv_threshold <= 1:
            raise ValueError(
                "data_parallel_kv_threshold must be in (0, 1], got "
                f"{self.data_parallel_kv_threshold}"
            )
        # The scheduler's and cache's options fail here, before the model loads (the
        # configs are made once the model's context length is known).
        check_positive_ints(
            self, ("max_num_seqs", "block_size"),
            ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks", "kv_cache_memory",
             "num_gpu_blocks_override", "kv_cache_memory_bytes"),
        )
        if not isinstance(self.long_prefill_token_threshold, int) or (
            self.long_prefill_token_threshold < 0
        ):
            raise ValueError(
                "long_prefill_token_threshold must be an integer >= 0, "
                f"got {self.long_prefill_token_threshold!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if not 0 < self.preload_max_fraction <= 1:
            raise ValueError(
                f"preload_max_fraction must be in (0, 1], got {self.preload_max_fraction}"
            )
        check_device(self.device)
        self.dtype = dtype_name(self.dtype)
        kv_cache_dtype_name(self.kv_cache_dtype)
        if self.runner not in RUNNER_TYPES:
            raise ValueError(
                f"runner must be one of {', '.join(RUNNER_TYPES)}, got {self.runner!r}"
            )
        if self.pooler_config is not None:
            self.pooler_config = PoolerConfig.from_dict(self.pooler_config)
            if self.runner == "generate":
                raise ValueError("pooler_config needs runner='pooling' (or 'auto')")
        self._check_disk_tier()
        if self.quantization not in (None, NO_QUANTIZATION, *QUANTIZATION_METHODS):
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                f"{NO_QUANTIZATION!r} or None, got {self.quantization!r}"
            )
        utilization = self.gpu_memory_utilization
        if utilization is not None and not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        self.input_limits()  # a bad limit fails here, before anything starts
        self.lora_config()  # likewise bad LoRA bounds
        if self.enable_lora and self.kv_cache_dir is not None:
            # Blocks are keyed by lora_int_id, which names an adapter for one engine's life
            # only: on disk, across restarts, an id could come back naming another adapter.
            raise ValueError("kv_cache_dir (the disk tier) cannot be combined with enable_lora")
        self.speculative()  # likewise a bad speculative_config
        if self.preload_prompts is not None:
            self.preload_prompts = load_preload_prompts(self.preload_prompts)
        gen = self.generation_config
        if gen not in ("auto", "vllm") and not Path(gen).expanduser().is_dir():
            raise ValueError(
                "generation_config must be 'auto', 'vllm' or a directory holding a "
                f"generation_config.json, got {gen!r}"
            )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """vLLM's: a flag for each option (`--max-model-len` for max_model_len), with its
        default and help; returns the parser."""
        return add_engine_args(parser, cls)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """vLLM's: the options of a command line parsed with `add_cli_args`'s flags."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def _check_disk_tier(self) -> None:
        disk_bytes = self.kv_cache_disk_bytes
        if self.kv_cache_dir is None:
            if disk_bytes is not None:
                raise ValueError("kv_cache_disk_bytes needs kv_cache_dir")
            return
        if disk_bytes is not None and (
            not isinstance(disk_bytes, int) or isinstance(disk_bytes, bool) or disk_bytes < 1
        ):
            raise ValueError(f"kv_cache_disk_bytes must be an integer >= 1, got {disk_bytes!r}")
        if not self.enable_prefix_caching:
            raise ValueError("kv_cache_dir (the disk tier) needs enable_prefix_caching")
        check_kv_cache_dir(self.kv_cache_dir)

    def disk_bytes(self) -> int:
        """The disk tier's byte bound (kv_cache_dir given)."""
        return self.kv_cache_disk_bytes or DEFAULT_KV_CACHE_DISK_BYTES

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

    def get_diff_sampling_param(self, model_dir: str | os.PathLike[str]) -> dict[str, Any]:
        """vLLM's: the default sampling parameters the model's creator recommends, for
        requests that do not set them: generation_config.json's temperature, top_p, top_k,
        min_p, repetition_penalty and max_new_tokens (as max_tokens), as SamplingParams
        keywords. Read from `model_dir` (the loaded model's HF directory) under "auto", from
        the given directory under a path; nothing under "vllm" or without the file."""
        if self.generation_config == "vllm":
            return {}
        folder = model_dir if self.generation_config == "auto" else self.generation_config
        file = Path(folder).expanduser() / "generation_config.json"
        try:
            config = json.loads(file.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {file}: {e}") from e
        defaults = {
            ours: config[key]
            for key, ours in GENERATION_CONFIG_DEFAULTS.items()
            if isinstance(config, dict) and config.get(key) is not None
        }
        if defaults:
            logger.info(
                "default sampling parameters from %s, for requests that do not set them: %s "
                "(generation_config='vllm' / --generation-config vllm turns this off)",
                file, defaults,
            )
        return defaults

    def _either(self, name: str, vllm_name: str) -> int | None:
        """An option given under our name or vLLM's (both: they must agree)."""
        ours, vllms = getattr(self, name), getattr(self, vllm_name)
        if ours is not None and vllms is not None and ours != vllms:
            raise ValueError(f"{name}={ours} and {vllm_name}={vllms} disagree: give one")
        return vllms if ours is None else ours

    def create_configs(
        self, model_max_len: int, on_gpu: bool
    ) -> tuple[SchedulerConfig, CacheConfig]:
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's context length {model_max_len}"
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
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.scheduling_policy,
            async_scheduling=self.async_scheduling,
            enable_prefix_aware_scheduling=self.enable_prefix_aware_scheduling,
            max_loras=self.max_loras if self.enable_lora else 0,
        )
        kv_cache_memory = self._either("kv_cache_memory", "kv_cache_memory_bytes")
        if kv_cache_memory is None and on_gpu and self.gpu_memory_utilization is not None:
            kv_cache_memory = _gpu_kv_cache_budget(self.gpu_memory_utilization)
        cache_config = CacheConfig(
            block_size=self.block_size,
            num_gpu_blocks=self._either("num_gpu_blocks", "num_gpu_blocks_override"),
            kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=self.enable_prefix_caching,
            preload_max_fraction=self.preload_max_fraction,
            cache_dtype=self.kv_cache_dtype,
        )
        return scheduler_config, cache_config


def _gpu_kv_cache_budget(utilization: float) -> int:
    """vLLM's gpu_memory_utilization: the KV cache gets what the weights (loaded by now) and
    everything else on the GPU leave of `utilization` of its memory."""
    import torch  # here only: this module is plain data otherwise

    free, total = torch.cuda.mem_get_info()
    return int(total * utilization) - (total - free)
