"""`python -m v1 serve --data-parallel-size 2` end to end: greedy outputs equal to one engine
core's, /metrics per core (label `engine`), and the death of a core (its requests get a 500
promptly, the other core serves on, /health is degraded naming it, /metrics drops
it), then no engine process outlives the server, even one killed with SIGKILL; a core's
death answers every kind of client (plain, n > 1 across cores, streamed chat)."""

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.mp_utils import PROMPTLY_S, alive, wait_until
from tests.entrypoints.conftest import PLAIN_PROMPTS
from tests.entrypoints.test_openai_server import Server, _descendants, serve
from v1 import LLM, SamplingParams

pytestmark = [pytest.mark.model, pytest.mark.slow]

MODEL = "smol"
# LLM()'s default weights, as the in-process engine its tokens are compared with (gguf_model).
ENGINE = ["--max-model-len", "512", "--num-gpu-blocks", "128"]


@pytest.fixture(scope="module")
def server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("openai_dp") / "server.log"
    with serve(
        default_model_path, log, "--served-model-name", MODEL, "--data-parallel-size", "2",
        *ENGINE,
    ) as server:
        yield server


def core_pids(server: Server) -> dict[int, int]:
    """The server's engine-core processes by data-parallel index (their process names)."""
    pids = {}
    for pid in _descendants(server.proc.pid):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("v1-engine-dp"):
            pids[int(name.removeprefix("v1-engine-dp"))] = pid
    return pids


def running_per_core(server: Server) -> dict[str, float]:
    families = text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
    return {
        s.labels["engine"]: s.value
        for f in families if f.name == "vllm:num_requests_running" for s in f.samples
    }


def complete(http: httpx.Client, prompt: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}
    return http.post("/v1/completions", json=body)


def test_greedy_outputs_match_one_core_and_metrics_per_core(server: Server, gguf_model):
    with LLM(loaded_model=gguf_model, max_model_len=512, num_gpu_blocks=128) as dp1:
        expected = [
            o.outputs[0].text
            for o in dp1.generate(PLAIN_PROMPTS, SamplingParams(temperature=0, max_tokens=12),
                                  use_tqdm=False)
        ]
    with httpx.Client(base_url=server.url, timeout=120) as http:
        got = [complete(http, p).json()["choices"][0]["text"] for p in PLAIN_PROMPTS]
        assert got == expected
        families = list(text_string_to_metric_families(http.get("/metrics").text))
    prompt_tokens = {
        s.labels["engine"]: s.value
        for f in families if f.name == "vllm:prompt_tokens" for s in f.samples
    }
    assert set(prompt_tokens) == {"0", "1"} and all(prompt_tokens.values()), prompt_tokens


def prompt_tokens_per_core(http: httpx.Client) -> dict[str, float]:
    families = text_string_to_metric_families(http.get("/metrics").text)
    return {
        s.labels["engine"]: s.value
        for f in families if f.name == "vllm:prompt_tokens" for s in f.samples
    }


def test_data_parallel_rank_pins_a_request(server: Server) -> None:
    """vLLM's `data_parallel_rank` in the body runs the request on that core; out of range
    is a 400."""
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for rank in (0, 1):
            before = prompt_tokens_per_core(http)
            prompt = f"Pinned to core {rank}: " + "a long unique prompt " * 8
            assert complete(http, prompt, data_parallel_rank=rank).status_code == 200
            after = prompt_tokens_per_core(http)
            grew = {core for core in after if after[core] > before.get(core, 0)}
            assert grew == {str(rank)}, (before, after)
        bad = complete(http, "x", data_parallel_rank=2)
        assert bad.status_code == 400 and "data_parallel_rank" in bad.text


