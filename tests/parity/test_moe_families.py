"""Today's MoE families against Hugging Face transformers on the same files (float32,
random weights, tests/parity/hf_models.py MOE_CONFIGS): Qwen3-MoE with dense layers among
the routed ones and renormalised top-k weights, and with every layer routed and the
softmax's top-k weights as they are; GLM-4.5 (a sigmoid router with its score-correction
bias, group-limited top-k, scaled weights, a shared expert, a dense first layer); gpt-oss
(attention sinks, a biased router's softmax over its top-k logits, biased experts with the
clamped SwiGLU, sliding and full layers in turn; more in tests/parity/test_gpt_oss.py).

Greedy tokens equal transformers' `generate` with a 40-token prompt prefilled in chunks of
16, on the contiguous and the paged KV layouts, and with the experts spread over 4
devices (`ep_tp`); log-probs are within 1e-4 of transformers'.
"""

from __future__ import annotations

import jax
import pytest

from engines import create_engine, load_hf_config
from jetserve import cli
from jetserve.offline import generate_many
from sharding import load_preset
from tests.parity.hf_models import (
    MOE_CONFIGS,
    assert_logprobs_close,
    cli_generate,
    parity_config,
    parity_prompts,
    written_case,
)

STEPS = 12


@pytest.fixture(scope="module", params=tuple(MOE_CONFIGS))
def fam(request, tmp_path_factory):
    """(variant, model dir, torch model, transformers' greedy tokens of each prompt)."""
    return written_case(request.param, tmp_path_factory, parity_prompts(), STEPS)


def test_config_reads_which_layers_route(fam):
    name, d, model, _ = fam
    cfg = load_hf_config(d)
    routed = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
    assert [cfg.moe_layer(i) for i in range(cfg.num_layers)] == routed, name
    windows = {cfg.layer_window(i) for i in range(cfg.num_layers)}  # gpt-oss: two kinds
    assert cfg.mixed_layers == (not all(routed) or len(windows) > 1)
    # gpt-oss has no such field: its softmax is over the top k, which sum to one.
    assert cfg.moe_renormalize == getattr(model.config, "norm_topk_prob", True)
    buffers = sum(b.numel() for n, b in model.named_buffers() if "correction_bias" in n)
    assert cfg.param_count() == sum(p.numel() for p in model.parameters()) + buffers


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_tokens_and_logprobs(fam, layout):
    name, d, model, want = fam
    engine = create_engine(load_hf_config(d), weights=d, config=parity_config(kv_layout=layout),
                           devices=jax.devices()[:1])
    results = generate_many(engine, engine.load_params(), parity_prompts(), max_tokens=STEPS,
                            ignore_eos=True)
    assert [r.token_ids for r in results] == want, name
    assert_logprobs_close(model, parity_prompts(), results)


def test_experts_over_four_devices(fam):
    """ep_tp on 4 devices: each holds 2 of the 8 experts (1 of gpt-oss's 4; the dense
    layers split as tp does), and the tokens are transformers'."""
    name, d, model, want = fam
    engine = create_engine(load_hf_config(d), weights=d, config=parity_config(),
                           devices=jax.devices()[:4], sharding=load_preset("ep_tp"))
    results = generate_many(engine, engine.load_params(), parity_prompts(), max_tokens=STEPS,
                            ignore_eos=True)
    assert [r.token_ids for r in results] == want, name


def test_cli_generate_and_convert_round_trip(fam, tmp_path, capsys):
    """`jetserve generate` on the HF directory and on its `jetserve convert` Orbax copy
    (whose config keeps which layers route)."""
    name, d, model, want = fam
    if name != "qwen3_moe":
        pytest.skip("the command line runs on the variant with dense layers among routed")
    orbax = str(tmp_path / "orbax")
    assert cli.main(["convert", "--from-hf", d, "--to", orbax]) == 0
    assert load_hf_config(d).dense_layers == (0, 2, 3)
    for source in (d, orbax):
        assert cli_generate(source, parity_prompts(), STEPS, 16, capsys) == want, (name, source)
