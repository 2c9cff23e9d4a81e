"""Small C kernels for the CPU path, built on first use and loaded with ctypes.

The sources live next to the Python that calls them (attention, elementwise ops). A source is
compiled once with the system C compiler (well under a second) into
`$V1_CACHE_DIR/kernels/` (default `~/.cache/v1/kernels/`), keyed by source, compiler, flags
and CPU, and reused from there. Without a compiler, or with `V1_CPU_KERNELS=0`, `load` gives
None and every caller keeps its torch path.
"""

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from v1.config import cache_root

logger = logging.getLogger("v1")

# -march=native: the binary is only valid for this CPU, so the CPU is part of the cache key.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

# What the sources share: 8-float vectors (GCC/Clang vector extensions, which -march=native
# maps to AVX where there is AVX) and e^x on them.
VECTOR_C = r"""
#include <stdint.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 x; __builtin_memcpy(&x, p, 32); return x; }
static inline void store8(float *p, v8 x) { __builtin_memcpy(p, &x, 32); }
static inline float hsum(v8 x) { return x[0] + x[1] + x[2] + x[3] + x[4] + x[5] + x[6] + x[7]; }

static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline v8 select(v8i mask, v8 a, v8 b) { return (v8)((mask & (v8i)a) | (~mask & (v8i)b)); }

/* e^x on 8 lanes: 2^round(x log2 e) times a degree-6 Taylor polynomial of e^f, |f| <= ln2/2
   (relative error ~1e-7). x is clamped to [-87, 88] first: the result is never a denormal
   (~1e-38 at the bottom) nor an overflowed exponent. */
static inline v8 exp8(v8 x) {
    x = select(x < splat(-87.f), splat(-87.f), x);
    x = select(x > splat(88.f), splat(88.f), x);
    v8 t = x * 1.44269504088896341f;
    v8 n = (t + 12582912.f) - 12582912.f;   /* round to nearest (|t| < 2^22) */
    v8 f = (t - n) * 0.69314718055994531f;
    v8 p = f * (1.f / 720) + 1.f / 120;
    p = p * f + 1.f / 24;
    p = p * f + 1.f / 6;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    return p * (v8)e;
}
"""

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _disabled() -> bool:
    return os.environ.get("V1_CPU_KERNELS", "1").lower() in ("0", "false", "no", "off")


def load(name: str, source: str, flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library built from `source` (C) with FLAGS + `flags`, or None if kernels are off
    or it cannot be built. Built at most once per process; the result, None included, is
    remembered. V1_CPU_KERNELS is read on every call, so switching it takes effect at once."""
    if _disabled():
        return None
    if name not in _loaded:
        with _lock:
            if name not in _loaded:
                _loaded[name] = _build(name, source, FLAGS + flags)
    return _loaded[name]


def _build(name: str, source: str, flags: tuple[str, ...]) -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler: the CPU path runs %s in torch", name)
        return None
    cpu = platform.machine() + platform.processor() + _cpu_flags()
    key = hashlib.sha256("\0".join([source, compiler, *flags, cpu]).encode())
    path = cache_root() / "kernels" / f"{name}_{key.hexdigest()[:16]}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                src = Path(tmp) / f"{name}.c"
                src.write_text(source)
                subprocess.run(
                    [compiler, *flags, "-o", str(Path(tmp) / path.name), str(src), "-lm"],
                    check=True, capture_output=True, text=True, timeout=120,
                )
                os.replace(Path(tmp) / path.name, path)  # atomic: others see all or nothing
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("C kernel %s unavailable, using torch: %s", name, detail)
        return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""
