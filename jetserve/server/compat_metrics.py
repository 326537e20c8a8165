"""`/metrics` under the names routers and gateways read: vLLM's and JetStream's.

Routers (vllm-router, sglang-router) and the Gateway API Inference Extension pick a
replica from a model server's metrics under vLLM's names (`vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, `vllm:lora_requests_info`, ...) or JetStream's two
(`jetstream_prefill_backlog_size`, `jetstream_slots_used_percentage`). This module exports
jetserve's state under those names and meanings, next to jetserve's own names
(metrics.py); docs/ROUTERS.md has the table. vLLM's series carry its `model_name` label
(the served model name).

Gauges and the prefix-cache counters are read from `orchestrator.stats()` at scrape time;
the histograms and token counters are fed by the orchestrator's events (on its threads;
prometheus-client's objects are thread-safe), like metrics.py's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:  # the type only: the servers import no engine code
    from jetserve.orchestrator.driver import Orchestrator

# vLLM's own bucket bounds are finer at the low end for TTFT; ours cover CPU test models
# up to big accelerator ones (the same as jetserve's histograms).
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
         7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0)
_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


def request_counts(stats: dict) -> tuple[float, float]:
    """(running, waiting): requests in a decode slot, and admitted ones not in one yet
    (queued, prefilling or waiting for a slot). Also what /get_load reports."""
    running = sum(float(r.get("slots_in_use") or 0) for r in stats.get("generate") or ())
    in_flight = float(stats.get("in_flight") or 0)
    return running, max(in_flight - running, 0.0)


def kv_usage(stats: dict) -> float:
    """Fraction of the KV cache in use, 0..1: pages held of a paged engine (by slots and
    the prefix cache), else decode slots occupied (each slot owns its KV rows)."""
    used = total = 0.0
    for r in stats.get("generate") or ():
        if r.get("kv_pages"):
            used += float(r["kv_pages"]) - float(r.get("kv_pages_free") or 0)
            total += float(r["kv_pages"])
        elif r.get("slots"):
            used += float(r.get("slots_in_use") or 0)
            total += float(r["slots"])
    return used / total if total else 0.0


def _backlog(stats: dict) -> float:
    """Requests waiting for a prefill: the admission queue (jetstream_prefill_backlog_size)."""
    return float(stats.get("admission_queue") or 0)


class _Gauges:
    """vLLM's and JetStream's gauges (and prefix-cache counters) read from stats()."""

    def __init__(self, orch: Orchestrator, model_name: str, max_lora: int):
        self.orch, self.model, self.max_lora = orch, model_name, max_lora

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        try:
            stats = self.orch.stats()
        except Exception:  # metrics.py logs it; a scrape must not fail because stats() did
            return
        m = [self.model]
        running, waiting = request_counts(stats)
        yield _gauge("vllm:num_requests_running", "Requests in a decode slot", running, m)
        yield _gauge("vllm:num_requests_waiting", "Requests admitted and waiting for a "
                     "decode slot (queued or prefilling)", waiting, m)
        yield _gauge("vllm:kv_cache_usage_perc", "Fraction of the KV cache in use (1 = full)",
                     kv_usage(stats), m)
        yield self._lora(stats)
        queries = hits = 0.0
        for row in stats.get("prefix_cache") or ():
            queries += float(row.get("lookup_tokens") or 0)
            hits += float(row.get("hit_tokens") or 0)
        for name, what, v in (("queries", "Prompt tokens looked up in the prefix cache", queries),
                              ("hits", "Prompt tokens found in the prefix cache", hits)):
            c = CounterMetricFamily(f"vllm:prefix_cache_{name}", what, labels=["model_name"])
            c.add_metric(m, v)
            yield c
        yield _gauge("jetstream_prefill_backlog_size", "Requests waiting for a prefill",
                     _backlog(stats))
        slots = GaugeMetricFamily("jetstream_slots_used_percentage", "Fraction of the decode "
                                  "slots in use, per generate engine", labels=["idx"])
        for r in stats.get("generate") or ():
            if r.get("slots"):
                slots.add_metric([str(r.get("engine", 0))],
                                 float(r.get("slots_in_use") or 0) / float(r["slots"]))
        yield slots

    def _lora(self, stats: dict) -> GaugeMetricFamily:
        """vLLM's info gauge: its value is the time of the scrape, its labels the news."""
        lora = stats.get("lora") or {}
        g = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters of running and "
                              "waiting requests (value: the time of this sample)",
                              labels=["max_lora", "running_lora_adapters",
                                      "waiting_lora_adapters"])
        g.add_metric([str(self.max_lora), ",".join(lora.get("running") or ()),
                      ",".join(lora.get("waiting") or ())], time.time())
        return g


def _gauge(name: str, doc: str, value: float, model: list[str] | None = None):
    g = GaugeMetricFamily(name, doc, labels=["model_name"] if model else None)
    g.add_metric(model or [], value)
    return g


class VllmMetrics:
    """vLLM's request histograms and token counters, fed by RequestFinished events."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        r, labels = registry, ["model_name"]
        self.model = model_name
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token",
                              labels, buckets=_TTFT, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time between output "
                              "tokens after the first (one sample per token)", labels,
                              buckets=_TPOT, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token",
                             labels, buckets=_REQUEST, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Arrival to prefill start",
                               labels, buckets=_REQUEST, registry=r)
        self.prompt = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests",
                              labels, registry=r)
        self.generation = Counter("vllm:generation_tokens", "Tokens generated by finished "
                                  "requests", labels, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests, by why they "
                               "finished", [*labels, "finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.success.labels(model_name, reason)
        self.prompt.labels(model_name)
        self.generation.labels(model_name)

    def on_event(self, event: Any) -> None:
        t, m = event.timing, self.model
        self.prompt.labels(m).inc(event.prompt_tokens)
        self.generation.labels(m).inc(event.completion_tokens)
        reason = event.finish_reason
        reason = reason if reason in ("stop", "length", "error") else "abort"
        self.success.labels(m, reason).inc()
        for hist, value in ((self.ttft, t.ttft), (self.e2e, t.latency),
                            (self.queue, t.queue_time)):
            if value is not None:
                hist.labels(m).observe(value)
        for gap in t.inter_token():
            self.tpot.labels(m).observe(gap)


def register(registry: CollectorRegistry, orch: Orchestrator, model_name: str) -> VllmMetrics:
    """Adds the vLLM and JetStream series over `orch` to `registry`."""
    from jetserve.lora_adapters import Adapters

    adapters = Adapters.of(orch)
    max_lora = adapters.engines[0].adapters.max_loras if adapters.enabled else 0
    registry.register(_Gauges(orch, model_name, max_lora))
    return VllmMetrics(registry, model_name)
