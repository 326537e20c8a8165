"""Today's families (tests/parity/hf_models.py: DENSE_CONFIGS Qwen3, Qwen3 with YaRN,
Gemma 2, Gemma 3, OLMo 2, Phi-3; Qwen3-MoE with dense layers among routed ones; GLM-4.5;
gpt-oss; Llama 4 text; DeepSeek-V3) through the servers, against transformers on the same random-weight directory (float32,
greedy, end of sequence ignored).

Each family gets one `jetserve serve` (both roles in one process on one fake device, paged
KV with its prefix cache on the KV pages, 8-token prefill chunks) and a split deployment: a
`--role prefill` process holding a prefix cache, prefilling 16 tokens a call, tp over 4
fake devices (6 for six query heads, one device where the vocabulary or the MLP does not
split over 6; DeepSeek-V3, whose one latent kv head tp would repeat, ep_tp over 4: 2 of
its 8 experts a device), and a `--role decode` process on one device pulling
each prefix from it and verifying n-gram drafts over it. Warm-up is off; the two
deployments start at once. Both are asked over the openai SDK (token-id prompts,
temperature 0, log-probs) and over JetStream's gRPC stub: a short prompt, a long one of
six sliding windows (so every chunk after the first continues a prefix longer than the
window), and two prompts sharing a 32-token prefix, the second one a prefix-cache hit
(counted on /metrics, or by the worker's Load when split); and the long prompt is scored
(echo, in chunks too). Every answer is transformers' `generate`, every log-prob within
1e-4 of transformers'. The engine-level checks of each family (speculative decoding in
mixed steps, LoRA, convert) are tests/parity/test_dense_families.py's and
tests/parity/test_moe_paths.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import openai
import pytest
import torch

from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc
from tests.e2e.serve_process import wait_listening
from tests.e2e.test_split_serve import _load, _metric
from tests.parity.hf_models import DENSE_CONFIGS, hf_greedy, make_hf_model
from tests.xla import xla_flags

FAMILIES = (*DENSE_CONFIGS, "qwen3_moe", "glm4_moe", "gpt_oss", "llama4", "deepseek_v3")

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 16-token prefill chunks; the windowed families' windows are 8 keys.
ENGINE = ["--max-seq-len", "64", "--max-prefill-length", "16", "--max-concurrent-decodes",
          "4", "--no-warmup", "--host", "127.0.0.1"]
CACHE = ["--prefix-cache-hbm-mb", "4"]
MAX_TOKENS = 8
_rng = np.random.default_rng(5)
SHORT = _rng.integers(3, 128, size=7).tolist()
LONG = _rng.integers(3, 128, size=48).tolist()  # six windows of 8, three chunks of 16
SHARED = _rng.integers(3, 128, size=32).tolist()  # two cache blocks (16 tokens, or 4 pages)
FIRST, SECOND = SHARED + [5, 9, 11], SHARED + [17, 4, 60, 8, 21]
PROMPTS = {"short": SHORT, "long": LONG, "first": FIRST, "second": SECOND}


def _spawn(argv: list[str], servers: int, out: list[str], devices: int = 1
           ) -> tuple[subprocess.Popen, dict[str, int]]:
    """`jetserve serve ARGV` on `devices` fake CPU devices, once its `servers` listen and
    it takes requests; what it prints goes on into `out`."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=xla_flags(devices))
    proc = subprocess.Popen([sys.executable, "-m", "jetserve", "serve", *ENGINE, *argv],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        ports = wait_listening(proc, servers, timeout_s=600, lines=out)
    finally:
        threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
    return proc, ports


class Deployment:
    """The processes of one deployment of model `d`: "one" (`jetserve serve`, paged KV,
    8-token prefill chunks) or "split" (a prefill worker with the prefix cache, tp over
    `tp` devices, and a decode process with speculative decoding)."""

    def __init__(self, d: str, kind: str, tp: int, preset: str = "tp"):
        self.kind, self.procs, self.out, self.worker = kind, [], [], None
        model = ["--model", d, "--served-model-name", "m"]
        try:
            if kind == "one":
                self._start(model + CACHE + ["--kv-layout", "paged", "--page-size", "8",
                                             "--prefill-chunk", "8", "--grpc-port", "0",
                                             "--http-port", "0"], 2)
            else:
                self.worker = self._start(model + CACHE + [
                    "--role", "prefill", "--sharding", preset, "--grpc-port", "0"], 1,
                    devices=tp)["gRPC"]
                self._start(model + ["--role", "decode", "--prefill-workers",
                                     f"127.0.0.1:{self.worker}", "--speculative", "ngram:3",
                                     "--grpc-port", "0", "--http-port", "0"], 2)
        except BaseException:
            self.close()
            raise

    def _start(self, argv: list[str], servers: int, devices: int = 1) -> dict[str, int]:
        proc, self.ports = _spawn(argv, servers, self.out, devices)
        self.procs.append(proc)
        return self.ports

    def cache_hits(self) -> float:
        """Prompt tokens found in the prefix cache so far (the worker's, when split)."""
        if self.worker is not None:
            return _load(self.worker).prefix_cache_hits
        return _metric(self.ports["HTTP"], "vllm:prefix_cache_hits_total")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _http(port: int, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs from /v1/completions, over the openai SDK."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=600)
    out = client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS,
                                    temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True,
                                                "return_tokens_as_token_ids": True})
    assert out.choices[0].finish_reason == "length"
    lp = out.choices[0].logprobs
    return [int(t.removeprefix("token_id:")) for t in lp.tokens], lp.token_logprobs


