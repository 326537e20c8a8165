"""Several tokens per step (speculative decoding) through the orchestrator, on MockEngine.

MockEngine(speculative=K) (engines/mock_engine.py) streams the same tokens as the plain
engine (first = sum(prompt) mod 256, then +1 each), but a step gives a slot holding n
tokens 1 + (n mod (K + 1)) of them. Every request must end exactly where the plain run
ends: stop ids, stop strings and max_tokens that fall inside a step drop the rest of it.
"""

import jax
import numpy as np
import pytest

from engines import MockEngine
from engines.mock_engine import ByteTokenizer
from jetserve.offline import generate_many
from jetserve.orchestrator import Orchestrator, Request

K = 3


def expected(prompt, n, V=256):
    t = sum(prompt) % V
    return [(t + i) % V for i in range(n)]


def logprob(t):
    return -(t % 4) / 4


@pytest.fixture(params=["interleaved", "disaggregated"])
def make(request):
    def build(**engine_kw):
        devs = jax.devices()
        engine_kw.setdefault("speculative", K)
        if request.param == "interleaved":
            return Orchestrator.from_engines(MockEngine(devices=devs[:1], **engine_kw))
        pe, ge = MockEngine(devices=devs[:1], **engine_kw), MockEngine(devices=devs[4:5], **engine_kw)
        return Orchestrator(prefill_engines=[pe], generate_engines=[ge],
                            prefill_params=[pe.load_params()],
                            generate_params=[ge.load_params()])
    return build


def test_steps_of_several_tokens_stream_the_plain_tokens(make):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, rng.integers(1, 40)).tolist() for _ in range(16)]
    lens = rng.integers(1, 30, len(prompts)).tolist()
    with make() as orch:
        hs = [orch.submit(Request(prompt_ids=p, max_tokens=n, logprobs=0))
              for p, n in zip(prompts, lens, strict=True)]
        deltas = [list(h) for h in hs]
        stats = orch.stats()
    for p, n, ds in zip(prompts, lens, deltas, strict=True):
        toks = [t for d in ds for t in d.token_ids]
        assert toks == expected(p, n)
        assert "".join(d.text for d in ds) == ByteTokenizer().decode(toks)
        assert [lp for d in ds for lp in d.logprobs] == [logprob(t) for t in toks]
        assert [len(d.top_logprobs) for d in ds] == [len(d.token_ids) for d in ds]
        assert ds[-1].finish_reason == "length"
    sizes = {len(d.token_ids) for ds in deltas for d in ds[1:]}
    assert sizes >= {1, 2} and max(sizes) <= K + 1  # steps of varying size were streamed
    assert sum(g["tokens"] for g in stats["generate"]) == sum(lens) - len(lens)
    assert all(g["slots_in_use"] == 0 for g in stats["generate"])


def test_stop_id_inside_a_step_ends_the_request_there(make):
    # Prompt [65]: the cache holds 1 token, so the first step gives 2 (66, 67), the next
    # (cache 3) 4: 68, 69, 70, 71. EOS 70 sits inside that step; 71 is dropped.
    with make(eos_ids=(70,)) as orch:
        deltas = list(orch.submit(Request(prompt_ids=[65], max_tokens=20)))
        by_id = orch.submit(Request(prompt_ids=[65], max_tokens=8, stop_token_ids=(67,))).result(10)
        ignored = orch.submit(Request(prompt_ids=[65], max_tokens=8, ignore_eos=True)).result(10)
    assert [d.token_ids for d in deltas] == [[65], [66, 67], [68, 69, 70]]
    assert [d.text for d in deltas] == ["A", "BC", "DE"]
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", 70)
    assert (by_id.token_ids, by_id.text, by_id.stop_reason) == ([65, 66, 67], "AB", 67)
    assert ignored.token_ids == expected([65], 8) and ignored.finish_reason == "length"


def test_max_tokens_and_max_seq_len_inside_a_step(make):
    with make(max_seq_len=20) as orch:
        short = orch.submit(Request(prompt_ids=[65], max_tokens=4)).result(10)
        capped = orch.submit(Request(prompt_ids=[1] * 15, max_tokens=50)).result(10)
    assert short.token_ids == [65, 66, 67, 68] and short.finish_reason == "length"
    assert capped.token_ids == expected([1] * 15, 5) and capped.finish_reason == "length"


def test_stop_string_inside_a_step_drops_the_rest(make):
    with make() as orch:
        deltas = list(orch.submit(Request(prompt_ids=[65], max_tokens=20,
                                          stop_strings=("CD",))))
    # Steps: [65], [66, 67], [68, 69, 70, 71]: "CD" completes at 68; 69.. are dropped.
    assert [d.token_ids for d in deltas] == [[65], [66, 67], [68]]
    assert "".join(d.text for d in deltas) == "AB"
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", "CD")


def test_cancel_between_steps_of_several_tokens(make):
    with make(max_concurrent_decodes=1, step_delay_s=0.002) as orch:
        first = orch.submit(Request(prompt_ids=[10], max_tokens=200))
        second = orch.submit(Request(prompt_ids=[20], max_tokens=6))
        got, it = [], iter(first)
        while len(got) < 8:
            got += next(it).token_ids
        first.cancel()
        rest = list(it)
        assert second.result(10).token_ids == expected([20], 6)  # took the freed slot
    got += [t for d in rest for t in d.token_ids]
    assert rest[-1].finish_reason == "cancelled" and rest[-1].token_ids == []
    assert got == expected([10], len(got)) and len(got) < 200


def test_offline_loop_takes_several_tokens_per_step():
    prompts = [[65], [1] * 15, [7, 8, 9], [200]]
    plain = MockEngine(max_concurrent_decodes=2, max_seq_len=24, eos_ids=(70,))
    spec = MockEngine(max_concurrent_decodes=2, max_seq_len=24, eos_ids=(70,), speculative=K)
    want = generate_many(plain, plain.load_params(), prompts, max_tokens=12)
    got = generate_many(spec, spec.load_params(), prompts, max_tokens=12)
    assert [(r.token_ids, r.finish_reason, r.logprobs) for r in got] == \
        [(r.token_ids, r.finish_reason, r.logprobs) for r in want]
    assert want[0].finish_reason == "stop" and want[1].finish_reason == "length"


def test_acceptance_counts_per_request_in_stats_and_metrics(make):
    from jetserve.server.metrics import ServerMetrics

    with make() as orch:
        metrics = ServerMetrics(orch)
        r = orch.submit(Request(prompt_ids=[65], max_tokens=8)).result(10)
        stats = orch.stats()
        text = metrics.render()[0].decode()
    # Steps from a cache of 1 token: 2 tokens (1 draft of 3 kept), then 4 (3 kept), then
    # 4 again, of which the budget takes 1: 3 steps, 9 drafts, 7 kept.
    assert r.token_ids == expected([65], 8)
    assert (r.timing.drafted, r.timing.accepted) == (9, 7)
    g = stats["generate"][0]
    assert g["drafted"] >= 9 and g["accepted"] >= 7  # a step after the end may count too
    assert "jetserve_spec_draft_tokens_total 9.0" in text
    assert "jetserve_spec_accepted_tokens_total 7.0" in text
