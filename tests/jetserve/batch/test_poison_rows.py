"""Rows that break a later stage (lone surrogates, deep nesting, a tokenizer that raises)
become error rows naming their line and field; every other row of their window runs.

In-process with a model-free executor (as test_journal.py), plus one `jetserve batch`
subprocess on the bundled model, whose sentencepiece tokenizer raises RuntimeError on a
lone surrogate."""

import json
import os
import subprocess
import sys

import pytest

from engines.mock_engine import ByteTokenizer
from jetserve.batch import wellformed
from jetserve.batch.journal import read_rows
from jetserve.batch.runner import BatchConfig, run_job
from jetserve.server.validation import ModelLimits
from tests.jetserve.batch.test_journal import fake_executor, write_lines

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
DEEP = 100_000


class FussyTokenizer(ByteTokenizer):
    """Raises on one prompt, as a tokenizer with a bug would."""

    def encode(self, text, *, add_bos=False):
        if "boom" in text:
            raise RuntimeError("tokenizer exploded")
        return super().encode(text, add_bos=add_bos)


LIMITS = ModelLimits(vocab_size=256, max_prefill_length=64, max_seq_len=128, bos_id=None,
                     eos_ids=(0,), top_logprobs=4, tokenizer=FussyTokenizer(eos_ids=(0,)))


def poison_lines() -> tuple[list[str], dict[str, str]]:
    """Good rows g0..g5 around poison rows; the expected error of each poison row."""
    nested = "[" * 200 + "]" * 200  # parses, but too deep to trust
    lines = [
        '{"id": "g0", "prompt": "ab"}',
        '{"id": "sur", "prompt": "a\\ud800b"}',
        '{"id": "g1", "prompt": "abc"}',
        '{"id": "chat", "messages": [{"role": "user", "content": "x\\udc00y"}]}',
        '{"id": "g2", "messages": [{"role": "user", "content": "hello"}]}',
        "[" * DEEP + "]" * DEEP,
        '{"id": "deep", "prompt": ' + "[" * DEEP + "]" * DEEP + "}",
        '{"id": "g3", "prompt": "abcd"}',
        '{"id": "meta", "prompt": "x", "metadata": ' + nested + "}",
        '{"id": "metasur", "prompt": "x", "metadata": {"note": "\\udfff"}}',
        '{"id": "a\\ud83d", "prompt": "x"}',
        '{"id": "boom", "prompt": "boom"}',
        '{"id": "g4", "prompt": "abcde"}',
        '{"id": "keysur", "prompt": "x", "metadata": {"\\ud800": 1}}',
        '{"id": "g5", "context": "ab", "continuation": "c"}',
    ]
    want = {
        '"sur"': "line 2: prompt contains a lone surrogate U+D800 at character 1",
        '"chat"': "line 4: messages[0].content contains a lone surrogate U+DC00",
        "#line 6": "line 6: the line is nested too deeply to parse",
        "#line 7": "line 7: the line is nested too deeply to parse",
        '"meta"': f"line 9: metadata{'[0]' * (wellformed.MAX_DEPTH - 1)} is nested more "
                  f"than {wellformed.MAX_DEPTH} levels deep",
        '"metasur"': "line 10: metadata.note contains a lone surrogate U+DFFF",
        "#line 11": 'line 11: "id" contains a lone surrogate U+D83D',
        '"boom"': "line 12: the row could not be prepared (RuntimeError: tokenizer exploded)",
        '"keysur"': "line 14: a field name in metadata contains a lone surrogate",
    }
    return lines, want


def by_key(rows):
    return {f"#line {r['line']}" if "line" in r else json.dumps(r["id"]): r for r in rows}


@pytest.mark.parametrize("window", [4096, 3])
def test_poison_rows_become_error_rows_and_the_rest_runs(tmp_path, window):
    lines, want = poison_lines()
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = str(tmp_path / "out.jsonl")
    s = run_job(BatchConfig(input=inp, output=out, window=window, progress=False), LIMITS,
                fake_executor)
    rows = by_key(read_rows(out))
    assert len(rows) == len(lines) == s.rows
    assert (s.ok, s.failed) == (6, len(want))
    for key, message in want.items():
        assert message in rows[key]["error"], (key, rows[key])
    for i in range(6):
        assert "text" in rows[f'"g{i}"'], rows[f'"g{i}"']
    # The job is finished: resuming runs nothing, and the error rows still fail it.
    s2 = run_job(BatchConfig(input=inp, output=out, resume=True, progress=False), LIMITS,
                 fake_executor)
    assert (s2.resumed, s2.ok, s2.failed, s2.failed_before) == (len(lines), 0, 0, len(want))
    assert len(read_rows(out)) == len(lines)


def test_wellformed_walks_deep_values_without_recursing():
    deep: list = []
    for _ in range(50_000):  # built without json, deeper than the recursion limit
        deep = [deep]
    with pytest.raises(wellformed.Malformed, match="nested more than"):
        wellformed.check({"metadata": deep})
    wellformed.check({"ok": [[{"a": ["\u00e9\U0001f600"]}]]})  # paired surrogates are fine


@pytest.mark.slow  # one model load in a subprocess
def test_cli_poison_rows_with_the_bundled_tokenizer(tmp_path):
    """The bundled model's sentencepiece tokenizer raises RuntimeError on a lone surrogate;
    the job writes every row, and --resume finishes at once."""
    lines = ['{"id": "g0", "prompt": "def f():"}',
             '{"id": "sur", "prompt": "a\\ud800b"}',
             '{"id": "chat", "messages": [{"role": "user", "content": "x\\udc00y"}]}',
             "[" * DEEP + "]" * DEEP,
             '{"id": "g1", "messages": [{"role": "user", "content": "import os"}]}']
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = str(tmp_path / "out.jsonl")
    cmd = [sys.executable, "-m", "jetserve", "batch", "--input", inp, "--output", out,
           "--max-tokens", "2", "--no-progress"]
    for extra, done_before in (([], 0), (["--resume"], len(lines))):
        p = subprocess.run(cmd + extra, cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 1, p.stderr
        assert "Traceback" not in p.stderr
        assert f"({done_before} done before this run" in p.stderr
    rows = by_key(read_rows(out))
    assert len(rows) == len(lines)
    assert "line 2: prompt contains a lone surrogate" in rows['"sur"']["error"]
    assert "line 3: messages[0].content contains a lone surrogate" in rows['"chat"']["error"]
    assert "line 4: the line is nested too deeply" in rows["#line 4"]["error"]
    assert rows['"g0"']["completion_tokens"] == rows['"g1"']["completion_tokens"] == 2
