"""The engine core: scheduler + model runner, stepped by whoever owns it.

`step()` is synchronous: schedule, execute, update. `step_with_batch_queue()` is async
scheduling (a batch queue of two): step N+1 is scheduled while step N executes on the
runner's thread, with output placeholders standing for the tokens N has not returned yet.

`EngineCoreProc` runs an `EngineCore` in its own process (multiprocessing, 'fork' or 'spawn':
see `v1.engine.core_client.engine_start_method`), serving any number of frontend processes
over ZMQ. One thread does it all: the busy loop handles the messages waiting at the input
socket, steps the core and sends the outputs, and blocks on the socket only when the core is
idle. (vLLM has an input and an output thread besides. Here the model runs on the CPU and the
busy loop needs the GIL between every two of its ops: another thread woken every step takes
it meanwhile, and on a loaded 2-core machine handing it back can wait out a scheduler time
slice: with those two threads, short runs in the engine process took far longer than
in-process on a loaded machine for the same CPU time. `bench/bench_throughput.py --short`
measures both.)

Protocol. An engine core at ADDRESS (`ipc://PATH`, by default in a fresh temp dir, or
`tcp://HOST:PORT`) binds two sockets:

- input: a PULL socket at ADDRESS. Clients PUSH two frames, [EngineCoreRequestType, msgpack]:
    HELLO    client_index: int      answered by READY
    ADD      EngineCoreRequest      answered by OUTPUTS, step by step, until it finishes
    ABORT    list[str] request ids  no answer (the client has forgotten them already)
    UTILITY  UtilityRequest         answered by UTILITY_RESULT (an error there is the
                                    caller's, e.g. a failed check_integrity; the core serves on)
- output: a ROUTER socket at `output_address(ADDRESS)` (PATH + "-out", or PORT + 1).
  Client i connects a DEALER with routing id `client_routing_id(i)` and receives only its
  own messages, two frames [EngineCoreOutputType, msgpack]:
    READY           EngineCoreReady: the model facts a frontend needs (it loads only the
                    tokenizer, from `model_dir`), and the KV cache's shape (block size,
                    number of blocks, prefix caching on or off: a data-parallel client
                    routes by it, see `v1.engine.dp_router`)
    OUTPUTS         EngineCoreOutputs of this client's requests, with the core's
                    `scheduler_stats` (waiting/running counts, KV usage) as of that step:
                    the load figures a data-parallel client balances by; with
                    `engine_error` set it is the death notice, sent to every client when the
                    busy loop ends (an exception, e.g. in the model, or shutdown), and the
                    last message
    UTILITY_RESULT  UtilityResult

A client connects its DEALER, then sends HELLO and waits for READY. Request ids (in ADD,
ABORT and OUTPUTS) are the frontends' internal ids, the caller's id plus a uuid (see
`EngineCoreRequest`), so they are unique across the clients of one engine and for its life;
an id already in the core is refused. When a client is gone (its DEALER disconnected),
the core aborts its requests. From another process, while an engine core runs at ADDRESS:

    from v1.engine.core_client import SyncMPClient   # or AsyncMPClient, for AsyncLLM
    from v1.engine.llm_engine import LLMEngine
    engine = LLMEngine(SyncMPClient(address=ADDRESS, client_index=1))

(the process that started the engine has `client.address`, and is client 0). The engine
process exits when the process that started it terminates it or dies (it watches its parent
pid), so none is ever orphaned; it removes its ipc socket files when it exits.

Test hook: `V1_ENGINE_CORE_HOOK="module:function"` in the environment of the process that
starts an engine makes the engine process call `function(engine_core)` once the core is
built, before serving (tests inject failures into the model this way).
"""

import ctypes
import enum
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch
import zmq

from v1 import memory_trim
from v1.config import EngineArgs, check_kv_cache_dir
from v1.core.kv_disk_index import DiskBlockIndex
from v1.core.sched.output import SchedulerOutput
from v1.core.sched.scheduler import Scheduler
from v1.engine.pooling import configure_pooling
from v1.engine.preload import preload_token_ids
from v1.engine.structured_output import StructuredOutputManager
from v1.lora.request import LoRARequest
from v1.lora.worker_manager import LoRAWorkerManager
from v1.models.loader import LoadedModel, load_model, resolve_model, resolve_quantization
from v1.outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput, SchedulerStats
from v1.pooling_params import PoolerInfo
from v1.request import EngineCoreRequest
from v1.sampling_params import SamplingParams
from v1.worker.model_runner import ModelRunner, attention_impl_for

