"""Fixtures for the engine tests."""

import pytest


@pytest.fixture(scope="session")
def tokenizer(hf_tokenizer):
    """The default model's HF tokenizer, loaded once per session (shared with the whole suite
    through tests/conftest.py's `hf_tokenizer`; skips when the model is not installed)."""
    return hf_tokenizer
