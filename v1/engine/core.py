"""The engine core: scheduler + model runner, stepped by whoever owns it (`InprocClient`, or
`v1.engine.core_proc` in its own process).

`step()` is synchronous: schedule, execute, update, returning each client's
`EngineCoreOutputs`. `step_with_batch_queue()` (async scheduling) schedules step N+1 while N
executes, with output placeholders; outputs are the same. Utilities: `UTILITY_METHODS` by name.
"""

import logging
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import torch

from v1 import envs
from v1.config import EngineArgs, VllmConfig
from v1.core.kv_disk_index import DiskBlockIndex
from v1.core.sched.output import SchedulerOutput
from v1.core.sched.scheduler import PauseState, Scheduler
from v1.engine.pooling import configure_pooling
from v1.engine.preload import preload_token_ids
from v1.engine.structured_output import StructuredOutputManager
from v1.lora.request import LoRARequest
from v1.lora.worker_manager import LoRAWorkerManager
from v1.models.loader import LoadedModel, load_model, resolve_device_and_dtype, resolve_quantization
from v1.models.model_files import has_tokenizer_files, resolve_model
from v1.outputs import EngineCoreOutputs, ModelRunnerOutput, SchedulerStats
from v1.request import EngineCoreRequest
from v1.sample.logits_processor import build_logitsprocs
from v1.sampling_params import SamplingParams
from v1.worker.kv_disk_store import open_kv_cache_dir
from v1.worker.model_runner import ModelRunner, attention_impl_for

logger = logging.getLogger("v1")

# What clients may call by name (`call_utility`), in process or over ZMQ.
UTILITY_METHODS = frozenset({
    "reset_prefix_cache", "get_stats", "check_integrity", "ping", "add_lora", "remove_lora",
    "list_loras", "pause_scheduler", "resume_scheduler", "is_scheduler_paused",
})

# vLLM's pause modes: what becomes of the requests in flight (`EngineCore.pause_scheduler`).
PAUSE_MODES = ("abort", "wait", "keep")

