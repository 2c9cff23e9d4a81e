"""What one request may ask for (`InputLimits`, set by `EngineArgs` fields of the same names), and
the cheap checks against it.

Every check runs before the costly work it guards (tokenizing, parsing a schema, compiling a
grammar) and raises a ValueError naming the field, the value and the limit (a 400 from the
server). Fixed limits: integers fit int64, text is valid Unicode, and a prompt longer in
characters than `max_model_len` tokens could cover is refused untokenized (`max_chars_per_token`,
or `max_chars_per_unbounded_token` where the vocabulary bounds nothing).
"""

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

from tokenizers.models import BPE

from v1.config.checks import check_ints

# The range of the integers the engine core's msgpack messages (and torch) carry.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def limit_field(default: int, help: str) -> Any:
    """A limits dataclass's field: its default and its flag's help."""
    return field(default=default, metadata={"help": help})


def check_limit_fields(limits: Any) -> None:
    """Every field of a limits dataclass is an integer >= 1."""
    check_ints(limits, tuple(f.name for f in fields(limits)))


@dataclass(frozen=True, slots=True)
class InputLimits:
    """Per-request limits; each is an `EngineArgs` field (and server flag) of the same name,
    whose `help` says what it bounds and why. The defaults refuse nothing ordinary clients
    send (OpenAI's own limits are tighter)."""

    max_logprobs: int = limit_field(
        20, "the most logprobs, top_logprobs or prompt_logprobs a request may ask for (each "
        "costs a sort of the vocabulary per token; vLLM's flag)",
    )
    max_n_sequences: int = limit_field(
        128, "the most choices (n) a request may ask for, each a sequence in the engine "
        "(OpenAI's cap; vLLM's VLLM_MAX_N_SEQUENCES)",
    )
    max_stop_strings: int = limit_field(
        64, "the most stop strings a request may give (each is looked for in every token's "
        "text; vLLM's VLLM_MAX_STOP_STRINGS)",
    )
    max_stop_string_len: int = limit_field(
        1024, "the most characters one stop string may have (streaming holds back one less "
        "than the longest)",
    )
    max_num_bad_words: int = limit_field(
        128, "the most bad_words a request may give (each is matched against the output at "
        "every step; vLLM's VLLM_MAX_NUM_BAD_WORDS)",
    )
    max_bad_word_len: int = limit_field(256, "the most characters one bad word may have")
    max_json_schema_depth: int = limit_field(
        64, "the deepest nesting of JSON objects and arrays a JSON schema (structured output, "
        "response_format, a tool's parameters) or structural tag may have: xgrammar's time "
        "to parse one grows about cubically with it",
    )
    max_structured_output_len: int = limit_field(
        256 * 1024, "the most characters a structured-output spec may have: a JSON schema's "
        "text, a regex, a grammar, all `choice` strings together (a grammar's compile time "
        "and memory grow with it)",
    )
    max_structured_output_choices: int = limit_field(
        1024, "the most strings a structured-output `choice` may list",
    )
    max_chars_per_unbounded_token: int = limit_field(
        100, "for a tokenizer whose vocabulary bounds no characters per token (WordPiece, "
        "WordLevel, Unigram: whitespace dropped, a long word one unknown token), how many "
        "characters a token is taken to cover: a text of more than max_model_len times this "
        "is refused before it is tokenized (WordPiece's own max_input_chars_per_word)",
    )
    max_request_token_ids: int = limit_field(
        256 * 1024, "the most token ids a request's stop_token_ids, allowed_token_ids and "
        "logit_bias may list together, times n: each of the n sequences carries its own copy "
        "to the engine core, which checks every id again (each list is also at most the "
        "vocabulary's size)",
    )

    def __post_init__(self) -> None:
        check_limit_fields(self)


DEFAULT_LIMITS = InputLimits()


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, what: str) -> None:
    """Refuse text that is not valid Unicode: a lone surrogate (JSON's "\\ud800" escape
    decodes to one) has no UTF-8 form, so no tokenizer, template or message can take it."""
    if text.isascii():  # the common case, O(1)
        return
    found = _SURROGATE.search(text)
    if found is not None:
        raise ValueError(
            f"{what} is not valid Unicode text: a lone surrogate (U+{ord(found.group()):04X}) "
            f"at character {found.start()}"
        )


def check_json_spec(spec: str | Mapping[str, Any], what: str, limits: InputLimits) -> None:
    """Refuse a JSON schema (or structural tag), as a dict or its text, that nests deeper than
    `max_json_schema_depth` or whose text is longer than `max_structured_output_len`, before
    anything parses it. Costs O(its size), and that is bounded by the request's."""
    if isinstance(spec, str):
        text = spec
    else:
        try:
            text = json.dumps(spec)
        except RecursionError:  # deeper than Python's recursion limit (~1000)
            _too_deep(what, limits)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{what} is not JSON: {e}") from e
    if len(text) > limits.max_structured_output_len:
        raise ValueError(
            f"{what} has {len(text)} characters (as JSON text), more than "
            f"max_structured_output_len ({limits.max_structured_output_len})"
        )
    if isinstance(spec, str):
        try:
            value = json.loads(text)
        except RecursionError:
            _too_deep(what, limits)
        except ValueError:
            return  # not JSON: the spec's own parser says what is wrong with it
    else:
        value = spec
    # Depth-first, without recursion: containers only (a scalar adds no level).
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > limits.max_json_schema_depth:
            _too_deep(what, limits)
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


