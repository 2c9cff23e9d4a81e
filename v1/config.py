"""Engine configuration, with vLLM's option names. Plain data: every layer may read it."""

import json
import logging
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from v1.limits import DEFAULT_LIMITS, InputLimits

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

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0, "
                f"got {self.long_prefill_token_threshold}"
            )
        for name in ("prefix_aware_window", "prefix_aware_max_skips"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when chunked prefill is off, "
                "or the longest prompt could never be scheduled"
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


# speculative_config's methods (vLLM's names): "ngram", drafts from the request's own tokens
# (prompt lookup); "suffix", drafts from a suffix index over recent requests' prompts and
# outputs (v1.worker.spec_decode.suffix).
SPECULATIVE_METHODS = ("ngram", "suffix")
# The most drafts one step verifies per request: each costs a query row of every layer.
MAX_SPECULATIVE_TOKENS = 64
MAX_SUFFIX_TREE_DEPTH = 256  # vLLM's default is 24


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` for the draft-free methods, with vLLM's keys and defaults.

    ngram: `prompt_lookup_max`/`prompt_lookup_min` bound the n-gram (the request's last n
    tokens) looked up earlier in its own tokens; either defaults to the other, both to 5
    (vLLM's). suffix: the `suffix_decoding_*` keys are `SuffixProposer`'s keywords;
    `num_speculative_tokens` defaults to `suffix_decoding_max_tree_depth` (vLLM's).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    @classmethod
    def from_dict(cls, config: "dict[str, Any] | SpeculativeConfig") -> "SpeculativeConfig":
        """Validates a `speculative_config` dict (ValueError naming the key and its limit)."""
        if not isinstance(config, dict | SpeculativeConfig):
            raise ValueError(f"speculative_config must be a dict, got {config!r}")
        method = config.method if isinstance(config, SpeculativeConfig) else config.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {method!r}"
            )
        if isinstance(config, SpeculativeConfig):  # built directly: checked all the same
            config._validate()
            return config
        prefix = "prompt_lookup_" if method == "ngram" else "suffix_decoding_"
        allowed = {"method", "num_speculative_tokens"} | {
            f.name for f in fields(cls) if f.name.startswith(prefix)
        }
        unknown = set(config) - allowed
        if unknown:
            raise ValueError(
                f"unknown speculative_config keys for method {method!r}: {sorted(unknown)} "
                f"(known: {sorted(allowed)})"
            )
        values = dict(config)
        if method == "suffix":
            values.setdefault(
                "num_speculative_tokens",
                values.get("suffix_decoding_max_tree_depth", 24),
            )
        elif "num_speculative_tokens" not in values:
            raise ValueError("speculative_config needs num_speculative_tokens for method 'ngram'")
        spec = cls(**values)
        spec._validate()
        return spec

    def _validate(self) -> None:
        def check_int(name: str, low: int, high: int | None = None) -> None:
            value = getattr(self, name)
            if (
                not isinstance(value, int) or isinstance(value, bool) or value < low
                or (high is not None and value > high)
            ):
                bound = f">= {low}" if high is None else f"in [{low}, {high}]"
                raise ValueError(f"speculative_config {name} must be an integer {bound}, "
                                 f"got {value!r}")

        check_int("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        if self.method == "ngram":
            if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
                self.prompt_lookup_min = self.prompt_lookup_max = 5
            elif self.prompt_lookup_min is None:
                self.prompt_lookup_min = self.prompt_lookup_max
            elif self.prompt_lookup_max is None:
                self.prompt_lookup_max = self.prompt_lookup_min
            check_int("prompt_lookup_min", 1)
            check_int("prompt_lookup_max", 1)
            assert self.prompt_lookup_min is not None and self.prompt_lookup_max is not None
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(
                    f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must be "
                    f"<= prompt_lookup_max ({self.prompt_lookup_max})"
                )
        else:
            # A draft's cost grows with the depth (candidates per match length).
            check_int("suffix_decoding_max_tree_depth", 1, MAX_SUFFIX_TREE_DEPTH)
            check_int("suffix_decoding_max_cached_requests", 0)
            factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
            if not isinstance(factor, int | float) or not 0 < factor < math.inf:
                raise ValueError(
                    "speculative_config suffix_decoding_max_spec_factor must be finite and > 0, "
                    f"got {factor!r}"
                )
            if not isinstance(prob, int | float) or not 0 <= prob <= 1:
                raise ValueError(
                    f"speculative_config suffix_decoding_min_token_prob must be in [0, 1], "
                    f"got {prob!r}"
                )


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


@dataclass(slots=True)
class EngineArgs:
    """The user-facing engine options, named as vLLM names them."""

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct, GGUF)
    # With a hub id as `model`: the branch, tag or commit to find in the local HF cache.
    revision: str | None = None
    # Where requests' default sampling parameters come from: "auto", the model's
    # generation_config.json; "vllm", vLLM's own (SamplingParams' defaults); or a directory
    # holding a generation_config.json.
    generation_config: str = "auto"
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 2048 on CPU, 8192 on GPU
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    # Waiting requests whose prefix is cached or being computed go first (bounded: see
    # SchedulerConfig.enable_prefix_aware_scheduling); --no-enable-prefix-aware-scheduling: FCFS.
    enable_prefix_aware_scheduling: bool = True
    # Declared prefixes (v1/engine/preload.py): prompts computed at start-up whose full
    # blocks are pinned in the prefix cache, never evicted: a list of prompts (text, a
    # conversation as a list of messages, or token ids), or the path of a JSON file holding
    # one (--preload-prompts FILE). They may pin at most preload_max_fraction of the blocks.
    preload_prompts: str | list[Any] | None = None
    preload_max_fraction: float = 0.5
    async_scheduling: bool = False
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes
    # vLLM's spellings of the two above, accepted as they mean the same.
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    # On GPU, the fraction of its memory the engine may use, the weights included (None:
    # the KV cache gets 85% of what is free after loading). Accepted, and unused, on CPU.
    gpu_memory_utilization: float | None = None
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    # The KV cache's dtype: "auto" (the model's), "bfloat16"/"bf16", "float16"/"fp16" or
    # "float32"/"fp32". A 16-bit cache under an fp32 model halves the cache's memory (twice
    # the tokens in the same kv_cache_memory); attention reads it back into fp32.
    kv_cache_dtype: str = "auto"
    # Quantized weights (vLLM's option), CPU only: one of QUANTIZATION_METHODS, "none" (float
    # weights, a GGUF file's dequantized), or None: as vLLM, "gguf" for a .gguf file (on CPU
    # in float32 with the native kernels built; v1.models.loader.resolve_quantization), else
    # float weights.
    quantization: str | None = None
    # The disk tier under the RAM prefix cache (v1/worker/kv_disk_store.py): full blocks
    # are kept in kv_cache_dir (in a subdirectory per model and KV setting), at most
    # kv_cache_disk_bytes of them (LRU; None: DEFAULT_KV_CACHE_DISK_BYTES), and read back
    # when a prompt's prefix is there, across restarts and by other processes.
    kv_cache_dir: str | None = None
    kv_cache_disk_bytes: int | None = None
    seed: int = 0
    # What the engine does with prompts (RUNNER_TYPES): "generate" (the default), "pooling"
    # (LLM.embed / encode / classify / score; the server's /v1/embeddings, /pooling, /score,
    # /rerank) or "auto". A pooling engine runs prompts only, never async_scheduling.
    runner: str = "generate"
    # The pooler's settings over the model's (PoolerConfig's keys); None: the model's.
    pooler_config: dict[str, Any] | PoolerConfig | None = None
    # Speculative decoding (vLLM's option): a dict as `SpeculativeConfig` reads it, e.g.
    # {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}; None: off.
    speculative_config: dict[str, Any] | None = None
    # Data parallelism (v1.engine.dp_client): this many engine-core processes, each with its
    # own scheduler and KV cache (num_gpu_blocks / kv_cache_memory are per core) and its
    # share of the CPU cores as torch threads, behind one client that routes each request.
    data_parallel_size: int = 1
    # How: "affinity" (to the core most likely to hold the prompt's longest cached prefix,
    # by its chained block hashes; rendezvous hashing of the first block for new prefixes),
    # "round_robin" or "least_loaded".
    data_parallel_routing: str = "affinity"
    # The load guard (affinity only): a request goes to the least-loaded core instead when
    # its affinity core's load score (4 x waiting + running requests) exceeds
    # ratio x the least-loaded's + slack, or its KV cache usage has reached kv_threshold
    # while another core's has not. See v1/engine/dp_router.py for why these defaults.
    data_parallel_load_ratio: float = 2.0
    data_parallel_load_slack: float = 8.0
    data_parallel_kv_threshold: float = 0.95
    # Cores on other hosts (v1/engine/dp_headless.py, vLLM's flags): this host runs
    # data_parallel_size_local of the cores (None: all), ranks from data_parallel_start_rank;
    # the frontend listens for the others' registration at
    # tcp://data_parallel_address:data_parallel_rpc_port, where headless hosts connect.
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 29550
    # "mp": this host's cores are local processes (and any others headless); "ray": every
    # core is a Ray actor, placed by Ray on the cluster `ray.init()` finds (v1/engine/dp_ray.py).
    data_parallel_backend: str = "mp"
    # What one request may ask for (the frontend checks; see `InputLimits` for each).
    max_logprobs: int = DEFAULT_LIMITS.max_logprobs
    max_n_sequences: int = DEFAULT_LIMITS.max_n_sequences
    max_stop_strings: int = DEFAULT_LIMITS.max_stop_strings
    max_stop_string_len: int = DEFAULT_LIMITS.max_stop_string_len
    max_num_bad_words: int = DEFAULT_LIMITS.max_num_bad_words
    max_bad_word_len: int = DEFAULT_LIMITS.max_bad_word_len
    max_json_schema_depth: int = DEFAULT_LIMITS.max_json_schema_depth
    max_structured_output_len: int = DEFAULT_LIMITS.max_structured_output_len
    max_structured_output_choices: int = DEFAULT_LIMITS.max_structured_output_choices

    def __post_init__(self) -> None:
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
        if self.runner not in RUNNER_TYPES:
            raise ValueError(
                f"runner must be one of {', '.join(RUNNER_TYPES)}, got {self.runner!r}"
            )
        if self.pooler_config is not None:
            self.pooler_config = PoolerConfig.from_dict(self.pooler_config)
            if self.runner == "generate":
                raise ValueError("pooler_config needs runner='pooling' (or 'auto')")
        kv_cache_dtype_name(self.kv_cache_dtype)  # fail before the model loads
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
        self.speculative()  # likewise a bad speculative_config
        if self.preload_prompts is not None:
            self.preload_prompts = load_preload_prompts(self.preload_prompts)
        gen = self.generation_config
        if gen not in ("auto", "vllm") and not Path(gen).expanduser().is_dir():
            raise ValueError(
                "generation_config must be 'auto', 'vllm' or a directory holding a "
                f"generation_config.json, got {gen!r}"
            )

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
