"""Helpers shared by the end-to-end benchmarks (bench_prefix_cache.py, bench_throughput.py).

- loading the model once for the engine and for the HF transformers baseline (the baseline reads
  the HF-format directory the engine's loader produced, so both run the very same fp32 weights);
- building an in-process `LLM` on already loaded weights, whatever the engine's default
  process layout is;
- HF `generate` in left-padded batches with exactly the requested number of new tokens;
- the output: a fixed-width table, a PNG, and one JSON object as the last line of stdout.
"""

import argparse
import functools
import glob
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# libgomp reads this once, when torch is imported. By default an OpenMP thread that reaches a
# barrier first spins for a while; on a machine shared with other busy processes (2 cores
# here) the spinning thread keeps its partner off the CPU, and every parallel op can then
# wait out a scheduler time slice: small ops measured 100x slower, GEMMs 3x. Sleeping waiters
# avoid that; both the engine and the HF baseline run under the same setting. Set
# OMP_WAIT_POLICY=ACTIVE (or anything) in the environment to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

# The CPU flags that decide which kernels run (v1's variants and llama.cpp's native build).
CPU_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni",
             "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16", "asimd", "asimddp")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a .gguf file or HF model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: leave torch's default)")


def add_common_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    parser.add_argument("--repeat", type=int, default=3,
                        help="engine runs per configuration; the median is reported")
    parser.add_argument("--hf-batch-size", type=int, default=8, help="HF generate batch size")
    parser.add_argument("--hf-repeat", type=int, default=1,
                        help="HF baseline runs (the median is reported)")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--out", default=None, help="directory for the JSON result and a PNG plot")


def setup_threads(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)


def load(model: str | None, quantization: str | None = None):
    """The engine's `LoadedModel` (fp32 compute, CPU, torch attention backend), its weights
    as `LLM(quantization=...)` loads them (unset: a .gguf file's blocks, as the engine's
    default)."""
    from v1.attention.backends.torch_attn import TorchAttentionImpl
    from v1.models.loader import load_model, resolve_quantization
    from v1.models.model_files import resolve_model

    path, cpu = resolve_model(model), torch.device("cpu")
    return load_model(path, torch.float32, cpu, TorchAttentionImpl,
                      quantization=resolve_quantization(quantization, path, cpu, torch.float32))


def make_llm(loaded: Any, **kwargs: Any):
    """An `LLM` in this process on `loaded`'s weights (no second copy, no engine process)."""
    from v1.entrypoints.llm import LLM

    return LLM(loaded_model=loaded, multiprocess=False, **kwargs)


def make_process_llm(model: str | None, **kwargs: Any):
    """An `LLM` whose engine core runs in its own process (the default `LLM`), over ZMQ."""
    from v1.entrypoints.llm import LLM

    return LLM(model=model, multiprocess=True, **kwargs)


