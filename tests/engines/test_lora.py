"""LoRA adapters in the engine (engines/lora*.py) without torch: adapter directories
written by hand; their checks at load; the pool's layout; tokens equal to a plain engine
whose weights have the adapter merged on the host (plain and n-gram speculative steps,
base rows unchanged beside adapter rows, prompts prefilled whole and in chunks); unknown
names."""

import dataclasses
import gc

import jax
import numpy as np
import pytest

from engines import EngineConfig, ModelConfig, create_engine
from engines.lora import LoraConfig, pool_shardings
from engines.lora_registry import UnknownAdapter
from engines.mixed_batch import MixedRow
from jetserve.offline import generate_many
from sharding import load_preset
from tests.engines import lora_files
from tests.engines.mixed_driver import run_mixed

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)
PREFIX = lora_files.PREFIX


def write_adapter(path, targets, **kw):
    return lora_files.write_adapter(path, CFG, targets, **kw)


def _engine(speculative="none", layers="auto", kv_layout="contiguous", page_size=16,
            kv_dtype="auto", max_loras=2, **kw):
    cfg = EngineConfig(max_concurrent_decodes=4, max_prefill_length=32, max_seq_len=64,
                       speculative=speculative, max_loras=max_loras, max_lora_rank=8,
                       layers=layers,
                       kv_layout=kv_layout, page_size=page_size, kv_dtype=kv_dtype)
    return create_engine(CFG, config=cfg, seed=5, devices=kw.pop("devices", jax.devices()[:1]),
                         **kw)


# ---- checks at load -----------------------------------------------------------------------


@pytest.mark.parametrize("change, message", [
    (dict(config={"r": 16}), r"r=16 must be an integer in \[1, 8\]"),
    (dict(targets=["q_proj"], config={"target_modules": ["q_proj", "lm_head"]}),
     r"target_modules \['lm_head'\]"),
    (dict(targets=["q_proj"], tensors={f"{PREFIX}.0.self_attn.q_proj.lora_B.weight":
                                       np.zeros((33, 4), np.float32)}),
     r"tensor 'base_model.*layers.0.self_attn.q_proj.lora_B.weight' has shape \(33, 4\).*"
     r"needs \(32, 4\)"),
    (dict(targets=["q_proj"], tensors={"base_model.model.lm_head.lora_A.weight":
                                       np.zeros((4, 32), np.float32)}),
     r"tensor 'base_model.model.lm_head.lora_A.weight' is not a LoRA A/B weight"),
    (dict(targets=["q_proj"], config={"use_dora": True}), r"use_dora=True is not supported"),
])
def test_malformed_adapters_are_refused_naming_file_and_tensor(tmp_path, change, message):
    eng = _engine()
    path, _ = write_adapter(tmp_path / "bad", **{"targets": ["q_proj"], **change})
    with pytest.raises(ValueError, match=message) as err:
        eng.load_adapter("bad", path)
    assert str(tmp_path / "bad") in str(err.value)  # the file is named


def test_missing_directory_and_unknown_names(tmp_path):
    eng = _engine()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        eng.load_adapter("none", str(tmp_path / "nowhere"))
    params = eng.load_params()
    with pytest.raises(UnknownAdapter):
        eng.prefill(params, [5, 6, 7], 3, adapter="nowhere")
    with pytest.raises(UnknownAdapter):
        eng.unload_adapter("nowhere")


# ---- layout -------------------------------------------------------------------------------


def test_pool_is_split_as_the_projections_it_modifies():
    eng = _engine(devices=jax.devices()[:4], sharding=load_preset("tp"))
    sh = pool_shardings(eng.model_config, LoraConfig(max_loras=2, max_rank=8), eng.sharding,
                        eng.mesh)
    spec = {m: (tuple(a.spec), tuple(b.spec)) for m, a, b in zip(sh.modules, sh.a, sh.b,
                                                                 strict=True)}
    assert spec["q_proj"][1][2] == "model" and spec["gate_proj"][1][2] == "model"
    assert spec["o_proj"][0][3] == "model" and spec["down_proj"][0][3] == "model"
    assert all(ax is None for ax in spec["q_proj"][0])  # A of a column-parallel: whole
    pool = eng._pool
    assert pool.a[0].shape[:2] == (CFG.num_layers, 3)  # [L, max_loras + 1, ...]
    assert not np.any(np.asarray(pool.a[0][:, 0]))  # row 0: no adapter


