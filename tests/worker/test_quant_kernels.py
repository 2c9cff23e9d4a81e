"""GGUF block weights (v1.models.layers.quantized): the bit layout against the gguf package, ggml's
rounding, and each multiplication path against the torch reference."""

import multiprocessing
import os
import platform
import subprocess
import sys
import threading
from collections.abc import Iterator

import gguf
import numpy as np
import pytest
import torch

from tests.kernels.kernel_check import INT8_ISA
from tests.worker.test_model_archs import quantized
from v1 import envs
from v1.kernels import library, variants
from v1.kernels.block_matmul import INT8_ISAS, QuantBlocks, QuantKernels, kernels
from v1.models.layers import quantized as quant
from v1.models.layers.linear import Linear
from v1.models.layers.quantized import MatmulPolicy, QuantizedWeight

KINDS = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}

needs_kernels = pytest.mark.skipif(kernels() is None, reason="no C kernels (V1_CPU_KERNELS=0?)")


def weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    w[0, :32] = 0.25  # a constant block: d = 0
    w[-1, -32:] = torch.linspace(-1, 2, 32)  # a wide one
    if in_features >= 64:
        # Ties: d = 1 in both kinds (max |x| 127; max - min 15), so x * (1 / d) lands on
        # halves, which ggml rounds away from zero (torch.round would round to even).
        w[-1, :32] = torch.tensor([127.0, 0.0] + [k + 0.5 for k in range(-15, 15)])
        w[0, 32:64] = torch.tensor([0.0, 15.0] + [k % 15 + 0.5 for k in range(30)])
    return w


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 path sees it: q8_0 per block of 32 with an fp32 scale, dequantized."""
    b = x.reshape(x.shape[0], -1, 32)  # the int8 path quantizes x per 32 values
    d = b.abs().amax(-1, keepdim=True) / 127
    return (quant._roundf(b * quant._inverse(d)) * d).reshape(x.shape)


def close(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """a == b up to fp32 rounding of sums of |x| |w| products (x [..., in], w [out, in])."""
    scale = (x.abs().double() @ w.abs().double().T).reshape(a.shape)
    assert ((a.double() - b.double()).abs() <= 1e-6 * scale + 1e-6).all()


@pytest.fixture
def fp32_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(N, K, M) of each call of the C fp32 path from now on: the torch reference gives the
    same results up to rounding, so only this tells which code ran."""
    calls: list[tuple[int, int, int]] = []
    linear = QuantKernels.linear

    def counting(self, w, x, bias, int8=False):
        out = linear(self, w, x, bias, int8)
        if not int8:
            calls.append((w.N, w.K, x.shape[0]))
        return out

    monkeypatch.setattr(QuantKernels, "linear", counting)
    return calls


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_are_ggml_bit_for_bit(kind: str) -> None:
    w = weight(7, 96)
    q = QuantizedWeight.quantize(w, kind)
    assert q.blocks.shape == (7, 3 * quant.BLOCK_SIZES[kind][1]) and q.nbytes == q.blocks.numel()
    assert np.array_equal(q.blocks.numpy(), gguf.quants.quantize(w.numpy(), KINDS[kind]))
    deq = gguf.quants.dequantize(q.blocks.numpy(), KINDS[kind])
    assert np.array_equal(q.dequantize().numpy(), deq)


def test_q4_1_nibble_order() -> None:
    """Value j < 16 is the low nibble of byte j, value j + 16 its high nibble."""
    d_m = torch.tensor([1.0, 0.0]).to(torch.float16).view(torch.uint8)  # d = 1, m = 0
    j = torch.arange(16, dtype=torch.uint8)
    block = torch.cat([d_m, j | ((15 - j) << 4)])
    w = QuantizedWeight("q4_1", block[None], 1, 32).dequantize()[0]
    assert w.tolist() == list(range(16)) + list(range(15, -1, -1))


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_round_trip(kind: str) -> None:
    w = weight(5, 64, seed=1)
    q = QuantizedWeight.quantize(w, kind)
    blocks = w.reshape(5, -1, 32)
    step = (blocks.abs().amax(-1) / 127 if kind == "q8_0"
            else (blocks.amax(-1) - blocks.amin(-1)) / 15)
    err = (q.dequantize() - w).reshape(5, -1, 32).abs().amax(-1)
    assert (err <= step * 0.51 + blocks.abs().amax(-1) * 1e-3).all()  # + fp16 rounding of d, m
    again = QuantizedWeight.quantize(q.dequantize(), kind)
    assert (again.dequantize() - q.dequantize()).abs().max() <= step.max() * 1e-2


