"""vLLM's `vllm.engine.arg_utils`: the engine options. `EngineArgs` lives in `v1.config`
(every layer reads it); `AsyncEngineArgs` is the same options, under the name vLLM's scripts
give `AsyncLLM.from_engine_args`."""

from v1.config import EngineArgs

AsyncEngineArgs = EngineArgs

__all__ = ["AsyncEngineArgs", "EngineArgs"]
