"""`jetserve bench prefill-rows`: its flags are checked, and a run on a tiny model prints
one JSON line with a row per (prompt length, prompts a call) and the floors beside them."""

import json

import pytest

from jetserve.bench import prefill_rows
from jetserve.cli import main as cli_main


@pytest.mark.parametrize("argv, message", [
    (["--rows", "3"], "powers of two >= 2"),
    (["--rows", "1"], "powers of two >= 2"),
    (["--prompt-len", "0"], "--prompt-len must be >= 1"),
    (["--prompt-len", "a"], "comma-separated integers"),
    (["--rounds", "0"], "--rounds must be >= 1"),
])
def test_bad_flags_name_what_was_wrong(argv, message, capsys):
    with pytest.raises(SystemExit):
        prefill_rows.parse(argv)
    assert message in capsys.readouterr().err


def test_a_tiny_run_reports_both_ways_and_the_floors(capsys):
    assert cli_main(["bench", "prefill-rows", "--model", "random:tiny", "--prompt-len", "5,16",
                     "--rows", "2,4", "--rounds", "1", "--read-bytes", str(1 << 26),
                     "--matmul-size", "256",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["prompt_len"], r["rows"]) for r in out["rows"]] == [(5, 2), (5, 4), (16, 2),
                                                                    (16, 4)]
    for r in out["rows"]:
        assert r["shared_ms"] > 0 and r["alone_ms"] > 0
        assert r["speedup"] == pytest.approx(r["alone_ms"] / r["shared_ms"])
        assert r["weight_read_floor_ms"] > 0 and r["compute_floor_ms"] > 0
    # the compute floor grows with the prompts of a call; the weight read does not
    for a, b in ((out["rows"][0], out["rows"][1]), (out["rows"][2], out["rows"][3])):
        assert b["compute_floor_ms"] == pytest.approx(2 * a["compute_floor_ms"])
        assert b["weight_read_floor_ms"] == a["weight_read_floor_ms"]
    assert out["rows"][2]["compute_floor_ms"] > out["rows"][0]["compute_floor_ms"]
