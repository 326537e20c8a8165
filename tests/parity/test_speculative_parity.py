"""Speculative decoding on every family: greedy output equals transformers' greedy
generate on the same files, token for token, through the orchestrator's continuous
batching (six requests of different lengths over three slots: they join and leave),
on the contiguous and the paged KV cache; and with a draft model (a small random one of
the same vocabulary on every family, the target itself on two)."""

import jax
import numpy as np
import pytest

from engines import EngineConfig, ModelConfig, create_engine, load_hf_config
from jetserve.orchestrator import Orchestrator, Request
from jetserve.scheduling.page_planner import with_pages
from tests.parity.hf_models import FAMILIES, hf_greedy

MAX_TOKENS = (28, 9, 20, 33, 14, 24)


def _prompts(seed=0):
    """Repeated pieces (drafts often right) with random tails (often wrong)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate((5, 7, 4, 9, 6, 3)):
        piece = rng.integers(3, 128, n).tolist()
        out.append(piece * (2 + i % 3) + rng.integers(3, 128, 3 + i).tolist())
    return out


def _check(hf_dirs, name, speculative="ngram:3", draft=None, **layout):
    d, model = hf_dirs[name]
    cfg = EngineConfig(max_concurrent_decodes=3, max_prefill_length=48, max_seq_len=96,
                       speculative=speculative, **layout)
    if draft == "itself":
        draft, draft_weights = load_hf_config(d), d
    else:
        draft_weights = None
    eng = with_pages(create_engine(load_hf_config(d), weights=d, config=cfg,
                                   devices=jax.devices()[:1], draft_config=draft,
                                   draft_weights=draft_weights))
    prompts = _prompts()
    with Orchestrator.from_engines(eng) as orch:
        handles = [orch.submit(Request(prompt_ids=p, max_tokens=n, ignore_eos=True))
                   for p, n in zip(prompts, MAX_TOKENS, strict=True)]
        results = [h.result(600) for h in handles]
        stats = orch.stats()["generate"][0]
    for p, n, r in zip(prompts, MAX_TOKENS, results, strict=True):
        assert r.token_ids == hf_greedy(model, p, n), name
    # Drafts were kept (a tiny random model's greedy text repeats itself; some families'
    # repeat one token, and then every draft is right).
    assert 0 < stats["accepted"] <= stats["drafted"] or draft is not None
    if draft_weights is not None:  # the target's own drafts are all kept
        assert stats["accepted"] >= 0.97 * stats["drafted"] > 0
    widths = eng.generate_widths() if layout else (None,)  # paged: one program per width
    assert eng.trace_counts()["generate"] <= len(widths)
    return eng


@pytest.mark.parametrize("name", FAMILIES)
def test_speculative_greedy_equals_transformers_contiguous(hf_dirs, name):
    _check(hf_dirs, name)


@pytest.mark.parametrize("name", FAMILIES)
def test_speculative_greedy_equals_transformers_paged(hf_dirs, name):
    eng = _check(hf_dirs, name, kv_layout="paged", page_size=8, num_pages=24)
    eng.kv_pages.check()
    assert eng.kv_pages.free_count == 24


# A small random draft model with the families' vocabulary of 128.
SMALL_DRAFT = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=2, num_kv_heads=1, head_dim=16)


@pytest.mark.parametrize("name, draft", [(name, "small") for name in FAMILIES]
                         + [("llama", "itself"), ("qwen2", "itself")])
def test_draft_model_greedy_equals_transformers(hf_dirs, name, draft):
    _check(hf_dirs, name, speculative="draft:d:3",
           draft=SMALL_DRAFT if draft == "small" else draft)