def check_token_id_lists(
    n: int, lists: Mapping[str, Any], limits: InputLimits, vocab_size: int | None = None,
) -> None:
    """Refuse token id lists (`lists`: field name -> its list or dict, None if not given)
    longer than the vocabulary (`vocab_size`, if known: a longer one repeats ids), or that
    together, times `n` sequences, hold more than `max_request_token_ids`. Reads only their
    lengths, so it runs before anything looks at their elements."""
    total = 0
    for name, ids in lists.items():
        length = len(ids or ())
        if vocab_size is not None and length > vocab_size:
            raise ValueError(
                f"{name} has {length} token ids, more than the vocabulary's size ({vocab_size})"
            )
        total += length
    if n * total > limits.max_request_token_ids:
        raise ValueError(
            f"the token id lists ({', '.join(lists)}) hold {total} ids for each of n={n} "
            f"sequences, {n * total} in all, more than max_request_token_ids "
            f"({limits.max_request_token_ids})"
        )


def _too_deep(what: str, limits: InputLimits) -> NoReturn:
    raise ValueError(
        f"{what} nests more than max_json_schema_depth ({limits.max_json_schema_depth}) "
        "levels of JSON objects and arrays"
    )


# The most a normalizer can shrink a text by: NFC and NFKC compose what NFD and NFKD (which
# never shrink) decompose, and one character decomposes canonically into at most 4, and
# with compatibility mappings into at most 18 (Unicode 14, as `unicodedata` says).
_SHRINKS_BY = {"NFC": 4, "NFKC": 18}
# Normalizers and pre-tokenizers that never drop characters (they may add some).
_KEEP_EVERY_CHARACTER = {
    "Prepend", "NFD", "NFKD", "Lowercase",  # normalizers
    "ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts",
}


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of text one token of `tokenizer` (a fast HF tokenizer) can stand
    for, or None if its vocabulary does not bound that: a normalizer or pre-tokenizer that
    may drop characters (BERT's whitespace splitting, stripping), a model that makes one
    token of a run of unknown characters (WordPiece, Unigram, BPE with fused unknowns and no
    byte fallback), added tokens that swallow the whitespace beside them.

    A BPE token's vocabulary string is at least as long as the text it covers (byte-level
    vocabularies spell each byte as one character, and a character is one byte or more), so
    the longest string bounds it, times what the normalizer may shrink a text by. A text of
    more characters than `max_model_len` times this is then longer than `max_model_len`
    tokens, which is known without tokenizing it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    # The parts read one by one: writing the whole tokenizer as JSON (vocabulary and merges)
    # and parsing it back was a large share of every start.
    shrink = _shrink_factor(_config(backend.normalizer))
    if shrink is None or _shrink_factor(_config(backend.pre_tokenizer)) != 1:
        return None
    model = backend.model
    if not isinstance(model, BPE) or (model.fuse_unk and not model.byte_fallback):
        return None
    added = list(backend.get_added_tokens_decoder().values())
    if any(token.lstrip or token.rstrip for token in added):
        return None
    vocab = backend.get_vocab(with_added_tokens=False)
    longest = max(len(s) for s in [*vocab, *(t.content for t in added)])
    return longest * shrink


def _config(component: Any) -> dict[str, Any] | None:
    """A normalizer's or pre-tokenizer's tokenizer.json form (None: none)."""
    return None if component is None else json.loads(component.__getstate__())


def _shrink_factor(component: Mapping[str, Any] | None) -> int | None:
    """How many times shorter a normalizer or pre-tokenizer (tokenizer.json's form) may make
    a text; None when unbounded (it may drop characters)."""
    if component is None:
        return 1
    kind = component.get("type")
    if kind == "Sequence":
        factor = 1
        for part in component.get("normalizers") or component.get("pretokenizers") or []:
            part_factor = _shrink_factor(part)
            if part_factor is None:
                return None
            factor *= part_factor
        return factor
    if kind == "Replace":  # a plain string replaced by one at least as long never shrinks
        pattern = component.get("pattern", {}).get("String")
        keeps = pattern is not None and len(component.get("content", "")) >= len(pattern)
        return 1 if keeps else None
    if kind in _SHRINKS_BY:
        return _SHRINKS_BY[kind]
    if kind in _KEEP_EVERY_CHARACTER and component.get("behavior") != "Removed":
        return 1
    return None
