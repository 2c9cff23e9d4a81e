"""What the kernel libraries are built from and for which CPUs: read by `setup.py` (the build)
and by `v1.kernels.library` (the choice at import), so it imports nothing of v1's.

Every variant is one shared library, `v1/kernels/_v1_<variant>.so`, holding every kernel. On
x86-64 the build makes x86_64_v4 (AVX-512 + VNNI), x86_64_v3_vnni (x86_64_v3 + AVX-VNNI),
x86_64_v3 (AVX2, FMA, F16C) and portable (the baseline, -O2); on AArch64 armv8_2_dotprod (NEON
+ the dot-product extension) and portable; elsewhere only portable. "native" and the
`<variant>_asan` sanitizer builds are made on request and never chosen by themselves. Why
these: docs/kernels.md, "Adding an instruction set".
"""

import hashlib
import os
import shlex
import sysconfig
from collections.abc import Sequence
from pathlib import Path

# Source files of csrc/ compiled into every library, with flags of their own.
SOURCES: dict[str, tuple[str, ...]] = {
    "pool.c": (),
    "layout.c": (),
    "interleave.c": (),
    # The kernel table (block_types.h): its rows, its entry points, each type's tuned
    # kernels and the plain C references.
    "block_types.c": (),
    "block_matmul.c": (),
    "block_q4_1.c": (),
    "block_q4_1x8.c": (),
    "block_q8_0.c": (),
    "block_q8_0x8.c": (),
    "block_q4_0.c": (),
    "block_q5_0.c": (),
    "block_q5_1.c": (),
    "block_f16.c": (),
    "block_bf16.c": (),
    "block_ref.c": (),
    # The K-quants: dequantize must round as gguf's numpy does (no FMA contraction).
    "block_q4_k.c": ("-ffp-contract=off",),
    "block_q4_kx8.c": ("-ffp-contract=off",),
    "block_q5_k.c": ("-ffp-contract=off",),
    "block_q6_k.c": ("-ffp-contract=off",),
    "block_q6_kx8.c": ("-ffp-contract=off",),
    "block_ref_k.c": ("-ffp-contract=off",),
    # a * b + c rounded twice, as the torch ops it must match bit for bit do.
    "elementwise.c": ("-ffp-contract=off",),
    "paged_decode_f32.c": (),
    "paged_decode_bf16.c": (),
    "paged_decode_f16.c": (),
    # Calls the others' entry points only (no arithmetic of its own to round).
    "fused_decode_step.c": (),
}
HEADERS = ("block_ktiles.h", "block_nibbles.h", "block_tiles.h", "block_types.h",
           "fused_decode_step.h", "isa.h", "isa_arm.h", "isa_generic.h", "isa_x86.h", "kernels.h",
           "kv_rows.h", "paged_decode.h", "pool.h", "v1.h", "vec.h", "vec8.h")

COMMON_FLAGS = ("-std=gnu11", "-fPIC", "-fvisibility=hidden", "-pthread", "-Wall", "-Wextra",
                "-Wno-psabi")  # psabi: GCC notes that 64-byte vectors pass differently
LINK_FLAGS = ("-shared", "-pthread", "-lm")

_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave",
       "cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3")
