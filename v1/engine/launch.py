"""Starting and stopping engine-core processes.

`EngineLaunch` starts one (`EngineCoreProc.run_engine_core` is its main, torch loaded first)
and `wait()`s for its model to load, so several launches load at once (data parallelism), or
the caller works meanwhile (`MPClient` loads the tokenizer). A failure to start is raised in
the caller as the engine raised it (same type and message). The start method is `fork` unless
V1_WORKER_MULTIPROC_METHOD=spawn or CUDA is initialised (then `spawn`, with a warning); a
spawned engine gets OMP_WAIT_POLICY=PASSIVE unless the caller's environment sets one
(docs/serving.md, "The engine process").
"""

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Iterator
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any, NamedTuple

from v1 import envs
from v1.config import EngineArgs
from v1.engine.exceptions import error_from_remote
from v1.openmp import POLICY_ENV, import_engine_module

logger = logging.getLogger("v1")

MULTIPROC_METHOD_ENV = "V1_WORKER_MULTIPROC_METHOD"


class StartMethod(NamedTuple):
    name: str  # "fork" or "spawn"
    reason: str  # why spawn, for messages ("" for fork)


def engine_start_method() -> StartMethod:
    """fork, unless V1_WORKER_MULTIPROC_METHOD=spawn or fork is unsafe in this process (then
    spawn, with a warning that says why); a ValueError naming the variable for any other
    value."""
    if envs.read().worker_multiproc_method == "spawn":
        return StartMethod("spawn", f"{MULTIPROC_METHOD_ENV}=spawn")
    torch = sys.modules.get("torch")  # not loaded: CUDA cannot be initialised either
    if torch is not None and torch.cuda.is_initialized():
        reason = "CUDA is initialised in this process, and a forked child cannot use it"
        logger.warning(
            "starting the engine core process with 'spawn', not 'fork': %s. spawn runs the "
            'main script again: create the engine under `if __name__ == "__main__":`', reason
        )
        return StartMethod("spawn", reason)
    return StartMethod("fork", "")


def _engine_main(*args: Any) -> None:
    """The engine process: torch loaded under the passive policy (the frontend that started
    it may never have loaded torch), then `EngineCoreProc.run_engine_core(*args)`."""
    # A forked child inherits the parent's signal wakeup fd (an asyncio loop's): our signals
    # must not wake the parent's handlers. Ctrl-C reaches the whole process group: the
    # frontend handles it and shuts us down (from the start: torch's import takes seconds).
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The signal mask is the starting thread's (fork and spawn keep it): SIGTERM must reach us.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    import_engine_module("v1.engine.core_proc").EngineCoreProc.run_engine_core(*args)


class EngineLaunch:
    """An engine process being started: `wait()` for its model to load, or `cancel()` it."""

    def __init__(
        self,
        args: EngineArgs,
        address: str,
        num_threads: int | None = None,
        name: str = "v1-engine-core",
    ) -> None:
        self.address = address
        self.method = method = engine_start_method()
        ctx = multiprocessing.get_context(method.name)
        self.reader, writer = ctx.Pipe(duplex=False)
        hook = envs.read().engine_core_hook
        self.proc = proc = ctx.Process(
            target=_engine_main,
            args=(args, address, writer, os.getpid(), num_threads, hook),
            name=name,
            daemon=True,  # multiprocessing terminates it at exit, should all else fail
        )
        try:
            if method.name == "fork":
                _fork_from_fresh_thread(proc)
            else:
                with spawn_environment():
                    proc.start()
        except BaseException:
            self.reader.close()
            raise
        finally:
            writer.close()  # the child's copy is the only one left: EOF when it dies

    def cancel(self) -> None:
        """Stop the process (started or not yet ready)."""
        self.reader.close()
        stop_process(self.proc)

    def wait(self) -> BaseProcess:
        proc, reader, method = self.proc, self.reader, self.method
        try:
            wait([reader, proc.sentinel])
            try:
                status, error_type, message = reader.recv()
            except EOFError:
                status, error_type, message = "died", "", ""
        except BaseException:  # e.g. Ctrl-C while the model loads
            stop_process(proc)
            raise
        finally:
            reader.close()
        if status == "ready":
            return proc
        proc.join(10)  # after reporting, it exits by itself
        stop_process(proc)
        if status == "error":
            raise error_from_remote(error_type, message)
        hint = ""
        if method.name == "spawn":
            hint = (
                f" It started with 'spawn' ({method.reason}), which runs the main script "
                'again: a script that starts an engine must do so under `if __name__ == '
                '"__main__":` (or use LLM(..., multiprocess=False))'
            )
        raise RuntimeError(
            f"the engine core process exited during startup ({exit_status(proc)}).{hint}"
        )


@contextlib.contextmanager
def spawn_environment() -> Iterator[None]:
    """os.environ as a spawned engine process should start with, for the moment it is
    started: OMP_WAIT_POLICY=PASSIVE unless one is set (OpenMP's threads then sleep after
    each parallel region instead of spinning; the child's torch loads with it)."""
    if POLICY_ENV in os.environ:
        yield
        return
    os.environ[POLICY_ENV] = "PASSIVE"
    try:
        yield
    finally:
        os.environ.pop(POLICY_ENV, None)


def _fork_from_fresh_thread(proc: BaseProcess) -> None:
    """Start `proc` (a fork context's) from a new thread. The child is a copy of the forking
    thread alone, and a thread that ran torch ops owns an OpenMP pool (libgomp) whose threads
    the copy would wait for at its first parallel op, forever; a fresh thread owns none. (Not
    a ThreadPoolExecutor's thread: the child would exit with status 1.)"""
    errors: list[BaseException] = []

    def start() -> None:
        try:
            proc.start()
        except BaseException as e:  # raised in the caller's thread below
            errors.append(e)

    forker = threading.Thread(target=start, name="v1-fork")
    forker.start()
    forker.join()
    if errors:
        raise errors[0]


@contextlib.contextmanager
def interrupted_by_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise KeyboardInterrupt meanwhile (in the main thread; elsewhere
    nothing changes), then the handlers before are back: an engine's start, which stops its
    process when interrupted, ends at once. A server's own handlers only flag an exit, which
    it heeds once started: after the model's load, minutes for a large one."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    before = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in before.items():
            if handler is not None:  # (None: one set from C, which Python cannot set back)
                signal.signal(s, handler)


def stop_process(proc: BaseProcess) -> None:
    """Terminate an engine process (it notifies its clients and exits), kill it if it
    lingers, and reap it. Interrupted while it waits (a second Ctrl-C), it kills it first:
    else multiprocessing waits for it at exit, however long its shutdown takes."""
    try:
        if proc.is_alive():
            proc.terminate()
            proc.join(10)
    except BaseException:
        proc.kill()
        proc.join()
        raise
    if proc.is_alive():
        proc.kill()
    proc.join()


def exit_status(proc: BaseProcess) -> str:
    """How an exited process ended, for messages."""
    proc.join(1)  # its sentinel fires as it exits, a moment before its status is known
    code = proc.exitcode
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
