"""lm-evaluation-harness's `local-completions` model against a running server on the
bundled model: its loglikelihood, loglikelihood_rolling and generate_until give the same
numbers whether lm-eval tokenizes with transformers (`tokenizer_backend=huggingface`) or
through the server's vLLM tokenizer routes (`remote`, which it picks by itself), and its
loglikelihoods equal `jetserve batch` scoring rows."""

import json
import math

import httpx
import openai
import pytest

from jetserve import cli
from jetserve.batch.journal import read_rows
from jetserve.model_loading import BUNDLED_DIR

pytestmark = pytest.mark.slow
MODEL = "bundled"
PAIRS = [("def add(a, b):\n", "    return a + b"), ("class Point:\n    def", " __init__(self):"),
         ("", "import sys"), ("x = [1, 2", ", 3]"), ("if not self.", "_closed:"),
         ("    # 東", "京 🙂")]
TEXT = "import os\n\n\ndef main():\n    path = os.path.join('a', 'b')\n    return path\n"


@pytest.fixture(scope="module")
def url(bundled_servers):
    return f"http://127.0.0.1:{bundled_servers.http_port}/v1/completions"


def _lm(url, backend):
    pytest.importorskip("lm_eval")
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    kw = {} if backend == "auto" else {"tokenizer_backend": backend, "tokenizer": BUNDLED_DIR}
    return LocalCompletionsAPI(base_url=url, model=MODEL, max_retries=1, **kw)


def _requests(kind, args):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=k) for k, a in enumerate(args)]


@pytest.fixture(scope="module")
def lms(url):
    auto = _lm(url, "auto")
    assert auto.tokenizer_backend == "remote"  # found /tokenizer_info and /tokenize
    return {"huggingface": _lm(url, "huggingface"), "remote": auto}


def test_loglikelihood_same_both_ways_and_equal_to_batch_rows(lms, tmp_path):
    got = {name: lm.loglikelihood(_requests("loglikelihood", PAIRS), disable_tqdm=True)
           for name, lm in lms.items()}
    for (hf_lp, hf_greedy), (r_lp, r_greedy) in zip(got["huggingface"], got["remote"],
                                                    strict=True):
        assert hf_lp == pytest.approx(r_lp, abs=1e-5) and hf_greedy == r_greedy
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": k, "context": c, "continuation": x,
                                       "add_bos": False}) + "\n"
                           for k, (c, x) in enumerate(PAIRS)))
    assert cli.main(["batch", "--input", str(inp), "--output", str(out), "--devices", "1",
                     "--max-concurrent-decodes", "4", "--no-progress"]) == 0
    rows = {r["id"]: r for r in read_rows(str(out))}
    for k, (lp, greedy) in enumerate(got["huggingface"]):
        assert rows[k]["logprob"] == pytest.approx(lp, abs=1e-4), PAIRS[k]
        assert rows[k]["is_greedy"] is greedy
    assert all(lp < 0 for lp, _ in got["huggingface"])


def test_loglikelihood_rolling_same_both_ways(lms):
    reqs = _requests("loglikelihood_rolling", [(TEXT,)])
    hf, remote = (lms[n].loglikelihood_rolling(reqs, disable_tqdm=True)
                  for n in ("huggingface", "remote"))
    assert hf[0] == pytest.approx(remote[0], abs=1e-4) and math.isfinite(hf[0]) and hf[0] < 0


def test_generate_until_same_both_ways_and_as_the_openai_client(lms, url):
    context = "def add(a, b):\n"
    gen = {"until": ["\n\n"], "max_gen_toks": 24, "do_sample": False}
    outs = [lms[n].generate_until(_requests("generate_until", [(context, dict(gen))]),
                                  disable_tqdm=True)[0] for n in ("huggingface", "remote")]
    assert outs[0] == outs[1]
    base = url.removesuffix("/v1/completions")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    ids = httpx.post(f"{base}/tokenize", json={"prompt": context, "add_special_tokens": False},
                     timeout=60).json()["tokens"]
    want = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0,
                                     stop=["\n\n"]).choices[0].text
    assert outs[0] == want and want


@pytest.fixture(scope="module")
def bpe_url(tmp_path_factory):
    """A served random-weight Llama whose tokenizer is byte-level BPE (tokenizer.json)."""
    import jax
    import torch
    import transformers as tf

    from engines import EngineConfig
    from jetserve import orchestrator
    from jetserve.server.runner import BackgroundServers
    from tests.e2e.conftest import local_config
    from tests.jetserve.test_tokenizer import write_byte_level_bpe
    from tests.parity.hf_models import TINY

    d = tmp_path_factory.mktemp("bpe_llama")
    # BOS is not id 0: lm-eval's remote tokenizer takes a BOS id of 0 for none.
    write_byte_level_bpe(d, [a + b for a, b in PAIRS] * 20 + [TEXT] * 20, 320,
                         specials=("<|pad|>", "<|bos|>", "<|eos|>"))
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**{**TINY, "vocab_size": 320})).save_pretrained(d)
    orch = orchestrator.build(str(d), interleaved=True, devices=jax.devices()[:1],
                              engine_config=EngineConfig(max_concurrent_decodes=2,
                                                         max_prefill_length=128,
                                                         max_seq_len=256))
    orch.start()
    try:
        with BackgroundServers(orch, local_config(model_name=MODEL)) as s:
            yield f"http://127.0.0.1:{s.http_port}/v1/completions", str(d)
    finally:
        orch.stop(drain=False, timeout=30)


def test_byte_level_bpe_model_same_both_ways(bpe_url):
    url, model_dir = bpe_url
    pytest.importorskip("lm_eval")
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    hf = LocalCompletionsAPI(base_url=url, model=MODEL, max_retries=1,
                             tokenizer_backend="huggingface", tokenizer=model_dir)
    remote = _lm(url, "auto")
    assert remote.tokenizer_backend == "remote"
    assert hf.prefix_token_id == remote.prefix_token_id  # "<|bos|>", read as one token
    reqs = _requests("loglikelihood", PAIRS)
    a, b = (lm.loglikelihood(reqs, disable_tqdm=True) for lm in (hf, remote))
    for (lp_a, greedy_a), (lp_b, greedy_b) in zip(a, b, strict=True):
        assert lp_a == pytest.approx(lp_b, abs=1e-5) and greedy_a == greedy_b
    gen = _requests("generate_until", [("def add(a, b):\n", {"until": ["\n\n"],
                                                            "max_gen_toks": 12})])
    assert hf.generate_until(gen, disable_tqdm=True) == remote.generate_until(
        gen, disable_tqdm=True)
