"""`v1.config.limits`: the cheap checks that run before tokenizing or parsing a grammar."""

import json

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from v1.config import EngineArgs
from v1.config.limits import (
    InputLimits,
    check_json_spec,
    check_text,
    check_token_id_lists,
    max_chars_per_token,
)
from v1.sampling_params import StructuredOutputsParams

LIMITS = InputLimits(max_json_schema_depth=8, max_structured_output_len=1000,
                     max_structured_output_choices=4)


def nested(depth: int) -> dict:
    """A schema whose JSON nests `depth` levels (objects in arrays' items)."""
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("as_text", [False, True])
def test_json_schema_depth(as_text: bool) -> None:
    def check(depth: int) -> None:
        schema = nested(depth)
        check_json_spec(json.dumps(schema) if as_text else schema, "tools[0]", LIMITS)

    check(8)
    with pytest.raises(ValueError, match=r"tools\[0\] nests more than max_json_schema_depth \(8\)"):
        check(9)


def test_json_nested_past_pythons_recursion_limit_is_a_value_error() -> None:
    """json.dumps / json.loads raise RecursionError there: a 500 unless caught."""
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    limits = InputLimits(max_json_schema_depth=8)
    for spec in (deep, "[" * 5000 + "]" * 5000):
        with pytest.raises(ValueError, match="max_json_schema_depth"):
            check_json_spec(spec, "structured_outputs.json", limits)  # type: ignore[arg-type]


def test_json_schema_size() -> None:
    big = {"enum": [f"item{i}" for i in range(200)]}
    with pytest.raises(ValueError, match=r"has \d+ characters .*max_structured_output_len"):
        check_json_spec(big, "response_format.json_schema.schema", LIMITS)
    check_json_spec({"enum": ["a", "b"]}, "response_format.json_schema.schema", LIMITS)
    # Not JSON: left to the spec's own parser, which says what is wrong.
    check_json_spec("{not json", "structured_outputs.json", LIMITS)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"choice": ["a", "b", "c", "d", "e"]}, r"choice has 5 strings, more than max_structured_output_choices \(4\)"),  # noqa: E501
        ({"choice": ["x" * 600, "y" * 600]}, r"choice has 1200 characters"),
        ({"regex": "a" * 1001}, r"regex has 1001 characters"),
        ({"grammar": "root ::= " + '"a" | ' * 200 + '"b"'}, r"grammar has \d+ characters"),
        ({"json": nested(9)}, r"json nests more than"),
        ({"structural_tag": json.dumps({"structures": [nested(8)]})}, "structural_tag nests"),
    ],
)
def test_structured_outputs_limits(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**spec).check_limits(LIMITS)


def test_lone_surrogates_are_refused() -> None:
    check_text("plain", "the prompt")
    check_text("émoji 😀 (a pair in JSON: \\ud83d\\ude00)", "the prompt")
    with pytest.raises(ValueError, match=r"the prompt is not valid Unicode.*U\+DC00.* 3"):
        check_text("abc\udc00", "the prompt")


def test_limits_are_engine_args_and_checked() -> None:
    args = EngineArgs(max_n_sequences=4, max_json_schema_depth=10)
    assert args.input_limits() == InputLimits(max_n_sequences=4, max_json_schema_depth=10)
    with pytest.raises(ValueError, match="max_stop_strings must be an integer >= 1, got 0"):
        EngineArgs(max_stop_strings=0)


def _tokenizer(**parts: object) -> PreTrainedTokenizerFast:
    vocab = {"a": 0, "b": 1, "ab": 2, "abab": 3, "<unk>": 4}
    tokenizer = Tokenizer(models.BPE(vocab, [("a", "b"), ("ab", "ab")], unk_token="<unk>"))
    added = parts.pop("added", None)
    for name, part in parts.items():
        setattr(tokenizer, name, part)
    if added is not None:
        tokenizer.add_special_tokens([added])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def test_max_chars_per_token_bounds_the_text_one_token_covers() -> None:
    assert max_chars_per_token(_tokenizer()) == 5  # "<unk>", then "abab"
    assert max_chars_per_token(
        _tokenizer(added=AddedToken("<|a_long_special|>", special=True))
    ) == len("<|a_long_special|>")
    # NFC composes up to 4 characters into one: the bound allows for it.
    assert max_chars_per_token(_tokenizer(normalizer=normalizers.NFC())) == 4 * 5
    assert max_chars_per_token(
        _tokenizer(normalizer=normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()]))
    ) == 5
    assert max_chars_per_token(_tokenizer(pre_tokenizer=pre_tokenizers.ByteLevel())) == 5


@pytest.mark.parametrize(
    "parts",
    [
        {"pre_tokenizer": pre_tokenizers.Whitespace()},  # drops whitespace
        {"normalizer": normalizers.Strip()},
        {"normalizer": normalizers.Replace("  ", " ")},
        {"added": AddedToken("<x>", special=True, lstrip=True)},  # swallows the spaces before
    ],
)
def test_max_chars_per_token_is_none_when_characters_may_vanish(parts: dict) -> None:
    assert max_chars_per_token(_tokenizer(**parts)) is None


def test_max_chars_per_token_of_the_default_model(hf_tokenizer) -> None:
    """Its longest token is a newline and 80 spaces (byte-level: one character a byte)."""
    assert max_chars_per_token(hf_tokenizer) == 81