# ---- tokens against the merged weights -----------------------------------------------------


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return write_adapter(tmp_path_factory.mktemp("lora") / "a",
                         ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"], seed=1)


def _prompts():
    """The first two longer than max_prefill_length (32): prefilled in chunks."""
    rng = np.random.default_rng(2)
    return [rng.integers(3, 30, n).tolist() * 2 for n in (24, 26, 3, 7)]


@pytest.mark.parametrize("speculative", ["none", "ngram:3"])
def test_adapter_tokens_equal_merged_weights(adapter, speculative):
    path, tensors = adapter
    eng = _engine(speculative)
    eng.load_adapter("a", path)
    params = eng.load_params()
    plain = create_engine(CFG, config=dataclasses.replace(eng.config, max_loras=0), seed=5,
                          devices=jax.devices()[:1])
    # In the LoRA engine's layout (the loop); `plain` may scan and converts what it is
    # handed (engines/param_layout.py).
    merged = lora_files.merged_params(params, tensors, 8 / 4, CFG, eng.param_shardings)
    prompts = _prompts()
    names = ["a", None, "a", None]  # adapter and base rows in one batch, long and short
    got = generate_many(eng, params, prompts, max_tokens=10, ignore_eos=True, adapters=names)
    want_a = generate_many(plain, merged, prompts, max_tokens=10, ignore_eos=True)
    want_base = generate_many(plain, params, prompts, max_tokens=10, ignore_eos=True)
    for name, g, wa, wb in zip(names, got, want_a, want_base, strict=True):
        assert g.token_ids == (wa if name else wb).token_ids, name
    assert [r.token_ids for r in want_a] != [r.token_ids for r in want_base]
    # Only base requests: the engine's plain step, the base model's tokens.
    only_base = generate_many(eng, params, prompts, max_tokens=10, ignore_eos=True)
    assert [r.token_ids for r in only_base] == [r.token_ids for r in want_base]


def test_scanned_layers_serve_adapters_as_the_loop(adapter):
    """layers "scan" reads each layer's slice of the adapter pool inside the scan: the
    tokens of the loop (checked against merged weights above), adapter and base rows in
    one batch, prompts whole and in chunks."""
    path, _ = adapter
    runs = []
    for layers in ("loop", "scan"):
        eng = _engine(layers=layers)
        eng.load_adapter("a", path)
        assert eng.model_config.scan_layers == (layers == "scan")
        runs.append(generate_many(eng, eng.load_params(), _prompts(), max_tokens=10,
                                  ignore_eos=True, adapters=["a", None, "a", None]))
    assert [r.token_ids for r in runs[1]] == [r.token_ids for r in runs[0]]


DRAFT = ModelConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=8)


@pytest.mark.parametrize("speculative, options", [
    ("none", {}), ("ngram:3", {}), ("draft:random:x:2", dict(draft_config=DRAFT)),
    ("none", dict(kv_dtype="int8", layers="scan"))])
