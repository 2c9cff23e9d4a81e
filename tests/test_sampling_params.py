import pytest

from v1.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"seed": 1.5}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
    ],
)
def test_invalid_values_name_the_field_and_value(kwargs, field):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    message = str(err.value)
    assert message.startswith(field)
    assert repr(next(iter(kwargs.values()))) in message or field == "min_tokens"


def test_normalization():
    p = SamplingParams(stop="###", top_k=-1, stop_token_ids=[5, 7])
    assert p.stop == ["###"] and p.top_k == 0
    assert p.all_stop_token_ids == {5, 7}
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
