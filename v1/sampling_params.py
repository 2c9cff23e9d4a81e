"""Sampling parameters, validated on construction like vLLM's."""

import copy
import enum
import math
from dataclasses import dataclass, field
from typing import Any

from v1.config.limits import INT64_MAX, INT64_MIN, InputLimits, check_json_spec, check_text

_GREEDY_EPS = 1e-5
_INF = float("inf")
_FLOAT32_MAX = 3.4028234663852886e38  # a larger bias is +inf in the fp32 logits: NaN sampling


class RequestOutputKind(enum.Enum):
    """What each of a request's `RequestOutput`s carries (vLLM's `SamplingParams.output_kind`).

    CUMULATIVE: every output holds everything generated so far (vLLM's default, for
    `LLMEngine` and `AsyncLLM`). DELTA: only the tokens and text new since the previous
    output (streaming). FINAL_ONLY: one output, when the request finishes (`LLM.generate`
    sets it).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2

    def __repr__(self) -> str:  # as written in code, so that a SamplingParams' repr evaluates
        return f"RequestOutputKind.{self.name}"


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's: constrain the output to exactly one of a JSON schema (`json`, a dict or its
    text), any JSON object (`json_object`), a regular expression, one of the `choice`
    strings, an EBNF `grammar` (xgrammar's dialect), or a `structural_tag` (xgrammar's JSON
    format: free text in which, once a trigger appears, a tagged part must follow its
    schema; e.g. tool calls). `disable_any_whitespace` (vLLM's): a JSON schema's output
    without whitespace between its tokens; the default here (vLLM's is False: any
    whitespace, in which a small model can loop)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
            if getattr(self, name) not in (None, False)
        ]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, "
                f"json_object or structural_tag, got {given or 'none'}"
            )
        if self.choice is not None and not (
            isinstance(self.choice, list) and self.choice
            and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(f"choice must be a list of non-empty strings, got {self.choice!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                f"disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}"
            )

    def check_limits(self, limits: InputLimits) -> None:
        """The size (and, for JSON, the depth) limits of whichever spec this holds."""
        if self.json is not None:
            check_json_spec(self.json, "structured_outputs.json", limits)
        elif self.structural_tag is not None:
            check_json_spec(self.structural_tag, "structured_outputs.structural_tag", limits)
        elif self.choice is not None:
            if len(self.choice) > limits.max_structured_output_choices:
                raise ValueError(
                    f"structured_outputs.choice has {len(self.choice)} strings, more than "
                    f"max_structured_output_choices ({limits.max_structured_output_choices})"
                )
            _check_spec_len(sum(map(len, self.choice)), "structured_outputs.choice", limits)
        else:
            for name in ("regex", "grammar"):
                spec = getattr(self, name)
                if spec is not None:
                    _check_spec_len(len(spec), f"structured_outputs.{name}", limits)


def _are_token_ids(values: Any) -> bool:
    """Whether every value is an int (not a bool) >= 0. Plain ints, the usual case, are
    checked at C speed (a list of 256k ids: ~10 ms, not ~50 ms); any other type goes the
    per-element way, which accepts int subclasses too."""
    if set(map(type, values)) <= {int}:
        return min(values, default=0) >= 0
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in values)


def _check_spec_len(length: int, what: str, limits: InputLimits) -> None:
    if length > limits.max_structured_output_len:
        raise ValueError(
            f"{what} has {length} characters, more than max_structured_output_len "
            f"({limits.max_structured_output_len})"
        )


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop.

    `temperature == 0` means greedy. `top_k` of 0 (or -1) and `top_p` of 1 disable those
    filters. `stop` strings are applied by the output processor; `stop_token_ids`, EOS,
    `max_tokens` and `min_tokens` by the scheduler.

    The logits processors follow vLLM: `presence_penalty` and `frequency_penalty` count the
    output tokens, `repetition_penalty` the prompt's and the output's (divides a positive
    logit, multiplies a negative one); `logit_bias` adds to token ids' logits;
    `allowed_token_ids` restricts sampling to those ids; `bad_words` are never completed
    (the processor tokenizes them into `bad_words_token_ids`). `structured_outputs` masks
    every sampled token to what its grammar allows. `extra_args` (vLLM's): arguments for the
    engine's custom logits processors, which read them (JSON-like values: they cross to the
    engine core in its messages).
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
    # vLLM's: per prompt token (but the first), its logprob and the top-k; 0 gives its own only.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: False leaves the outputs' text empty (token ids only; no stop strings then).
    detokenize: bool = True
    # vLLM's; as there with a fast tokenizer (always here), it changes nothing.
    spaces_between_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None
    # Filled in by the processor: each bad word's token ids, with and without a leading space.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Filled in by the processor from the tokenizer's EOS and `stop_token_ids`; the scheduler
    # checks membership once per generated token, so it is a set.
    all_stop_token_ids: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:  # checked here: list() of it would be a TypeError naming nothing
            raise ValueError(
                f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}"
            )
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise ValueError(
                f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}"
            )
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1 and not isinstance(self.seed, bool):  # vLLM's: -1 is no seed
            self.seed = None
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(
                f"output_kind must be a RequestOutputKind ("
                f"{', '.join(k.name for k in RequestOutputKind)}), got {self.output_kind!r}"
            )
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

        # What the engine core's messages carry: an int64 (a larger one fails to serialize).
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs",
                     "prompt_logprobs"):
            value = getattr(self, name)
            if is_int(value) and not INT64_MIN <= value <= INT64_MAX:
                raise bad(name, value, "an int64 (from -2**63 to 2**63 - 1)")
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
        if self.stop and not self.detokenize:
            raise bad("stop", self.stop, "empty with detokenize=False (stop strings are text)")
        for i, s in enumerate(self.stop):
            check_text(s, f"stop[{i}]")
        if not _are_token_ids(self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise bad(name, value, "an integer >= 0 or None")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_num(value) or not -2.0 <= value <= 2.0:
                raise bad(name, value, "in [-2, 2]")
        if not is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty < _INF:
            raise bad("repetition_penalty", self.repetition_penalty, "a finite number > 0")
        if self.logit_bias is not None and not (
            isinstance(self.logit_bias, dict)
            and _are_token_ids(self.logit_bias)
            # Unbounded below, as vLLM's (-inf bans a token); the server clamps to OpenAI's
            # +-100.
            and all(is_num(b) and -_INF <= b <= _FLOAT32_MAX for b in self.logit_bias.values())
        ):
            raise bad("logit_bias", self.logit_bias,
                      f"a dict of token id -> bias (a number <= {_FLOAT32_MAX:.7g}, not NaN)")
        if self.allowed_token_ids is not None and not (
            isinstance(self.allowed_token_ids, list)
            and self.allowed_token_ids
            and _are_token_ids(self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids")
        if self.bad_words is not None and not (
            isinstance(self.bad_words, list)
            and all(isinstance(w, str) and w.strip() for w in self.bad_words)
        ):
            raise bad("bad_words", self.bad_words, "a list of non-blank strings")
        for i, word in enumerate(self.bad_words or ()):
            check_text(word, f"bad_words[{i}]")
        if self.extra_args is not None and not (
            isinstance(self.extra_args, dict) and all(isinstance(k, str) for k in self.extra_args)
        ):
            raise bad("extra_args", self.extra_args, "a dict with string keys")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs this request's token counts."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self) -> "SamplingParams":
        """vLLM's: a deep copy, to change without touching this one (its lists too)."""
        return copy.deepcopy(self)


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's parameters of `LLM.beam_search` (see `v1.beam_search`), validated on
    construction: keep the `beam_width` best sequences, extended one token per step, for at
    most `max_tokens` steps.

    `ignore_eos` lets a beam go on past an end-of-text token; `temperature` is that of each
    step's one-token request (as vLLM: at 0 the candidates are exactly each beam's top
    2 * beam_width tokens; above 0 the sampled token joins them when it is not among them);
    `length_penalty` divides a finished sequence's cumulative logprob by its length to this
    power when the sequences are ranked (vLLM's formula, `get_beam_search_score`);
    `include_stop_str_in_output` keeps the end-of-text token in a sequence's tokens and text.
    Each step asks the engine for 2 * beam_width logprobs, so `check_limits` bounds
    beam_width by the engine's `max_logprobs`.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not is_int(value) or not 1 <= value <= INT64_MAX:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name, limit in (("temperature", "a finite number >= 0"),
                            ("length_penalty", "a finite number")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and (name != "temperature" or value >= 0)
            ):
                raise ValueError(f"{name} must be {limit}, got {value!r}")

    def check_limits(self, limits: InputLimits) -> None:
        """Each step asks for 2 * beam_width logprobs: that must fit `max_logprobs`."""
        if 2 * self.beam_width > limits.max_logprobs:
            raise ValueError(
                f"beam_width is {self.beam_width}: each step asks for 2 * beam_width = "
                f"{2 * self.beam_width} logprobs, more than max_logprobs "
                f"({limits.max_logprobs}); use beam_width <= {limits.max_logprobs // 2}"
            )
