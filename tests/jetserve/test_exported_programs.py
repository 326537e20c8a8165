"""The exported-program cache (engines/exported_programs.py): a start on a cache that a
previous process filled loads prefill, insert and generate without tracing them and
produces the same greedy tokens as a start that traced them (and as the cache off); a
changed key component is a miss; a corrupt entry is a miss with a warning; `off` writes
nothing. Every start is a fresh process."""

import json
import os
import subprocess
import sys

# One start: builds the engine (random:tiny), runs a prompt through prefill, insert and
# a few generate steps, and prints the tokens, the trace counts and the cache's stats.
START = r"""
import json, sys
import numpy as np
from jetserve import compile_cache
cache, max_seq_len, other_sources = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
compile_cache.enable(cache)
from engines import exported_programs
if other_sources:  # as if a source file of the programs had changed
    exported_programs.source_hash = lambda: "another version of the sources"
from engines.engine_config import EngineConfig
from jetserve.model_loading import build_engine
engine = build_engine("random:tiny", engine_config=EngineConfig(
    max_seq_len=max_seq_len, max_prefill_length=max_seq_len, max_concurrent_decodes=2))
params = engine.load_params()
prefix, first = engine.prefill(params, np.array([3, 1, 4, 1, 5]), 5)
state = engine.insert(prefix, engine.init_decode_state(), 0)
tokens = [int(np.asarray(first.data)[0, 0])]
for _ in range(4):
    state, result = engine.generate(params, state)
    tokens.append(int(np.asarray(result.data)[0, 0]))
print(json.dumps({"tokens": tokens, "traces": engine.traces,
                  "stats": exported_programs.stats}))
"""
CACHED = ("prefill", "insert", "generate")


def _start(cache, max_seq_len=64, other_sources=False):
    r = subprocess.run([sys.executable, "-c", START, str(cache), str(max_seq_len),
                        "1" if other_sources else "0"],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def _entries(cache):
    d = cache / "exported"
    return sorted(os.listdir(d)) if d.exists() else []


def test_a_warm_start_traces_nothing_and_gives_the_same_tokens(tmp_path):
    off, _ = _start("off")
    assert not any(off["stats"].values())
    cold, _ = _start(tmp_path)
    assert cold["stats"]["exports"] == 3 and cold["stats"]["hits"] == 0
    assert all(cold["traces"][n] == 1 for n in CACHED), cold["traces"]
    assert cold["stats"]["json_writes"] > 0  # the traced parameter shapes too
    assert len([n for n in _entries(tmp_path) if n.endswith(".exported")]) == 3
    warm, _ = _start(tmp_path)
    assert warm["stats"] == {"hits": 3, "exports": 0, "errors": 0, "json_writes": 0,
                             "json_hits": cold["stats"]["json_writes"]}
    assert all(warm["traces"][n] == 0 for n in CACHED), warm["traces"]
    assert warm["tokens"] == cold["tokens"] == off["tokens"]


def test_a_changed_key_component_is_a_miss(tmp_path):
    cold, _ = _start(tmp_path)
    other_config, _ = _start(tmp_path, max_seq_len=128)
    assert other_config["stats"]["hits"] == 0 and other_config["stats"]["exports"] == 3
    assert all(other_config["traces"][n] == 1 for n in CACHED)
    other_sources, _ = _start(tmp_path, other_sources=True)
    assert other_sources["stats"]["hits"] == 0 and other_sources["stats"]["exports"] == 3
    assert other_sources["tokens"] == cold["tokens"]
    assert len([n for n in _entries(tmp_path) if n.endswith(".exported")]) == 9


def test_a_corrupt_entry_is_a_miss_with_a_warning(tmp_path):
    cold, _ = _start(tmp_path)
    entries = _entries(tmp_path)
    for name in entries:
        path = tmp_path / "exported" / name
        path.write_bytes(path.read_bytes()[:100] + b"\x00garbage")
    torn, err = _start(tmp_path)
    assert torn["stats"]["errors"] == len(entries) and torn["stats"]["hits"] == 0
    assert err.count("is unreadable") == len(entries), err
    assert all(torn["traces"][n] == 1 for n in CACHED)
    assert torn["tokens"] == cold["tokens"]
    again, _ = _start(tmp_path)  # the miss wrote the entries back whole
    assert again["stats"]["hits"] == 3 and not again["stats"]["errors"]


def test_compile_cache_off_writes_nothing(tmp_path):
    env = dict(os.environ, JETSERVE_COMPILE_CACHE=str(tmp_path / "env"),
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax"))
    r = subprocess.run([sys.executable, "-m", "jetserve", "generate", "--model", "random:tiny",
                        "--prompt-ids", "3,1,4", "--max-tokens", "2", "--ignore-eos",
                        "--max-seq-len", "64", "--compile-cache", "off", "--json"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["token_ids"]
    assert os.listdir(tmp_path) == []


def _generate(cache):
    """`jetserve generate` of a prompt longer than a prefill (chunks continue a prefix
    through the donating prefill, whose prefix argument shares buffers with another)."""
    r = subprocess.run([sys.executable, "-m", "jetserve", "generate", "--model", "random:tiny",
                        "--max-seq-len", "64", "--max-prefill-length", "16", "--json",
                        "--max-tokens", "6", "--ignore-eos", "--compile-cache", str(cache),
                        "--prompt-ids", ",".join(map(str, range(1, 40)))],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert r.returncode == 0, r.stderr
    assert "donate" not in r.stderr, r.stderr  # XLA refuses a doubly used donated buffer
    return json.loads(r.stdout.strip().splitlines()[-1])["token_ids"]


def test_chunked_prompts_donate_only_what_the_program_reads(tmp_path):
    off = _generate("off")
    assert _generate(tmp_path) == off  # cold: exported, then run
    assert _generate(tmp_path) == off  # warm: loaded
