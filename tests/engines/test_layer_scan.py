"""Layers under one scanned body (EngineConfig.layers "scan", engines/layer_scan.py):
the same tokens as the unrolled loop for every KV and weight format, sharded too;
checkpoints keep per-layer names; the generate program does not grow with the layer
count and holds no second copy of the cache; nothing recompiles after warm-up."""

import dataclasses

import jax
import numpy as np
import pytest

from engines import EngineConfig, ModelConfig, create_engine, layer_scan
from engines.checkpoint import save_orbax
from engines.engine_config import LAYER_MODES
from jetserve import cli
from jetserve.model_loading import build_engine
from jetserve.offline import generate_many
from sharding import load_preset
from tests.engines import programs

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=24)
PROMPTS = [list(range(1, 30)), [5, 6, 7], [9, 2, 6, 11, 40, 3]]


def _engine(layers, cfg=CFG, devices=1, preset=None, weights=None, **kw):
    config = EngineConfig(max_concurrent_decodes=4, max_prefill_length=16, max_seq_len=64,
                          layers=layers, **kw)
    return create_engine(cfg, config=config, devices=jax.devices()[:devices], seed=3,
                         sharding=load_preset(preset) if preset else None, weights=weights)


def _run(eng, params=None):
    """Greedy tokens and log-probs of PROMPTS (the 29-token one prefilled in chunks)."""
    params = params if params is not None else eng.load_params()
    res = generate_many(eng, params, PROMPTS, max_tokens=8, ignore_eos=True)
    return [r.token_ids for r in res], np.array([r.logprobs for r in res])


@pytest.mark.parametrize("kw", [{}, {"kv_dtype": "int8"}, {"quantize": "int8"},
                                {"quantize": "int4", "quant_group_size": 16}],
                         ids=["f32", "int8-kv", "int8-weights", "int4-weights"])
def test_scan_gives_the_loops_tokens(kw):
    loop, scan = _engine("loop", **kw), _engine("scan", **kw)
    assert scan.model_config.scan_layers and not loop.model_config.scan_layers
    (tl, ll), (ts, ls) = _run(loop), _run(scan)
    assert ts == tl
    np.testing.assert_allclose(ls, ll, rtol=1e-5, atol=1e-5)


def test_scan_on_a_sharded_mesh_gives_one_devices_tokens():
    tokens, logprobs = _run(_engine("loop"))
    sharded = _engine("scan", devices=4, preset="tp")
    # The stacked layer axis stays whole; the others split as the preset says.
    q = sharded.param_shardings["layers"]["self_attn"]["q_proj"]
    assert q.spec[0] is None and "model" in tuple(q.spec)
    ts, ls = _run(sharded)
    assert ts == tokens
    np.testing.assert_allclose(ls, logprobs, rtol=1e-4, atol=1e-4)


def test_moe_under_scan():
    cfg = dataclasses.replace(CFG, num_experts=4, num_experts_per_tok=2)
    assert _run(_engine("scan", cfg))[0] == _run(_engine("loop", cfg))[0]


def test_parameters_stack_at_load_and_checkpoints_keep_layer_names(tmp_path):
    loop, scan = _engine("loop"), _engine("scan")
    lp, sp = loop.load_params(), scan.load_params()
    assert "layers" in sp and "layers_0" not in sp
    assert sp["layers"]["mlp"]["up_proj"].shape == (3, 64, 32)
    stored = scan.checkpoint_params(sp)
    assert sorted(stored) == sorted(lp)  # layers_0 .. layers_2, embed_tokens, ...
    for a, b in zip(jax.tree.leaves(stored), jax.tree.leaves(lp), strict=True):
        np.testing.assert_array_equal(a, b)  # same seed, same weights in either layout
    out = str(tmp_path / "orbax")
    save_orbax(stored, scan.source_config, out, None)
    want = _run(loop, lp)[0]
    assert _run(_engine("scan", weights=out))[0] == want
    assert _run(_engine("loop", weights=out))[0] == want


def _generate_program(layers):
    eng = _engine("scan", dataclasses.replace(CFG, num_layers=layers))
    return programs.generate_program(eng, eng.load_params(), eng.init_decode_state())


