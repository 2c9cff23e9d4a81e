"""Clients of the engine core: the frontend talks to the core only through these.

`InprocClient` steps a core in this process. `SyncMPClient` (for `LLM`) and `AsyncMPClient`
(for `AsyncLLM`) talk to one in its own process over ZMQ: given `EngineArgs` they start it
(`v1.engine.launch`), own it (client 0) and terminate it on shutdown; given `address=` and a
unique `client_index`, they connect to a running one. When the engine dies, waiting calls raise
`EngineDeadError` within ~0.1 s and later calls at once. Importing this changes no environment.
"""

import asyncio
import itertools
import queue
import shutil
import tempfile
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import zmq

from v1.config import EngineArgs
from v1.engine.exceptions import (
    EngineCoreDeadError,
    EngineDeadError,
    error_from_remote,
)
from v1.engine.launch import EngineLaunch, stop_process
from v1.engine.protocol import (
    ENGINE_SOCKET_DIR_PREFIX,
    UTILITY_RESULT_TYPES,
    EngineCoreRequestType,
    UtilityRequest,
    UtilityResult,
)
from v1.engine.transport import EngineConnection
from v1.models.model_files import hf_dir_of, load_tokenizer, resolve_model
from v1.openmp import import_engine_module
from v1.outputs import EngineCoreOutputs
from v1.pooling_params import PoolerInfo
from v1.request import EngineCoreRequest
from v1.startup_gc import paused_for_import

if TYPE_CHECKING:
    from v1.models.loader import LoadedModel


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

    def __init__(self, args: EngineArgs, loaded: "LoadedModel | None" = None) -> None:
        self.engine_core = import_engine_module("v1.engine.core").EngineCore(args, loaded)
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

def _local_model_dir(args: EngineArgs) -> str | None:
    """The HF directory of `args`' model where it is local (a GGUF file converted on first
    use, as the engine would); None where it cannot be found here (the engine process then
    reports why)."""
    try:
        return str(hf_dir_of(resolve_model(args.model, args.revision)))
    except (ValueError, OSError):
        return None


def _local_tokenizer(model_dir: str | None) -> tuple[str, Any] | None:
    """(`model_dir`, its tokenizer), or None where it cannot be loaded here."""
    try:
        return None if model_dir is None else (model_dir, load_tokenizer(model_dir))
    except (ValueError, OSError):
        return None


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
        try:
            if self.thread is not None and self.thread is not threading.current_thread():
                self.thread.join(5)  # it polls every 100 ms
            if self.proc is not None:
                stop_process(self.proc)
        finally:  # interrupted too (a second Ctrl-C)
            self.ctx.destroy(linger=0)
            if self.tmp_dir is not None:
                shutil.rmtree(self.tmp_dir, ignore_errors=True)


class MPClient(ABC):
    """A client of an engine core in another process: its connection, the receiver thread,
    utility calls, failure and shutdown. Subclasses deliver outputs to their callers."""

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
            early = None
            if args is not None:
                if address is None:
                    self._res.tmp_dir = tempfile.mkdtemp(prefix=ENGINE_SOCKET_DIR_PREFIX)
                    address = f"ipc://{self._res.tmp_dir}/engine"
                # A GGUF file is converted before the engine process starts (it finds it so);
                # then the engine loads the model while this process imports transformers
                # and loads the tokenizer, which a GGUF file's engine needs neither of.
                model_dir = _local_model_dir(args)
                launch = EngineLaunch(args, address)
                try:
                    with paused_for_import("transformers"):
                        early = _local_tokenizer(model_dir) if self._load_tokenizer else None
                except BaseException:
                    launch.cancel()
                    raise
                self._res.proc = launch.wait()
            self.address = address
            self._connect(address, early)
        except BaseException:
            self._finalizer()
            raise

    def _connect(self, address: str, early: tuple[str, Any] | None = None) -> None:
        """`early`: (HF directory, its tokenizer) loaded already, used if the engine's model
        is in that directory."""
        self._conn = EngineConnection(self._res.ctx, address, self.client_index, self._res.proc)
        self.ready = ready = self._conn.hello()
        tokenizer = None
        if self._load_tokenizer:
            tokenizer = (early[1] if early is not None and early[0] == ready.model_dir
                         else load_tokenizer(ready.model_dir))
        self.model_info = ModelInfo(
            ready.model_name,
            tokenizer,
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
            self._conn.send(kind, data)

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
            self._pending[call_id] = (future, UTILITY_RESULT_TYPES.get(method, Any))
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
        try:
            self._conn.receive(self._res.stop, self._deliver, self._resolve)
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