def test_rows_concatenate() -> None:
    """Fused projections: the blocks of stacked weights are the stacked blocks."""
    a, b = weight(3, 64), weight(5, 64, seed=2)
    fused = torch.cat([QuantizedWeight.quantize(t, "q4_1").blocks for t in (a, b)])
    assert torch.equal(fused, QuantizedWeight.quantize(torch.cat([a, b]), "q4_1").blocks)


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(37, 96), (1, 32), (67, 160)])
def test_fp32_path_matches_reference(kind: str, shape: tuple[int, int]) -> None:
    q = QuantizedWeight.quantize(weight(*shape), kind)
    w = q.dequantize()
    bias = torch.randn(shape[0])
    for m in (1, 3, 4, 5, 8, 9, 16, 17, 65):  # each tile and its edges
        x = torch.randn(m, shape[1])
        ref = torch.nn.functional.linear(x.double(), w.double(), bias.double())
        close(q.linear(x, bias, path="fp32"), ref, x, w)
        assert q.linear(x, path="fp32").shape == (m, shape[0])


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
def test_int8_path_matches_quantized_activations(kind: str) -> None:
    q = QuantizedWeight.quantize(weight(41, 128), kind)
    w = q.dequantize()
    for m in (1, 3, 16, 17, 40, 70):  # 16 rows per vector, 64 per tile: cover the edges
        x = torch.randn(m, 128)
        x[0, :32] = 0  # a zero block: scale 0
        got = q.linear(x, path="int8")
        close(got, int8_activations(x).double() @ w.double().T, x, w)
        # ... which is not what fp32 activations give: the path is really another one.
        assert (got - q.linear(x, path="fp32")).abs().max() > 1e-4


@needs_kernels
def test_every_row_takes_int8_by_default() -> None:
    """MatmulPolicy.all_int8 (the default): without a `path`, every batch size runs "int8"."""
    q = QuantizedWeight.quantize(weight(37, 96), "q4_1")
    for m in (1, 3, 17, 300):
        x = torch.randn(m, 96)
        assert torch.equal(q.linear(x), q.linear(x, path="int8"))
    assert not torch.equal(q.linear(x), q.linear(x, path="fp32"))


@pytest.fixture
def by_batch_size() -> MatmulPolicy:
    """V1_QUANT_ALL_INT8=0: paths by batch size (and prompt rows)."""
    return MatmulPolicy(all_int8=False)


def by_rule(q: QuantizedWeight, x: torch.Tensor, policy: MatmulPolicy) -> torch.Tensor:
    """`q.linear` on the path the policy gives a call of x's rows (`MatmulRows.linear`)."""
    return policy.rows(None, kernels()).linear(q, x, None)


@needs_kernels
def test_path_by_batch_size(by_batch_size: MatmulPolicy) -> None:
    q = QuantizedWeight.quantize(weight(16, 64), "q8_0")
    x = torch.randn(8, 64)
    assert not torch.equal(q.linear(x, path="int8"), q.linear(x, path="fp32"))
    min4 = MatmulPolicy(all_int8=False, int8_min_rows=4)
    assert torch.equal(by_rule(q, x[:3], min4), q.linear(x[:3], path="fp32"))
    assert torch.equal(by_rule(q, x, min4), q.linear(x, path="int8"))
    assert torch.equal(by_rule(q, x, by_batch_size), q.linear(x, path="fp32"))
    dense4 = MatmulPolicy(all_int8=False, dense_min_rows=4)
    assert not torch.equal(q.linear(x, path="dense"), q.linear(x, path="fp32"))
    assert torch.equal(by_rule(q, x[:3], dense4), q.linear(x[:3], path="fp32"))
    assert torch.equal(by_rule(q, x, dense4), q.linear(x, path="dense"))


