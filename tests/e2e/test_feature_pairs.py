"""Every pair of serving features, each on a real `jetserve serve`: the pairs that
docs/ARCHITECTURE.md ("Feature matrix") marks refused must be refused by name (at start,
or with a 400 naming the field for a request-level feature); every other pair must serve
each request the greedy tokens a reference server gives it.

The matrix is read from the document, so the document and the servers cannot drift. The
reference server holds the LoRA adapter (it serves base, adapter and grammar requests
alike), with int8 KV where the pair has it (int8 KV changes the numbers, so a pair with it
is held to int8 KV's own tokens). Tiny random model, warm-up off: the first requests of
each server compile.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from jetserve.model_loading import RANDOM_MODELS
from tests.e2e.serve_process import wait_listening
from tests.engines import lora_files
from tests.xla import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "ARCHITECTURE.md")
MODEL = "random:tiny"
BASE = ["--model", MODEL, "--max-seq-len", "128", "--max-prefill-length", "32",
        "--max-concurrent-decodes", "4", "--no-warmup", "--host", "127.0.0.1"]
MAX_TOKENS = 8
SHORT = [5, 9, 11, 3, 5, 9]
LONG = [(7 * i + 3) % 250 + 1 for i in range(70)]  # 70 tokens: chunked at 32 or less
SHARED = [(11 * i + 5) % 250 + 1 for i in range(40)]
REGEX = "[a-z]{2,6}"
BIAS = {"17": 4.0, "42": 4.0, "99": -100.0}  # OpenAI's logit_bias: token id -> bias


@dataclasses.dataclass(frozen=True)
class Feature:
    names: tuple[str, ...]  # words a refusal of it says (a flag, a setting), any case
    args: tuple[str, ...] = ()
    adapter_rows: bool = False  # sends requests naming the adapter
    grammar_rows: bool = False  # sends requests with a regex
    bias_rows: bool = False  # sends requests with a logit_bias
    launch: str = "one"  # "one" process, "lockstep" over two, "split" prefill/decode roles
    int8_kv: bool = False
    prefill_role: bool = False  # split roles: its flags go to the prefill worker only


FEATURES: dict[str, Feature] = {
    "paged KV": Feature(("kv_layout", "--kv-layout", "paged"),
                        args=("--kv-layout", "paged", "--page-size", "8", "--num-pages", "96")),
    "int8 KV": Feature(("kv_dtype", "--kv-dtype"), args=("--kv-dtype", "int8"), int8_kv=True),
    # --lora-modules comes with the adapter's path
    "LoRA": Feature(("lora",), adapter_rows=True),
    "n-gram speculative": Feature(("speculative",), args=("--speculative", "ngram:3")),
    "draft speculative": Feature(("speculative", "draft"),
                                 args=("--speculative", "draft:random:tiny:2")),
    "structured output": Feature(("structured_outputs", "structured output"),
                                 grammar_rows=True),
    "logit bias": Feature(("logit_bias",), bias_rows=True),
    "prefix cache": Feature(("prefix cache", "--prefix-cache"),
                            args=("--prefix-cache-hbm-mb", "4"), prefill_role=True),
    "chunked prefill": Feature(("--prefill-chunk", "chunk"), args=("--prefill-chunk", "8")),
    "several processes": Feature(("process",), launch="lockstep"),
    "split roles": Feature(("--role",), launch="split"),
    "scanned layers": Feature(("scan",), args=("--layers", "scan")),
    "several prompts per step": Feature(("prefill_batch", "--prefill-batch"),
                                        args=("--prefill-batch", "2")),
    "mixed steps": Feature(("--scheduling", "mixed"),
                           args=("--scheduling", "mixed", "--kv-layout", "paged",
                                 "--page-size", "8", "--num-pages", "96")),
}


def names_a_feature(text: str, *features: str) -> bool:
    """Whether `text` (a refusal) names one of `features` by a flag or setting of it."""
    return any(n.lower() in text.lower() for f in features for n in FEATURES[f].names)


def matrix() -> dict[frozenset[str], str | None]:
    """{pair: "" (served), the reason it is refused, or None (one setting: the two are
    values of one flag)}, from the document's table: a row and a column per feature, `ok`,
    `no` or `-` in each cell below the diagonal, the reasons listed under the table as
    `- A x B: reason`."""
    text = open(DOC).read()
    start = text.index("## Feature matrix")
    section = text[start:text.index("\n## ", start)]
    table = [r for r in section.splitlines() if r.startswith("|")]
    names = [c.strip() for c in table[0].strip("|").split("|")][1:]
    rows = table[2:]  # after the header and its rule
    reasons = dict(re.findall(r"^- (.+?): (.+)$", section, re.M))
    out = {}
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        a = cells[0]
        for b, cell in zip(names, cells[1:], strict=True):
            if a == b or cell == "":
                continue
            pair = frozenset((a, b))
            if cell == "-":
                out[pair] = None
            elif cell == "no":
                why = reasons.get(f"{a} x {b}") or reasons.get(f"{b} x {a}")
                assert why, f"{a} x {b} is refused in {DOC} with no reason listed"
                out[pair] = why
            else:
                assert cell == "ok", f"{a} x {b}: cell {cell!r} (expected ok or no)"
                out[pair] = ""
    return out


def test_matrix_names_every_pair_of_features():
    m = matrix()
    want = {frozenset(p) for p in itertools.combinations(FEATURES, 2)}
    assert set(m) == want, sorted(map(sorted, set(m) ^ want))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu",
                XLA_FLAGS=xla_flags(1))


def _drain(proc: subprocess.Popen) -> None:
    """Reads what `proc` prints from now on, so its pipe never fills."""
    threading.Thread(target=lambda: list(proc.stdout), daemon=True).start()


class _Refused(Exception):
    pass


class Deployment:
    """One server (or the processes of one), started for a set of features; `refused`
    holds what it printed when it would not start."""

    def __init__(self, names: tuple[str, ...], adapter: str):
        feats = [FEATURES[n] for n in names if n in FEATURES]
        args, prefill_args = list(BASE), []
        for f in feats:
            (prefill_args if f.prefill_role else args).extend(f.args)
        if any(f.adapter_rows for f in feats) or "reference" in names:
            args += ["--lora-modules", f"a1={adapter}"]
        launch = {f.launch for f in feats} - {"one"}
        self.procs: list[subprocess.Popen] = []
        self.ports: dict[str, int] = {}
        self.refused: str | None = None
        try:
            if not launch:
                self._wait(self._spawn(args + prefill_args + [
                    "--interleaved", "--grpc-port", "-1", "--http-port", "0"]))
            elif launch == {"lockstep"}:
                self._lock_step(args + prefill_args + ["--grpc-port", "-1", "--http-port", "0"])
            else:  # split roles; with "lockstep" too, the prefill worker over two processes
                prefill = args + prefill_args + ["--role", "prefill", "--grpc-port", "0"]
                if "lockstep" in launch:
                    self._lock_step(prefill, ready=False)
                else:
                    self._wait(self._spawn(prefill), ready=False)
                worker = self.ports["gRPC"]  # the decode role needs the worker's port
                self._wait(self._spawn(args + ["--role", "decode", "--prefill-workers",
                                               f"127.0.0.1:{worker}", "--grpc-port", "-1",
                                               "--http-port", "0"]))
        except _Refused as e:
            self.refused = str(e)
            self.close()

    def _lock_step(self, argv: list[str], ready: bool = True) -> None:
        """Two processes of one jax.distributed job (both start first: each waits for the
        other); process 0 listens."""
        coord = f"127.0.0.1:{_free_port()}"
        first, second = (self._spawn(argv + ["--coordinator", coord, "--num-processes", "2",
                                             "--process-id", str(i)]) for i in range(2))
        _drain(second)
        self._wait(first, ready=ready)

    def _spawn(self, argv: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "jetserve", "serve", *argv],
                                env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        self.procs.append(proc)
        return proc

    def _wait(self, proc: subprocess.Popen, ready: bool = True) -> None:
        """Until `proc` listens (and, with `ready`, takes requests); _Refused with what it
        printed where it stopped first."""
        lines: list[str] = []
        try:
            self.ports.update(wait_listening(proc, 1, timeout_s=600, lines=lines,
                                             ready=ready))
        except AssertionError:
            proc.wait()
            raise _Refused("".join(lines)) from None
        _drain(proc)

    def complete(self, body: dict) -> httpx.Response:
        with httpx.Client(timeout=600) as c:
            return c.post(f"http://127.0.0.1:{self.ports['HTTP']}/v1/completions",
                          json={"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
                                "ignore_eos": True, "return_tokens_as_token_ids": True,
                                "logprobs": 0, **body})

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def requests_for(names: tuple[str, ...]) -> list[tuple[str, dict]]:
    """(name, body) of what a deployment of `names` is asked: short, long (chunked) and
    two prompts sharing a prefix (the second a prefix-cache hit where there is one), plus
    adapter and grammar rows where a feature of the pair brings them."""
    feats = [FEATURES[n] for n in names if n in FEATURES]
    out = [("short", {"prompt": SHORT}), ("long", {"prompt": LONG}),
           ("shared 1", {"prompt": SHARED + [17, 18]}),
           ("shared 2", {"prompt": SHARED + [19, 20, 21]})]
    if any(f.adapter_rows for f in feats):
        out += [("adapter short", {"prompt": SHORT, "model": "a1"}),
                ("adapter long", {"prompt": LONG, "model": "a1"})]
    if any(f.grammar_rows for f in feats):
        out += [("grammar", {"prompt": SHORT, "structured_outputs": {"regex": REGEX}})]
    if any(f.bias_rows for f in feats):
        out += [("bias short", {"prompt": SHORT, "logit_bias": BIAS}),
                ("bias long", {"prompt": LONG, "logit_bias": BIAS})]
    return out


def ask_all(d: Deployment, names: tuple[str, ...]) -> dict[str, httpx.Response]:
    """Every request of `names` at once, but the shared-prefix pair, which go one after
    the other (the second may then hit the prefix cache)."""
    reqs = requests_for(names)
    now = [(n, b) for n, b in reqs if not n.startswith("shared")]
    with ThreadPoolExecutor(len(now)) as pool:
        out = dict(zip([n for n, _ in now], pool.map(lambda nb: d.complete(nb[1]), now),
                       strict=True))
    for n, b in reqs:
        if n.startswith("shared"):
            out[n] = d.complete(b)
    return {n: out[n] for n, _ in reqs}


def _tokens(r: httpx.Response) -> list[int]:
    toks = r.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in toks]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    path, _ = lora_files.write_adapter(tmp_path_factory.mktemp("adapter") / "a1",
                                       RANDOM_MODELS["tiny"], ["q_proj", "v_proj", "down_proj"],
                                       rank=4, alpha=8)
    return path


@pytest.fixture(scope="module")
def reference(adapter):
    """request name -> greedy tokens, per KV dtype ("f32", "int8"), from the reference
    server of that dtype (every request kind, one at a time)."""
    out: dict[str, dict[str, list[int]]] = {}
    for key, names in (("f32", ("reference",)), ("int8", ("reference", "int8 KV"))):
        d = Deployment(names, adapter)
        assert d.refused is None, d.refused
        try:
            out[key] = {}
            for name, r in ask_all(d, tuple(FEATURES)).items():
                assert r.status_code == 200, (name, r.text)
                out[key][name] = _tokens(r)
            # the bias moves the answers, so a pair that dropped it would be caught
            assert out[key]["bias short"] != out[key]["short"], out[key]
        finally:
            d.close()
    return out


def check_pair(a: str, b: str, adapter: str, reference: dict) -> None:
    """Starts the deployment of `a` and `b` and holds it to the matrix: refused by name
    where the matrix refuses the pair, else every request its reference's tokens."""
    why = matrix()[frozenset((a, b))]
    d = Deployment((a, b), adapter)
    try:
        if d.refused is not None:
            assert why, f"{a} x {b} is marked ok but the server would not start:\n{d.refused}"
            assert names_a_feature(d.refused, a, b), d.refused
            return
        want = reference["int8" if FEATURES[a].int8_kv or FEATURES[b].int8_kv else "f32"]
        answered = []
        for name, r in ask_all(d, (a, b)).items():
            if r.status_code == 400:
                assert why, f"{a} x {b}: {name} refused but marked ok: {r.text}"
                assert names_a_feature(r.text, a, b), (name, r.text)
                continue
            assert r.status_code == 200, (name, r.text)
            answered.append(name)
            assert _tokens(r) == want[name], f"{a} x {b}: {name}"
        assert not why or len(answered) < len(requests_for((a, b))), \
            f"{a} x {b} is marked refused ({why}) but served every request"
    finally:
        d.close()


