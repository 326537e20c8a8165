"""KV events as vLLM publishes them: the prefix cache's stores, tier moves, drops and clears
become BlockStored / BlockRemoved / AllBlocksCleared; replaying every event gives exactly
the blocks the cache holds (hash, medium, tokens), and each hash is the chain of its
parent's. Then over ZMQ from a serving orchestrator: a subscriber (pyzmq + msgpack, as a
router would) decodes every batch of a run in sequence."""

import json

import jax
import msgpack
import pytest
import zmq

from engines import EngineConfig, create_engine
from jetserve.orchestrator import Orchestrator, OrchestratorConfig, Request
from jetserve.orchestrator import kv_events as ev
from jetserve.orchestrator.prefix_stores import block_bytes
from jetserve.scheduling.page_planner import with_pages
from tests.jetserve.test_prefix_cache import _paged, _serve
from tests.sharding.families import host_params, model_config, place


class _Collect:
    """A publisher that keeps the batches."""

    def __init__(self):
        self.batches = []

    def publish(self, events, rank):
        self.batches.append((rank, events))


class Replay:
    """What a subscriber knows from the events: {hash: (medium, tokens)}, checking each
    event against what came before."""

    def __init__(self, key: str):
        self.blocks: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.parents: dict[int, int | None] = {}
        self.root = ev.root_hash(key)
        self.kinds = []

    def apply(self, event: dict) -> None:
        kind = event["type"]
        self.kinds.append(kind)
        if kind == "BlockStored":
            hashes, parent, tokens, size, medium = (
                event[k] for k in ("block_hashes", "parent_block_hash", "token_ids",
                                   "block_size", "medium"))
            assert len(tokens) == size * len(hashes) and event["lora_id"] is None
            assert parent is None or parent in self.parents  # told of before
            for i, h in enumerate(hashes):
                block = tuple(tokens[i * size:(i + 1) * size])
                # The hash names the prefix: recomputable from its parent and its tokens.
                assert h == ev.block_hash(self.root if parent is None else parent, block)
                assert h not in self.blocks, "stored twice without a removal"
                self.blocks[h] = (medium, block)
                self.parents[h] = parent
                parent = h
        elif kind == "BlockRemoved":
            for h in event["block_hashes"]:
                assert self.blocks.pop(h)[0] == event["medium"]
        else:
            assert event == {"type": "AllBlocksCleared"}
            self.blocks.clear()

    def matches(self, cache) -> bool:
        held = {h: (ev.MEDIUM[tier], tokens) for h, (tier, tokens) in cache.blocks().items()}
        return held == self.blocks


def test_stores_moves_drops_and_clears_replay_to_the_cache_content():
    eng, cache = _paged(hbm_blocks=2, host_blocks=2)
    out = _Collect()
    cache.events = ev.EventSink(out, rank=3)
    replay = Replay("k")
    seen = 0

    def check():
        nonlocal seen
        for rank, events in out.batches[seen:]:
            assert rank == 3
            for e in events:
                replay.apply(e)
        seen = len(out.batches)
        assert replay.matches(cache)

    p = [3] * 8 + [4]
    _serve(eng, cache, 0, p)  # two blocks stored on the device
    check()
    eng.kv_pages.free(0)
    _serve(eng, cache, 1, [5] * 8 + [6])  # p's blocks move to the host
    check()
    _serve(eng, cache, 2, p + [1, 1])  # and back into slot 2's pages, the others down
    check()
    _serve(eng, cache, 3, [7] * 12 + [1])  # over both budgets: some are dropped
    check()
    assert {"BlockStored", "BlockRemoved"} <= set(replay.kinds)
    assert {m for m, _ in replay.blocks.values()} == {ev.GPU, ev.CPU}
    assert cache.stats()["dropped"] >= 1 and cache.stats()["evicted_to_host"] >= 1
    cache.clear()
    check()
    assert replay.kinds[-1] == "AllBlocksCleared" and replay.blocks == {}


def test_the_config_is_vllms_json_and_bad_fields_are_named():
    c = ev.KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                '"endpoint": "tcp://127.0.0.1:5557", "topic": "kv-events"}')
    assert c.publishes and c.topic == "kv-events"
    assert not ev.KVEventsConfig.parse('{"publisher": "zmq"}').publishes  # not enabled
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['replay_endpoint'\]"):
        ev.KVEventsConfig.parse('{"replay_endpoint": "tcp://*:5558"}')
    with pytest.raises(ValueError, match="publisher must be"):
        ev.KVEventsConfig.parse('{"publisher": "kafka"}')
    with pytest.raises(ValueError, match="must be a JSON object"):
        ev.KVEventsConfig.parse("[1]")


SYSTEM = list(range(20, 60))  # 5 blocks of 8


def test_a_subscriber_decodes_every_event_of_a_run_and_ends_at_the_cache_content():
    cfg = EngineConfig(max_concurrent_decodes=2, max_prefill_length=64, max_seq_len=96,
                       kv_layout="paged", page_size=8)
    eng = with_pages(create_engine(model_config("llama"), devices=jax.devices()[:1],
                                   config=cfg))
    params = place(eng, host_params(eng))
    # Room for 6 device blocks: later prompts push earlier ones to the host and out.
    b = block_bytes(eng, 8)
    config = OrchestratorConfig(prefix_cache_hbm_bytes=6 * b, prefix_cache_host_bytes=3 * b,
                                prefix_cache_block=8, prefix_cache_key="events")
    kv = ev.KVEventsConfig.parse(json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:*", "topic": "kv-events"}))
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.setsockopt(zmq.RCVTIMEO, 30_000)
    orch = Orchestrator.from_engines(eng, params=params, config=config)
    publisher = ev.attach(orch, kv)
    assert publisher.endpoint.startswith("tcp://127.0.0.1:")
    sub.connect(publisher.endpoint)
    # ZMQ drops what a PUB sends before the SUB's subscription arrives: wait for an empty
    # batch to come through before the run.
    publisher.publish([], 0)
    while not sub.poll(100):
        publisher.publish([], 0)
    start = int.from_bytes(sub.recv_multipart()[1], "big") + 1
    (_, cache), = orch.prefix_caches()
    replay = Replay("events")
    try:
        with orch:
            prompts = [SYSTEM + [i, i + 1, i + 2] for i in range(3)] + \
                      [[9] * 40 + [1], [8] * 40 + [2], SYSTEM + [7]]
            for p in prompts:  # one after another: each can hit
                orch.submit(Request(prompt_ids=p, max_tokens=4, ignore_eos=True)).result(
                    timeout=300)
            publisher.flush()
            want = publisher.seq
            while start < want:
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv-events" and int.from_bytes(seq, "big") == start
                ts, events, rank = msgpack.unpackb(payload)
                assert isinstance(ts, float) and rank == 0
                for e in events:
                    replay.apply(e)
                start += 1
            assert replay.matches(cache) and replay.blocks
            assert {"BlockStored", "BlockRemoved"} <= set(replay.kinds)
            assert cache.stats()["hits"] >= 2
    finally:
        publisher.close()
        sub.close()
