"""Data parallelism on one host (LLM(data_parallel_size=2)): two engine-core processes of
the real default model behind DPSyncMPClient. Greedy outputs equal to one core's, prefix
affinity end to end, pinning, aborts reaching the owning core, per-core stats, a core's
death (its requests fail fast, the other serves on) and no process left behind on any path.
The router's own logic is tested without a model in test_data_parallel_router.py."""

import multiprocessing
import os
import signal
import threading
import time

import pytest

from tests.engine.mp_utils import (
    GREEDY,
    LONG,
    PROMPTS,
    SMALL_ENGINE,
    child_pids,
    wait_until,
)
from tests.entrypoints.conftest import QUESTIONS, SYSTEM
from v1 import LLM
from v1.engine.core import EngineCore
from v1.engine.dp_client import DPSchedulerStats, DPSyncMPClient
from v1.engine.exceptions import EngineCoreDeadError, EngineDeadError
from v1.engine.protocol import output_address

pytestmark = pytest.mark.model



def shared_prefix_prompts(system: str, questions: list[str]) -> list[str]:
    return [f"{system}\nQuestion: {q}\nAnswer:" for q in questions]


@pytest.fixture(scope="module")
def dp_llm(default_model_path):
    with LLM(data_parallel_size=2, **SMALL_ENGINE) as llm:
        yield llm




def engine_stats(llm: LLM) -> list:
    stats = llm.get_stats()
    assert isinstance(stats, DPSchedulerStats)
    return stats.engines


def check_idle(llm: LLM) -> None:
    llm.llm_engine.client.call_utility("check_integrity")  # every live core
    assert not llm.llm_engine.output_processor.has_unfinished_requests()
    assert not llm.llm_engine.client._owners


