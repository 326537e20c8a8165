"""The scheduling knobs users know from vLLM, checked and resolved against one engine.

  max_num_seqs            the most sequences decoding at once: a cap on the decode slots
                          the scheduler hands out (at most the engine's
                          max_concurrent_decodes, which sizes the KV cache and the compiled
                          batch; given alone on the command line it sizes them)
  max_num_batched_tokens  the token budget of one decode step: its decode tokens (one per
                          running sequence) plus the prefill tokens run since the previous
                          step; it also caps the prefill chunk at the budget less a full
                          batch of decode tokens, so one chunk always fits
  step_policy             who goes first when prompts wait and sequences decode:
                          prefill-first (the lowest TTFT: a generate engine with free slots
                          waits for the prompts on their way, then steps; a long prompt
                          still lets one step run between its chunks) or decode-first (a
                          steady TPOT: every step runs as soon as it can, and at most the
                          budget's prefill runs before it; step_budget.py enforces it)
  prefill_lookahead       decode-first only: a waiting prompt may be prefilled this many
                          decode steps before a running sequence's token budget ends (its
                          slot's end is known then), so its first token streams while that
                          sequence finishes; 0: only into a free sequence

Plain Python (no jax): the CLI, the orchestrator and the tests share these checks, and
every refusal names the field, its flag, the value and the limit.
"""

from __future__ import annotations

import dataclasses

PREFILL_FIRST = "prefill-first"
DECODE_FIRST = "decode-first"
STEP_POLICIES = (PREFILL_FIRST, DECODE_FIRST)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepPolicy:
    """One generate engine's scheduling knobs, resolved (`resolve`).

    Args:
      max_num_seqs: the most slots in use at once (<= the engine's slots).
      prefill_chunk: tokens per prefill call at most.
      max_num_batched_tokens: decode plus prefill tokens per step window; None: no
        budget (prefill-first without --max-num-batched-tokens).
      step_policy: PREFILL_FIRST or DECODE_FIRST.
      prefill_lookahead: decode steps ahead of a sequence's known end that a prompt may
        be prefilled for its slot (decode-first; 0: none).
    """

    max_num_seqs: int
    prefill_chunk: int
    max_num_batched_tokens: int | None = None
    step_policy: str = PREFILL_FIRST
    prefill_lookahead: int = 0

    def __post_init__(self):
        for name in ("max_num_seqs", "prefill_chunk"):
            _check_positive(name, getattr(self, name))
        if self.max_num_batched_tokens is not None:
            _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
            if self.max_num_seqs + self.prefill_chunk > self.max_num_batched_tokens:
                raise ValueError(
                    f"max_num_batched_tokens={self.max_num_batched_tokens} cannot hold "
                    f"max_num_seqs={self.max_num_seqs} decode tokens and one prefill chunk "
                    f"of {self.prefill_chunk}")
        check_step_policy(self.step_policy)
        check_lookahead(self.prefill_lookahead, self.step_policy)

    @property
    def decode_first(self) -> bool:
        return self.step_policy == DECODE_FIRST


def check_step_policy(value: object) -> None:
    if value not in STEP_POLICIES:
        raise ValueError(f"step_policy (--step-policy) must be one of "
                         f"{', '.join(STEP_POLICIES)}; got {value!r}")


def check_lookahead(value: object, step_policy: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"prefill_lookahead (--prefill-lookahead) must be an integer >= 0, "
                         f"got {value!r}")
    if value and step_policy != DECODE_FIRST:
        raise ValueError(f"prefill_lookahead={value} (--prefill-lookahead) applies to "
                         f"--step-policy decode-first; {step_policy} already prefills every "
                         f"waiting prompt at once")


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} (--{name.replace('_', '-')}) must be an integer >= 1, "
                         f"got {value!r}")


def check_knobs(*, max_num_seqs: int | None, max_num_batched_tokens: int | None,
                step_policy: str, prefill_lookahead: int = 0) -> None:
    """The checks that need no engine (OrchestratorConfig runs them)."""
    for name, v in (("max_num_seqs", max_num_seqs),
                    ("max_num_batched_tokens", max_num_batched_tokens)):
        if v is not None:
            _check_positive(name, v)
    check_step_policy(step_policy)
    check_lookahead(prefill_lookahead, step_policy)


def resolve(*, slots: int, max_prefill_length: int, chunked_prefill: bool,
            shares_devices: bool, max_num_seqs: int | None = None,
            max_num_batched_tokens: int | None = None, prefill_chunk: int | None = None,
            step_policy: str = PREFILL_FIRST, prefill_lookahead: int = 0) -> StepPolicy:
    """The knobs as given (None: not given) against an engine with `slots` decode slots
    whose prefill takes at most `max_prefill_length` tokens a call (and continues a prefix
    when `chunked_prefill`); `shares_devices`: prefill and decode run on the same devices
    (interleaved), the only case where a budget between decode steps means anything.

    Without a budget, decode-first lets one prefill chunk run between two steps.
    """
    check_knobs(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                step_policy=step_policy, prefill_lookahead=prefill_lookahead)
    seqs = slots if max_num_seqs is None else max_num_seqs
    if seqs > slots:
        raise ValueError(f"max_num_seqs={seqs} (--max-num-seqs) is more than the engine's "
                         f"{slots} decode slots (--max-concurrent-decodes); give at most "
                         f"{slots}, or --max-num-seqs alone to size the slots")
    if not shares_devices and (max_num_batched_tokens is not None
                               or step_policy == DECODE_FIRST):
        raise ValueError("max_num_batched_tokens / step_policy=decode-first "
                         "(--max-num-batched-tokens / --step-policy) bound the prefill run "
                         "between decode steps on the same devices: they apply to an "
                         "interleaved engine, not to prefill on devices of its own")
    chunk = prefill_chunk or max_prefill_length
    budget = max_num_batched_tokens
    if budget is not None:
        room = budget - seqs  # prefill tokens beside a full batch of decode tokens
        if room < 1:
            raise ValueError(f"max_num_batched_tokens={budget} (--max-num-batched-tokens) "
                             f"leaves no prefill token beside max_num_seqs={seqs} decode "
                             f"tokens: give at least {seqs + 1}")
        if prefill_chunk is not None and prefill_chunk > room:
            raise ValueError(f"prefill_chunk={prefill_chunk} (--prefill-chunk) and "
                             f"max_num_seqs={seqs} decode tokens do not fit "
                             f"max_num_batched_tokens={budget} (--max-num-batched-tokens): "
                             f"give a chunk of at most {room} or a budget of at least "
                             f"{seqs + prefill_chunk}")
        chunk = min(chunk, room)
        if chunk < max_prefill_length and not chunked_prefill:
            raise ValueError(f"max_num_batched_tokens={budget} (--max-num-batched-tokens) "
                             f"cuts prompts into chunks of {chunk} tokens, and this engine "
                             f"cannot continue a prefix: give at least "
                             f"{seqs + max_prefill_length}")
    elif step_policy == DECODE_FIRST:
        budget = seqs + chunk
    return StepPolicy(max_num_seqs=seqs, prefill_chunk=chunk,
                      max_num_batched_tokens=budget, step_policy=step_policy,
                      prefill_lookahead=prefill_lookahead)
