"""The server's speculative decoding metrics: vLLM's spec_decode_* counters under tokenmill's prefix, as
increments of the core's cumulative SpecDecodingStats."""

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.protocol import SchedulerStats, SpecDecodingStats
from tokenmill.server.metrics import PrometheusStatLogger

MODEL = "m"
COUNTERS = ("tokenmill:spec_decode_num_drafts_total", "tokenmill:spec_decode_num_draft_tokens_total",
            "tokenmill:spec_decode_num_accepted_tokens_total")
PER_POS = "tokenmill:spec_decode_num_accepted_tokens_per_pos_total"


def samples(registry: CollectorRegistry) -> dict[tuple[str, str | None], float]:
    """(sample name, position label) -> value, of every tokenmill:spec_decode_* counter."""
    text = generate_latest(registry).decode()
    return {(s.name, s.labels.get("position")): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("tokenmill:spec_decode_") and s.name.endswith("_total")}


def stats(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> SchedulerStats:
    return SchedulerStats(spec_decoding=SpecDecodingStats(drafts, draft_tokens, accepted, per_pos))


def test_cumulative_stats_become_counter_increments_with_a_position_label():
    registry = CollectorRegistry()
    logger = PrometheusStatLogger(MODEL, registry, num_speculative_tokens=3)
    assert samples(registry) == {**{(name, None): 0.0 for name in COUNTERS},
                                 **{(PER_POS, str(i)): 0.0 for i in range(3)}}  # shown from the start
    logger.record([], stats(2, 6, 3, [2, 1, 0]))
    logger.record([], None)  # a batch of outputs without stats changes nothing
    logger.record([], stats(5, 14, 7, [4, 2, 1]))
    assert samples(registry) == {
        ("tokenmill:spec_decode_num_drafts_total", None): 5.0,
        ("tokenmill:spec_decode_num_draft_tokens_total", None): 14.0,
        ("tokenmill:spec_decode_num_accepted_tokens_total", None): 7.0,
        (PER_POS, "0"): 4.0, (PER_POS, "1"): 2.0, (PER_POS, "2"): 1.0,
    }
    logger.record([], stats(5, 14, 7, [4, 2, 1]))  # the same totals again: no increment
    assert samples(registry)[("tokenmill:spec_decode_num_drafts_total", None)] == 5.0


def test_the_model_name_label_is_kept():
    registry = CollectorRegistry()
    PrometheusStatLogger("my-model", registry, num_speculative_tokens=1).record([], stats(1, 1, 1, [1]))
    text = generate_latest(registry).decode()
    assert 'tokenmill:spec_decode_num_drafts_total{model_name="my-model"} 1.0' in text
    assert 'tokenmill:spec_decode_num_accepted_tokens_per_pos_total{model_name="my-model",position="0"} 1.0' in text


def test_positions_past_the_first_totals_appear_when_drafted():
    registry = CollectorRegistry()
    logger = PrometheusStatLogger(MODEL, registry)  # not told k: the metrics come with the first spec stats
    assert samples(registry) == {}
    logger.record([], stats(1, 1, 1, [1]))
    logger.record([], stats(2, 4, 2, [2, 0, 0]))
    assert {k: v for k, v in samples(registry).items() if k[0] == PER_POS} == {
        (PER_POS, "0"): 2.0, (PER_POS, "1"): 0.0, (PER_POS, "2"): 0.0}


def test_without_speculative_decoding_there_are_no_spec_decode_metrics():
    registry = CollectorRegistry()
    logger = PrometheusStatLogger(MODEL, registry)
    logger.record([], SchedulerStats(num_running_reqs=1, prefix_cache_queries=8, prefix_cache_hits=4))
    assert samples(registry) == {} and logger.spec_decoding is None
    assert "tokenmill:prefix_cache_hits_total" in generate_latest(registry).decode()


@pytest.mark.parametrize("num_speculative_tokens", [None, 2])
def test_other_counters_are_unchanged_by_spec_stats(num_speculative_tokens):
    registry = CollectorRegistry()
    logger = PrometheusStatLogger(MODEL, registry, num_speculative_tokens)
    logger.record([], SchedulerStats(num_preemptions=2, spec_decoding=SpecDecodingStats(1, 2, 1, [1, 0])))
    assert registry.get_sample_value("tokenmill:num_preemptions_total", {"model_name": MODEL}) == 2.0
    assert registry.get_sample_value("tokenmill:spec_decode_num_draft_tokens_total", {"model_name": MODEL}) == 2.0
