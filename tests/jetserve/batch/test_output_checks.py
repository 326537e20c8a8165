"""What `jetserve batch` resumes from is verified, and an output that cannot be written
ends the job with one line (exit 2) and leaves it resumable.

Corrupt outputs (a row without a result, a repeated row, a row for an id not in the
input) are refused naming the line; --repair rewrites them to their valid rows. The CLI
checks run in-process through jetserve.cli.main where they end before a model loads, and
as subprocesses where they need one (or could crash the process, as a taken coordinator
port did)."""

import errno
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys

import pytest

from jetserve.batch.journal import Journal, OutputError, read_rows
from jetserve.batch.runner import BatchConfig, run_job
from jetserve.cli import main
from tests.jetserve.batch.test_journal import LIMITS, fake_executor, write_lines

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
MODEL_ARGS = ["--model", "random:tiny", "--max-seq-len", "64", "--max-concurrent-decodes",
              "2", "--devices", "1", "--max-tokens", "2", "--no-progress"]
N = 8


def job_files(tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps({"id": f"r{i}", "prompt": "x" * (i + 1)})
                                              for i in range(N)])
    out = str(tmp_path / "out.jsonl")
    run_job(BatchConfig(input=inp, output=out, progress=False), LIMITS, fake_executor)
    return inp, out


def lines_of(path) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def corrupt(out, how: str) -> int:
    """Damages the finished output as `how` says; returns the bad line's number."""
    lines = lines_of(out)
    if how == "no result":  # a middle row cut down to its id: its result is lost
        lines[3] = json.dumps({"id": json.loads(lines[3])["id"]})
        bad = 4
    elif how == "repeated":
        lines.insert(5, lines[2])
        bad = 6
    else:  # "unknown id"
        lines.insert(2, json.dumps({"id": "stranger", "text": "?", "token_ids": [1]}))
        bad = 3
    write_lines(pathlib.Path(out), lines)
    return bad


REASONS = {"no result": "has no result (none of the fields text, token_ids, logprob, error)",
           "repeated": "repeats id 'r",
           "unknown id": "is for id 'stranger', which is not a row of the input"}


@pytest.mark.parametrize("how", list(REASONS))
def test_a_corrupt_output_is_refused_then_repaired(tmp_path, how):
    inp, out = job_files(tmp_path)
    bad = corrupt(out, how)
    before = open(out, "rb").read()
    cfg = BatchConfig(input=inp, output=out, resume=True, progress=False)
    with pytest.raises(ValueError, match=rf":{bad} {re.escape(REASONS[how])}.*--resume --repair"):
        run_job(cfg, LIMITS, fake_executor)
    assert open(out, "rb").read() == before  # a refused file is left as it is

    s = run_job(BatchConfig(input=inp, output=out, resume=True, repair=True, progress=False),
                LIMITS, fake_executor)
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == [f"r{i}" for i in range(N)]  # each id once
    assert all(r["text"] == str(int(r["id"][1:]) + 1) for r in rows)  # with its result
    assert (s.resumed, s.ok) == ((N - 1, 1) if how == "no result" else (N, 0))
    assert not os.path.exists(out + ".repairing")


def test_repair_keeps_the_first_valid_row_of_each_id(tmp_path):
    inp, out = job_files(tmp_path)
    lines = lines_of(out)
    first = json.loads(lines[0])
    later = dict(first, text="later copy")
    lines[1:1] = ["not json", json.dumps({"id": "r9", "text": ""}), json.dumps(later)]
    write_lines(pathlib.Path(out), lines)
    with Journal(out, resume=True, repair=True, expected={f'"r{i}"' for i in range(N)}) as j:
        assert len(j.repaired) == 3 and j.done == {f'"r{i}"': True for i in range(N)}
    assert lines_of(out) == [lines[0], *lines[4:]]


def test_cli_refuses_a_corrupt_output_before_loading_a_model(tmp_path, capsys):
    inp, out = job_files(tmp_path)
    bad = corrupt(out, "no result")
    rc = main(["batch", "--input", inp, "--output", out, "--resume", *MODEL_ARGS])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and f"{out}:{bad} has no result" in err and "--repair" in err
    rc = main(["batch", "--input", inp, "--output", out, "--repair", *MODEL_ARGS])
    assert rc == 2 and "--repair continues a job: add --resume" in capsys.readouterr().err


