"""The engine core in its own process (EngineCoreProc) behind SyncMPClient and LLM: parity
with the in-process engine, several frontend processes on one engine, utilities, death of
the engine (SIGKILL, an exception in the model) and clean shutdown."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from tests.engine.mp_utils import (
    PROMPTLY_S,
    PROMPTS,
    SMALL_ENGINE,
    assert_greedy_match,
    assert_ports_free,
    child_pids,
    free_tcp_address,
    wait_until,
)
from v1 import LLM, SamplingParams
from v1.config import EngineArgs
from v1.engine.core_client import SyncMPClient
from v1.engine.exceptions import EngineDeadError
from v1.engine.llm_engine import LLMEngine
from v1.engine.protocol import EngineCoreOutputType
from v1.outputs import RequestOutput, SchedulerStats

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
GREEDY_TOP5 = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5)
LONG = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)

REPO = Path(__file__).resolve().parents[2]  # where `tests.engine.engine_hooks` imports from


@pytest.fixture(scope="module")
def mp_llm(default_model_path):
    """One engine process for the module, started the default way (LLM is multiprocess)."""
    with LLM(**SMALL_ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def inproc_llm(gguf_model):
    llm = LLM(loaded_model=gguf_model, **SMALL_ENGINE)
    yield llm
    llm.shutdown()


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_gone(proc: multiprocessing.Process) -> None:
    assert proc not in multiprocessing.active_children()
    assert proc.pid not in child_pids()


def test_multiprocess_is_the_default_and_matches_inproc(mp_llm, inproc_llm):
    client = mp_llm.llm_engine.client
    assert isinstance(client, SyncMPClient) and client.address.startswith("ipc://")
    assert mp_llm.llm_engine.model_name == inproc_llm.llm_engine.model_name
    assert mp_llm.llm_engine.max_model_len == 1024
    ours = mp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    theirs = inproc_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(ours) == token_ids(theirs)
    assert [o.outputs[0].text for o in ours] == [o.outputs[0].text for o in theirs]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12, n=2)
    a = mp_llm.generate(PROMPTS[:2], sampled, use_tqdm=False)
    b = inproc_llm.generate(PROMPTS[:2], sampled, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [
        [c.token_ids for c in o.outputs] for o in b
    ]
    client.call_utility("check_integrity")


def test_stop_ids_and_strings_survive_the_wire(mp_llm, monkeypatch):
    (first,) = mp_llm.generate(["1, 2, 3, 4,"], GREEDY, use_tqdm=False)
    tok = first.outputs[0].token_ids[2]
    # As if the generation config listed `tok` among its end-of-text ids: the processor puts
    # it into all_stop_token_ids alone, which must survive the engine process's decoder.
    monkeypatch.setattr(mp_llm.llm_engine.processor, "extra_stop_token_ids", (tok,))
    (out,) = mp_llm.generate(["1, 2, 3, 4,"], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == first.outputs[0].token_ids[:3]
    assert out.outputs[0].stop_reason == tok
    monkeypatch.undo()
    params = SamplingParams(temperature=0.0, max_tokens=16, stop=[" 7"])
    (out,) = mp_llm.generate(["1, 2, 3, 4,"], params, use_tqdm=False)
    assert out.outputs[0].stop_reason == " 7" and out.outputs[0].text == " 5, 6,"
    mp_llm.llm_engine.client.call_utility("check_integrity")


def test_utilities_and_bad_input(mp_llm):
    client = mp_llm.llm_engine.client
    assert client.call_utility("ping") is True
    stats = mp_llm.get_stats()
    assert isinstance(stats, SchedulerStats) and stats.kv_cache_usage == 0
    assert mp_llm.reset_prefix_cache() is True
    with pytest.raises(ValueError, match="unknown utility"):
        client.call_utility("shutdown")
    before = mp_llm.get_stats().num_prompt_tokens
    with pytest.raises(ValueError, match="max_model_len"):
        mp_llm.generate(["x " * 3000], GREEDY, use_tqdm=False)
    assert mp_llm.get_stats().num_prompt_tokens == before  # rejected before it was sent
    client.call_utility("check_integrity")


# A second frontend process: connects to the engine at argv[1] as client argv[2], generates
# greedily for the prompts in argv[3], prints what it got, then leaves a long request running
# and vanishes without a word (the engine must abort that request).
FRONTEND = r"""
import json, os, sys
from v1.engine.core_client import SyncMPClient
from v1.engine.llm_engine import LLMEngine
from v1.sampling_params import SamplingParams

