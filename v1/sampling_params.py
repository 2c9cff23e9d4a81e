"""Sampling parameters, validated on construction like vLLM's."""

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop.

    `temperature == 0` means greedy. `top_k` of 0 (or -1) and `top_p` of 1 disable those
    filters. `stop` strings are applied by the output processor; `stop_token_ids`, EOS,
    `max_tokens` and `min_tokens` by the scheduler.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Filled in by the processor from the tokenizer's EOS and `stop_token_ids`; the scheduler
    # checks membership once per generated token, so it is a set.
    all_stop_token_ids: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        # A union, not a reset: decoding a message re-runs __post_init__ on a copy whose
        # processor already added the model's further end-of-text ids.
        self.all_stop_token_ids = set(self.stop_token_ids) | set(self.all_stop_token_ids)

    def _verify(self) -> None:
        def bad(name: str, value: object, limit: str) -> ValueError:
            return ValueError(f"{name} must be {limit}, got {value!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if not is_num(self.temperature) or not 0.0 <= self.temperature < float("inf"):
            raise bad("temperature", self.temperature, "a finite number >= 0")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", self.top_k, "0 or -1 (disabled) or a positive integer")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", self.seed, "an integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", self.stop, "a non-empty string or a list of non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", self.logprobs, "an integer >= 0 or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
