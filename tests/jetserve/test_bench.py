"""`jetserve bench`: probes, decode bench and compare-hf on tiny shapes (figures are not
asserted: benchmarks print them; these tests check what the figures are made of)."""

import json
import os

import numpy as np
import pytest

from jetserve import cli
from jetserve.bench import bandwidth, compare_hf, decode
from jetserve.model_loading import RANDOM_MODELS, build_engine, resolve_model

MB = 2**20


def test_bandwidth_probe_keeps_the_best_pass():
    r = bandwidth.stream_read_bandwidth(read_bytes=16 * MB, repeats=2)
    assert "numpy-threads" in r.passes
    assert all(len(v) == 2 for v in r.passes.values())
    assert r.best_bps == max(max(v) for v in r.passes.values())
    assert r.passes[r.method] and max(r.passes[r.method]) == r.best_bps
    with pytest.raises(ValueError, match="read_bytes"):
        bandwidth.stream_read_bandwidth(read_bytes=1000)


def test_device_probe_reads_the_array_in_device_memory():
    r = bandwidth.device_read_bandwidth(_one_device()[0], read_bytes=16 * MB, repeats=3)
    assert r.read_bytes == 16 * MB and len(r.passes["xla-sum"]) == 3
    assert r.best_bps == max(r.passes["xla-sum"]) > 0
    assert r.method == "xla-sum on cpu"


def test_matmul_probe_counts_flops():
    assert bandwidth.matmul_flops("float32", size=64, repeats=1) > 0
    with pytest.raises(ValueError, match="size"):
        bandwidth.matmul_flops(size=8)


def test_fill_slots_puts_context_in_every_slot():
    from engines import EngineConfig

    engine = build_engine("random:tiny", devices=_one_device(), engine_config=EngineConfig(
        max_concurrent_decodes=3, max_prefill_length=16, max_seq_len=64))
    params = engine.load_params()
    state = decode.fill_slots(engine, params, context=40)  # 3 chunks of 16
    assert np.asarray(state.lengths).tolist() == [40, 40, 40]
    times, state = decode.time_steps(engine, params, state, warmup=1, steps=2)
    assert len(times) == 2 and np.asarray(state.lengths).tolist() == [43, 43, 43]


def test_decode_config_errors():
    with pytest.raises(ValueError, match="batches"):
        decode.DecodeBenchConfig(batches=(0,))
    with pytest.raises(ValueError, match="max_seq_len"):
        decode.DecodeBenchConfig(context=100, max_seq_len=64)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from jetserve.bench.hf_model import make_hf_model

    # Larger weights than the default init, so greedy picks are clear of near-ties.
    return make_hf_model("tiny", str(tmp_path_factory.mktemp("hf")), seed=1, init_std=0.2)


def test_make_hf_model_loads_in_jetserve(tiny_hf):
    assert os.path.exists(os.path.join(tiny_hf, "config.json"))
    cfg, tiny = resolve_model(tiny_hf).config, RANDOM_MODELS["tiny"]
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "tie_word_embeddings"):
        assert getattr(cfg, f) == getattr(tiny, f), f


def test_compare_hf_same_tokens_as_transformers(tiny_hf):
    cfg = compare_hf.CompareConfig(model=tiny_hf, batches=(3,), prompt_len=8, new_tokens=16,
                                   repeats=2, max_seq_len=32, bf16=False, read_bytes=16 * MB)
    out = compare_hf.run(cfg, log=lambda *a: None)
    (row,) = out["rows"]
    assert row["batch"] == 3
    # Rates are timings: on a loaded machine T(16) may come out at or below T(1), and the
    # rate is then null (decode_rate). Either way no figure is asserted, only its form.
    rates = (row["jetserve_tok_s"], row["hf_tok_s"])
    for rate in rates:
        assert rate is None or (isinstance(rate, float) and rate > 0)
    if None in rates:
        assert row["ratio"] is None
    else:
        assert row["ratio"] == pytest.approx(rates[0] / rates[1], rel=0.01)
    # Same weights, greedy, f32: the serving path and transformers agree token for token.
    assert row["sequences_identical"] == 1.0
    assert out["serving_path"] == "orchestrator"


