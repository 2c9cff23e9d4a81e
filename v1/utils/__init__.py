"""Small helpers under vLLM's module paths (`vllm.utils.*`)."""