def test_output_equal_to_input_is_refused(tmp_path, capsys):
    inp, _ = job_files(tmp_path)
    os.symlink(inp, tmp_path / "link.jsonl")
    os.link(inp, tmp_path / "hard.jsonl")
    before = open(inp, "rb").read()
    for output, extra in ((inp, ["--resume"]), (str(tmp_path / "link.jsonl"), []),
                          (str(tmp_path / "hard.jsonl"), ["--resume"]),
                          (os.path.relpath(inp), [])):
        rc = main(["batch", "--input", inp, "--output", output, *extra, *MODEL_ARGS])
        err = capsys.readouterr().err
        assert rc == 2 and "is the same file as --input" in err, (output, err)
    rc = main(["batch", "--merge", "--input", inp, "--output", inp, "--num-processes", "1"])
    assert rc == 2 and "is the same file as --input" in capsys.readouterr().err
    assert open(inp, "rb").read() == before


def test_a_full_disk_stops_the_job_resumable(tmp_path, monkeypatch):
    """The disk fills in the middle of an append: part of it is written, then ENOSPC.
    The append is cut off, the job stops with the path named, and --resume finishes."""
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps({"id": i, "prompt": "x" * (i + 1)})
                                              for i in range(N)])
    out = str(tmp_path / "out.jsonl")
    real_write = os.write
    journal_fds: set[int] = set()
    real_open = os.open

    def tracking_open(path, flags, *a, **k):
        fd = real_open(path, flags, *a, **k)
        if str(path) == out:
            journal_fds.add(fd)
        return fd

    calls = {"n": 0}

    def filling_write(fd, data):
        if fd not in journal_fds:
            return real_write(fd, data)
        calls["n"] += 1
        if calls["n"] < 4:
            return real_write(fd, data)
        if calls["n"] == 4:  # the disk has room for half of this append
            return real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "open", tracking_open)
    monkeypatch.setattr(os, "write", filling_write)
    with pytest.raises(OutputError, match=rf"cannot write {out}: No space left on device "
                                          r"\(ENOSPC\).*--resume"):
        run_job(BatchConfig(input=inp, output=out, progress=False), LIMITS, fake_executor)
    monkeypatch.undo()
    assert len(read_rows(out)) == 3  # the complete appends; nothing half-written
    s = run_job(BatchConfig(input=inp, output=out, resume=True, progress=False), LIMITS,
                fake_executor)
    assert (s.resumed, s.ok) == (3, N - 3)
    assert sorted(r["id"] for r in read_rows(out)) == list(range(N))


def test_a_read_only_directory_is_one_line(tmp_path, monkeypatch, capsys):
    inp, _ = job_files(tmp_path)
    ro = tmp_path / "ro"
    real_open = os.open

    def read_only_open(path, flags, *a, **k):
        if str(path).startswith(str(ro)) and flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", read_only_open)
    rc = main(["batch", "--input", inp, "--output", str(ro / "out.jsonl"), *MODEL_ARGS])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err == (f"jetserve batch: error: cannot open {ro / 'out.jsonl'} for writing: "
                   "Read-only file system (EROFS)\n")


def chattr(flag: str, path) -> bool:
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0


def test_an_immutable_directory_even_for_root(tmp_path, capsys):
    """A real unwritable directory (chattr +i stops root too, where chmod does not): a
    new output cannot be created, and --repair cannot rewrite one; both are one line,
    and the output is left as it was."""
    inp, out = job_files(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir()
    kept = str(locked / "out.jsonl")
    shutil.copy(out, kept)
    corrupt(kept, "repeated")
    before = open(kept, "rb").read()
    if not chattr("+i", locked):
        pytest.skip("chattr +i is not available here")
    try:
        for output, extra in ((str(locked / "new.jsonl"), []),
                              (kept, ["--resume", "--repair"])):
            rc = main(["batch", "--input", inp, "--output", output, *extra, *MODEL_ARGS])
            err = capsys.readouterr().err
            assert rc == 2 and err.count("\n") == 1 and output in err, err
        assert open(kept, "rb").read() == before
    finally:
        chattr("-i", locked)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jetserve", "batch", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # one model load in a subprocess
def test_cli_disk_full_is_one_line_and_exit_2(tmp_path):
    """/dev/full: every write fails with ENOSPC."""
    inp, _ = job_files(tmp_path)
    p = cli("--input", inp, "--output", "/dev/full", *MODEL_ARGS)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(
        "jetserve batch: error: cannot write /dev/full: No space left on device (ENOSPC)")
    assert "Traceback" not in p.stderr


def test_cli_taken_coordinator_port_is_one_line(tmp_path):
    """Process 0 hosts the coordinator: a taken port used to crash it (SIGSEGV)."""
    inp, _ = job_files(tmp_path)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        p = cli("--input", inp, "--output", str(tmp_path / "o.jsonl"), "--coordinator",
                f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0",
                *MODEL_ARGS)
    assert p.returncode == 2, p.stderr
    assert p.stderr == (f"jetserve batch: error: --coordinator 127.0.0.1:{port}: port {port} "
                        "is already in use by another program; process 0 hosts the "
                        "coordinator there: choose a free port (the same for every "
                        "process)\n")
