"""Clients of the engine core. The frontend talks to the core only through these.

- `InprocClient`: the core in this process; `get_output()` steps it.
- `SyncMPClient` (for `LLM`) and `AsyncMPClient` (for `AsyncLLM`): the core in its own
  process (`EngineCoreProc`, protocol in `v1.engine.core`), over ZMQ. Given `EngineArgs`, a
  client starts the engine process, owns it (is client 0) and terminates it on shutdown;
  given only `address=` (and a `client_index` unique among the engine's clients), it
  connects to an engine core already running there:

      client = SyncMPClient(address="ipc:///tmp/v1-engine-x/engine", client_index=1)

The engine process starts with `fork` (a script needs no `if __name__ == "__main__":` guard)
unless V1_WORKER_MULTIPROC_METHOD=spawn, or fork is unsafe here (CUDA initialised), where it
starts with `spawn`, which runs the main script again, and a warning says why.

A background thread receives the client's messages and watches the engine: its output
socket, that socket's disconnection, and, for an engine this client started, the process's
sentinel. When the engine dies, every waiting call raises `EngineDeadError` within ~0.1 s
and every later call raises it at once.
"""

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import queue
import shutil
import sys
import tempfile
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any, NamedTuple

# OpenMP's wait policy, for this process and the engine processes it starts. Unless passive,
# OpenMP's threads spin after each parallel region (libgomp's default: ~ms) and take the CPU
# from the frontend while it tokenizes and detokenizes, and from the kernels' worker pool
# (on 2 cores, generation up to 5x slower). libgomp reads the policy once, as torch loads:
# so it is set for that moment and taken out of os.environ again, where a user's own
# subprocesses (a torch job, llama.cpp) would inherit it and run up to 3x slower. A forked
# engine keeps the policy torch loaded with here; a spawned one gets it in its environment
# (`_engine_environment`). A policy the user set, or a torch already loaded, is left alone.
_OPENMP_POLICY: str | None = None  # the policy set here for torch's load, if one was
if "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ:
    _OPENMP_POLICY = os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        import torch
    finally:
        del os.environ["OMP_WAIT_POLICY"]

import msgspec  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402

from v1.config import EngineArgs  # noqa: E402
from v1.engine.core import (  # noqa: E402
    EngineCore,
    EngineCoreOutputType,
    EngineCoreProc,
    EngineCoreReady,
    EngineCoreRequestType,
    UtilityRequest,
    UtilityResult,
    client_routing_id,
    output_address,
)
from v1.engine.exceptions import (  # noqa: E402
    EngineCoreDeadError,
    EngineDeadError,
    error_from_remote,
)
from v1.models.loader import LoadedModel, load_tokenizer  # noqa: E402
from v1.outputs import EngineCoreOutputs, SchedulerStats  # noqa: E402
from v1.pooling_params import PoolerInfo  # noqa: E402
from v1.request import EngineCoreRequest  # noqa: E402

logger = logging.getLogger("v1")


class ModelInfo(NamedTuple):
    """What a frontend needs to know of the model to process inputs and outputs."""

    model_name: str
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    stop_token_ids: tuple[int, ...]
    # The model's HF-format directory (its generation_config.json gives default sampling
    # parameters: `EngineArgs.get_diff_sampling_param`).
    model_dir: str
    scheduling_policy: str = "fcfs"  # the engine core's ("priority" lets requests set one)
    pooler: PoolerInfo | None = None  # a pooling engine's (runner="pooling")


