"""The engine's Prometheus metrics under vLLM's names and labels (its dashboards work unchanged),
for GET /metrics and `LLM.get_metrics()`: the core's cumulative `SchedulerStats`, fetched at
each scrape, and the frontend's per-request latencies (`IterationStats`). Under data
parallelism core series are labelled `engine` (a dead core's disappear). Each server or `LLM`
has its own `CollectorRegistry`.
"""

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from v1.engine.dp_client import DPSchedulerStats
from v1.engine.output_processor import IterationStats
from v1.outputs import SchedulerStats

# (name, kind, help, SchedulerStats field). Counters are named without `_total`, which the
# exposition appends, as vLLM's are.
_SCHEDULER_METRICS = [
    ("vllm:num_requests_running", "gauge", "Requests running in the engine.",
     "num_running_reqs"),
    ("vllm:num_requests_waiting", "gauge", "Requests waiting to run.",
     "num_waiting_reqs"),
    ("vllm:kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks in use (0 to 1).",
     "kv_cache_usage"),
    ("vllm:prefix_cache_queries", "counter",
     "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "counter",
     "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    # The disk tier (--kv-cache-dir; zero without one). vLLM has no such tier, hence v1's names.
    ("v1:disk_cache_hits", "counter",
     "Prompt tokens read back from the disk tier (counted in vllm:prefix_cache_hits too).",
     "disk_cache_hits"),
    ("v1:disk_cache_stored_blocks", "counter", "KV blocks written to the disk tier.",
     "disk_cache_stored_blocks"),
    ("v1:disk_cache_blocks", "gauge", "KV blocks on the disk tier, as this server knows.",
     "disk_cache_blocks"),
    ("vllm:num_preemptions", "counter", "Requests preempted.",
     "num_preemptions"),
    ("vllm:prompt_tokens", "counter", "Prompt tokens processed.",
     "num_prompt_tokens"),
    ("vllm:generation_tokens", "counter", "Tokens generated.",
     "num_generation_tokens"),
    ("vllm:spec_decode_num_drafts", "counter",
     "Request steps that verified draft tokens (speculative decoding).",
     "spec_decode_num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "counter", "Draft tokens verified.",
     "spec_decode_num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted.",
     "spec_decode_num_accepted_tokens"),
]
# Labelled by draft position too (0: the first draft of a step), as vLLM's.
_ACCEPTED_PER_POS = (
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "Draft tokens accepted, by their position in the draft.",
)

# vLLM's bucket boundaries, so that quantiles compare with a vLLM server's.
_TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]
_ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
]
_REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
]

# Exposed at 0 from the start, so that rate() sees a request's first success of a kind.
_FINISH_REASONS = ("stop", "length", "abort")


class _SchedulerStatsCollector(Collector):
    """The core's latest `SchedulerStats` as gauges and counters. Its counters are already
    cumulative, so they are exposed as they are rather than through `Counter.inc`."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats = SchedulerStats()

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        per_engine = stats.engines if isinstance(stats, DPSchedulerStats) else None
        for name, kind, help_text, field in _SCHEDULER_METRICS:
            family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            if per_engine is None:
                family = family_type(name, help_text, labels=["model_name"])
                family.add_metric([self.model_name], getattr(stats, field))
            else:  # data parallel: one series per live core
                family = family_type(name, help_text, labels=["model_name", "engine"])
                for i, engine_stats in enumerate(per_engine):
                    if engine_stats is not None:
                        family.add_metric([self.model_name, str(i)], getattr(engine_stats, field))
            yield family
        name, help_text = _ACCEPTED_PER_POS
        if per_engine is None:
            family = CounterMetricFamily(name, help_text, labels=["model_name", "position"])
            for pos, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                family.add_metric([self.model_name, str(pos)], count)
        else:
            family = CounterMetricFamily(
                name, help_text, labels=["model_name", "engine", "position"]
            )
            for i, engine_stats in enumerate(per_engine):
                if engine_stats is not None:
                    for pos, count in enumerate(
                        engine_stats.spec_decode_num_accepted_tokens_per_pos
                    ):
                        family.add_metric([self.model_name, str(i), str(pos)], count)
        yield family


def _1_2_5_buckets(limit: int) -> list[float]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `limit`."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class PrometheusMetrics:
    """One engine's metrics: `record` is a stat logger (of `AsyncLLM` or `LLMEngine`),
    `set_scheduler_stats` takes the engine core's stats as of now, `expose` answers a
    scrape. `max_model_len` bounds the token-count histograms' buckets, as in vLLM."""

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry()
        self._scheduler = _SchedulerStatsCollector(model_name)
        self.registry.register(self._scheduler)

        def histogram(name: str, help_text: str, buckets: list[float]) -> Histogram:
            return Histogram(
                name, help_text, ["model_name"], buckets=buckets, registry=self.registry
            ).labels(model_name)

        self._ttft = histogram(
            "vllm:time_to_first_token_seconds", "Seconds from arrival to the first token.",
            _TTFT_BUCKETS,
        )
        # vLLM's current name, and the older name of the same histogram, which vLLM's example
        # Grafana dashboard still charts.
        self._itl = [
            histogram(name, "Seconds between a request's successive tokens.", _ITL_BUCKETS)
            for name in (
                "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"
            )
        ]
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Seconds from arrival to finish.", _REQUEST_LATENCY_BUCKETS,
        )
        self._queue = histogram(
            "vllm:request_queue_time_seconds",
            "Seconds a request waited in the scheduler's queue before first being scheduled.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self._prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of each finished request.",
            _1_2_5_buckets(max_model_len),
        )
        self._generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens of each finished request.",
            _1_2_5_buckets(max_model_len),
        )
        self._success = Counter(
            "vllm:request_success", "Requests finished, by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry,
        )
        self._model_name = model_name
        for reason in _FINISH_REASONS:
            self._success.labels(model_name, reason)

    def record(self, stats: IterationStats) -> None:
        for ttft in stats.time_to_first_tokens:
            self._ttft.observe(ttft)
        for itl in stats.inter_token_latencies:
            for itl_histogram in self._itl:
                itl_histogram.observe(itl)
        for finished in stats.finished_requests:
            self._e2e.observe(finished.e2e_latency)
            if finished.queue_time is not None:
                self._queue.observe(finished.queue_time)
            self._success.labels(self._model_name, finished.finish_reason).inc()
            self._prompt_tokens.observe(finished.num_prompt_tokens)
            self._generation_tokens.observe(finished.num_generation_tokens)

    def set_scheduler_stats(self, stats: SchedulerStats) -> None:
        """The engine core's stats that the gauges and core counters show from now on."""
        self._scheduler.stats = stats

    def expose(self, accept: str) -> tuple[bytes, str]:
        """The exposition and its content type: the format the scraper's Accept header
        prefers (Prometheus asks for OpenMetrics first)."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type
