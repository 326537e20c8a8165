"""`jetserve bench startup --json`: a cold start then a warm one on the same new cache."""

import json

import pytest

from jetserve import cli
from jetserve.bench.startup import StartupConfig


@pytest.mark.slow
def test_json_has_a_cold_and_a_warm_start(capsys):
    rc = cli.main(["bench", "startup", "--model", "random:tiny", "--max-seq-len", "64",
                   "--prompt-len", "8", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["model"] == "random:tiny" and out["prompt_len"] == 8
    for key in ("cold", "warm"):
        r = out[key]
        assert r["cache"] == key
        for field in ("first_token_s", "compile_s", "compile_share", "trace_s"):
            assert isinstance(r[field], float) and r[field] >= 0, (key, field, r)
        assert r["first_token_s"] > 0 and r["programs"] > 0
        assert isinstance(r["cpu_s"], float) and r["cpu_s"] > 0  # the child's, not ours
    assert out["cold"]["from_cache"] == 0 and out["warm"]["from_cache"] > 0
    assert isinstance(out["warm_over_cold"], float)
    assert out["cpu_warm_over_cold"] == pytest.approx(
        out["warm"]["cpu_s"] / out["cold"]["cpu_s"], abs=1e-3)


def test_config_names_the_bad_field():
    with pytest.raises(ValueError, match="prompt_len"):
        StartupConfig(prompt_len=300, max_seq_len=256)
