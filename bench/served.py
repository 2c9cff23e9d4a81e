"""A benchmark's server process (v1's, llama-server): started in its own session, so that
Ctrl-C reaches the benchmark alone, which then stops the server in order; ready once
GET /health answers 200; stopped on the way out with `stop_signal`, then SIGKILL to its
process group after 30 s. Standard library only: llama.cpp's venv imports it too."""

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any


@contextmanager
def served(cmd: Sequence[str], port: int, timeout_s: float,
           stop_signal: int = signal.SIGTERM, **popen: Any) -> Iterator[str]:
    """The base URL of `cmd` listening on `port` of 127.0.0.1 (its stdout goes to stderr:
    a benchmark's stdout ends with its JSON line); `popen`: more subprocess.Popen options."""
    print("starting:", " ".join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=sys.stderr, start_new_session=True, **popen)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with code {proc.returncode}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):  # not listening yet, or 503: loading
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} did not become healthy in {timeout_s:.0f} s")
            time.sleep(0.2)
        yield base
    finally:
        if proc.poll() is None:
            proc.send_signal(stop_signal)
            try:
                proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
