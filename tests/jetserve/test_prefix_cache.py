"""Prefix cache: the trie and its tiers on stand-in prefixes, then the orchestrator on a
tiny engine: cached, host-tier-only and uncached runs give the same greedy tokens, and the
cache's hit rate and bytes per tier reach the metrics."""

import threading
import time
import types

import jax
import numpy as np
import pytest

from engines import EngineConfig, create_engine
from jetserve.offline import generate_many
from jetserve.orchestrator import Orchestrator, OrchestratorConfig, Request
from jetserve.orchestrator.prefix_cache import PrefixCache, cache_key, model_cache_key
from jetserve.orchestrator.prefix_stores import LocalShards, PageStore, block_bytes
from jetserve.scheduling.page_planner import with_pages
from jetserve.scheduling.page_pool import SlotPages
from jetserve.server.metrics import ServerMetrics
from tests.jetserve.test_orchestrator_paged import PageChecker
from tests.sharding.families import host_params, model_config, place

KB = 1024
PS = 4  # tokens per page (= block) of the stand-in engine


class _Engine:
    """Stands in for a paged engine: a real page pool, a block of 32 bytes (1 layer, 1 kv
    head of dim 1, f32), and page reads that return each page's id as its KV."""

    model_config = types.SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1,
                                         kv_bytes_per_token=lambda nbytes: 2 * nbytes)
    dtype = np.float32

    def __init__(self, num_pages=16):
        self.kv_pages = SlotPages(slots=4, page_size=PS, num_pages=num_pages, max_seq_len=16)
        self.reads = []

    def read(self, pages):
        self.reads.append(list(pages))
        return np.broadcast_to(np.asarray(pages, np.float32)[:, None, None, None, None, None],
                               (len(pages), 1, 2, PS, 1, 1))

    def stack_blocks(self, blocks):
        return np.stack(blocks)

    def prefix_from_blocks(self, stack, tokens):
        return stack, list(tokens)


def _paged(hbm_blocks=100, host_blocks=100, num_pages=16):
    eng = _Engine(num_pages)
    cache = PrefixCache(store=PageStore(eng, eng.read), hbm_bytes=32 * hbm_blocks,
                        host_bytes=32 * host_blocks)
    return eng, cache


def _serve(eng, cache, slot, prompt):
    """What a request goes through: lookup, insert into `slot` linking the hit's pages,
    adopt; returns the hit (released by adopt)."""
    hit = cache.lookup("k", prompt)
    eng.kv_pages.insert(slot, len(prompt), shared=hit.pages)
    cache.adopt(hit, eng.kv_pages.pages_of(slot))
    return hit


def _check(eng, cache):
    eng.kv_pages.check(cache.page_owners())


def test_longest_whole_block_prefix_leaving_one_token_to_prefill():
    eng, cache = _paged()
    prompt = list(range(1, 14))  # 13 tokens: 3 whole blocks of 4
    _serve(eng, cache, 0, prompt)
    hit = cache.lookup("k", prompt + [99, 98])
    assert hit.tokens == 12 and hit.pages == eng.kv_pages.pages_of(0)[:3]
    hit.release()
    assert cache.lookup("k", prompt[:12]).tokens == 8  # the last token is always prefilled
    assert cache.lookup("k", prompt[:5] + [0] * 9).tokens == 4  # diverges in block 2
    assert cache.lookup("k", [0] + prompt).tokens == 0
    assert cache.lookup("other model", prompt + [1]).tokens == 0  # the key separates models
    s = cache.stats()
    assert (s["lookups"], s["hits"], s["hit_tokens"]) == (6, 3, 24)
    assert s["hit_rate"] == pytest.approx(0.5) and s["hbm_blocks"] == 3 and s["hbm_bytes"] == 96


def test_a_shared_prefix_is_stored_once_and_its_pages_are_linked_not_copied():
    eng, cache = _paged()
    system = [7] * 8  # two blocks
    _serve(eng, cache, 0, system + [1, 2, 3, 4, 5])
    first = eng.kv_pages.pages_of(0)
    hit = _serve(eng, cache, 1, system + [9, 9, 9, 9, 9, 9])
    assert hit.tokens == 8 and hit.pages == first[:2]
    assert eng.kv_pages.pages_of(1)[:2] == first[:2]  # shared pages, no copy
    assert [eng.kv_pages.pool.refcount(p) for p in first[:2]] == [3, 3]  # 2 slots + cache
    # The system prompt's 2 blocks once, then one more block per prompt.
    assert cache.stats()["hbm_blocks"] == 4 and eng.reads == []
    _check(eng, cache)
    for slot in (0, 1):
        eng.kv_pages.free(slot)
    _check(eng, cache)
    assert eng.kv_pages.free_count == 16 - 4  # the cache's pages stay used
    cache.clear()
    _check(eng, cache)
    assert eng.kv_pages.free_count == 16


