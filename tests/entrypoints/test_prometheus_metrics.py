"""GET /metrics end to end: a real server, real requests, and the exposition read back with
prometheus_client's own parser, under vLLM's metric names and labels."""

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.entrypoints.test_openai_server import Server, serve

pytestmark = [pytest.mark.model, pytest.mark.slow]

MODEL = "smol"
BLOCK_SIZE = 16
# Long enough for several full blocks, so that repeating it hits the prefix cache.
SHARED_PROMPT = (
    "The library is open from nine to eight on weekdays and from ten to four on Saturdays. "
    "Loans last three weeks and can be renewed twice online. Late fees are twenty cents a day. "
    "Question: when does the library open on Saturday? Answer:"
)

GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
DISK_BLOCKS = "v1:disk_cache_blocks"  # a gauge that stays up once blocks are written
COUNTERS = [
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits", "vllm:num_preemptions", "v1:disk_cache_hits",
    "v1:disk_cache_stored_blocks", "vllm:request_success",
]
HISTOGRAMS = [
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
]


@pytest.fixture(scope="module")
def server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("prometheus_metrics") / "server.log"
    with serve(
        default_model_path, log, "--served-model-name", MODEL, "--max-model-len", "512",
        "--num-gpu-blocks", "128", "--block-size", str(BLOCK_SIZE),
        "--kv-cache-dir", str(log.parent / "kv"),
    ) as server:
        yield server


def _scrape(server: Server) -> tuple[dict[str, str], list[Sample]]:
    """Each metric family's type by name, and every sample, parsed as Prometheus would."""
    families = list(text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text))
    return {f.name: f.type for f in families}, [s for f in families for s in f.samples]


def _value(samples: list[Sample], name: str, **labels: str) -> float:
    (value,) = [
        s.value for s in samples if s.name == name and s.labels == {"model_name": MODEL, **labels}
    ]
    return value


def _post(server: Server, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}{path}", json=dict(body, model=MODEL), timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_names_types_and_labels(server: Server) -> None:
    """vLLM's names, types and `model_name` label, before any request (all at zero)."""
    types, samples = _scrape(server)
    # Prometheus asks for OpenMetrics first, and gets it.
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    response = httpx.get(f"{server.url}/metrics", headers={"accept": accept})
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    for names, kind in ((GAUGES, "gauge"), (COUNTERS, "counter"), (HISTOGRAMS, "histogram")):
        assert {name: types.get(name) for name in names} == dict.fromkeys(names, kind)
    assert types[DISK_BLOCKS] == "gauge"
    for name in [*GAUGES, DISK_BLOCKS]:
        assert _value(samples, name) == 0
    for name in COUNTERS[:-1]:
        assert _value(samples, f"{name}_total") == 0
    for reason in ("stop", "length", "abort"):
        assert _value(samples, "vllm:request_success_total", finished_reason=reason) == 0
    for name in HISTOGRAMS:
        assert _value(samples, f"{name}_count") == 0


def test_values_after_requests(server: Server) -> None:
    """Counters move by what the responses report; one histogram sample per request (per
    token after the first, for inter-token latency); a repeated prompt hits the cache."""
    _, before = _scrape(server)
    requests = [
        ("/v1/completions", {"prompt": SHARED_PROMPT, "max_tokens": 5, "temperature": 0}),
        # The same prompt again: its full blocks come from the prefix cache.
        ("/v1/completions", {"prompt": SHARED_PROMPT, "max_tokens": 3, "temperature": 0}),
        ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 1}),
        # Greedy, it answers and ends with the end-of-turn token before the limit.
        ("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 64,
            "temperature": 0,
        }),
    ]
    responses = [_post(server, path, body) for path, body in requests]
    usages = [r["usage"] for r in responses]
    reasons = [r["choices"][0]["finish_reason"] for r in responses]
    assert sorted(set(reasons)) == ["length", "stop"]
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= 2 * BLOCK_SIZE
    _, after = _scrape(server)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert delta("vllm:prefix_cache_queries_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("vllm:prefix_cache_hits_total") == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in usages
    )
    for reason in ("stop", "length", "abort"):
        assert delta("vllm:request_success_total", finished_reason=reason) == reasons.count(
            reason
        )
    num_gaps = sum(u["completion_tokens"] - 1 for u in usages)
    for name, count in [
        ("vllm:time_to_first_token_seconds", len(requests)),
        ("vllm:e2e_request_latency_seconds", len(requests)),
        ("vllm:request_queue_time_seconds", len(requests)),
        ("vllm:inter_token_latency_seconds", num_gaps),
        ("vllm:time_per_output_token_seconds", num_gaps),
    ]:
        assert delta(f"{name}_count") == count, name
        assert delta(f"{name}_sum") > 0, name
        assert delta(f"{name}_bucket", le="+Inf") == count, name
    # Nothing is left running, waiting or holding a block once the responses are in.
    for name in GAUGES:
        assert _value(after, name) == 0, name
    # The repeated prompt hit RAM, not disk; its full blocks were written to disk (on the
    # writer's thread, after their step: counted once written, so wait for them).
    assert delta("v1:disk_cache_hits_total") == 0
    num_shared_blocks = usages[0]["prompt_tokens"] // BLOCK_SIZE
    for _ in range(600):
        _, after = _scrape(server)
        if delta("v1:disk_cache_stored_blocks_total") >= num_shared_blocks:
            break
        time.sleep(0.05)
    stored = delta("v1:disk_cache_stored_blocks_total")
    assert stored >= num_shared_blocks >= 2
    assert _value(after, DISK_BLOCKS) == _value(before, DISK_BLOCKS) + stored
