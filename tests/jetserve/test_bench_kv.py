"""`jetserve bench capacity` and `jetserve bench chunked` on tiny shapes (figures are not
asserted; these tests check what the figures are made of)."""

import json

import pytest

from jetserve import cli
from jetserve.bench import capacity, chunked


def test_capacity_length_mix_fits_the_sequence_limit():
    cfg = capacity.CapacityConfig(requests=200, max_seq_len=256, prompt_median=100,
                                  output_median=80)
    mix = capacity.length_mix(cfg)
    assert len(mix) == 200 and all(p >= 4 and n >= 1 and p + n <= 256 for p, n in mix)
    assert mix == capacity.length_mix(cfg)  # seeded: both layouts get the same requests
    with pytest.raises(ValueError, match="kv_tokens"):
        capacity.CapacityConfig(kv_tokens=100, max_seq_len=256)


@pytest.mark.slow
def test_cli_bench_capacity_runs_the_same_requests_on_both_layouts(capsys):
    rc = cli.main(["bench", "capacity", "--kv-tokens", "256", "--max-seq-len", "128",
                   "--page-size", "8", "--paged-slots", "8", "--requests", "12",
                   "--prompt-median", "12", "--output-median", "8", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    c, p = out["rows"]["contiguous"], out["rows"]["paged"]
    assert c["slots"] == 2 and c["max_concurrency"] <= 2  # 256 // 128
    assert p["max_concurrency"] > 2  # short sequences share the same 32 pages
    assert c["tokens"] == p["tokens"] > 0
    assert out["concurrency_ratio"] == round(p["mean_concurrency"] / c["mean_concurrency"], 2)


@pytest.mark.slow
def test_cli_bench_chunked_measures_both_modes(capsys):
    rc = cli.main(["bench", "chunked", "--model", "random:tiny", "--prompt-len", "40",
                   "--chunk", "16", "--running", "2", "--arrivals", "1", "--max-seq-len",
                   "128", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for mode in ("whole", "chunked"):
        r = out["rows"][mode]
        assert r["gaps"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
    with pytest.raises(ValueError, match="chunk"):
        chunked.ChunkedConfig(prompt_len=64, chunk=64)


def test_cli_bench_prefix_reports_three_modes(capsys):
    rc = cli.main(["bench", "prefix", "--model", "random:tiny", "--system-len", "48",
                   "--question-len", "4", "--requests", "3", "--cache-mb", "8", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert rows["off"]["hit_rate"] == 0 and rows["off"]["hbm_bytes"] == 0
    # 3 measured requests after 3 warm-up ones on another system prompt: 4 of 6 hit.
    for mode, tier in (("hbm", "hbm_bytes"), ("host", "host_bytes")):
        assert rows[mode]["hit_rate"] == round(4 / 6, 3) and rows[mode][tier] > 0
    assert rows["host"]["hbm_bytes"] == 0
    # 3 prompts of 48 + 4 tokens through one system prompt: its 3 blocks of 16 once, and
    # nothing else whole (block 4 holds 4 tokens of each question only).
    d = out["dedup"]
    assert d["held_blocks"] == 3 and d["held_bytes"] == d["system_copy_bytes"]
    assert d["per_entry_bytes"] >= 3 * d["system_copy_bytes"]
