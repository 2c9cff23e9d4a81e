"""Data parallelism: N engine-core processes behind one client, as vLLM's DP.

`DPSyncMPClient` (for `LLM`) and `DPAsyncMPClient` (for `AsyncLLM`) start `data_parallel_size`
ordinary `EngineCoreProc`s (torch threads = cores // N), or connect cores from other hosts
(`dp_headless`) or Ray actors (`dp_ray`) over TCP, and merge their outputs into one stream.

Contract: `DPRouter` picks each request's core, and aborts go where it is; a dead core fails
only its requests (`EngineCoreDeadError`) and is never routed to again; the client is dead only
when every core is. Utilities go to every live core (`get_stats`: a `DPSchedulerStats`).
"""

import asyncio
import logging
import shutil
import tempfile
import threading
import weakref
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from v1.config import EngineArgs
from v1.engine.core_client import (
    AsyncDelivery,
    EngineCoreClient,
    ModelInfo,
    MPClient,
    SyncDelivery,
)
from v1.engine.dp_headless import RegistrationServer
from v1.engine.dp_launch import cores_for, wait_all
from v1.engine.dp_router import DPRouter, LoadGuard
from v1.engine.exceptions import EngineCoreDeadError, EngineDeadError
from v1.engine.launch import EngineLaunch
from v1.engine.protocol import DP_SOCKET_DIR_PREFIX, remove_socket_files
from v1.outputs import EngineCoreOutputs, SchedulerStats
from v1.request import EngineCoreRequest

logger = logging.getLogger("v1")


class DPSchedulerStats(SchedulerStats):
    """The data-parallel total (counts summed, KV usage the mean over the live cores, hit
    rates over all of their lookups), with each core's own (None for a dead core)."""

    engines: list[SchedulerStats | None] = []


def combine_stats(per_engine: Sequence[SchedulerStats | None]) -> DPSchedulerStats:
    alive = [s for s in per_engine if s is not None]
    total = DPSchedulerStats(engines=list(per_engine))
    if not alive:
        return total
    for field in (
        "num_running_reqs", "num_waiting_reqs", "prefix_cache_queries", "prefix_cache_hits",
        "num_preemptions", "num_prompt_tokens", "num_generation_tokens",
        "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens", "disk_cache_hits", "disk_cache_stored_blocks",
    ):
        setattr(total, field, sum(getattr(s, field) for s in alive))
    per_pos = [s.spec_decode_num_accepted_tokens_per_pos for s in alive]
    total.spec_decode_num_accepted_tokens_per_pos = [
        sum(counts[i] for counts in per_pos if i < len(counts))
        for i in range(max(map(len, per_pos)))
    ]
    total.kv_cache_usage = sum(s.kv_cache_usage for s in alive) / len(alive)
    if total.prefix_cache_queries:
        total.prefix_cache_hit_rate = total.prefix_cache_hits / total.prefix_cache_queries
        # Each core's window rate, weighted by its lookups (the windows themselves are
        # not published).
        total.recent_prefix_cache_hit_rate = sum(
            s.recent_prefix_cache_hit_rate * s.prefix_cache_queries for s in alive
        ) / total.prefix_cache_queries
    return total


class _CoreConnection(MPClient):
    """The connection to one core of several: its deliveries go to the DP client."""

    def __init__(self, owner: "DPClientBase", index: int, address: str, proc: Any) -> None:
        self.engine_index = index
        self._owner = weakref.ref(owner)  # the owner's finalizer must be able to run
        self._load_tokenizer = index == 0
        super().__init__(address=address, client_index=0, proc=proc)

    def _init_delivery(self) -> None:
        pass

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        owner = self._owner()
        if owner is not None:
            owner._on_core_item(self.engine_index, item)


def _release(engines: list[_CoreConnection], tmp_dir: str, closers: list[Any]) -> None:
    """Terminate every core at once, then wait for each and free its connection; then the
    rest (the registration socket, whose closing stops headless hosts; Ray's actors)."""
    for engine in engines:
        engine._owner = lambda: None  # nobody to tell: this is no core's death
        proc = engine._res.proc
        if proc is not None and proc.is_alive():
            proc.terminate()
    try:
        for engine in engines:
            engine.shutdown()
        for closer in closers:
            closer.close()
    finally:  # interrupted too (a second Ctrl-C)
        shutil.rmtree(tmp_dir, ignore_errors=True)


