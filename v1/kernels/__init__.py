"""The bottom layer: C kernels for the CPU path and their ctypes bindings.

- `csrc/`: the C sources (quantized matmuls, paged-attention decode and cache write,
  elementwise ops, the fused decode step that calls them, the worker pool they share),
  compiled by the package build (`setup.py`) into one shared library per ISA variant
  (`variants.py`);
- `library.py`: picks and loads the variant for this CPU (V1_CPU_KERNELS);
- `quant.py`, `attention.py`, `elementwise.py`, `decoder.py`: the bindings. Each checks
  dtypes, shapes, strides and indices before C sees a pointer, and raises ValueError naming
  the argument.

Imports nothing of v1 above it; `v1.models` and `v1.attention` call it.
"""
