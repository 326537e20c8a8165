"""The output journal (durable appends, torn-tail recovery), input scanning and ownership,
merging parts, and run_job's bookkeeping with a model-free executor."""

import json

import pytest

from engines.mock_engine import ByteTokenizer
from jetserve.batch import inputs
from jetserve.batch.journal import Journal, part_path, read_rows, recover
from jetserve.batch.merge import merge
from jetserve.batch.runner import BatchConfig, run_job
from jetserve.server.validation import ModelLimits

LIMITS = ModelLimits(vocab_size=256, max_prefill_length=64, max_seq_len=128, bos_id=None,
                     eos_ids=(0,), top_logprobs=4, tokenizer=ByteTokenizer(eos_ids=(0,)))


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_recover_truncates_a_torn_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    with Journal(str(out), resume=False) as j:
        j.append([{"id": "a", "text": "x"}, {"id": 1, "error": "bad"}])
        j.append([{"id": None, "error": "not json", "line": 4}])
    good = out.read_bytes()
    for torn in (b'{"id": "b", "te', b'{"id": "b", "te\n'):
        out.write_bytes(good + torn)
        rec = recover(str(out))
        assert rec.done == {'"a"': True, "1": False, "#line 4": False}
        assert rec.torn_bytes == len(torn) and out.read_bytes() == good


def test_recover_refuses_a_file_damaged_in_the_middle(tmp_path):
    out = write_lines(tmp_path / "out.jsonl", ['{"id": "a", "text": ""}', "garbage",
                                                    '{"id": "b", "text": ""}'])
    with pytest.raises(ValueError, match=":2 is not a JSON object row"):
        recover(out)


def test_journal_needs_resume_to_append_to_an_existing_output(tmp_path):
    out = write_lines(tmp_path / "out.jsonl", ['{"id": "a", "text": ""}'])
    with pytest.raises(ValueError, match="already exists; pass --resume"):
        Journal(out, resume=False)
    with Journal(out, resume=True) as j:
        assert j.done == {'"a"': True}
        j.append([{"id": "b", "text": ""}])
    assert [r["id"] for r in read_rows(out)] == ["a", "b"]


def test_scan_finds_bad_lines_and_duplicates(tmp_path):
    path = write_lines(tmp_path / "in.jsonl", [
        '{"id": "a", "prompt": "x"}', "", "{oops", '{"id": 1, "prompt": "x"}',
        '{"id": "1", "prompt": "x"}', '{"id": "a", "prompt": "y"}'])
    entries = inputs.scan(path)
    assert [(e.line, e.key) for e in entries] == [
        (1, '"a"'), (3, "#line 3"), (4, "1"), (5, '"1"'), (6, "#line 6")]
    assert "line 3: the line is not valid JSON" in entries[1].error
    assert "duplicate id 'a' (first on line 1)" in entries[4].error
    assert entries[4].error_row() == {"id": "a", "error": entries[4].error, "line": 6}
    assert [n for n, _ in inputs.read_lines(path, [6, 1])] == [1, 6]


def test_ownership_is_a_deterministic_partition():
    keys = [json.dumps(f"row-{i}") for i in range(400)]
    owners = [inputs.owner(k, 3) for k in keys]
    assert owners == [inputs.owner(k, 3) for k in keys]
    assert all(owners.count(p) > 80 for p in range(3))  # roughly even


def fake_executor(jobs, emit):
    """A model-free executor: each job's 'text' is its prompt length."""
    for job in jobs:
        emit([(job, {"id": job.id, "text": str(job.prompt_len), "token_ids": [1]})])


