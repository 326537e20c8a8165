"""`jetserve plan` against the textbook decode examples of issue 6 (each within 3%)."""

import dataclasses
import json

import pytest

from jetserve import cli
from jetserve.hardware import PRESETS, Hardware
from jetserve.model_loading import RANDOM_MODELS
from jetserve.model_presets import MODEL_PRESETS
from jetserve.plan import ModelSpec, Precision, make_plan

V5E = PRESETS["tpu-v5e"]
BF16 = Precision(weight_bits=16, act_bits=16, kv_bits=16)
BATCHES = (1, 8, 16, 32, 64, 240)
# LLaMA-2-13B in bf16 on 8 v5e chips at 8192 context, as the textbook tabulates it.
TEXTBOOK_STEP_MS = (4.98, 12.13, 20.30, 36.65, 69.33, 249.09)
TEXTBOOK_TOK_S = (200.6, 659.3, 788.0, 873.2, 923.1, 963.5)


def close(got, want, rel=0.03):
    return abs(got - want) <= rel * abs(want)


@pytest.fixture(scope="module")
def llama13b():
    return ModelSpec.from_config(MODEL_PRESETS["llama2-13b"], "llama2-13b")


def test_llama2_13b_shapes(llama13b):
    assert close(llama13b.params, 13e9, 0.01)
    plan = make_plan(llama13b, V5E, chips=8, batches=[1], context=8192, precision=BF16)
    assert close(plan.kv_bytes_per_seq / 1e9, 6.7)
    assert close(plan.critical_batch, 240)


def test_llama2_13b_step_floor_and_throughput(llama13b):
    plan = make_plan(llama13b, V5E, chips=8, batches=BATCHES, context=8192, precision=BF16)
    for row, ms, tok in zip(plan.rows, TEXTBOOK_STEP_MS, TEXTBOOK_TOK_S, strict=True):
        assert close(row.step_ms_floor, ms), (row.batch, row.step_ms_floor, ms)
        assert close(row.tokens_per_s, tok), (row.batch, row.tokens_per_s, tok)
        assert row.bound == "memory"  # 240 is at the critical batch, KV dominates anyway


def test_llama2_13b_what_fits(llama13b):
    plan = make_plan(llama13b, V5E, chips=8, batches=BATCHES, context=8192, precision=BF16)
    fits = {r.batch: r.fits for r in plan.rows}
    assert fits[1] and fits[8]
    assert not fits[16]
    assert close(plan.rows[2].total_gb, 133)  # the textbook's "about 133" (GB units)
    assert 8 <= plan.max_batch < 16


def test_llama2_13b_with_8_kv_heads(llama13b):
    # The textbook swaps in 8 kv heads and keeps the 13B parameter count: only the cache shrinks.
    gqa = dataclasses.replace(llama13b, kv_values_per_token=2 * 40 * 8 * 128)
    plan = make_plan(gqa, V5E, chips=8, batches=[1, 240], context=8192, precision=BF16)
    assert close(plan.rows[0].step_ms_floor, 4.17)
    assert close(plan.rows[1].step_ms_floor, 52.99)


def test_30b_int8_on_16_chips_includes_compute():
    spec = ModelSpec(name="30b", params=30e9, unread_params=0.0, matmul_params=30e9,
                     kv_values_per_token=100e3, ffn=4 * 7168)  # 100 kB per token at int8
    int8 = Precision(weight_bits=8, act_bits=16, kv_bits=8)
    plan = make_plan(spec, V5E, chips=16, batches=[4, 256], context=8192, precision=int8)
    b4, b256 = plan.rows
    assert close(b4.step_ms_floor, 2.5, 0.03)
    assert close(b256.step_ms_floor, 21.0, 0.03)
    # Without the compute term batch 256 would come out at the memory floor, ~18 ms.
    assert b256.step_ms_floor - b256.step_ms_memory > 2.0
    assert b256.bound == "compute"


def test_llama_156m_reads_492_mb_per_step():
    spec = ModelSpec.from_config(RANDOM_MODELS["llama-156m"])
    assert close(spec.params, 156e6, 0.01)
    assert close(spec.read_params(1) * 4, 492e6, 0.01)  # the input embedding is not read


def test_tied_embedding_is_read_by_the_head():
    cfg = dataclasses.replace(RANDOM_MODELS["llama-156m"], tie_word_embeddings=True)
    spec = ModelSpec.from_config(cfg)
    assert spec.read_params(1) == spec.params


