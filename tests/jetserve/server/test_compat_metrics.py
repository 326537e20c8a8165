"""vLLM's and JetStream's gauges from orchestrator stats (no model): requests running and
waiting, KV usage from pages or slots, the LoRA info gauge's labels, JetStream's slot
fraction and backlog; and the adapters of requests in flight as the orchestrator reports
them."""

import types

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jetserve.orchestrator.driver import _adapters_in_flight
from jetserve.server import compat_metrics, probes

STATS = {"admission_queue": 2, "in_flight": 7,
         "generate": [{"engine": 0, "slots": 4, "slots_in_use": 3, "kv_pages": 100,
                       "kv_pages_free": 75, "kv_page_size": 16},
                      {"engine": 1, "slots": 4, "slots_in_use": 1}],
         "prefix_cache": [{"engine": 0, "lookup_tokens": 500, "hit_tokens": 320}],
         "lora": {"running": ["math", "sql"], "waiting": ["poetry"]}}


class _Orch:
    def __init__(self):
        pool = types.SimpleNamespace(max_loras=4)
        self.prefill_engines = [types.SimpleNamespace(load_adapter=None, adapters=pool)]
        self.generate_engines = []

    def stats(self):
        return STATS


def _samples(orch) -> dict:
    """{name: sample}, and {name/idx: sample} for JetStream's per-engine one."""
    r = CollectorRegistry()
    compat_metrics.register(r, orch, "m")
    text = generate_latest(r).decode()
    return {s.name + (f"/{s.labels['idx']}" if "idx" in s.labels else ""): s
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_gauges_from_stats():
    s = _samples(_Orch())
    assert s["vllm:num_requests_running"].value == 4  # slots in use, both engines
    assert s["vllm:num_requests_waiting"].value == 3  # admitted, not in a slot
    # 25 pages of 100 held on engine 0, 1 of 4 slots on the contiguous engine 1.
    assert s["vllm:kv_cache_usage_perc"].value == (25 + 1) / (100 + 4)
    assert s["vllm:prefix_cache_queries_total"].value == 500
    assert s["vllm:prefix_cache_hits_total"].value == 320
    assert s["vllm:lora_requests_info"].labels == {
        "max_lora": "4", "running_lora_adapters": "math,sql",
        "waiting_lora_adapters": "poetry"}
    assert s["jetstream_prefill_backlog_size"].value == 2
    assert s["jetstream_slots_used_percentage/0"].value == 0.75
    assert s["jetstream_slots_used_percentage/1"].value == 0.25


def test_get_load_in_both_routers_shapes():
    assert probes.load(STATS) == {"load": 7}
    assert probes.load(STATS, "sglang") == [{"dp_rank": 0, "num_reqs": 7,
                                              "num_waiting_reqs": 3, "num_tokens": 25 * 16}]


def test_adapters_in_flight_split_by_whether_their_prefill_started():
    def live(adapter, started):
        return types.SimpleNamespace(
            request=types.SimpleNamespace(lora_adapter=adapter),
            timing=types.SimpleNamespace(prefill_start=1.0 if started else None))

    lives = [live("b", True), live("a", True), live(None, True), live("c", False),
             live("a", False)]
    assert _adapters_in_flight(lives) == {"running": ["a", "b"], "waiting": ["a", "c"]}
