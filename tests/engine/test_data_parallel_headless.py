"""Engine cores on "another host" without Ray (`python -m v1 serve --headless`), here on
loopback: a separate process runs core 1 and registers it with a frontend that runs core 0.
Outputs equal to one core's, pinning to the remote core, its death (its requests fail fast,
core 0 serves on), and no process left on either side."""

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.mp_utils import (
    GREEDY,
    PROMPTS,
    SMALL_ENGINE,
    alive,
    child_pids,
    core_one_dies_alone,
    wait_until,
)
from tests.entrypoints.test_openai_server import _descendants, free_port
from v1 import LLM

pytestmark = pytest.mark.model

ENGINE_FLAGS = ["--num-gpu-blocks", str(SMALL_ENGINE["num_gpu_blocks"]),
                "--max-model-len", str(SMALL_ENGINE["max_model_len"])]


@contextlib.contextmanager
def headless_pair(model_path: Path, log: Path) -> Iterator[tuple[LLM, subprocess.Popen]]:
    """A headless process serving core 1 of 2, and an LLM frontend running core 0."""
    port = free_port()
    with open(log, "wb") as out:
        headless = subprocess.Popen(
            [sys.executable, "-m", "v1", "serve", "--model", str(model_path), "--headless",
             "--data-parallel-size", "2", "--data-parallel-size-local", "1",
             "--data-parallel-start-rank", "1", "--data-parallel-address", "127.0.0.1",
             "--data-parallel-rpc-port", str(port), *ENGINE_FLAGS],
            stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        llm = LLM(data_parallel_size=2, data_parallel_size_local=1,
                  data_parallel_rpc_port=port, **SMALL_ENGINE)
        try:
            yield llm, headless
        finally:
            llm.shutdown()
        # The frontend gone, the headless process stops its core and exits by itself.
        assert headless.wait(120) == 0, log.read_text()  # seconds; a time-out for a hang
    finally:
        if headless.poll() is None:
            headless.kill()
            headless.wait()


def test_headless_core_serves_like_a_local_one(default_model_path, dp1_llm, tmp_path):
    before = child_pids()
    with headless_pair(default_model_path, tmp_path / "headless.log") as (llm, headless):
        client = llm.llm_engine.client
        assert client.addresses[0].startswith("ipc://")
        assert client.addresses[1].startswith("tcp://127.0.0.1:")
        remote_pids = _descendants(headless.pid)
        ours = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        theirs = dp1_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
        tokens = [s.num_prompt_tokens for s in llm.get_stats().engines]
        assert all(tokens), tokens
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, data_parallel_rank=1)
        after = [s.num_prompt_tokens for s in llm.get_stats().engines]
        assert after[0] == tokens[0]
        assert after[1] - tokens[1] == sum(len(o.prompt_token_ids) for o in ours)
    wait_until(lambda: child_pids() <= before)
    wait_until(lambda: not any(map(alive, remote_pids)))


def test_headless_core_death(default_model_path, dp1_llm, tmp_path):
    with headless_pair(default_model_path, tmp_path / "headless.log") as (llm, headless):
        (core,) = [
            pid for pid in _descendants(headless.pid)
            if Path(f"/proc/{pid}/comm").read_text().strip() == "v1-engine-dp1"
        ]
        core_one_dies_alone(llm, lambda: os.kill(core, signal.SIGKILL), core, dp1_llm)
        # Core 0 served on; the headless process, its only core gone, exits.
        assert headless.wait(120) == 0