class EngineCoreClient(ABC):
    model_info: ModelInfo
    client_index: int = 0
    data_parallel_size: int = 1  # engine cores behind this client (v1.engine.dp_client)

    @abstractmethod
    def add_request(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None:
        """Send a request to the engine core (with several, `data_parallel_rank` pins one;
        the frontend has checked it is in range)."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next outputs for this client (blocks until the core has some)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """The engine core in this process: `get_output` steps it."""

    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        self.engine_core = EngineCore(args, loaded)
        loaded = self.engine_core.loaded
        self.model_info = ModelInfo(
            loaded.model_name,
            loaded.tokenizer,
            self.engine_core.scheduler_config.max_model_len,
            int(loaded.hf_config.vocab_size),
            loaded.eos_token_id,
            loaded.stop_token_ids,
            str(loaded.model_dir),
            self.engine_core.scheduler_config.policy,
            self.engine_core.pooler_info,
        )

    def add_request(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        while self.engine_core.has_unfinished_requests():
            outputs = self.engine_core.step().get(0)
            if outputs is not None:
                return outputs
        return EngineCoreOutputs()

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.engine_core.call_utility(method, args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


# ---- the engine core in another process ----------------------------------------------------

# How long a client waits for READY from an engine it did not start (it may not be there).
CONNECT_TIMEOUT_S = 30.0
# The decoded type of each utility's result (others: plain msgpack values).
_UTILITY_RESULT_TYPES: dict[str, Any] = {
    "get_stats": SchedulerStats, "reset_prefix_cache": bool, "add_lora": bool,
    "remove_lora": bool, "list_loras": set[int],
}


# Chooses how engine processes start, as VLLM_WORKER_MULTIPROC_METHOD does in vLLM.
MULTIPROC_METHOD_ENV = "V1_WORKER_MULTIPROC_METHOD"
MULTIPROC_METHODS = ("fork", "spawn")


class StartMethod(NamedTuple):
    name: str  # "fork" or "spawn"
    reason: str  # why spawn, for messages ("" for fork)


def engine_start_method() -> StartMethod:
    """fork, unless V1_WORKER_MULTIPROC_METHOD=spawn or fork is unsafe in this process (then
    spawn, with a warning that says why)."""
    name = os.environ.get(MULTIPROC_METHOD_ENV) or "fork"
    if name not in MULTIPROC_METHODS:
        raise ValueError(
            f"{MULTIPROC_METHOD_ENV}={name!r} is not a start method for the engine process: "
            f"use one of {', '.join(map(repr, MULTIPROC_METHODS))}"
        )
    if name == "spawn":
        return StartMethod("spawn", f"{MULTIPROC_METHOD_ENV}=spawn")
    if torch.cuda.is_initialized():
        reason = "CUDA is initialised in this process, and a forked child cannot use it"
        logger.warning(
            "starting the engine core process with 'spawn', not 'fork': %s. spawn runs the "
            'main script again: create the engine under `if __name__ == "__main__":`', reason
        )
        return StartMethod("spawn", reason)
    return StartMethod("fork", "")


def launch_engine_core(
    args: EngineArgs, address: str, num_threads: int | None = None
) -> BaseProcess:
    """Start an engine process serving at `address`; return once its model is loaded.

    A failure to start (a bad model path, an address in use) is raised here as the engine
    raised it: a ValueError stays a ValueError with the same message.
    """
    return EngineLaunch(args, address, num_threads).wait()


class EngineLaunch:
    """An engine process being started: `wait()` for its model to load. Several launches
    load their models at once (data parallelism)."""

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
        self.proc = proc = ctx.Process(
            target=EngineCoreProc.run_engine_core,
            args=(args, address, writer, os.getpid(), num_threads),
            name=name,
            daemon=True,  # multiprocessing terminates it at exit, should all else fail
        )
        try:
            if method.name == "fork":
                _fork_from_fresh_thread(proc)
            else:
                with _engine_environment():
                    proc.start()
        except BaseException:
            self.reader.close()
            raise
        finally:
            writer.close()  # the child's copy is the only one left: EOF when it dies

    def cancel(self) -> None:
        """Stop the process (started or not yet ready)."""
        self.reader.close()
        _stop_process(self.proc)

    def wait(self) -> BaseProcess:
        proc, reader, method = self.proc, self.reader, self.method
        try:
            wait([reader, proc.sentinel])
            try:
                status, error_type, message = reader.recv()
            except EOFError:
                status, error_type, message = "died", "", ""
        except BaseException:  # e.g. Ctrl-C while the model loads
            _stop_process(proc)
            raise
        finally:
            reader.close()
        if status == "ready":
            return proc
        proc.join(10)  # after reporting, it exits by itself
        _stop_process(proc)
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
            f"the engine core process exited during startup ({_exit_status(proc)}).{hint}"
        )


@contextlib.contextmanager
def _engine_environment() -> Iterator[None]:
    """os.environ as a spawned engine process should start with: the OpenMP policy this
    process loaded torch with, if it chose one (see `_OPENMP_POLICY`), for the moment the
    child is started."""
    if _OPENMP_POLICY is None or "OMP_WAIT_POLICY" in os.environ:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = _OPENMP_POLICY
    try:
        yield
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)


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


def _stop_process(proc: BaseProcess) -> None:
    if proc.is_alive():
        proc.terminate()  # SIGTERM: the engine notifies its clients and exits
        proc.join(10)
    if proc.is_alive():
        proc.kill()
    proc.join()


def _exit_status(proc: BaseProcess) -> str:
    proc.join(1)  # its sentinel fires as it exits, a moment before its status is known
    code = proc.exitcode
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"


class _Resources:
    """What a client's shutdown releases, apart from the client object (so that a finalizer
    can release it at exit without keeping the client alive)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.proc: BaseProcess | None = None
        self.ctx = zmq.Context()
        self.tmp_dir: str | None = None

    def release(self) -> None:
        self.stop.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(5)  # it polls every 100 ms
        if self.proc is not None:
            _stop_process(self.proc)
        self.ctx.destroy(linger=0)
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)


