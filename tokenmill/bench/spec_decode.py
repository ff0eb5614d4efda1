"""Speculative decoding's acceptance over a benchmark run, for every `tokenmill bench`: from the offline
engine's cumulative SpecDecodingStats, or from a server's /metrics counters (tokenmill's or vLLM's),
read before and after the run; the difference is the run's.

The rates and result keys are vLLM's (`vllm bench serve`'s spec_decode_*): acceptance rate = accepted / draft
tokens, in percent; mean acceptance length = 1 + accepted / drafts (tokens per verifying request-step); and
position i's rate = drafts accepted at i / drafts, a fraction.
"""

from __future__ import annotations

from tokenmill.protocol import SchedulerStats, SpecDecodingStats

METRIC_PREFIXES = ("tokenmill", "vllm")
"""The /metrics prefixes of the spec_decode_* counters, tried in this order."""


def stats_of(llm) -> SpecDecodingStats | None:
    """The offline engine's counters so far; None with speculative decoding off."""
    stats: SchedulerStats | None = llm.engine.last_stats
    return None if stats is None or stats.spec_decoding is None else stats.spec_decoding.copy()


def difference(before: SpecDecodingStats | None, after: SpecDecodingStats | None) -> SpecDecodingStats | None:
    """The counts of what ran between two readings of the counters; None when `after` has none."""
    if after is None:
        return None
    before = before or SpecDecodingStats()
    old = before.accepted_per_position + [0] * max(0, len(after.accepted_per_position)
                                                    - len(before.accepted_per_position))
    return SpecDecodingStats(
        num_drafts=after.num_drafts - before.num_drafts,
        num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
        num_accepted_tokens=after.num_accepted_tokens - before.num_accepted_tokens,
        accepted_per_position=[new - o for new, o in zip(after.accepted_per_position, old)],
    )


def summary(stats: SpecDecodingStats | None) -> dict:
    """The result keys (spec_decode_*, vLLM's names and units); {} without speculative decoding."""
    if stats is None:
        return {}
    return {
        "spec_decode_acceptance_rate": 100 * stats.acceptance_rate,
        "spec_decode_acceptance_length": stats.mean_acceptance_length,
        "spec_decode_num_drafts": stats.num_drafts,
        "spec_decode_draft_tokens": stats.num_draft_tokens,
        "spec_decode_accepted_tokens": stats.num_accepted_tokens,
        "spec_decode_per_position_acceptance_rates": [
            accepted / stats.num_drafts if stats.num_drafts else 0.0 for accepted in stats.accepted_per_position
        ],
    }


def describe(result: dict) -> str | None:
    """One line for a summary() (None for {}): 'Speculative decoding: acceptance rate 62.5%, ...'."""
    if "spec_decode_acceptance_rate" not in result:
        return None
    positions = ", ".join(f"{rate:.1%}" for rate in result["spec_decode_per_position_acceptance_rates"])
    return (f"Speculative decoding: acceptance rate {result['spec_decode_acceptance_rate']:.1f}%, mean acceptance "
            f"length {result['spec_decode_acceptance_length']:.2f} ({result['spec_decode_accepted_tokens']} of "
            f"{result['spec_decode_draft_tokens']} draft tokens accepted in {result['spec_decode_num_drafts']} "
            f"drafts); by position: {positions or '-'}")


def from_metrics(text: str) -> SpecDecodingStats | None:
    """The spec_decode_* counters of a Prometheus text exposition (summed over label sets other than the
    position: vLLM's engines, say); None when it has none of them."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    per_position: dict[str, dict[int, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            prefix, _, name = sample.name.partition(":")
            if prefix not in METRIC_PREFIXES or not name.startswith("spec_decode_") or not name.endswith("_total"):
                continue
            name = name.removesuffix("_total")
            if name == "spec_decode_num_accepted_tokens_per_pos":
                positions = per_position.setdefault(prefix, {})
                position = int(sample.labels.get("position", 0))
                positions[position] = positions.get(position, 0.0) + sample.value
            else:
                key = f"{prefix}:{name}"
                values[key] = values.get(key, 0.0) + sample.value
    for prefix in METRIC_PREFIXES:
        if f"{prefix}:spec_decode_num_drafts" not in values:
            continue
        positions = per_position.get(prefix, {})
        return SpecDecodingStats(
            num_drafts=int(values[f"{prefix}:spec_decode_num_drafts"]),
            num_draft_tokens=int(values.get(f"{prefix}:spec_decode_num_draft_tokens", 0)),
            num_accepted_tokens=int(values.get(f"{prefix}:spec_decode_num_accepted_tokens", 0)),
            accepted_per_position=[int(positions.get(i, 0)) for i in range(max(positions, default=-1) + 1)],
        )
    return None
