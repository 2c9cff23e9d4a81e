"""Which path prompt chunks' matmuls take on this machine, per weight kind: measured once,
then cached.

The int8 block kernels and the dense path (the weight dequantized per call, then oneDNN's
GEMM) rank differently by CPU and by block kind: with AVX-512 VNNI int8 wins at every row
count for most kinds, while with AVX2 alone dense can be 1.4x faster from a few hundred rows,
and a kind whose int8 tile is slow at many rows (q6_k next to q4_kx8) can lose to dense where
the others win. `prompt_dense_min_rows` times the two on the model's own weight shapes, each
kind apart, at a few prompt-chunk row counts and gives per kind the smallest count from which
dense is clearly faster (`MatmulPolicy.prompt_dense_min_rows`). The result is kept as JSON
under `<cache dir>/calibration/`, one file per set of facts it depends on (`machine_key`), and
remembered for the process. Figures and why: docs/kernels.md, "Which path a row takes".
"""

import contextlib
import ctypes
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from v1.kernels import variants
from v1.kernels.block_matmul import QuantKernels
from v1.kernels.library import cpu_model
from v1.kernels.variants import cpu_flags
from v1.models.layers.quantized import QuantizedWeight

logger = logging.getLogger("v1")

ROWS = (128, 256, 512)  # prompt-chunk row counts timed
REPEATS = 3  # paired rounds; each figure is the median
# Dense is chosen where it takes at most this fraction of int8's time: a clear margin, so
# that timing noise does not flip the choice between machines of one kind.
MARGIN = 0.9
# A count whose first paired round puts dense/int8 beyond this factor of MARGIN (either way)
# is settled by that round (rounds differ by under 10% on a busy 2-core VM).
CLEAR = 1.2

# (weight, how many times the model multiplies by one of its shape in a forward)
WeightSet = Sequence[tuple[QuantizedWeight, int]]

_FIGURES = ("int8_ms", "dense_ms", "dense_vs_int8")  # Timings' per-row-count fields
# (kind, rows from which its prompt rows take dense), for the kinds that have such a count
DenseMinRows = tuple[tuple[str, int], ...]
_chosen: dict[str, DenseMinRows] = {}  # by cache file name: measured or read in this process


@dataclass(frozen=True, slots=True)
class Timings:
    """At each row count, ms of one forward's matmuls (the weight set) per path and dense's
    time over int8's (the median of the paired rounds' ratios: what the choice reads), and
    the wall time the measurement took."""

    rows: tuple[int, ...]
    int8_ms: tuple[float, ...]
    dense_ms: tuple[float, ...]
    dense_vs_int8: tuple[float, ...]
    took_ms: float

    def choice(self) -> int | None:
        """The smallest measured row count from which dense takes at most MARGIN of int8's
        time, at that count and every larger one; None if the largest misses it."""
        chosen = None
        for rows, ratio in sorted(zip(self.rows, self.dense_vs_int8), reverse=True):
            if ratio > MARGIN:
                break
            chosen = rows
        return chosen

    def describe(self) -> str:
        def join(values: tuple[float, ...], digits: int) -> str:
            return "/".join(f"{v:.{digits}f}" for v in values)

        return (f"rows {'/'.join(map(str, self.rows))}: int8 {join(self.int8_ms, 1)} ms, "
                f"dense {join(self.dense_ms, 1)} ms per forward, dense/int8 "
                f"{join(self.dense_vs_int8, 2)} (measured in {self.took_ms:.0f} ms)")


def measure(q: QuantKernels, weights: WeightSet, rows: Sequence[int] = ROWS,
            repeats: int = REPEATS) -> Timings:
    """Times both paths through every weight of `weights` (each counted as often as the
    model uses its shape) at each row count, from the largest down: rounds paired and
    interleaved (the order alternates), after a dense call to warm up; each figure the
    median of `repeats`, or of the first round alone where its ratio is CLEAR of MARGIN.
    Stops after the first count where dense misses MARGIN: the choice reads no smaller one
    (with AVX-512 VNNI that is the first, timed once: half of three rounds' time)."""
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    xs = {w.in_features: torch.randn(max(rows), w.in_features, generator=gen)
          for w, _ in weights}
    paths = ("int8", "dense")
    samples = {(m, p): [] for m in rows for p in paths}

    def run(m: int, path: str) -> float:
        total = 0.0
        for w, count in weights:
            x = xs[w.in_features][:m]
            t = time.perf_counter()
            w.linear(x, None, path, q)
            total += count * (time.perf_counter() - t)
        return total

    def median_ms(m: int, path: str) -> float:
        return statistics.median(samples[m, path]) * 1e3

    def ratio(m: int) -> float:
        return statistics.median(d / i for d, i in zip(samples[m, "dense"], samples[m, "int8"]))

    measured: list[int] = []
    with torch.inference_mode():
        # The count timed first: dense's first call of a shape sets oneDNN up (the int8
        # kernels have nothing to set up: their first call times as their second).
        run(max(rows), "dense")
        for m in sorted(rows, reverse=True):
            for r in range(repeats):
                for path in (paths if r % 2 == 0 else paths[::-1]):
                    samples[m, path].append(run(m, path))
                if not MARGIN / CLEAR <= ratio(m) <= MARGIN * CLEAR:
                    break
            measured.insert(0, m)
            if ratio(m) > MARGIN:
                break
    return Timings(
        tuple(measured), tuple(median_ms(m, "int8") for m in measured),
        tuple(median_ms(m, "dense") for m in measured), tuple(map(ratio, measured)),
        (time.perf_counter() - start) * 1e3)