def test_decode_rate_unresolved_when_noise_swamps_the_decode():
    assert compare_hf.decode_rate(4, 11, t1=0.5, tn=1.5) == pytest.approx(40.0)
    # T(n) <= T(1): no rate, rather than a huge figure from a near-zero difference.
    assert compare_hf.decode_rate(4, 11, t1=0.5, tn=0.5) is None
    assert compare_hf.decode_rate(4, 11, t1=0.5, tn=0.4) is None


def test_cli_bench_decode_json(capsys):
    rc = cli.main(["bench", "decode", "--model", "random:tiny", "--batch", "1,2", "--context",
                   "8", "--steps", "3", "--warmup", "1", "--read-gb", "0.02", "--matmul-size", "128",
                   "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bandwidth_gbps"] == max(out["bandwidth_probes_gbps"])
    assert [r["batch"] for r in out["rows"]] == [1, 2]
    for r in out["rows"]:
        assert {"batch", "context", "step_ms", "floor_ms", "fraction_of_floor"} <= set(r)
        assert r["fraction_of_floor"] == pytest.approx(r["floor_ms"] / r["step_ms"], rel=0.01,
                                                      abs=1e-3)
        assert r["floor_ms"] >= max(r["memory_floor_ms"], r["compute_floor_ms"]) * 0.999
        assert r["fraction_of_floor_best"] >= r["fraction_of_floor"]  # best step <= median
    assert len(out["load_average_1m"]) == 2
    # The tiny model reads its weights (minus the input embedding) per step.
    tiny = RANDOM_MODELS["tiny"]
    expect = (tiny.param_count() - tiny.vocab_size * tiny.hidden_size) * 4
    assert out["weights_read_bytes"] == expect
    assert cli.main(["bench", "decode", "--batch", "x"]) == 2


def _one_device():
    import jax

    return jax.devices()[:1]


def test_cli_bench_batch_same_tokens_as_transformers(tiny_hf, capsys):
    rc = cli.main(["bench", "batch", "--model", tiny_hf, "--prompts", "10", "--min-len", "3",
                   "--max-len", "12", "--new-tokens", "4", "--slots", "4", "--hf-batch", "4",
                   "--torch-threads", "1", "--repeats", "2", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["prompts"], out["new_tokens"], out["torch_threads"], out["repeats"]) == (
        10, 4, 1, 2)
    assert out["batch_over_hf"] == pytest.approx(out["batch_tok_s"] / out["hf_tok_s"], rel=0.01)
    assert out["batch_over_engine_loop"] == pytest.approx(
        out["batch_tok_s"] / out["engine_loop_tok_s"], rel=0.01)
    # Same weights, greedy, f32: the batch job, the bare loop and transformers (left-padded
    # batches) agree token for token.
    assert out["same_as_hf"] == out["same_as_engine_loop"] == 1.0


def test_cli_bench_overhead_forwards_leading_options():
    args = cli.build_parser().parse_args(["bench", "overhead", "--batch", "8", "--json"])
    assert args.rest == ["--batch", "8", "--json"]


def test_bench_speculative_json(capsys):
    rc = cli.main(["bench", "speculative", "--model", "random:tiny", "--workloads", "random",
                   "--batch", "2", "--prompt-len", "24", "--new-tokens", "12", "--repeats", "1",
                   "--speculative", "ngram:2", "--json"])
    assert rc == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["workload"] == "random" and row["same_tokens"] == 1.0  # greedy: same tokens
    assert row["plain_tok_s"] > 0 and row["spec_tok_s"] > 0
    assert 0 <= row["acceptance_rate"] <= 1 and row["spec_steps"] <= row["plain_steps"]
    rc = cli.main(["bench", "speculative", "--speculative", "none"])
    assert rc == 2 and "must name a drafter" in capsys.readouterr().err