def test_moe_reads_more_experts_as_batch_grows():
    spec = ModelSpec.from_config(MODEL_PRESETS["mixtral-8x7b"])
    assert close(spec.params, 46.7e9, 0.01)
    one, big = spec.read_params(1), spec.read_params(64)
    assert close(one, 12.9e9 - 4096 * 32000, 0.05)  # ~13B active at batch 1
    assert big > 0.99 * (spec.params - spec.unread_params)


def test_int8_activations_use_the_int8_rate():
    assert V5E.matmul_flops(8, 8) == V5E.flops_int8
    assert V5E.matmul_flops(8, 16) == V5E.flops_bf16
    with pytest.raises(ValueError, match="weight_bits"):
        Precision(weight_bits=12)


def test_cpu_f32_batch_is_compute_bound_past_critical():
    cpu = Hardware(name="cpu", hbm_bytes=24e9, hbm_bandwidth=32e9, flops_bf16=10e9,
                   flops_int8=10e9, flops_f32=100e9, ici_bandwidth=None)
    spec = ModelSpec.from_config(RANDOM_MODELS["llama-156m"])
    f32 = Precision.from_dtype("float32")
    plan = make_plan(spec, cpu, batches=[1, 32], context=256, precision=f32)
    assert close(plan.critical_batch, 2 * 100 / 32)
    b1, b32 = plan.rows
    assert b1.bound == "memory" and b32.bound == "compute"
    assert close(b1.step_ms_floor, 15.5, 0.03)
    assert b1.model_parallel_max is None


