"""--max-num-seqs, --max-num-batched-tokens and --step-policy on `jetserve serve` and
`jetserve batch`: what they set, and the startup errors that name flag, value and limit."""

import jax
import pytest

from jetserve.cli import build_parser
from jetserve.commands import batch, serve


def _serve(*argv):
    return build_parser().parse_args(["serve", "--model", "random:tiny", *argv])


def _built(monkeypatch, *argv):
    from jetserve import orchestrator

    seen = {}
    monkeypatch.setattr(orchestrator, "build", lambda model, **kw: seen.update(kw) or "orch")
    serve.build_orchestrator(_serve("--max-seq-len", "64", *argv))
    return seen["engine_config"], seen["config"]


@pytest.mark.parametrize("argv, slots, knobs", [
    ((), 8, (None, None, "prefill-first")),
    (("--max-num-seqs", "4"), 4, (4, None, "prefill-first")),  # alone: it sizes the slots
    (("--max-concurrent-decodes", "8", "--max-num-seqs", "4"), 8, (4, None, "prefill-first")),
    (("--step-policy", "decode-first", "--max-num-batched-tokens", "48"), 8,
     (None, 48, "decode-first")),
])
def test_serve_flags_reach_the_engine_and_the_orchestrator(monkeypatch, argv, slots, knobs):
    ec, config = _built(monkeypatch, *argv)
    assert ec.max_concurrent_decodes == slots
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.step_policy) == knobs


def test_an_unknown_step_policy_is_a_usage_error():
    with pytest.raises(SystemExit):
        _serve("--step-policy", "fcfs")


@pytest.mark.parametrize("argv, message", [
    (("--max-concurrent-decodes", "4", "--max-num-seqs", "6"),
     r"max_num_seqs=6 \(--max-num-seqs\) is more than the engine's 4 decode slots"),
    (("--max-num-seqs", "4", "--max-num-batched-tokens", "4"),
     r"--max-num-batched-tokens\) leaves no prefill token .* give at least 5"),
    (("--max-num-batched-tokens", "40", "--prefill-chunk", "64"),
     r"prefill_chunk=64 \(--prefill-chunk\).* at most 32"),
    (("--max-num-seqs", "0"), r"max_num_seqs \(--max-num-seqs\) must be an integer >= 1, got 0"),
    (("--prefill-devices", "1", "--generate-devices", "1", "--step-policy", "decode-first"),
     "apply to an interleaved engine"),
])
def test_serve_refuses_bad_knobs_at_startup(argv, message):
    with pytest.raises(ValueError, match=message):
        serve.build_orchestrator(_serve("--max-seq-len", "64", *argv))


def test_batch_takes_the_knobs(tmp_path):
    args = build_parser().parse_args([
        "batch", "--model", "random:tiny", "--max-seq-len", "64", "--input", "in.jsonl",
        "--output", str(tmp_path / "out.jsonl"), "--max-num-seqs", "2",
        "--step-policy", "decode-first"])
    orch = batch._orchestrator(args, jax.devices()[:1])
    assert orch.generate_engines[0].max_concurrent_decodes == 2
    assert (orch.policy.max_num_seqs, orch.policy.decode_first) == (2, True)
    assert orch.policy.max_num_batched_tokens == 2 + orch.policy.prefill_chunk


@pytest.mark.parametrize("argv, budgets", [
    ((), (0, 0)),
    (("--enable-prefix-caching",), (256 * 2**20, 0)),
    (("--enable-prefix-caching", "--prefix-cache-hbm-mb", "8"), (8 * 2**20, 0)),
    (("--prefix-cache-hbm-mb", "8", "--prefix-cache-host-mb", "4",
      "--no-enable-prefix-caching"), (0, 0)),
])
def test_vllm_names_of_the_cache_and_length_knobs(monkeypatch, argv, budgets):
    """--max-model-len, --block-size and --enable-prefix-caching, vLLM's names, set what
    --max-seq-len, --page-size and the prefix-cache budgets do."""
    from jetserve import orchestrator

    seen = {}
    monkeypatch.setattr(orchestrator, "build", lambda model, **kw: seen.update(kw) or "orch")
    serve.build_orchestrator(_serve("--max-model-len", "64", "--kv-layout", "paged",
                                    "--block-size", "8", *argv))
    ec, config = seen["engine_config"], seen["config"]
    assert (ec.max_seq_len, ec.page_size) == (64, 8)
    assert (config.prefix_cache_hbm_bytes, config.prefix_cache_host_bytes) == budgets
