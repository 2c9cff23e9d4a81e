"""Torch loaded under OpenMP's passive wait policy, for a process that will run an engine.

libgomp reads `OMP_WAIT_POLICY` once, as torch loads, and a forked engine keeps its parent's
runtime; spinning OpenMP threads take the CPU from the kernels' pool and the frontend. The
policy is in the environment only while torch loads (the caller's subprocesses do not inherit
it); a policy the caller set, or a torch already loaded, is left alone. Measurements:
docs/serving.md, "OpenMP's wait policy".
"""

import os
import sys

POLICY_ENV = "OMP_WAIT_POLICY"


def load_torch_passively() -> None:
    if "torch" in sys.modules or POLICY_ENV in os.environ:
        return
    os.environ[POLICY_ENV] = "PASSIVE"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ[POLICY_ENV]
