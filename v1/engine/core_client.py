"""Clients of the engine core. The frontend talks to the core only through these."""

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

from v1.config import EngineArgs
from v1.engine.core import EngineCore
from v1.outputs import EngineCoreOutputs
from v1.request import EngineCoreRequest
from v1.worker.model_loader import LoadedModel


class ModelInfo(NamedTuple):
    """What a frontend needs to know of the model to process inputs and outputs."""

    model_name: str
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    stop_token_ids: tuple[int, ...]


class EngineCoreClient(ABC):
    model_info: ModelInfo

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next outputs for this client (blocks until the core has some)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any: ...

    @abstractmethod
    def shutdown(self) -> None: ...


_UTILITIES = frozenset({"reset_prefix_cache", "get_stats", "check_integrity"})


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
        )

    def add_request(self, request: EngineCoreRequest) -> None:
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
        if method not in _UTILITIES:
            raise ValueError(f"unknown utility {method!r}: expected one of {sorted(_UTILITIES)}")
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
