"""Prefix cache: the trie and its tiers on stand-in prefixes, then the orchestrator on a
tiny engine: cached, host-tier-only and uncached runs give the same greedy tokens, and the
cache's hit rate and bytes per tier reach the metrics."""

import jax
import numpy as np
import pytest

from engines import EngineConfig, TransformerEngine
from jetserve.offline import generate_many
from jetserve.orchestrator import Orchestrator, OrchestratorConfig, Request
from jetserve.orchestrator.prefix_cache import PrefixCache, cache_key, model_cache_key
from jetserve.server.metrics import ServerMetrics
from tests.sharding.families import host_params, model_config

KB = 1024


def _cache(hbm=10 * KB, host=10 * KB, block=4):
    moved = []

    def to_device(tree):
        moved.append(tree)
        return tree

    cache = PrefixCache(block=block, hbm_bytes=hbm, host_bytes=host, to_device=to_device,
                        head=lambda prefix, n, tokens: (prefix, n, list(tokens)))
    return cache, moved


def _prefix(nbytes: int, tag: int):
    return {"kv": np.full((nbytes // 4,), tag, np.float32)}


def test_longest_whole_block_prefix_leaving_one_token_to_prefill():
    cache, _ = _cache()
    prompt = list(range(1, 14))  # 13 tokens: 3 whole blocks of 4
    cache.insert("k", prompt, _prefix(400, 1))
    hit = cache.lookup("k", prompt + [99, 98])
    assert hit.tokens == 12 and hit.prefix[1:] == (12, prompt[:12])
    hit.release()
    assert cache.lookup("k", prompt[:12]).tokens == 8  # the last token is always prefilled
    assert cache.lookup("k", prompt[:5] + [0] * 9).tokens == 4  # diverges in block 2
    assert cache.lookup("k", [0] + prompt) is None
    assert cache.lookup("other model", prompt + [1]) is None  # the key separates models
    s = cache.stats()
    assert (s["lookups"], s["hits"], s["hit_tokens"]) == (5, 3, 24)
    assert s["hit_rate"] == pytest.approx(0.6) and s["hbm_bytes"] == 400


def test_lru_moves_to_host_then_drops_and_a_host_hit_comes_back():
    cache, moved = _cache(hbm=1000, host=1000)
    a, b, c = ([t] * 8 for t in (1, 2, 3))
    for p, tag in ((a, 1), (b, 2), (c, 3)):
        cache.insert("k", p, _prefix(600, tag))
    # a went to the host when b arrived; a was dropped when b went to the host too.
    assert cache.entries() == [("k", "host", 2), ("k", "hbm", 2)]
    assert cache.lookup("k", a + [0]) is None
    hit = cache.lookup("k", b + [0])  # from the host back to the device; c goes down
    assert hit.tokens == 8 and len(moved) == 1 and moved[0]["kv"][0] == 2
    assert cache.entries() == [("k", "host", 2), ("k", "hbm", 2)]
    s = cache.stats()
    assert s["host_hits"] == 1 and s["hbm_bytes"] == 600 and s["host_bytes"] == 600
    assert s["dropped"] == 1 and s["evicted_to_host"] == 3
    hit.release()


def test_pinned_entry_stays_on_the_device_and_host_only_cache():
    cache, _ = _cache(hbm=0, host=1000)
    cache.insert("k", [5] * 8, _prefix(400, 5))
    assert cache.entries() == [("k", "host", 2)]
    hit = cache.lookup("k", [5] * 9)
    assert cache.entries() == [("k", "hbm", 2)]  # in use: not moved down
    hit.release()
    assert cache.entries() == [("k", "host", 2)]
    with pytest.raises(ValueError, match="budgets"):
        _cache(hbm=0, host=0)


def test_cache_key_follows_the_tokenizer_and_chat_template(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ a }}"}')
    k1 = model_cache_key(str(tmp_path), "cfg")
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ b }}"}')
    assert model_cache_key(str(tmp_path), "cfg") != k1
    assert model_cache_key(str(tmp_path), "other cfg") != model_cache_key(str(tmp_path), "cfg")
    assert cache_key("a", 1) == cache_key("a", 1) != cache_key("a", 2)


SYSTEM = list(range(3, 43))  # a 40-token shared system prompt
QUESTIONS = ([7, 8, 9], [100, 101], [55, 4, 4, 4, 60], [9])


@pytest.fixture(scope="module")
def setup():
    cfg = EngineConfig(max_concurrent_decodes=2, max_prefill_length=64, max_seq_len=96,
                       kv_layout="paged", page_size=8)
    eng = TransformerEngine(model_config("qwen2"), devices=jax.devices()[:1], config=cfg)
    params = jax.device_put(host_params(eng), eng.param_shardings)
    prompts = [SYSTEM + q for q in QUESTIONS]
    want = [r.token_ids for r in generate_many(eng, params, prompts, max_tokens=8,
                                               ignore_eos=True)]
    return eng, params, prompts, want


@pytest.mark.parametrize("hbm,host", [(64 * KB * KB, 0), (0, 64 * KB * KB)])
def test_cached_runs_give_the_uncached_tokens(setup, hbm, host):
    eng, params, prompts, want = setup
    config = OrchestratorConfig(prefix_cache_hbm_bytes=hbm, prefix_cache_host_bytes=host,
                                prefix_cache_block=8, prefix_cache_key="qwen2-test")
    with Orchestrator.from_engines(eng, params=params, config=config) as orch:
        got = [orch.submit(Request(prompt_ids=p, max_tokens=8, ignore_eos=True)).result(
            timeout=300).token_ids for p in prompts]  # one after another: each can hit
        s = orch.stats()["prefix_cache"][0]
        metrics = ServerMetrics(orch).render()[0].decode()
    assert got == want
    assert 'jetserve_prefix_cache_hit_rate{engine="0"} 0.75' in metrics
    assert f'jetserve_prefix_cache_bytes{{engine="0",tier="hbm"}} {float(hbm and s["hbm_bytes"])}' \
        in metrics
    assert 'jetserve_kv_pages_free{engine="0"}' in metrics
    # Every request after the first reuses the 40-token system prompt (5 blocks of 8).
    assert s["hits"] == 3 and s["hit_tokens"] >= 3 * 40
    assert (s["host_hits"] == 3) == (hbm == 0)
    assert (s["hbm_bytes"] > 0) == (hbm > 0) and (s["host_bytes"] > 0) == (host > 0)
