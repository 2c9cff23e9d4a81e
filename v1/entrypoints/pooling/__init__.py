"""vLLM's `vllm.entrypoints.pooling` paths that its pooling clients import."""
