"""`echo` (OpenAI's, and vLLM's for chat) and `prompt_logprobs` (vLLM's), through the real
`openai` client against one `python -m v1 serve` process."""

import openai
import pytest

from tests.entrypoints.test_openai_server import MESSAGES, MODEL

pytestmark = [pytest.mark.model, pytest.mark.slow]

PROMPT = "The capital of France is"
OTHER = "Once upon a time"


@pytest.fixture
def client(extras_client: openai.OpenAI) -> openai.OpenAI:
    return extras_client


def complete(client: openai.OpenAI, prompt: str | list[int], **kwargs) -> openai.types.Completion:
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, **kwargs
    )


def test_echo_prepends_the_prompt(client: openai.OpenAI, hf_tokenizer) -> None:
    plain = complete(client, PROMPT).choices[0].text
    assert complete(client, PROMPT, echo=True).choices[0].text == PROMPT + plain
    # A prompt given as token ids is echoed as its text.
    ids = hf_tokenizer.encode(PROMPT, add_special_tokens=False)
    assert complete(client, ids, echo=True).choices[0].text == hf_tokenizer.decode(ids) + plain


def test_echo_with_logprobs_scores_the_prompt_tokens_too(client: openai.OpenAI) -> None:
    plain = complete(client, PROMPT, logprobs=2)
    echoed = complete(client, PROMPT, logprobs=2, echo=True)
    num_prompt = echoed.usage.prompt_tokens
    lp, plain_lp = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num_prompt + 4
    # As OpenAI: the first prompt token has nothing before it to be scored against.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    # The token itself and the top 2 (OpenAI's "up to logprobs + 1"); a prompt's tokens are
    # not all among their top 2.
    assert all(lp.tokens[i] in top and 0 < len(top) <= 3
               for i, top in enumerate(lp.top_logprobs) if i > 0)
    assert any(len(top) == 3 for top in lp.top_logprobs[1:num_prompt])
    assert lp.tokens[num_prompt:] == plain_lp.tokens
    assert lp.token_logprobs[num_prompt:] == pytest.approx(plain_lp.token_logprobs)
    assert "".join(lp.tokens[:num_prompt]) == PROMPT  # (this model adds no BOS)
    assert lp.text_offset == sorted(lp.text_offset)
    # The prompt part is the prompt logprobs', which come along, as vLLM's.
    prompt_logprobs = echoed.choices[0].prompt_logprobs
    assert len(prompt_logprobs) == num_prompt
    for pos in range(1, num_prompt):
        assert lp.token_logprobs[pos] in [e["logprob"] for e in prompt_logprobs[pos].values()]


def test_prompt_logprobs_per_choice(client: openai.OpenAI, hf_tokenizer) -> None:
    k = 3
    response = complete(client, [PROMPT, OTHER], n=2, extra_body={"prompt_logprobs": k})
    assert len(response.choices) == 4
    for choice in response.choices:
        prompt = [PROMPT, OTHER][choice.index // 2]  # prompt i's choice j is i * n + j
        ids = hf_tokenizer.encode(prompt)
        prompt_logprobs = choice.prompt_logprobs
        assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
        for token_id, entry in zip(ids[1:], prompt_logprobs[1:], strict=True):
            assert str(token_id) in entry and len(entry) in (k, k + 1)
            assert sorted(e["rank"] for e in entry.values())[:k] == list(range(1, k + 1))
            assert entry[str(token_id)]["decoded_token"] == hf_tokenizer.decode([token_id])
    assert complete(client, PROMPT).choices[0].prompt_logprobs is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"extra_body": {"prompt_logprobs": 1}, "stream": True},  # as vLLM: not streamed
        {"extra_body": {"prompt_logprobs": 21}},
        {"extra_body": {"prompt_logprobs": -1}},
    ],
)
def test_bad_prompt_extras_are_refused(client: openai.OpenAI, kwargs) -> None:
    with pytest.raises(openai.BadRequestError):
        complete(client, PROMPT, **kwargs)


def test_streamed_echo_is_the_unstreamed_one(client: openai.OpenAI) -> None:
    """Each choice's first chunk starts with the prompt (and, with logprobs, its tokens'),
    so the chunks add up to the non-streamed choice."""
    kwargs = {"echo": True, "logprobs": 1, "n": 2}
    whole = complete(client, [PROMPT, OTHER], **kwargs)
    text: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    token_logprobs: dict[int, list[float | None]] = {}
    for chunk in complete(client, [PROMPT, OTHER], stream=True, **kwargs):
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + c.text
            tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
            token_logprobs.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    assert len(whole.choices) == len(text) == 4
    for c in whole.choices:
        assert text[c.index] == c.text and c.text.startswith((PROMPT, OTHER))
        assert tokens[c.index] == c.logprobs.tokens
        # Batch composition differs between the two runs: fp32 GEMMs differ in the last bits.
        assert token_logprobs[c.index] == pytest.approx(c.logprobs.token_logprobs, abs=1e-4)
        assert token_logprobs[c.index][0] is None  # the prompt's first token


def test_chat_echo_and_prompt_logprobs(client: openai.OpenAI) -> None:
    """vLLM's chat `echo`: a continued assistant message is repeated before the reply (a
    user's is not); `prompt_logprobs` come with the response, one entry per prompt token."""
    opened = [*MESSAGES, {"role": "assistant", "content": "Red, green"}]
    continuing = {"add_generation_prompt": False, "continue_final_message": True}

    def chat(messages, stream=False, **extra):
        return client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=stream,
            extra_body=extra,
        )

    plain = chat(opened, **continuing).choices[0].message.content
    echoed = chat(opened, echo=True, **continuing).choices[0].message.content
    assert echoed == "Red, green" + plain
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in chat(opened, stream=True, echo=True, **continuing)
    )
    assert streamed == echoed
    assert chat(MESSAGES, echo=True).choices[0].message.content == (
        chat(MESSAGES).choices[0].message.content
    )
    response = chat(MESSAGES, prompt_logprobs=2)
    assert len(response.prompt_logprobs) == response.usage.prompt_tokens
    assert response.prompt_logprobs[0] is None and len(response.prompt_logprobs[1]) >= 2
    assert chat(MESSAGES).model_extra.get("prompt_logprobs") is None
