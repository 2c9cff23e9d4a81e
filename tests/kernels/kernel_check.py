"""The kernel driver (kernel_driver.c: every tuned block kernel against its reference, in C
alone) built and run over kernel libraries, where the Python tests cannot load them.

    python -m tests.kernels.kernel_check aarch64         (make check-aarch64)
        every AArch64 variant of v1/kernels/variants.py cross-compiled with
        aarch64-linux-gnu-gcc, from the same sources and flags as setup.py builds on an AArch64
        machine, into build/kernel-check/aarch64/, and the driver run on them under
        qemu-aarch64 (Debian: gcc-aarch64-linux-gnu, qemu-user)
    python -m tests.kernels.kernel_check native [--asan]  (make sanitize runs it with --asan)
        the variants this CPU runs, as built in place (`make kernels`; with --asan the
        `<variant>_asan` builds and a driver under the same sanitizers)

Each library must also report the integer dot product its variant is built for (INT8_ISA).
Exits with the driver's status: 0 when every kernel of every library agrees.
"""

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from v1.kernels import library, variants

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "v1" / "kernels" / "csrc"
DRIVER = Path(__file__).resolve().with_name("kernel_driver.c")
BUILD = ROOT / "build" / "kernel-check"

# Each variant's integer dot product (csrc/isa.h's INT8_ISA; its name: INT8_ISAS in
# v1/kernels/block_matmul.py): a build that silently fell back to another (a flag lost) would
# still match its references.
# By architecture, as variants.VARIANTS.
INT8_ISA = {
    "x86_64": {"x86_64_v4": 3, "x86_64_v3_vnni": 2, "x86_64_v3": 1, "portable": 0},
    "aarch64": {"armv8_2_dotprod": 4, "portable": 5},
    "": {"portable": 0},
}
DRIVER_FLAGS = ("-std=gnu11", "-O2", "-Wall", "-Wextra", f"-I{CSRC}")
DRIVER_LIBS = ("-ldl", "-lm")

# The cross tools: the compiler, the emulator and the target's libraries (its -L).
CROSS = {"aarch64": ("aarch64-linux-gnu-gcc", "qemu-aarch64", "/usr/aarch64-linux-gnu")}
# The CPU qemu emulates for each variant: the oldest model that has the variant's CPU flags,
# so an instruction beyond them (a build that targets more than its flags say) is an illegal
# instruction there. Cortex-A53: ARMv8.0; Neoverse N1: ARMv8.2 with SDOT.
EMULATED_CPU = {"aarch64": {"armv8_2_dotprod": "neoverse-n1", "portable": "cortex-a53"}}


def missing_tools(arch: str) -> list[str]:
    """The cross tools for `arch` that are not installed."""
    cc, qemu, sysroot = CROSS[arch]
    gone = [tool for tool in (cc, qemu) if shutil.which(tool) is None]
    return gone + ([sysroot] if not Path(sysroot).is_dir() else [])


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True)


def build_variant(cc: list[str], flags: tuple[str, ...], out: Path, jobs: int) -> None:
    """A variant's library at `out` (unless up to date), its sources compiled `jobs` at a
    time."""
    if variants.up_to_date(out, CSRC):
        return
    objects = out.parent / out.name.removesuffix(".so")
    objects.mkdir(parents=True, exist_ok=True)
    commands = variants.compile_commands(cc, flags, CSRC, objects)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(_run, [cmd for cmd, _ in commands]))  # raises the first failure
    _run(variants.link_command(cc, flags, [obj for _, obj in commands], out))


def build_driver(cc: list[str], out: Path, extra: tuple[str, ...] = ()) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    _run([*cc, *DRIVER_FLAGS, *extra, str(DRIVER), "-o", str(out), *DRIVER_LIBS])
    return out


def _arguments(arch: str, libraries: dict[str, Path]) -> list[str]:
    """The driver's arguments: each library, with its variant's INT8_ISA where known."""
    args = []
    for name, path in libraries.items():
        isa = INT8_ISA[arch].get(name.removesuffix(variants.ASAN_SUFFIX))
        args.append(str(path) if isa is None else f"{path}={isa}")
    return args


def check_cross(arch: str, jobs: int) -> int:
    """Cross-compiles `arch`'s variants and the driver, and runs it on each under qemu-user,
    emulating the oldest CPU the variant is for."""
    gone = missing_tools(arch)
    if gone:
        print(f"kernel_check {arch}: missing {', '.join(gone)} (Debian: apt-get install "
              f"gcc-{arch}-linux-gnu qemu-user)", file=sys.stderr)
        return 2
    cc, qemu, sysroot = CROSS[arch]
    out = BUILD / arch
    start = time.monotonic()
    libraries = {}
    for name, (flags, _) in variants.variants_for(arch).items():
        libraries[name] = out / variants.library_name(name)
        build_variant([cc], flags, libraries[name], jobs)
    driver = build_driver([cc], out / "kernel_driver")
    built = time.monotonic()
    status = 0
    for name, path in libraries.items():
        run = subprocess.run([qemu, "-L", sysroot, "-cpu", EMULATED_CPU[arch][name], str(driver),
                              *_arguments(arch, {name: path})])
        status = max(status, run.returncode if run.returncode >= 0 else 3)  # 3: a signal
    print(f"kernel_check {arch}: built in {built - start:.1f} s, checked under {qemu} in "
          f"{time.monotonic() - built:.1f} s")
    return status


def check_native(asan: bool) -> int:
    """Runs the driver, built by the compiler setup.py uses, on this CPU's variants as built
    in place."""
    machine = platform.machine()
    names = library.candidates("asan" if asan else "", machine, variants.cpu_flags())
    libraries = {name: library.KERNELS_DIR / variants.library_name(name) for name in names}
    absent = [str(path) for path in libraries.values() if not path.is_file()]
    if absent:
        print(f"kernel_check native: not built: {', '.join(absent)} (`make kernels`, or "
              f"V1_KERNELS_BUILD=asan for --asan)", file=sys.stderr)
        return 2
    name = "kernel_driver" + ("_asan" if asan else "")
    driver = build_driver(variants.compiler(), BUILD / "native" / name,
                          variants.ASAN_FLAGS if asan else ())
    return subprocess.run([str(driver), *_arguments(variants.architecture(machine),
                                                    libraries)]).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.kernels.kernel_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("target", choices=["native", *CROSS])
    parser.add_argument("--asan", action="store_true",
                        help="native: the sanitizer builds (make sanitize)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="compilations at once (cross builds)")
    args = parser.parse_args(argv)
    if args.target == "native":
        return check_native(args.asan)
    return check_cross(args.target, args.jobs)


if __name__ == "__main__":
    sys.exit(main())
