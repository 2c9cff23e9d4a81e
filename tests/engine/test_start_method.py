"""How the engine core process starts (V1_WORKER_MULTIPROC_METHOD): with fork by default, so
that vLLM's quickstart runs as written, in a script without `if __name__ == "__main__":`;
with spawn when asked or when fork is unsafe. Scripts run in subprocesses, as a user runs
them, and no engine process outlives its script however the script ends."""

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.engine.mp_utils import (
    PROMPTLY_S,
    PROMPTS,
    SMALL_ENGINE,
    marked_processes,
    wait_until,
)
from v1 import LLM, SamplingParams
from v1.config import EngineArgs
from v1.engine import launch
from v1.engine.core_client import AsyncMPClient, SyncMPClient

METHOD_ENV = "V1_WORKER_MULTIPROC_METHOD"
QUICKSTART = Path(__file__).parent / "scripts" / "quickstart.py"
REPO = Path(__file__).resolve().parents[2]  # where `tests.engine.engine_hooks` imports from
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)

# Starts an engine, generates greedily for the prompts in argv[1] and reports; then, once a
# line comes on stdin (so that the test sees its processes first), exits (argv[2] == "exit")
# or waits to be killed.
ENGINE_SCRIPT = f"""
import json, sys, time
from v1 import LLM, RequestOutputKind, SamplingParams
llm = LLM(**{SMALL_ENGINE!r})
outputs = llm.generate(json.loads(sys.argv[1]), {GREEDY!r}, use_tqdm=False)
proc = llm.llm_engine.client._res.proc
tokens = [o.outputs[0].token_ids for o in outputs]
print(json.dumps({{"method": proc._start_method, "tokens": tokens}}), flush=True)
sys.stdin.readline()
if sys.argv[2] != "exit":
    time.sleep(600)
"""


def start_script(args: list[str], method: str | None, more_env: dict[str, str] | None = None
                 ) -> tuple[subprocess.Popen, str]:
    """`python ARGS` with V1_WORKER_MULTIPROC_METHOD=method (None: unset), `more_env`, a
    fresh mark (see `marked_processes`) and faulthandler on (SIGABRT prints every thread's
    stack) in its environment; returns the process and the mark."""
    token = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != METHOD_ENV} | {
        "V1_TEST_MARK": token, "PYTHONFAULTHANDLER": "1"} | (more_env or {})
    if method is not None:
        env[METHOD_ENV] = method
    proc = subprocess.Popen(
        [sys.executable, *args], env=env, cwd=REPO, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    return proc, f"V1_TEST_MARK={token}"


@pytest.fixture(scope="module")
def inproc_tokens(gguf_model) -> list[list[int]]:
    llm = LLM(loaded_model=gguf_model, **SMALL_ENGINE)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.model
def test_quickstart_runs_as_written(default_model_path):
    proc, mark = start_script([str(QUICKSTART)], None)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) == 4, out
    assert all(line.startswith("Prompt: '") and ", Generated text: " in line for line in lines)
    assert "spawn" not in err  # fork was safe: no warning
    assert not marked_processes(mark)  # the engine process ended with the script


@pytest.mark.model
def test_quickstart_under_spawn_fails_saying_why(default_model_path):
    proc, mark = start_script([str(QUICKSTART)], "spawn")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert (
        f"It started with 'spawn' ({METHOD_ENV}=spawn), which runs the main script again" in err
    )
    assert not marked_processes(mark)


def end_engine_script(proc: subprocess.Popen, mark: str, end: str) -> dict:
    """Read an ENGINE_SCRIPT's report, then kill it or let it exit; check that it had child
    processes (the engine; under spawn, multiprocessing's resource tracker too) and that none
    is left; return the report."""
    try:
        line = proc.stdout.readline()
        children = marked_processes(mark) - {proc.pid}
    finally:
        if end == "kill":
            proc.kill()  # SIGKILL: the script cannot shut its engine down
        try:
            _, err = proc.communicate("go\n", timeout=60)  # EOF once its engine is gone
        except subprocess.TimeoutExpired:
            for pid in marked_processes(mark):  # their stacks say where they are stuck
                os.kill(pid, signal.SIGABRT)
            _, err = proc.communicate(timeout=60)
            pytest.fail(f"the script's processes outlived it by 60 s:\n{err}")
    assert line, err
    assert children
    assert proc.returncode == (-signal.SIGKILL if end == "kill" else 0), err
    wait_until(lambda: not marked_processes(mark))
    return json.loads(line)


@pytest.mark.model
def test_both_methods_match_inproc_and_end_with_their_script(inproc_tokens, tmp_path):
    # (fork, exit) is the quickstart's test; each method and each end once more here, side
    # by side, to be quick (a third script cost CI ~20 s on 2 cores). Nothing is left in
    # their temporary directory: a killed script's engine removes its sockets' directory.
    runs = [("fork", "kill"), ("spawn", "exit")]
    scripts = [start_script(["-c", ENGINE_SCRIPT, json.dumps(PROMPTS), end], method,
                            {"TMPDIR": str(tmp_path)})
               for method, end in runs]
    try:
        for (method, end), (proc, mark) in zip(runs, scripts):
            report = end_engine_script(proc, mark, end)
            assert report["method"] == method
            assert report["tokens"] == inproc_tokens
        assert not list(tmp_path.glob("v1-*"))
    finally:
        for proc, _ in scripts:
            proc.kill()
            proc.wait()


