"""The synchronous frontend: processor -> engine core client -> output processor.

Callers name requests by their own ids (or get "0", "1", ...); the engine core knows each
request by the internal id the processor gives it (see `EngineCoreRequest`).

With data parallelism (a `DPSyncMPClient`), `data_parallel_rank` pins a request to a core,
and a core that dies fails the requests it held: `step()` raises its `EngineCoreDeadError`
once it has forgotten them; the engine serves on with the other cores.
"""

import itertools
from collections.abc import Sequence

from v1.engine.core_client import EngineCoreClient
from v1.engine.dp_router import check_data_parallel_rank
from v1.engine.exceptions import EngineCoreDeadError
from v1.engine.output_processor import OutputProcessor, RequestOutputKind
from v1.engine.processor import Processor, PromptType
from v1.limits import DEFAULT_LIMITS, InputLimits
from v1.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput, SchedulerStats
from v1.pooling_params import PoolingParams
from v1.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, client: EngineCoreClient, limits: InputLimits = DEFAULT_LIMITS) -> None:
        """`limits`: what one request may ask for (`EngineArgs.input_limits`)."""
        self.client = client
        info = client.model_info
        self.tokenizer = info.tokenizer
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.processor = Processor(
            info.tokenizer,
            info.max_model_len,
            info.vocab_size,
            info.eos_token_id,
            info.stop_token_ids,
            info.scheduling_policy,
            limits,
            info.pooler,
        )
        self.output_processor = OutputProcessor(info.tokenizer)
        self._ids = map(str, itertools.count())

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        request_id: str | None = None,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.FINAL,
        data_parallel_rank: int | None = None,
    ) -> str:
        """Returns the caller's id: the one outputs carry and `abort_requests` takes."""
        check_data_parallel_rank(data_parallel_rank, self.client.data_parallel_size)
        request_id = request_id or next(self._ids)
        request, text = self.processor.process_inputs(request_id, prompt, params, None, priority)
        core_requests = self.output_processor.add_request(request, text, output_kind)
        try:
            for core_request in core_requests:
                self.client.add_request(core_request, data_parallel_rank)
        except BaseException:  # e.g. its pinned core is dead
            self.abort_requests([request_id])
            raise
        return request_id

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        self.client.abort_requests(self.output_processor.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput | PoolingRequestOutput[PoolingOutput]]:
        try:
            outputs = self.client.get_output()
        except EngineCoreDeadError as e:  # one core of several died
            states = self.output_processor.request_states
            failed = {states[i].external_req_id for i in e.request_ids if i in states}
            if not failed:
                return []  # none of them live here any more
            self.abort_requests(list(failed))  # n > 1: siblings on other cores too
            raise
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:  # stop strings: the core does not know them
            self.client.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def reset_prefix_cache(self, include_disk: bool = False) -> bool:
        return self.client.call_utility("reset_prefix_cache", include_disk)

    def get_stats(self) -> SchedulerStats:
        return self.client.call_utility("get_stats")

    def shutdown(self) -> None:
        self.client.shutdown()
