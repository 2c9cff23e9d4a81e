"""llama.cpp as the benchmarks' baseline, as `make bench-llamacpp` builds it under .llamacpp/.

Two ways to run it, both on the GGUF file the engine runs:
- `Worker`: llama-cpp-python in a process of its own venv (.llamacpp/venv, loading the
  libraries of the same build), one request after another, greedy, exactly `max_tokens`
  tokens each (EOS included, as ignore_eos), optionally with its prompt-lookup drafting
  (`LlamaPromptLookupDecoding`, which drafts from the request's own tokens). Its `generate`
  keeps the KV of the longest prefix the new prompt shares with what it evaluated last
  (reset=True does that, despite the name): its fastest mode for one user's requests.
- `server`: `llama-server` with `parallel` slots (continuous batching), OpenAI-compatible.

Clean environment: both start without the OMP_*/GOMP_*/KMP_* variables of this process.
bench/common.py (as the `v1` command) puts OMP_WAIT_POLICY=PASSIVE in os.environ for the
engine's own libgomp; llama.cpp's OpenMP threads then sleep between its many small parallel
regions and a llama.cpp started with it ran ~3x slower here. llama.cpp
runs under its own defaults instead, with all cores (`threads`: os.cpu_count() unless given;
llama-cpp-python's own default is half of them).

Run as a script (by `Worker`, under .llamacpp/venv/bin/python), this file is the worker:
JSON lines on stdin ({"prompts": [[ids]], "max_tokens": n, "lookup": null | {...}}), one JSON
line per run on stdout ({"seconds": s, "outputs": [[ids]]}). It imports nothing of this
repository: that venv has neither torch nor v1.
"""

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from served import served

ROOT = Path(__file__).resolve().parent.parent
HOME = ROOT / ".llamacpp"
BIN = HOME / "build" / "bin"  # llama-server and the shared libraries llama-cpp-python loads
SERVER = BIN / "llama-server"
PYTHON = HOME / "venv" / "bin" / "python"


def missing(server: bool = False) -> str | None:
    """Why llama.cpp cannot run here (not built), or None: the worker needs the venv and the
    library, `server=True` llama-server."""
    needed = [SERVER] if server else [PYTHON, BIN / "libllama.so"]
    absent = [str(p.relative_to(ROOT)) for p in needed if not p.exists()]
    if absent:
        return f"llama.cpp is not built ({', '.join(absent)} missing): run `make bench-llamacpp`"
    return None


def version() -> str | None:
    """The llama-cpp-python version whose vendored llama.cpp was built (the Makefile's pin)."""
    found = sorted(HOME.glob("llama_cpp_python-*/"))
    return found[-1].name.removeprefix("llama_cpp_python-") if found else None


def clean_env() -> dict[str, str]:
    """This process's environment without its OpenMP settings (see the module docstring),
    with llama-cpp-python pointed at the build's libraries."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    env["LLAMA_CPP_LIB_PATH"] = str(BIN)
    return env


def default_threads(threads: int | None) -> int:
    return threads or os.cpu_count() or 1


class Worker:
    """llama-cpp-python on `model` in its own process; `run` is one timed sequence of
    requests. The worker keeps one llama.cpp context per drafting configuration."""

    def __init__(self, model: Path, n_ctx: int, threads: int | None = None) -> None:
        cmd = [str(PYTHON), __file__, str(model), str(n_ctx), str(default_threads(threads))]
        self._proc = subprocess.Popen(cmd, env=clean_env(), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)

    def run(self, prompts: Sequence[Sequence[int]], max_tokens: int,
            lookup: dict[str, int] | None = None) -> tuple[float, list[list[int]]]:
        """Seconds and outputs of `prompts`, one after another, from a cold context (the
        first prompt reuses nothing). `lookup`: LlamaPromptLookupDecoding's arguments
        (max_ngram_size, num_pred_tokens), or None for plain decoding."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        request = {"prompts": [list(p) for p in prompts], "max_tokens": max_tokens,
                   "lookup": lookup}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp worker exited with code {self._proc.wait()}")
        reply = json.loads(line)
        return reply["seconds"], reply["outputs"]

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()  # end of input: the worker returns
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(model: Path, parallel: int, ctx_per_slot: int, threads: int | None = None,
           extra_args: Sequence[str] = ()) -> Iterator[str]:
    """The base URL of a `llama-server` on `model` with `parallel` slots of `ctx_per_slot`
    tokens each (its -c is the total), stopped on the way out. Its output goes to stderr."""
    port = free_port()
    threads = default_threads(threads)
    cmd = [str(SERVER), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
           "-c", str(parallel * ctx_per_slot), "--metrics", *extra_args]
    with served(cmd, port, 120, env=clean_env(), stderr=sys.stderr) as base:
        yield base


def _worker_main(model: str, n_ctx: int, threads: int) -> None:
    """The worker loop (in .llamacpp/venv): see the module docstring."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    contexts: dict[str, Any] = {}  # drafting configuration (JSON) -> its Llama
    for line in sys.stdin:
        request = json.loads(line)
        key = json.dumps(request["lookup"], sort_keys=True)
        if key not in contexts:
            draft = LlamaPromptLookupDecoding(**request["lookup"]) if request["lookup"] else None
            # logits_all with a draft model: llama-cpp-python 0.3.36 forces it on, but sizes
            # its logits buffer from the argument (n_batch rows), which a prompt longer than
            # n_batch then overruns.
            contexts[key] = Llama(model_path=model, n_ctx=n_ctx, n_batch=512, n_threads=threads,
                                  n_threads_batch=threads, draft_model=draft,
                                  logits_all=draft is not None, verbose=False)
        llm = contexts[key]
        llm.reset()  # a cold start: nothing of the previous run is reused
        max_tokens = request["max_tokens"]
        outputs: list[list[int]] = []
        t0 = time.perf_counter()
        for prompt in request["prompts"]:
            tokens: list[int] = []
            for token in llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True):
                tokens.append(token)  # EOS too: as ignore_eos, every request gets its length
                if len(tokens) == max_tokens:
                    break
            outputs.append(tokens)
        seconds = time.perf_counter() - t0
        print(json.dumps({"seconds": seconds, "outputs": outputs}), flush=True)


if __name__ == "__main__":
    _worker_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
