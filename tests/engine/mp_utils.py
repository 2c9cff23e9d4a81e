"""Helpers for tests that start engine core processes."""

import glob
import os
import socket
import time
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path

import pytest
import zmq

from v1 import LLM, SamplingParams
from v1.engine.exceptions import EngineCoreDeadError
from v1.engine.protocol import output_address

# Small KV caches: engine processes start fast and several fit in memory at once. The weights
# are `LLM()`'s default, the .gguf file's blocks, as the session's in-process `gguf_model` has
# them: the engine processes these tests start load the model themselves, and their tokens
# are compared with an in-process engine's exactly.
SMALL_ENGINE = {"num_gpu_blocks": 256, "max_model_len": 1024}

# Prompts of a few kinds (prose, numbers, code) and lengths, for the engine-process tests.
PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
LONG = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)  # runs until aborted

# The bound for "promptly" (a death noticed, a dead engine's later call refused), which takes
# ~0.1 s: far above that, so that no busy machine breaks it, and far below the hang or the
# time-out it tells apart. Speed targets belong in bench/.
PROMPTLY_S = 10.0


def wait_until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Poll `condition` until it holds; fail after `timeout_s`, a bound for a hang only (it
    waits no longer than the condition takes)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def child_pids() -> set[int]:
    """This process's live children, from /proc (zombies count: they were not reaped)."""
    me, pids = os.getpid(), set()
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[1]) == me:
            pids.add(int(stat.split("/")[2]))
    return pids


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not: it has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def marked_processes(mark: str) -> set[int]:
    """Live processes with `mark` ("NAME=VALUE") in their environment: put a fresh one into a
    script's environment, and its engine processes carry it too, wherever they were reparented
    (zombies count as gone: their environment reads empty)."""
    entry, pids = mark.encode(), set()
    for environ in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(environ, "rb") as f:
                if entry in f.read().split(b"\0"):
                    pids.add(int(environ.split("/")[2]))
        except OSError:
            continue  # exited meanwhile, or not ours
    return pids


def free_tcp_address() -> str:
    """tcp://127.0.0.1:PORT with PORT and PORT + 1 (the output socket) both free."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return f"tcp://127.0.0.1:{port}"
    raise RuntimeError("no two consecutive free ports")


def assert_ports_free(address: str) -> None:
    """A new engine could bind both ports of this tcp engine address (ZMQ binds with
    SO_REUSEADDR, so connections in TIME_WAIT do not count)."""
    ctx = zmq.Context()
    try:
        for addr in (address, output_address(address)):
            sock = ctx.socket(zmq.ROUTER)
            sock.bind(addr)
            sock.close(linger=0)
    finally:
        ctx.term()


def assert_raises_at_once(awaitable: Awaitable[object], error: type[Exception]) -> None:
    """`awaitable` raises `error` on its first step, without suspending: it sent nothing that
    it would wait for an answer to, and waited for nothing (no clock involved)."""
    steps = awaitable.__await__()
    try:
        with pytest.raises(error):
            steps.send(None)  # a suspension would return here instead of raising
    finally:
        steps.close()


def assert_greedy_match(
    a: list[int], a_top: list[Collection[int]], b: list[int], b_top: list[Collection[int]]
) -> None:
    """Two greedy runs whose batches differed (so float rounding may too), by vLLM's rule:
    equal until the first divergence, where each side's token is in the other's top-5."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            assert x in b_top[i] and y in a_top[i], f"diverged at {i}: {x} vs {y}"
            return
    assert len(a) == len(b)


def core_one_dies_alone(
    llm: LLM, kill: Callable[[], None], pid: int, reference: LLM
) -> None:
    """With a request running on each of two data-parallel cores, `kill` core 1 (process
    `pid`, on this host): once it is gone its request fails promptly with
    EngineCoreDeadError (core 0's long one still running), the client marks the core dead,
    and core 0 serves on, greedy outputs as `reference`'s."""
    engine, client = llm.llm_engine, llm.llm_engine.client
    ids = [engine.add_request(f"r{r}", PROMPTS[0], LONG, data_parallel_rank=r) for r in (0, 1)]
    wait_until(lambda: (engine.step(), client.router.loads[1].running == 1)[1])
    kill()
    wait_until(lambda: not alive(pid))  # Ray kills asynchronously
    with pytest.raises(EngineCoreDeadError, match="engine core 1 died"):
        while True:
            engine.step()
    assert engine.has_unfinished_requests()  # core 0's long one: noticed, not waited out
    assert list(client.dead_engines) == [1]
    engine.abort_requests(ids)
    ours = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    theirs = reference.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
