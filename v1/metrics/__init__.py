"""The engine's metrics: Prometheus collectors (`prometheus`) and their snapshot as plain
objects (`reader`, what `LLM.get_metrics()` returns), as in vLLM's `vllm.v1.metrics`."""