@pytest.mark.model
@pytest.mark.parametrize("hook", ["lose_the_first_sigterm", "ignore_sigterm"])
def test_an_engine_ends_with_its_killed_script_when_a_sigterm_is_lost_or_ignored(
    hook, default_model_path, tmp_path
):
    # The engine's parent watch repeats its SIGTERM, and past a grace exits at once (its
    # sockets and their directory removed all the same).
    hook_env = {"V1_ENGINE_CORE_HOOK": f"tests.engine.engine_hooks:{hook}",
                "TMPDIR": str(tmp_path)}
    proc, mark = start_script(["-c", ENGINE_SCRIPT, json.dumps(PROMPTS[:1]), "kill"], "fork",
                              hook_env)
    try:
        end_engine_script(proc, mark, "kill")
        assert not list(tmp_path.glob("v1-*"))
    finally:
        proc.kill()
        proc.wait()


# Starts and shuts down an engine from a thread that blocks SIGTERM; prints how the engine
# process ended (its exit code).
BLOCKED_SIGTERM_SCRIPT = f"""
import signal
from v1 import LLM
signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM}})
llm = LLM(**{SMALL_ENGINE!r})
proc = llm.llm_engine.client._res.proc
llm.shutdown()
print(proc.exitcode)
"""


@pytest.mark.model
def test_an_engine_started_with_sigterm_blocked_still_shuts_down_on_it(default_model_path):
    # fork and spawn keep the starting thread's signal mask: the engine unblocks SIGTERM and
    # exits by it (0); it was killed instead (-9, after stop_process's 10 s), its clients
    # told nothing.
    proc, _ = start_script(["-c", BLOCKED_SIGTERM_SCRIPT], "fork")
    out, err = proc.communicate(timeout=120)
    assert out.split() == ["0"], err


# Starts an engine, reports, and waits to be interrupted.
INTERRUPTED_SCRIPT = f"""
import time
from v1 import LLM
llm = LLM(**{SMALL_ENGINE!r})
print("ready", flush=True)
time.sleep(600)
"""


def start_hooked_script(hook: str, tmp_path: Path) -> tuple[subprocess.Popen, str, Path]:
    """INTERRUPTED_SCRIPT, its engine run with `hook` (of tests.engine.engine_hooks; one
    that writes V1_TEST_HOOK_FILE as its slow part begins) and its temporary files in
    `tmp_path`; returns the process, its mark and the hook's file."""
    began = tmp_path / "hook-began"
    proc, mark = start_script(["-c", INTERRUPTED_SCRIPT], "fork", {
        "V1_ENGINE_CORE_HOOK": f"tests.engine.engine_hooks:{hook}",
        "V1_TEST_HOOK_FILE": str(began), "TMPDIR": str(tmp_path)})
    return proc, mark, began


def assert_nothing_left(mark: str, tmp_path: Path) -> None:
    """No process of the script's is left (promptly), nor any engine's sockets' directory."""
    wait_until(lambda: not marked_processes(mark), PROMPTLY_S)
    assert not list(tmp_path.glob("v1-*"))


@pytest.mark.model
def test_a_second_ctrl_c_while_the_engine_shuts_down_ends_the_script_at_once(
    default_model_path, tmp_path
):
    # The first Ctrl-C ends the script, which stops its engine (whose shutdown here takes
    # 30 s); the second one, meanwhile, kills it: the script ended after those 30 s before,
    # its engine's directory left behind.
    proc, mark, began = start_hooked_script("slow_shutdown", tmp_path)
    try:
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        wait_until(began.exists)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=PROMPTLY_S)
        assert_nothing_left(mark, tmp_path)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.model
def test_an_engine_whose_script_is_killed_while_it_starts_leaves_nothing(
    default_model_path, tmp_path
):
    # The engine is stopped while it starts (a hook makes that take 30 s more): its sockets'
    # directory goes with it (the script, killed, cannot remove it).
    proc, mark, began = start_hooked_script("slow_start", tmp_path)
    try:
        wait_until(began.exists)
        proc.kill()
        proc.wait()
        assert_nothing_left(mark, tmp_path)
    finally:
        proc.kill()
        proc.wait()


def test_unknown_method_is_a_value_error(monkeypatch):
    monkeypatch.setenv(METHOD_ENV, "forkserver")
    with pytest.raises(ValueError, match=f"{METHOD_ENV}='forkserver'.*'fork' or 'spawn'"):
        SyncMPClient(EngineArgs(model="/no/such/model"))


@pytest.mark.parametrize("asked", [None, "fork"])
def test_fork_falls_back_to_spawn_once_cuda_is_initialised(asked, monkeypatch, caplog):
    monkeypatch.delenv(METHOD_ENV, raising=False)
    assert launch.engine_start_method().name == "fork"
    if asked:
        monkeypatch.setenv(METHOD_ENV, asked)
    monkeypatch.setattr("torch.cuda.is_initialized", lambda: True)
    with caplog.at_level(logging.WARNING, logger="v1"):
        method = launch.engine_start_method()
    assert method.name == "spawn" and "CUDA is initialised" in method.reason
    assert "'spawn', not 'fork'" in caplog.text and "CUDA is initialised" in caplog.text


