"""`jetserve bench transfer` on random:tiny (figures are not asserted; this checks what
they are made of: both paths moved the same prefix, once per repeat and length)."""

import json

import pytest

from jetserve import cli
from jetserve.model_loading import RANDOM_MODELS


@pytest.mark.slow
def test_cli_bench_transfer_moves_each_length_both_ways(capsys):
    rc = cli.main(["bench", "transfer", "--model", "random:tiny", "--prompt-len", "8,40",
                   "--devices", "2", "--repeats", "2", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    c = RANDOM_MODELS["tiny"]
    assert [r["prompt_len"] for r in out["rows"]] == [8, 40]
    for r in out["rows"]:
        # At least the prompt's k and v in every layer, 4-byte floats.
        assert r["kv_bytes"] >= 2 * c.num_layers * r["prompt_len"] * c.num_kv_heads * c.head_dim * 4
        assert r["pull_over_device_put"] == pytest.approx(r["pull_ms"] / r["device_put_ms"])
    assert out["rows"][1]["kv_bytes"] > out["rows"][0]["kv_bytes"]
