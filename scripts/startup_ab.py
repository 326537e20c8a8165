"""`jetserve bench startup` for two checkouts of this repository, taking turns, and where
a warm start's imports go in each.

    git archive <commit> | (mkdir -p /tmp/base && tar -x -C /tmp/base)
    python scripts/startup_ab.py /tmp/base . --rounds 3 [--model random:llama-156m]
    python scripts/startup_ab.py /tmp/base . --imports 3      # the import-time breakdown

Each start runs in its checkout's directory with PYTHONPATH pointing at it, so `python -m
jetserve` imports that checkout; this checkout's jetserve/bench/startup.py times both (a
cold start on a new cache directory, then a warm one, wall and CPU seconds). Rounds
alternate A B, B A, ... so the other load on the machine hits both alike; every line printed
is one JSON with the side, the round and the 1-minute load average before and after. `--imports N` instead runs a warm `jetserve
generate --max-tokens 1` N times a side under `python -X importtime` and prints, per side,
the median seconds of each top-level package that the start imports (the cumulative time of
its outermost import), largest first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile

from jetserve.bench.startup import StartupConfig, command, one_start

_IMPORT_LINE = re.compile(r"import time:\s+\d+ \|\s+(\d+) \| ( *)(\S+)")


def _env(tree: str) -> dict:
    return dict(os.environ, PYTHONPATH=os.path.abspath(tree))


def bench(tree: str, model: str | None) -> dict:
    """A cold then a warm start of `tree`'s `jetserve generate`, timed by this checkout's
    jetserve/bench/startup.py (so both sides are measured alike, CPU seconds included)."""
    cfg = StartupConfig(model=model)
    with tempfile.TemporaryDirectory(prefix="startup-ab-") as cache_dir:
        cold, warm = (one_start(cfg, cache_dir, label, cwd=tree, env=_env(tree))
                      for label in ("cold", "warm"))
    return {"model": model or "bundled", "cold": cold, "warm": warm,
            "warm_over_cold": round(warm["first_token_s"] / cold["first_token_s"], 3),
            "cpu_warm_over_cold": round(warm["cpu_s"] / cold["cpu_s"], 3),
            "load_after": round(os.getloadavg()[0], 2)}


def import_seconds(tree: str, model: str | None, cache_dir: str) -> dict[str, float]:
    """One warm start under -X importtime: seconds per top-level package, outermost
    imports only (a package first imported inside another counts with that one)."""
    cfg = StartupConfig(model=model)
    cmd = command(cfg, cache_dir)
    r = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], cwd=tree, env=_env(tree),
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"{tree}: generate exited {r.returncode}:\n{r.stderr[-2000:]}")
    out: dict[str, float] = {}
    for m in map(_IMPORT_LINE.match, r.stderr.splitlines()):
        if m and not m.group(2):  # depth 0: an outermost import
            top = m.group(3).split(".")[0]
            out[top] = out.get(top, 0.0) + int(m.group(1)) / 1e6
    out["(all imports)"] = sum(out.values())
    return out


def imports(trees: dict[str, str], model: str | None, n: int) -> None:
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in trees}
    with tempfile.TemporaryDirectory(prefix="startup-ab-") as tmp:
        caches = {side: os.path.join(tmp, side) for side in trees}
        for side, tree in trees.items():  # fills each side's cache: the runs below are warm
            import_seconds(tree, model, caches[side])
        for i in range(n):
            for side in (list(trees) if i % 2 == 0 else list(trees)[::-1]):
                runs[side].append(import_seconds(trees[side], model, caches[side]))
    for side, rows in runs.items():
        names = {k for row in rows for k in row}
        med = {k: statistics.median(row.get(k, 0.0) for row in rows) for k in names}
        top = sorted(med.items(), key=lambda kv: -kv[1])[:16]
        print(json.dumps({"side": side, "tree": trees[side], "runs": n,
                          "median_import_s": {k: round(v, 3) for k, v in top}}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tree_a")
    p.add_argument("tree_b")
    p.add_argument("--model", default=None, help="default: the bundled model")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--imports", type=int, default=0, metavar="N",
                   help="the import-time breakdown over N warm starts a side instead")
    args = p.parse_args()
    if args.rounds < 1 or args.imports < 0:
        raise SystemExit(f"--rounds must be >= 1 and --imports >= 0, got {args.rounds} and "
                         f"{args.imports}")
    trees = {"A": args.tree_a, "B": args.tree_b}
    if args.imports:
        imports(trees, args.model, args.imports)
        return
    for i in range(args.rounds):
        for side in ("A", "B") if i % 2 == 0 else ("B", "A"):
            load = round(os.getloadavg()[0], 2)
            row = bench(trees[side], args.model)
            print(json.dumps({"side": side, "round": i, "load_before": load, **row}),
                  flush=True)


if __name__ == "__main__":
    main()