@pytest.mark.model
def test_forked_engine_leaves_the_parents_signal_handlers_alone(default_model_path, monkeypatch):
    # asyncio's signal handlers learn of signals through a wakeup fd that a forked child
    # inherits: the SIGTERM that ends the engine must not reach this process's handlers.
    monkeypatch.delenv(METHOD_ENV, raising=False)

    async def main() -> list[str]:
        loop, received = asyncio.get_running_loop(), []
        ours = loop.create_future()
        loop.add_signal_handler(signal.SIGTERM, received.append, "SIGTERM")
        loop.add_signal_handler(signal.SIGUSR1, ours.set_result, None)
        try:
            client = AsyncMPClient(EngineArgs(**SMALL_ENGINE))
            assert client._res.proc._start_method == "fork"
            client.shutdown()  # the engine has exited: any byte it wrote is in the wakeup fd
            # Our own signal's byte comes after it there: once its handler has run, so has
            # the one any earlier byte would call.
            os.kill(os.getpid(), signal.SIGUSR1)
            await asyncio.wait_for(ours, PROMPTLY_S)
        finally:
            loop.remove_signal_handler(signal.SIGTERM)
            loop.remove_signal_handler(signal.SIGUSR1)
        return received

    assert asyncio.run(main()) == []


# Reports the OpenMP wait policy in the environment as torch loads (libgomp reads it then),
# after `from v1 import LLM`, at torch's import (in the engine process: the frontend loads
# none), after the engine, in a subprocess the script starts after that, in the environment a
# spawned engine process starts with, and after that start. The spy sees imports, not a
# package's availability check (transformers' find_spec of torch).
SPY = """
import builtins, os, subprocess, sys

real_import = builtins.__import__

def spy(name, *args, **kwargs):
    if name == "torch" and "torch" not in sys.modules:
        print("torch", os.environ.get("OMP_WAIT_POLICY"), flush=True)
    return real_import(name, *args, **kwargs)

builtins.__import__ = spy
"""
POLICY_AT_TORCH_LOAD = SPY + """
from v1 import LLM
print("frontend", os.environ.get("OMP_WAIT_POLICY"), flush=True)
with LLM(num_gpu_blocks=64, max_model_len=256):
    pass
print("after", os.environ.get("OMP_WAIT_POLICY"), flush=True)
subprocess.run([sys.executable, "-c",
                "import os; print('subprocess', os.environ.get('OMP_WAIT_POLICY'))"])
from v1.engine.launch import spawn_environment
with spawn_environment():
    print("spawn", os.environ.get("OMP_WAIT_POLICY"), flush=True)
print("after", os.environ.get("OMP_WAIT_POLICY"), flush=True)
"""

# The same spy around the `v1` command (`v1 serve --help` loads the server, torch with it).
POLICY_OF_THE_COMMAND = SPY + """
from v1.__main__ import main
main(["serve", "--help"])
"""


def policies(script: str, policy: str | None, more_env: dict[str, str] | None = None
             ) -> list[str]:
    """What `script` prints, run with OMP_WAIT_POLICY=policy (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | (more_env or {})
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
        check=True,
    ).stdout
    return out.split()


@pytest.mark.parametrize("cache", ["converted", "cold"])
def test_openmp_waits_passively_in_engines_unless_told_otherwise(cache, tmp_path):
    # torch loads under the passive policy (v1.openmp), in the engine process: a
    # spinning OpenMP thread takes the CPU from the kernels' pool and the frontend (a
    # shared-prompt batch 6.7x slower on 2 busy cores). The frontend loads no torch; its
    # environment is never changed, so its own subprocesses do not inherit the policy (a
    # llama.cpp under PASSIVE ran ~3x slower); a spawned engine gets it; a policy the user
    # set is kept everywhere. With a cold cache the frontend converts the GGUF file first,
    # which loads torch there (passively too: the engine forked after inherits it).
    env = {"V1_CACHE_DIR": str(tmp_path)} if cache == "cold" else {}
    assert policies(POLICY_AT_TORCH_LOAD, None, env) == [
        "frontend", "None", "torch", "PASSIVE", "after", "None", "subprocess", "None",
        "spawn", "PASSIVE", "after", "None"]
    if cache == "converted":  # (a conversion costs the cold case ~10 s a run)
        assert policies(POLICY_AT_TORCH_LOAD, "ACTIVE")[1::2] == ["ACTIVE"] * 6


def test_the_v1_command_loads_torch_with_the_passive_policy():
    # A program of ours (the server): its torch, and the engines it forks, wait passively.
    assert policies(POLICY_OF_THE_COMMAND, None)[:2] == ["torch", "PASSIVE"]
    assert policies(POLICY_OF_THE_COMMAND, "ACTIVE")[:2] == ["torch", "ACTIVE"]
