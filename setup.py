"""The package build's one extra step: the C kernels in v1/kernels/csrc/, compiled into plain
shared libraries (no Python or torch ABI: v1.kernels loads them with ctypes), one per ISA
variant of v1/kernels/variants.py, beside their bindings in v1/kernels/. Everything else about
the package is in pyproject.toml.

Runs at `pip install .` and `pip install -e .` (`make setup`; an editable install puts the
libraries into the source tree) and by `python setup.py build_ext --inplace` (`make kernels`,
after editing the C). V1_KERNELS_BUILD picks what is built:
  unset     the ISA variants (x86-64: x86_64_v4, x86_64_v3_vnni, x86_64_v3, portable;
            AArch64: armv8_2_dotprod, portable)
  runnable  those this CPU runs; the others' sources only checked (-fsyntax-only, a second
            each, where an AVX-512 build of them takes minutes): `make setup` and `make
            kernels`, whose libraries serve this machine only
  native    one more, for this CPU only (-march=native; used with V1_CPU_KERNELS=native)
  asan      the ISA variants with AddressSanitizer and UBSan, as <variant>_asan (make sanitize)
  none      nothing: v1 then runs every kernel's torch fallback, and says so once
The compiler is $CC (arguments allowed, e.g. "ccache gcc"), else Python's, else cc. A failed
compilation fails the build: a v1 without its kernels is several times slower.
"""

import importlib.util
import os
import platform
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "v1" / "kernels" / "csrc"


def _variants_module():
    # By path: importing the package would import torch, which a build environment lacks.
    spec = importlib.util.spec_from_file_location("v1_kernel_variants",
                                                  ROOT / "v1" / "kernels" / "variants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


V = _variants_module()


def _setting() -> str:
    return os.environ.get("V1_KERNELS_BUILD", "").strip().lower()


def _wanted() -> dict[str, tuple[str, ...]]:
    """Variant name -> its compiler flags, for V1_KERNELS_BUILD."""
    what = _setting()
    isa = {name: flags for name, (flags, _) in V.variants_for(platform.machine()).items()}
    if what in ("", "default"):
        return isa
    if what == "runnable":
        here = V.runnable(platform.machine(), V.cpu_flags())
        return {name: flags for name, flags in isa.items() if name in here}
    if what == "native":
        return {"native": V.NATIVE_FLAGS}
    if what == "asan":
        # The ISA flags without their -O level: the sanitizers' own comes last.
        return {name + V.ASAN_SUFFIX: (*(f for f in flags if not f.startswith("-O")),
                                       *V.ASAN_FLAGS) for name, flags in isa.items()}
    if what == "none":
        return {}
    raise SystemExit(f"V1_KERNELS_BUILD={what!r}: expected runnable, native, asan, none or "
                     "nothing")


def _checked_only() -> dict[str, tuple[str, ...]]:
    """The ISA variants V1_KERNELS_BUILD=runnable leaves unbuilt, by name: their flags."""
    if _setting() != "runnable":
        return {}
    built = _wanted()
    return {name: flags for name, (flags, _) in V.variants_for(platform.machine()).items()
            if name not in built}


class BuildKernels(build_ext):
    """build_ext for the kernel libraries: each source compiled with the variant's flags and
    its own (variants.SOURCES), then linked as a plain .so; variants in parallel."""

    def get_ext_filename(self, fullname: str) -> str:
        # Called with the full dotted name and with its last part alone.
        if fullname.rpartition(".")[2].startswith("_v1_"):
            return os.path.join(*fullname.split(".")) + ".so"  # no Python ABI tag
        return super().get_ext_filename(fullname)

    def build_extensions(self) -> None:
        self.check_extensions_list(self.extensions)
        stale = [ext for ext in self.extensions if self.force or not V.up_to_date(
            Path(self.get_ext_fullpath(ext.name)), CSRC, Path(__file__))]
        # The variants left unbuilt are checked with the sources the others are built from.
        checks = [cmd for flags in _checked_only().values()
                  for cmd in V.check_commands(V.compiler(), flags, CSRC)] if stale else []
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(self._run, checks))  # raises the first failure
            list(pool.map(self.build_extension, stale))

    def build_extension(self, ext: Extension) -> None:
        variant = ext.name.rpartition("._v1_")[2]
        flags = _wanted()[variant]
        out = Path(self.get_ext_fullpath(ext.name))
        tmp = Path(self.build_temp) / variant
        tmp.mkdir(parents=True, exist_ok=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        cc = V.compiler()
        objects = []
        for cmd, obj in V.compile_commands(cc, flags, CSRC, tmp):
            self._run(cmd)
            objects.append(obj)
        # Linked under a temporary name and renamed: a reader never sees half a library.
        partial = out.with_name(out.name + ".partial")
        self._run(V.link_command(cc, flags, objects, partial))
        os.replace(partial, out)

    def _run(self, cmd: list[str]) -> None:
        self.announce(" ".join(cmd), level=2)  # shown unless -q
        try:
            subprocess.run(cmd, check=True)
        except FileNotFoundError as e:
            raise SystemExit(
                f"no C compiler ({e.filename}): v1's kernels are compiled when it is "
                "installed; set CC, or V1_KERNELS_BUILD=none to install without them "
                "(every kernel then runs in torch, several times slower)"
            ) from e


setup(
    ext_modules=[
        Extension(f"v1.kernels._v1_{variant}",
                  sources=[f"v1/kernels/csrc/{name}" for name in V.SOURCES])
        for variant in _wanted()
    ],
    cmdclass={"build_ext": BuildKernels},
)
