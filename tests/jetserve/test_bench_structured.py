"""`jetserve bench structured` on a tiny model: its rows, and the programs it ran (the step
without a mask and the one with, each compiled once)."""

import json

import pytest

from jetserve import cli
from jetserve.bench.structured import StructuredBenchConfig


def test_cli_bench_structured_json(capsys):
    rc = cli.main(["bench", "structured", "--model", "random:tiny-v4096", "--batch", "2",
                   "--context", "8", "--steps", "3", "--repeats", "1", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    row, = out["rows"]
    assert row["batch"] == 2 and row["host_mask_ms_per_step"] > 0
    assert row["ratio_constrained_to_free"] == pytest.approx(
        row["constrained_step_ms"] / row["free_step_ms"], rel=0.01)
    assert row["traces"]["generate"] == 2  # free and masked: no recompiles past those
    assert out["tokenizer"].startswith("the bundled model's")


def test_cli_bench_structured_on_the_paged_layout(capsys):
    rc = cli.main(["bench", "structured", "--model", "random:tiny-v4096", "--batch", "2",
                   "--context", "8", "--steps", "3", "--repeats", "1", "--kv-layout", "paged",
                   "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    row, = out["rows"]
    assert out["kv_layout"] == "paged" and row["mixed_step_ms"] > 0
    assert row["ratio_mixed_to_free"] == pytest.approx(
        row["mixed_step_ms"] / row["free_step_ms"], rel=0.01)


def test_config_names_the_bad_field():
    with pytest.raises(ValueError, match="^batches"):
        StructuredBenchConfig(batches=(0,))
    with pytest.raises(ValueError, match="^repeats"):
        StructuredBenchConfig(repeats=0)
    with pytest.raises(ValueError, match="^kv_layout"):
        StructuredBenchConfig(kv_layout="ring")
