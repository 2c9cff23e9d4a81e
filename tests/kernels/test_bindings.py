"""Every binding checks what its C assumes before C sees a pointer: a ValueError naming the
argument for each way an argument can be wrong, and a good call beside the bad ones."""

import pytest
import torch

from v1.kernels import attention
from v1.kernels.attention import paged_decode_kernel
from v1.kernels.block_matmul import QuantBlocks, kernels
from v1.kernels.elementwise import native_ops
from v1.kernels.interleave import BlockParts, relayout
from v1.kernels.library import library
from v1.models.layers.quantized import QuantizedWeight

pytestmark = pytest.mark.skipif(library() is None, reason="no C kernels")


def test_quant_linear_checks() -> None:
    q = kernels()
    blocks = QuantizedWeight.quantize(torch.randn(24, 64), "q4_1").blocks  # 24 x 40 bytes
    w = QuantBlocks("q4_1", blocks)
    x, bias = torch.randn(3, 64), torch.randn(24)
    assert q.linear(w, x, bias).shape == (3, 24)
    assert q.linear(w, torch.randn(3, 71)[:, :64], None).shape == (3, 24)  # rows 71 apart

    def with_blocks(kind: str, b: torch.Tensor):
        return lambda: q.linear(QuantBlocks(kind, b), x, bias)

    bad = {
        "kind": with_blocks("q2_k", blocks),  # a GGUF type no row has
        "blocks": with_blocks("q4_1", blocks.view(torch.int8)),
        "blocks ": with_blocks("q4_1", blocks.t().contiguous().t()),
        "blocks  ": with_blocks("q4_1", blocks[:, :30]),
        "blocks   ": with_blocks("q8_0", blocks),  # 40 bytes: no whole q8_0 block
        "x": lambda: q.linear(w, x.double(), bias),
        "x ": lambda: q.linear(w, torch.randn(3, 32), bias),
        "x  ": lambda: q.linear(w, torch.randn(3, 64, 1), bias),
        "x   ": lambda: q.linear(w, torch.randn(64, 3).t(), bias),  # columns strided
        "bias": lambda: q.linear(w, x, bias.double()),
        "bias ": lambda: q.linear(w, x, bias[:12]),
        "bias  ": lambda: q.linear(w, x, torch.randn(48)[::2]),
    }
    for name, call in bad.items():
        with pytest.raises(ValueError, match=f"^{name.strip()}"):
            call()
    with pytest.raises(ValueError, match="^blocks"):
        q.dequantize(QuantBlocks("q4_1", blocks[:, :30]))
    # Checked once, and again after a change in place.
    w = QuantBlocks("q4_1", blocks.clone())
    q.linear(w, x, None)
    w.tensor.resize_(12, 40)
    assert q.linear(w, x, None).shape == (3, 12)
    w.tensor.set_(torch.zeros(6, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="^blocks"):
        q.linear(w, x, None)


def test_quantized_weight_takes_strided_input_and_bias() -> None:
    """What the layer hands the binding is made acceptable first (rows copied contiguous,
    bias made contiguous): strided inputs are not errors."""
    w = QuantizedWeight.quantize(torch.randn(24, 64), "q4_1")
    x = torch.randn(64, 3).t()
    bias = torch.randn(48)[::2]
    torch.testing.assert_close(w.linear(x, bias, path="fp32"),
                               x @ w.dequantize().T + bias, rtol=1e-5, atol=1e-5)


def test_elementwise_checks() -> None:
    ops = native_ops()
    x, res, w = torch.randn(4, 40), torch.randn(4, 40), torch.randn(40)
    ops.rms_norm(x, res.clone(), w, 1e-5)
    qk = torch.randn(5, 3, 16)
    cos, sin = torch.randn(5, 1, 16), torch.randn(5, 1, 16)
    ops.rope(qk.clone(), cos, sin)
    bad = {
        "x": lambda: ops.rms_norm(x.double(), None, w, 1e-5),
        "x ": lambda: ops.rms_norm(torch.randn(40, 4).t(), None, torch.randn(4), 1e-5),
        "residual": lambda: ops.rms_norm(x, res[:3], w, 1e-5),
        "residual ": lambda: ops.rms_norm(x, torch.randn(40, 4).t(), w, 1e-5),
        "weight": lambda: ops.rms_norm(x, res, w[:20], 1e-5),
        "weight ": lambda: ops.rms_norm(x, res, torch.randn(80)[::2], 1e-5),
        "qk": lambda: ops.rope(qk.view(5, 48), cos, sin),
        "qk's heads": lambda: ops.rope(torch.randn(3, 5, 16).transpose(0, 1), cos, sin),
        "qk's heads ": lambda: ops.rope(torch.randn(5, 3, 15), cos[..., :15], sin[..., :15]),
        "cos": lambda: ops.rope(qk, cos[:4], sin),
        "sin": lambda: ops.rope(qk, cos, sin.double()),
        "sin ": lambda: ops.rope(qk, cos, torch.randn(5, 1, 32)[..., ::2]),
        "gate_up": lambda: ops.silu_and_mul(torch.randn(3, 8).double()),
        "gate_up has": lambda: ops.silu_and_mul(torch.randn(3, 9)),
    }
    for name, call in bad.items():
        with pytest.raises(ValueError, match=f"^{name.strip()}"):
            call()


class Step:
    """A valid two-entry step on a cache of 8 blocks of 16: entry i reads query row i."""

    def __init__(self) -> None:
        self.cache = torch.zeros(2, 8, 16, 3, 64)
        self.kernel = paged_decode_kernel(self.cache, 9)
        self.table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
        self.rows, self.tokens = torch.tensor([0, 1]), torch.tensor([0, 1])
        self.start, self.end = torch.tensor([0, 0]), torch.tensor([20, 40])
        self.slots = torch.tensor([19, 39])

    def bind(self, **changed):
        args = dict(table=self.table, table_rows=self.rows, tokens=self.tokens,
                    start=self.start, end=self.end, slots=self.slots, kv_cache=self.cache)
        return self.kernel.bind(**{**args, **changed})


@pytest.mark.parametrize("list_max", [attention.LIST_MAX_ENTRIES, 0])  # entries as lists, numpy
def test_paged_decode_bind_checks(monkeypatch, list_max) -> None:
    monkeypatch.setattr(attention, "LIST_MAX_ENTRIES", list_max)
    s = Step()
    assert s.bind().max_token == 1
    bad = {
        "kv_cache": dict(kv_cache=s.cache.bfloat16()),
        "kv_cache ": dict(kv_cache=torch.zeros(2, 8, 16, 3, 128)[..., ::2]),
        "table": dict(table=s.table.long()),
        "table ": dict(table=s.table.t().contiguous().t()),
        "tokens": dict(tokens=s.tokens.int()),
        "end": dict(end=torch.tensor([20, 40, 1])),
        "slots": dict(slots=torch.tensor([[19, 39]])),
        "table row 2 is outside": dict(table_rows=torch.tensor([0, 2])),
        "table row -1 is outside": dict(table_rows=torch.tensor([-1, 0])),
        "query row -1": dict(tokens=torch.tensor([-1, 1])),
        "key positions": dict(start=torch.tensor([0, 41])),
        "key positions ": dict(start=torch.tensor([-1, 0])),
        "65 keys need more": dict(end=torch.tensor([20, 65])),
        "block id 8 is outside": dict(table=s.table + 1),
        "slot 128 is past": dict(slots=torch.tensor([19, 128])),
    }
    for name, changed in bad.items():
        with pytest.raises(ValueError, match=f"^{name.strip()}"):
            s.bind(**changed)


def test_paged_decode_call_checks() -> None:
    s = Step()
    step = s.bind()
    query, out = torch.randn(2, 9, 64), torch.empty(2, 9, 64)
    key, value = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    s.kernel(step, query, s.cache, out, None, 0.125, key, value)
    s.kernel(step, query, s.cache, out, torch.empty(2, 9), 0.125)
    bad = {
        "kv_cache": (query, torch.zeros(2, 9, 16, 3, 64), out, None, None, None),
        "key and value": (query, s.cache, out, None, key, None),
        "key": (query, s.cache, out, None, key[:1], value),
        "value": (query, s.cache, out, None, key, value[:, :2]),
        "value ": (query, s.cache, out, None, key, value.double()),
        "query": (query.double(), s.cache, out, None, None, None),
        "query ": (query[:1], s.cache, out, None, None, None),  # entry 1 reads row 1
        "query  ": (torch.randn(2, 8, 64), s.cache, out, None, None, None),  # 8 on 3 kv heads
        "query   ": (torch.randn(2, 9, 32), s.cache, out, None, None, None),
        "out": (query, s.cache, None, None, None, None),
        "out ": (query, s.cache, torch.empty(9, 2, 64).transpose(0, 1), None, None, None),
        "out  ": (query, s.cache, out.bfloat16(), None, None, None),
        "lse": (query, s.cache, out, torch.empty(9, 2).t(), None, None),
        "lse ": (query, s.cache, out, torch.empty(2, 8), None, None),
    }
    for name, (q, cache, o, lse, k, v) in bad.items():
        with pytest.raises(ValueError, match=f"^{name.strip()}"):
            s.kernel(step, q, cache, o, lse, 0.125, k, v)


def test_relayout_checks() -> None:
    """The block relayout refuses what its C would read or write past."""
    move = relayout()
    parts = BlockParts(34, 0, 8, 2)  # q8_0: 8 dwords, then 2 bytes
    src = torch.zeros(16, 68, dtype=torch.uint8)
    dst = torch.empty_like(src)
    move(src, dst, 8, parts, True)
    bad = {
        "src": lambda: move(src.view(torch.int8), dst, 8, parts, True),
        "dst": lambda: move(src, dst[:8], 8, parts, True),
        "dst ": lambda: move(src, torch.empty(68, 16, dtype=torch.uint8).t(), 8, parts, True),
        "blocks": lambda: move(src[:12], dst[:12], 8, parts, True),  # 12 rows: no 8-row group
        "blocks ": lambda: move(src, dst, 8, BlockParts(34, 0, 8, 3), True),
        "blocks  ": lambda: move(src, dst, 32, parts, True),  # more rows than a group may have
        "blocks   ": lambda: move(src, dst, 8, BlockParts(34, 2, 8, 100), True),  # lead, rest
        "blocks    ": lambda: move(src, dst, 8, BlockParts(0, 0, 0, 0), True),
        "blocks     ": lambda: move(src, dst, 8, BlockParts(34, -2, 9, 0), True),
        "dst overlaps": lambda: move(src, src, 8, parts, True),
    }
    for name, call in bad.items():
        with pytest.raises(ValueError, match=f"^{name.strip()}"):
            call()
    empty = torch.zeros(8, 0, dtype=torch.uint8)
    move(empty, torch.empty_like(empty), 8, parts, True)  # nothing to move
