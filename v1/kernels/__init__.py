"""The bottom layer: C kernels for the CPU path and their ctypes bindings.

- `csrc/`: the C sources (the kernel table of block-quantized matmuls, paged-attention decode
  and cache write, elementwise ops, the fused decode step that calls them, the worker pool
  they share), compiled by the package build (`setup.py`) into one shared library per ISA
  variant (`variants.py`); docs/kernels.md explains the table and how to extend it;
- `library.py`: picks and loads the variant for this CPU (V1_CPU_KERNELS);
- `structs.py`: the tensor view the entry points take, and the check of every ctypes mirror
  against the library's struct layouts;
- `block_matmul.py`, `attention.py`, `elementwise.py`, `fused_step.py`: the bindings. Each
  checks dtypes, shapes, strides and indices before C sees a pointer, and raises ValueError
  naming the argument.

Imports nothing of v1 above it but `v1.envs`; `v1.models` and `v1.attention` call it.
"""
