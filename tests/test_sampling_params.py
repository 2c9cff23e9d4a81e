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
        ({"stop": ["x"], "detokenize": False}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {5: 1e39}}, "logit_bias"),  # +inf in fp32
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        # Past int64, what the engine core's messages carry.
        ({"seed": 2**70}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": 2**70}, "top_k"),
        ({"n": 2**63}, "n"),
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"logprobs": 2**63}, "logprobs"),
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
    # vLLM's: seed=-1 is no seed (each run samples anew).
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2


@pytest.mark.parametrize("kwargs", [{"stop": ["ok", "\ud800"]}, {"bad_words": ["x\udfff"]}])
def test_lone_surrogates_are_refused(kwargs):
    """Such text has no UTF-8 form: the engine core's message could not carry it."""
    field = next(iter(kwargs))
    with pytest.raises(ValueError, match=rf"^{field}\[\d\] is not valid Unicode text"):
        SamplingParams(**kwargs)


def test_logit_bias_is_unbounded_below_inf_as_vllms():
    SamplingParams(logit_bias={5: -1e9, 6: float("-inf"), 7: 250.0})


def test_int64_bounds_are_accepted():
    SamplingParams(seed=2**63 - 1, top_k=2**63 - 1)
    SamplingParams(seed=-(2**63))
