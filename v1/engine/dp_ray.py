"""Data-parallel engine cores as Ray actors: `data_parallel_backend="ray"` (vLLM's), for cores
on more than one host.

A placement group of `data_parallel_size` bundles, one `EngineCoreActor` in each: an ordinary
`EngineCoreProc` on `tcp://ITS_NODE_IP:PORT`, connected to as any core (Ray places, ZMQ carries).
Ray restarts nothing: a dead actor is a dead core. Shutdown kills the actors and removes the
group. Details: docs/data-parallel.md.
"""

import logging
import os
import threading
from typing import Any

from v1.config import EngineArgs

logger = logging.getLogger("v1")

# How long to wait for the cluster to grant the placement group and the cores to load.
STARTUP_TIMEOUT_S = 600.0


class EngineCoreActor:
    """The body of a Ray actor: one engine core serving ZMQ clients over TCP."""

    def __init__(self, args: EngineArgs, rank: int, num_threads: int) -> None:
        import ray

        from v1.openmp import import_engine_module

        EngineCore = import_engine_module("v1.engine.core").EngineCore
        import torch

        from v1.engine.core_proc import EngineCoreProc
        from v1.engine.dp_launch import free_port_pair

        torch.set_num_threads(num_threads)
        core = EngineCore(args)
        ip = ray.util.get_node_ip_address()
        self.address = f"tcp://{ip}:{free_port_pair(ip)}"
        self.proc = EngineCoreProc(core, self.address)
        self.rank = rank
        threading.Thread(target=self.proc.run, name="v1-core-busy-loop", daemon=True).start()

    def get_address(self) -> str:
        return self.address

    def get_pid(self) -> int:
        return os.getpid()


class RayEngineCores:
    """The actors and their placement group, for a DP client."""

    def __init__(self, args: EngineArgs) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._remove_placement_group = remove_placement_group
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(log_to_driver=False)
        n = args.data_parallel_size
        cpus = int(ray.cluster_resources().get("CPU", n))
        self.threads_per_engine = max(1, cpus // n)
        self.actors: list[Any] = []
        self.placement_group = placement_group(
            [{"CPU": self.threads_per_engine}] * n, strategy="PACK"
        )
        try:
            ray.get(self.placement_group.ready(), timeout=STARTUP_TIMEOUT_S)
            actor_cls = ray.remote(EngineCoreActor)
            for rank in range(n):
                self.actors.append(actor_cls.options(
                    num_cpus=self.threads_per_engine,
                    max_restarts=0,
                    name=None,
                    runtime_env={"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.placement_group,
                        placement_group_bundle_index=rank,
                    ),
                ).remote(args, rank, self.threads_per_engine))
            try:
                self.addresses: list[str] = ray.get(
                    [actor.get_address.remote() for actor in self.actors],
                    timeout=STARTUP_TIMEOUT_S,
                )
            except ray.exceptions.RayActorError as e:
                cause = getattr(e, "cause", None) or e
                raise RuntimeError(f"an engine core actor failed to start: {cause}") from None
        except BaseException:
            self.close()
            raise
        logger.info("data parallel on Ray: engine cores at %s", ", ".join(self.addresses))

    def kill(self, rank: int) -> None:
        self._ray.kill(self.actors[rank], no_restart=True)

    def pids(self) -> list[int]:
        return self._ray.get([actor.get_pid.remote() for actor in self.actors])

    def close(self) -> None:
        """Kill the actors, free their placement group (and stop Ray if we started it)."""
        ray = self._ray
        if not ray.is_initialized():
            return
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        try:
            self._remove_placement_group(self.placement_group)
        except Exception:
            pass
        if self.started_ray:
            ray.shutdown()
