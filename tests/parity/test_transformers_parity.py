"""Every family against Hugging Face transformers on the same files (float32).

Logits of prefill and of each decode step match to 1e-4 relative; greedy tokens through
prefill -> insert -> generate, with prompts joining at different steps, equal
`transformers` generate; the CLI gives the same tokens.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from engines import EngineConfig, create_engine, load_hf_config
from engines.kv_cache import DecodeKV, PrefillKV
from jetserve import cli
from jetserve.offline import generate_many
from tests.parity.hf_models import FAMILIES, hf_greedy

STEPS = 32
PROMPT_LENGTHS = (40, 7, 23, 33, 12)  # five prompts, four slots: the last joins later


def _engine(model_dir, slots=4):
    cfg = EngineConfig(max_concurrent_decodes=slots, max_prefill_length=48, max_seq_len=96,
                       top_logprobs=4)
    return create_engine(load_hf_config(model_dir), weights=model_dir, config=cfg)


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 128, size=n).tolist() for n in PROMPT_LENGTHS]


def _rel_err(a, b):
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, hf_dirs):
    d, model = hf_dirs[request.param]
    eng = _engine(d)
    return request.param, d, model, eng, eng.load_params()


def test_prefill_and_decode_logits_match(family):
    name, d, model, eng, params = family
    prompt = _prompts()[0]
    with torch.no_grad():
        ref_tokens = hf_greedy(model, prompt, 6)
        ref = model(torch.tensor([prompt + ref_tokens])).logits[0].numpy()
    T = len(prompt)
    tokens = jnp.asarray([prompt], jnp.int32)
    pos = jnp.arange(T)[None]
    ours = eng.model.apply({"params": params}, tokens, pos, PrefillKV(pos, None))[0]
    assert _rel_err(np.asarray(ours), ref[:T]) < 1e-4, name

    step = jax.jit(lambda p, s: eng.model.apply(
        {"params": p}, s.tokens[:, None], s.lengths[:, None], DecodeKV(s, s.lengths))[:, 0])
    prefix, _ = eng.prefill(params, prompt, T)
    state = eng.insert(prefix, eng.init_decode_state(), 1)
    for i in range(5):
        logits = np.asarray(step(params, state))[1]
        assert _rel_err(logits, ref[T + i]) < 1e-4, (name, i)
        state, res = eng.generate(params, state)
        assert res.to_host().token(1) == ref_tokens[i + 1]


def test_greedy_tokens_match_transformers_generate(family):
    name, d, model, eng, params = family
    prompts = _prompts()
    results = generate_many(eng, params, prompts, max_tokens=STEPS, ignore_eos=True)
    for p, r in zip(prompts, results, strict=True):
        assert r.token_ids == hf_greedy(model, p, STEPS), name


def test_decode_logprobs_match_transformers(family):
    name, d, model, eng, params = family
    prompt = _prompts()[2]
    r = generate_many(eng, params, [prompt], max_tokens=6, ignore_eos=True)[0]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + r.token_ids])).logits[0], -1)
    want = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(r.token_ids)]
    np.testing.assert_allclose(r.logprobs, want, rtol=1e-4, atol=1e-5)


def test_prompt_logprobs_match_transformers(family):
    name, d, model, eng, params = family
    prompt = _prompts()[3]
    pl = eng.prompt_logprobs(params, prompt)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1).numpy()
    want = [logp[t - 1, prompt[t]] for t in range(1, len(prompt))]
    np.testing.assert_allclose(pl.token_logprobs[1:], want, rtol=1e-4, atol=1e-5)
    assert np.isnan(pl.token_logprobs[0])
    np.testing.assert_array_equal(pl.greedy[1:], logp.argmax(-1)[:-1])


def test_cli_generate_gives_the_same_tokens(family, capsys):
    name, d, model, eng, params = family
    prompts = _prompts()[:4]
    argv = ["generate", "--model", d, "--max-tokens", str(STEPS), "--ignore-eos", "--json",
            "--max-concurrent-decodes", "4", "--max-seq-len", "96"]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["prompt_ids"] for r in rows] == prompts
    for p, row in zip(prompts, rows, strict=True):
        assert row["token_ids"] == hf_greedy(model, p, STEPS), name
        assert row["finish_reason"] == "length"


@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_kernels_match_transformers(hf_dirs, family):
    """On one CPU device decode steps run on our kernels (engines/cpu_kernels.py): every
    family's features (sliding windows, biases, tied heads, experts) through them."""
    d, model = hf_dirs[family]
    cfg = EngineConfig(max_concurrent_decodes=4, max_prefill_length=48, max_seq_len=96)
    eng = create_engine(load_hf_config(d), weights=d, config=cfg, devices=jax.devices()[:1])
    if not eng.backend.cpu_matmul_rows:
        pytest.skip("the CPU matmul kernel is not available here")
    params = eng.load_params()
    prompts = _prompts()
    results = generate_many(eng, params, prompts, max_tokens=STEPS, ignore_eos=True)
    for p, r in zip(prompts, results, strict=True):
        assert r.token_ids == hf_greedy(model, p, STEPS)
    p, r = prompts[2], results[2]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([p + r.token_ids])).logits[0], -1)
    want = [float(logp[len(p) - 1 + i, t]) for i, t in enumerate(r.token_ids)]
    np.testing.assert_allclose(r.logprobs, want, rtol=1e-4, atol=1e-5)