class MPClient(ABC):
    """A client of an engine core in another process: sockets, handshake, the receiver
    thread, failure and shutdown. Subclasses deliver outputs to their callers."""

    data_parallel_size = 1
    _load_tokenizer = True  # for model_info (a data-parallel client loads it once)

    def __init__(
        self,
        args: EngineArgs | None = None,
        *,
        address: str | None = None,
        client_index: int = 0,
        proc: BaseProcess | None = None,
    ) -> None:
        """`proc`: the engine process already started at `address` (by a data-parallel
        client), which this client then owns as if it had started it."""
        if args is None and address is None:
            raise ValueError("give EngineArgs (to start an engine core) or an address")
        self.client_index = client_index
        self.dead_error: EngineDeadError | None = None
        self._lock = threading.Lock()  # guards the input socket, dead_error and _pending
        self._pending: dict[int, tuple[Future[Any], Any]] = {}  # call id -> (future, type)
        self._call_ids = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._init_delivery()  # before the receiver thread starts delivering
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.release)  # runs at exit, too
        self._res.proc = proc
        try:
            if args is not None:
                if address is None:
                    self._res.tmp_dir = tempfile.mkdtemp(prefix="v1-engine-")
                    address = f"ipc://{self._res.tmp_dir}/engine"
                self._res.proc = launch_engine_core(args, address)
            self.address = address
            self._connect(address)
        except BaseException:
            self._finalizer()
            raise

    def _connect(self, address: str) -> None:
        ctx = self._res.ctx
        self._input = ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # sends never block
        self._output = ctx.socket(zmq.DEALER)
        self._output.setsockopt(zmq.ROUTING_ID, client_routing_id(self.client_index))
        self._output.setsockopt(zmq.RCVHWM, 0)
        # Before connecting, so that no disconnection goes unseen.
        self._monitor = self._output.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._output.connect(output_address(address))
        self._input.connect(address)
        self._send(EngineCoreRequestType.HELLO, self.client_index)
        waited_ms, proc = 0, self._res.proc
        while not self._output.poll(100):
            waited_ms += 100
            if proc is not None and not proc.is_alive():
                raise EngineDeadError(f"the engine core process died ({_exit_status(proc)})")
            if proc is None and waited_ms >= CONNECT_TIMEOUT_S * 1000:
                raise TimeoutError(
                    f"no engine core answered at {address} within {CONNECT_TIMEOUT_S:.0f} s "
                    f"(is one running there? is client_index {self.client_index} taken?)"
                )
        kind, payload = self._output.recv_multipart()
        if kind != EngineCoreOutputType.READY.value:
            raise RuntimeError(f"the engine core at {address} did not answer HELLO with READY")
        self.ready = ready = msgspec.msgpack.decode(payload, type=EngineCoreReady)
        self.model_info = ModelInfo(
            ready.model_name,
            load_tokenizer(ready.model_dir) if self._load_tokenizer else None,
            ready.max_model_len,
            ready.vocab_size,
            ready.eos_token_id,
            ready.stop_token_ids,
            ready.model_dir,
            ready.scheduling_policy,
            ready.pooler,
        )
        self._res.thread = threading.Thread(
            target=self._receive, name="v1-core-client-output", daemon=True
        )
        self._res.thread.start()

    # -- sending -----------------------------------------------------------------------

    def _send(self, kind: EngineCoreRequestType, message: Any) -> None:
        data = self._encoder.encode(message)
        with self._lock:
            if self.dead_error is not None:
                raise self.dead_error
            # Copied, as the engine's sends (see `EngineCoreProc._send`): zero-copy would
            # wake pyzmq's garbage-collector thread for each frame over 64 KB.
            self._input.send_multipart((kind.value, data))

    def add_request(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None:
        request.client_index = self.client_index
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            try:
                self._send(EngineCoreRequestType.ABORT, request_ids)
            except EngineDeadError:
                pass  # a dead engine has nothing left to abort

    def _utility_future(self, method: str, args: Sequence[Any]) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self.dead_error is not None:
                raise self.dead_error
            call_id = next(self._call_ids)
            self._pending[call_id] = (future, _UTILITY_RESULT_TYPES.get(method, Any))
        call = UtilityRequest(self.client_index, call_id, method, tuple(args))
        self._send(EngineCoreRequestType.UTILITY, call)
        return future

    # -- receiving ---------------------------------------------------------------------

    @abstractmethod
    def _init_delivery(self) -> None:
        """Set up where `_deliver` puts things (called once, first thing in __init__)."""

    @abstractmethod
    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        """Hand outputs (or, once, the error that ends them) to whoever waits for them."""

    def _receive(self) -> None:
        """The receiver thread: route messages until stopped or the engine is dead."""
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        proc = self._res.proc
        if proc is not None:
            poller.register(proc.sentinel, zmq.POLLIN)
        outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        result_decoder = msgspec.msgpack.Decoder(UtilityResult)
        try:
            while not self._res.stop.is_set():
                events = dict(poller.poll(100))
                # Read what the engine sent before judging a disconnection or an exit: the
                # death notice, when there is one, says why.
                while self._output.poll(0):
                    kind, payload = self._output.recv_multipart(copy=False)
                    if kind.bytes == EngineCoreOutputType.OUTPUTS.value:
                        outputs = outputs_decoder.decode(payload.buffer)
                        if outputs.engine_error is not None:
                            raise EngineDeadError(outputs.engine_error)
                        self._deliver(outputs)
                    elif kind.bytes == EngineCoreOutputType.UTILITY_RESULT.value:
                        self._resolve(result_decoder.decode(payload.buffer))
                if self._monitor in events or (proc is not None and proc.sentinel in events):
                    if proc is None:
                        raise EngineDeadError(f"the engine core at {self.address} disconnected")
                    raise EngineDeadError(f"the engine core process died ({_exit_status(proc)})")
        except EngineDeadError as e:
            self._fail(e)
        except Exception as e:  # a broken message or socket: nobody must wait forever
            self._fail(EngineDeadError(f"lost the engine core at {self.address}: {e!r}"))

    def _resolve(self, result: UtilityResult) -> None:
        with self._lock:
            future, result_type = self._pending.pop(result.call_id)
        if result.error is not None:
            future.set_exception(error_from_remote(*result.error))
        else:
            future.set_result(msgspec.msgpack.decode(result.result, type=result_type))

    def _fail(self, error: EngineDeadError) -> None:
        """The engine is gone: fail every waiting and later call with `error`."""
        with self._lock:
            if self.dead_error is not None:
                return
            self.dead_error = error
            pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            future.set_exception(error)
        self._deliver(error)

    def shutdown(self) -> None:
        """Fail what still waits, stop the receiver thread, terminate the engine process if
        this client started it (it removes its socket files), and free the sockets."""
        self._fail(EngineDeadError("the engine core client was shut down"))
        self._finalizer()

    def __enter__(self) -> "MPClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class SyncDelivery:
    """Outputs handed from receiver threads to blocking callers (`get_output`). An
    EngineDeadError ends the stream for every caller; an EngineCoreDeadError (one core of
    several) fails only the requests it names, once."""

    dead_error: EngineDeadError | None

    def _init_delivery(self) -> None:
        self._outputs: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        self._outputs.put(item)

    def get_output(self) -> EngineCoreOutputs:
        if self.dead_error is not None:
            raise self.dead_error
        item = self._outputs.get()
        if isinstance(item, EngineDeadError):
            if not isinstance(item, EngineCoreDeadError):
                self._outputs.put(item)  # for any other thread waiting here
            raise item
        return item


class AsyncDelivery:
    """Outputs handed from receiver threads to an asyncio loop (`get_output_async`): the
    client binds to the loop it is first used in (adding a request or awaiting outputs);
    use it from that loop only. Errors as in `SyncDelivery`."""

    dead_error: EngineDeadError | None

    def _init_delivery(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError] = asyncio.Queue()

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError(
                f"a {type(self).__name__} is bound to the event loop it was first used in"
            )

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        loop = self._loop
        if loop is None:
            return  # never used: nothing to deliver to, and dead_error says the rest
        try:
            loop.call_soon_threadsafe(self._outputs.put_nowait, item)
        except RuntimeError:
            pass  # the loop is closed: nobody is left to wake

    def add_request(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None:
        self._bind_loop()
        super().add_request(request, data_parallel_rank)  # type: ignore[misc]

    async def get_output_async(self) -> EngineCoreOutputs:
        self._bind_loop()
        if self.dead_error is not None:
            raise self.dead_error
        item = await self._outputs.get()
        if isinstance(item, EngineDeadError):
            if not isinstance(item, EngineCoreDeadError):
                self._outputs.put_nowait(item)
            raise item
        return item


class SyncMPClient(SyncDelivery, MPClient, EngineCoreClient):
    """A blocking client, for `LLM` / `LLMEngine`."""

    def call_utility(self, method: str, *args: Any) -> Any:
        return self._utility_future(method, args).result()


class AsyncMPClient(AsyncDelivery, MPClient):
    """An asyncio client, for `AsyncLLM`."""

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return await asyncio.wrap_future(self._utility_future(method, args))
