"""vLLM's `vllm.v1.sample` paths: what vLLM's users import to change sampling (custom logits
processors, `v1.sample.logits_processor`). Part of the worker layer: the sampler that runs
them is `v1.worker.sampler`."""