def test_cli_json(capsys):
    rc = cli.main(["plan", "--model-preset", "llama2-13b", "--hardware", "tpu-v5e",
                   "--chips", "8", "--context", "8192", "--batch", "1,8,16", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert [r["batch"] for r in rows] == [1, 8, 16]
    for r, ms in zip(rows, TEXTBOOK_STEP_MS, strict=False):
        assert {"batch", "kv_gib", "total_gib", "step_ms_floor", "tokens_per_s"} <= set(r)
        assert close(r["step_ms_floor"], ms)
    assert [r["fits"] for r in rows] == [True, True, False]


def test_cli_model_path_and_errors(capsys):
    assert cli.main(["plan", "--model", "random:llama-156m", "--hardware", "h200",
                     "--batch", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["precision"]["weight_bits"] == 16  # auto: bf16 on an accelerator
    assert close(out["rows"][0]["weights_read_gb"], 0.246, 0.01)
    assert cli.main(["plan", "--model-preset", "llama3-8b", "--hardware", "h100",
                     "--batch", "0"]) == 2
    assert "--batch" in capsys.readouterr().err


def test_tp_past_the_kv_heads_counts_the_copies():
    """Llama-3-70B (8 kv heads) on 16 chips: each kv head on 2 chips, so the cache holds
    twice the model's KV per token (one head's worth per chip) and the k/v projections
    are stored twice."""
    spec = ModelSpec.from_config(MODEL_PRESETS["llama3-70b"])
    assert spec.num_kv_heads == 8 and spec.kv_head_copies(16) == 2
    assert spec.kv_head_copies(8) == 1 and spec.kv_head_copies(12) == 1
    per_token = 2 * 80 * 8 * 128 * 2  # Z bytes in bf16
    p8 = make_plan(spec, V5E, chips=8, batches=[1], context=8192, precision=BF16)
    p16 = make_plan(spec, V5E, chips=16, batches=[1], context=8192, precision=BF16)
    assert p8.kv_head_copies == 1 and p8.kv_bytes_per_token == per_token
    assert p8.kv_bytes_per_token_per_chip == per_token / 8
    assert p16.kv_head_copies == 2 and p16.kv_bytes_per_token == 2 * per_token
    assert p16.kv_bytes_per_token_per_chip == per_token / 8  # one kv head per chip
    kv_proj = 80 * 2 * 8 * 128 * 8192 * 2  # k and v projections, bf16
    assert p16.param_bytes - p8.param_bytes == kv_proj
    assert p16.rows[0].kv_gb == pytest.approx(2 * p8.rows[0].kv_gb)


def test_cli_shows_kv_bytes_per_chip(capsys):
    assert cli.main(["plan", "--model-preset", "llama3-70b", "--hardware", "tpu-v5e",
                     "--chips", "16", "--context", "8192", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert ("16 chips of tensor parallelism (tp) over 8 kv heads hold each head, its k/v "
            "projections and its cache, on 2 chips: 40.96 kB/token per chip") in out
    assert cli.main(["plan", "--model-preset", "llama3-70b", "--hardware", "tpu-v5e",
                     "--chips", "16", "--batch", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_head_copies"] == 2 and out["kv_bytes_per_token_per_chip"] == 40960


def test_dp_ep_splits_the_latent_cache_and_copies_the_rest():
    """DeepSeek-V3 on 64 chips: tp holds its one latent kv head on every chip (64 copies of
    the cache); dp_ep splits the cache by slot (1/64 per chip, no copies) and the experts,
    and holds every other weight on every chip (stored and read 64 times)."""
    spec = ModelSpec.from_config(MODEL_PRESETS["deepseek-v3"])
    per_token = 61 * (512 + 64) * 2  # the keys of one latent head (no values), bf16
    tp = make_plan(spec, V5E, chips=64, batches=[1], context=4096, precision=BF16)
    dp = make_plan(spec, V5E, chips=64, batches=[1], context=4096, precision=BF16,
                   layout="dp_ep")
    assert tp.kv_head_copies == 64 and tp.kv_bytes_per_token == 64 * per_token
    assert dp.kv_head_copies == 1 and dp.kv_bytes_per_token == per_token
    assert dp.kv_bytes_per_token_per_chip == per_token / 64
    assert dp.rows[0].kv_gb * 64 == pytest.approx(tp.rows[0].kv_gb)
    whole = spec.params - spec.expert_params  # attention, dense MLPs, shared experts, embeddings
    assert dp.param_bytes == pytest.approx((spec.params + 63 * whole) * 2)
    read = (spec.read_params(1) + 63 * (whole - spec.unread_params)) * 2
    assert dp.rows[0].weights_read_gb == pytest.approx(read / 1e9)
    one = make_plan(spec, V5E, chips=1, batches=[1], context=4096, precision=BF16,
                    layout="dp_ep")
    assert one.param_bytes == make_plan(spec, V5E, chips=1, batches=[1], context=4096,
                                        precision=BF16).param_bytes
    with pytest.raises(ValueError, match=r"layout must be one of \('tp', 'dp_ep'\), got 'ep'"):
        make_plan(spec, V5E, chips=8, batches=[1], context=64, precision=BF16, layout="ep")


def test_cli_dp_ep(capsys):
    assert cli.main(["plan", "--model-preset", "deepseek-v3", "--hardware", "tpu-v6e",
                     "--chips", "64", "--batch", "1", "--sharding", "dp_ep", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"] == "dp_ep" and out["kv_head_copies"] == 1
    assert out["kv_bytes_per_token_per_chip"] == 61 * (512 + 64) * 2 / 64


@pytest.mark.parametrize("name,billions", [
    ("qwen3-8b", 8.19), ("qwen3-32b", 32.76), ("gemma3-12b", 11.77), ("gemma3-27b", 27.01),
    ("phi4-mini", 3.84), ("olmo2-13b", 13.72)])
def test_todays_dense_presets_have_their_published_sizes(name, billions):
    """Parameter counts of the text models as their model cards give them (Gemma 3's
    without its vision tower)."""
    assert close(MODEL_PRESETS[name].param_count() / 1e9, billions, 0.01)


@pytest.mark.parametrize("name,billions", [
    ("qwen3-30b-a3b", 30.5), ("qwen3-235b-a22b", 235.0), ("glm-4.5-air", 106.0),
    ("glm-4.5", 355.0), ("gpt-oss-20b", 20.91), ("gpt-oss-120b", 116.83)])
def test_todays_moe_presets_have_their_published_sizes(name, billions):
    """Total parameters as the model cards give them (GLM-4.5's count its one
    next-token-prediction layer too, which the decoder does not run: within 1%)."""
    assert close(MODEL_PRESETS[name].param_count() / 1e9, billions, 0.01)
    spec = ModelSpec.from_config(MODEL_PRESETS[name])
    assert spec.expert_params > 0.9 * spec.params  # most of an MoE model is its experts


@pytest.mark.parametrize("name,active", [("gpt-oss-20b", 3.61), ("gpt-oss-120b", 5.13)])
def test_gpt_oss_presets_read_their_published_active_parameters(name, active):
    """The model card's active parameters per token (unembedding included): what a
    step's matmuls read for one token."""
    assert close(ModelSpec.from_config(MODEL_PRESETS[name]).matmul_params / 1e9, active, 0.01)


def test_llama_4_scout_preset_has_its_published_sizes():
    """Llama 4 Scout's card: 109B total with its vision encoder (the text decoder alone
    is 107.77B, 16 experts of 3 * 5120 * 8192 and a shared one on each of 48 layers), and
    17B active: the attention, the shared and one routed expert per layer, both
    embeddings."""
    cfg = MODEL_PRESETS["llama-4-scout"]
    assert close(cfg.param_count() / 1e9, 107.77, 0.001)
    assert 0.98 < cfg.param_count() / 109e9 < 1.0
    spec = ModelSpec.from_config(cfg)
    embed = cfg.vocab_size * cfg.hidden_size
    assert close((spec.matmul_params + embed) / 1e9, 17.0, 0.02)
    assert spec.expert_params == 48 * 16 * 3 * 5120 * 8192  # the shared ones always read


def test_sliding_layers_read_their_window_only():
    """Gemma 3 (40 of 48 layers sliding over 1024 keys): a step at 32k context reads the
    global layers' whole context and the sliding layers' window."""
    spec = ModelSpec.from_config(MODEL_PRESETS["gemma3-12b"])
    assert spec.sliding_layers == 40 / 48
    one = make_plan(spec, V5E, chips=1, batches=[1], context=32768, precision=BF16).rows[0]
    full = make_plan(dataclasses.replace(spec, sliding_window=None), V5E, chips=1,
                     batches=[1], context=32768, precision=BF16).rows[0]
    read_share = (8 / 48 * 32768 + 40 / 48 * 1024) / 32768
    kv_ms = 32768 * spec.kv_values_per_token * 2 / V5E.hbm_bandwidth * 1e3  # every layer
    assert close(full.step_ms_memory - one.step_ms_memory, (1 - read_share) * kv_ms)


def test_paged_sliding_layers_store_their_ring_only(capsys):
    """Gemma 3 27B at 32k on the paged layout: the 52 of 62 layers with a window of 1024
    store a ring of ceil((1024 + 512 - 1) / 16) + 1 = 97 pages of 16 per sequence, the 10
    global layers every position: about a fifth of the contiguous layout's bytes, and a
    batch five times larger fits."""
    out = {}
    for layout in ("contiguous", "paged"):
        assert cli.main(["plan", "--model-preset", "gemma3-27b", "--hardware", "tpu-v5p",
                         "--context", "32768", "--batch", "1", "--kv-layout", layout,
                         "--json"]) == 0
        out[layout] = json.loads(capsys.readouterr().out)
    share = (10 * 32768 + 52 * 97 * 16) / (62 * 32768)
    assert close(out["paged"]["kv_bytes_per_seq"], share * out["contiguous"]["kv_bytes_per_seq"])
    assert close(out["paged"]["rows"][0]["kv_gb"], share * out["contiguous"]["rows"][0]["kv_gb"])
    assert out["paged"]["max_batch"] >= 4 * out["contiguous"]["max_batch"] > 0
    assert cli.main(["plan", "--model-preset", "gemma3-27b", "--kv-layout", "paged"]) == 0
    assert "keep a ring of 1552 positions per sequence" in capsys.readouterr().out


@pytest.mark.parametrize("name,total,active", [("deepseek-v3", 671.0, 37.0),
                                               ("kimi-k2", 1026.4, 32.0)])
def test_deepseek_v3_presets_have_their_published_sizes(name, total, active):
    """DeepSeek-V3's card: 671B in the decoder (685B with its next-token-prediction
    module, which the decoder does not run), 37B active; Kimi K2's: 1T total (1.026T),
    32B active (both embeddings counted, as the cards do). The KV cache per token is the
    latent attention's one kv head of 512 + 64 per layer, held once (keys only: the
    values are read from them), not 128 heads of keys and values: 70,272 bytes at bf16."""
    cfg = MODEL_PRESETS[name]
    assert close(cfg.param_count() / 1e9, total, 0.001)
    spec = ModelSpec.from_config(cfg)
    embed = cfg.vocab_size * cfg.hidden_size
    assert close((spec.matmul_params + embed) / 1e9, active, 0.03)
    assert spec.kv_values_per_token == 61 * (512 + 64)
    assert cfg.kv_bytes_per_token(2) == 61 * (512 + 64) * 2 == 70_272


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2"])
def test_cli_plans_the_latent_cache_once(name, capsys):
    """`jetserve plan` of the latent-attention presets: (512 + 64) x 61 layers x 2 bytes
    per token at bf16, the keys alone (the cache holds no copy of the latent as values);
    tensor parallelism over 64 chips holds the one latent kv head on each of them."""
    for chips in ("1", "64"):
        assert cli.main(["plan", "--model-preset", name, "--hardware", "tpu-v6e", "--chips",
                         chips, "--batch", "1", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["kv_bytes_per_token_per_chip"] == (512 + 64) * 61 * 2 == 70_272
        assert out["kv_bytes_per_token"] == 70_272 * int(chips)
