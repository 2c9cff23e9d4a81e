"""vLLM compatibility: what vLLM's users import, under vLLM's names, implemented here.

Each module serves vLLM paths (with `vllm` read as `v1`); the modules at those paths are
re-exports of these:

- `platforms`: `vllm.platforms` (`current_platform`) -> `v1.platforms`
- `distributed`: `vllm.distributed` (`cleanup_dist_env_and_memory`) -> `v1.distributed`
- `utils`: `vllm.utils` (`FlexibleArgumentParser`, `get_open_port`, `random_uuid`),
  `vllm.utils.argparse_utils`, `vllm.utils.network_utils` -> `v1.utils`, `v1.utils.*`
- `vllm_v1`: `vllm.v1.<path>` -> `v1.v1.<path>`, the same module as `v1.<path>`

vLLM paths that are v1's own modules or names need no shim: `v1.engine.core`
(`EngineCore`), `v1.engine.core_client` (the clients), `v1.engine.async_llm`, `v1.LLM`, ...
Two more are aliases where vLLM has them: `v1.engine.async_llm_engine` (`AsyncLLMEngine`,
vLLM's name for `AsyncLLM`) and `v1.engine.arg_utils` (`EngineArgs`, `AsyncEngineArgs`).

Nothing here imports a layer of the engine: these modules import torch at first use only.
"""