logger = logging.getLogger("v1")

# A READY our output socket cannot route yet (see `EngineCoreProc._handle_input`) is retried
# every READY_RETRY_MS for READY_TIMEOUT_S.
READY_RETRY_MS = 5
READY_TIMEOUT_S = 5.0

# What clients may call by name (`call_utility`), in process or over ZMQ.
UTILITY_METHODS = frozenset({
    "reset_prefix_cache", "get_stats", "check_integrity", "ping", "add_lora", "remove_lora",
    "list_loras",
})

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device_and_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    dev = torch.device(device)
    if dtype == "auto":
        # bf16 matmul on CPU is many times slower than fp32.
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return dev, _DTYPES[dtype]


class EngineCore:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        device, dtype = resolve_device_and_dtype(args.device, args.dtype)
        torch.manual_seed(args.seed)
        if loaded is None:
            path = resolve_model(args.model, args.revision)
            loaded = load_model(
                path, dtype, device, attention_impl_for(device),
                quantization=resolve_quantization(args.quantization, path, device, dtype),
            )
        self.loaded = loaded
        scheduler_config, cache_config = args.create_configs(
            loaded.max_model_len, device.type == "cuda"
        )
        # runner="pooling": the pooler, with the configs adjusted to what pooling needs.
        pooler = configure_pooling(args, loaded, scheduler_config, cache_config)
        self.pooler_info = pooler.info if pooler is not None else None
        self.model_runner = ModelRunner(
            loaded, scheduler_config, cache_config, device, dtype, args.speculative(),
            args.lora_config(), pooler,
        )
        num_blocks = self.model_runner.determine_num_blocks(cache_config)
        capacity = num_blocks * cache_config.block_size
        if capacity < scheduler_config.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks), fewer than "
                f"max_model_len {scheduler_config.max_model_len}: lower max_model_len or "
                "give the cache more memory"
            )
        self.model_runner.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        self.structured_output_manager = (
            StructuredOutputManager(
                loaded.tokenizer, loaded.hf_config.vocab_size,
                [i for i in (loaded.eos_token_id, *loaded.stop_token_ids) if i is not None],
            )
            if loaded.tokenizer is not None
            else None
        )
        disk_index = None
        if args.kv_cache_dir is not None:
            store = self.model_runner.open_kv_disk(check_kv_cache_dir(args.kv_cache_dir))
            disk_index = DiskBlockIndex(args.disk_bytes(), store.file_bytes, store.scan())
            logger.info(
                "disk KV tier: %s, %d blocks of %d bytes on disk, bound %d bytes",
                store.directory, len(disk_index), store.file_bytes, args.disk_bytes(),
            )
        self.scheduler = Scheduler(
            scheduler_config, cache_config, num_blocks, self.structured_output_manager,
            disk_index,
        )
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.batch_queue: deque[tuple[Future[ModelRunnerOutput], SchedulerOutput]] = deque()
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="v1-runner")
            if scheduler_config.async_scheduling
            else None
        )
        if args.preload_prompts is not None:
            try:
                self.preload(preload_token_ids(
                    args.preload_prompts, loaded.tokenizer, int(loaded.hf_config.vocab_size)
                ))
            except BaseException:
                self.shutdown()
                raise

    def preload(self, prompts: list[list[int]]) -> None:
        """Compute declared prefixes one at a time and pin each one's full blocks
        (v1/engine/preload.py); a ValueError before any is computed if they cannot be."""
        kv = self.scheduler.kv_cache_manager
        kv.check_preload(prompts)
        for i, prompt in enumerate(prompts):
            self.add_request(EngineCoreRequest(
                f"preload-{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True)
            ))
            while self.has_unfinished_requests():
                self.step()
            num_pinned = kv.pin_prefix(prompt)
            logger.info("preloaded prompt %d: %d tokens, %d blocks pinned",
                        i, len(prompt), num_pinned)

    # -- requests ---------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.lora_request is not None:
            # Loaded (and checked) now: a bad adapter is refused here, never in a step.
            self.add_lora(request.lora_request)
        self.scheduler.add_request(request)

    # -- LoRA adapters (vLLM's utilities) ---------------------------------------------------

    def _lora_manager(self) -> LoRAWorkerManager:
        if self.model_runner.lora is None:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora=True")
        return self.model_runner.lora

    def add_lora(self, lora_request: LoRARequest | Sequence[Any]) -> bool:
        """Load an adapter (a ValueError if it cannot be served); False if loaded already."""
        if not isinstance(lora_request, LoRARequest):  # a utility call's msgpack array
            lora_request = msgspec.convert(lora_request, LoRARequest)
        return self._lora_manager().add_adapter(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; False if unknown, a ValueError while a request uses it."""
        manager = self._lora_manager()
        users = [
            r.request_id for r in self.scheduler.requests.values()
            if r.lora_request is not None and r.lora_request.lora_int_id == lora_id
        ]
        if users:
            raise ValueError(f"LoRA adapter {lora_id} is in use by {len(users)} requests")
        return manager.remove_adapter(lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters known (loaded, or reloadable on demand)."""
        return self._lora_manager().list_adapters()

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    # -- stepping ---------------------------------------------------------------------

    def step(self) -> dict[int, EngineCoreOutputs]:
        if self._executor is not None:
            return self.step_with_batch_queue()
        if not self.scheduler.has_requests():
            return {}
        scheduler_output = self._schedule()
        model_output = self.model_runner.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def _schedule(self) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.total_num_scheduled_tokens and self.structured_output_manager:
            # Nothing could run, as when only requests whose grammar compiles are left:
            # wait for a compilation (briefly: new input must not wait) rather than spin.
            self.structured_output_manager.wait_for_compilation(timeout=0.05)
        return scheduler_output

    def step_with_batch_queue(self) -> dict[int, EngineCoreOutputs]:
        """Keep up to two steps in flight; return the outputs of the oldest when the queue
        is full or nothing more can be scheduled."""
        assert self._executor is not None
        if self.scheduler.has_requests() and len(self.batch_queue) < 2:
            scheduler_output = self._schedule()
            future = self._executor.submit(self.model_runner.execute_model, scheduler_output)
            self.batch_queue.appendleft((future, scheduler_output))
            if (
                scheduler_output.total_num_scheduled_tokens > 0
                and len(self.batch_queue) < 2
                and not future.done()
            ):
                return {}  # fill the queue first: schedule the next step while this runs
        if not self.batch_queue:
            return {}
        future, scheduler_output = self.batch_queue.pop()
        return self.scheduler.update_from_output(scheduler_output, future.result())

    # -- utilities --------------------------------------------------------------------

    def reset_prefix_cache(self, include_disk: bool = False) -> bool:
        """Forget the prefix cache, refused (False) while any block is in use. The disk
        tier is kept (it is there to outlive such resets, as restarts) unless
        `include_disk`: then its files of this model and KV setting are removed too."""
        if not self.scheduler.reset_prefix_cache(include_disk):
            return False
        if include_disk and self.model_runner.kv_disk is not None:
            self.model_runner.kv_disk.clear()
        return True

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def ping(self) -> bool:
        """A round trip through the busy loop: the core is alive and serving."""
        return True

    def call_utility(self, method: str, args: Sequence[Any] = ()) -> Any:
        if method not in UTILITY_METHODS:
            raise ValueError(
                f"unknown utility {method!r}: expected one of {sorted(UTILITY_METHODS)}"
            )
        return getattr(self, method)(*args)

    def shutdown(self) -> None:
        if self.structured_output_manager is not None:
            self.structured_output_manager.shutdown()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        kv_disk = self.model_runner.kv_disk
        if kv_disk is not None:
            # Every queued write done and indexed, then what they evict beyond the bound.
            disk_tier = self.scheduler.disk_tier
            assert disk_tier is not None
            kv_disk.flush()
            for block_hash, ok in kv_disk.take_stored():
                disk_tier.index.stored(block_hash, ok)
            kv_disk.delete(disk_tier.index.take_deletes())
            kv_disk.close()


# ---- the engine core in its own process --------------------------------------------------


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of a client -> core message (see the module docstring)."""

    HELLO = b"\x00"
    ADD = b"\x01"
    ABORT = b"\x02"
    UTILITY = b"\x03"


class EngineCoreOutputType(bytes, enum.Enum):
    """First frame of a core -> client message."""

    READY = b"\x00"
    OUTPUTS = b"\x01"
    UTILITY_RESULT = b"\x02"


class UtilityRequest(msgspec.Struct, array_like=True):
    client_index: int
    call_id: int
    method: str
    args: tuple[Any, ...] = ()


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack-encoded; the caller knows the type
    error: tuple[str, str] | None = None  # (exception type name, message)


class EngineCoreReady(msgspec.Struct, array_like=True):
    """What a frontend needs to know of the model, from the core that loaded it."""

    model_name: str
    model_dir: str  # HF-format directory holding the tokenizer files
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    stop_token_ids: tuple[int, ...]
    # The KV cache (defaults: a core that predates these fields).
    block_size: int = 16
    num_gpu_blocks: int = 0
    enable_prefix_caching: bool = True
    # "fcfs" or "priority": a frontend refuses a request's priority under fcfs.
    scheduling_policy: str = "fcfs"
    # A pooling engine's pooler (runner="pooling"); None: the engine generates.
    pooler: PoolerInfo | None = None


def output_address(address: str) -> str:
    """The output socket's address, derived from the engine's (input) address."""
    if address.startswith("ipc://"):
        return address + "-out"
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        if port.isdigit() and int(port) > 0:
            return f"tcp://{host}:{int(port) + 1}"
    raise ValueError(
        f"engine address {address!r} must be ipc://PATH or tcp://HOST:PORT (PORT > 0; the "
        "output socket takes PORT + 1)"
    )


def remove_socket_files(address: str) -> None:
    """Remove an ipc:// engine address's two socket files, which ZMQ leaves behind (an
    engine that was killed could not remove them itself)."""
    if not address.startswith("ipc://"):
        return
    for addr in (address, output_address(address)):
        try:
            os.unlink(addr[len("ipc://"):])
        except OSError:  # already gone (or not ours): nothing to tidy
            pass


def client_routing_id(client_index: int) -> bytes:
    return b"client-%d" % client_index


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
    ) -> None:
        """Main of the engine process: build the core, report ("ready", "", "") or
        ("error", exception type, message) through `report`, then serve until terminated.
        `num_threads`: torch's intra-op threads (a data-parallel core's share of the CPU
        cores); None leaves torch's default."""
        # A forked child inherits the parent's signal wakeup fd (an asyncio loop's): our
        # signals must not wake the parent's handlers.
        signal.set_wakeup_fd(-1)
        # Ctrl-C reaches the whole process group: the frontend handles it and shuts us down.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _exit_on_signal)
        _watch_parent(parent_pid)
        _set_process_name(multiprocessing.current_process().name)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        try:
            engine_core = EngineCore(args)
            _run_test_hook(engine_core)
            proc = EngineCoreProc(engine_core, address)
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
        remove_socket_files(self.address)

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
            self._reply(message.client_index, EngineCoreOutputType.UTILITY_RESULT,
                        self._call_utility(message))
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
        try:
            # Copied: pyzmq sends a large frame zero-copy and then wakes its garbage-collector
            # thread to free it, a second Python thread taking the GIL from the busy loop.
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

    def _call_utility(self, call: UtilityRequest) -> UtilityResult:
        try:
            result = self.engine_core.call_utility(call.method, call.args)
        except Exception as e:  # the caller's problem (a bad name, a failed check)
            return UtilityResult(call.call_id, error=(type(e).__name__, str(e)))
        return UtilityResult(call.call_id, msgspec.Raw(self._encoder.encode(result)))


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _set_process_name(name: str) -> None:
    """The name `ps` and /proc/PID/comm show (Linux, at most 15 bytes; best effort), so
    that each data-parallel core can be told apart."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _watch_parent(parent_pid: int) -> None:
    """Terminate this process when its parent dies, even by SIGKILL: no orphaned engine."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="v1-parent-watch", daemon=True).start()


def _run_test_hook(engine_core: EngineCore) -> None:
    hook = os.environ.get("V1_ENGINE_CORE_HOOK")
    if hook:
        module, _, function = hook.partition(":")
        getattr(importlib.import_module(module), function)(engine_core)
