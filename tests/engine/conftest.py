"""Fixtures for the engine tests."""

import pytest


@pytest.fixture(scope="session")
def tokenizer(hf_tokenizer):
    """The default model's HF tokenizer, loaded once per session (shared with the whole suite
    through tests/conftest.py's `hf_tokenizer`; skips when the model is not installed)."""
    return hf_tokenizer


@pytest.fixture(scope="module")
def dp1_llm(gguf_model):
    """One engine core (in process, sharing the session's weights): the reference the
    data-parallel tests compare with."""
    from tests.engine.mp_utils import SMALL_ENGINE
    from v1 import LLM

    with LLM(loaded_model=gguf_model, **SMALL_ENGINE) as llm:
        yield llm
