"""The kernel library of this process: the best variant for this CPU, checked, loaded once.

The libraries are built with the package (`variants.py`) and sit beside this file; nothing is
compiled at run time. A library is loaded only if it is a whole ELF file, and must report the
hash of the C sources beside it (`v1_sources_hash`; a stale editable build gets a warning).

`library(setting)`: the setting's library; None means V1_CPU_KERNELS as the environment holds
it at the call (`v1.envs`): unset/1/on the best variant this CPU runs (the next if missing),
0/off none (callers take their torch path; one WARNING), native or asan those builds, or a
variant's name.
"""

import ctypes
import logging
import os
import platform
import threading
from pathlib import Path

from v1 import envs
from v1.kernels import variants

logger = logging.getLogger("v1")

KERNELS_DIR = Path(__file__).resolve().parent
CSRC_DIR = KERNELS_DIR / "csrc"

_OFF = ("0", "false", "no", "off")
_DEFAULT = ("", "1", "true", "yes", "on")

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}  # by setting
_sources_hash: str | None = None


def library(setting: str | None = None) -> ctypes.CDLL | None:
    """The kernels for `setting` (a V1_CPU_KERNELS value, see the module docstring; None: the
    environment's), or None: switched off, or no variant could be loaded (then one WARNING,
    once per setting, says why and what it costs)."""
    if setting is None:
        setting = envs.value("cpu_kernels")
    else:
        setting = setting.strip().lower()
    if setting in _OFF:
        return None
    lib = _loaded.get(setting, False)
    if lib is not False:
        return lib
    with _lock:
        if setting not in _loaded:
            _loaded[setting] = _load(setting)
        return _loaded[setting]


def candidates(setting: str, machine: str, flags: set[str]) -> list[str]:
    """The variants to try for a V1_CPU_KERNELS value, best first: those whose CPU flags
    this machine has (all of them for an explicit name: the user asked for it)."""
    table = variants.variants_for(machine)
    runnable = variants.runnable(machine, flags)
    if setting in _DEFAULT:
        return runnable
    if setting == "asan":
        return [name + variants.ASAN_SUFFIX for name in runnable]
    base = setting.removesuffix(variants.ASAN_SUFFIX)
    if setting == "native" or base in table:
        return [setting]
    raise ValueError(f"V1_CPU_KERNELS={setting!r}: expected 0, 1, native, asan or one of "
                     f"{sorted(table)} (with or without {variants.ASAN_SUFFIX!r})")


def load_variant(variant: str, directory: Path | None = None) -> ctypes.CDLL | str:
    """The library of `variant` from `directory` (default KERNELS_DIR), or why it cannot
    be used."""
    path = (KERNELS_DIR if directory is None else directory) / variants.library_name(variant)
    try:
        whole = _is_whole_elf(path)
    except OSError as e:
        return f"not built ({e.strerror}: {path})"
    if not whole:
        return f"{path} is damaged (truncated or not a shared library): reinstall v1"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return f"{path} does not load: {e}"
    get_hash = getattr(lib, "v1_sources_hash", None)
    if get_hash is None:
        return f"{path} is not a v1 kernel library"
    get_hash.restype = ctypes.c_char_p
    built, expected = get_hash().decode(), _expected_hash()
    if expected is not None and built != expected:
        return (f"{path} was built from other C sources than those in {CSRC_DIR} (edited "
                f"since?): rebuild with `make kernels` or `pip install -e .`")
    return lib


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name as Linux reports it, or "" (AArch64 reports none)."""
    return variants.cpuinfo_value(("model name",), cpuinfo).strip()


def _load(setting: str) -> ctypes.CDLL | None:
    failed = []
    for variant in candidates(setting, platform.machine(), variants.cpu_flags()):
        lib = load_variant(variant)
        if isinstance(lib, str):
            failed.append(f"{variant}: {lib}")
            continue
        if failed:
            logger.warning("C kernels: using %s, not the better %s", variant, "; ".join(failed))
        logger.debug("C kernels: %s", variant)
        return lib
    logger.warning(
        "C kernels unavailable (%s): GGUF matmuls, paged-attention decodes and the elementwise "
        "ops run in torch instead, several times slower (a GGUF model decodes ~12x slower). "
        "They are built when v1 is installed (`make setup`, `pip install -e .`; a C compiler "
        "is needed then, not at run time).", "; ".join(failed) or "none for this CPU")
    return None


def _expected_hash() -> str | None:
    """The digest of the sources beside the libraries; None where they were not shipped."""
    global _sources_hash
    if _sources_hash is None:
        try:
            _sources_hash = variants.sources_hash(CSRC_DIR)
        except OSError:
            return None
    return _sources_hash


def _is_whole_elf(path: Path) -> bool:
    """Whether `path` is an ELF file at least as long as its header says: the section header
    table, which the linker writes last, ends within the file."""
    with open(path, "rb") as f:
        head = f.read(64)
        size = os.fstat(f.fileno()).st_size
    if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2):
        return False
    order = "little" if head[5] == 1 else "big"
    if head[4] == 2:  # 64-bit
        if len(head) < 64:
            return False
        shoff, shentsize, shnum = head[40:48], head[58:60], head[60:62]
    else:
        shoff, shentsize, shnum = head[32:36], head[46:48], head[48:50]
    end = int.from_bytes(shoff, order) + int.from_bytes(shentsize, order) * int.from_bytes(
        shnum, order)
    return end <= size


if __name__ == "__main__":
    # The variants a V1_CPU_KERNELS value would try on this machine (make sanitize's list).
    import sys

    print(" ".join(candidates(sys.argv[1] if len(sys.argv) > 1 else "", platform.machine(),
                              variants.cpu_flags())))
