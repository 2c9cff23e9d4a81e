"""vLLM's `vllm.distributed` names that scripts use between engines (served at
`v1.distributed`). An engine core runs in one process on one device, so there is no process
group to tear down."""

import gc


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's: release what engines already dropped (`del llm`) before the next starts. A
    collection runs the dropped engines' finalizers, which terminate their engine-core
    processes, then the CUDA caching allocator (if any) returns its free memory. With
    `shutdown_ray`, Ray (if this process started it) is shut down too."""
    gc.collect()
    import torch  # here: importing the module stays cheap

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if shutdown_ray:
        try:
            import ray
        except ImportError:
            return
        ray.shutdown()