def load_hf(loaded: Any):
    from transformers import AutoModelForCausalLM

    from v1.models.gguf_cache import hf_checkpoint_dir

    model = AutoModelForCausalLM.from_pretrained(hf_checkpoint_dir(loaded.model_path),
                                                 dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    output_lens: Sequence[int],
    batch_size: int,
    pad_token_id: int,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[float, list[list[int]]]:
    """Greedy `generate` over batches of `batch_size` consecutive prompts, left-padded.

    Each batch generates exactly max(output_lens of the batch) tokens (min_new_tokens =
    max_new_tokens, so EOS cannot end it early); a request's output is cut to its own length.
    Returns the wall time and the outputs.
    """
    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        lens = output_lens[start : start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        n = max(lens)
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=pad_token_id, eos_token_id=None,
        )
        outputs.extend(row[width : width + k].tolist() for row, k in zip(out, lens))
        if progress:
            progress(start + len(batch), len(prompts))
    return time.perf_counter() - t0, outputs


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first differing token (len of the shorter when one prefixes the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def agreement(ours: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> dict[str, float]:
    """How far greedy outputs agree: exact matches, and the mean identical prefix fraction.
    (fp32 rounding differs between batched/padded HF and the engine, so near-ties can flip.)"""
    exact = sum(list(a) == list(b) for a, b in zip(ours, ref))
    prefix = [first_divergence(a, b) / max(1, len(b)) for a, b in zip(ours, ref)]
    return {"exact_match": exact / max(1, len(ref)),
            "mean_common_prefix": statistics.fmean(prefix) if prefix else 0.0}


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def time_call(fn: Callable[[], object], reps: int) -> float:
    """Mean seconds of one call of `fn` over `reps` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def seconds_per_call(fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of `repeat` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(h) for h in header]] + [
        [f"{c:.3f}" if isinstance(c, float) else str(c) for c in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for j, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def write_outputs(out_dir: str | None, name: str, result: dict[str, Any],
                  plot: Callable[[Any], None]) -> None:
    """`out_dir/name.json` and `out_dir/name.png` (plot(fig) draws on a fresh figure)."""
    if not out_dir:
        return
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(10, 4))
    plot(fig)
    fig.tight_layout()
    fig.savefig(path / f"{name}.png", dpi=120)
    plt.close(fig)


def bar(ax: Any, labels: Sequence[str], values: Sequence[float], ylabel: str, title: str) -> None:
    bars = ax.bar(labels, values, color=["tab:blue", "tab:orange", "tab:gray", "tab:green"]
                  [: len(labels)])
    for b, v in zip(bars, values):
        ax.annotate(f"{v:.3g}", (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom")
    ax.set_ylabel(ylabel)
    ax.set_title(title)


def cpu_seconds() -> float:
    """CPU time (user + system, all threads) of this process and its live children (an engine
    process), from /proc (Linux): what a run computed, beside how long it waited."""
    me, tick = os.getpid(), os.sysconf("SC_CLK_TCK")
    total = 0.0
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(stat.split("/")[2]) == me or int(fields[1]) == me:  # fields[1]: the parent pid
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def cpu_line(cpu: dict[str, Any]) -> str:
    """`cpu_info`'s record as the line a result prints to name its CPU."""
    return (f"CPU: {cpu['model']} ({cpu['vendor']} {cpu['family_model_stepping']}), flags: "
            f"{' '.join(cpu['flags']) or 'none of ' + ' '.join(CPU_FLAGS)}")


def cpu_info(cpuinfo: str) -> dict[str, Any]:
    """The CPU of a /proc/cpuinfo text (its first processor): model name, vendor, family,
    model and stepping numbers (a VM may hide the name, not those), and which of `CPU_FLAGS`
    it has."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:  # the blank line after the first processor
                break
            continue
        fields.setdefault(key.strip(), value.strip())
    flags = set((fields.get("flags") or fields.get("Features", "")).split())
    numbers = ("cpu family", "model", "stepping")
    return {"model": fields.get("model name", platform.processor() or platform.machine()),
            "vendor": fields.get("vendor_id", ""),
            "family_model_stepping": "/".join(fields.get(k, "?") for k in numbers),
            "flags": [f for f in CPU_FLAGS if f in flags]}


def v1_kernel_library() -> str:
    """The file name of the kernel library this process's V1_CPU_KERNELS setting loads (an
    engine process started from here loads the same), or "none"."""
    from v1.kernels.library import library

    lib = library()
    return Path(lib._name).name if lib is not None else "none"


def environment(kernels: bool = True) -> dict[str, Any]:
    """What a result must name to be compared: torch and its threads, the CPU and which of
    v1's kernel libraries ran (`kernels` False: a run that measured another server, or several
    libraries, names none), the load when the run started."""
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(),
           "cpus": os.cpu_count(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
           "cpu": cpu_info(Path("/proc/cpuinfo").read_text()),
           "loadavg_1m": round(os.getloadavg()[0], 2)}
    if kernels:
        env["v1_kernel_library"] = v1_kernel_library()
    return env


class CallClock:
    """perf_counter seconds spent in patched calls, summed by name into `_spent` (which a
    subclass resets and files away once per step)."""

    def __init__(self, names: Sequence[str]) -> None:
        self._names = tuple(names)
        self._reset()

    def _reset(self) -> None:
        self._spent = dict.fromkeys(self._names, 0.0)

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._spent[name] += time.perf_counter() - t0
        return timed


def rss_mb(pid: int, kind: str = "VmRSS") -> float | None:
    """A process's resident memory in MB from /proc (`kind` "RssAnon": its heap's alone), or
    None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    kb = next((line.split()[1] for line in status.splitlines() if line.startswith(kind + ":")), 0)
    return round(int(kb) / 1024, 1)


def process_parents() -> dict[int, int]:
    """Every live process's parent, from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    return parents


def descendants(pid: int) -> set[int]:
    """Every live process under `pid` (children, theirs, ...), from /proc."""
    parents = process_parents()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def engine_core_pid(frontend: int) -> int | None:
    """The frontend's descendant with the most resident memory: the engine core (weights)."""
    return max(descendants(frontend), key=lambda p: rss_mb(p) or 0.0, default=None)
