"""`jetserve batch` as users run it: real subprocesses on the random tiny model.

One uninterrupted run is the reference. A second run is SIGKILLed part-way (a torn last
line is added, as a kill during a write leaves), then resumed: every id is in the output
exactly once and every row equals the reference's. Two independent processes
(`--num-processes 2 --process-id I`) write parts that `--merge` joins, in input order,
into the reference's rows. Timing fields differ between runs and are left out.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from jetserve.batch.journal import part_path, read_rows
from tests.xla import xla_flags

pytestmark = pytest.mark.slow  # about 2 minutes of subprocesses on 2 busy cores

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
MODEL_ARGS = ["--model", "random:tiny", "--max-seq-len", "64", "--max-concurrent-decodes",
              "4", "--devices", "1", "--max-tokens", "12"]
TIMING = ("ttft", "latency")
BAD_LINES = 2


def input_lines() -> list[str]:
    rng = np.random.default_rng(0)
    rows = [{"id": f"g{i}", "prompt_ids": rng.integers(1, 256, size=int(n)).tolist()}
            for i, n in enumerate(rng.integers(2, 40, size=40))]
    rows[3]["max_tokens"] = 20
    shared = rng.integers(1, 256, size=20).tolist()  # a few-shot style common prefix
    for r in rows[30:]:
        r["prompt_ids"] = shared + r["prompt_ids"][:8]
    rows[5].update(logprobs=2)
    rows += [{"id": 100 + i, "prompt": p, "temperature": 0.9, "seed": i}
             for i, p in enumerate(["Once upon a time", "The answer is"])]
    rows += [{"id": f"s{i}", "context": c, "continuation": x, "metadata": {"q": i}}
             for i, (c, x) in enumerate([("The capital of France is", " Paris"),
                                         ("2 + 2 =", " 4"), ("abc", "def"), ("x ", "y")])]
    lines = [json.dumps(r) for r in rows]
    lines.insert(7, '{"id": "broken", "prompt": ')  # not JSON
    lines.insert(20, json.dumps({"id": "typo", "prompt": "hi", "temprature": 1.0}))
    return lines


def batch(*args: str, env: dict | None = None) -> subprocess.Popen:
    """A `jetserve batch` subprocess; its stderr goes to a file (a pipe that nobody reads
    while another process is awaited could fill and stall it)."""
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by finish())
    p = subprocess.Popen([sys.executable, "-m", "jetserve", "batch", *args], cwd=ROOT,
                         env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    p.log = log
    return p


def finish(p: subprocess.Popen) -> tuple[int, str]:
    p.wait(timeout=600)
    p.log.seek(0)
    err = p.log.read()
    p.log.close()
    return p.returncode, err


def without_timing(rows: list[dict]) -> dict:
    """id (or line, for rows without a usable id) -> row without its timing fields."""
    return {json.dumps(r["line"] if "line" in r else r["id"]):
            {k: v for k, v in r.items() if k not in TIMING} for r in rows}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    inp = d / "in.jsonl"
    lines = input_lines()
    inp.write_text("\n".join(lines) + "\n")
    out, summary = d / "ref.jsonl", d / "summary.json"
    rc, err = finish(batch("--input", str(inp), "--output", str(out), "--summary",
                           str(summary), *MODEL_ARGS))
    return dict(dir=d, input=str(inp), n=len(lines), rc=rc, err=err, rows=read_rows(out),
                summary=json.loads(summary.read_text()))


def test_uninterrupted_run(job):
    rows, err = job["rows"], job["err"]
    assert job["rc"] == 1, err  # the two bad rows fail the job; the rest ran
    assert len(rows) == job["n"] == len(without_timing(rows))
    errors = {r["id"]: r["error"] for r in rows if "error" in r}
    assert len(errors) == BAD_LINES
    assert "line 8: the line is not valid JSON" in errors[None]
    assert "unknown field(s) ['temprature']" in errors["typo"]
    by_id = {r["id"]: r for r in rows}
    for i in range(40):
        r = by_id[f"g{i}"]
        assert r["finish_reason"] in ("stop", "length") and r["text"] is not None
        assert 1 <= r["completion_tokens"] == len(r["token_ids"]) <= (20 if i == 3 else 12)
        assert r["ttft"] <= r["latency"]
    assert len(by_id["g5"]["logprobs"]) == len(by_id["g5"]["top_logprobs"]) == len(
        by_id["g5"]["token_ids"])
    assert "logprobs" not in by_id["g4"]
    s0 = by_id["s0"]
    assert s0["num_tokens"] == 6 and s0["logprob"] < 0 and s0["metadata"] == {"q": 0}
    assert isinstance(s0["is_greedy"], bool)
    # Progress bar (requests, tokens/s, ETA) and the summary on stderr, and as JSON.
    assert "tok/s" in err and "<00:00" in err
    s = job["summary"]
    assert (s["rows"], s["ok"], s["failed"], s["resumed"]) == (job["n"], job["n"] - 2, 2, 0)
    assert s["completion_tokens"] == sum(len(r.get("token_ids", ())) for r in rows)
    assert s["tokens_per_s"] > 0 and f"tokens in {s['prompt_tokens']}" in err


def test_sigkill_then_resume_gives_every_id_once_as_uninterrupted(job):
    out = job["dir"] / "killed.jsonl"
    p = batch("--input", job["input"], "--output", str(out), "--no-progress", *MODEL_ARGS)
    try:
        while p.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= BAD_LINES + 10:
                p.send_signal(signal.SIGKILL)
                break
            time.sleep(0.02)
        finish(p)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -signal.SIGKILL
    written = len(read_rows(str(out)))
    assert BAD_LINES + 10 <= written < job["n"]  # killed part-way
    with open(out, "ab") as f:  # a kill in the middle of a write leaves a torn line
        f.write(b'{"id": "g1", "text": "tor')

    with pytest.raises(subprocess.CalledProcessError):  # no --resume: refuses to overwrite
        subprocess.run([sys.executable, "-m", "jetserve", "batch", "--input", job["input"],
                        "--output", str(out), *MODEL_ARGS], cwd=ROOT, check=True,
                       capture_output=True)
    rc, err = finish(batch("--input", job["input"], "--output", str(out), "--resume",
                           "--no-progress", *MODEL_ARGS))
    assert rc == 1, err
    assert "removed a torn last line" in err
    assert f"({written} done before this run" in err
    rows = read_rows(str(out))
    assert len(rows) == job["n"]  # every id exactly once
    assert without_timing(rows) == without_timing(job["rows"])


def test_two_processes_merged_equal_one(job):
    """(Also with the prefix cache on: ten rows share a 20-token prefix.)"""
    out = str(job["dir"] / "two.jsonl")
    procs = [batch("--input", job["input"], "--output", out, "--num-processes", "2",
                   "--process-id", str(i), "--no-progress", "--prefix-cache-hbm-mb", "1",
                   *MODEL_ARGS) for i in range(2)]
    results = [finish(p) for p in procs]
    parts = [read_rows(part_path(out, i, 2)) for i in range(2)]
    assert all(parts) and sum(map(len, parts)) == job["n"]
    assert [rc for rc, _ in results] == [1 if any("error" in r for r in part) else 0
                                         for part in parts], results
    rc, err = finish(batch("--merge", "--input", job["input"], "--output", out,
                           "--num-processes", "2"))
    assert rc == 1 and f"{job['n']} rows (2 errors) from 2 parts" in err
    merged = read_rows(out)
    assert without_timing(merged) == without_timing(job["rows"])
    ids = [json.dumps(r["line"] if "line" in r else r["id"]) for r in merged]
    want = []
    for n, line in enumerate(input_lines(), 1):
        try:
            want.append(json.dumps(json.loads(line)["id"]))
        except json.JSONDecodeError:
            want.append(json.dumps(n))
    assert ids == want  # input order


def lock_step_lines() -> list[str]:
    """Greedy rows with their own max_tokens, stop strings and stop token ids, log-probs,
    scoring rows, and two rows far apart sharing a 40-token prefix (2 prefix-cache blocks
    and a half)."""
    rng = np.random.default_rng(1)
    rows = [{"id": i, "prompt_ids": rng.integers(1, 256, size=int(n)).tolist(),
             "max_tokens": int(m)}
            for i, (n, m) in enumerate(zip(rng.integers(2, 30, size=12),
                                           rng.integers(1, 16, size=12), strict=True))]
    rows[0].update(logprobs=True)
    rows[1].update(stop_token_ids=list(range(128, 256)), max_tokens=16)
    # Byte tokens >= 128 alone decode to U+FFFD, which the random model emits often.
    rows[2].update(prompt="Hello", stop=["\ufffd"], max_tokens=16)
    del rows[2]["prompt_ids"]
    rows += [{"id": "s", "context": "The capital of France is", "continuation": " Paris"},
             {"id": "t", "context_ids": [5, 6, 7], "continuation_ids": [8, 9]}]
    shared = rng.integers(1, 256, size=40).tolist()
    rows.insert(6, {"id": "p1", "prompt_ids": shared + [3, 4], "max_tokens": 6})
    rows.append({"id": "p2", "prompt_ids": shared + [5], "max_tokens": 6})
    return [json.dumps(r) for r in rows]


def test_coordinator_lock_step_equals_one_process(tmp_path):
    """Two processes sharing one model sharded over 2 x 4 devices (jax.distributed, gloo on
    127.0.0.1; the lock-step orchestrator, with the prefix cache on every process) write
    what one process on 8 devices without a cache writes; process 0 alone reads and
    writes, and --resume skips the rows already there."""
    from tests.sharding.test_multiprocess import _free_port

    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lock_step_lines()) + "\n")
    args = ["--input", str(inp), "--model", "random:tiny", "--sharding", "tp_kv_batch",
            "--max-seq-len", "64", "--max-concurrent-decodes", "4", "--no-progress"]
    ref = tmp_path / "one.jsonl"
    rc, err = finish(batch(*args, "--output", str(ref), "--devices", "8"))
    assert rc == 0, err
    want = read_rows(str(ref))
    by_id = {r["id"]: r for r in want}
    assert by_id[1]["finish_reason"] == "stop" and by_id[1]["stop_reason"] >= 128
    assert by_id[1]["token_ids"][-1] == by_id[1]["stop_reason"]
    assert by_id[2]["finish_reason"] == "stop" and by_id[2]["stop_reason"] == "\ufffd"
    assert "\ufffd" not in by_id[2]["text"]
    out = tmp_path / "two.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in want[:5]))  # as a killed run left
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS=xla_flags(4))
    procs = [batch(*args, "--output", str(out), "--resume", "--coordinator",
                   f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
                   "--prefix-cache-hbm-mb", "1", env=env)
             for i in range(2)]
    results = [finish(p) for p in procs]
    for i, (rc, err) in enumerate(results):
        if rc != 0:  # gloo prints a line per communicator; what matters is the rest
            tail = "\n".join(x for x in err.splitlines() if "[Gloo]" not in x)[-4000:]
            pytest.fail(f"process {i} exited with {rc}:\n{tail}")
    assert "(5 done before this run" in results[0][1]
    got = read_rows(str(out))
    assert len(got) == len(want)
    assert without_timing(got) == without_timing(want)
    assert not list(tmp_path.glob("two.jsonl.part-*"))  # one output, written by process 0
