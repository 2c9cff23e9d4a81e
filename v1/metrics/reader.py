"""A snapshot of Prometheus metrics as plain objects, as vLLM's `vllm.v1.metrics.reader`:
what `LLM.get_metrics()` returns.

Only the `vllm:` metrics are read. A counter labelled by `position` (the accepted draft tokens
per draft position) becomes one `Vector` per set of its other labels, its values in position
order; every other series becomes one `Counter`, `Gauge` or `Histogram` per set of labels.
"""

from collections import defaultdict
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client import Metric as PromMetric

_POSITION = "position"


@dataclass(slots=True)
class Metric:
    """One series: a metric's name and its key=value labels (one name may have several)."""

    name: str
    labels: dict[str, str]


@dataclass(slots=True)
class Counter(Metric):
    """A monotonically increasing count."""

    value: int


@dataclass(slots=True)
class Vector(Metric):
    """Counters indexed by position (values[i]: the count at position i)."""

    values: list[int]


@dataclass(slots=True)
class Gauge(Metric):
    """A value that goes up and down."""

    value: float


@dataclass(slots=True)
class Histogram(Metric):
    """Observations: their count and sum, and the cumulative count under each bucket's upper
    bound (keyed by the bound as Prometheus writes it, "+Inf" last)."""

    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(registry: CollectorRegistry = REGISTRY) -> list[Metric]:
    """The `vllm:` metrics of `registry` as they are now."""
    collected: list[Metric] = []
    for metric in registry.collect():
        if not metric.name.startswith("vllm:"):
            continue
        if metric.type == "gauge":
            collected += [Gauge(metric.name, dict(s.labels), s.value) for s in metric.samples]
        elif metric.type == "counter":
            collected += _counters(metric)
        elif metric.type == "histogram":
            collected += _histograms(metric)
    return collected


def _key(labels: dict[str, str], without: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k != without))


def _counters(metric: PromMetric) -> list[Metric]:
    totals = [s for s in metric.samples if s.name.endswith("_total")]
    if not any(_POSITION in s.labels for s in totals):
        return [Counter(metric.name, dict(s.labels), int(s.value)) for s in totals]
    by_labels: dict[tuple[tuple[str, str], ...], dict[int, int]] = defaultdict(dict)
    for s in totals:
        by_labels[_key(s.labels, _POSITION)][int(s.labels[_POSITION])] = int(s.value)
    return [
        Vector(metric.name, dict(key), [counts.get(i, 0) for i in range(max(counts) + 1)])
        for key, counts in by_labels.items()
    ]


def _histograms(metric: PromMetric) -> list[Metric]:
    series: dict[tuple[tuple[str, str], ...], Histogram] = {}
    for s in metric.samples:
        key = _key(s.labels, "le")
        hist = series.setdefault(key, Histogram(metric.name, dict(key), 0, 0.0, {}))
        if s.name.endswith("_bucket"):
            hist.buckets[s.labels["le"]] = int(s.value)
        elif s.name.endswith("_count"):
            hist.count = int(s.value)
        elif s.name.endswith("_sum"):
            hist.sum = s.value
    return list(series.values())