def test_paged_kv_serves_adapters_as_the_contiguous_cache(adapter, tmp_path, speculative,
                                                          options):
    """kv_layout "paged" (small pages, through the page planner): two adapters and the
    base model in one batch, prompts whole and in chunks, the contiguous LoRA engine's
    tokens and log-probs (plain, n-gram and draft-model verify steps; int8 KV under a
    scan); then base rows alone (the plain step), and every adapter row unpinned once
    the requests end (the planner frees the engine's slots too); base rows in mixed
    steps too."""
    other, _ = write_adapter(tmp_path / "b", ["k_proj", "gate_proj"], rank=2, seed=3)
    names = ["a", None, "b", "a"]
    runs = {}
    for layout in ("contiguous", "paged"):
        eng = _engine(speculative, kv_layout=layout, page_size=8, **options)
        assert eng.model_config.scan_layers == (options.get("layers") == "scan")
        assert (eng.page_geometry is not None) == (layout == "paged")
        eng.load_adapter("a", adapter[0])
        eng.load_adapter("b", other)
        params = eng.load_params()
        runs[layout] = [generate_many(eng, params, _prompts(), max_tokens=10, ignore_eos=True,
                                      adapters=names),
                        generate_many(eng, params, _prompts(), max_tokens=10,
                                      ignore_eos=True)]
        gc.collect()  # prefixes pin their rows until dropped
        assert not eng._slot_rows and not any(eng.adapters._pins)
    if speculative == "none" and not options:  # base rows in ragged mixed steps
        mixed = run_mixed(eng, params, _prompts(), max_tokens=10, chunk=16, budget=20,
                          widest=True)
        assert mixed.outputs == [r.token_ids for r in runs["contiguous"][1]]
    for got, want in zip(runs["paged"], runs["contiguous"], strict=True):
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
    adapted, base = runs["paged"]
    assert [r.token_ids for r in adapted] != [r.token_ids for r in base]


def test_mixed_steps_run_each_row_through_its_adapter(adapter, tmp_path):
    """Mixed steps (engines/mixed_step.py) on the paged LoRA engine: two adapters and the
    base model in one batch, prompts in several chunks beside decode rows, give the
    tokens and log-probs of the engine's own prefill + insert + generate; a second run
    compiles nothing new; base rows alone run the plain program; each row is let go with
    its slot."""
    other, _ = write_adapter(tmp_path / "b", ["k_proj", "gate_proj"], rank=2, seed=3)
    eng = _engine(kv_layout="paged", page_size=8)
    eng.load_adapter("a", adapter[0])
    eng.load_adapter("b", other)
    params = eng.load_params()
    names = ["a", None, "b", "a"]
    want = generate_many(eng, params, _prompts(), max_tokens=10, ignore_eos=True,
                         adapters=names)
    base = generate_many(eng, params, _prompts(), max_tokens=10, ignore_eos=True)
    run = run_mixed(eng, params, _prompts(), max_tokens=10, chunk=16, budget=20,
                    widest=True, adapters=names)
    assert run.mixed_steps >= 3
    assert run.outputs == [r.token_ids for r in want]
    for got, w in zip(run.logprobs, want, strict=True):
        np.testing.assert_allclose(got, w.logprobs, atol=1e-5)
    assert [r.token_ids for r in want] != [r.token_ids for r in base]
    assert not eng._slot_rows and not any(eng.adapters._pins)
    traced = eng.trace_counts()["mixed"]
    assert traced <= 2 * len(run.shapes)  # at most the pool's and the plain program each
    again = run_mixed(eng, params, _prompts(), max_tokens=10, chunk=16, budget=20,
                      widest=True, adapters=names)
    assert again.outputs == run.outputs and eng.trace_counts()["mixed"] == traced
    # Base rows alone: the plain programs (no slot holds an adapter), the base tokens.
    with_pool = eng._mixed_jits[True]
    eng._mixed_jits[True] = None  # reaching for the pool's programs would fail the step
    try:
        only_base = run_mixed(eng, params, _prompts(), max_tokens=10, chunk=16, budget=20,
                              widest=True)
    finally:
        eng._mixed_jits[True] = with_pool
    assert only_base.outputs == [r.token_ids for r in base]
    with pytest.raises(ValueError, match="decode row .* takes no start, last, sampling or "
                                         "adapter"):
        MixedRow(slot=0, adapter="a")


