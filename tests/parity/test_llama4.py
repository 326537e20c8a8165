"""Llama 4 text (llama4_text) against Hugging Face transformers on the same files, float32,
random weights (tests/parity/hf_models.py LLAMA4_CONFIGS["llama4"]: 4 layers, chunked
attention in chunks of 8 on the RoPE layers 0 and 2, NoPE layers 1 and 3 whose queries'
temperature tuning changes every 4 positions, weightless q/k norms, interleaved-pair RoPE
read into the half-split form, 4 experts top-1 with the sigmoid on their input and a
shared expert on layers 0, 1 and 3, a dense layer 2). The prompts (40, 7 and 23 tokens)
cross several chunks. Checked:

- greedy tokens equal transformers' `generate` and log-probs within 1e-4 of its forward,
  on the contiguous and the paged KV layouts with 16-token prefill chunks;
- blockwise prefill over tiles of 8 and decode past the CPU decode kernel (which has no
  chunked attention); ragged mixed steps on the paged layout;
- the experts over 4 devices (ep_tp) give one device's tokens;
- `jetserve generate --model DIR`, and on its `jetserve convert` Orbax copy;
- a PEFT LoRA adapter on the attention (its q and k rows reordered as the kernels are);
- the config fields and paths it cannot take refused by name.
"""

from __future__ import annotations

import json
import os

import jax
import pytest

from engines import create_engine, load_hf_config
from engines.backend import Backend
from engines.config import CHUNKED, FULL
from engines.hf_config import from_hf_config
from engines.paged_kv import resolve_attention
from jetserve import cli
from jetserve.offline import generate_many
from sharding import load_preset
from tests.parity.hf_models import (
    assert_logprobs_close,
    assert_mixed_steps_keep_the_tokens,
    cli_generate,
    hf_greedy,
    parity_config,
    parity_prompts,
    written_case,
)