@pytest.fixture(scope="module")
def outcomes(request, adapter, reference) -> dict[frozenset[str], BaseException | None]:
    """Every pair of two features whose test runs (all, or those `-k` selects) checked,
    two deployments at a time (a deployment is a subprocess that mostly compiles on one
    core): pair -> what its check raised, or None."""
    m = matrix()
    selected = {(item.callspec.params["a"], item.callspec.params["b"])
                for item in request.session.items
                if item.originalname == "test_pair_serves_or_is_refused_by_name"}
    pairs = [(a, b) for a, b in itertools.combinations(FEATURES, 2)
             if m[frozenset((a, b))] is not None and (a, b) in selected]

    def run(pair: tuple[str, str]) -> BaseException | None:
        try:
            check_pair(*pair, adapter, reference)
        except BaseException as e:  # noqa: BLE001 - re-raised by the pair's own test
            return e
        return None

    with ThreadPoolExecutor(2) as pool:
        return {frozenset(p): e for p, e in zip(pairs, pool.map(run, pairs), strict=True)}


PAIRS = [pytest.param(a, b, id=f"{a}+{b}".replace(" ", "-"))
         for a, b in itertools.combinations(FEATURES, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("a,b", PAIRS)
def test_pair_serves_or_is_refused_by_name(a, b, outcomes):
    if matrix()[frozenset((a, b))] is None:
        pytest.skip(f"{a} and {b} are two values of one flag")
    error = outcomes[frozenset((a, b))]
    if error is not None:
        raise error
