"""`AsyncLLM`: the asyncio frontend of the engine, for servers.

The engine core runs in its own process (`AsyncMPClient`, or `DPAsyncMPClient` with data
parallelism). One output-handler task on the event loop's thread turns each
`EngineCoreOutputs` into `RequestOutput`s and feeds each request's asyncio queue, from which
`generate` yields (no locks). Per-request CPU work on the way in (tokenizing, chat templates,
checks) runs on a small thread pool (`run_in_pool`), so one heavy request does not stall every
stream. Requests go by the caller's id here; an id may be reused once its request is done.
"""

import asyncio
import functools
import logging
import warnings
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from v1.config import EngineArgs
from v1.config.limits import DEFAULT_LIMITS, InputLimits
from v1.engine.core_client import AsyncMPClient
from v1.engine.dp_client import DPAsyncMPClient
from v1.engine.dp_router import check_data_parallel_rank
from v1.engine.exceptions import EngineCoreDeadError, EngineDeadError
from v1.engine.output_processor import IterationStats, OutputProcessor
from v1.engine.processor import Processor, PromptType, logits_processor_classes
from v1.lora.request import LoRARequest
from v1.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput, SchedulerStats
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams

if TYPE_CHECKING:
    from v1.sample.logits_processor import LogitsProcessor

logger = logging.getLogger("v1")

# What a request's queue carries: its outputs, then None if abort() ended it, or the error
# that ended every request.
_QueueItem = RequestOutput | PoolingRequestOutput[PoolingOutput] | EngineDeadError | None

# Threads for the per-request input work. More than one, so that a request that takes seconds
# to tokenize or validate delays the next ones only by the CPU it shares with them; few, as the
# work is CPU-bound (and partly GIL-bound): more threads would add no throughput.
INPUT_WORKERS = 4

P = ParamSpec("P")
T = TypeVar("T")


