"""Today's dense families (Qwen3, Gemma 2, Gemma 3, OLMo 2, Phi-3) and long-context RoPE
(YaRN, LongRoPE, partial rotary) against Hugging Face transformers on the same files
(float32, random weights, tests/parity/hf_models.py DENSE_CONFIGS).

Each directory is written by transformers with odd shapes: head_dim apart from D / N, 3
kv heads, sliding windows of 8 keys under prompts of 40 (five windows), sliding and global
layers mixed. Greedy tokens equal transformers' `generate` with the 40-token prompt
prefilled in chunks of 16 (so every chunk continues a prefix longer than the window),
on the contiguous and the paged KV layouts, tensor-parallel over 4 devices (6 for six
heads), through `jetserve generate` and through `jetserve convert` to Orbax, with
speculative decoding, in ragged mixed steps, and with a LoRA adapter (against
transformers with it merged);
log-probs and whole-prompt logits are within 1e-4 of transformers'. The heavier paths run
on the variants they could break, so the file stays near two minutes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from engines import EngineConfig, create_engine, load_hf_config
from engines.hf_config import from_hf_config
from engines.kv_cache import PrefillKV
from engines.model import rope, rope_inputs
from engines.rope import rope_tables
from jetserve import cli
from jetserve.offline import generate_many
from sharding import load_preset
from tests.parity.hf_models import (
    DENSE_CONFIGS,
    cli_generate,
    hf_greedy,
    written_case,
)

STEPS = 16
PROMPT_LENGTHS = (40, 7, 23)
CHUNK = 16  # max_prefill_length: the 40-token prompt is prefilled in three chunks


def _config(**kw) -> EngineConfig:
    return EngineConfig(**{**dict(max_concurrent_decodes=4, max_prefill_length=CHUNK,
                                  max_seq_len=64, top_logprobs=2), **kw})


def _prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(3, 128, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=tuple(DENSE_CONFIGS))
def fam(request, tmp_path_factory):
    """(variant, model dir, torch model, transformers' greedy tokens of each prompt)."""
    return written_case(request.param, tmp_path_factory, _prompts(), STEPS)


def _tokens(engine, params=None):
    params = engine.load_params() if params is None else params
    return [r.token_ids for r in generate_many(engine, params, _prompts(), max_tokens=STEPS,
                                               ignore_eos=True)]


def test_config_reads_the_family(fam):
    name, d, model, _ = fam
    cfg = load_hf_config(d)
    hf = model.config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert cfg.head_dim == head_dim and cfg.num_kv_heads == hf.num_key_value_heads
    types = getattr(hf, "layer_types", None)
    if cfg.layer_types is not None:
        assert list(cfg.layer_types) == types
        assert cfg.mixed_layers


def test_contiguous_chunked_prefill_tokens_logprobs_and_logits(fam):
    """One device (the CPU kernels where they apply), 16-token chunks."""
    name, d, model, want = fam
    engine = create_engine(load_hf_config(d), weights=d, config=_config(),
                           devices=jax.devices()[:1])
    if engine.backend.cpu_matmul_rows:  # the scan where layers are alike, else the loop
        assert engine.model_config.scan_layers == (not engine.model_config.mixed_layers)
    params = engine.load_params()
    results = generate_many(engine, params, _prompts(), max_tokens=STEPS, ignore_eos=True)
    assert [r.token_ids for r in results] == want, name
    for p, r in zip(_prompts(), results, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p + r.token_ids])).logits[0], -1)
        ref = [float(logp[len(p) - 1 + i, t]) for i, t in enumerate(r.token_ids)]
        np.testing.assert_allclose(r.logprobs, ref, rtol=1e-4, atol=1e-4)
    prompt = _prompts()[0]  # the whole prompt at once, every position's logits
    pos = jnp.arange(len(prompt))[None]
    ours = np.asarray(engine.model.apply({"params": params}, jnp.asarray([prompt]), pos,
                                         PrefillKV(pos, None))[0])
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].numpy()
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) < 1e-4, name


# The paged layout and tp over 4 devices on the variants whose mechanisms they could
# break (windows of mixed layers, soft caps, per-head norms, partial RoPE with repeated kv
# heads), to keep the file's time down; the contiguous test runs every variant.
PAGED_VARIANTS = ("qwen3", "gemma2", "gemma3")
TP_VARIANTS = ("olmo2", "gemma2", "phi3")


