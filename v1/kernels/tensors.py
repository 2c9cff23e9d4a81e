"""What the bindings share about the tensors they check."""

from collections.abc import Sequence

import torch


def stamp(t: torch.Tensor) -> tuple[int, int]:
    """(address, element count) of `t`: a binding that checked an argument before (the same
    object, the same stamp) need not check it again. What the kernels read of it is that
    many elements from that address: an in-place op that grows or replaces its memory
    (resize_, set_, `.data =`) moves the address or changes the count, and one that keeps
    both (a transpose_, an element-size-preserving view assigned to `.data`) leaves the
    kernels reading the same, allocated memory."""
    return t.data_ptr(), t.numel()


def stamps(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """`stamp` of each tensor, in order (without a Python call per tensor: hundreds of
    weights are compared every step)."""
    return list(zip(map(torch.Tensor.data_ptr, tensors), map(torch.Tensor.numel, tensors)))
