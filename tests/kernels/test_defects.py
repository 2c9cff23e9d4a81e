"""Issue 21's table of defects, found by driving the C kernels directly: each is now a
ValueError naming the argument, or torch's result. (The library rows, a truncated library,
no compiler, a planted library in a shared cache, are in test_library.py.)"""

import pytest
import torch
import torch.nn.functional as F

from tests.attention.test_torch_attn import ATOL, RTOL, SCENARIOS, Batch
from v1.attention.backends.torch_attn import TorchAttentionImpl
from v1.attention.backends.torch_plan import AttentionPlan
from v1.kernels.elementwise import native_ops
from v1.kernels.library import library
from v1.models.layers.quantized import QuantizedWeight

pytestmark = pytest.mark.skipif(library() is None, reason="no C kernels")

PATHS = ("fp32", "int8", "dense")


@pytest.fixture
def bf16_default():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    yield
    torch.set_default_dtype(before)


@pytest.mark.parametrize("path", PATHS)
def test_outputs_are_fp32_whatever_the_default_dtype(bf16_default, path) -> None:
    """Under torch.set_default_dtype(torch.bfloat16) the kernels' outputs were allocated as
    bf16 and written as fp32: a heap overflow, which aborted `LLM(gguf).generate`."""
    q = QuantizedWeight.quantize(torch.randn(300, 64, dtype=torch.float32), "q4_1")
    for m in (1, 5, 300):
        x = torch.randn(m, 64, dtype=torch.float32)
        out = q.linear(x, path=path)
        assert out.dtype == torch.float32 and out.shape == (m, 300)
        ref = x.double() @ q.dequantize().double().T
        tolerance = 0.5 if path == "int8" else 1e-4
        assert (out.double() - ref).abs().max() < tolerance


def test_elementwise_outputs_are_fp32_whatever_the_default_dtype(bf16_default) -> None:
    ops = native_ops()
    x, res, w = (torch.randn(3, 40, dtype=torch.float32) for _ in range(3))
    out, _ = ops.rms_norm(x, res, w[0], 1e-5)
    assert out.dtype == torch.float32
    assert ops.silu_and_mul(x).dtype == torch.float32


@pytest.mark.parametrize("path", (*PATHS, "torch"))
def test_bias_must_be_out_features_long(path) -> None:
    """A 1-element (broadcastable) bias gave errors of 1e34, a short one was read past its
    end: only [out_features] is a bias, on every path."""
    q = QuantizedWeight.quantize(torch.randn(24, 64), "q8_0")
    x = torch.randn(3, 64)
    for bias in (torch.randn(1), torch.randn(12), torch.randn(25), torch.randn(24, 1)):
        with pytest.raises(ValueError, match=r"bias has shape .*expected \[24\]"):
            q.linear(x, bias, path=path)


def test_a_dense_but_permuted_query() -> None:
    """A query whose heads are its outer dimension in memory (dense, not contiguous): its
    output, allocated with empty_like, kept those strides, and the kernel wrote it as if
    contiguous (errors of 8e34)."""
    batch = Batch(*SCENARIOS["decode"], 9, 3, 64, 16)
    plan = AttentionPlan.for_step(batch.metadata, batch.kv_cache, 9)
    assert plan.native is not None
    permuted = batch.query.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    assert not permuted.is_contiguous() and torch.equal(permuted, batch.query)
    impl = TorchAttentionImpl(9, 64, 3, 0.125)
    out = impl.forward(permuted, batch.key, batch.value, batch.kv_cache.clone(),
                       batch.metadata)
    ref, _ = batch.run_reference(0.125)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def _same_non_finite(got: torch.Tensor, ref: torch.Tensor) -> None:
    """NaN where the reference has NaN, the same infinities where it has them."""
    assert torch.equal(got.isnan(), ref.isnan())
    inf = ref.isinf()
    assert torch.equal(got.isinf(), inf) and torch.equal(got[inf], ref[inf])


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("path", PATHS)
def test_inf_activations_as_torch_at_every_batch_size(kind, path) -> None:
    """+-inf in an activation row: the one-row q4_1 path gave NaN where torch gives +-inf
    (results depended on the batch size); quantized activations gave NaN throughout. Now
    NaN and inf land where torch puts them, at every M, and other rows are untouched."""
    torch.manual_seed(0)
    q = QuantizedWeight.quantize(torch.randn(40, 96), kind)
    w = q.dequantize()
    for m in (1, 2, 3, 4, 5, 17, 40):
        x = torch.randn(m, 96)
        x[0, 5] = float("inf")
        if m > 2:
            x[2, 40] = float("-inf")
            x[2, 70] = float("nan")
        got = q.linear(x, path=path)
        ref = F.linear(x, w)
        _same_non_finite(got, ref)
        finite_rows = [i for i in range(m) if i not in (0, 2)]
        if finite_rows:  # as without the non-finite rows (up to the sums' order)
            alone = q.linear(x[finite_rows], path=path)
            torch.testing.assert_close(got[finite_rows], alone, rtol=1e-5, atol=1e-4)


def test_silu_of_minus_inf_is_nan_as_in_torch() -> None:
    """silu(-inf) = -inf / (1 + e^inf) is NaN in torch; the vector lanes' clamped e^x gave
    -inf (the scalar tail, NaN)."""
    ops = native_ops()
    n = 11  # one vector of 8, a tail of 3
    gate_up = torch.zeros(2, 2 * n)
    gate_up[0, :3] = torch.tensor([float("-inf"), float("inf"), float("nan")])
    gate_up[1, 9] = float("-inf")
    gate_up[:, n:] = 1.0
    ref = F.silu(gate_up[:, :n]) * gate_up[:, n:]
    _same_non_finite(ops.silu_and_mul(gate_up), ref)