@needs_kernels
def test_prompt_chunks_from_the_calibrated_size_take_dense() -> None:
    """`prompt_dense_min_rows` (the machine's calibration): a forward's prompt rows by a
    weight of a listed kind take "dense" once the call has that many rows; smaller chunks,
    generated rows, the calls of other sizes (the LM head's) and weights of other kinds keep
    int8."""
    q = QuantizedWeight.quantize(weight(24, 64), "q4_1")
    other = QuantizedWeight.quantize(weight(24, 64), "q8_0")
    policy = MatmulPolicy(prompt_dense_min_rows=(("q4_1", 6), ("q5_0", 2)))
    x = torch.randn(8, 64)
    prompt = np.ones(8, dtype=bool)
    dense, int8 = q.linear(x, path="dense"), q.linear(x, path="int8")
    assert not torch.equal(dense, int8)
    chunk = policy.rows(prompt, kernels())
    assert chunk.path(8, "q4_1") == "dense" and torch.equal(chunk.linear(q, x, None), dense)
    assert chunk.path(8, "q8_0") == "int8"
    assert torch.equal(chunk.linear(other, x, None), other.linear(x, path="int8"))
    assert chunk.path(2, "q4_1") == "int8"  # the head's rows: by count
    small = policy.rows(prompt[:5], kernels())
    assert small.path(5, "q4_1") == "int8"
    assert torch.equal(small.linear(q, x[:5], None), int8[:5])
    generated = policy.rows(np.zeros(8, dtype=bool), kernels())
    assert generated.path(8, "q4_1") == "int8" and torch.equal(generated.linear(q, x, None), int8)
    # Prompt rows beside generated ones: split, each on its own path.
    mixed = prompt.copy()
    mixed[[2, 5]] = False
    rows = policy.rows(mixed, kernels())
    assert rows.path(8, "q4_1") is None and rows.path(8, "q8_0") == "int8"
    got = rows.linear(q, x, None)
    assert torch.equal(got[mixed], q.linear(x[mixed], path="dense"))
    assert torch.equal(got[~mixed], int8[~mixed])
    assert policy.rows(None, kernels()).path(8, "q4_1") == "int8"  # no row's kind known
    assert MatmulPolicy().rows(prompt, kernels()).path(8, "q4_1") == "int8"  # no threshold


@needs_kernels
def test_small_batches_run_the_c_fp32_kernel(fp32_kernel_calls: list,
                                            by_batch_size: MatmulPolicy) -> None:
    """Decode-sized batches (the default path below DENSE_MIN_ROWS rows) are the C kernel's."""
    q = QuantizedWeight.quantize(weight(37, 96), "q4_1")
    for m in (1, 3, 17):
        by_rule(q, torch.randn(m, 96), by_batch_size)
    q.linear(torch.randn(2, 96), path="torch")
    assert fp32_kernel_calls == [(37, 96, 1), (37, 96, 3), (37, 96, 17)]


@needs_kernels
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_dense_path_dequantizes_in_c(kind: str) -> None:
    """Big batches: the C dequantizer feeds a dense GEMM; the result is the reference's."""
    q = QuantizedWeight.quantize(weight(40, 96), kind)
    x, bias = torch.randn(130, 96), torch.randn(40)
    close(q.linear(x, bias, path="dense"), x @ q.dequantize().T + bias, x, q.dequantize())
    w = kernels().dequantize(QuantBlocks(kind, q.blocks))
    torch.testing.assert_close(w, q.dequantize(), rtol=1e-6, atol=1e-6)


def policy_of(**environ: str) -> MatmulPolicy:
    return MatmulPolicy.from_env(envs.read(environ))


def test_all_int8_from_environment() -> None:
    assert policy_of().all_int8 and policy_of(V1_QUANT_ALL_INT8="").all_int8
    assert policy_of(V1_QUANT_ALL_INT8="1").all_int8
    assert not policy_of(V1_QUANT_ALL_INT8="0").all_int8
    with pytest.raises(ValueError, match="V1_QUANT_ALL_INT8='2'"):
        policy_of(V1_QUANT_ALL_INT8="2")


def test_int8_min_rows_from_environment() -> None:
    assert policy_of().int8_min_rows is None
    assert policy_of(V1_QUANT_INT8_MIN_ROWS="").int8_min_rows is None
    assert policy_of(V1_QUANT_INT8_MIN_ROWS="16").int8_min_rows == 16
    for bad in ("0", "-3", "x"):
        with pytest.raises(ValueError, match=f"V1_QUANT_INT8_MIN_ROWS='{bad}'.*>= 1"):
            policy_of(V1_QUANT_INT8_MIN_ROWS=bad)