def test_mixed_steps_compose_adapters_and_token_masks(adapter):
    """One mixed run with adapter and base rows and a token mask on every sampled token
    (a random quarter of the vocabulary each) gives each prompt the tokens its own
    prefill + insert + masked generate steps give through its adapter."""
    from engines.token_mask import allow_all
    from jetserve.scheduling.page_planner import PagePlanner
    from tests.engines.test_token_mask import _mask_of

    eng = _engine(kv_layout="paged", page_size=8)
    eng.load_adapter("a", adapter[0])
    params = eng.load_params()
    V, steps = eng.vocab_size, 8
    prompts = [p[:14] for p in _prompts()[:2]] + _prompts()[2:]  # 14, 14, 6, 14 tokens
    names = ["a", None, "a", None]

    def allowed(i, j):
        return set(np.random.default_rng(1000 * i + j).choice(V, V // 4, replace=False)
                   .tolist())

    masks = lambda i, j: _mask_of([allowed(i, j)], V)[0]  # noqa: E731
    planner, want = PagePlanner(eng), []
    state = planner.init_decode_state()
    for i, p in enumerate(prompts):
        prefix, first = eng.prefill(params, p, len(p), seed=i, adapter=names[i],
                                    token_mask=masks(i, 0)[None])
        state = planner.insert(prefix, state, 0)
        toks = [first.to_host().token(0)]
        for j in range(1, steps):
            mask = allow_all(4, V)
            mask[0] = masks(i, j)
            state, res = planner.generate(params, state, token_mask=mask)
            toks.append(res.to_host().token(0))
        planner.free_slot(0)
        want.append(toks)
    run = dict(max_tokens=steps, chunk=4, budget=8, widest=True, adapters=names)
    got = run_mixed(eng, params, prompts, masks=masks, **run)
    assert got.mixed_steps >= 3
    assert got.outputs == want
    assert all(t in allowed(i, j) for i, toks in enumerate(want) for j, t in enumerate(toks))
    assert run_mixed(eng, params, prompts, **run).outputs != want  # the masks decide here
    assert not eng._slot_rows and not any(eng.adapters._pins)


@pytest.mark.parametrize("speculative, options", [
    ("none", {}), ("draft:random:x:2", dict(draft_config=DRAFT))])
def test_mixed_scheduling_waits_for_a_row_when_every_row_is_held(adapter, tmp_path,
                                                                 speculative, options):
    """--scheduling mixed with one pool row and requests for two adapters and the base
    model at once: a request whose adapter finds the row held by a running request waits
    in line (nothing fails) and every request gets the tokens it gets alone (with a draft
    model too: its verify rows and chunk passes beside the adapters' rows)."""
    from jetserve.orchestrator import OrchestratorConfig, Request
    from jetserve.orchestrator.mixed import MixedOrchestrator
    from jetserve.scheduling.page_planner import with_pages

    other, _ = write_adapter(tmp_path / "b", ["k_proj", "gate_proj"], rank=2, seed=3)
    eng = with_pages(_engine(speculative, kv_layout="paged", page_size=8, max_loras=1,
                             **options))
    eng.load_adapter("a", adapter[0])
    eng.load_adapter("b", other)
    params = eng.load_params()
    prompts, names = _prompts(), ["a", "b", None, "b"]
    jobs = list(zip(prompts, names, strict=True))
    want = [generate_many(eng, params, [p], max_tokens=8, ignore_eos=True,
                          adapters=[n])[0].token_ids for p, n in jobs]
    config = OrchestratorConfig(scheduling="mixed", prefill_chunk=16)
    with MixedOrchestrator.from_engines(eng, params=params, config=config) as orch:
        handles = [orch.submit(Request(prompt_ids=p, max_tokens=8, ignore_eos=True,
                                       lora_adapter=n)) for p, n in jobs]
        got = [h.result(timeout=300) for h in handles]
    assert [c.finish_reason for c in got] == ["length"] * 4, [c.error for c in got]
    assert [c.token_ids for c in got] == want
    assert not eng.engine._slot_rows and not any(eng.engine.adapters._pins)


# ---- rows: least recently used, never one in use ------------------------------------------


def test_registry_swaps_the_least_recently_used_unpinned_row():
    from engines.lora_registry import AdapterRegistry

    reg = AdapterRegistry(2)
    w = object()
    for name in "abc":
        reg.add(name, w)
    assert reg.row_for("a") == (1, w) and reg.row_for("b") == (2, w)
    assert reg.row_for("a") == (1, None)  # resident: nothing to write; "b" is now older
    assert reg.row_for("c") == (2, w) and "b" not in reg.resident()
    reg.pin(1)
    reg.pin(2)
    with pytest.raises(RuntimeError, match="--max-loras"):
        reg.row_for("b")
    reg.unpin(1)
    assert reg.row_for("b") == (1, w)


def test_a_waiting_prefix_keeps_its_adapter_resident(tmp_path):
    import gc

    cfg = EngineConfig(max_concurrent_decodes=2, max_prefill_length=32, max_seq_len=64,
                       max_loras=1, max_lora_rank=8)
    eng = create_engine(CFG, config=cfg, seed=5, devices=jax.devices()[:1])
    eng.row_wait_s = 0.5  # how long a prefill waits for a pinned row before it refuses
    for name, seed in (("a", 1), ("b", 2)):
        eng.load_adapter(name, write_adapter(tmp_path / name, ["q_proj"], seed=seed)[0])
    params = eng.load_params()
    prefix, _ = eng.prefill(params, [5, 6, 7], 3, adapter="a")
    with pytest.raises(RuntimeError, match="live requests"):
        eng.prefill(params, [5, 6, 7], 3, adapter="b")  # "a" waits to be inserted
    state = eng.insert(prefix, eng.init_decode_state(), 0)
    del prefix
    gc.collect()
    with pytest.raises(RuntimeError, match="live requests"):
        eng.prefill(params, [5, 6, 7], 3, adapter="b")  # slot 0 holds "a"
    eng.free_slot(0)
    eng.prefill(params, [5, 6, 7], 3, adapter="b")  # now "a" can go
    assert eng.adapters.resident() == {"b": 1}
    del state


def test_a_request_waits_for_a_row_to_be_unpinned():
    import threading

    from engines.lora_registry import AdapterRegistry

    reg = AdapterRegistry(1)
    reg.add("a", object())
    reg.add("b", object())
    row, _ = reg.row_for("a")
    reg.pin(row)
    threading.Timer(0.2, reg.unpin, (row,)).start()  # the slot holding "a" ends
    assert reg.row_for("b", wait_s=60)[0] == row and reg.resident() == {"b": row}


@pytest.mark.parametrize("kv_layout", ["contiguous", "paged"])
def test_prompt_logprobs_through_an_adapter_equal_merged_weights(adapter, kv_layout):
    """Scoring a prompt (echo) through an adapter gives the merged weights' log-probs, in
    one pass and, past max_prefill_length (32), in chunks; the base model's stay the
    plain engine's."""
    path, tensors = adapter
    eng = _engine(kv_layout=kv_layout)
    eng.load_adapter("a", path)
    params = eng.load_params()
    plain = create_engine(CFG, config=dataclasses.replace(eng.config, max_loras=0), seed=5,
                          devices=jax.devices()[:1])
    merged = lora_files.merged_params(params, tensors, 8 / 4, CFG, eng.param_shardings)
    for prompt in (_prompts()[3], _prompts()[0]):  # 14 tokens; 48 tokens in two chunks
        got = eng.prompt_logprobs(params, prompt, adapter="a")
        want = plain.prompt_logprobs(merged, prompt)
        base = eng.prompt_logprobs(params, prompt)
        np.testing.assert_allclose(got.token_logprobs[1:], want.token_logprobs[1:], atol=1e-5)
        np.testing.assert_array_equal(got.top_ids[1:], want.top_ids[1:])
        np.testing.assert_allclose(base.token_logprobs[1:],
                                   plain.prompt_logprobs(params, prompt).token_logprobs[1:],
                                   atol=1e-5)
        assert np.abs(got.token_logprobs[1:] - base.token_logprobs[1:]).max() > 1e-2
    assert not any(eng.adapters._pins)  # scoring unpinned the row it held

