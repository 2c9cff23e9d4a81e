"""`weight_empty`: the memory repacked and stacked weight blocks live in (huge pages where the
kernel gives them), usable as any uint8 tensor, with or without transparent huge pages."""

import errno
import mmap
import types

import pytest
import torch

from v1.kernels import tensors
from v1.kernels.interleave import relayout
from v1.kernels.tensors import HUGE_PAGE_BYTES, weight_empty
from v1.models.layers.quantized import QuantizedWeight


def test_small_weights_are_torchs_and_large_ones_hold_their_mapping() -> None:
    small = weight_empty(4, 1024)
    assert small.shape == (4, 1024) and small.dtype == torch.uint8
    assert small.untyped_storage().resizable()  # torch's own allocation
    rows = HUGE_PAGE_BYTES // 1024 + 3  # past 2 MiB, not a multiple of it
    large = weight_empty(rows, 1024)
    assert large.shape == (rows, 1024) and large.is_contiguous()
    assert not large.untyped_storage().resizable()  # the mapping's
    large.fill_(7)
    view = large[-1]
    del large  # the view keeps the mapping alive
    assert int(view.sum()) == 7 * 1024


@pytest.mark.skipif(relayout() is None, reason="no C kernels: nothing interleaves")
def test_a_kernel_without_huge_pages_still_gets_the_memory(monkeypatch) -> None:
    """madvise(MADV_HUGEPAGE) answers EINVAL where the kernel has no transparent huge pages:
    the weights are laid out all the same."""

    class NoHugePages(mmap.mmap):
        def madvise(self, *args: object) -> None:
            raise OSError(errno.EINVAL, "Invalid argument")

    names = {k: getattr(mmap, k) for k in dir(mmap) if k.isupper()}
    monkeypatch.setattr(tensors, "mmap", types.SimpleNamespace(**names, mmap=NoHugePages))
    w = QuantizedWeight.quantize(torch.randn(1024, 2048), "q8_0")  # 2.1 MiB of blocks
    plain = w.blocks.clone()
    w.repack("q8_0x8")
    assert w.blocks.nbytes >= HUGE_PAGE_BYTES
    assert not w.blocks.untyped_storage().resizable()
    w.repack("q8_0")
    assert torch.equal(w.blocks, plain)


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE here")
def test_stacked_weights_are_joined_in_place() -> None:
    parts = [QuantizedWeight.quantize(torch.randn(n, 2048), "q8_0") for n in (1536, 512)]
    joined = QuantizedWeight.stacked(parts, None)  # no kernels: GGUF's layout, joined
    assert joined.kind == "q8_0" and not joined.blocks.untyped_storage().resizable()
    assert torch.equal(joined.blocks, torch.cat([w.blocks for w in parts]))
