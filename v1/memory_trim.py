"""Giving the memory a process freed back to the operating system (glibc's `malloc_trim`).

`trim()` hands the free pages of every arena back; `IdleTrim` does so when the process goes
idle, only if it grew by more than a slack since its last trim. Without glibc nothing is
trimmed. Why and measurements: docs/serving.md, "Memory back to the OS".
"""

import ctypes
import os
from collections.abc import Callable

DEFAULT_SLACK_BYTES = 32 << 20
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # this process's C library
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def trim() -> bool:
    """Return malloc's free pages to the OS (ctypes releases the GIL meanwhile). False where
    the C library has no malloc_trim."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


def rss_bytes() -> int:
    """This process's resident anonymous memory, the heap's pages (Linux; 0 elsewhere). Not
    the file-backed ones (code, mapped weights), which the kernel drops and reads again as
    memory gets short."""
    try:
        with open("/proc/self/statm") as f:
            fields = f.read().split()
    except OSError:
        return 0
    return (int(fields[1]) - int(fields[2])) * _PAGE_SIZE  # resident - shared (file-backed)


class IdleTrim:
    """Call `on_idle` whenever the process has nothing left to do: it trims when the resident
    memory grew more than `slack_bytes` since the last trim (or since this was made). Not
    thread-safe: one caller at a time."""

    def __init__(self, slack_bytes: int = DEFAULT_SLACK_BYTES) -> None:
        self.slack_bytes = slack_bytes
        self._reference = rss_bytes()

    def on_idle(self) -> bool:
        """True if it trimmed."""
        if rss_bytes() <= self._reference + self.slack_bytes or not trim():
            return False
        # What stayed is in use (or kept by malloc anyway): the next trim waits for more growth.
        self._reference = rss_bytes()
        return True
