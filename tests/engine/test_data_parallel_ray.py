"""Data-parallel engine cores as Ray actors (data_parallel_backend="ray"), on a local Ray
instance the test starts (ray.init(num_cpus=2)) and stops: outputs equal to one core's, both
cores used, an actor killed (its requests fail fast, the other core serves on), and no actor
or placement group left after shutdown. Skipped when ray is not installed."""

import os

import pytest

from tests.engine.mp_utils import GREEDY, PROMPTS, SMALL_ENGINE, core_one_dies_alone, wait_until
from v1 import LLM

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.model, pytest.mark.slow]



@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()




def test_ray_actors_serve_fail_alone_and_leave_nothing(ray_cluster, default_model_path,
                                                       dp1_llm):
    llm = LLM(data_parallel_size=2, data_parallel_backend="ray", **SMALL_ENGINE)
    client = llm.llm_engine.client
    cores = client.ray_cores
    try:
        assert all(a.startswith("tcp://") for a in client.addresses)
        assert client.threads_per_engine == 1  # 2 CPUs in the cluster, 2 cores
        pids = cores.pids()
        assert os.getpid() not in pids and len(set(pids)) == 2
        ours = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        theirs = dp1_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
        assert all(s.num_prompt_tokens for s in llm.get_stats().engines)

        core_one_dies_alone(llm, lambda: cores.kill(1), pids[1], dp1_llm)  # no restart
    finally:
        llm.shutdown()
    wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids))
    # The placement group is gone: the cluster has its CPUs back.
    wait_until(lambda: ray.available_resources().get("CPU") == 2)
