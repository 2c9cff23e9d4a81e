"""vLLM's `vllm.platforms.current_platform` (served at `v1.platforms`): the device this
process's engines run on, as `EngineArgs(device="auto")` picks it (CUDA when torch sees a
GPU, else the CPU), detected at first use."""

import functools
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Platform:
    device_type: str  # "cuda" or "cpu", as torch names it
    # The environment variable that selects this platform's devices for a process.
    device_control_env_var: str

    @property
    def device_name(self) -> str:
        return self.device_type

    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def device_count(self) -> int:
        import torch

        return torch.cuda.device_count() if self.is_cuda() else 1


@functools.cache
def _detect() -> Platform:
    import torch  # at first use: importing the module stays cheap

    if torch.cuda.is_available():
        return Platform("cuda", "CUDA_VISIBLE_DEVICES")
    return Platform("cpu", "CPU_VISIBLE_MEMORY_NODES")  # vLLM's CPU platform's


def __getattr__(name: str) -> Platform:
    if name == "current_platform":
        return _detect()
    raise AttributeError(f"module 'v1.platforms' has no attribute {name!r}")
