"""llama.cpp as the benchmarks' baseline, as `make bench-llamacpp` builds it under .llamacpp/.

Builds (`BUILDS`): "native" (.llamacpp/build, -march=native without AMX: `make
bench-llamacpp`) and "avx2" (.llamacpp/build-avx2, the x86-64-v3 class: AVX2, FMA, F16C, no
AVX-512, AVX-VNNI or AMX: `make bench-llamacpp-avx2`), so that an AVX-512 machine measures
both CPU classes. Every runner below takes the build to use.

Three ways to run it, all on the GGUF file the engine runs:
- `Worker`: llama-cpp-python in a process of its own venv (.llamacpp/venv, loading the
  libraries of the same build), one request after another, greedy, exactly `max_tokens`
  tokens each (EOS included, as ignore_eos), optionally with its prompt-lookup drafting
  (`LlamaPromptLookupDecoding`, which drafts from the request's own tokens). Its `generate`
  keeps the KV of the longest prefix the new prompt shares with what it evaluated last
  (reset=True does that, despite the name): its fastest mode for one user's requests.
- `server`: `llama-server` with `parallel` slots (continuous batching), OpenAI-compatible.
- `llama_bench`: llama.cpp's own benchmark, `llama-bench` (pp<n> and tg<n> tok/s).

Clean environment: all start without the OMP_*/GOMP_*/KMP_* variables of this process.
bench/common.py puts OMP_WAIT_POLICY=PASSIVE in os.environ for the engine's own libgomp;
llama.cpp's OpenMP threads then sleep between its many small parallel regions and a
llama.cpp started with it ran ~3x slower here. llama.cpp
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
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from served import served

ROOT = Path(__file__).resolve().parent.parent
HOME = ROOT / ".llamacpp"
# Build name -> (its CMake build directory, the make target that builds it).
BUILDS = {"native": (HOME / "build", "bench-llamacpp"),
          "avx2": (HOME / "build-avx2", "bench-llamacpp-avx2")}
PYTHON = HOME / "venv" / "bin" / "python"
# The instruction-set options of this llama.cpp's ggml/CMakeLists.txt, as a build records them.
ISA_OPTIONS = ("GGML_NATIVE", "GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C",
               "GGML_BMI2", "GGML_AVX_VNNI", "GGML_AVX512", "GGML_AVX512_VBMI",
               "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AMX_TILE", "GGML_AMX_INT8",
               "GGML_AMX_BF16")


def bin_dir(build: str = "native") -> Path:
    """A build's programs and the shared libraries they (and llama-cpp-python) load."""
    return BUILDS[build][0] / "bin"


def missing(tool: str | None = None, build: str = "native") -> str | None:
    """Why llama.cpp cannot run here (not built), or None: `tool` None is the worker (the
    venv and the build's library), else that program of the build (llama-server,
    llama-bench, ...)."""
    binaries = bin_dir(build)
    needed = [PYTHON, binaries / "libllama.so"] if tool is None else [binaries / tool]
    absent = [str(p.relative_to(ROOT)) for p in needed if not p.exists()]
    if not absent:
        return None
    targets = {"bench-llamacpp" if tool is None else BUILDS[build][1], BUILDS[build][1]}
    return (f"llama.cpp is not built ({', '.join(absent)} missing): run "
            f"`make {' '.join(sorted(targets))}`")


def build_options(build: str = "native") -> dict[str, str]:
    """How a build was configured: its instruction-set options that are ON (`ISA_OPTIONS`)
    and its extra compiler flags, from its CMakeCache.txt ({} where it is not configured)."""
    try:
        cache = (BUILDS[build][0] / "CMakeCache.txt").read_text()
    except OSError:
        return {}
    return parse_cmake_cache(cache, (*ISA_OPTIONS, "CMAKE_C_FLAGS"))


def parse_cmake_cache(text: str, names: Sequence[str]) -> dict[str, str]:
    """The values of `names` in a CMakeCache.txt (lines NAME:TYPE=VALUE), those whose value is
    empty or OFF left out."""
    values = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        name = key.partition(":")[0]
        if sep and name in names and value and value.upper() != "OFF":
            values[name] = value
    return values


