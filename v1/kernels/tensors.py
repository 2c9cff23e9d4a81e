"""What the bindings share about the tensors they check, and the memory weight blocks live in."""

import mmap
from collections.abc import Sequence

import torch

# Weights this large go on memory advised for transparent huge pages (`weight_empty`).
HUGE_PAGE_BYTES = 2 << 20


def stamp(t: torch.Tensor) -> tuple[int, int]:
    """(address, element count) of `t`: a binding that checked an argument before (the same
    object, the same stamp) need not check it again. What the kernels read of it is that
    many elements from that address: an in-place op that grows or replaces its memory
    (resize_, set_, `.data =`) moves the address or changes the count, and one that keeps
    both (a transpose_, an element-size-preserving view assigned to `.data`) leaves the
    kernels reading the same, allocated memory."""
    return t.data_ptr(), t.numel()


def stamps(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """`stamp` of each tensor, in order (without a Python call per tensor: a step compares
    every layer's cache)."""
    return list(zip(map(torch.Tensor.data_ptr, tensors), map(torch.Tensor.numel, tensors)))


def weight_empty(rows: int, width: int) -> torch.Tensor:
    """An uninitialised uint8 [rows, width] for weight blocks the kernels stream at every
    step: from `HUGE_PAGE_BYTES` up, on anonymous memory advised for transparent huge pages
    (MADV_HUGEPAGE: "madvise" is many distributions' THP mode, where torch's allocations get
    4 KiB pages). Streaming a 1B model's ~600 MB a token through 4 KiB pages costs a TLB miss
    every 4 KiB: the layers of a 1B Q4_K_M decode step took 0.85-0.86x the time on huge pages
    on an AVX2 EPYC (bench/bench_fused_step.py, docs/kernels.md). Elsewhere, or smaller:
    torch's own memory. The blocks start on a 2 MiB boundary (the kernel aligns only mappings
    whose length is a multiple of it: a 4.4 MiB weight got one huge page); the mapping's
    untouched tail is never resident. The mapping lives as long as the tensor (it holds the
    buffer)."""
    nbytes = rows * width
    if nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(rows, width, dtype=torch.uint8)
    memory = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        memory.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # EINVAL: a kernel without transparent huge pages; the memory serves as is
        pass
    whole = torch.frombuffer(memory, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[skip:skip + nbytes].view(rows, width)