class DPClientBase:
    """What the sync and async DP clients share: startup, routing, bookkeeping, faults."""

    def __init__(self, args: EngineArgs) -> None:
        n = self.data_parallel_size = args.data_parallel_size
        self.dead_error: EngineDeadError | None = None
        self.dead_engines: dict[int, str] = {}  # core index -> why it is dead
        self._lock = threading.Lock()  # guards the router, owners and dead state
        self._closing = False
        self._owners: dict[str, int] = {}  # live request (internal id) -> its core
        self._init_delivery()
        self.engines: list[_CoreConnection] = []
        local = n if args.data_parallel_size_local is None else args.data_parallel_size_local
        if args.data_parallel_start_rank != 0 or local < 1:
            raise ValueError(
                "a frontend runs engine cores 0.. itself (data_parallel_start_rank 0, "
                "data_parallel_size_local >= 1); cores of other ranks run headless"
            )
        tmp_dir = tempfile.mkdtemp(prefix=DP_SOCKET_DIR_PREFIX)
        closers: list[Any] = []  # what _release closes after the connections
        registration: list[RegistrationServer] = []
        self._finalizer = weakref.finalize(self, _release, self.engines, tmp_dir, closers)
        if args.data_parallel_backend == "ray":
            self._start_ray(args, closers)
            return
        self.addresses = [f"ipc://{tmp_dir}/engine-{i}" for i in range(local)]
        self.threads_per_engine = cores_for(local)
        try:
            launches: list[EngineLaunch] = []
            try:
                if local < n:  # before starting anything: the port may be taken
                    registration.append(RegistrationServer(
                        args.data_parallel_address, args.data_parallel_rpc_port
                    ))
                    closers.append(registration[0])
                for i, address in enumerate(self.addresses):
                    launches.append(EngineLaunch(
                        args, address, self.threads_per_engine, name=f"v1-engine-dp{i}"
                    ))
                remote = registration[0].wait_for(range(local, n)) if registration else {}
                procs = wait_all(launches)  # they load their models at the same time
            except BaseException:
                for launch in launches:
                    launch.cancel()
                raise
            self.addresses += [remote[i] for i in range(local, n)]
            for i, address in enumerate(self.addresses):
                try:
                    proc = procs[i] if i < local else None
                    self.engines.append(_CoreConnection(self, i, address, proc))
                except BaseException:
                    for later in launches[i + 1:]:
                        later.cancel()
                    raise
        except BaseException:
            self._finalizer()
            raise
        self._init_router(args)

    def _start_ray(self, args: EngineArgs, closers: list[Any]) -> None:
        from v1.engine.dp_ray import RayEngineCores

        try:
            self.ray_cores = cores = RayEngineCores(args)
            closers.append(cores)
            self.addresses = list(cores.addresses)
            self.threads_per_engine = cores.threads_per_engine
            for i, address in enumerate(self.addresses):
                self.engines.append(_CoreConnection(self, i, address, None))
        except BaseException:
            self._finalizer()
            raise
        self._init_router(args)

    def _init_router(self, args: EngineArgs) -> None:
        n = self.data_parallel_size
        ready = [engine.ready for engine in self.engines]
        self.model_info: ModelInfo = self.engines[0].model_info
        policy = args.data_parallel_routing
        if policy == "affinity" and not all(r.enable_prefix_caching for r in ready):
            policy = "least_loaded"  # nothing to be affine to
        self.router = DPRouter(
            n,
            ready[0].block_size,
            policy,
            cache_blocks=[r.num_gpu_blocks for r in ready],
            guard=LoadGuard(
                args.data_parallel_load_ratio,
                args.data_parallel_load_slack,
                args.data_parallel_kv_threshold,
            ),
        )
        logger.info(
            "data parallel: %d engine cores with %d torch thread(s) each, routing %s",
            n, self.threads_per_engine, policy,
        )

    # -- delivery (`SyncDelivery` / `AsyncDelivery`) ------------------------------------

    def _init_delivery(self) -> None:
        raise NotImplementedError

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        """Hand an item of the merged stream to whoever waits for it (any thread)."""
        raise NotImplementedError

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None:
        with self._lock:  # routing, recording and sending as one: a death sweep sees all
            if self.dead_error is not None:
                raise self.dead_error
            while True:
                try:
                    lora = request.lora_request
                    route = self.router.route(
                        request.prompt_token_ids, request.cache_salt, data_parallel_rank,
                        None if lora is None else lora.lora_int_id,
                    )
                except RuntimeError as e:  # the pinned core is dead (or, racing, all are)
                    raise EngineDeadError(str(e)) from None
                self._owners[request.request_id] = route.engine
                try:
                    self.engines[route.engine].add_request(request)
                    return
                except EngineDeadError:
                    # It died just now (its receiver thread will tell the rest): route
                    # this request again, elsewhere.
                    del self._owners[request.request_id]
                    self.router.mark_dead(route.engine)

    def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = defaultdict(list)
        with self._lock:
            for request_id in request_ids:
                engine = self._owners.pop(request_id, None)
                if engine is not None:
                    by_engine[engine].append(request_id)
            for engine, ids in by_engine.items():
                self.router.finished(engine, len(ids))
        for engine, ids in by_engine.items():
            self.engines[engine].abort_requests(ids)  # a dead core's: nothing to do

    def engine_of(self, request_id: str) -> int | None:
        """The core running a live request (by internal id)."""
        with self._lock:
            return self._owners.get(request_id)

    # -- what the cores send -------------------------------------------------------------

    def _on_core_item(self, index: int, item: EngineCoreOutputs | EngineDeadError) -> None:
        """On core `index`'s receiver thread: its outputs, or the error that ended it."""
        if isinstance(item, EngineDeadError):
            self._on_core_death(index, item)
            return
        with self._lock:
            stats = item.scheduler_stats
            if stats is not None:
                self.router.update_stats(
                    index, stats.num_waiting_reqs, stats.num_running_reqs, stats.kv_cache_usage
                )
            done = 0
            for output in item.outputs:
                if output.finish_reason is not None and self._owners.pop(
                    output.request_id, None
                ) is not None:
                    done += 1
            for request_id in item.finished_requests or ():
                if self._owners.pop(request_id, None) is not None:
                    done += 1
            if done:
                self.router.finished(index, done)
        self._deliver(item)

    def _on_core_death(self, index: int, error: EngineDeadError) -> None:
        with self._lock:
            if self._closing or index in self.dead_engines:
                return
            self.router.mark_dead(index)
            self.dead_engines[index] = str(error)
            failed = [rid for rid, engine in self._owners.items() if engine == index]
            for request_id in failed:
                del self._owners[request_id]
            all_dead = len(self.dead_engines) == self.data_parallel_size
            if all_dead:
                self.dead_error = EngineDeadError(
                    "every engine core is dead: " + "; ".join(
                        f"core {i}: {why}" for i, why in sorted(self.dead_engines.items())
                    )
                )
        remove_socket_files(self.addresses[index])  # a killed core leaves them
        logger.error(
            "engine core %d died (%s): %d request(s) on it failed; %s", index, error,
            len(failed), "no core is left" if all_dead else "the others serve on",
        )
        if failed:
            self._deliver(EngineCoreDeadError(f"engine core {index} died: {error}", index, failed))
        if all_dead:
            self._deliver(self.dead_error)

    # -- utilities -----------------------------------------------------------------------

    def _utility_futures(
        self, method: str, args: Sequence[Any], engines: Sequence[int] | None = None
    ) -> list[tuple[int, Future[Any]]]:
        if self.dead_error is not None:
            raise self.dead_error
        indices = engines if engines is not None else [
            i for i in range(self.data_parallel_size) if i not in self.dead_engines
        ]
        futures = []
        for i in indices:
            try:
                futures.append((i, self.engines[i]._utility_future(method, args)))
            except EngineDeadError as e:  # died meanwhile
                future: Future[Any] = Future()
                future.set_exception(e)
                futures.append((i, future))
        return futures

    def _combine(self, method: str, results: dict[int, Any]) -> Any:
        """One answer from the live cores' answers (a dead core's is missing)."""
        if not results:
            raise self.dead_error or EngineDeadError("no engine core is alive")
        if method == "get_stats":
            return combine_stats(
                [results.get(i) for i in range(self.data_parallel_size)]
            )
        if method == "reset_prefix_cache":
            with self._lock:
                for i, done in results.items():
                    if done:
                        self.router.reset_prefix_index(i)
            return all(results.values())
        if method == "ping":
            return all(results.values())
        if method == "is_scheduler_paused":
            return any(results.values())
        if method in ("add_lora", "remove_lora"):  # every core holds every adapter
            return any(results.values())
        if method == "list_loras":
            return set().union(*results.values())
        return None  # check_integrity: each core raised if it failed

    def shutdown(self) -> None:
        """Fail what still waits, terminate every core process, free the sockets."""
        with self._lock:
            self._closing = True
            if self.dead_error is None:
                self.dead_error = EngineDeadError("the engine core client was shut down")
        self._deliver(self.dead_error)
        self._finalizer()

    def __enter__(self) -> "DPClientBase":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _gather(futures: list[tuple[int, Future[Any]]]) -> dict[int, Any]:
    """Each live core's result; a core that died meanwhile is left out; any other error
    (a failed check_integrity) is raised."""
    results = {}
    for i, future in futures:
        try:
            results[i] = future.result()
        except EngineDeadError:
            continue
    return results


class DPSyncMPClient(SyncDelivery, DPClientBase, EngineCoreClient):
    """The blocking DP client, for `LLM` / `LLMEngine`: `get_output` raises
    EngineCoreDeadError when a core died with requests of ours (those requests are over; the
    client serves on), EngineDeadError when every core is dead."""

    def call_utility(self, method: str, *args: Any) -> Any:
        return self._combine(method, _gather(self._utility_futures(method, args)))

    def call_utility_on(self, engine: int, method: str, *args: Any) -> Any:
        """A utility on one core only."""
        ((_, future),) = self._utility_futures(method, args, [engine])
        return future.result()


class DPAsyncMPClient(AsyncDelivery, DPClientBase):
    """The asyncio DP client, for `AsyncLLM` (errors as `DPSyncMPClient`'s)."""

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        futures = self._utility_futures(method, args)
        outcomes = await asyncio.gather(
            *(asyncio.wrap_future(f) for _, f in futures), return_exceptions=True
        )
        results = {}
        for (i, _), outcome in zip(futures, outcomes):
            if isinstance(outcome, EngineDeadError):
                continue
            if isinstance(outcome, BaseException):
                raise outcome
            results[i] = outcome
        return self._combine(method, results)
