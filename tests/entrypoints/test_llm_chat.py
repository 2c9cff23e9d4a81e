"""`LLM.chat`'s template options, as vLLM's: chat_template, add_generation_prompt,
continue_final_message, chat_template_kwargs; and vLLM's spellings of the KV cache options."""

from collections.abc import Iterator

import pytest

from v1 import LLM, SamplingParams

pytestmark = pytest.mark.model

# A template of our own: no default system prompt (the model's adds one), and a `prefill`
# variable that only chat_template_kwargs can set.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{{ prefill or '' }}{% endif %}"
)
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)
QUESTION = {"role": "user", "content": "What color is the sky?"}
OPEN_ANSWER = {"role": "assistant", "content": "The sky is"}


@pytest.fixture(scope="module")
def llm(default_model) -> Iterator[LLM]:
    with LLM(loaded_model=default_model, num_gpu_blocks=64, max_model_len=512) as llm:
        yield llm


def prompt_of(llm: LLM, messages: list[dict[str, str]], **kwargs) -> str:
    [out] = llm.chat(messages, ONE_TOKEN, use_tqdm=False, **kwargs)
    return out.prompt


def test_chat_template_replaces_the_models(llm: LLM) -> None:
    assert "SmolLM" in prompt_of(llm, [QUESTION])  # the model's template's system prompt
    assert prompt_of(llm, [QUESTION], chat_template=TEMPLATE) == (
        "<|im_start|>user\nWhat color is the sky?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_add_generation_prompt_false(llm: LLM) -> None:
    prompt = prompt_of(llm, [QUESTION], chat_template=TEMPLATE, add_generation_prompt=False)
    assert prompt == "<|im_start|>user\nWhat color is the sky?<|im_end|>\n"


def test_continue_final_message(llm: LLM) -> None:
    """The last message stays open: the model goes on with it rather than answering it."""
    messages = [QUESTION, OPEN_ANSWER]
    prompt = prompt_of(
        llm, messages, add_generation_prompt=False, continue_final_message=True
    )
    assert prompt.endswith("<|im_start|>assistant\nThe sky is")
    with pytest.raises(ValueError, match="continue_final_message"):
        prompt_of(llm, messages, continue_final_message=True)  # add_generation_prompt too


def test_chat_template_kwargs(llm: LLM) -> None:
    prompt = prompt_of(
        llm, [QUESTION], chat_template=TEMPLATE, chat_template_kwargs={"prefill": "Blue"}
    )
    assert prompt.endswith("<|im_start|>assistant\nBlue")
    # They override the call's own flags, as vLLM's do; `tokenize` is not theirs to set.
    prompt = prompt_of(
        llm, [QUESTION], chat_template=TEMPLATE,
        chat_template_kwargs={"add_generation_prompt": False},
    )
    assert not prompt.endswith("assistant\n")
    with pytest.raises(ValueError, match="tokenize"):
        prompt_of(llm, [QUESTION], chat_template_kwargs={"tokenize": True})


def test_vllm_spellings_of_kv_cache_options(default_model) -> None:
    """num_gpu_blocks_override and kv_cache_memory_bytes size the KV cache as our names do."""
    with pytest.raises(ValueError, match=r"\(2 blocks\)"):
        LLM(loaded_model=default_model, max_model_len=512, num_gpu_blocks_override=2)
    with pytest.raises(ValueError, match="kv_cache_memory of 1000 bytes"):
        LLM(loaded_model=default_model, max_model_len=512, kv_cache_memory_bytes=1000)
    with pytest.raises(ValueError, match="disagree"):
        LLM(loaded_model=default_model, num_gpu_blocks=64, num_gpu_blocks_override=32)
    # gpu_memory_utilization is accepted everywhere (on CPU it changes nothing).
    with LLM(
        loaded_model=default_model, max_model_len=512, num_gpu_blocks_override=64,
        gpu_memory_utilization=0.5,
    ) as llm:
        assert llm.chat([QUESTION], ONE_TOKEN, use_tqdm=False)[0].outputs[0].token_ids


def test_tools_reach_the_template(llm: LLM) -> None:
    """As vLLM's `LLM.chat(tools=...)`: the function definitions are the template's `tools`."""
    template = "{% for t in tools or [] %}{{ t.function.name }};{% endfor %}" + TEMPLATE
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    assert prompt_of(llm, [QUESTION], chat_template=template, tools=tools).startswith(
        "get_time;<|im_start|>user"
    )
    assert prompt_of(llm, [QUESTION], chat_template=template).startswith("<|im_start|>user")


def test_messages_as_openai_sends_them(llm: LLM) -> None:
    """As vLLM's message parsing: content as text parts (joined by newlines), an assistant's
    tool calls with null content and JSON-text arguments (objects in the template), a tool's
    answer. The model's own template renders them (it failed on both before)."""
    template = TEMPLATE.replace(
        "{{ m.content }}",
        "{{ m.content }}{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}"
        "{% endfor %}",
    )
    parts = {"role": "user", "content": [{"type": "text", "text": "Weather"},
                                         {"type": "text", "text": "in Paris?"}]}
    call = {"role": "assistant", "content": None, "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]}
    answer = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert prompt_of(llm, [parts, call, answer], chat_template=template) == (
        "<|im_start|>user\nWeather\nin Paris?<|im_end|>\n<|im_start|>assistant\nParis<|im_end|>\n"
        "<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "Weather\nin Paris?" in prompt_of(llm, [parts, call, answer])
    for bad, match in (({"role": "user", "content": [{"type": "image_url"}]}, "text only"),
                       ({**call, "tool_calls": [{"function": {"name": "f", "arguments": "["}}]},
                        "tool call arguments must be a JSON object"),
                       ({"content": "no role"}, "needs a 'role'"),
                       ({**call, "tool_calls": 5}, "tool_calls must be a list"),
                       ({**call, "tool_calls": [{"function": {"name": "f",
                                                              "arguments": "[" * 100_000}}]},
                        "tool call arguments must be a JSON object")):
        with pytest.raises(ValueError, match=match):
            llm.chat([bad], ONE_TOKEN, use_tqdm=False)