address, index, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
client = SyncMPClient(address=address, client_index=index)
received, sent = [], []
get_output, add_request = client.get_output, client.add_request

def spy():
    outputs = get_output()
    assert outputs.client_index == index, outputs
    received.extend(o.request_id for o in outputs.outputs)
    return outputs

def spy_add(request, data_parallel_rank=None):
    sent.append(request.request_id)  # the internal id, which the core's outputs carry
    add_request(request, data_parallel_rank)

client.get_output, client.add_request = spy, spy_add
engine = LLMEngine(client)
params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5)
ids = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
done = {}
while engine.has_unfinished_requests():
    for out in engine.step():
        if out.finished:
            c = out.outputs[0]
            done[out.request_id] = [c.token_ids, [list(top) for top in c.logprobs]]
engine.add_request("long", prompts[0], SamplingParams(max_tokens=1000, ignore_eos=True))
engine.step()
result = {"outputs": [done[i] for i in ids], "sent": sent, "received": received}
print(json.dumps({**result, "num_first": len(ids)}))
sys.stdout.flush()
os._exit(0)
"""


def test_two_frontend_processes_share_one_engine(mp_llm):
    address = mp_llm.llm_engine.client.address
    prompts = {1: PROMPTS[:2], 2: PROMPTS[2:]}
    solo = lambda prompts: mp_llm.generate(prompts, GREEDY_TOP5, use_tqdm=False)
    expected = {i: solo(p) for i, p in prompts.items()}
    own_expected = solo(PROMPTS[1:3])
    frontends = {
        i: subprocess.Popen(
            [sys.executable, "-c", FRONTEND, address, str(i), json.dumps(p)],
            stdout=subprocess.PIPE, text=True,
        )
        for i, p in prompts.items()
    }
    # Client 0 (this process) generates now and then meanwhile, so that steps mix clients.
    stop, own = threading.Event(), []

    def client0() -> None:
        while not stop.wait(0.5):
            own.extend(zip(own_expected, solo(PROMPTS[1:3])))

    thread = threading.Thread(target=client0)
    thread.start()
    try:
        results = {i: p.communicate(timeout=300)[0] for i, p in frontends.items()}
    finally:
        stop.set()
        thread.join()
    for i, p in frontends.items():
        assert p.returncode == 0, results[i]
        result = json.loads(results[i])
        assert set(result["received"]) <= set(result["sent"])  # only its own
        assert set(result["sent"][: result["num_first"]]) <= set(result["received"])
        for (tokens, tops), ref in zip(result["outputs"], expected[i], strict=True):
            assert_same_greedy(ref, tokens, tops)
    assert own
    for ref, out in own:
        assert_same_greedy(ref, out.outputs[0].token_ids, out.outputs[0].logprobs)
    # The vanished frontends' long requests were aborted: nothing runs, no block is held.
    wait_until(lambda: mp_llm.get_stats().num_running_reqs == 0)
    assert mp_llm.get_stats().kv_cache_usage == 0
    mp_llm.llm_engine.client.call_utility("check_integrity")


def assert_same_greedy(ref: RequestOutput, tokens: list[int], tops: list) -> None:
    c = ref.outputs[0]
    assert_greedy_match(tokens, tops, c.token_ids, c.logprobs)


def test_sigkill_mid_generation_raises_engine_dead(default_model_path):
    llm = LLM(**SMALL_ENGINE)
    client = llm.llm_engine.client
    proc, tmp_dir = client._res.proc, client._res.tmp_dir
    def kill() -> None:
        os.kill(proc.pid, signal.SIGKILL)

    timer = threading.Timer(1.0, kill)
    timer.start()
    with pytest.raises(EngineDeadError, match="killed by signal 9"):
        llm.generate(["Once upon a time"], LONG, use_tqdm=False)
    for later in (
        lambda: llm.generate(["hi"], GREEDY, use_tqdm=False),
        llm.get_stats,
        lambda: client.call_utility("ping"),
    ):
        with pytest.raises(EngineDeadError):
            later()
        assert not client._pending  # at once: no call was sent to wait for its answer
    llm.shutdown()
    assert_gone(proc)
    assert not os.path.exists(tmp_dir)


def test_exception_in_model_raises_engine_dead(default_model_path, monkeypatch):
    monkeypatch.setenv("V1_ENGINE_CORE_HOOK", "tests.engine.engine_hooks:fail_model_on_third_step")
    # Under async scheduling, the model runs on the runner thread: its error must still end
    # the busy loop and reach the client.
    engine = LLMEngine(SyncMPClient(EngineArgs(async_scheduling=True, **SMALL_ENGINE)))
    client = engine.client
    engine.add_request("0", "Once upon a time", LONG)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="RuntimeError: injected model failure"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < PROMPTLY_S
    with pytest.raises(EngineDeadError, match="injected model failure"):
        engine.add_request("1", "hi", GREEDY)
    wait_until(lambda: not client._res.proc.is_alive())
    assert client._res.proc.exitcode == 1
    engine.shutdown()
    assert_gone(client._res.proc)


def test_the_engine_starts_first_and_a_gguf_engine_needs_no_transformers(
    default_model_path, tmp_path
):
    """`LLM()` starts its engine process first: this process has loaded no torch (to
    generate without a grammar it never does: xgrammar imports it) and then imports
    transformers and loads the tokenizer while the
    engine imports torch and loads the model (on a 1B GGUF, ~1.5 s of a start, now beside
    the engine's). A GGUF file's engine needs neither transformers nor the tokenizer (the
    config and EOS as the conversion recorded them) and loads the tokenizer for its first
    grammar. Run in a fresh process: this one has imported both, and a forked engine would
    inherit them."""
    imports = tmp_path / "imports.json"
    code = (
        "import json, sys\n"
        "from v1 import LLM, SamplingParams, StructuredOutputsParams\n"
        "loaded = lambda: ['torch' in sys.modules, 'transformers' in sys.modules]\n"
        "print(json.dumps(loaded()))\n"
        f"with LLM(**{SMALL_ENGINE!r}) as llm:\n"
        "    yes_no = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams("
        "choice=['yes', 'no']))\n"
        "    llm.generate(['Is the sky blue?'], SamplingParams(max_tokens=4), use_tqdm=False)\n"
        "    print(json.dumps(loaded()))\n"
        "    (out,) = llm.generate(['Is the sky blue?'], yes_no, use_tqdm=False)\n"
        "print(json.dumps(out.outputs[0].text))\n"
    )
    env = {**os.environ, "V1_ENGINE_CORE_HOOK": "tests.engine.engine_hooks:record_start_imports",
           "V1_TEST_IMPORTS_FILE": str(imports)}
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=300, check=True)
    at_import, after_generate, answer = map(json.loads, run.stdout.splitlines()[-3:])
    assert at_import == [False, False] and after_generate == [False, True]
    assert json.loads(imports.read_text()) == {"transformers": False, "tokenizer": False}
    assert answer in ("yes", "no")  # the grammar compiled with the tokenizer loaded then


def test_the_busy_loop_is_the_only_python_thread_at_work(
    default_model_path, monkeypatch, tmp_path
):
    """The engine process steps, reads its input and sends its outputs on one thread: a
    second thread woken every step would take the GIL from the busy loop between the model's
    ops (on a loaded 2-core machine, a time slice at each hand-off). Only the parent
    watcher (two wake-ups a second) runs beside it, even after a step output of a few
    hundred KB (pyzmq frees a frame sent zero-copy on a thread of its own)."""
    threads_file = tmp_path / "threads.json"
    monkeypatch.setenv("V1_ENGINE_CORE_HOOK", "tests.engine.engine_hooks:record_threads_per_step")
    monkeypatch.setenv("V1_TEST_THREADS_FILE", str(threads_file))
    with LLM(**SMALL_ENGINE) as llm:
        large = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=20)
        (big,) = llm.generate(["word " * 900], large, use_tqdm=False)
        assert len(big.prompt_logprobs) > 900
        outputs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) > 0 for o in outputs)
    assert json.loads(threads_file.read_text()) == ["v1-parent-watch"]


def test_tcp_address_and_clean_shutdown(default_model_path):
    address = free_tcp_address()
    client = SyncMPClient(EngineArgs(**SMALL_ENGINE), address=address)
    assert client.address == address and client._res.tmp_dir is None
    engine = LLMEngine(client)
    engine.add_request("0", "The capital of France is", GREEDY)
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert outputs[0].finished and "Paris" in outputs[0].outputs[0].text
    # A second client connects to the running engine, then the owner shuts it down: the
    # second one learns from the death notice, at once.
    other = SyncMPClient(address=address, client_index=1)
    assert other.call_utility("ping") is True
    proc = client._res.proc
    client.shutdown()
    assert proc.exitcode == 0  # terminated gracefully, not killed
    assert_gone(proc)
    with pytest.raises(EngineDeadError, match="shut down"):
        other.get_output()
    other.shutdown()
    assert_ports_free(address)
    client.shutdown()  # idempotent


def test_startup_failure_is_the_engines_value_error():
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="model '/no/such/model' not found"):
        SyncMPClient(EngineArgs(model="/no/such/model"))
    assert set(multiprocessing.active_children()) <= before


def test_connect_to_nothing_times_out(monkeypatch, tmp_path):
    monkeypatch.setattr("v1.engine.transport.CONNECT_TIMEOUT_S", 0.3)
    with pytest.raises(TimeoutError, match="no engine core answered"):
        SyncMPClient(address=f"ipc://{tmp_path}/nothing")


def test_sigterm_waits_for_the_last_frame_of_a_message_being_sent() -> None:
    """A SystemExit between two frames of a message left half of it on the socket, which the
    death notice's frames then completed: the client read it garbled (a review reproduced it
    with a slowed send). While `_send` sends, SIGTERM's exit waits until it is done."""
    from v1.engine.core_proc import EngineCoreProc, _Termination

    class Socket:  # SIGTERM arrives after the first frame
        def send_multipart(self, frames):
            sent.append(frames[0])
            _Termination.on_signal(signal.SIGTERM, None)
            sent.extend(frames[1:])

    proc = SimpleNamespace(_output_socket=Socket(), _encoder=msgspec.msgpack.Encoder())
    sent: list = []
    with pytest.raises(SystemExit):
        EngineCoreProc._send(proc, 0, EngineCoreOutputType.OUTPUTS, "payload")
    assert len(sent) == 3  # the whole message, then the exit

    sent = []
    with pytest.raises(SystemExit):
        with _Termination.deferred():
            _Termination.on_signal(signal.SIGTERM, None)
            sent.append("last frame")
    assert sent == ["last frame"] and not _Termination.pending
    with pytest.raises(SystemExit):  # elsewhere, at once
        _Termination.on_signal(signal.SIGTERM, None)
    with _Termination.deferred():  # a send with no signal: nothing raised
        pass
    with pytest.raises(OSError):  # a send that fails: its error, and no exit kept for later
        with _Termination.deferred():
            _Termination.on_signal(signal.SIGTERM, None)
            raise OSError("send failed")
    assert not _Termination.pending
