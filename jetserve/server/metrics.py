"""Prometheus metrics for `/metrics`, fed by the orchestrator's listener events.

Histograms and counters are updated from the orchestrator's events (`RequestFinished`,
`StepDone`, `PrefillDone`, see jetserve.orchestrator.timing), which arrive on the
orchestrator's threads; prometheus-client's metric objects are thread-safe. Queue depths
and slots in use are read from `orchestrator.stats()` when scraped, so they are never
stale. Each ServerMetrics has its own registry, so several servers in one process (tests)
do not collide.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jetserve.disagg.transfer_metrics import transfer_gauges
from jetserve.server import compat_metrics

if TYPE_CHECKING:  # the type only: the servers import no engine code
    from jetserve.orchestrator.driver import Orchestrator

log = logging.getLogger(__name__)

# Latency buckets from 1 ms to 5 min: CPU test models and big accelerator models alike.
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            20.0, 40.0, 80.0, 160.0, 300.0)
_RATE = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
_PER_TOKEN = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
              0.5, 0.75, 1.0, 2.5)


class _StatsCollector:
    """Gauges read from orchestrator.stats() at scrape time."""

    def __init__(self, orch: Orchestrator):
        self.orch = orch

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            stats = self.orch.stats()
        except Exception:  # a scrape must not fail because stats() did
            log.exception("orchestrator.stats() failed")
            return
        queues = GaugeMetricFamily("jetserve_queue_depth", "Requests waiting in each queue",
                                   labels=["queue", "engine"])
        for name, engine, depth in _queue_depths(stats):
            queues.add_metric([name, engine], depth)
        yield queues
        if _number(stats.get("in_flight")):
            yield GaugeMetricFamily("jetserve_requests_in_flight", "Requests admitted and "
                                    "not finished", value=float(stats["in_flight"]))
        slots = GaugeMetricFamily("jetserve_slots_in_use", "Decode slots occupied",
                                  labels=["engine"])
        total = GaugeMetricFamily("jetserve_slots_total", "Decode slots", labels=["engine"])
        for engine, used, size in _slot_rows(stats):
            slots.add_metric([engine], used)
            if size is not None:
                total.add_metric([engine], size)
        yield slots
        yield total
        yield _batch_steps(stats)
        yield from _kv_gauges(stats)
        yield from transfer_gauges(stats)  # a --role decode process's pulls


def _batch_steps(stats: dict) -> CounterMetricFamily:
    """Generate steps run at each decode batch size (slots stepped), per engine."""
    steps = CounterMetricFamily("jetserve_generate_steps", "Generate steps, by the decode "
                                "batch size (slots) each ran at", labels=["engine", "batch"])
    for row in stats.get("generate") or ():
        for batch, n in (row.get("steps_by_batch") or {}).items():
            steps.add_metric([str(row.get("engine", 0)), str(batch)], float(n))
    return steps


def _kv_gauges(stats: dict) -> Iterator[GaugeMetricFamily]:
    """KV pages of paged generate engines; hit rate and bytes per tier of prefix caches."""
    pages = GaugeMetricFamily("jetserve_kv_pages_free", "Free KV pages", labels=["engine"])
    pages_total = GaugeMetricFamily("jetserve_kv_pages_total", "KV pages", labels=["engine"])
    preempted = GaugeMetricFamily("jetserve_preemptions", "Requests preempted for KV pages "
                                  "(recomputed later)", labels=["engine"])
    kv_bytes = GaugeMetricFamily("jetserve_kv_bytes", "Device bytes of the paged KV cache "
                                 "(the page pool and sliding layers' rings)", labels=["engine"])
    kv_used = GaugeMetricFamily("jetserve_kv_bytes_used", "Of them, bytes held by sequences "
                                "and cached prefixes", labels=["engine"])
    for row in stats.get("generate") or ():
        if _number(row.get("kv_pages")):
            e = str(row.get("engine", 0))
            pages.add_metric([e], float(row["kv_pages_free"]))
            pages_total.add_metric([e], float(row["kv_pages"]))
            preempted.add_metric([e], float(row["preemptions"]))
            if _number(row.get("kv_bytes")):
                kv_bytes.add_metric([e], float(row["kv_bytes"]))
                kv_used.add_metric([e], float(row["kv_bytes_used"]))
    hit_rate = GaugeMetricFamily("jetserve_prefix_cache_hit_rate", "Prefix cache lookups "
                                 "that hit", labels=["engine"])
    nbytes = GaugeMetricFamily("jetserve_prefix_cache_bytes", "Prefix cache bytes per tier",
                               labels=["engine", "tier"])
    blocks = GaugeMetricFamily("jetserve_prefix_cache_blocks", "Prefix cache blocks (trie "
                               "nodes, each a block of tokens' KV) per tier",
                               labels=["engine", "tier"])
    for row in stats.get("prefix_cache") or ():
        e = str(row.get("engine", 0))
        hit_rate.add_metric([e], float(row["hit_rate"]))
        for tier in ("hbm", "host"):
            nbytes.add_metric([e, tier], float(row[f"{tier}_bytes"]))
            blocks.add_metric([e, tier], float(row[f"{tier}_blocks"]))
    yield from (pages, pages_total, preempted, kv_bytes, kv_used, hit_rate, nbytes, blocks)


def _queue_depths(stats: dict) -> list[tuple[str, str, float]]:
    """(queue, engine, depth): admission and detokenize (engine "all"), transfer queues and
    generate backlogs per engine (see Orchestrator.stats)."""
    out = []
    for name in ("admission", "detokenize"):
        if _number(stats.get(f"{name}_queue")):
            out.append((name, "all", float(stats[f"{name}_queue"])))
    for row in stats.get("transfer") or ():
        if _number(row.get("queue")):
            out.append(("transfer", str(row.get("engine", 0)), float(row["queue"])))
    for row in stats.get("generate") or ():
        if _number(row.get("backlog")):
            out.append(("backlog", str(row.get("engine", 0)), float(row["backlog"])))
    return out


def _slot_rows(stats: dict) -> list[tuple[str, float, float | None]]:
    """(generate engine, slots in use, slots)."""
    out = []
    for row in stats.get("generate") or ():
        if _number(row.get("slots_in_use")):
            size = row.get("slots")
            out.append((str(row.get("engine", 0)), float(row["slots_in_use"]),
                        float(size) if _number(size) else None))
    return out


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class ServerMetrics:
    """The metrics of one serving process; subscribe with `orch.add_listener(m.on_event)`
    (done here when an orchestrator is given). With an orchestrator, vLLM's and JetStream's
    names too (compat_metrics.py), labelled with `model_name`."""

    def __init__(self, orch: Orchestrator | None = None, model_name: str = "jetserve"):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("jetserve_time_to_first_token_seconds",
                              "Arrival to first token", buckets=_LATENCY, registry=r)
        self.tpot = Histogram("jetserve_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              buckets=_PER_TOKEN, registry=r)
        self.e2e = Histogram("jetserve_e2e_request_latency_seconds",
                             "Arrival to last token", buckets=_LATENCY, registry=r)
        self.queue_time = Histogram("jetserve_request_queue_time_seconds",
                                    "Arrival to prefill start", buckets=_LATENCY, registry=r)
        self.step_time = Histogram("jetserve_generate_step_seconds",
                                   "Time of one generate step", buckets=_PER_TOKEN, registry=r)
        self.prefill_time = Histogram("jetserve_prefill_seconds", "Time of one prefill",
                                      buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("jetserve_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("jetserve_generation_tokens",
                                         "Tokens generated by finished requests", registry=r)
        self.drafted = Counter("jetserve_spec_draft_tokens", "Speculative decoding: draft "
                               "tokens proposed for finished requests", registry=r)
        self.accepted = Counter("jetserve_spec_accepted_tokens", "Speculative decoding: "
                                "draft tokens the target model accepted", registry=r)
        self.acceptance = Histogram("jetserve_spec_acceptance_rate", "Speculative decoding: "
                                    "accepted / proposed drafts, per finished request",
                                    buckets=_RATE, registry=r)
        self.requests = Counter("jetserve_requests", "Finished requests",
                                labelnames=["finish_reason"], registry=r)
        for reason in ("stop", "length", "cancelled", "deadline", "error"):
            self.requests.labels(reason)  # exported at 0 before the first one
        self.lora_requests = Counter("jetserve_lora_requests", "Finished requests through "
                                     "each LoRA adapter", labelnames=["adapter"], registry=r)
        self.lora_tokens = Counter("jetserve_lora_generation_tokens", "Tokens generated "
                                   "through each LoRA adapter", labelnames=["adapter"],
                                   registry=r)
        self.vllm = None
        if orch is not None:
            r.register(_StatsCollector(orch))
            self.vllm = compat_metrics.register(r, orch, model_name)
            if hasattr(orch, "add_listener"):
                orch.add_listener(self.on_event)

    def on_event(self, event: Any) -> None:
        """Listener for the orchestrator's events (called on its threads)."""
        kind = type(event).__name__
        if kind == "RequestFinished":
            if self.vllm is not None:
                self.vllm.on_event(event)
            t = event.timing
            self.requests.labels(event.finish_reason).inc()
            self.prompt_tokens.inc(event.prompt_tokens)
            self.generation_tokens.inc(event.completion_tokens)
            if getattr(event, "lora_adapter", None):
                self.lora_requests.labels(event.lora_adapter).inc()
                self.lora_tokens.labels(event.lora_adapter).inc(event.completion_tokens)
            if t.drafted:
                self.drafted.inc(t.drafted)
                self.accepted.inc(t.accepted)
                self.acceptance.observe(t.acceptance_rate)
            for hist, value in ((self.ttft, t.ttft), (self.tpot, t.tpot),
                                (self.e2e, t.latency), (self.queue_time, t.queue_time)):
                if value is not None:
                    hist.observe(value)
        elif kind == "StepDone":
            self.step_time.observe(event.step_time)
        elif kind == "PrefillDone":
            self.prefill_time.observe(event.seconds)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
