"""`jetserve bench prefill`: its FLOP count, its checks, and one run of the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jetserve import cli
from jetserve.bench import prefill
from jetserve.model_loading import RANDOM_MODELS


def test_prefill_flops_by_hand():
    c = RANDOM_MODELS["tiny"]
    D, F, N, K, H, L, V = (c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
                           c.head_dim, c.num_layers, c.vocab_size)
    per_token = L * (2 * D * N * H + 2 * D * K * H + 3 * D * F)
    # 10 tokens in chunks of 4: 3 chunks, one LM-head row each; 55 causal pairs.
    want = 2 * (10 * per_token + 3 * V * D) + 4 * L * N * H * 55
    assert prefill.prefill_flops(c, 10, 4) == want
    # A window of 3: query p sees min(p + 1, 3) keys: 1 + 2 + 3 * 8 = 27 pairs.
    windowed = dataclasses.replace(c, sliding_window=3)
    assert prefill.prefill_flops(windowed, 10, 4) == want - 4 * L * N * H * (55 - 27)


@pytest.mark.parametrize("kwargs,field", [({"lengths": ()}, "lengths"),
                                          ({"lengths": (1,)}, "lengths"),
                                          ({"chunk": 8}, "chunk"),
                                          ({"attention": "flash"}, "attention"),
                                          ({"timeout_s": 0}, "timeout_s")])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        prefill.PrefillBenchConfig(**kwargs)


def test_lengths_flag():
    assert prefill.parse_lengths("64, 128") == (64, 128)
    for bad in ("64,x", "", "1"):
        with pytest.raises(ValueError, match="--lengths"):
            prefill.parse_lengths(bad)


def test_cli_bench_prefill_json(capsys):
    """Two lengths, the longer one in two chunks, each in its own process."""
    rc = cli.main(["bench", "prefill", "--model", "random:tiny", "--lengths", "32,128",
                   "--chunk", "64", "--attention", "xla", "--json"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["length"], r["chunk"]) for r in rows] == [(32, 32), (128, 64)]
    # Both chunks of 128 write into the one prefix of 128 entries (engine.empty_prefix):
    # one program, where a prefix grown chunk by chunk took two.
    assert [r["programs"] for r in rows] == [1, 1]
    for r in rows:
        assert r["attention"] == "xla" and r["temp_bytes"] > 0
        assert r["peak_rss_bytes"] > r["weights_bytes"]
        assert r["fraction_of_floor"] == pytest.approx(r["floor_s"] / r["seconds"], rel=0.05,
                                                      abs=1e-3)