def test_paged_layout_tokens(fam):
    name, d, model, want = fam
    if name not in PAGED_VARIANTS:
        pytest.skip(f"the paged layout runs on {PAGED_VARIANTS}")
    engine = create_engine(load_hf_config(d), weights=d, config=_config(kv_layout="paged"),
                           devices=jax.devices()[:1])
    assert _tokens(engine) == want, name


def test_tensor_parallel(fam):
    """tp over 4 devices (kv heads repeated where fewer than 4) gives transformers' tokens;
    a model whose 6 query heads do not divide over 4 is refused by name, and runs over 6
    (its 3 kv heads repeated: OLMo 2's k norm over the whole projection sees each twice)."""
    name, d, model, want = fam
    if name not in TP_VARIANTS:
        pytest.skip(f"tp runs on {TP_VARIANTS}")
    cfg = load_hf_config(d)
    n = 4
    if cfg.num_heads % 4:
        with pytest.raises(ValueError, match="head"):
            create_engine(cfg, weights=d, config=_config(), devices=jax.devices()[:4],
                          sharding=load_preset("tp"))
        n = cfg.num_heads
    engine = create_engine(cfg, weights=d, config=_config(), devices=jax.devices()[:n],
                           sharding=load_preset("tp"))
    assert engine.kv_repeat == n // cfg.num_kv_heads
    assert _tokens(engine) == want, name


# The command line over the engine's own path, on the families with most new parts (the
# per-family weight tables are all read by the engine tests above).
CLI_VARIANTS = ("gemma3", "phi3")


def test_cli_generate_and_convert_round_trip(fam, tmp_path, capsys):
    """`jetserve generate` on the HF directory and on its `jetserve convert` Orbax copy."""
    name, d, model, want = fam
    if name not in CLI_VARIANTS:
        pytest.skip(f"the command line runs on {CLI_VARIANTS}")
    orbax = str(tmp_path / "orbax")
    assert cli.main(["convert", "--from-hf", d, "--to", orbax]) == 0
    for source in (d, orbax):
        assert cli_generate(source, _prompts(), STEPS, CHUNK, capsys) == want, (name, source)


