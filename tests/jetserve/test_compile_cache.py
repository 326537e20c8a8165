"""The persistent compile cache: where it lives, and that a second `jetserve generate`
on the same cache directory reads its programs back (the same tokens), while torn
entries and `off` cost compiles, never a failure."""

import json
import os
import re
import subprocess
import sys

import pytest

from jetserve import cli, compile_cache

LINE = re.compile(r"jetserve generate: compiled (\d+) programs? in [\d.]+ s \((\d+) from cache\)")
GENERATE = ["generate", "--model", "random:tiny", "--prompt-ids", "3,1,4,1,5",
            "--max-tokens", "3", "--ignore-eos", "--max-seq-len", "64", "--json"]


def test_the_flag_then_the_environment_then_the_default(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    home = os.path.expanduser("~")
    assert compile_cache.resolve(None) == os.path.join(home, ".cache", "jetserve", "xla")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert compile_cache.resolve(None) == str(tmp_path / "jax")
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.resolve(None) == str(tmp_path / "env")
    assert compile_cache.resolve(str(tmp_path / "flag")) == str(tmp_path / "flag")
    assert compile_cache.resolve("OFF") is None
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.resolve(None) is None
    with pytest.raises(ValueError, match="--compile-cache"):
        compile_cache.resolve(" ")


def test_every_engine_command_takes_the_flag():
    parser = cli.build_parser()
    for argv in (["generate", "--prompt", "x"], ["serve"], ["batch", "--input", "i", "--output", "o"],
                 ["bench", "decode"], ["bench", "capacity"]):
        args, _ = parser.parse_known_args([*argv, "--compile-cache", "off"])
        assert args.compile_cache == "off", argv


def test_a_directory_that_cannot_be_made_is_an_error_naming_the_flag(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli.main([*GENERATE, "--compile-cache", str(blocker / "cache")]) == 2
    err = capsys.readouterr().err
    assert "--compile-cache: cannot create" in err and str(blocker) in err


def _generate(*extra: str, env: dict | None = None) -> tuple[list[int], int, int]:
    r = subprocess.run([sys.executable, "-m", "jetserve", *GENERATE, *extra],
                       env=dict(os.environ, **(env or {})), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    m = LINE.search(r.stderr)
    assert m, r.stderr
    row = json.loads(r.stdout.strip().splitlines()[-1])
    return row["token_ids"], int(m.group(1)), int(m.group(2))


@pytest.mark.slow
def test_a_restart_on_a_warm_cache_compiles_nothing_new(tmp_path):
    cache = str(tmp_path / "cache")
    tokens, programs, hits = _generate("--compile-cache", cache)
    assert programs > 0 and hits == 0  # a fresh directory: everything compiled
    entries = os.listdir(cache)
    assert entries
    again, programs2, hits2 = _generate("--compile-cache", cache)
    assert again == tokens
    assert hits2 == programs2 == programs  # every program read back, none compiled
    # Torn entries (a writer killed mid-way, or another jax's files) are misses, not errors.
    for name in entries:
        if name == "exported":  # the traced programs (tests/jetserve/test_exported_programs.py)
            continue
        with open(os.path.join(cache, name), "r+b") as f:
            f.truncate(max(1, os.path.getsize(f.name) // 2))
    torn, _, hits3 = _generate("--compile-cache", cache)
    assert torn == tokens and hits3 == 0


@pytest.mark.slow
def test_two_processes_filling_one_cache_at_once(tmp_path):
    cache = str(tmp_path / "cache")
    cmd = [sys.executable, "-m", "jetserve", *GENERATE, "--compile-cache", cache]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    rows = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert rows[0]["token_ids"] == rows[1]["token_ids"]
    # jax writes an entry in place: two writers racing on one may leave it torn, a miss
    # (never an error); the rest read back.
    again, _, hits = _generate("--compile-cache", cache)
    assert again == rows[0]["token_ids"] and hits > 0


@pytest.mark.slow
def test_off_writes_nothing(tmp_path):
    jax_dir = tmp_path / "jax"
    jax_dir.mkdir()
    _, programs, hits = _generate(env={compile_cache.ENV: "off",
                                       "JAX_COMPILATION_CACHE_DIR": str(jax_dir)})
    assert programs > 0 and hits == 0
    assert os.listdir(jax_dir) == []