_V4 = (*_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni")

# Tuning (not the instruction set): GCC's generic tuning ran the kernels markedly slower than
# a -march=native build on the machines they were written on; znver3 matched it
# (docs/kernels.md).
_TUNE = "-mtune=znver3"

# name -> (compiler flags, CPU flags required), best first, per architecture. The CPU flags
# are /proc/cpuinfo's ("flags" on x86, "Features" on AArch64, where "asimddp" is SDOT; NEON,
# "asimd", every AArch64 CPU has, and fp16 conversions are base ARMv8).
VARIANTS: dict[str, dict[str, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "x86_64": {
        "x86_64_v4": (("-O3", "-march=x86-64-v4", "-mavx512vnni", _TUNE), _V4),
        # AVX2 with AVX-VNNI's 256-bit vpdpbusd (Alder Lake and later Intel clients, Zen 5).
        "x86_64_v3_vnni": (("-O3", "-march=x86-64-v3", "-mavxvnni", _TUNE), (*_V3, "avx_vnni")),
        "x86_64_v3": (("-O3", "-march=x86-64-v3", _TUNE), _V3),
        "portable": (("-O2", "-march=x86-64"), ()),
    },
    "aarch64": {
        "armv8_2_dotprod": (("-O3", "-march=armv8.2-a+dotprod"), ("asimd", "asimddp")),
        "portable": (("-O2", "-march=armv8-a"), ()),
    },
    "": {"portable": (("-O2",), ())},  # any other architecture
}
# platform.machine()'s names for them.
_MACHINES = {"x86_64": "x86_64", "AMD64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}
NATIVE_FLAGS = ("-O3", "-march=native")
# Sanitizer builds: every check, none recovered (the first report aborts the process).
ASAN_FLAGS = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
              "-fno-sanitize-recover=all")
ASAN_SUFFIX = "_asan"


def architecture(machine: str) -> str:
    """VARIANTS' key for a `platform.machine()` name ("" for any other architecture)."""
    return _MACHINES.get(machine, "")


def variants_for(machine: str) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """The variants of an architecture (`platform.machine()`), best first."""
    return VARIANTS[architecture(machine)]


def runnable(machine: str, flags: set[str]) -> list[str]:
    """The variants of `machine` a CPU with these /proc/cpuinfo `flags` runs, best first."""
    return [name for name, (_, needs) in variants_for(machine).items() if flags.issuperset(needs)]


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's flags as Linux reports them in `cpuinfo` (only those the OS supports), or
    none: x86's "flags" line, AArch64's "Features"."""
    return set(cpuinfo_value(("flags", "Features"), cpuinfo).split())


def cpuinfo_value(fields: tuple[str, ...], cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The value of `cpuinfo`'s first line naming one of `fields`, or "" (none, or no such
    file)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in fields:
                    return value
    except OSError:
        pass
    return ""


def compiler() -> list[str]:
    """The C compiler's command words: $CC (arguments allowed, e.g. "ccache gcc"), else the
    one Python was built with, else cc."""
    return shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


def up_to_date(library: Path, csrc: Path, *also: Path) -> bool:
    """Whether `library` exists and is newer than the C sources in `csrc`, this file and the
    files `also`."""
    if not library.exists():
        return False
    built = library.stat().st_mtime
    deps = [csrc / name for name in (*SOURCES, *HEADERS)] + [Path(__file__), *also]
    return all(built >= dep.stat().st_mtime for dep in deps)


def compile_commands(cc: Sequence[str], flags: Sequence[str], csrc: Path,
                     objects: Path) -> list[tuple[list[str], Path]]:
    """A variant's compilation by the C compiler `cc` (its command words) with the variant's
    `flags`: per source in `csrc`, its command and the object file it writes in `objects`.
    setup.py runs them for this machine; tests/kernels/kernel_check.py with a cross compiler."""
    define = f'-DV1_SOURCES_HASH="{sources_hash(csrc)}"'
    out = []
    for source, own in SOURCES.items():
        obj = objects / (source[:-2] + ".o")
        out.append(([*cc, *COMMON_FLAGS, *flags, *own, define, "-c", str(csrc / source), "-o",
                     str(obj)], obj))
    return out


def check_commands(cc: Sequence[str], flags: Sequence[str], csrc: Path) -> list[list[str]]:
    """compile_commands' sources checked, not compiled (-fsyntax-only: types, declarations,
    the intrinsics the flags allow), for a variant this machine does not build."""
    return [[*c[: c.index("-c")], "-fsyntax-only", c[c.index("-c") + 1]]
            for c, _ in compile_commands(cc, flags, csrc, Path())]


def link_command(cc: Sequence[str], flags: Sequence[str], objects: Sequence[Path],
                 library: Path) -> list[str]:
    """The command linking a variant's `objects` into the shared library `library`."""
    return [*cc, *flags, *LINK_FLAGS, "-o", str(library), *map(str, objects)]


def library_name(variant: str) -> str:
    """The file name of a variant's library in v1/kernels/."""
    return f"_v1_{variant}.so"


def sources_hash(csrc: Path) -> str:
    """A digest of the C sources, compiled into each library (`v1_sources_hash()`): the
    loader compares it with the sources beside it, so that a library built from other
    sources (an editable install whose C changed since) is not used."""
    h = hashlib.sha256()
    for name in sorted((*SOURCES, *HEADERS)):
        h.update(name.encode() + b"\0" + (csrc / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]