class _CountingIds(list):
    """A token id list that counts how often its elements are read."""

    reads = 0

    def __iter__(self):
        type(self).reads += 1
        return super().__iter__()


def test_token_id_lists_are_bounded_by_their_length_times_n_before_any_element_is_read() -> None:
    """stop_token_ids, allowed_token_ids and logit_bias: each of the n sequences carries its
    own copy, so their lengths times n are bounded, read before any element (a million ids
    were checked one by one on the event loop, then again in the core per sequence)."""
    from v1.entrypoints.openai.protocol import CompletionRequest

    limits = InputLimits(max_request_token_ids=10)
    # -1 is not a token id: an element check would say so, but the length check comes first.
    request = CompletionRequest(prompt="Hi", n=4, stop_token_ids=[1, 2], logit_bias={"3": 1.0},
                                allowed_token_ids=[-1])
    with pytest.raises(ValueError, match=(
        r"the token id lists \(stop_token_ids, allowed_token_ids, logit_bias\) hold 4 ids for "
        r"each of n=4 sequences, 16 in all, more than max_request_token_ids \(10\)"
    )):
        request.to_sampling_params(limits)
    ids = _CountingIds([5] * 11)
    with pytest.raises(ValueError, match=r"11 in all, more than max_request_token_ids \(10\)"):
        check_token_id_lists(1, {"allowed_token_ids": ids}, limits)
    assert _CountingIds.reads == 0
    with pytest.raises(ValueError, match=(
        r"allowed_token_ids has 6 token ids, more than the vocabulary's size \(5\)"
    )):
        check_token_id_lists(1, {"allowed_token_ids": ids[:6]}, limits, vocab_size=5)
    assert _CountingIds.reads == 0
    check_token_id_lists(2, {"stop_token_ids": [1] * 5, "logit_bias": None}, limits, 5)


def test_the_processor_bounds_token_id_lists_by_the_vocabulary() -> None:
    """An `LLM` user's lists too (they come as SamplingParams)."""
    from v1.engine.processor import Processor
    from v1.sampling_params import SamplingParams

    processor = Processor(None, max_model_len=16, vocab_size=5, eos_token_id=None)
    with pytest.raises(ValueError, match=r"stop_token_ids has 6 token ids, more than the vocab"):
        processor.process_inputs("r", [1, 2], SamplingParams(stop_token_ids=[1] * 6))
    with pytest.raises(ValueError, match=r"max_request_token_ids \(3\)"):
        Processor(None, 16, 5, None, limits=InputLimits(max_request_token_ids=3)).process_inputs(
            "r", [1, 2], SamplingParams(n=2, allowed_token_ids=[1, 2]))


def _wordpiece() -> PreTrainedTokenizerFast:
    """A BERT-style tokenizer: BertNormalizer, BertPreTokenizer, WordPiece."""
    from tokenizers import processors

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "a": 3, "##a": 4, "b": 5}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer()
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.BertProcessing(("[SEP]", 2), ("[CLS]", 1))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")


class _CountingTokenizer:
    """A tokenizer that counts the texts it is given."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.inner, self.calls = tokenizer, 0
        self.backend_tokenizer = tokenizer.backend_tokenizer

    def encode(self, *args, **kwargs):
        self.calls += 1
        return self.inner.encode(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def test_wordpiece_texts_get_a_character_bound_too() -> None:
    """WordPiece drops whitespace and makes one [UNK] of a word of any length (a 15 MB word
    is 3 tokens), so its vocabulary bounds no characters per token: such a tokenizer's texts
    are bounded by max_chars_per_unbounded_token characters a token, before tokenizing
    (a 15 MB /v1/embeddings input was tokenized in full before); a cross-encoder's text
    pairs by their two lengths together."""
    from v1.engine.processor import Processor, PromptTooLongError

    wordpiece = _wordpiece()
    assert max_chars_per_token(wordpiece) is None
    assert wordpiece.encode("a" * 1000) == [1, 0, 2]  # one [UNK] for 1000 characters
    tokenizer = _CountingTokenizer(wordpiece)
    processor = Processor(tokenizer, max_model_len=16, vocab_size=6, eos_token_id=None,
                          limits=InputLimits(max_chars_per_unbounded_token=10))
    assert processor.encode("a" * 160, "the input") == [1, 0, 2]  # at the bound: tokenized
    assert processor.encode_pair("a" * 80, "b" * 80)[:3] == [1, 3, 4]  # a ##a ##a ...
    assert tokenizer.calls == 2
    message = (r"has 161 characters, more than max_model_len \(16\) tokens can hold: "
               r"max_chars_per_unbounded_token \(10\) characters each, as this model's "
               r"vocabulary bounds none")
    with pytest.raises(PromptTooLongError, match="^the input " + message):
        processor.encode("a" * 161, "the input")
    with pytest.raises(PromptTooLongError, match="^the text pair " + message):
        processor.encode_pair("a" * 80, "b" * 81)
    huge = Processor(tokenizer, max_model_len=512, vocab_size=6, eos_token_id=None)
    with pytest.raises(PromptTooLongError, match=r"^the prompt has 15000000 characters"):
        huge.tokenize_prompt("a" * 15_000_000)
    assert tokenizer.calls == 2  # none of the refused texts was tokenized
