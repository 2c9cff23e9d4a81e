"""Each bench script's `--help`, as `python bench/NAME.py --help` gives it, for many scripts
at the price of one torch import.

Run as a script, this imports torch once (~1.2 s, nearly all of a `--help`) and then forks one
child per script: the child runs the script's file as `__main__` with argv `[script, --help]`
and the script's folder first on sys.path, as the interpreter does, and exits with the code
the interpreter would. Each script still starts in a process of its own (nothing one script
does is seen by the next); only torch is already imported when its first line runs.
"""

import json
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import NamedTuple


class Help(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def run_help(scripts: list[Path], cwd: Path, timeout: float = 300) -> dict[Path, Help]:
    """Each script's `--help` (its exit code, stdout and stderr), run from `cwd`, from one
    helper process."""
    result = subprocess.run(
        [sys.executable, __file__, *map(str, scripts)], capture_output=True, text=True,
        cwd=cwd, timeout=timeout,
    )
    assert result.returncode == 0, result.stderr
    return {Path(script): Help(*help_) for script, help_ in json.loads(result.stdout).items()}


def _exit_code(exit: SystemExit) -> int:
    """The process's exit code for an uncaught SystemExit, as the interpreter sets it."""
    if exit.code is None:
        return 0
    if isinstance(exit.code, int):
        return exit.code
    print(exit.code, file=sys.stderr)
    return 1


def _child(script: str) -> int:
    sys.argv = [script, "--help"]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return _exit_code(e)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _help(script: str) -> Help:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            code = _child(script)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return Help(os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode())


if __name__ == "__main__":
    import torch  # noqa: F401  (the import the scripts share: once, before the forks)

    json.dump({script: _help(script) for script in sys.argv[1:]}, sys.stdout)