class AsyncLLM:
    def __init__(
        self,
        client: AsyncMPClient | DPAsyncMPClient,
        limits: InputLimits = DEFAULT_LIMITS,
        input_workers: int = INPUT_WORKERS,
        logits_processors: Sequence[type["LogitsProcessor"]] = (),
    ) -> None:
        """`limits`: what one request may ask for (`EngineArgs.input_limits`);
        `logits_processors`: the engine's custom ones (their `validate_params` checks
        requests)."""
        self.client = client
        info = client.model_info
        self.tokenizer: Any = info.tokenizer
        self.model_name = info.model_name
        self.model_dir = info.model_dir  # its generation_config.json: default sampling params
        self.max_model_len = info.max_model_len
        self.processor = Processor(
            info.tokenizer, info.max_model_len, info.vocab_size, info.eos_token_id,
            info.stop_token_ids, info.scheduling_policy, limits, info.pooler,
            logits_processors,
        )
        self.output_processor = OutputProcessor(info.tokenizer)
        self._input_pool = ThreadPoolExecutor(input_workers, thread_name_prefix="v1-input")
        self._queues: dict[str, asyncio.Queue[_QueueItem]] = {}
        self._output_handler: asyncio.Task[None] | None = None
        self._handler_error: EngineDeadError | None = None
        # Called with each batch's per-request latencies (a server's Prometheus metrics);
        # with none, no latencies are gathered.
        self.stat_loggers: list[Callable[[IterationStats], None]] = []

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncLLM":
        """Start an engine core process with `args` (blocks until its model is loaded);
        `data_parallel_size` of them behind one routing client when it is > 1."""
        client = DPAsyncMPClient(args) if args.data_parallel_size > 1 else AsyncMPClient(args)
        return cls(
            client, args.input_limits(),
            logits_processors=logits_processor_classes(args.logits_processors),
        )

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._handler_error or self.client.dead_error

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        """vLLM's: the engine serves (False once it is dead or shut down)."""
        return not self.errored

    @property
    def is_stopped(self) -> bool:
        """vLLM's: the engine is dead or shut down."""
        return self.errored

    def get_tokenizer(self) -> Any:
        """vLLM's: the model's tokenizer (also `.tokenizer`)."""
        return self.tokenizer

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | PoolingParams,
        request_id: str,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[Any, None]:
        """Stream the request's outputs, of its `sampling_params.output_kind` as vLLM's:
        CUMULATIVE (the default) each with everything so far, DELTA each with only what is
        new, FINAL_ONLY one at the end; the last has `finished=True`. With PoolingParams
        (`encode`), its one PoolingRequestOutput.

        Bad input raises ValueError on the first iteration, before anything reaches the
        engine. Leaving the loop early (break, cancellation, a closed connection) aborts the
        request in the engine core, which frees its blocks; `abort(request_id)` ends the
        stream without a finished output; a dead engine raises EngineDeadError (with data
        parallelism, `data_parallel_rank` pins the request to that core, and the death of
        the core running it raises EngineCoreDeadError).
        """
        if self.dead_error is not None:
            raise self.dead_error
        check_data_parallel_rank(data_parallel_rank, self.client.data_parallel_size)
        request, text = await self.run_in_pool(
            self.processor.process_inputs, request_id, prompt, sampling_params, priority=priority,
            lora_request=lora_request,
        )
        core_requests = self.output_processor.add_request(request, text)
        queue: asyncio.Queue[_QueueItem] = asyncio.Queue()
        self._queues[request_id] = queue
        self._start_output_handler()
        finished = False
        try:
            for core_request in core_requests:
                self.client.add_request(core_request, data_parallel_rank)
            while not finished:
                out = await queue.get()
                if out is None:
                    return
                if isinstance(out, EngineDeadError):
                    raise out
                finished = out.finished
                yield out
        finally:
            # After an abort, a new request may have taken the caller's id already: leave
            # its queue, and abort only this request, by its internal id.
            if self._queues.get(request_id) is queue:
                del self._queues[request_id]
            if not finished:
                self._abort(request.request_id, internal=True)

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncGenerator[PoolingRequestOutput[PoolingOutput], None]:
        """vLLM's: a pooling request (runner="pooling"), as `generate` runs one; yields its
        one, finished output."""
        async with aclosing(self.generate(prompt, pooling_params, request_id, priority)) as outs:
            async for out in outs:
                yield out

    async def run_in_pool(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on the input pool, off the event loop: for per-request CPU
        work that touches no state of the loop's (the processor's methods, the tokenizer).
        Cancelling the caller leaves a call that has started to finish, unseen."""
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._input_pool, call)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort the live request with this caller's id (with n > 1, all its children), or
        those of several ids, as vLLM's."""
        for one in [request_id] if isinstance(request_id, str) else request_id:
            self._abort(one)
            queue = self._queues.get(one)
            if queue is not None:
                queue.put_nowait(None)

    def _abort(self, request_id: str, internal: bool = False) -> None:
        self.client.abort_requests(self.output_processor.abort_requests([request_id], internal))

    async def get_stats(self) -> SchedulerStats:
        return await self.client.call_utility_async("get_stats")

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """vLLM's (`EngineCore.reset_prefix_cache`)."""
        return await self.client.call_utility_async(
            "reset_prefix_cache", reset_running_requests, reset_connector
        )

    # Pause and resume, as vLLM's AsyncLLM (for weight updates): while paused, new requests
    # queue and no token is produced; they go on once resumed.
    async def pause_generation(
        self,
        *,
        mode: str = "abort",
        wait_for_inflight_requests: bool | None = None,
        clear_cache: bool = True,
    ) -> None:
        """Returns once paused (`EngineCore.pause_scheduler`): `mode` "abort" (the requests
        in flight end with finish_reason "abort"), "wait" (they finish first) or "keep" (they
        stop where they are); `clear_cache`: then the prefix cache and disk tier are reset.
        `wait_for_inflight_requests=True` is vLLM's deprecated spelling of mode "wait". A
        ValueError for another mode."""
        if wait_for_inflight_requests:
            warnings.warn(
                "wait_for_inflight_requests is deprecated: use mode='wait'",
                DeprecationWarning, stacklevel=2,
            )
            mode = "wait"
        await self.client.call_utility_async("pause_scheduler", mode, clear_cache)

    async def resume_generation(self) -> None:
        """Schedule again (a RuntimeError while a pause has not completed yet)."""
        await self.client.call_utility_async("resume_scheduler")

    async def is_paused(self) -> bool:
        return await self.client.call_utility_async("is_scheduler_paused")

    # LoRA adapters, as vLLM's AsyncLLM: load (a ValueError if it cannot be served), unload
    # (a ValueError while a request uses it), list the ids.
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        return await self.client.call_utility_async("add_lora", lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return await self.client.call_utility_async("remove_lora", lora_id)

    async def list_loras(self) -> set[int]:
        return await self.client.call_utility_async("list_loras")

    @property
    def dead_engines(self) -> dict[int, str]:
        """With data parallelism, the cores that died (index -> why); others serve on."""
        return dict(getattr(self.client, "dead_engines", {}))

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine is dead (the receiver thread notices at once),
        or, with data parallelism, if any of its cores is (the others still serve)."""
        if self.dead_error is not None:
            raise self.dead_error
        dead = self.dead_engines
        if dead:
            raise EngineDeadError(
                f"degraded: engine core(s) {sorted(dead)} dead ("
                + "; ".join(f"core {i}: {why}" for i, why in sorted(dead.items())) + ")"
            )

    def _start_output_handler(self) -> None:
        if self._output_handler is None:
            self._output_handler = asyncio.get_running_loop().create_task(
                self._handle_outputs(), name="v1-async-llm-output-handler"
            )

    async def _handle_outputs(self) -> None:
        """The one consumer of the engine's outputs: route them to the requests' queues."""
        try:
            while True:
                try:
                    outputs = await self.client.get_output_async()
                except EngineCoreDeadError as e:  # one core of several: fail its requests
                    self._fail_requests(e)
                    continue
                stats = IterationStats() if self.stat_loggers else None
                processed = self.output_processor.process_outputs(outputs.outputs, stats)
                for out in processed.request_outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                # Stop strings finish requests here; the core has to be told.
                self.client.abort_requests(processed.reqs_to_abort)
                if stats is not None:
                    for log_stats in self.stat_loggers:
                        log_stats(stats)
        except EngineDeadError as e:
            error = e
        except Exception as e:  # a bug here would leave every request waiting forever
            logger.exception("the AsyncLLM output handler failed")
            error = self._handler_error = EngineDeadError(f"the output handler failed: {e!r}")
        for queue in self._queues.values():
            queue.put_nowait(error)

    def _fail_requests(self, error: EngineCoreDeadError) -> None:
        states = self.output_processor.request_states
        failed = {states[i].external_req_id for i in error.request_ids if i in states}
        for request_id in failed:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(error)
            self._abort(request_id)  # n > 1: its children on other cores too

    def shutdown(self) -> None:
        """Terminate the engine core process (if this frontend started it). Requests still
        streaming get EngineDeadError, through the output handler, which then ends."""
        self._input_pool.shutdown(wait=False, cancel_futures=True)
        self.client.shutdown()