def test_core_death_then_no_orphans(server: Server):
    """Six streamed requests spread over both cores, then core 1 is killed."""
    pids = core_pids(server)
    assert sorted(pids) == [0, 1]
    body = {"model": MODEL, "max_tokens": 120, "ignore_eos": True, "stream": True}
    prompts = [f"{i}. Once upon a time" for i in range(6)]
    events: dict[int, list[tuple[float, str]]] = {i: [] for i in range(len(prompts))}
    status: dict[int, int] = {}

    def stream(i: int) -> None:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            with http.stream("POST", "/v1/completions", json={**body, "prompt": prompts[i]}) as r:
                status[i] = r.status_code
                for line in r.iter_lines():
                    if line:
                        events[i].append((time.monotonic(), line.removeprefix("data: ")))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    # Both cores run some of them (the router spread the prompts), then core 1 dies.
    wait_until(lambda: all(v > 0 for v in running_per_core(server).values()))
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    failed = []
    for t in threads:
        t.join(120)
    for i, lines in events.items():
        if status[i] == 500:  # core 1's, not started yet: a 500 with a JSON body
            (when, line), = lines
        else:  # started: the error in-band, or finished normally (core 0's)
            assert status[i] == 200 and lines[-1][1] == "[DONE]"
            when, line = lines[-2]
        last = json.loads(line)
        if "error" in last:  # core 1's: promptly after the kill
            assert last["error"]["code"] == 500 and "engine core 1 died" in last["error"]["message"]
            assert when - killed_at < PROMPTLY_S
            failed.append(i)
        else:
            assert status[i] == 200 and last["choices"][0]["finish_reason"] == "length"
    assert 0 < len(failed) < len(prompts), failed
    with httpx.Client(base_url=server.url, timeout=120) as http:
        health = http.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "degraded" and health.json()["dead_engines"] == [1]
        # The router no longer sends to core 1: every request is served, by core 0.
        for prompt in PLAIN_PROMPTS:
            response = complete(http, prompt)
            assert response.status_code == 200, response.text
        assert set(running_per_core(server)) == {"0"}
    # The frontend killed outright: its remaining core notices and exits.
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    wait_until(lambda: not any(map(alive, pids.values())))



@pytest.fixture(scope="module")
def round_robin(
    default_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """Its own server (the test kills a core): round robin spreads a request's n children
    over both cores."""
    log = tmp_path_factory.mktemp("openai_dp_rr") / "server.log"
    with serve(
        default_model_path, log, "--served-model-name", MODEL, "--data-parallel-size", "2",
        "--data-parallel-routing", "round_robin", *ENGINE,
    ) as server:
        yield server


def test_core_death_answers_every_kind_of_client(round_robin: Server) -> None:
    """A core killed (by its PID) while plain, n=4 (children on both cores) and streamed
    chat requests run: each client gets its whole answer or a clear error naming the dead
    core, none hangs; the server serves on with the other core (n=4 included), /health says
    which core is lost, and a request pinned to the dead core is refused naming it."""
    server = round_robin
    pids = core_pids(server)
    assert sorted(pids) == [0, 1]
    tokens = 120
    plain = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": tokens,
             "ignore_eos": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}],
            "max_tokens": tokens, "ignore_eos": True, "stream": True}
    bodies = [("/v1/completions", plain)] * 2 + [("/v1/completions", {**plain, "n": 4})] * 2
    bodies += [("/v1/chat/completions", chat)] * 2
    results: dict[int, tuple[int, list[str]]] = {}

    def run(i: int) -> None:
        path, body = bodies[i]
        with httpx.Client(base_url=server.url, timeout=300) as http:
            with http.stream("POST", path, json=body) as r:
                results[i] = (r.status_code, [line for line in r.iter_lines() if line])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    wait_until(lambda: all(v > 0 for v in running_per_core(server).values()))
    os.kill(pids[1], signal.SIGKILL)
    for t in threads:
        t.join(300)  # a hang guard: every client is answered
    assert not any(t.is_alive() for t in threads)
    outcomes = []
    for i, (status, lines) in sorted(results.items()):
        path, body = bodies[i]
        if body.get("stream") and status == 200:  # started: the error in-band, if any
            assert lines[-1] == "data: [DONE]", lines[-3:]
            last = json.loads(lines[-2].removeprefix("data: "))
        else:  # not streamed, or failed before its first output: one JSON body
            (line,) = lines
            last = json.loads(line)
        if "error" in last:
            assert status in (200, 500) and last["error"]["code"] == 500
            assert "engine core 1 died" in last["error"]["message"], last
            outcomes.append("error")
        else:
            assert status == 200
            choices = last["choices"]
            assert len(choices) == body.get("n", 1) or body.get("stream")
            assert all(c["finish_reason"] == "length" for c in choices)
            outcomes.append("answer")
    # The n=4 requests had children on core 1: they failed, their core-0 children aborted.
    assert outcomes[2:4] == ["error", "error"], outcomes
    with httpx.Client(base_url=server.url, timeout=300) as http:
        health = http.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "degraded" and health.json()["dead_engines"] == [1]
        served = http.post("/v1/completions", json={**plain, "n": 4, "max_tokens": 4})
        assert served.status_code == 200, served.text
        assert [c["finish_reason"] for c in served.json()["choices"]] == ["length"] * 4
        pinned = http.post("/v1/completions", json={**plain, "data_parallel_rank": 1})
        assert pinned.status_code == 500
        assert "engine core 1 is dead" in pinned.json()["error"]["message"]
        assert set(running_per_core(server)) == {"0"}
