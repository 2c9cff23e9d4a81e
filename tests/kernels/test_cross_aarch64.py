"""The C kernel driver (kernel_driver.c, run by kernel_check.py): on this machine's variants,
where the Python tests check the same kernels (so the driver is checked too), and on the
AArch64 variants, cross-compiled and run under qemu-user, where nothing else checks them
(skipped without the cross tools: `make check-aarch64` installs them)."""

import platform
import shutil
import subprocess

import pytest

from tests.kernels import kernel_check
from v1.kernels import library, variants

_MISSING = kernel_check.missing_tools("aarch64")
needs_cc = pytest.mark.skipif(shutil.which(variants.compiler()[0]) is None,
                              reason="no C compiler")


@pytest.mark.skipif(bool(_MISSING), reason=f"no {', '.join(_MISSING)} (Debian: apt-get "
                    "install gcc-aarch64-linux-gnu qemu-user, or make check-aarch64)")
def test_aarch64_kernels_match_their_reference_under_qemu(capfd) -> None:
    """Every AArch64 variant's tuned kernels equal the references (int8 bit for bit), and the
    dot-product variant's int8 path is SDOT's."""
    assert kernel_check.main(["aarch64"]) == 0
    out = capfd.readouterr().out
    for name in variants.variants_for("aarch64"):
        assert f"PASS {kernel_check.BUILD / 'aarch64' / variants.library_name(name)}: " \
               f"INT8_ISA {kernel_check.INT8_ISA['aarch64'][name]}" in out, out


@needs_cc
@pytest.mark.skipif(library.library() is None, reason="no C kernels")
def test_the_driver_passes_this_machines_variants(capfd) -> None:
    assert kernel_check.main(["native"]) == 0
    out = capfd.readouterr().out
    runnable = library.candidates("", platform.machine(), library.cpu_flags())
    assert out.count("PASS ") == len(runnable) > 0, out


@needs_cc
def test_the_driver_refuses_another_dot_product(tmp_path) -> None:
    """A library reporting another INT8_ISA than its variant's fails, as does one that is not
    a kernel library."""
    portable = library.KERNELS_DIR / variants.library_name("portable")
    if not portable.is_file():
        pytest.skip("no portable library built")
    driver = kernel_check.build_driver(variants.compiler(), tmp_path / "kernel_driver")
    run = subprocess.run([str(driver), f"{portable}=4"], capture_output=True, text=True)
    assert run.returncode == 1 and "INT8_ISA 0, expected 4" in run.stdout, run.stdout
    not_kernels = tmp_path / "empty.so"
    not_kernels.write_bytes(b"")
    run = subprocess.run([str(driver), str(not_kernels)], capture_output=True, text=True)
    assert run.returncode == 2 and "ERROR" in run.stdout, run.stdout