def test_lru_leaves_move_to_host_then_drop_and_pinned_nodes_stay():
    eng, cache = _paged(hbm_blocks=3, host_blocks=2)
    a, b = [1] * 12 + [0], [2] * 12 + [0]  # 3 blocks each
    _serve(eng, cache, 0, a)
    pages_a = eng.kv_pages.pages_of(0)
    pinned = cache.lookup("k", a)  # a request about to use a's blocks
    _serve(eng, cache, 1, b)
    # Over budget by 3: a's blocks are pinned, so b's leaves go down (deepest first)
    # until the host holds 2, then the host drops its least recent leaf.
    nodes = cache.nodes()
    assert [(d, t, p) for k, d, t, p in nodes if t == "hbm"] == [(1, "hbm", 1), (2, "hbm", 1),
                                                                 (3, "hbm", 1)]
    assert cache.stats()["host_blocks"] == 2 and cache.stats()["dropped"] == 1
    assert all(p in pages_a for p in pinned.pages)
    pinned.release()
    _check(eng, cache)
    # b's first two blocks on the host hold b's pages' KV (the page ids here).
    hit = cache.lookup("k", b)
    assert hit.tokens == 8 and hit.pages == []
    pages_b = eng.kv_pages.pages_of(1)
    assert [int(x.flat[0]) for x in hit.blocks] == pages_b[:2]
    stack, tokens = cache.existing_prefix(hit, b)
    assert stack.shape[0] == 2 and tokens == b[:8]
    hit.release()
    s = cache.stats()
    assert s["host_hits"] == 1 and s["evicted_to_host"] == 3


def test_host_blocks_come_back_into_the_slots_pages_on_adopt():
    eng, cache = _paged(hbm_blocks=2, host_blocks=10)
    p = [3] * 8 + [4]
    _serve(eng, cache, 0, p)
    eng.kv_pages.free(0)
    _serve(eng, cache, 1, [5] * 8 + [6])  # pushes p's two blocks to the host
    assert sorted(t for _, d, t, _ in cache.nodes() if d <= 2) == ["hbm", "hbm", "host", "host"]
    hit = _serve(eng, cache, 2, p + [1, 1])  # a host hit: its KV goes to fresh pages, adopted
    assert hit.tokens == 8 and hit.pages == [] and len(hit.blocks) == 2
    mine = eng.kv_pages.pages_of(2)
    again = cache.lookup("k", p)
    assert again.pages == mine[:2]  # back on the device, in the slot's pages
    again.release()
    assert cache.stats()["restored"] == 2
    _check(eng, cache)


def test_make_room_frees_only_pages_the_cache_alone_holds():
    eng, cache = _paged(host_blocks=0)
    _serve(eng, cache, 0, [1] * 8 + [2])
    _serve(eng, cache, 1, [3] * 8 + [4])
    eng.kv_pages.free(0)  # slot 0's pages are now held by the cache only
    free = eng.kv_pages.free_count
    assert cache.make_room(5) == 2  # slot 1's cached pages are in use: they stay
    assert eng.kv_pages.free_count == free + 2
    assert cache.lookup("k", [1] * 8 + [2]).tokens == 0
    hit = cache.lookup("k", [3] * 8 + [4])
    assert hit.tokens == 8
    eng.kv_pages.free(1)
    assert cache.make_room(5) == 0  # pinned by the hit
    hit.release()
    assert cache.make_room(5) == 2
    _check(eng, cache)
    assert eng.kv_pages.free_count == 16


def test_a_lookup_waits_for_pages_an_earlier_request_is_about_to_cache():
    eng, cache = _paged()
    system = [8] * 8
    first = cache.lookup("k", system + [1])  # a miss, handed on to be inserted
    cache.hand_on(first)
    got = []
    t = threading.Thread(target=lambda: got.append(cache.lookup("k", system + [2], 60.0)))
    t.start()
    time.sleep(0.05)
    assert not got  # waiting: the first request's pages would lengthen its hit
    eng.kv_pages.insert(0, 9)
    cache.adopt(first, eng.kv_pages.pages_of(0))
    t.join(10)
    assert got[0].tokens == 8 and got[0].pages == eng.kv_pages.pages_of(0)[:2]
    got[0].release()
    # Nothing handed on that shares its first block: no wait, whatever wait_s says (600 s
    # here: a lookup that waited would outlast the join below by far).
    found = []
    t = threading.Thread(target=lambda: found.append(cache.lookup("k", [9] * 9, 600.0)))
    t.start()
    t.join(120)
    assert found and found[0].tokens == 0
    found[0].release()