def test_generate_program_is_one_layer_body_and_updates_the_cache_in_place():
    ops2, _, _ = _generate_program(2)
    ops8, mem, cache = _generate_program(8)
    assert ops8 == ops2  # one body whatever L is
    # The donated cache is aliased to the new one, and the temporaries hold about one
    # layer's slice of it, not a second copy of the whole cache.
    assert mem.alias_size_in_bytes >= cache
    assert mem.temp_size_in_bytes < cache / 2


def test_nothing_recompiles_after_warmup_under_scan():
    eng = _engine("scan")
    params = eng.load_params()
    _run(eng, params)
    warm = dict(eng.traces)
    _run(eng, params)
    generate_many(eng, params, [[4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 1]],
                  max_tokens=5, ignore_eos=True)
    assert eng.traces == warm


def test_layer_modes_are_checked():
    assert LAYER_MODES == ("auto", "loop", "scan")
    with pytest.raises(ValueError, match=r"layers must be one of .*'unrolled'"):
        EngineConfig(layers="unrolled")
    assert EngineConfig(layers="scan", kv_layout="paged").layers == "scan"  # both layouts
    assert EngineConfig(layers="scan", max_loras=2).layers == "scan"  # LoRA scans too
    with pytest.raises(ValueError, match="scan_layers must be True or False"):
        dataclasses.replace(CFG, scan_layers="yes")


def test_auto_scans_where_the_cpu_kernels_read_layers_in_place():
    # Measured: with the kernels reading the stacked layers in place, the scanned decode
    # step is as fast as the loop on the CPU (docs/BENCHMARKS.md); without them XLA would
    # copy each layer's weights out of the stack.
    eng = _engine("auto")
    assert eng.backend.cpu_kernels and eng.model_config.scan_layers
    assert not _engine("loop").model_config.scan_layers
    assert _engine("auto", kv_layout="paged").model_config.scan_layers  # either KV layout
    assert not _engine("auto", devices=2).model_config.scan_layers  # no kernels when sharded
    assert not _engine("auto", quantize="int8").model_config.scan_layers
    assert not _engine("auto", max_loras=2).model_config.scan_layers  # a hook per layer
    assert layer_scan.use_scan(EngineConfig(), "cpu", cpu_kernels=True)
    assert not layer_scan.use_scan(EngineConfig(), "cpu", cpu_kernels=False)
    assert layer_scan.use_scan(EngineConfig(), "tpu", cpu_kernels=False)
    # Paged KV scans wherever contiguous does (tests/engines/test_paged_scan.py).
    assert layer_scan.use_scan(EngineConfig(kv_layout="paged"), "tpu", cpu_kernels=False)
    assert not layer_scan.use_scan(EngineConfig(max_loras=1), "tpu", cpu_kernels=False)


def test_cli_layers_flag(capsys):
    outs = {}
    for mode in ("loop", "scan"):
        assert cli.main(["generate", "--model", "random:tiny", "--prompt-ids", "3,1,4,1,5",
                         "--max-tokens", "6", "--ignore-eos", "--layers", mode,
                         "--compile-cache", "off"]) == 0
        outs[mode] = capsys.readouterr().out
    assert outs["scan"] == outs["loop"] and outs["loop"].strip()
    with pytest.raises(SystemExit):
        cli.main(["generate", "--model", "random:tiny", "--prompt-ids", "1", "--layers", "x"])


@pytest.mark.parametrize("spec", ["ngram:3", "draft:random:tiny:2"])
def test_speculative_decoding_under_scan(spec):
    """Verification writes T entries per slot through the scanned store; a draft model's
    cache rides beside the stacked one."""
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5], [7, 7, 8]]
    out = {}
    for mode in ("loop", "scan"):
        eng = build_engine("random:tiny", devices=jax.devices()[:1], engine_config=EngineConfig(
            max_concurrent_decodes=2, max_prefill_length=16, max_seq_len=64, speculative=spec,
            layers=mode))
        out[mode] = [r.token_ids for r in generate_many(eng, eng.load_params(), prompts,
                                                         max_tokens=10, ignore_eos=True)]
    assert out["scan"] == out["loop"]
