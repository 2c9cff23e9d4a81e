"""Torch loaded under OpenMP's passive wait policy, for a process that will run an engine.

libgomp reads `OMP_WAIT_POLICY` once, as torch loads, and a forked engine keeps its parent's
runtime. Unless passive, OpenMP's threads spin after each parallel region and take the CPU
from the kernels' worker pool and the frontend: on 2 busy cores, a batch of prompts sharing a
system prompt ran 6.7x slower (`bench/bench_ab.py passive=. unset=.,OMP_WAIT_POLICY=
--workloads prefix`). The policy is in the environment only while torch loads: afterwards
the environment is as before, so the caller's own subprocesses (a llama.cpp, another torch
job) do not inherit it. A policy the caller set, or a torch already loaded, is left alone.
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
