"""The speculative-decoding group: vLLM's `speculative_config` for the draft-free methods, as
`EngineArgs.speculative()` validates it and the model runner's proposers read it."""

import math
from dataclasses import dataclass, fields
from typing import Any

from v1.config import checks

# speculative_config's methods (vLLM's names): "ngram", drafts from the request's own tokens
# (prompt lookup); "suffix", drafts from a suffix index over recent requests' prompts and
# outputs (v1.worker.spec_decode.suffix).
SPECULATIVE_METHODS = ("ngram", "suffix")
# The most drafts one step verifies per request: each costs a query row of every layer.
MAX_SPECULATIVE_TOKENS = 64
MAX_SUFFIX_TREE_DEPTH = 256  # vLLM's default is 24
# The suffix method's shared tree holds at most this many tokens (~190 MB): v1's own key,
# as vLLM bounds it by requests only (see SuffixProposer).
DEFAULT_SUFFIX_MAX_CACHED_TOKENS = 1_000_000


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` for the draft-free methods, with vLLM's keys and defaults.

    ngram: `prompt_lookup_max`/`prompt_lookup_min` bound the n-gram (the request's last n
    tokens) looked up earlier in its own tokens; either defaults to the other, both to 5
    (vLLM's). suffix: the `suffix_decoding_*` keys are `SuffixProposer`'s keywords;
    `num_speculative_tokens` defaults to `suffix_decoding_max_tree_depth` (vLLM's);
    `suffix_decoding_max_cached_tokens` is v1's own (vLLM has no bound in tokens).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_tokens: int = DEFAULT_SUFFIX_MAX_CACHED_TOKENS

    @classmethod
    def from_dict(cls, config: "dict[str, Any] | SpeculativeConfig") -> "SpeculativeConfig":
        """Validates a `speculative_config` dict (ValueError naming the key and its limit)."""
        if not isinstance(config, dict | SpeculativeConfig):
            raise ValueError(f"speculative_config must be a dict, got {config!r}")
        method = config.method if isinstance(config, SpeculativeConfig) else config.get("method")
        checks.check_choice("speculative_config method", method, SPECULATIVE_METHODS)
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
            checks.check_int(f"speculative_config {name}", getattr(self, name), low, high)

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
            check_int("suffix_decoding_max_cached_tokens", 0)
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
