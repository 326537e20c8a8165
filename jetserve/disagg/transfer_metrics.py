"""Prometheus gauges of the decode side's transfer stage, read from
`DecodeOrchestrator.stats()["transfer"]` at scrape time (jetserve/server/metrics.py).

Totals since start, as counters are: bytes and seconds of successful pulls (their rates'
ratio is the pull throughput, seconds over transfers the mean pull latency), pulls that
failed, failed pulls whose request was prefilled again on another worker, and prefill
calls that went to another worker after one failed; and whether each worker is up.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily

_FIELDS = (
    ("bytes", "jetserve_kv_transfer_bytes", "KV bytes pulled from prefill workers"),
    ("pulls", "jetserve_kv_transfers", "Prefixes pulled from prefill workers"),
    ("seconds", "jetserve_kv_transfer_seconds", "Seconds spent in successful pulls"),
    ("failures", "jetserve_kv_transfer_failures", "Pulls that failed"),
    ("retries", "jetserve_kv_transfer_retries", "Failed pulls prefilled again elsewhere"),
)


def transfer_gauges(stats: dict) -> Iterator[GaugeMetricFamily]:
    rows = [r for r in stats.get("transfer") or () if "bytes" in r]
    if not rows:
        return
    up = GaugeMetricFamily("jetserve_prefill_worker_up", "1 while a prefill worker takes "
                           "prefills, 0 while it is left out after a failure",
                           labels=["address"])
    for w in stats.get("prefill_workers") or ():
        up.add_metric([w["address"]], 1.0 if w["up"] else 0.0)
    yield up
    retried = [r["retries"] for r in stats.get("prefill") or () if "retries" in r]
    yield GaugeMetricFamily("jetserve_remote_prefill_retries", "Prefills sent to another "
                            "worker after one failed or timed out", value=float(sum(retried)))
    for field, name, doc in _FIELDS:
        g = GaugeMetricFamily(name, doc, labels=["engine"])
        for r in rows:
            g.add_metric([str(r.get("engine", 0))], float(r[field]))
        yield g
