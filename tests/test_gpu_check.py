"""`python -m v1.tools.gpu_check --device cpu`: the GPU check's logic at tiny sizes, with the
Triton kernels in the interpreter, and proof that each of its checks can fail."""

import json
import os

import pytest
import torch

from v1.models import loader as model_loader
from v1.tools import gpu_check, wheels

# As tests/attention/conftest.py: Triton decides when the ops are first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytestmark = pytest.mark.slow


def run_check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    code = gpu_check.main(["--device", "cpu", *args])
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    return code, json.loads(last_line)


def test_cpu_run_passes_and_reports_every_figure(capsys):
    code, summary = run_check(capsys)
    assert code == 0, summary
    assert summary["ok"] and summary["failed"] == []
    assert summary["device"] == "cpu" and summary["size"] == "tiny"
    assert set(summary["versions"]) == {"python", "torch", "triton", "transformers"}

    cases = summary["kernels"]["cases"]
    assert {c["case"] for c in cases} == {c.name for c in gpu_check.tiny_sizes().kernel_cases}
    assert {c["dtype"] for c in cases} == {"float32", "float16"}
    assert any(c["window"] for c in cases)
    for c in cases:
        assert c["ok"] and c["cache_ok"] and 0 <= c["rel_err"] <= c["tol"]

    fp32 = summary["parity_fp32"]
    assert fp32["ok"] and fp32["agreement"] == 1.0
    assert fp32["attention"] == "TritonAttentionImpl"  # the GPU path, interpreted
    assert fp32["max_logprob_err"] <= gpu_check.LOGPROB_TOL_FP32
    assert fp32["prompts"] == len(gpu_check.tiny_sizes().parity_prompts)
    bf16 = summary["parity_bf16"]
    assert bf16["ok"] and 0 <= bf16["agreement"] <= 1

    timing = summary["timing"]
    assert timing["prefill_tok_s"] > 0 and timing["cuda_graphs"] is False
    assert set(timing["decode_tok_s"]) == {"1", "4"}
    assert all(v > 0 for v in timing["decode_tok_s"].values())


def test_a_wrong_kernel_result_fails_the_check(capsys, monkeypatch):
    # The kernels are right, so make the reference they are held to disagree a little: an
    # output 3% off must fail every case, in fp32 and in fp16 (tolerance 1e-2).
    reference = gpu_check.paged_attention_reference

    def off_reference(*args, **kwargs):
        return reference(*args, **kwargs) * 1.03

    monkeypatch.setattr(gpu_check, "paged_attention_reference", off_reference)
    code, summary = run_check(capsys, "--only", "kernels")
    assert code == 1
    assert summary["failed"] == ["kernels"]
    assert not any(c["ok"] for c in summary["kernels"]["cases"])


def test_a_broken_model_fails_parity(capsys, monkeypatch):
    # The engine loads one weight wrong (layer 0's attention output projection, scaled by 1.1):
    # its logprobs leave transformers' on the same checkpoint.
    iter_weights = model_loader._iter_safetensors

    def broken(model_dir):
        for name, tensor in iter_weights(model_dir):
            yield name, tensor * 1.1 if name == "model.layers.0.self_attn.o_proj.weight" \
                else tensor

    monkeypatch.setattr(model_loader, "_iter_safetensors", broken)
    code, summary = run_check(capsys, "--only", "parity")
    assert code == 1
    assert summary["failed"] == ["parity_fp32"]
    assert summary["parity_fp32"]["max_logprob_err"] > gpu_check.LOGPROB_TOL_FP32


def test_an_error_is_reported_not_raised(capsys, monkeypatch):
    # An exception fails its own kernel case, or its own check; the others still run.
    def no_engine(*args, **kwargs):
        raise RuntimeError("no engine today")

    make_batch = gpu_check.make_kernel_batch

    def no_fp16(case, dtype, device, seed):
        if dtype == torch.float16 and case.name == "decode":
            raise RuntimeError("no fp16 today")
        return make_batch(case, dtype, device, seed)

    monkeypatch.setattr(gpu_check, "make_llm", no_engine)
    monkeypatch.setattr(gpu_check, "make_kernel_batch", no_fp16)
    code, summary = run_check(capsys, "--only", "kernels", "--only", "parity")
    assert code == 1
    assert summary["failed"] == ["kernels", "parity_fp32"]
    assert summary["parity_fp32"]["error"] == "RuntimeError: no engine today"
    cases = summary["kernels"]["cases"]
    assert [c for c in cases if not c["ok"]] == [
        {"case": "decode", "dtype": "float16", "ok": False, "error": "RuntimeError: no fp16 today"}
    ]
    assert len(cases) == 6


def test_cuda_asked_for_without_cuda_exits_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpu_check.main([]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_wheels_lists_what_the_engine_imports():
    # Each module the bare machine lacks has a pinned wheel; this venv has them all.
    assert {"msgspec", "zmq", "gguf", "xgrammar"} <= set(wheels.PACKAGES)
    assert all("==" in pin for pin in wheels.PACKAGES.values())
    assert wheels.missing_packages() == []
