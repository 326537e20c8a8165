"""The orchestrator on the Flax engine, 8 fake CPU devices.

Disaggregated: prefill on devices 0-3, generate on devices 4-7 (KV cache split by kv heads
then slots), so every prefix crosses slices. 16 concurrent requests give the same tokens
there, in interleaved mode and in `jetserve.offline.generate_many`.
"""

import json

import jax
import numpy as np
import pytest

from engines import EngineConfig, SamplingParams
from jetserve import cli
from jetserve.offline import generate_many
from jetserve.orchestrator import Orchestrator, Request, build

CFG = EngineConfig(max_concurrent_decodes=4, max_prefill_length=32, max_seq_len=64)
STEPS = 10


@pytest.fixture(scope="module")
def disaggregated():
    orch = build("random:tiny", interleaved=False, prefill_devices=4, generate_devices=4,
                 generate_sharding="tp_kv_batch", engine_config=CFG)
    orch.start()
    yield orch
    orch.stop()


@pytest.fixture(scope="module")
def interleaved(disaggregated):
    # The prefill engine (devices 0-3) also generates here: no transfer at all.
    eng = disaggregated.prefill_engines[0]
    orch = Orchestrator.from_engines(eng, params=disaggregated._prefill[0].params)
    orch.start()
    yield orch
    orch.stop()


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(1, 256, rng.integers(1, 30)).tolist() for _ in range(16)]


def run_all(orch, prompts, **kw):
    hs = [orch.submit(Request(prompt_ids=p, max_tokens=STEPS, logprobs=2, **kw))
          for p in prompts]
    return [h.result(120) for h in hs]


def test_slices_are_disjoint(disaggregated):
    p = disaggregated.prefill_engines[0].mesh.devices.flatten().tolist()
    g = disaggregated.generate_engines[0].mesh.devices.flatten().tolist()
    assert p == jax.devices()[:4] and sorted(g, key=lambda d: d.id) == jax.devices()[4:]
    assert disaggregated.generate_engines[0].mesh.shape == {"data": 2, "model": 2}


def test_disaggregated_equals_interleaved_equals_offline(disaggregated, interleaved, prompts):
    eng = interleaved.generate_engines[0]
    offline = generate_many(eng, interleaved._generate[0].params, prompts, max_tokens=STEPS)
    dis = run_all(disaggregated, prompts)
    inter = run_all(interleaved, prompts)
    for o, d, i in zip(offline, dis, inter, strict=True):
        assert d.token_ids == i.token_ids == o.token_ids
        assert d.finish_reason == i.finish_reason == o.finish_reason
        np.testing.assert_allclose(d.logprobs, o.logprobs, atol=1e-4)
        np.testing.assert_allclose(i.logprobs, o.logprobs, atol=1e-5)
        assert [[t for t, _ in alts] for alts in d.top_logprobs] == \
               [[t for t, _ in alts] for alts in i.top_logprobs]
        assert all(len(a) == 2 for a in d.top_logprobs)
        assert d.text == eng.tokenizer.decode([t for t in d.token_ids if t not in eng.eos_ids])
    stats = disaggregated.stats()
    assert stats["transfer"][0]["transfers"] >= 16
    assert stats["generate"][0]["slots_in_use"] == 0


def test_seeded_sampling_is_the_same_in_both_modes(disaggregated, interleaved, prompts):
    sp = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11)
    dis = run_all(disaggregated, prompts[:6], sampling=sp, ignore_eos=True)
    inter = run_all(interleaved, prompts[:6], sampling=sp, ignore_eos=True)
    eng = interleaved.generate_engines[0]
    offline = generate_many(eng, interleaved._generate[0].params, prompts[:6],
                            max_tokens=STEPS, sampling=sp, ignore_eos=True)
    assert [d.token_ids for d in dis] == [i.token_ids for i in inter] == \
           [o.token_ids for o in offline]
    greedy = run_all(interleaved, prompts[:6], ignore_eos=True)
    assert [d.token_ids for d in dis] != [g.token_ids for g in greedy]


def test_prompt_logprobs_echo(disaggregated):
    eng = disaggregated.prefill_engines[0]
    prompt = [5, 17, 99, 3, 42]
    r = disaggregated.submit(Request(prompt_ids=prompt, max_tokens=0, prompt_logprobs=True,
                                     logprobs=2)).result(60)
    ref = eng.prompt_logprobs(disaggregated._prefill[0].params, prompt)
    assert (r.token_ids, r.finish_reason) == ([], "length")
    assert r.prompt_logprobs[0] is None and r.prompt_top_logprobs[0] == []
    np.testing.assert_allclose(r.prompt_logprobs[1:], ref.token_logprobs[1:], rtol=1e-6)
    assert [[t for t, _ in a] for a in r.prompt_top_logprobs[1:]] == \
           np.asarray(ref.top_ids)[1:, :2].tolist()
    both = disaggregated.submit(Request(prompt_ids=prompt, max_tokens=3,
                                        prompt_logprobs=True)).result(60)
    assert both.prompt_logprobs == r.prompt_logprobs and len(both.token_ids) >= 1


def test_cli_generate_runs_through_the_orchestrator(capsys, prompts, interleaved):
    argv = ["generate", "--model", "random:tiny", "--max-tokens", str(STEPS), "--json",
            "--max-concurrent-decodes", "4", "--max-prefill-length", "32",
            "--max-seq-len", "64", "--devices", "1"]
    for p in prompts[:5]:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    eng = interleaved.generate_engines[0]
    offline = generate_many(eng, interleaved._generate[0].params, prompts[:5], max_tokens=STEPS)
    assert [r["prompt_ids"] for r in rows] == prompts[:5]
    assert [r["token_ids"] for r in rows] == [o.token_ids for o in offline]
    assert [r["finish_reason"] for r in rows] == [o.finish_reason for o in offline]
    assert set(rows[0]) == {"prompt_ids", "token_ids", "text", "finish_reason"}
