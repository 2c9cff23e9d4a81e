"""The step's elementwise ops: the C kernels against the torch reference, and who gets which."""

import pytest
import torch

from v1.kernels import elementwise
from v1.kernels.elementwise import NativeOps
from v1.models.layers import ops
from v1.models.layers.ops import TorchOps, ops_for_step


@pytest.fixture(scope="module")
def native_ops() -> NativeOps:
    op = ops_for_step(torch.device("cpu"), torch.float32, 4, elementwise.native_ops())
    if not isinstance(op, NativeOps):
        pytest.skip("the C elementwise kernels are not available (no C compiler?)")
    return op


@pytest.mark.parametrize("rows, n", [(1, 576), (64, 576), (5, 13)])  # 13: tails past 8 lanes
def test_rms_norm_with_and_without_residual(native_ops, rows, n):
    torch.manual_seed(0)
    x, residual, weight = torch.randn(rows, n) * 3, torch.randn(rows, n), torch.randn(n)
    ref_out, ref_sum = TorchOps().rms_norm(x, residual, weight, 1e-5)
    res = residual.clone()
    out, summed = native_ops.rms_norm(x, res, weight, 1e-5)
    assert summed is res  # the sum is written into the residual stream in place
    assert torch.equal(summed, ref_sum)  # one fp32 add: exact
    torch.testing.assert_close(out, ref_out, rtol=2e-6, atol=2e-6)

    ref_out, _ = TorchOps().rms_norm(x, None, weight, 1e-5)
    before = x.clone()
    out, same = native_ops.rms_norm(x, None, weight, 1e-5)
    assert same is x and torch.equal(x, before)
    torch.testing.assert_close(out, ref_out, rtol=2e-6, atol=2e-6)


def test_rope_is_bit_identical_and_in_place_on_a_strided_view(native_ops):
    torch.manual_seed(0)
    T, heads, kv_heads, D = 7, 9, 3, 64
    qkv = torch.randn(T, (heads + 2 * kv_heads) * D)
    qk = qkv[:, : (heads + kv_heads) * D].view(T, heads + kv_heads, D)  # rows (heads+2kv)*D apart
    angles = torch.rand(T, 1, D // 2) * 100
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((-angles.sin(), angles.sin()), -1)
    v_before = qkv[:, (heads + kv_heads) * D :].clone()
    ref = TorchOps().rope(qk, cos, sin)
    out = native_ops.rope(qk, cos, sin)
    assert out.data_ptr() == qk.data_ptr()
    assert torch.equal(out, ref)
    assert torch.equal(qkv[:, (heads + kv_heads) * D :], v_before)  # v untouched


@pytest.mark.parametrize("n", [1536, 11])
def test_silu_and_mul(native_ops, n):
    torch.manual_seed(0)
    gate_up = torch.randn(9, 2 * n) * 6
    gate_up[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 0.0])  # past the exp clamps, and 0
    ref = TorchOps().silu_and_mul(gate_up)
    out = native_ops.silu_and_mul(gate_up)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=3e-6, atol=1e-9)


def test_which_ops_a_step_gets(monkeypatch, native_ops):
    small, big = torch.zeros(ops.SMALL_STEP_MAX_TOKENS, 8), torch.zeros(200, 8)
    # fp32 with the kernels: every step (a row's numbers must not depend on its step's size)
    def ops_for(x: torch.Tensor) -> ops.StepOps:
        return ops_for_step(x.device, x.dtype, x.shape[0], elementwise.native_ops())

    assert ops_for(small) is native_ops and ops_for(big) is native_ops
    bf16 = ops_for(small.bfloat16())
    assert isinstance(bf16, TorchOps) and bf16.serial == (torch.get_num_threads() > 1)
    assert ops_for(big.bfloat16()) is ops.TORCH_OPS  # prefill-sized: torch, all threads
    monkeypatch.setenv("V1_CPU_KERNELS", "0")
    assert isinstance(ops_for(small), TorchOps)
    assert ops_for(big) is ops.TORCH_OPS


def test_serial_torch_ops_restore_the_thread_count():
    threads = torch.get_num_threads()
    serial = TorchOps(serial=True)
    with serial:
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads
