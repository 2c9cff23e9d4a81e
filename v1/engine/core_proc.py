"""An `EngineCore` in its own process, serving any number of frontend processes over ZMQ
(`v1.engine.protocol`).

`EngineCoreProc.run_engine_core` is the process's main (started by `v1.engine.launch`): it
builds the core, reports ready or the startup error through a pipe, then runs one busy loop
(messages, step, outputs; blocking only when idle) until terminated. It exits when its parent
terminates it or dies (never orphaned) and removes its ipc socket files; a client gone away has
its requests aborted. Why one thread: docs/serving.md, "One thread in the engine process".
"""

import contextlib
import ctypes
import gc
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch
import zmq

from v1 import memory_trim
from v1.config import EngineArgs
from v1.engine.core import EngineCore
from v1.engine.protocol import (
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequestType,
    UtilityRequest,
    UtilityResult,
    client_routing_id,
    output_address,
    remove_engine_sockets,
)
from v1.outputs import EngineCoreOutput, EngineCoreOutputs
from v1.request import EngineCoreRequest
from v1.startup_gc import paused_gc

logger = logging.getLogger("v1")

# A READY our output socket cannot route yet (see `EngineCoreProc._handle_input`) is retried
# every READY_RETRY_MS for READY_TIMEOUT_S.
READY_RETRY_MS = 5
READY_TIMEOUT_S = 5.0
# Once its parent is gone, how long the engine has to shut down (death notices to other
# clients, the disk tier's queued writes) before it exits at once.
PARENT_GONE_GRACE_S = 30.0


