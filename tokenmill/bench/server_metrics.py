"""The server's own view of a `tokenmill bench serve` run, from its /metrics (tokenmill's or vLLM's names) read
before and after the run: its mean TTFT and mean queue time (histogram sum / count), which split the client's
TTFT into waiting to be scheduled, the server's prefill, and the rest (network, frontend); and the prefix
cache's hit rate (prompt tokens found in the cache / prompt tokens looked up).
"""

from __future__ import annotations

METRIC_PREFIXES = ("tokenmill", "vllm")
"""The /metrics prefixes, tried in this order."""

SERIES = (
    "time_to_first_token_seconds_sum",
    "time_to_first_token_seconds_count",
    "request_queue_time_seconds_sum",
    "request_queue_time_seconds_count",
    "prefix_cache_hits_total",
    "prefix_cache_queries_total",
)
"""The samples read (each summed over its label sets: a data-parallel server's engines, say)."""


def from_metrics(text: str) -> dict[str, float] | None:
    """SERIES' values in a Prometheus text exposition, under the first prefix that has the TTFT histogram;
    None when neither has it."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            prefix, _, name = sample.name.partition(":")
            if prefix in METRIC_PREFIXES and name in SERIES:
                found = values.setdefault(prefix, {})
                found[name] = found.get(name, 0.0) + sample.value
    for prefix in METRIC_PREFIXES:
        if "time_to_first_token_seconds_count" in values.get(prefix, {}):
            return {name: values[prefix].get(name, 0.0) for name in SERIES}
    return None


def difference(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """What the run added to each series; None when `after` has none (a server without these metrics)."""
    if after is None:
        return None
    return {name: value - (before or {}).get(name, 0.0) for name, value in after.items()}


def summary(run: dict[str, float] | None) -> dict:
    """The result keys (server_*): {} without the metrics; a mean is left out when the run has no samples."""
    if run is None:
        return {}
    result = {}
    for key, series in (("server_mean_ttft_ms", "time_to_first_token_seconds"),
                        ("server_mean_queue_time_ms", "request_queue_time_seconds")):
        if run[f"{series}_count"] > 0:
            result[key] = 1000 * run[f"{series}_sum"] / run[f"{series}_count"]
    if run["prefix_cache_queries_total"] > 0:
        result["server_prefix_cache_hit_rate"] = run["prefix_cache_hits_total"] / run["prefix_cache_queries_total"]
    result["server_prefix_cache_hits"] = int(run["prefix_cache_hits_total"])
    result["server_prefix_cache_queries"] = int(run["prefix_cache_queries_total"])
    return result
