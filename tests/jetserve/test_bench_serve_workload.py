"""The load generator's arrival processes, length distributions and SLO parsing."""

import numpy as np
import pytest

from jetserve.bench import serve


def test_poisson_and_gamma_gaps_have_the_rate_mean():
    rng = np.random.default_rng(0)
    for arrival, shape in (("poisson", 1.0), ("gamma", 0.25), ("gamma", 4.0)):
        t = serve.arrival_times(20000, 8.0, rng, arrival=arrival, burstiness=shape)
        gaps = np.diff(t)
        assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
        # Gamma gaps of shape k have coefficient of variation 1/sqrt(k): bursty below 1.
        assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(shape), rel=0.1)
    assert not serve.arrival_times(5, float("inf"), rng).any()


def test_synthetic_lengths_have_the_medians_and_stay_in_bounds():
    w = serve.Workload(num_requests=4000, prompt_len=100, output_len=50, lengths="synthetic",
                       max_total=1024, shared_prefix=10)
    reqs = serve.make_requests(w, np.random.default_rng(1))
    p = np.array([len(r.prompt_ids) - 10 for r in reqs])
    o = np.array([r.max_tokens for r in reqs])
    assert np.median(p) == pytest.approx(100, rel=0.1)
    assert np.median(o) == pytest.approx(50, rel=0.1)
    assert np.percentile(p, 99) > 4 * 100  # a long right tail
    assert (p + o + 10 <= 1024).all() and (p >= 1).all() and (o >= 1).all()


def test_fixed_lengths():
    reqs = serve.make_requests(serve.Workload(num_requests=5, prompt_len=7, output_len=3),
                               np.random.default_rng(0))
    assert {len(r.prompt_ids) for r in reqs} == {7} and {r.max_tokens for r in reqs} == {3}
    shared = serve.make_requests(serve.Workload(num_requests=3, prompt_len=8, shared_prefix=4),
                                 np.random.default_rng(0))
    assert len({r.prompt_ids[:4] for r in shared}) == 1  # one prefix opens every prompt
    assert len({r.prompt_ids[4:] for r in shared}) == 3


def test_bad_inputs_are_named():
    assert serve.parse_slo("ttft_ms=500, tpot_ms=20") == {"ttft_ms": 500.0, "tpot_ms": 20.0}
    with pytest.raises(ValueError, match="ttft"):
        serve.parse_slo("ttft=5")
    with pytest.raises(ValueError, match="tpot_ms"):
        serve.parse_slo("tpot_ms=fast")
    with pytest.raises(ValueError, match="--rates"):
        serve.parse_rates("1,0")
    assert serve.parse_rates("1,inf") == [1.0, float("inf")]
    with pytest.raises(ValueError, match="max_total"):
        serve.Workload(prompt_len=900, output_len=200, max_total=1024)
    with pytest.raises(ValueError, match="lengths"):
        serve.Workload(lengths="sharegpt")


def test_percentiles_and_goodput():
    recs = [{"ok": True, "ttft_ms": float(i), "tpot_ms": 10.0, "itl_ms": [10.0], "e2e_ms": 50.0,
             "output_tokens": 5} for i in range(1, 101)]
    row = serve.summarize(2.0, recs, 10.0, {"ttft_ms": 50})
    assert row["ttft_ms"] == {"p50": 50.5, "p90": 90.1, "p99": 99.01}
    assert row["goodput_req_s"] == 5.0  # 50 of 100 requests within 50 ms, over 10 s
    assert row["throughput_tok_s"] == 50.0
