"""The bottom layer: C kernels for the CPU path (`csrc/`) and their ctypes bindings.

`library.py` loads the variant for this CPU, `structs.py` checks every ctypes mirror against
the library's struct layouts, and `block_matmul.py`, `attention.py`, `elementwise.py`,
`fused_step.py` are the bindings: each checks dtypes, shapes, strides and indices before C sees
a pointer (ValueError naming the argument). Which file holds what: docs/kernels.md. Imports
nothing of v1 above it but `v1.envs`.
"""
