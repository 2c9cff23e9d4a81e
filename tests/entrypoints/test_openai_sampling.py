"""The logits-processor sampling fields over HTTP (penalties, logit_bias, allowed_token_ids,
bad_words), through the real `openai` client against one `python -m v1 serve` process."""

import openai
import pytest

from tests.entrypoints.test_openai_server import MODEL

pytestmark = [pytest.mark.model, pytest.mark.slow]

REPETITIVE = "I like cats. I like cats."  # greedy: " I'm a cat. I'm a cat. I'm a cat."
TOKEN = 504  # any in-vocabulary id


@pytest.fixture
def client(extras_client: openai.OpenAI) -> openai.OpenAI:
    return extras_client


def greedy(client: openai.OpenAI, prompt: str, max_tokens: int = 12, **extra) -> list[str]:
    completion = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body=extra,
        n=extra.pop("n", 1),
    )
    return [choice.text for choice in completion.choices]


def test_logit_bias_forces_a_token(client: openai.OpenAI, hf_tokenizer) -> None:
    [text] = greedy(client, "The capital of France is", 4, logit_bias={str(TOKEN): 100})
    assert text == hf_tokenizer.decode([TOKEN] * 4)
    # Biases beyond 100 are clamped, as OpenAI's range, not refused.
    assert greedy(client, "The capital of France is", 4, logit_bias={str(TOKEN): 1e6}) == [text]


@pytest.mark.parametrize(
    "penalty",
    [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 2.0}],
)
def test_penalties_break_repetition(client: openai.OpenAI, penalty: dict[str, float]) -> None:
    [plain] = greedy(client, REPETITIVE, 16)
    assert plain.count("cat") >= 3  # the model repeats itself without a penalty
    penalised = greedy(client, REPETITIVE, 16, n=2, **penalty)
    assert penalised[0].count("cat") < plain.count("cat")
    # n > 1: each choice counts its own tokens, so greedy choices are alike.
    assert penalised[1] == penalised[0]


def test_allowed_token_ids_restrict_random_sampling(client: openai.OpenAI, hf_tokenizer) -> None:
    completion = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=8,
        temperature=1.0,
        extra_body={"allowed_token_ids": [TOKEN]},
    )
    assert completion.choices[0].text == hf_tokenizer.decode([TOKEN] * 8)


def test_bad_words_are_never_completed(client: openai.OpenAI) -> None:
    prompt = "The capital of France is the city of"
    [plain] = greedy(client, prompt)
    assert "Paris" in plain
    [banned] = greedy(client, prompt, bad_words=["Paris"])
    assert "Paris" not in banned and banned != ""


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -3, "[-2, 2]"),
        ("repetition_penalty", 0, "> 0"),
        ("allowed_token_ids", [], "non-empty"),
        ("allowed_token_ids", [10**7], "valid: 0 to"),
        ("logit_bias", {"x": 1}, "token ids"),
        ("logit_bias", {str(10**7): 1}, "valid: 0 to"),
    ],
)
def test_bad_values_get_400(client: openai.OpenAI, field: str, value, expected: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        greedy(client, "Hi", 1, **{field: value})
    message = str(err.value)
    assert field in message and expected in message
