"""`jetserve bench quality` on random:tiny: what the figures are made of (memory per
parameter and per KV token from the model's shapes, errors against the float model)."""

import json

import numpy as np
import pytest

from jetserve import cli
from jetserve.bench import quality
from jetserve.model_loading import RANDOM_MODELS


def test_forced_logits_follow_the_greedy_run():
    from engines import EngineConfig
    from jetserve.model_loading import build_engine
    from jetserve.offline import generate_many

    eng = build_engine("random:tiny", engine_config=EngineConfig(
        max_concurrent_decodes=2, max_prefill_length=8, max_seq_len=32))
    params = eng.load_params()
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47]]
    greedy = [r.token_ids for r in generate_many(eng, params, prompts, max_tokens=6,
                                                 ignore_eos=True)]
    seqs = [p + g for p, g in zip(prompts, greedy, strict=True)]
    logits = quality.forced_logits(eng, params, seqs, 8)
    assert logits.shape == (2, 6, 256)
    # Fed its own greedy tokens, the decode path picks them again at every step.
    assert np.argmax(logits, axis=-1).tolist() == greedy


@pytest.mark.slow
def test_cli_bench_quality_json(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 4)
    assert cli.main(["bench", "quality", "--model", "random:tiny", "--steps", "6",
                     "--prompts", "2", "--prompt-len", "8", "--variants", "int8,int4,kv-int8",
                     "--text", str(text), "--text-tokens", "40", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["variant"]: r for r in out["rows"]}
    assert list(rows) == ["none", "int8", "int4", "kv-int8"]
    c = RANDOM_MODELS["tiny"]
    per_head = c.num_layers * c.num_kv_heads * 2  # k and v
    assert rows["none"]["bytes_per_kv_token"] == per_head * c.head_dim * 4
    assert rows["kv-int8"]["bytes_per_kv_token"] == per_head * (c.head_dim + 4)  # + f32 scale
    assert rows["none"]["bytes_per_param"] == 4.0
    assert rows["int4"]["bytes_per_param"] < rows["int8"]["bytes_per_param"] < 2.0
    assert rows["kv-int8"]["bytes_per_param"] == 4.0
    for name in ("int8", "int4", "kv-int8"):
        r = rows[name]
        assert 0 < r["mean_logit_error"] <= r["max_logit_error"] < 1.0
        assert 0 <= r["top1_agreement"] <= 1 and 0 <= r["greedy_run_agreement"] <= 1
        assert r["perplexity"] == pytest.approx(rows["none"]["perplexity"], rel=0.05)
    assert rows["int4"]["max_logit_error"] > rows["int8"]["max_logit_error"]


def test_quality_config_errors():
    with pytest.raises(ValueError, match="variant 'int2' is unknown"):
        quality.QualityConfig(variants=("int2",))
    with pytest.raises(ValueError, match="steps must be >= 1"):
        quality.QualityConfig(steps=0)
