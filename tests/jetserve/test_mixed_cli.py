"""`jetserve serve --scheduling mixed`: it reaches the orchestrator's config, and what it
cannot run is a startup error naming the flag."""

import pytest

from jetserve.cli import build_parser
from jetserve.commands import serve


def _serve(*argv):
    return build_parser().parse_args(["serve", "--model", "random:tiny", "--max-seq-len",
                                      "64", *argv])


def test_scheduling_reaches_the_config_and_turns_is_the_default(monkeypatch):
    from jetserve import orchestrator

    seen = {}
    monkeypatch.setattr(orchestrator, "build", lambda model, **kw: seen.update(kw) or "orch")
    serve.build_orchestrator(_serve())
    assert seen["config"].scheduling == "turns"
    serve.build_orchestrator(_serve("--scheduling", "mixed", "--kv-layout", "paged"))
    assert seen["config"].scheduling == "mixed"
    with pytest.raises(SystemExit):
        _serve("--scheduling", "fused")


@pytest.mark.parametrize("argv, message", [
    ((), r"--scheduling mixed runs its steps on the paged KV cache: add --kv-layout paged"),
    (("--kv-layout", "paged", "--prefill-devices", "1", "--generate-devices", "1"),
     r"--scheduling mixed .* one slice: leave out --prefill-devices"),
    (("--kv-layout", "paged", "--speculative", "ngram:3", "--max-num-seqs", "4",
      "--max-num-batched-tokens", "10"),
     r"max_num_batched_tokens=10 \(--max-num-batched-tokens\) leaves no prefill token "
     r"beside max_num_seqs=4 verify rows of 4 tokens: give at least 17"),
    (("--kv-layout", "paged", "--step-policy", "decode-first"),
     r"--step-policy decode-first: --scheduling mixed runs every decoding sequence"),
    (("--kv-layout", "paged", "--role", "decode", "--prefill-workers", "127.0.0.1:1"),
     r"--scheduling mixed serves with --role both \(prompts and decoding in one step\), "
     r"not --role decode"),
])
def test_what_mixed_cannot_run_is_a_startup_error(argv, message):
    with pytest.raises(ValueError, match=message):
        serve.build_orchestrator(_serve("--scheduling", "mixed", *argv))