def test_host_only_cache_and_budgets():
    eng, cache = _paged(hbm_blocks=0, host_blocks=4)
    _serve(eng, cache, 0, [5] * 8 + [1])
    assert [t for *_, t, _ in cache.nodes()] == ["host", "host"]  # moved down at once
    eng.kv_pages.free(0)
    assert eng.kv_pages.free_count == 16
    hit = _serve(eng, cache, 1, [5] * 8 + [2])
    assert hit.tokens == 8 and hit.pages == []
    assert cache.stats()["hbm_blocks"] == 0 and cache.stats()["host_hits"] == 1
    with pytest.raises(ValueError, match="budgets"):
        _paged(hbm_blocks=0, host_blocks=0)


def test_cache_key_follows_the_tokenizer_and_chat_template(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ a }}"}')
    k1 = model_cache_key(str(tmp_path), "cfg")
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ b }}"}')
    assert model_cache_key(str(tmp_path), "cfg") != k1
    assert model_cache_key(str(tmp_path), "other cfg") != model_cache_key(str(tmp_path), "cfg")
    assert cache_key("a", 1) == cache_key("a", 1) != cache_key("a", 2)


SYSTEM = list(range(3, 43))  # a 40-token shared system prompt: 5 blocks of 8
QUESTIONS = ([7, 8, 9], [100, 101], [55, 4, 4, 4, 60], [9])
SHAPES = dict(max_concurrent_decodes=2, max_prefill_length=64, max_seq_len=96)


@pytest.fixture(scope="module", params=[("qwen2", "paged"), ("llama", "paged"),
                                        ("qwen2", "contiguous"), ("llama", "contiguous")],
                ids="-".join)
def setup(request):
    family, layout = request.param
    cfg = EngineConfig(**SHAPES, kv_layout=layout, page_size=8)
    # A paged engine with its page planner: the test reads its pages after serving.
    eng = with_pages(create_engine(model_config(family), devices=jax.devices()[:1], config=cfg))
    params = place(eng, host_params(eng))
    prompts = [SYSTEM + q for q in QUESTIONS]
    want = [r.token_ids for r in generate_many(eng, params, prompts, max_tokens=8,
                                               ignore_eos=True)]
    return eng, params, prompts, want


@pytest.mark.parametrize("hbm,host", [(64 * KB * KB, 0), (0, 64 * KB * KB)], ids=["hbm", "host"])
def test_cached_runs_give_the_uncached_tokens(setup, hbm, host):
    eng, params, prompts, want = setup
    config = OrchestratorConfig(prefix_cache_hbm_bytes=hbm, prefix_cache_host_bytes=host,
                                prefix_cache_block=8, prefix_cache_key="test")
    with Orchestrator.from_engines(eng, params=params, config=config) as orch:
        got = [orch.submit(Request(prompt_ids=p, max_tokens=8, ignore_eos=True)).result(
            timeout=300).token_ids for p in prompts]  # one after another: each can hit
        s = orch.stats()["prefix_cache"][0]
        metrics = ServerMetrics(orch).render()[0].decode()
    assert got == want
    assert s["device_store"] == ("pages" if eng.kv_pages is not None else "arrays")
    assert 'jetserve_prefix_cache_hit_rate{engine="0"} 0.75' in metrics
    assert f'jetserve_prefix_cache_bytes{{engine="0",tier="hbm"}} {float(s["hbm_bytes"])}' \
        in metrics
    assert f'jetserve_prefix_cache_blocks{{engine="0",tier="host"}} {float(s["host_blocks"])}' \
        in metrics
    # Every request after the first reuses the 40-token system prompt (5 blocks of 8), and
    # the cache holds those 5 blocks once (each prompt has no other whole block).
    assert s["hits"] == 3 and s["hit_tokens"] == 3 * 40
    assert (s["host_hits"] == 3) == (hbm == 0)
    tier = "hbm" if hbm else "host"
    assert s[f"{tier}_blocks"] == 5 and s[f"{tier}_bytes"] == 5 * block_bytes(eng, 8)
    if eng.kv_pages is not None:  # the orchestrator's end gave the cache's pages back
        eng.kv_pages.check()
        assert eng.kv_pages.free_count == eng.kv_pages.pool.num_pages