STEPS = 12


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(model dir, torch model, transformers' greedy tokens of each prompt)."""
    _, d, model, want = written_case("llama4", tmp_path_factory, parity_prompts(), STEPS)
    return d, model, want


def _generate(d, **kw):
    engine = create_engine(load_hf_config(d), weights=d, **kw)
    return generate_many(engine, engine.load_params(), parity_prompts(), max_tokens=STEPS,
                         ignore_eos=True)


def test_config_reads_the_family(case):
    d, model, _ = case
    cfg = load_hf_config(d)
    assert cfg.layer_types == (CHUNKED, FULL, CHUNKED, FULL)
    assert [cfg.layer_chunk(i) for i in range(4)] == [8, None, 8, None]
    assert [cfg.layer_rope(i) for i in range(4)] == [True, False, True, False]
    assert [cfg.moe_layer(i) for i in range(4)] == [
        hasattr(layer.feed_forward, "experts") for layer in model.model.layers]
    assert (cfg.intermediate_size, cfg.expert_size, cfg.shared_experts) == (96, 48, 1)
    assert cfg.moe_router == "topk_sigmoid" and cfg.qk_norm == "l2"
    assert (cfg.attn_temperature_tuning, cfg.floor_scale, cfg.attn_scale) == (True, 4.0, 0.5)
    assert cfg.mixed_layers
    assert cfg.param_count() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_tokens_and_logprobs(case, layout):
    d, model, want = case
    results = _generate(d, config=parity_config(kv_layout=layout), devices=jax.devices()[:1])
    assert [r.token_ids for r in results] == want
    assert_logprobs_close(model, parity_prompts(), results)


def test_blockwise_prefill_and_decode_past_the_cpu_kernel(case):
    """Tiles of 8 make every 16-token chunk's prefill run the blockwise path (the chunk
    mask in its online softmax, key blocks skipped by the chunk's reach); decode steps on
    one CPU device would take the CPU attention kernel, which has no chunks, and take
    XLA's path instead."""
    d, model, want = case
    results = _generate(d, config=parity_config(), devices=jax.devices()[:1],
                        backend=Backend(block_q=8, block_k=8))
    assert [r.token_ids for r in results] == want
    assert_logprobs_close(model, parity_prompts(), results)


def test_mixed_steps_keep_the_tokens(case):
    """Ragged mixed steps on the paged layout: prompt chunks of 5 beside decode rows."""
    d, _, want = case
    assert_mixed_steps_keep_the_tokens(d, want, STEPS)


def test_experts_over_four_devices(case):
    """ep_tp on 4 devices: each holds 1 of the 4 experts (the dense layer and the shared
    experts split as tp does); the tokens are transformers'."""
    d, _, want = case
    results = _generate(d, config=parity_config(), devices=jax.devices()[:4],
                        sharding=load_preset("ep_tp"))
    assert [r.token_ids for r in results] == want


def test_cli_generate_and_convert_round_trip(case, tmp_path, capsys):
    """`jetserve generate` on the HF directory and on its `jetserve convert` Orbax copy
    (whose config keeps the layers' kinds, NoPE layers and experts)."""
    d, _, want = case
    orbax = str(tmp_path / "orbax")
    assert cli.main(["convert", "--from-hf", d, "--to", orbax]) == 0
    for source in (d, orbax):
        assert cli_generate(source, parity_prompts(), STEPS, 16, capsys) == want, source


def test_unimplemented_paths_and_fields_are_refused(case):
    d, _, _ = case
    with open(os.path.join(d, "config.json")) as f:
        hf = json.load(f)
    with pytest.raises(ValueError, match="attention_bias"):
        from_hf_config({**hf, "attention_bias": True})
    with pytest.raises(ValueError, match="no_rope_layers"):
        from_hf_config({**hf, "no_rope_layers": [1, 2, 1, 0]})
    with pytest.raises(ValueError, match="layer_types"):
        from_hf_config({**hf, "layer_types": ["sliding_attention"] * 4})
    with pytest.raises(ValueError, match="attention_chunk_size=8"):
        resolve_attention("pallas_tpu", "tpu", None, 1, chunk=8)
    assert resolve_attention("auto", "tpu", None, 1, chunk=8) == "xla"
    # Defaults as transformers fills them: every 4th layer NoPE, the others chunked.
    bare = {k: v for k, v in hf.items()
            if k not in ("no_rope_layers", "layer_types", "moe_layers")}
    cfg = from_hf_config({**bare, "interleave_moe_layer_step": 2})
    assert cfg.nope_layers == (3,) and cfg.dense_layers == (0, 2)
    assert cfg.layer_types == (CHUNKED, CHUNKED, CHUNKED, FULL)


def test_lora_adapter_matches_peft_merged(case, tmp_path):
    """A PEFT adapter on q, k, v and o: its q and k B rows reordered as the base kernels
    are (RoPE pairs to halves); the tokens are transformers' on the merged model."""
    from tests.parity.lora_adapters import make_adapter, merged_model

    d, _, _ = case
    adapter = str(tmp_path / "adapter")
    make_adapter(d, adapter, 4, 8, ["q_proj", "k_proj", "v_proj", "o_proj"], False, seed=3)
    merged = merged_model(d, adapter)
    want = [hf_greedy(merged, p, STEPS) for p in parity_prompts()]
    engine = create_engine(load_hf_config(d), weights=d, devices=jax.devices()[:1],
                           config=parity_config(max_prefill_length=64, max_loras=1,
                                          max_lora_rank=4))
    engine.load_adapter("a", adapter)
    params = engine.load_params()
    got = []
    for p in parity_prompts():
        state = engine.init_decode_state()
        prefix, first = engine.prefill(params, p, len(p), adapter="a")
        toks = [first.to_host().token(0)]
        state = engine.insert(prefix, state, 0)
        for _ in range(STEPS - 1):
            state, res = engine.generate(params, state)
            toks.append(res.to_host().token(0))
        engine.free_slot(0)
        got.append(toks)
    assert got == want