def version() -> str | None:
    """The llama-cpp-python version whose vendored llama.cpp was built (the Makefile's pin)."""
    found = sorted(HOME.glob("llama_cpp_python-*/"))
    return found[-1].name.removeprefix("llama_cpp_python-") if found else None


def clean_env(build: str = "native") -> dict[str, str]:
    """This process's environment without its OpenMP settings (see the module docstring),
    with llama-cpp-python pointed at `build`'s libraries."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    env["LLAMA_CPP_LIB_PATH"] = str(bin_dir(build))
    return env


def default_threads(threads: int | None) -> int:
    return threads or os.cpu_count() or 1


class Worker:
    """llama-cpp-python on `model` in its own process; `run` is one timed sequence of
    requests. The worker keeps one llama.cpp context per drafting configuration."""

    def __init__(self, model: Path, n_ctx: int, threads: int | None = None,
                 build: str = "native") -> None:
        cmd = [str(PYTHON), __file__, str(model), str(n_ctx), str(default_threads(threads))]
        self._proc = subprocess.Popen(cmd, env=clean_env(build), stdin=subprocess.PIPE,
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
           extra_args: Sequence[str] = (), build: str = "native") -> Iterator[str]:
    """The base URL of `build`'s `llama-server` on `model` with `parallel` slots of
    `ctx_per_slot` tokens each (its -c is the total), stopped on the way out. Its output goes
    to stderr."""
    port = free_port()
    threads = default_threads(threads)
    cmd = [str(bin_dir(build) / "llama-server"), "-m", str(model), "--host", "127.0.0.1",
           "--port", str(port), "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
           "-c", str(parallel * ctx_per_slot), "--metrics", *extra_args]
    with served(cmd, port, 120, env=clean_env(build), stderr=sys.stderr) as base:
        yield base


def post(base: str, route: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    """A llama-server endpoint's JSON reply to a JSON POST."""
    request = urllib.request.Request(f"{base}{route}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.loads(resp.read())


def greedy(base: str, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """llama-server's greedy continuation of the token ids `prompt` (taken as they are: no BOS
    added), exactly `max_tokens` tokens (EOS ignored), from an empty context."""
    reply = post(base, "/completion", {
        "prompt": list(prompt), "n_predict": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "cache_prompt": False, "return_tokens": True})
    return reply["tokens"]


def llama_bench(model: Path, threads: int | None = None, build: str = "native",
                prompt_tokens: int = 512, gen_tokens: int = 128, repetitions: int = 1,
                extra_args: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """`build`'s llama-bench on `model`: its pp`prompt_tokens` test (one batch of that many
    tokens into an empty context) and its tg`gen_tokens` test (that many one-token decodes
    from an empty context), each `repetitions` times after its own untimed warm-up, as
    `parse_llama_bench` reads them. Its log goes to stderr."""
    cmd = [str(bin_dir(build) / "llama-bench"), "-m", str(model),
           "-t", str(default_threads(threads)), "-p", str(prompt_tokens),
           "-n", str(gen_tokens), "-r", str(repetitions), "-o", "json", *extra_args]
    out = subprocess.run(cmd, env=clean_env(build), stdout=subprocess.PIPE, text=True,
                         check=True).stdout
    return parse_llama_bench(out)


def parse_llama_bench(text: str) -> dict[str, dict[str, Any]]:
    """llama-bench's `-o json` output by test, named as llama-bench's own table names them
    (pp512, tg128, pp512+tg128, with @d<depth> for a test at a depth): the mean and standard
    deviation over repetitions of its tok/s (`tok_s`, `tok_s_stddev`), the mean seconds of one
    repetition, the per-repetition tok/s, its threads and the llama.cpp commit it was built
    from."""
    tests = {}
    for test in json.loads(text):
        parts = [f"pp{test['n_prompt']}"] if test["n_prompt"] else []
        parts += [f"tg{test['n_gen']}"] if test["n_gen"] else []
        name = "+".join(parts) + (f"@d{test['n_depth']}" if test.get("n_depth") else "")
        tests[name] = {"tok_s": test["avg_ts"], "tok_s_stddev": test["stddev_ts"],
                       "seconds": test["avg_ns"] / 1e9, "samples_tok_s": test["samples_ts"],
                       "threads": test["n_threads"], "build_commit": test["build_commit"]}
    return tests


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
