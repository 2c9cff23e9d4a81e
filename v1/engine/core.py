"""The engine core: scheduler + model runner, stepped by whoever owns it.

`step()` is synchronous: schedule, execute, update. `step_with_batch_queue()` is async
scheduling (a batch queue of two): step N+1 is scheduled while step N executes on the
runner's thread, with output placeholders standing for the tokens N has not returned yet.
"""

import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from v1.config import EngineArgs
from v1.core.sched.output import SchedulerOutput
from v1.core.sched.scheduler import Scheduler
from v1.outputs import EngineCoreOutputs, ModelRunnerOutput, SchedulerStats
from v1.request import EngineCoreRequest
from v1.worker.model_loader import LoadedModel, load_model
from v1.worker.model_runner import ModelRunner, attention_impl_for

logger = logging.getLogger("v1")

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
            loaded = load_model(args.model, dtype, device, attention_impl_for(device))
        self.loaded = loaded
        scheduler_config, cache_config = args.create_configs(
            loaded.max_model_len, device.type == "cuda"
        )
        self.model_runner = ModelRunner(loaded, scheduler_config, cache_config, device, dtype)
        num_blocks = self.model_runner.determine_num_blocks(cache_config)
        capacity = num_blocks * cache_config.block_size
        if capacity < scheduler_config.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks), fewer than "
                f"max_model_len {scheduler_config.max_model_len}: lower max_model_len or "
                "give the cache more memory"
            )
        self.model_runner.initialize_kv_cache(num_blocks)
        self.scheduler = Scheduler(scheduler_config, cache_config, num_blocks)
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.batch_queue: deque[tuple[Future[ModelRunnerOutput], SchedulerOutput]] = deque()
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="v1-runner")
            if scheduler_config.async_scheduling
            else None
        )

    # -- requests ---------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(request)

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
        scheduler_output = self.scheduler.schedule()
        model_output = self.model_runner.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def step_with_batch_queue(self) -> dict[int, EngineCoreOutputs]:
        """Keep up to two steps in flight; return the outputs of the oldest when the queue
        is full or nothing more can be scheduled."""
        assert self._executor is not None
        if self.scheduler.has_requests() and len(self.batch_queue) < 2:
            scheduler_output = self.scheduler.schedule()
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

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