@needs_kernels
def test_strided_and_batched_input() -> None:
    q = QuantizedWeight.quantize(weight(24, 64), "q4_1")
    x = torch.randn(64, 6).T.reshape(2, 3, 64)  # not contiguous
    ref = x.reshape(6, 64) @ q.dequantize().T
    close(q.linear(x, path="fp32"), ref.reshape(2, 3, 24), x, q.dequantize())
    ld = torch.randn(5, 100)[:, :64]  # rows 100 apart
    bias = torch.randn(48)[::2]
    for path in ("fp32", "int8"):
        assert torch.equal(q.linear(ld, path=path), q.linear(ld.contiguous(), path=path))
        assert torch.equal(q.linear(ld, bias, path), q.linear(ld, bias.contiguous(), path))
    close(q.linear(ld, path="fp32"), ld @ q.dequantize().T, ld, q.dequantize())


# The integer dot product each variant's int8 path compiles to (see csrc/isa.h's INT8_ISA).
VARIANT_INT8_ISA = {variant: INT8_ISAS[code] for variant, code
                    in INT8_ISA[variants.architecture(platform.machine())].items()}


@pytest.mark.parametrize("variant", VARIANT_INT8_ISA)
def test_each_variant(variant: str) -> None:
    """Each variant of the library that this CPU runs computes what the chosen one does,
    with the int8 dot product it was built for."""
    if variant not in library.candidates("", platform.machine(), variants.cpu_flags()):
        pytest.skip(f"this CPU does not run {variant}")
    lib = library.load_variant(variant)
    assert not isinstance(lib, str), lib
    q_kernels = QuantKernels(lib)
    assert q_kernels.int8_isa == VARIANT_INT8_ISA[variant]
    for kind in KINDS:
        q = QuantizedWeight.quantize(weight(21, 96), kind)
        for m in (1, 3, 19):
            x = torch.randn(m, 96)
            for int8, path in ((False, "fp32"), (True, "int8")):
                y = q_kernels.linear(QuantBlocks(kind, q.blocks), x, None, int8=int8)
                close(y, q.linear(x, path=path), x, q.dequantize())


@pytest.mark.parametrize("variant", VARIANT_INT8_ISA)
def test_int8_rows_are_the_same_in_any_call(variant: str) -> None:
    """A row's int8 result is bit for bit the same alone and inside calls of 2 .. 40 rows and
    of 64, 65, 129 and 130 (the few-row tile in one group, in groups, tile_i8 past 64 rows with
    AVX2 and 128 with AVX-512), on each variant: every variant computes the same numbers (exact
    integer block sums, one explicit-FMA recurrence), so they also equal each other's. Odd N:
    the few-row tile's last 16 rows are partly copies."""
    if variant not in library.candidates("", platform.machine(), variants.cpu_flags()):
        pytest.skip(f"this CPU does not run {variant}")
    lib = library.load_variant(variant)
    assert not isinstance(lib, str), lib
    q_kernels = QuantKernels(lib)
    chosen = kernels()
    for kind in KINDS:
        for n, k in ((37, 96), (21, 320), (1, 32)):
            g = torch.Generator().manual_seed(n)
            q = QuantizedWeight.quantize(torch.randn(n, k, generator=g), kind)
            blocks = QuantBlocks(kind, q.blocks)
            x, bias = torch.randn(130, k, generator=g), torch.randn(n, generator=g)
            alone = torch.cat([q_kernels.linear(blocks, x[i:i + 1], bias, int8=True)
                               for i in range(130)])
            close(alone, int8_activations(x).double() @ q.dequantize().double().T + bias,
                  x, q.dequantize())
            for m in (*range(2, 41), 64, 65, 129, 130):
                got = q_kernels.linear(blocks, x[:m], bias, int8=True)
                assert torch.equal(got, alone[:m]), (kind, n, k, m)
            assert torch.equal(chosen.linear(blocks, x, bias, int8=True), alone)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Kernels split their work over torch's thread count: 2, so the pool's worker runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def pool_calls() -> list[tuple[QuantizedWeight, torch.Tensor, str]]:
    """Calls big enough to be split into several items: each path, both kinds."""
    calls = []
    for kind in KINDS:
        q = QuantizedWeight.quantize(weight(1024, 512, seed=1), kind)
        for m, path in ((1, "fp32"), (3, "fp32"), (9, "fp32"), (40, "fp32"), (20, "int8"),
                        (300, "dense")):
            calls.append((q, torch.randn(m, 512, generator=torch.Generator().manual_seed(m)),
                          path))
    return calls