class EngineCoreProc:
    """An EngineCore serving ZMQ clients; `run_engine_core` is the process's main."""

    def __init__(self, engine_core: EngineCore, address: str) -> None:
        self.engine_core = engine_core
        self.address = address
        loaded = engine_core.loaded
        self.ready = EngineCoreReady(
            loaded.model_name,
            str(loaded.model_dir),
            engine_core.scheduler_config.max_model_len,
            int(loaded.hf_config.vocab_size),
            loaded.eos_token_id,
            tuple(loaded.stop_token_ids),
            engine_core.cache_config.block_size,
            engine_core.num_blocks,
            engine_core.cache_config.enable_prefix_caching,
            engine_core.scheduler_config.policy,
            engine_core.pooler_info,
        )
        self.clients: set[int] = set()  # said HELLO; they get the death notice
        # Whenever the core goes idle: what large requests freed (their grammars, prompts'
        # activations) goes back to the OS, rather than stay in malloc's arenas for good.
        self._idle_trim = memory_trim.IdleTrim()
        # Clients whose READY our output socket could not route yet -> when to give up.
        self._unready: dict[int, float] = {}
        self._encoder = msgspec.msgpack.Encoder()
        T = EngineCoreRequestType
        self._decoders = {
            T.HELLO: msgspec.msgpack.Decoder(int),
            T.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
            T.ABORT: msgspec.msgpack.Decoder(list[str]),
            T.UTILITY: msgspec.msgpack.Decoder(UtilityRequest),
        }
        # Bound here, so that an address in use fails the startup; then used by the busy
        # loop's thread only.
        self._ctx = zmq.Context()
        self._input_socket = self._ctx.socket(zmq.PULL)
        self._output_socket = self._ctx.socket(zmq.ROUTER)
        # Raise EHOSTUNREACH for a client that is not (or no longer) connected instead of
        # dropping its messages silently; never block on a slow client.
        self._output_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._output_socket.setsockopt(zmq.SNDHWM, 0)
        self._input_socket.setsockopt(zmq.RCVHWM, 0)
        try:
            self._input_socket.bind(address)
            self._output_socket.bind(output_address(address))
        except BaseException:
            self._ctx.destroy(linger=0)
            raise

    # -- the process -------------------------------------------------------------------

    @staticmethod
    def run_engine_core(
        args: EngineArgs,
        address: str,
        report: Connection,
        parent_pid: int,
        num_threads: int | None = None,
        hook: str | None = None,
    ) -> None:
        """Main of the engine process: build the core, report ("ready", "", "") or
        ("error", exception type, message) through `report`, then serve until terminated.
        `num_threads`: torch's intra-op threads (a data-parallel core's share of the CPU
        cores); None leaves torch's default. `hook`: "module:function", called with the
        core once it is built, before serving (tests inject failures this way; the
        launcher passes V1_ENGINE_CORE_HOOK)."""
        # The collector's state is the parent's: off where another thread's start had paused
        # it (v1/startup_gc.py). Ours runs, paused below while the core is built. (SIGINT and
        # the wakeup fd: `launch._engine_main`, before torch loads.)
        gc.enable()
        signal.signal(signal.SIGTERM, _Termination.on_signal)
        _watch_parent(parent_pid, address)
        _set_process_name(multiprocessing.current_process().name)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        try:
            with paused_gc(collect_young=True):  # they live as long as we do
                engine_core = EngineCore(args)
            if hook is not None:
                module, _, function = hook.partition(":")
                getattr(importlib.import_module(module), function)(engine_core)
            proc = EngineCoreProc(engine_core, address)
        except SystemExit:  # terminated while it started: its client stopped it, or died
            logger.info("the engine core was stopped while it started")
            remove_engine_sockets(address)  # a dead client cannot
            raise
        except BaseException as e:
            logger.error("the engine core failed to start: %s: %s", type(e).__name__, e)
            report.send(("error", type(e).__name__, str(e)))
            sys.exit(1)
        report.send(("ready", "", ""))
        report.close()
        sys.exit(proc.run())

    def run(self) -> int:
        """Serve until terminated (exit status 0) or the busy loop fails (1)."""
        status, reason = 0, "the engine core was shut down"
        try:
            self.run_busy_loop()
        except SystemExit:
            pass
        except BaseException as e:
            logger.exception("the engine core's busy loop failed")
            status, reason = 1, f"the engine core died: {type(e).__name__}: {e}"
        finally:
            if threading.current_thread() is threading.main_thread():  # not in a Ray actor
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second terminate: finish
            self.shutdown(reason)
        return status

    def shutdown(self, reason: str) -> None:
        """Send every client the death notice, free the sockets."""
        for client in sorted(self.clients):
            notice = EngineCoreOutputs(client_index=client, engine_error=reason)
            self._send(client, EngineCoreOutputType.OUTPUTS, notice)
        self.engine_core.shutdown()
        self._output_socket.close(linger=1000)  # give the death notices a moment to leave
        self._ctx.destroy(linger=0)
        remove_engine_sockets(self.address)

    # -- the busy loop -----------------------------------------------------------------

    def run_busy_loop(self) -> None:
        scheduler = self.engine_core.scheduler
        while True:
            idle = not self.engine_core.has_unfinished_requests()
            if idle:
                self._idle_trim.on_idle()
            self._process_input(block=idle)
            step_outputs = self.engine_core.step()
            if step_outputs:  # the load figures, as of this step, go with the outputs
                stats = scheduler.make_stats()
                for client, outputs in step_outputs.items():
                    outputs.scheduler_stats = stats
                    self._reply(client, EngineCoreOutputType.OUTPUTS, outputs)
            # A pause completes (and is answered) after the outputs of the step that
            # drained it.
            self.engine_core.settle_pause()

    def _process_input(self, block: bool) -> None:
        """Handle every message waiting at the input socket; with `block` (the core is
        idle), sleep until one comes first."""
        sock = self._input_socket
        if self._unready:
            self._retry_ready()
        if block:
            # Wake now and then while a READY waits for its client's connection.
            while not sock.poll(READY_RETRY_MS if self._unready else None):
                self._retry_ready()
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                kind = EngineCoreRequestType(frames[0].bytes)
                message = self._decoders[kind].decode(frames[1].buffer)
            except (ValueError, KeyError, IndexError, msgspec.DecodeError) as e:
                logger.warning("dropped a malformed message from a client: %r", e)
                continue
            self._handle_input(kind, message)

    def _handle_input(self, kind: EngineCoreRequestType, message: Any) -> None:
        core = self.engine_core
        if kind is EngineCoreRequestType.ADD:
            request = message
            try:
                core.add_request(request)
            except ValueError as e:  # an id in use, no prompt (a frontend's bug): refuse it
                rejected = EngineCoreOutput(request.request_id, [], None, "abort", str(e))
                outputs = EngineCoreOutputs([rejected], client_index=request.client_index)
                self._reply(request.client_index, EngineCoreOutputType.OUTPUTS, outputs)
        elif kind is EngineCoreRequestType.ABORT:
            core.abort_requests(message)
        elif kind is EngineCoreRequestType.UTILITY:
            self._call_utility(message)
        else:  # HELLO
            self.clients.add(message)
            # The client connects its DEALER before it sends HELLO, yet our end may not have
            # seen that connection yet: then READY is retried a while.
            if not self._send(message, EngineCoreOutputType.READY, self.ready):
                self._unready[message] = time.monotonic() + READY_TIMEOUT_S

    def _retry_ready(self) -> None:
        now = time.monotonic()
        for client, deadline in list(self._unready.items()):
            if self._send(client, EngineCoreOutputType.READY, self.ready):
                del self._unready[client]
            elif now >= deadline:
                del self._unready[client]
                self._client_gone(client)

    def _reply(self, client: int, kind: EngineCoreOutputType, message: Any) -> None:
        if not self._send(client, kind, message):
            self._client_gone(client)

    def _send(self, client: int, kind: EngineCoreOutputType, message: Any) -> bool:
        """False when the client is not connected (any more)."""
        frames = (client_routing_id(client), kind.value, self._encoder.encode(message))
        with _Termination.deferred():  # never half a message
            try:
                # Copied: pyzmq sends a large frame zero-copy and then wakes its
                # garbage-collector thread to free it, a second Python thread taking the GIL
                # from the busy loop.
                self._output_socket.send_multipart(frames)
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                return False
        return True

    def _client_gone(self, client: int) -> None:
        """Forget a client that cannot be reached, and abort its requests."""
        self.clients.discard(client)
        requests = self.engine_core.scheduler.requests.values()
        self.engine_core.abort_requests(
            [r.request_id for r in requests if r.client_index == client]
        )

    def _call_utility(self, call: UtilityRequest) -> None:
        """Run a utility and answer it; one that returns a Future (a pause) is answered
        when the future is done (on this thread: the busy loop completes it)."""
        try:
            result = self.engine_core.call_utility(call.method, call.args)
        except Exception as e:  # the caller's problem (a bad name, a failed check)
            self._answer(call, error=e)
            return
        if isinstance(result, Future):
            result.add_done_callback(
                lambda done: self._answer(call, error=done.exception(), result=None)
            )
        else:
            self._answer(call, result=result)

    def _answer(
        self, call: UtilityRequest, error: BaseException | None = None, result: Any = None
    ) -> None:
        if error is None:
            answer = UtilityResult(call.call_id, msgspec.Raw(self._encoder.encode(result)))
        else:
            answer = UtilityResult(call.call_id, error=(type(error).__name__, str(error)))
        self._reply(call.client_index, EngineCoreOutputType.UTILITY_RESULT, answer)


