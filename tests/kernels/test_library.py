"""The kernel library (v1.kernels.library): built with the package, chosen by the CPU's flags,
checked before it is loaded, never compiled or cached at run time."""

import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from v1.kernels import library, variants

needs_kernels = pytest.mark.skipif(library.library() is None, reason="no C kernels")

# In a fresh interpreter: which library loads, and whether a GGUF one-row matmul takes the C
# path (it would otherwise be the torch reference, bit for bit).
_RUN_TIME = """
import logging, sys, torch
logging.basicConfig(level=logging.WARNING)
from v1.kernels.library import library
from v1.models.layers.quantized import QuantizedWeight
lib = library()
print(lib._name if lib is not None else None)
q = QuantizedWeight.quantize(torch.randn(256, 512), "q4_1")
x = torch.randn(1, 512)
print(not torch.equal(q.linear(x), q.linear(x, path="torch")))
cache = sys.argv[1]
print(sum(cache in line for line in open("/proc/self/maps")))  # files mapped from the cache
"""


@needs_kernels
@pytest.mark.parametrize("poisoned", [False, True])
def test_no_compiler_and_a_poisoned_cache_at_run_time(tmp_path: Path, poisoned: bool) -> None:
    """No C compiler (CC=/bin/false, none on PATH) and an empty cache directory, or a
    shared (world-writable) one holding truncated, empty and planted libraries where v1 once
    cached its builds: the kernels load from the package all the same, nothing is mapped
    from the cache, and nothing is said. (v1 used to compile them on first use into that
    cache: without a compiler every kernel fell back to torch, 12x slower, at INFO; a
    truncated library there crashed every start with SIGBUS; a planted one was run.)"""
    cache = tmp_path / "cache"
    (cache / "kernels").mkdir(parents=True)
    if poisoned:
        lib_file = Path(library.library()._name)
        for name in ("quant", "paged_decode_f32", "elementwise"):
            (cache / "kernels" / f"{name}_0123456789abcdef.so").write_bytes(
                lib_file.read_bytes())
        (cache / "kernels" / "quant_1123456789abcdef.so").write_bytes(
            lib_file.read_bytes()[:4096])
        (cache / "kernels" / "elementwise_1123456789abcdef.so").write_bytes(b"")
        cache.chmod(0o777)
        (cache / "kernels").chmod(0o777)
    bin_dir = tmp_path / "bin"  # PATH: no cc, gcc or clang
    bin_dir.mkdir()
    env = {**os.environ, "CC": "/bin/false", "PATH": str(bin_dir), "V1_CACHE_DIR": str(cache)}
    env.pop("V1_CPU_KERNELS", None)
    run = subprocess.run([sys.executable, "-c", _RUN_TIME, str(cache)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    name, native, mapped = run.stdout.split()
    assert Path(name).parent == library.KERNELS_DIR and native == "True" and mapped == "0"
    assert "WARNING" not in run.stderr, run.stderr


@needs_kernels
def test_a_damaged_library_is_not_loaded(tmp_path: Path) -> None:
    """A truncated or empty library file is reported, not mapped (which would fault)."""
    built = Path(library.library()._name)
    variant = built.name.removeprefix("_v1_").removesuffix(".so")
    data = built.read_bytes()
    for size in (len(data) // 2, 100, 0):
        (tmp_path / built.name).write_bytes(data[:size])
        reason = library.load_variant(variant, tmp_path)
        assert isinstance(reason, str) and "damaged" in reason, reason
    (tmp_path / built.name).write_bytes(data)
    assert not isinstance(library.load_variant(variant, tmp_path), str)


@needs_kernels
def test_a_library_built_from_other_sources_is_not_used(monkeypatch) -> None:
    """The C beside the library changed since it was built (an editable install): its
    functions may take other arguments now, so it is reported, with how to rebuild."""
    variant = Path(library.library()._name).name.removeprefix("_v1_").removesuffix(".so")
    monkeypatch.setattr(library, "_sources_hash", "0" * 16)
    reason = library.load_variant(variant)
    assert isinstance(reason, str) and "make kernels" in reason


def test_missing_kernels_warn_once(monkeypatch, tmp_path: Path, caplog) -> None:
    """No library for this CPU: one WARNING, saying which and what it costs; callers get
    None (their torch paths)."""
    monkeypatch.setattr(library, "KERNELS_DIR", tmp_path)
    monkeypatch.setattr(library, "_loaded", {})
    monkeypatch.delenv("V1_CPU_KERNELS", raising=False)
    with caplog.at_level(logging.WARNING, logger="v1"):
        assert library.library() is None
        assert library.library() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "not built" in message and "12x slower" in message and "make setup" in message


def test_switched_off_is_silent(monkeypatch, caplog) -> None:
    monkeypatch.setenv("V1_CPU_KERNELS", "0")
    with caplog.at_level(logging.WARNING, logger="v1"):
        assert library.library() is None
    assert not caplog.records


def test_variant_choice_by_cpu_flags() -> None:
    table = variants.variants_for("x86_64")
    v4_flags = set(table["x86_64_v4"][1])
    assert library.candidates("", "x86_64", v4_flags) == ["x86_64_v4", "x86_64_v3", "portable"]
    assert library.candidates("", "x86_64", v4_flags | {"avx_vnni"}) == [
        "x86_64_v4", "x86_64_v3_vnni", "x86_64_v3", "portable"]
    avx512_without_vnni = v4_flags - {"avx512_vnni"}
    assert library.candidates("1", "x86_64", avx512_without_vnni) == ["x86_64_v3", "portable"]
    client = set(table["x86_64_v3"][1]) | {"avx_vnni"}  # Alder Lake: AVX2 + AVX-VNNI
    assert library.candidates("", "x86_64", client) == ["x86_64_v3_vnni", "x86_64_v3",
                                                         "portable"]
    assert library.candidates("", "x86_64", {"sse2"}) == ["portable"]
    assert library.candidates("asan", "x86_64", {"sse2"}) == ["portable_asan"]
    assert library.candidates("", "aarch64", set()) == ["portable"]
    dotprod = set(variants.variants_for("aarch64")["armv8_2_dotprod"][1])
    for machine in ("aarch64", "arm64"):
        assert library.candidates("", machine, dotprod) == ["armv8_2_dotprod", "portable"]
    assert library.candidates("", "riscv64", dotprod) == ["portable"]
    # Asked for by name: that one, whatever the flags say.
    assert library.candidates("x86_64_v4", "x86_64", set()) == ["x86_64_v4"]
    assert library.candidates("native", "x86_64", set()) == ["native"]
    with pytest.raises(ValueError, match="V1_CPU_KERNELS='fast'"):
        library.candidates("fast", "x86_64", set())


def test_cpu_flags_of_each_architecture(tmp_path: Path) -> None:
    """x86's "flags" line and AArch64's "Features" line (a Neoverse N1's) both give the
    flags the variants need."""
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma f16c\nbugs\t\t: spectre\n")
    assert variants.cpu_flags(x86) == {"fpu", "sse2", "avx2", "fma", "f16c"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull "
                   "sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp "
                   "ssbs\nCPU implementer\t: 0x41\n")
    assert library.candidates("", "aarch64", variants.cpu_flags(arm)) == ["armv8_2_dotprod",
                                                                         "portable"]
    assert variants.cpu_flags(tmp_path / "missing") == set()


def test_this_machine_has_its_best_variant_built() -> None:
    """`make setup` built every variant this CPU runs (V1_KERNELS_BUILD=runnable: the others'
    sources only checked), and the loader takes the best one (the CI machine's flags decide
    which), or the one V1_CPU_KERNELS names."""
    setting = os.environ.get("V1_CPU_KERNELS", "").strip().lower()
    names = library.candidates(setting, platform.machine(), variants.cpu_flags())
    for name in variants.runnable(platform.machine(), variants.cpu_flags()):
        assert (library.KERNELS_DIR / variants.library_name(name)).is_file(), name
    lib = library.library()
    assert lib is not None and Path(lib._name).name == variants.library_name(names[0])


@pytest.mark.skipif(shutil.which("readelf") is None, reason="no readelf")
@needs_kernels
def test_only_entry_points_are_exported() -> None:
    """Built with hidden visibility: the pool and helpers are not symbols another library's
    could clash with."""
    out = subprocess.run(["readelf", "--dyn-syms", "-W", library.library()._name],
                         capture_output=True, text=True, check=True).stdout
    defined = {line.split()[-1] for line in out.splitlines()
               if " FUNC " in line and " GLOBAL " in line and " UND " not in line}
    assert defined and all(name.startswith("v1_") for name in defined), defined
    assert "v1_parallel_for" not in defined


def test_unbuilt_variants_are_checked_not_compiled(tmp_path: Path) -> None:
    """What `make setup` runs for the variants this CPU cannot run: the same compiler words as
    their build, but -fsyntax-only and no object file; one with an error in its own
    instruction set's code fails where the others pass."""
    flags = variants.variants_for("x86_64")
    for name, (f, _) in flags.items():
        for cmd, (built, _) in zip(variants.check_commands(["cc"], f, library.CSRC_DIR),
                                   variants.compile_commands(["cc"], f, library.CSRC_DIR, tmp_path),
                                   strict=True):
            assert cmd[-2] == "-fsyntax-only" and "-o" not in cmd, name
            assert cmd[:-2] == built[: built.index("-c")] and cmd[-1] == built[-3], name
    if platform.machine() != "x86_64" or shutil.which("cc") is None:
        return
    broken = tmp_path / "csrc"
    shutil.copytree(library.CSRC_DIR, broken)
    with open(broken / "pool.c", "a") as f:
        f.write("#ifdef __AVX512F__\nstatic int broken(void) { return undeclared; }\n#endif\n")
    for name, fails in (("x86_64_v3", False), ("x86_64_v4", True)):
        cmd = next(c for c in variants.check_commands(["cc"], flags[name][0], broken)
                   if c[-1].endswith("pool.c"))
        assert (subprocess.run(cmd, capture_output=True).returncode != 0) == fails, name
