"""vLLM compatibility: what vLLM's users import, under vLLM's names, implemented here.

Each module serves vLLM paths (`vllm` read as `v1`), re-exported at those paths: `platforms`
(`v1.platforms`), `distributed` (`v1.distributed`), `utils` (`v1.utils`, `v1.utils.*`) and
`vllm_v1` (`v1.v1.<path>`, the same module as `v1.<path>`). vLLM paths that are v1's own
modules need no shim (docs/serving.md, "Coming from vLLM"). Nothing here imports a layer of
the engine: these modules import torch at first use only.
"""
