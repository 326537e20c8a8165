"""`--speculative` on the commands: named errors, and `jetserve generate --json` rows with
the acceptance counts (the same tokens as without it)."""

import json
import re

import pytest

from jetserve import cli

ARGS = ["--model", "random:tiny", "--max-tokens", "24", "--ignore-eos", "--json",
        "--max-concurrent-decodes", "2", "--max-prefill-length", "32", "--max-seq-len", "64",
        "--prompt-ids", "5,9,11,3,5,9,11,3,5,9", "--prompt-ids", "7,1,2"]


@pytest.mark.parametrize("command", ["generate", "serve", "batch"])
@pytest.mark.parametrize("value, message", [
    ("ngram:0", "--speculative: .*1 <= K <= 16"), ("draft:", "--speculative: .*draft model"),
    ("ngram:x", "--speculative: .*integer K"),
])
def test_bad_speculative_is_named(command, value, message, capsys, tmp_path):
    extra = {"generate": ["--prompt", "x"], "serve": [],
             "batch": ["--input", str(tmp_path / "in.jsonl"), "--output",
                       str(tmp_path / "out.jsonl")]}[command]
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    rc = cli.main([command, "--model", "random:tiny", "--speculative", value, *extra])
    assert rc == 2
    assert re.search(message, capsys.readouterr().err)


def test_generate_json_rows_carry_acceptance(capsys):
    assert cli.main(["generate", *ARGS]) == 0
    plain = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert cli.main(["generate", *ARGS, "--speculative", "ngram:3"]) == 0
    spec = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert all("drafted" not in r for r in plain)
    for r in spec:
        assert r["drafted"] > 0 and 0 <= r["accepted"] <= r["drafted"]
        assert r["drafted"] % 3 == 0  # K drafts per step
