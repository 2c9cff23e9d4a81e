"""Without a GPU, the Triton kernels run in Triton's interpreter on CPU tensors.

Triton decides between compiling and interpreting when it decorates a kernel, so the variable
must be set before `v1.attention.ops` is imported: a conftest is loaded before the test modules
of its directory. With CUDA available the kernels are compiled and run on the GPU instead.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