def test_dp2_greedy_matches_dp1_and_uses_both_cores(dp_llm, dp1_llm):
    client = dp_llm.llm_engine.client
    assert isinstance(client, DPSyncMPClient) and client.data_parallel_size == 2
    assert client.threads_per_engine == max(1, len(os.sched_getaffinity(0)) // 2)
    prompts = PROMPTS + shared_prefix_prompts(SYSTEM, QUESTIONS[:4])
    ours = dp_llm.generate(prompts, GREEDY, use_tqdm=False)
    theirs = dp1_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    assert [o.outputs[0].text for o in ours] == [o.outputs[0].text for o in theirs]
    # Both cores served, and get_stats() gives each core's figures and their total.
    total = dp_llm.get_stats()
    per_core = total.engines
    assert all(s.num_prompt_tokens > 0 for s in per_core), per_core
    for field in ("num_prompt_tokens", "num_generation_tokens", "prefix_cache_queries",
                  "prefix_cache_hits"):
        assert getattr(total, field) == sum(getattr(s, field) for s in per_core)
    assert total.num_generation_tokens == sum(len(o.outputs[0].token_ids) for o in ours)
    check_idle(dp_llm)


def test_shared_prefix_stays_on_one_core(dp_llm, dp1_llm):
    """A system prompt seen once is then served by the core that cached it: the cluster's
    prefix-cache hits equal a single core's on the same requests."""
    system = SYSTEM.replace("library", "museum")  # a prefix neither engine has seen
    warm, *batch = shared_prefix_prompts(system, QUESTIONS[4:8])
    hits = {}
    for name, llm in (("dp2", dp_llm), ("dp1", dp1_llm)):
        before = llm.get_stats()
        llm.generate(warm, GREEDY, use_tqdm=False)
        llm.generate(batch, GREEDY, use_tqdm=False)
        hits[name] = llm.get_stats().prefix_cache_hits - before.prefix_cache_hits
    assert hits["dp2"] == hits["dp1"] >= 3 * (len(SYSTEM) // 5 // 16) * 16, hits
    check_idle(dp_llm)


def test_pinning(dp_llm):
    """data_parallel_rank runs a request on that core, whatever the router would choose."""
    tokenizer = dp_llm.get_tokenizer()
    prompt = "Pin me to a core, please:"
    n = len(tokenizer.encode(prompt))
    for rank in (0, 1, 1, 0):
        before = [s.num_prompt_tokens for s in engine_stats(dp_llm)]
        dp_llm.generate(prompt, GREEDY, use_tqdm=False, data_parallel_rank=rank)
        after = [s.num_prompt_tokens for s in engine_stats(dp_llm)]
        assert after[rank] - before[rank] == n and after[1 - rank] == before[1 - rank]
    before = [s.num_prompt_tokens for s in engine_stats(dp_llm)]
    dp_llm.generate([prompt, prompt], GREEDY, use_tqdm=False, data_parallel_rank=[1, 1])
    after = [s.num_prompt_tokens for s in engine_stats(dp_llm)]
    assert after[1] - before[1] == 2 * n and after[0] == before[0]
    for bad in (2, -1):
        with pytest.raises(ValueError, match="data_parallel_rank"):
            dp_llm.generate(prompt, GREEDY, use_tqdm=False, data_parallel_rank=bad)
    check_idle(dp_llm)


def test_abort_reaches_the_owning_core(dp_llm):
    engine = dp_llm.llm_engine
    client: DPSyncMPClient = engine.client
    ids = [engine.add_request(f"r{r}", PROMPTS[0], LONG, data_parallel_rank=r) for r in (0, 1)]
    for _ in range(3):
        engine.step()

    def running() -> list[int]:
        return [client.call_utility_on(i, "get_stats").num_running_reqs for i in (0, 1)]

    assert running() == [1, 1]
    engine.abort_requests([ids[1]])
    wait_until(lambda: running() == [1, 0])
    engine.abort_requests([ids[0]])
    wait_until(lambda: running() == [0, 0])
    check_idle(dp_llm)


def test_a_core_that_fails_to_start_stops_the_others(default_model_path, monkeypatch):
    """Core 1 fails as it starts: the error is raised at once, without waiting for core 0
    (which would never be ready here), and core 0's process is stopped."""

    def failing_on_core_one(self, *args, **kwargs) -> None:  # the forked cores inherit it
        if multiprocessing.current_process().name == "v1-engine-dp1":
            raise RuntimeError("core 1 cannot start")
        time.sleep(600)  # core 0: stopped long before this ends

    monkeypatch.setattr(EngineCore, "__init__", failing_on_core_one)
    before = child_pids()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="core 1 cannot start"):
        LLM(data_parallel_size=2, **SMALL_ENGINE)
    assert time.monotonic() - start < 60  # startup of two processes: seconds, not 600
    wait_until(lambda: child_pids() <= before)


def test_core_death(default_model_path, dp1_llm):
    """SIGKILL core 1 while both run requests: the batch fails with EngineCoreDeadError
    promptly, before core 0's requests could end; core 0 serves on (same outputs as one
    core), the router never sends to core 1 again, a request pinned there fails at once;
    shutdown leaves no process."""
    before = child_pids()
    llm = LLM(data_parallel_size=2, **SMALL_ENGINE)
    client: DPSyncMPClient = llm.llm_engine.client
    procs = [engine._res.proc for engine in client.engines]

    def kill_core_one() -> None:
        wait_until(lambda: client.router.loads[1].running == 2)
        os.kill(procs[1].pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_core_one)
    killer.start()
    try:
        with pytest.raises(EngineCoreDeadError, match="engine core 1 died") as info:
            llm.generate(PROMPTS, LONG, use_tqdm=False, data_parallel_rank=[0, 1, 0, 1])
        assert info.value.engine_index == 1 and len(info.value.request_ids) == 2
        assert engine_stats(llm)[0].num_generation_tokens < 2 * LONG.max_tokens
        killer.join()
        assert list(client.dead_engines) == [1] and client.dead_error is None
        # The killed core could not remove its ipc socket files: the client did (core 0's
        # are still in use).
        socket_files = [
            [a[len("ipc://"):] for a in (address, output_address(address))]
            for address in client.addresses
        ]
        assert all(os.path.exists(f) for f in socket_files[0])
        assert not any(os.path.exists(f) for f in socket_files[1])
        check_idle(llm)  # core 0's requests of the failed batch were aborted
        # Core 0 serves on, and gets everything.
        before_tokens = engine_stats(llm)[0].num_prompt_tokens
        ours = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        theirs = dp1_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
        stats = engine_stats(llm)
        assert stats[1] is None
        assert stats[0].num_prompt_tokens - before_tokens == sum(
            len(o.prompt_token_ids) for o in ours
        )
        with pytest.raises(EngineDeadError, match="engine core 1 is dead"):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, data_parallel_rank=1)
        check_idle(llm)
    finally:
        llm.shutdown()
    assert not procs[0].is_alive() and procs[0].exitcode == 0  # terminated cleanly
    wait_until(lambda: child_pids() <= before)