class _Termination:
    """SIGTERM's handler (the process's): SystemExit wherever the busy loop is, but while a
    message's frames are being sent, right after them. Between two frames, it left half a
    message, which the death notice's frames then completed: the client read it garbled."""

    sending = False
    pending = False

    @classmethod
    def on_signal(cls, signum: int, frame: Any) -> None:
        if cls.sending:
            cls.pending = True
            return
        raise SystemExit(0)

    @classmethod
    @contextlib.contextmanager
    def deferred(cls) -> Iterator[None]:
        cls.sending = True
        try:
            yield
        finally:  # a send that raised ends the loop anyway: the exit is not kept for later
            cls.sending = False
            pending, cls.pending = cls.pending, False
        if pending:
            raise SystemExit(0)


def _set_process_name(name: str) -> None:
    """The name `ps` and /proc/PID/comm show (Linux, at most 15 bytes; best effort), so
    that each data-parallel core can be told apart."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _watch_parent(parent_pid: int, address: str) -> None:
    """Terminate this process when its parent dies, even by SIGKILL: no orphaned engine.
    SIGTERM repeats every half second (the shutdown ignores it once begun): the busy loop
    can miss one, a SystemExit raised inside a finaliser is dropped. Past
    PARENT_GONE_GRACE_S (a shutdown stuck) the process exits at once, its sockets removed."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        logger.warning("the engine's parent process %d is gone: shutting down", parent_pid)
        deadline = time.monotonic() + PARENT_GONE_GRACE_S
        while time.monotonic() < deadline:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
        logger.error("the engine had not shut down %.0f s after its parent died: exiting now",
                     PARENT_GONE_GRACE_S)
        remove_engine_sockets(address)
        os._exit(1)

    threading.Thread(target=watch, name="v1-parent-watch", daemon=True).start()