@needs_kernels
def test_pool_concurrent_callers(two_threads: None) -> None:
    """Python threads calling kernels at once (the pool runs one job; the others run alone on
    their own thread) all get what a lone caller gets, bit for bit."""
    calls = pool_calls()
    expected = [q.linear(x, path=path) for q, x, path in calls]
    errors: list[str] = []

    def caller(offset: int) -> None:
        for i in range(50):
            k = (offset + i) % len(calls)
            q, x, path = calls[k]
            if not torch.equal(q.linear(x, path=path), expected[k]):
                errors.append(f"call {k} ({path}, {x.shape[0]} rows) differs")

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def _child_linear(conn, q: QuantizedWeight, x: torch.Tensor) -> None:
    torch.set_num_threads(2)
    conn.send(q.linear(x, path="fp32").tolist())  # plain floats: no shared-memory handoff


@needs_kernels
def test_pool_after_fork(two_threads: None) -> None:
    """A forked child has none of its parent's workers: its kernels start their own (without
    that, the first split call waits forever for a worker that does not exist)."""
    q, x, _ = pool_calls()[0]
    expected = q.linear(x, path="fp32")  # the parent's worker exists now
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_linear, args=(child, q, x))
    proc.start()
    try:
        assert parent.poll(60), "the forked child's kernel call did not return"
        assert torch.equal(torch.tensor(parent.recv()), expected)
    finally:
        proc.kill()
        proc.join()


# Run in a fresh interpreter: the worker's scheduling policy cannot be set back unprivileged.
_LATE_WORKER = """
import os, subprocess, sys, time
import torch
from v1.models.layers.quantized import QuantizedWeight
torch.set_num_threads(2)
q = QuantizedWeight.quantize(torch.randn(1536, 576), "q4_1")
x = torch.randn(1, 576)
expected = q.linear(x, path="fp32")  # starts the worker
deadline = time.monotonic() + 60
while True:  # it names itself once it runs
    workers = [int(t) for t in os.listdir("/proc/self/task")
               if open(f"/proc/self/task/{t}/comm").read().strip() == "v1-pool"]
    if workers or time.monotonic() > deadline:
        break
    time.sleep(0.01)
assert len(workers) == 1, workers
cpus = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpus[0]})
hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
try:
    os.sched_setaffinity(hog.pid, {cpus[1]})
    os.sched_setaffinity(workers[0], {cpus[1]})
    os.sched_setscheduler(workers[0], os.SCHED_IDLE, os.sched_param(0))
    time.sleep(0.05)
    t = time.perf_counter()
    for _ in range(30):
        assert torch.equal(q.linear(x, path="fp32"), expected)
    print(time.perf_counter() - t)
finally:
    hog.kill()
"""


