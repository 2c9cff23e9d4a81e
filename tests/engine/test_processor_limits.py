"""The processor refuses what one request may not ask for with a ValueError naming the field,
the value and the limit, before paying for it (tokenizing, parsing a grammar): `LLM` users
get it as it is, the server as a 400."""

import pytest

from v1.config.limits import InputLimits
from v1.engine.processor import Processor
from v1.sampling_params import SamplingParams, StructuredOutputsParams

SMALL = InputLimits(
    max_logprobs=5, max_n_sequences=4, max_stop_strings=2, max_stop_string_len=8,
    max_num_bad_words=2, max_bad_word_len=8, max_json_schema_depth=4,
    max_structured_output_len=200, max_structured_output_choices=3,
)


def _processor(tokenizer=None, max_model_len: int = 64, policy: str = "fcfs") -> Processor:
    vocab_size = 100 if tokenizer is None else len(tokenizer)
    return Processor(tokenizer, max_model_len, vocab_size, None, (), policy, SMALL)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"n": 5}, r"n is 5, more than max_n_sequences \(4\)"),
        ({"logprobs": 6}, r"logprobs is 6, more than max_logprobs \(5\)"),
        ({"prompt_logprobs": 6}, r"prompt_logprobs is 6, more than max_logprobs \(5\)"),
        ({"stop": ["a", "b", "c"]}, r"stop has 3 strings, more than max_stop_strings \(2\)"),
        ({"stop": ["123456789"]}, r"stop has a string of 9 characters, .*max_stop_string_len"),
        ({"bad_words": ["a", "b", "c"]}, r"bad_words has 3 strings, .*max_num_bad_words \(2\)"),
        ({"bad_words": ["x" * 9]}, r"bad_words has a string of 9 .*max_bad_word_len \(8\)"),
        ({"structured_outputs": StructuredOutputsParams(choice=["a", "b", "c", "d"])},
         r"choice has 4 strings, more than max_structured_output_choices \(3\)"),
        ({"structured_outputs": StructuredOutputsParams(regex="a" * 201)},
         r"regex has 201 characters, more than max_structured_output_len \(200\)"),
        ({"structured_outputs": StructuredOutputsParams(json={"anyOf": [{"anyOf": [{}]}]})},
         r"json nests more than max_json_schema_depth \(4\)"),  # 5 deep
    ],
)
def test_each_limit_names_the_field_the_value_and_the_limit(params, message) -> None:
    """Token ids and no tokenizer: each limit is checked before anything needs one."""
    with pytest.raises(ValueError, match=message):
        _processor().process_inputs("r", [1, 2, 3], SamplingParams(**params))


def test_at_the_limits_is_accepted(tokenizer) -> None:
    params = SamplingParams(
        n=4, logprobs=5, prompt_logprobs=5, stop=["a", "12345678"], bad_words=["b", "x" * 8],
        structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]),
    )
    _processor(tokenizer).process_inputs("r", "Hello", params)


def test_priority_needs_the_priority_policy() -> None:
    """As vLLM, in its words: clients match them."""
    params = SamplingParams()
    with pytest.raises(ValueError, match=r"^Got priority 1 but Priority scheduling is not enabled"):
        _processor().process_inputs("r", [1], params, priority=1)
    _processor().process_inputs("r", [1], params, priority=0)
    _processor(policy="priority").process_inputs("r", [1], params, priority=-(2**63))
    with pytest.raises(ValueError, match=r"priority must be an int64 .*got 9223372036854775808"):
        _processor(policy="priority").process_inputs("r", [1], params, priority=2**63)


class _CountingTokenizer:
    """The real tokenizer, counting `encode` calls."""

    def __init__(self, inner) -> None:
        self._inner, self.calls = inner, 0

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def encode(self, *args, **kwargs):
        self.calls += 1
        return self._inner.encode(*args, **kwargs)


def test_a_prompt_too_long_in_characters_is_refused_untokenized(tokenizer) -> None:
    """The default model's tokens cover at most 81 characters: a prompt of more than
    max_model_len * 81 needs more than max_model_len tokens, which is known without
    tokenizing megabytes of it. One character fewer is tokenized (and refused by its count)."""
    counting = _CountingTokenizer(tokenizer)
    processor = _processor(counting, max_model_len=64)
    with pytest.raises(ValueError, match=r"the prompt has 5185 characters, more than max_model_len "
                                         r"\(64\) tokens can hold.* at most 81 characters each"):
        processor.process_inputs("r", "x" * (64 * 81 + 1), SamplingParams())
    assert counting.calls == 0
    with pytest.raises(ValueError, match=r"the prompt has \d+ tokens, more than max_model_len"):
        processor.process_inputs("r", "x" * (64 * 81), SamplingParams())
    assert counting.calls == 1


def test_text_that_is_not_unicode_is_a_value_error(tokenizer) -> None:
    """A lone surrogate (JSON's "\\ud800") made the tokenizer raise TypeError."""
    processor = _processor(tokenizer)
    with pytest.raises(ValueError, match=r"the prompt is not valid Unicode text.*U\+D800"):
        processor.process_inputs("r", "Hi \ud800", SamplingParams())
    with pytest.raises(ValueError, match=r"cache_salt is not valid Unicode text"):
        processor.process_inputs("r", "Hi", SamplingParams(), cache_salt="\udfff")
    # Not text at all (`LLM.generate`'s prompt dicts are not validated by pydantic).
    for prompt in ({"prompt": "Hi", "cache_salt": 5},
                   {"prompt_token_ids": [1], "cache_salt": b"s"}):
        with pytest.raises(ValueError, match=r"cache_salt must be a string, got"):
            processor.process_inputs("r", prompt, SamplingParams())
        with pytest.raises(ValueError, match=r"cache_salt must be a string, got"):
            processor.prompt_token_ids(prompt)
    text = processor.apply_chat_template([{"role": "user", "content": "Hi \ud800"}])
    with pytest.raises(ValueError, match=r"the conversation .* is not valid Unicode text"):
        processor.encode_conversation(text)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # A variable the template is called with already: TypeError from jinja's render().
        ({"chat_template_kwargs": {"messages": 5}}, "TypeError: .*'messages'"),
        ({"chat_template": "{{ 1 // 0 }}"}, "ZeroDivisionError"),
    ],
)
def test_chat_template_errors_of_any_type_are_value_errors(tokenizer, kwargs, message) -> None:
    with pytest.raises(ValueError, match=f"^the chat template failed: {message}"):
        _processor(tokenizer).apply_chat_template([{"role": "user", "content": "Hi"}], **kwargs)