class EngineCore:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        """`loaded`: a model loaded in this process, used as it is."""
        device, dtype = resolve_device_and_dtype(args.device, args.dtype)
        # A disk tier that cannot be written fails before the model loads.
        kv_dir = None if args.kv_cache_dir is None else open_kv_cache_dir(args.kv_cache_dir)
        torch.manual_seed(args.seed)
        if loaded is not None and args.hf_overrides is not None:
            raise ValueError("hf_overrides cannot change a model already loaded (loaded_model)")
        if loaded is None:
            path = resolve_model(args.model, args.revision)
            loaded = load_model(
                path, dtype, device, attention_impl_for(device),
                quantization=resolve_quantization(args.quantization, path, device, dtype),
                hf_overrides=args.hf_overrides,
                max_model_len=args.max_model_len,
            )
        self.loaded = loaded
        scheduler_config, cache_config = args.create_configs(
            loaded.max_model_len, device.type == "cuda"
        )
        # runner="pooling": the pooler, with the configs adjusted to what pooling needs.
        pooler = configure_pooling(args, loaded, scheduler_config, cache_config)
        self.pooler_info = pooler.info if pooler is not None else None
        vllm_config = VllmConfig(
            args.model_config(), cache_config, scheduler_config, args.parallel_config(),
            args.speculative(), args.lora_config(),
        )
        logitsprocs = build_logitsprocs(
            vllm_config, device, device.type == "cuda", pooler is not None,
            args.logits_processors,
        )
        self.model_runner = ModelRunner(
            loaded, scheduler_config, cache_config, device, dtype,
            vllm_config.speculative_config, vllm_config.lora_config, pooler,
            logitsprocs=logitsprocs,
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
                lambda: loaded.tokenizer, loaded.hf_config.vocab_size,
                [i for i in (loaded.eos_token_id, *loaded.stop_token_ids) if i is not None],
                envs.read().xgrammar_cache_mb << 20,
            )
            if has_tokenizer_files(loaded.model_dir)
            else None
        )
        disk_index = None
        if kv_dir is not None:
            store = self.model_runner.open_kv_disk(kv_dir)
            disk_bytes = cache_config.disk_bytes()
            disk_index = DiskBlockIndex(disk_bytes, store.file_bytes, store.scan())
            logger.info(
                "disk KV tier: %s, %d blocks of %d bytes on disk, bound %d bytes",
                store.directory, len(disk_index), store.file_bytes, disk_bytes,
            )
        self.scheduler = Scheduler(
            scheduler_config, cache_config, num_blocks, self.structured_output_manager,
            disk_index,
        )
        self.scheduler_config = scheduler_config
        if self.model_runner.lora is not None:  # adapters of unfinished requests stay loaded
            self.model_runner.lora.in_use = self.scheduler.lora_users
        self.cache_config = cache_config
        # Pauses not complete yet: each one's future, and whether it clears the caches.
        self._pausing: list[tuple[Future[None], bool]] = []
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
        """Unload an adapter; False if unknown, a ValueError while a request uses it. Its
        cached blocks are never hit again (the id may name another adapter next)."""
        manager = self._lora_manager()
        users = self.scheduler.lora_users.get(lora_id, 0)
        if users:
            raise ValueError(f"LoRA adapter {lora_id} is in use by {users} requests")
        removed = manager.remove_adapter(lora_id)
        if removed:
            self.scheduler.forget_lora(lora_id)
        return removed

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

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """vLLM's: forget the prefix cache (`Scheduler.reset_prefix_cache`: refused, False,
        while requests hold blocks, unless `reset_running_requests` preempts them). The disk
        tier is kept (it is there to outlive such resets, as restarts), its queued writes
        then finished and indexed, so every block computed before the reset is found there
        after it; unless `reset_connector`: then its files of this model and KV setting are
        removed too."""
        if not self.scheduler.reset_prefix_cache(reset_running_requests, reset_connector):
            return False
        if reset_connector:
            assert self.model_runner.kv_disk is not None  # the scheduler has its tier
            self.model_runner.kv_disk.clear()
        elif self.model_runner.kv_disk is not None:
            self._index_disk_writes()  # (not before a refusal: it may wait on many writes)
        return True

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> Future[None]:
        """vLLM's pause: new requests queue, unscheduled, until `resume_scheduler`. `mode`:
        "abort" aborts every request (reported "abort"), "wait" lets the running ones finish,
        "keep" freezes them too (they go on when resumed). The future is done once nothing is
        left to step (`settle_pause`, which whoever steps the core calls after each step), the
        caches then reset if `clear_cache`: prefix cache and disk tier, the running requests
        preempted (as vLLM's, for new weights)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        if mode == "abort":
            self.scheduler.abort_all()
        self.scheduler.pause_state = (
            PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW
        )
        future: Future[None] = Future()
        self._pausing.append((future, clear_cache))
        self.settle_pause()
        return future

    def settle_pause(self) -> None:
        """Complete the pending pauses once nothing is left to step."""
        if not self._pausing or self.has_unfinished_requests():
            return
        pausing, self._pausing = self._pausing, []
        error = None
        if any(clear for _, clear in pausing):
            try:
                self.reset_prefix_cache(
                    reset_running_requests=True,
                    reset_connector=self.scheduler.disk_tier is not None,
                )
            except Exception as e:  # the caller's to see; the engine serves on
                error = e
        for future, _ in pausing:
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    def resume_scheduler(self) -> None:
        """vLLM's: schedule again, the requests queued meanwhile included; a RuntimeError
        while a pause is still draining (wait for it first, as vLLM's)."""
        if self._pausing:
            raise RuntimeError("a pause is still in progress: resume once it has completed")
        self.scheduler.pause_state = PauseState.UNPAUSED

    def is_scheduler_paused(self) -> bool:
        return self.scheduler.pause_state is not PauseState.UNPAUSED

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
            self._index_disk_writes()
            assert self.scheduler.disk_tier is not None
            kv_disk.delete(self.scheduler.disk_tier.index.take_deletes())
            kv_disk.close()

    def _index_disk_writes(self) -> None:
        """Wait for the disk tier's queued writes and put their outcomes in its index (a step
        reports them otherwise, once they are done)."""
        kv_disk, disk_tier = self.model_runner.kv_disk, self.scheduler.disk_tier
        assert kv_disk is not None and disk_tier is not None
        kv_disk.flush()
        for block_hash, ok in kv_disk.take_stored():
            disk_tier.index.stored(block_hash, ok)

