"""The data-parallel group: how many engine cores, where they run, how a request picks one."""

from dataclasses import dataclass

from v1.config.checks import check_choice, check_fraction, check_int

# How a data-parallel client picks an engine core for each request (v1.engine.dp_router).
DP_ROUTING_POLICIES = ("affinity", "round_robin", "least_loaded")
DP_BACKENDS = ("mp", "ray")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """`data_parallel_size` engine cores, `data_parallel_size_local` of them (None: all) on
    this host from rank `data_parallel_start_rank`; the others register with the frontend at
    `data_parallel_address`:`data_parallel_rpc_port`. The affinity router's load guard is
    described by EngineArgs' help of the same names. Every value is checked when made."""

    data_parallel_size: int = 1
    data_parallel_routing: str = "affinity"
    data_parallel_load_ratio: float = 2.0
    data_parallel_load_slack: float = 8.0
    data_parallel_kv_threshold: float = 0.95
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 29550
    data_parallel_backend: str = "mp"

    def __post_init__(self) -> None:
        size = self.data_parallel_size
        check_int("data_parallel_size", size)
        check_choice("data_parallel_routing", self.data_parallel_routing, DP_ROUTING_POLICIES)
        if self.data_parallel_load_ratio < 1 or self.data_parallel_load_slack < 0:
            raise ValueError(
                "data_parallel_load_ratio must be >= 1 and data_parallel_load_slack >= 0, got "
                f"{self.data_parallel_load_ratio} and {self.data_parallel_load_slack}"
            )
        local, start = self.data_parallel_size_local, self.data_parallel_start_rank
        if local is not None and not 0 <= local <= size:
            raise ValueError(
                f"data_parallel_size_local must be in [0, data_parallel_size {size}], got {local}"
            )
        if not 0 <= start or start + (local or 0) > size:
            raise ValueError(
                f"data_parallel_start_rank {start} + data_parallel_size_local {local} exceeds "
                f"data_parallel_size {size}"
            )
        check_choice("data_parallel_backend", self.data_parallel_backend, DP_BACKENDS)
        if self.data_parallel_backend == "ray" and local is not None:
            raise ValueError("data_parallel_size_local is for the mp backend: Ray places cores")
        if not 0 < self.data_parallel_rpc_port < 65536:
            raise ValueError(
                f"data_parallel_rpc_port must be a TCP port, got {self.data_parallel_rpc_port}"
            )
        check_fraction("data_parallel_kv_threshold", self.data_parallel_kv_threshold)