def _scored(port: int, prompt: list[int]) -> list[float]:
    """The log-prob of each of `prompt`'s tokens but the first (echo, no tokens
    generated)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=600)
    out = client.completions.create(model="m", prompt=prompt, max_tokens=0, echo=True,
                                    logprobs=1)
    scored = out.choices[0].logprobs.token_logprobs
    assert len(scored) == len(prompt) and scored[0] is None
    return scored[1:]


def _grpc(port: int, prompt: list[int]) -> tuple[list[int], list[float]]:
    """The same from JetStream's Decode stream."""
    req = pb.DecodeRequest(max_tokens=MAX_TOKENS, ignore_eos=True, has_bos=True, logprobs=1,
                           token_content=pb.DecodeRequest.TokenContent(token_ids=prompt))
    tokens, logprobs = [], []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        for m in pb_grpc.OrchestratorStub(ch).Decode(req, timeout=600):
            tokens += m.stream_content.samples[0].token_ids
            logprobs += m.stream_content.samples[0].logprobs
    return tokens, logprobs


def ask(dep: Deployment) -> dict:
    """"answers": (api, prompt) -> (tokens, log-probs), every prompt over HTTP and gRPC:
    the short and long ones all at once, then the prefix-sharing pair one after the other;
    "hits": the prefix-cache hit tokens counted over the second prompt's first request;
    "transfers": prefixes the decode process pulled for those (split); "scored": the long
    prompt's log-probs (echo, scored where it is prefilled, nothing pulled)."""
    call = {"http": lambda p: _http(dep.ports["HTTP"], p),
            "grpc": lambda p: _grpc(dep.ports["gRPC"], p)}
    with ThreadPoolExecutor(4) as pool:
        calls = {(api, n): pool.submit(call[api], PROMPTS[n])
                 for api in call for n in ("short", "long")}
        answers = {k: c.result(timeout=600) for k, c in calls.items()}
    answers["http", "first"] = call["http"](FIRST)
    hits = dep.cache_hits()
    answers["grpc", "second"] = call["grpc"](SECOND)
    hits = dep.cache_hits() - hits
    answers["http", "second"] = call["http"](SECOND)
    transfers = _metric(dep.ports["HTTP"], "jetserve_kv_transfers")
    return {"answers": answers, "hits": hits, "transfers": transfers,
            "scored": _scored(dep.ports["HTTP"], LONG)}


def _logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """transformers' log-prob of each of `tokens` after `prompt` (with no `tokens`: of
    each prompt token after those before it)."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0], -1)
    if not tokens:
        return [float(logp[i - 1, t]) for i, t in enumerate(prompt) if i]
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    """(variant, transformers' tokens and log-probs of each prompt, each deployment's
    answers or what asking it raised): the family's deployments start and are asked at
    once."""
    d = str(tmp_path_factory.mktemp(request.param))
    model = make_hf_model(request.param, d)
    want = {}
    for name, p in PROMPTS.items():
        tokens = hf_greedy(model, p, MAX_TOKENS)
        want[name] = (tokens, _logprobs(model, p, tokens))
    want["scored"] = _logprobs(model, LONG, [])
    cfg = model.config  # 6 query heads do not divide over 4: over 6, where all else does
    tp = 4 if cfg.num_attention_heads % 4 == 0 else cfg.num_attention_heads
    tp = tp if cfg.vocab_size % tp == 0 and cfg.intermediate_size % tp == 0 else 1
    # DeepSeek-V3's one latent kv head is not repeated over tp's devices: its 8 experts
    # go over the 4 devices instead (ep_tp), the attention on each whole.
    preset = "ep_tp" if getattr(cfg, "kv_lora_rank", None) else "tp"

    def run(kind: str) -> dict | BaseException:
        try:
            dep = Deployment(d, kind, tp, preset)
        except BaseException as e:  # noqa: BLE001 - raised by the deployment's own test
            return e
        try:
            return ask(dep)
        except BaseException as e:  # noqa: BLE001
            return AssertionError(f"{e!r}\n" + "".join(dep.out[-60:]))
        finally:
            dep.close()

    with ThreadPoolExecutor(2) as pool:
        runs = dict(zip(("one", "split"), pool.map(run, ("one", "split")), strict=True))
    return request.param, want, runs


@pytest.mark.parametrize("kind", ["one", "split"])
def test_servers_give_transformers_tokens(served, kind):
    name, want, runs = served
    got = runs[kind]
    if isinstance(got, BaseException):
        raise got
    assert len(got["answers"]) == 7
    for (api, prompt), (tokens, logprobs) in got["answers"].items():
        assert tokens == want[prompt][0], (name, kind, api, prompt)
        np.testing.assert_allclose(logprobs, want[prompt][1], rtol=1e-4, atol=1e-4,
                                   err_msg=f"{name} {kind} {api} {prompt}")
    np.testing.assert_allclose(got["scored"], want["scored"], rtol=1e-4, atol=1e-4,
                               err_msg=f"{name} {kind} echo")
    # The second shared prompt found its prefix's two whole blocks (four pages) cached.
    assert got["hits"] == len(SHARED), got["hits"]
    if kind == "split":  # each prompt was prefilled by the worker, its KV pulled
        assert got["transfers"] == len(got["answers"]), got["transfers"]