def test_longrope_long_factors_match_transformers_rotary_embedding():
    """Positions at and past original_max_position_embeddings take LongRoPE's long
    factors (transformers: once a sequence is longer than that), earlier ones the short;
    partial rotary leaves the last dims of each head as they are."""
    import transformers as tf
    from transformers.models.phi3 import modeling_phi3

    kind, settings = DENSE_CONFIGS["phi3"]
    hf_cfg = tf.Phi3Config(**{**dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2), **settings})
    cfg = from_hf_config(hf_cfg.to_dict())
    orig = cfg.rope_scaling.original_max_position_embeddings
    x = np.random.default_rng(0).standard_normal((1, 8, 4, cfg.head_dim)).astype(np.float32)
    emb = modeling_phi3.Phi3RotaryEmbedding(hf_cfg)
    for start in (orig - 20, orig + 5):  # all short, then all long
        pos = np.arange(start, start + 8)[None]
        cos, sin = emb(torch.tensor(x), torch.tensor(pos))
        want, _ = modeling_phi3.apply_rotary_pos_emb(
            torch.tensor(x).transpose(1, 2), torch.tensor(x).transpose(1, 2), cos, sin)
        _, scale = rope_tables(cfg)
        ours = rope(jnp.asarray(x), jnp.asarray(pos), rope_inputs(cfg)["full_attention"],
                    switch_at=orig, scale=scale)
        np.testing.assert_allclose(np.asarray(ours), want.transpose(1, 2).numpy(),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("field,value", [
    ("attention_bias", True), ("use_bidirectional_attention", True),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
    ("rope_parameters", {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4,
                         "original_max_position_embeddings": 32, "new_knob": 1.0}),
])
def test_unimplemented_config_fields_are_refused_by_name(field, value):
    hf = dict(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=str(value.get("rope_type") if isinstance(value, dict)
                                             else field)):
        from_hf_config({**hf, field: value})


def test_mixed_layers_refuse_the_scan():
    """Sliding and global layers run the unrolled loop; layers "scan" is refused by name."""
    hf = dict(model_type="gemma2", vocab_size=128, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              sliding_window=8)
    cfg = from_hf_config(hf)
    assert cfg.layer_types == ("sliding_attention", "full_attention")
    assert [cfg.layer_window(i) for i in range(2)] == [8, None]
    with pytest.raises(ValueError, match="layer_types"):
        create_engine(cfg, config=_config(layers="scan"), devices=jax.devices()[:1])
    assert not create_engine(cfg, config=_config(), devices=jax.devices()[:1]).model_config.scan_layers


def test_speculative_decoding_keeps_the_tokens(fam):
    """Prompt-lookup drafts verified several tokens a step (T > 1 over the decode cache:
    windows, soft caps) leave greedy output as transformers gives it."""
    name, d, model, want = fam
    if name != "gemma2":
        pytest.skip("speculative decoding runs on gemma2 (mixed windows, soft caps)")
    engine = create_engine(load_hf_config(d), weights=d, config=_config(speculative="ngram:3"),
                           devices=jax.devices()[:1])
    assert _tokens(engine) == want


def test_lora_on_every_projection_matches_the_merged_adapter(fam, tmp_path):
    """A PEFT adapter on all seven projections (Gemma 3: under its q/k norms and sandwich
    norms) gives the tokens of transformers' model with the adapter merged, on the
    contiguous and the paged KV layouts; Phi-3's fused qkv_proj is refused by name."""
    from tests.parity.lora_adapters import make_adapter, merged_model

    name, d, model, want = fam
    if name not in ("gemma3", "phi3"):
        pytest.skip("LoRA runs on gemma3 and phi3")
    cfg = _config(max_loras=1, max_lora_rank=8, max_prefill_length=48)
    engine = create_engine(load_hf_config(d), weights=d, config=cfg, devices=jax.devices()[:1])
    if name == "phi3":
        make_adapter(d, str(tmp_path / "fused"), 4, 8, ["qkv_proj"], False, seed=1)
        with pytest.raises(ValueError, match="qkv_proj"):
            engine.load_adapter("fused", str(tmp_path / "fused"))
        return
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    make_adapter(d, str(tmp_path / "all"), 8, 16, targets, True, seed=2)
    merged = merged_model(d, str(tmp_path / "all"))
    engine.load_adapter("all", str(tmp_path / "all"))
    params = engine.load_params()
    prompts = _prompts()
    for p in prompts:
        prefix, first = engine.prefill(params, p, len(p), adapter="all")
        state = engine.insert(prefix, engine.init_decode_state(), 0)
        got = [first.to_host().token(0)]
        for _ in range(STEPS - 1):
            state, res = engine.generate(params, state)
            got.append(res.to_host().token(0))
        engine.free_slot(0)
        ref = hf_greedy(merged, p, STEPS)
        assert got == ref
    assert ref != want[-1]  # the adapter changes the tokens
    # Paged KV with pages of 4 (the sliding layers in a ring of pages), 16-token chunks:
    # adapter and base rows in one batch.
    cfg = _config(max_loras=1, max_lora_rank=8, kv_layout="paged", page_size=4)
    paged = create_engine(load_hf_config(d), weights=d, config=cfg, devices=jax.devices()[:1])
    assert paged.ring is not None and any(paged.ring.layers)
    paged.load_adapter("all", str(tmp_path / "all"))
    names = ["all", None, "all"]
    got = generate_many(paged, paged.load_params(), prompts, max_tokens=STEPS,
                        ignore_eos=True, adapters=names)
    for i, (name, r) in enumerate(zip(names, got, strict=True)):
        assert r.token_ids == (hf_greedy(merged, prompts[i], STEPS) if name else want[i]), i


def test_mixed_steps_keep_the_tokens(fam):
    """Ragged mixed steps on the paged layout (chunks of 5 beside decode rows, the
    scheduler's path for `serve --scheduling mixed`): windows per layer and soft caps in
    the ragged attention."""
    from tests.engines.mixed_driver import run_mixed

    name, d, model, want = fam
    if name != "gemma2":
        pytest.skip("mixed steps run on gemma2 (mixed windows, soft caps)")
    engine = create_engine(load_hf_config(d), weights=d, devices=jax.devices()[:1],
                           config=_config(kv_layout="paged", page_size=4))
    run = run_mixed(engine, engine.load_params(), _prompts(), max_tokens=STEPS, chunk=5,
                    budget=7, widest=True)
    assert run.mixed_steps >= 3
    assert run.outputs == want
