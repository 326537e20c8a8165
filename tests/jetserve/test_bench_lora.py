"""`jetserve bench decode --loras`: runs on a tiny model and reports each batch's three
steps (no timing is asserted: benchmarks print figures, tests check they are there)."""

import json

from jetserve import cli


def test_lora_decode_bench_reports_every_batch(capsys):
    argv = ["bench", "decode", "--model", "random:tiny", "--batch", "2,4", "--context", "8",
            "--steps", "6", "--warmup", "1", "--loras", "3", "--lora-rank", "4"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["batch"] for r in out["rows"]] == [2, 4]
    for r in out["rows"]:
        assert r["distinct_adapters"] == min(r["batch"], 3) and r["rank"] == 4
        for k in ("base_ms", "adapters_ms", "no_adapter_ms", "adapters_ratio",
                  "no_adapter_ratio"):
            assert r[k] > 0, k
