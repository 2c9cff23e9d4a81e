"""Speculative decoding's counters on /metrics under vLLM's names (one core and data
parallel), read back with prometheus_client's parser."""

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from v1.engine.dp_client import combine_stats
from v1.metrics.prometheus import _SchedulerStatsCollector
from v1.outputs import SchedulerStats


def scrape(stats: SchedulerStats) -> dict[tuple[str, tuple], float]:
    collector = _SchedulerStatsCollector("m")
    collector.stats = stats
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text) for s in f.samples
        if s.name.startswith("vllm:spec_decode")
    }


def test_spec_decode_counters_as_vllm():
    stats = SchedulerStats(
        spec_decode_num_drafts=5, spec_decode_num_draft_tokens=12,
        spec_decode_num_accepted_tokens=7, spec_decode_num_accepted_tokens_per_pos=[4, 2, 1],
    )
    model = (("model_name", "m"),)
    assert scrape(stats) == {
        ("vllm:spec_decode_num_drafts_total", model): 5,
        ("vllm:spec_decode_num_draft_tokens_total", model): 12,
        ("vllm:spec_decode_num_accepted_tokens_total", model): 7,
        **{
            ("vllm:spec_decode_num_accepted_tokens_per_pos_total",
             (("model_name", "m"), ("position", str(pos)))): n
            for pos, n in enumerate([4, 2, 1])
        },
    }
    assert stats.spec_decode_acceptance_rate == 7 / 12

    other = SchedulerStats(
        spec_decode_num_drafts=1, spec_decode_num_draft_tokens=4,
        spec_decode_num_accepted_tokens=4, spec_decode_num_accepted_tokens_per_pos=[1, 1, 1, 1],
    )
    total = combine_stats([stats, None, other])
    assert total.spec_decode_num_accepted_tokens == 11
    assert total.spec_decode_num_accepted_tokens_per_pos == [5, 3, 2, 1]
    per_engine = scrape(total)
    assert per_engine[(
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        (("engine", "2"), ("model_name", "m"), ("position", "3")),
    )] == 1
