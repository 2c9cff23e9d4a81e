"""The C kernel driver (kernel_driver.c, run by kernel_check.py): on a fake library whose
kernels differ from their references, on this machine's variants, where the Python tests
check the same kernels, and on the AArch64 variants, cross-compiled and run under qemu-user,
where nothing else checks them (skipped without the cross tools: `make check-aarch64`
installs them)."""

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
    runnable = library.candidates("", platform.machine(), variants.cpu_flags())
    assert out.count("PASS ") == len(runnable) > 0, out


# A kernel table of one q8_0 row whose kernels write the bias (the dequantize: zeros), the
# tuned ones OFF off in one cell: 1 ulp for linear_i8, 1.0 for linear_f32.
_FAKE_LIBRARY = r"""
#include "block_types.h"
#include <math.h>
static int32_t fill(const struct v1_matmul *c, float off) {
    float *y = c->out.data;
    for (int64_t r = 0; r < c->out.rows; r++)
        for (int64_t n = 0; n < c->out.cols; n++)
            y[r * c->out.stride + n] = c->bias && c->x.data ? c->bias[n] : 0.f;
    y[c->out.stride * (c->out.rows - 1)] += off;
    return 0;
}
static int32_t ref(const struct v1_matmul *c) { return fill(c, 0.f); }
static int32_t f32(const struct v1_matmul *c) { return fill(c, OFF * 1.f); }
static int32_t i8(const struct v1_matmul *c) {
    fill(c, 0.f);
    float *y = (float *)c->out.data + c->out.stride * (c->out.rows - 1);
    *y = OFF ? nextafterf(*y, INFINITY) : *y;
    return 0;
}
static const struct v1_block_type table[] = {
    {"q8_0", 32, 34, 1, 0, {f32, i8, ref}, {ref, ref, ref}}};
V1_API const struct v1_block_type *v1_block_types(int32_t *count) { *count = 1; return table; }
V1_API const char *v1_block_kernel_name(int32_t k) {
    static const char *const names[] = {"linear_f32", "linear_i8", "dequantize"};
    return k >= 0 && k < 3 ? names[k] : 0;
}
V1_API int32_t v1_block_run(int32_t k, int32_t reference, const struct v1_matmul *c) {
    return (reference ? table[0].reference[k] : table[0].kernels[k])(c);
}
V1_API int32_t v1_block_int8_isa(void) { return 0; }
"""


@needs_cc
def test_the_driver_finds_a_kernel_that_differs(tmp_path) -> None:
    """The driver's verdict is its comparison: the same fake library passes with its tuned
    kernels equal to the references, and fails naming each kernel when they are 1 ulp (int8)
    or 1.0 (fp32) off in one cell."""
    source = tmp_path / "fake.c"
    source.write_text(_FAKE_LIBRARY)
    driver = kernel_check.build_driver(variants.compiler(), tmp_path / "kernel_driver")
    for off in (0, 1):
        lib = tmp_path / f"fake{off}.so"
        subprocess.run([*variants.compiler(), "-shared", "-fPIC", f"-DOFF={off}",
                        f"-I{kernel_check.CSRC}", str(source), "-o", str(lib), "-lm"],
                       check=True)
        run = subprocess.run([str(driver), f"{lib}=0"], capture_output=True, text=True)
        if not off:
            assert run.returncode == 0 and "PASS" in run.stdout, run.stdout
            continue
        assert run.returncode == 1 and "FAIL" in run.stdout, run.stdout
        assert "MISMATCH q8_0 linear_i8" in run.stdout and "not the same bits" in run.stdout
        assert "MISMATCH q8_0 linear_f32" in run.stdout
        assert "MISMATCH q8_0 dequantize" not in run.stdout


@needs_cc
def test_the_driver_refuses_another_dot_product(tmp_path) -> None:
    """A library reporting another INT8_ISA than its variant's fails, as does one that is not
    a kernel library."""
    portable = library.KERNELS_DIR / variants.library_name("portable")
    if not portable.is_file():
        pytest.skip("no portable library built")
    driver = kernel_check.build_driver(variants.compiler(), tmp_path / "kernel_driver")
    run = subprocess.run([str(driver), f"{portable}=99"], capture_output=True, text=True)
    assert run.returncode == 1 and "expected 99" in run.stdout, run.stdout
    not_kernels = tmp_path / "empty.so"
    not_kernels.write_bytes(b"")
    run = subprocess.run([str(driver), str(not_kernels)], capture_output=True, text=True)
    assert run.returncode == 2 and "ERROR" in run.stdout, run.stdout
