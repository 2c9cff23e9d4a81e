"""Fixtures for end-to-end tests with the real default model."""

from typing import NamedTuple

import pytest
import torch

SYSTEM = (
    "You are a careful assistant for a public library. You answer questions about opening "
    "hours, borrowing rules, late fees, study rooms, printing, and the catalogue. Keep answers "
    "short and friendly. If you do not know the answer, say so and suggest asking the front "
    "desk. Never invent policies. Opening hours: Monday to Friday 9 to 20, Saturday 10 to 16, "
    "closed on Sunday. Loans last three weeks and can be renewed twice online. Late fees are "
    "twenty cents a day per item. Study rooms are booked online for up to two hours a day. "
)

QUESTIONS = [
    "When do you open on Saturday?",
    "How long can I keep a book?",
    "What is the late fee?",
    "Can I book a study room for four hours?",
    "Are you open on Sunday?",
    "How many times can I renew a loan?",
    "Where can I print?",
    "Do you have a catalogue of films?",
]

PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three colors:",
    "Translate to French: good morning",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Water boils at a temperature of 100 degrees Celsius at sea level, but on a high mountain",
]


class Reference(NamedTuple):
    token_ids: list[int]
    top5: list[list[int]]  # per generated position, HF's top-5 token ids


@pytest.fixture(scope="session")
def hf_greedy(hf_model, hf_tokenizer, default_model):
    """HF transformers greedy `generate`, one prompt at a time (no padding), memoized."""
    cache: dict[tuple[tuple[int, ...], int], Reference] = {}
    stop_ids = [default_model.eos_token_id, *default_model.stop_token_ids]

    def run(prompt_ids: list[int], max_tokens: int) -> Reference:
        key = (tuple(prompt_ids), max_tokens)
        if key not in cache:
            with torch.inference_mode():
                out = hf_model.generate(
                    torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                    eos_token_id=stop_ids, pad_token_id=stop_ids[0],
                    output_logits=True, return_dict_in_generate=True,
                )
            new = out.sequences[0, len(prompt_ids):].tolist()
            top5 = [step[0].topk(5).indices.tolist() for step in out.logits]
            cache[key] = Reference(new, top5)
        return cache[key]

    return run


@pytest.fixture(scope="session")
def chat_prompts(hf_tokenizer) -> list[list[int]]:
    """The library questions under one shared system prompt, chat-templated, as token ids."""
    return [
        hf_tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            add_generation_prompt=True, tokenize=False,
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="session")
def extras_client(default_model_path, tmp_path_factory):
    """An `openai` client of one `python -m v1 serve` shared by the modules that test single
    request fields (sampling, echo, tools): one server start for all of them."""
    from tests.entrypoints.test_openai_server import serve_client

    with serve_client(
        default_model_path, tmp_path_factory, "openai_extras",
        "--max-model-len", "512", "--num-gpu-blocks", "128",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ) as client:
        yield client