def test_run_job_orders_by_length_writes_errors_and_resumes(tmp_path, capsys):
    lines = ['{"id": "short", "prompt": "ab"}', '{"id": "long", "prompt": "' + "x" * 40 + '"}',
             "{not json", '{"id": "mid", "prompt": "' + "y" * 10 + '"}',
             '{"id": "bad", "prompt": "z", "max_tokens": -1}']
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = str(tmp_path / "out.jsonl")
    s = run_job(BatchConfig(input=inp, output=out), LIMITS, fake_executor)
    assert "5/5" in capsys.readouterr().err  # the progress bar
    rows = read_rows(out)
    assert [r["id"] for r in rows] == [None, "bad", "long", "mid", "short"]
    assert "line 3" in rows[0]["error"] and rows[0]["line"] == 3
    assert "line 5: max_tokens must be >= 1" in rows[1]["error"]
    assert (s.rows, s.ok, s.failed, s.prompt_tokens, s.all_ok) == (5, 3, 2, 52, False)

    # Resume: nothing left to run; the earlier failures still fail the job.
    s2 = run_job(BatchConfig(input=inp, output=out, resume=True), LIMITS, fake_executor)
    assert capsys.readouterr().err == ""  # no bar for nothing to do
    assert (s2.resumed, s2.ok, s2.failed, s2.failed_before) == (5, 0, 0, 2)
    assert not s2.all_ok and len(read_rows(out)) == 5

    # A partial output (the job was killed after two rows) is completed exactly once.
    with open(out, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows[2:4]) + '{"id": "sh')
    s3 = run_job(BatchConfig(input=inp, output=out, resume=True, progress=False), LIMITS,
                 fake_executor)
    assert (s3.resumed, s3.ok, s3.failed) == (2, 1, 2)
    assert sorted(map(str, (r["id"] for r in read_rows(out)))) == sorted(
        ["None", "bad", "long", "mid", "short"])


def test_parts_merge_in_input_order(tmp_path):
    lines = [json.dumps({"id": f"r{i}", "prompt": "x" * (i + 1)}) for i in range(12)]
    lines.insert(5, "not json")
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = str(tmp_path / "out.jsonl")
    for p in range(2):
        run_job(BatchConfig(input=inp, output=part_path(out, p, 2), process_id=p,
                            num_processes=2, progress=False), LIMITS, fake_executor)
    part_ids = [{r["id"] for r in read_rows(part_path(out, p, 2))} for p in range(2)]
    assert part_ids[0] and part_ids[1] and not part_ids[0] & part_ids[1]
    assert merge(inp, out, 2) == (13, 1)
    rows = read_rows(out)
    assert [r.get("line") or r["id"] for r in rows] == [
        *(f"r{i}" for i in range(5)), 6, *(f"r{i}" for i in range(5, 12))]
    assert [r["text"] for r in rows if "text" in r] == [str(i + 1) for i in range(12)]


def test_merge_names_what_is_missing(tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps({"id": i, "prompt": "x"})
                                              for i in range(6)])
    out = str(tmp_path / "out.jsonl")
    with pytest.raises(FileNotFoundError, match=r"part-0-of-2 is missing: run process 0"):
        merge(inp, out, 2)
    for p in range(2):
        run_job(BatchConfig(input=inp, output=part_path(out, p, 2), process_id=p,
                            num_processes=2, progress=False), LIMITS, fake_executor)
    rows = read_rows(part_path(out, 1, 2))
    with open(part_path(out, 1, 2), "w") as f:  # as if process 1 was killed after one row
        f.write(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match=r"have no result yet .*process 1.*--resume"):
        merge(inp, out, 2)
    assert not (tmp_path / "out.jsonl").exists()


def test_retry_failed_runs_error_rows_again_once(tmp_path, capsys):
    lines = ['{"id": "a", "prompt": "ab"}', "{not json", '{"id": "b", "prompt": "z", '
             '"max_tokens": -1}', '{"id": "c", "prompt": "xyz"}']
    inp = tmp_path / "in.jsonl"
    write_lines(inp, lines)
    out = str(tmp_path / "out.jsonl")
    s = run_job(BatchConfig(input=str(inp), output=out, progress=False), LIMITS, fake_executor)
    assert (s.ok, s.failed) == (2, 2)
    with pytest.raises(ValueError, match="retry_failed .* needs resume"):
        BatchConfig(input=str(inp), output=out, retry_failed=True)
    # The user fixes the two bad lines and runs the failed rows again.
    lines[1], lines[2] = '{"id": "fixed", "prompt": "abcd"}', '{"id": "b", "prompt": "z"}'
    write_lines(inp, lines)
    s2 = run_job(BatchConfig(input=str(inp), output=out, resume=True, retry_failed=True,
                             progress=False), LIMITS, fake_executor)
    assert "running 2 failed rows again" in capsys.readouterr().err
    assert (s2.resumed, s2.ok, s2.failed, s2.failed_before, s2.all_ok) == (2, 2, 0, 0, True)
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == ["a", "b", "c", "fixed"]
    assert not any("error" in r for r in rows)
    assert not (tmp_path / "out.jsonl.retrying").exists()
