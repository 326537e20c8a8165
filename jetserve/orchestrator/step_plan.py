"""A step plan as integers: the wire form of what process 0 decided, for every process.

Several processes serving one model (lockstep.py) must call prefill / insert / generate in
the same order with the same inputs. Process 0 alone sees requests, so each turn it writes
a `StepPlan` (jetserve/scheduling/plan.py: slots to free, prompts to admit, or stop) and
every process, process 0 included, applies the plan it gets back from the broadcast, so
all apply the same bits.

Wire form (uint32, so float bits and 32-bit seeds pass through a broadcast unchanged):
  header, fixed size for a given slot count B (every process passes the same shape):
    [kind, admissions, payload length] + B release flags + B admission records of
    [slot + 1 (0: score only, no slot), prompt length, flags, seed, top_k,
     temperature, top_p, min_p, repetition, frequency and presence penalty (f32 bits)]
  payload, sent only when something is admitted: the prompts' token ids one after
    another, padded to a power of two (its size is in the header, so every process knows
    the shape; few sizes, so few compiled broadcasts).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engines import SamplingParams
from jetserve.scheduling.plan import Admission, StepPlan

RUN, STOP = 0, 1
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
           "presence_penalty")
_RECORD = 5 + len(_FLOATS)  # slot + 1, length, flags, seed, top_k, floats
_PROMPT_LOGPROBS = 1  # flags bit
_MIN_PAYLOAD = 16

__all__ = ["Admission", "Broadcast", "PlanCodec", "StepPlan", "exchange"]

Broadcast = Callable[[np.ndarray], np.ndarray]  # process 0's array, on every process


class PlanCodec:
    """Encodes and decodes plans for an engine with `slots` decode slots."""

    def __init__(self, slots: int):
        self.slots = slots
        self.header_size = 3 + slots + slots * _RECORD

    def encode(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray | None]:
        B = self.slots
        if len(plan.admissions) > B:
            raise ValueError(f"a plan admits at most {B} prompts, got {len(plan.admissions)}")
        h = np.zeros(self.header_size, np.uint32)
        prompts = [a.prompt_ids for a in plan.admissions]
        total = sum(len(p) for p in prompts)
        h[0] = STOP if plan.stop else RUN
        h[1] = len(plan.admissions)
        h[2] = _bucket(total) if total else 0
        for s in plan.releases:
            h[3 + s] = 1
        for i, a in enumerate(plan.admissions):
            r = h[3 + B + i * _RECORD: 3 + B + (i + 1) * _RECORD]
            sp = a.sampling
            r[:5] = [0 if a.slot is None else a.slot + 1, len(a.prompt_ids),
                     _PROMPT_LOGPROBS if a.prompt_logprobs else 0, a.seed, sp.top_k]
            r[5:] = np.asarray([getattr(sp, f) for f in _FLOATS], np.float32).view(np.uint32)
        if not total:
            return h, None
        payload = np.zeros(h[2], np.uint32)
        payload[:total] = np.concatenate([np.asarray(p, np.uint32) for p in prompts])
        return h, payload

    def payload_size(self, header: np.ndarray) -> int:
        return int(header[2])

    def decode(self, header: np.ndarray, payload: np.ndarray | None) -> StepPlan:
        B = self.slots
        h = np.asarray(header, np.uint32)
        if h[0] == STOP:
            return StepPlan(stop=True)
        releases = tuple(int(s) for s in np.flatnonzero(h[3: 3 + B]))
        admissions, at = [], 0
        for i in range(int(h[1])):
            r = h[3 + B + i * _RECORD: 3 + B + (i + 1) * _RECORD]
            slot1, length, flags, seed, top_k = (int(x) for x in r[:5])
            floats = r[5:].view(np.float32).tolist()
            sampling = SamplingParams(top_k=top_k, **dict(zip(_FLOATS, floats, strict=True)))
            ids = tuple(int(t) for t in payload[at: at + length])
            at += length
            admissions.append(Admission(slot=None if slot1 == 0 else slot1 - 1, prompt_ids=ids,
                                        sampling=sampling, seed=seed,
                                        prompt_logprobs=bool(flags & _PROMPT_LOGPROBS)))
        return StepPlan(releases=releases, admissions=tuple(admissions))


def exchange(plan: StepPlan | None, codec: PlanCodec, broadcast: Broadcast) -> StepPlan:
    """Process 0 passes its plan, the others None; every process gets process 0's plan."""
    if plan is None:
        header, payload = np.zeros(codec.header_size, np.uint32), None
    else:
        header, payload = codec.encode(plan)
    header = np.asarray(broadcast(header), np.uint32)
    n = codec.payload_size(header)
    if n:
        payload = np.asarray(broadcast(payload if payload is not None
                                       else np.zeros(n, np.uint32)), np.uint32)
    return codec.decode(header, payload)


def _bucket(n: int) -> int:
    return max(_MIN_PAYLOAD, 1 << (n - 1).bit_length())