@needs_kernels
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_pool_does_not_wait_for_a_late_worker() -> None:
    """A call whose worker cannot get a CPU (SCHED_IDLE, beside a busy process: on a shared
    machine, a worker behind the frontend process or asleep) finishes on the caller's thread
    without waiting for it. (Waiting for every worker to acknowledge each job took a time
    slice of the busy process per call, milliseconds; here, with the worker starved, a caller
    that waited for it to join had not ended the 30 calls after 5 minutes. They take a few
    ms, 0.1 s at a load of 11 on 2 cores: the bound tells a wait apart, it is no speed
    target, which belongs in bench/.)"""
    run = subprocess.run([sys.executable, "-c", _LATE_WORKER], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    seconds = float(run.stdout.split()[-1])
    assert seconds < 10, f"30 batch-1 calls took {seconds:.1f} s"


def test_torch_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """V1_CPU_KERNELS=0: every path is the reference, bit for bit; so are non-fp32 inputs."""
    q = QuantizedWeight.quantize(weight(9, 64), "q4_1")
    x = torch.randn(4, 64)
    ref = torch.nn.functional.linear(x, q.dequantize())
    assert torch.equal(q.linear(x, path="torch"), ref)
    monkeypatch.setenv("V1_CPU_KERNELS", "0")
    assert kernels() is None
    for path in (None, "fp32", "int8"):
        assert torch.equal(q.linear(x, path=path), ref)
    x16 = x.bfloat16()  # the weight follows the activations' dtype
    assert torch.equal(q.linear(x16), torch.nn.functional.linear(x16, q.dequantize().bfloat16()))


def test_embedding_rows() -> None:
    q = QuantizedWeight.quantize(weight(10, 64), "q8_0")
    ids = torch.tensor([[3, 0], [9, 3]])
    assert torch.equal(q.embedding(ids), q.dequantize()[ids])


@needs_kernels  # interleaved layouts come from, and are moved by, the C library
@pytest.mark.parametrize("kind, other", [("q4_1", "q8_0"), ("q8_0", "q4_1")])
def test_repacked_blocks(kind: str, other: str) -> None:
    """q4_1x8 (q8_0x8) holds q4_1's (q8_0's) bytes moved, and back; every path that reads them
    (dequantize, the embedding's rows, the torch fallback, the kernels) sees the same weight."""
    x8 = kind + "x8"
    q = QuantizedWeight.quantize(weight(16, 64), kind)
    moved = QuantizedWeight(kind, q.blocks.clone(), 16, 64)
    moved.repack(x8)
    assert (moved.kind, moved.gguf_kind, moved.nbytes) == (x8, kind, q.nbytes)
    assert not torch.equal(moved.blocks, q.blocks)
    assert torch.equal(moved.blocks, QuantizedWeight.quantize(weight(16, 64), x8).blocks)
    if kind == "q8_0":  # a group's block: dword f of its rows' quants (f < 8), then their d
        group = moved.blocks.view(2, 2, 8 * 34)[1, 0]  # rows 8 .. 15, block 0
        plain = q.blocks.view(2, 8, 2, 34)[1, :, 0]
        assert torch.equal(group[:256].view(8, 8, 4).transpose(0, 1).reshape(8, 32),
                           plain[:, 2:])
        assert torch.equal(group[256:].view(8, 2), plain[:, :2])
    assert torch.equal(moved.dequantize(), q.dequantize())
    for ids in (torch.tensor([[3, 15], [8, 3]]), torch.tensor([15]), torch.tensor([[8], [3]])):
        assert torch.equal(moved.embedding(ids), q.dequantize()[ids])  # gather, a few ids
    x = torch.randn(3, 64)
    assert torch.equal(moved.linear(x, path="torch"), q.linear(x, path="torch"))
    if kernels() is not None:
        assert torch.equal(moved.linear(x, path="int8"), q.linear(x, path="int8"))
    moved.repack(kind)
    assert moved.kind == kind and torch.equal(moved.blocks, q.blocks)
    with pytest.raises(ValueError, match=f"cannot be laid out as '{other}'"):
        moved.repack(other)
    odd = QuantizedWeight.quantize(weight(9, 64), kind)
    with pytest.raises(ValueError, match="multiple of 8 rows"):
        odd.repack(x8)
    with pytest.raises(ValueError, match="multiple of 8"):
        QuantizedWeight(x8, odd.blocks, 9, 64)


@pytest.mark.skipif(kernels() is None, reason="no kernel library")
def test_embedding_of_few_ids_dequantizes_their_groups(monkeypatch) -> None:
    """Up to FEW_IDS ids of an interleaved embedding are each their group's 8 rows through
    the C kernel; more, or an id out of range, take the gather (which raises for the latter)."""
    moved = QuantizedWeight.quantize(weight(16, 64), "q8_0x8")
    calls = []
    dequantize = QuantKernels.dequantize
    monkeypatch.setattr(QuantKernels, "dequantize",
                        lambda self, w: calls.append(len(w.tensor)) or dequantize(self, w))
    ids = torch.tensor([15, 2])
    assert torch.equal(moved.embedding(ids), moved.dequantize()[ids])
    assert calls == [8, 8]
    calls.clear()
    moved.embedding(torch.tensor([15, 2, 3]))
    assert calls == []
    with pytest.raises(IndexError):
        moved.embedding(torch.tensor([16]))


@needs_kernels
@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
def test_repacked_k_quant_blocks(kind: str) -> None:
    """q4_kx8 and q6_kx8 hold q4_k's and q6_k's superblocks moved (q6_k's d, past its whole
    dwords, too), and back: dequantize (gguf's bits), the embedding's rows and the kernels see
    the same weight."""
    gguf_type = gguf.GGMLQuantizationType[kind.upper()]
    raw = quantized(np.zeros((16, 512), np.float32), gguf_type, seed=3)
    q = QuantizedWeight(kind, torch.from_numpy(raw.reshape(16, -1)), 16, 512)
    moved = QuantizedWeight(kind, q.blocks.clone(), 16, 512)
    moved.repack(kind + "x8")
    assert (moved.kind, moved.gguf_kind, moved.nbytes) == (kind + "x8", kind, q.nbytes)
    assert not torch.equal(moved.blocks, q.blocks)
    want = torch.from_numpy(gguf.quants.dequantize(raw, gguf_type))
    assert torch.equal(moved.dequantize(), want) and torch.equal(q.dequantize(), want)
    for ids in (torch.tensor([[3, 15], [8, 3]]), torch.tensor([15]), torch.tensor([[8], [3]])):
        assert torch.equal(moved.embedding(ids), want[ids])  # gather, a few ids
    assert moved.embedding(torch.tensor([], dtype=torch.long)).shape == (0, 512)
    if kernels() is not None:
        x = torch.randn(3, 512)
        assert torch.equal(moved.linear(x, path="int8"), q.linear(x, path="int8"))
    moved.repack(kind)
    assert moved.kind == kind and torch.equal(moved.blocks, q.blocks)


@needs_kernels
def test_loaded_blocks_take_the_library_s_layout() -> None:
    """A finished layer's blocks are in the layout its library's table asks for (q4_1 in
    q4_1x8 on AVX2 and AVX-512), where the rows allow; the weight's form stays q4_1."""
    want = kernels().types["q4_1"].repack or "q4_1"
    for rows, kind in ((16, want), (9, "q4_1")):
        layer = Linear(64, rows, bias=False)
        layer.weight.data.copy_(weight(rows, 64))
        layer.finish_loading("q4_1")
        assert (layer.kernel.kind, layer.weight_form) == (kind, "q4_1")
        x = torch.randn(2, 64)
        expected = QuantizedWeight.quantize(weight(rows, 64), "q4_1").linear(x, path="int8")
        assert torch.equal(layer(x), expected)


def test_bad_shapes() -> None:
    blocks = torch.zeros(4, 40, dtype=torch.uint8)
    with pytest.raises(ValueError, match="in_features=48"):
        QuantizedWeight("q4_1", blocks, 4, 48)
    with pytest.raises(ValueError, match=r"uint8 \[4, 40\], got torch.uint8 \[4, 34\]"):
        QuantizedWeight("q4_1", blocks[:, :34], 4, 64)
    with pytest.raises(ValueError, match="torch.int8"):
        QuantizedWeight("q4_1", blocks.view(torch.int8), 4, 64)
    with pytest.raises(ValueError, match="'q3_k'"):
        QuantizedWeight("q3_k", blocks, 4, 64)
    with pytest.raises(ValueError, match=r"in_features=64 must be a positive multiple of 256"):
        QuantizedWeight("q4_k", blocks, 4, 64)  # a K-quant's blocks hold 256 values
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight.quantize(torch.zeros(4, 40))
    with pytest.raises(ValueError, match="'q5_k'"):
        QuantizedWeight.quantize(torch.zeros(4, 64), "q5_k")
    q = QuantizedWeight("q4_1", blocks, 4, 64)
    with pytest.raises(ValueError, match="input has 32 features, the weight takes 64"):
        q.linear(torch.zeros(2, 32))
    with pytest.raises(ValueError, match="'fast'"):
        q.linear(torch.zeros(2, 64), path="fast")


@pytest.mark.parametrize("kind", KINDS)
def test_int8_rows_do_not_depend_on_their_neighbours(kind: str) -> None:
    """What per-row int8 prompt rows rest on (MatmulPolicy.prompt_int8): a row's int8 result is bit
    for bit the same alone, in any batch size (tiles of 16 rows and their remainders), gathered
    by index, and on 1 or 2 threads."""
    q = QuantizedWeight.quantize(weight(96, 288), kind)
    x = torch.randn(37, 288, generator=torch.Generator().manual_seed(3))
    full = q.linear(x, path="int8")
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for m in (1, 5, 16, 17, 37):
                assert torch.equal(q.linear(x[:m], path="int8"), full[:m]), (n, m)
            picked = torch.tensor([36, 0, 17, 5])
            assert torch.equal(q.linear(x[picked], path="int8"), full[picked])
    finally:
        torch.set_num_threads(threads)