def library_id(lib: ctypes.CDLL) -> str:
    """The kernel library's variant (its file name) and the hash of the sources it was built
    from."""
    get_hash = lib.v1_sources_hash
    get_hash.restype = ctypes.c_char_p
    return f"{Path(lib._name).name}:{get_hash().decode()}"


def machine_key(library: str, weights: WeightSet, threads: int) -> dict[str, str]:
    """What the timings depend on: the CPU (model name and the flags the kernel variants
    are built for), the kernel library (`library_id`), torch (version, the ISA its own CPU
    kernels run and the one oneDNN is held to, which serves the dense path), the thread
    count and the weight shapes."""
    flags = set()
    for _, needs in variants.variants_for(platform.machine()).values():
        flags.update(needs)
    return {
        "format": "per kind",  # files of one figure for all kinds have another name
        "cpu": cpu_model(),
        "cpu_flags": " ".join(sorted(flags & cpu_flags())),
        "library": library,
        "torch": f"{torch.__version__} {torch.backends.cpu.get_cpu_capability()}",
        "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA")
        or os.environ.get("DNNL_MAX_CPU_ISA", "ALL"),
        "threads": str(threads),
        "weights": " ".join(sorted(f"{w.kind}:{w.out_features}x{w.in_features}*{n}"
                                   for w, n in weights)),
    }


def prompt_dense_min_rows(
    q: QuantKernels, library: str, weights: WeightSet, cache_dir: Path,
    timer: Callable[[QuantKernels, WeightSet], Timings] | None = None,
) -> DenseMinRows:
    """Per kind of `weights`, the row count from which prompt chunks take "dense" on this
    machine (`Timings.choice` of `timer`, default `measure`, run on that kind's weights
    alone); kinds without one are left out: from this process's earlier answer, else from the
    cache file under `cache_dir`, else measured and written there. Logged at INFO once per
    process with the figures. An unreadable or corrupt cache file is measured again; one
    that cannot be written is only logged."""
    key = machine_key(library, weights, torch.get_num_threads())
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = cache_dir / f"{digest}.json"
    if str(path) in _chosen:
        return _chosen[str(path)]
    kinds = sorted({w.kind for w, _ in weights})
    by_kind = _read(path, key, kinds)
    source = "from cache"
    if by_kind is None:
        by_kind = {kind: (measure if timer is None else timer)(
            q, [(w, n) for w, n in weights if w.kind == kind]) for kind in kinds}
        _write(path, key, by_kind)
        source = "measured"
    chosen = tuple((kind, rows) for kind, t in by_kind.items()
                   if (rows := t.choice()) is not None)
    for kind, t in by_kind.items():
        rows = t.choice()
        logger.info("matmul calibration (%s, %s threads, %s): %s %s: prompt chunks %s",
                    library, key["threads"], source, kind, t.describe(),
                    "take int8 at every size" if rows is None
                    else f"of {rows}+ rows take dense, smaller ones int8")
    _chosen[str(path)] = chosen
    return chosen


def _timings(data: dict) -> Timings:
    """A kind's `Timings` as `_write` stores them; ValueError, KeyError or TypeError if not."""
    timings = Timings(tuple(int(r) for r in data["rows"]),
                      *(tuple(float(v) for v in data[f]) for f in _FIGURES),
                      float(data["took_ms"]))
    if len({len(timings.rows), *(len(getattr(timings, f)) for f in _FIGURES)}) != 1:
        raise ValueError("figures of unequal lengths")
    if not all(math.isfinite(v) and v > 0 for f in _FIGURES for v in getattr(timings, f)):
        raise ValueError("a figure is not a positive number")
    return timings


def _read(path: Path, key: dict[str, str], kinds: list[str]) -> dict[str, Timings] | None:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.warning("matmul calibration: cannot read %s (%s): measuring again", path, e)
        return None
    try:
        data = json.loads(raw)  # bytes that are not UTF-8 JSON: ValueError
        if data["key"] != key:
            raise ValueError("written for other facts")
        if sorted(data["kinds"]) != kinds:
            raise ValueError(f"kinds {sorted(data['kinds'])}, not {kinds}")
        return {kind: _timings(data["kinds"][kind]) for kind in kinds}
    except (ValueError, KeyError, TypeError) as e:
        logger.warning("matmul calibration: %s is corrupt (%s): measuring again", path, e)
        return None


def _write(path: Path, key: dict[str, str], by_kind: dict[str, Timings]) -> None:
    data = {"key": key, "kinds": {
        kind: {"rows": t.rows, **{f: getattr(t, f) for f in _FIGURES}, "took_ms": t.took_ms,
               "prompt_dense_min_rows": t.choice()} for kind, t in by_kind.items()}}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)  # whole or absent: another process may read it now
    except OSError as e:
        logger.warning("matmul calibration: cannot write %s (%s): measured again next start",
                       path, e)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