def test_shared_pages_while_requests_are_cancelled_and_preempted():
    """Six requests through one system prompt at once on a pool too small for them: they
    share its cached pages, some are preempted and recomputed, one is cancelled mid-stream;
    the page invariant (cache included) holds after every step and the tokens are the
    uncached ones."""
    cfg = EngineConfig(**{**SHAPES, "max_concurrent_decodes": 4}, kv_layout="paged",
                       page_size=8, num_pages=14)
    eng = with_pages(create_engine(model_config("llama"), devices=jax.devices()[:1], config=cfg))
    params = place(eng, host_params(eng))
    prompts = [SYSTEM + [i + 1] * (1 + i % 4) for i in range(6)]
    want = [r.token_ids for r in generate_many(eng, params, prompts, max_tokens=30,
                                               ignore_eos=True)]
    config = OrchestratorConfig(prefix_cache_hbm_bytes=64 * KB * KB,
                                prefix_cache_host_bytes=64 * KB * KB, prefix_cache_key="t")
    orch = Orchestrator.from_engines(eng, params=params, config=config)
    checker = PageChecker(orch)
    orch.add_listener(checker)
    with orch:
        orch.submit(Request(prompt_ids=prompts[0], max_tokens=1)).result(timeout=300)
        handles = [orch.submit(Request(prompt_ids=p, max_tokens=30, ignore_eos=True))
                   for p in prompts]
        while len(handles[2].timing.token_times) < 3 and not handles[2].done:
            time.sleep(0.002)
        handles[2].cancel()
        out = [h.result(timeout=300) for h in handles]
        stats = orch.stats()
    assert checker.errors == [] and checker.steps > 0
    assert stats["generate"][0]["preemptions"] >= 1
    assert stats["prefix_cache"][0]["hits"] >= 5
    for i, c in enumerate(out):
        if i == 2:
            assert c.finish_reason == "cancelled" and c.token_ids == want[i][:len(c.token_ids)]
        else:
            assert c.finish_reason == "length" and c.token_ids == want[i], i
    eng.kv_pages.check()
    assert eng.kv_pages.free_count == eng.kv_pages.pool.num_pages


def test_disaggregated_prefill_caches_blocks_on_its_own_slice():
    """Prefill on one engine (contiguous), decode on another (paged): the cache keeps
    device arrays on the prefill engine and gives the uncached tokens."""
    devices = jax.devices()
    prefill = create_engine(model_config("qwen2"), devices=devices[:1],
                            config=EngineConfig(**SHAPES))
    gen = create_engine(model_config("qwen2"), devices=devices[1:2],
                        config=EngineConfig(**SHAPES, kv_layout="paged", page_size=8))
    host = host_params(prefill)
    pp, gp = (place(e, host) for e in (prefill, gen))
    prompts = [SYSTEM + q for q in QUESTIONS]
    want = [r.token_ids for r in generate_many(prefill, pp, prompts, max_tokens=8,
                                               ignore_eos=True)]
    config = OrchestratorConfig(prefix_cache_hbm_bytes=64 * KB * KB, prefix_cache_block=8,
                                prefix_cache_key="d")
    with Orchestrator(prefill_engines=[prefill], generate_engines=[gen], prefill_params=[pp],
                      generate_params=[gp], config=config) as orch:
        got = [orch.submit(Request(prompt_ids=p, max_tokens=8, ignore_eos=True)).result(
            timeout=300).token_ids for p in prompts]
        s = orch.stats()["prefix_cache"][0]
    assert got == want
    assert s["device_store"] == "arrays" and s["hits"] == 3 and s["hbm_blocks"] == 5


def test_local_shards_keep_one_copy_per_part_and_go_back_where_they_were():
    """The host tier of a block over several processes keeps this process's shards (one
    numpy copy per distinct index: a replicated axis is not stored twice) and rebuilds
    the same array with the same sharding."""
    mesh = jax.make_mesh((2, 4), ("model", "data"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, None,
                                                                           "model"))
    block = jax.device_put(np.arange(2 * 2 * 4 * 2 * 3, dtype=np.float32).reshape(2, 2, 4, 2, 3),
                           sharding)
    host = LocalShards(block)
    assert len(host.parts) == 2 and len(host.where) == 8
    assert sum(x.nbytes for x in host.parts.values()) == block.nbytes
    back = host.to_device()
    assert back.sharding == sharding
    np.testing.assert_array_equal(np.asarray(back), np.asarray(block))
