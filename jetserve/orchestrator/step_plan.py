"""A step plan as integers: the wire form of what process 0 decided, for every process.

Several processes serving one model (lockstep.py) must call prefill / insert / generate in
the same order with the same inputs. Process 0 alone sees requests, so each turn it writes
a `StepPlan` (jetserve/scheduling/plan.py: slots to free, prompts to admit, or stop) and
every process, process 0 included, applies the plan it gets back from the broadcast, so
all apply the same bits.

Wire form (uint32, so float bits and 32-bit seeds pass through a broadcast unchanged):
  header, fixed size for a given slot count B (every process passes the same shape):
    [kind, admissions, payload length, step mask] + B release flags + B admission
    records of
    [slot + 1 (0: score only, no slot), prompt length, flags, seed, top_k, logit_bias
     pairs, LoRA adapter id (engines.lora_registry.adapter_id; 0: the base model),
     temperature, top_p, min_p, repetition, frequency and presence penalty (f32
     bits)]
  payload, sent only when something is admitted: the prompts' token ids one after
    another, then each admission's logit_bias as (token id, bias f32 bits) pairs, padded
    to a power of two (its size is in the header, so every process knows the shape; few
    sizes, so few compiled broadcasts).

Mixed steps (`--scheduling mixed`, orchestrator/mixed_lockstep.py) send a `MixedPlan`
instead: the engine calls process 0 made since the last one, as `MixedPlanCodec` words.
  header: [kind, payload length]
  payload: [host ops, then each as (length, op, its integers)] (the page planner's
    free_slot / start_prompt / init_decode_state and the prefix cache's lookup / release
    / adopt / make_room / clear, in the order process 0 made them), [rows, then each as a row
    record: slot, start, chunk length, flags (last, fresh), seed, top_k, logit_bias
    pairs, LoRA adapter id, six f32 bits of sampling, then the chunk's ids, [its context
    (a prefix-cache hit's tokens, MixedRow.context), then each] and the bias pairs], [slots still in their prompt, then each], token mask positions (0: no mask),
    page table width and LoRA program flag (a warm-up step's), slot, tokens and adapter id
    (a prompt started through an adapter, kind HOLD; the adapter of a prompt scored),
    [the prompt scored (kind SCORE)], [the pages a HOLD's prefix-cache hit links].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from engines import SamplingParams
from engines.lora_registry import adapter_id
from engines.mixed_batch import MixedRow
from jetserve.scheduling.plan import Admission, StepPlan

RUN, STOP = 0, 1
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
           "presence_penalty")
_INTS = 7  # slot + 1, length, flags, seed, top_k, logit_bias pairs, adapter id
_RECORD = _INTS + len(_FLOATS)
_PROMPT_LOGPROBS, _CONSTRAINED = 1, 2  # flags bits
_HEAD = 4  # kind, admissions, payload length, step mask
_MIN_PAYLOAD = 16

__all__ = ["Admission", "Broadcast", "MixedPlan", "MixedPlanCodec", "PlanCodec", "StepPlan",
           "exchange"]

Broadcast = Callable[[np.ndarray], np.ndarray]  # process 0's array, on every process


class PlanCodec:
    """Encodes and decodes plans for an engine with `slots` decode slots; `adapter_name`
    turns an adapter id back into the name it was loaded under (every process loads the
    same adapters: --lora-modules)."""

    def __init__(self, slots: int, adapter_name: Callable[[int], str] | None = None):
        self.slots = slots
        self._adapter_name = adapter_name
        self.header_size = _HEAD + slots + slots * _RECORD

    def encode(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray | None]:
        B = self.slots
        if len(plan.admissions) > B:
            raise ValueError(f"a plan admits at most {B} prompts, got {len(plan.admissions)}")
        h = np.zeros(self.header_size, np.uint32)
        prompts = [np.asarray(a.prompt_ids, np.uint32) for a in plan.admissions]
        biases = [_bias_words(a.sampling.logit_bias) for a in plan.admissions]
        total = sum(len(p) for p in prompts) + sum(len(b) for b in biases)
        h[0] = STOP if plan.stop else RUN
        h[1] = len(plan.admissions)
        h[2] = _bucket(total) if total else 0
        h[3] = plan.step_mask
        for s in plan.releases:
            h[_HEAD + s] = 1
        for i, a in enumerate(plan.admissions):
            r = h[_HEAD + B + i * _RECORD: _HEAD + B + (i + 1) * _RECORD]
            sp = a.sampling
            flags = (_PROMPT_LOGPROBS if a.prompt_logprobs else 0) | (
                _CONSTRAINED if a.constrained else 0)
            r[:_INTS] = [0 if a.slot is None else a.slot + 1, len(a.prompt_ids), flags,
                         a.seed, sp.top_k, len(sp.logit_bias),
                         _ident(a.adapter)]
            r[_INTS:] = np.asarray([getattr(sp, f) for f in _FLOATS], np.float32).view(np.uint32)
        if not total:
            return h, None
        payload = np.zeros(h[2], np.uint32)
        payload[:total] = np.concatenate(prompts + biases)
        return h, payload

    def _adapter(self, ident: int) -> str | None:
        return _adapter_name(ident, self._adapter_name)

    def payload_size(self, header: np.ndarray) -> int:
        return int(header[2])

    def decode(self, header: np.ndarray, payload: np.ndarray | None) -> StepPlan:
        B = self.slots
        h = np.asarray(header, np.uint32)
        if h[0] == STOP:
            return StepPlan(stop=True)
        releases = tuple(int(s) for s in np.flatnonzero(h[_HEAD: _HEAD + B]))
        records = [h[_HEAD + B + i * _RECORD: _HEAD + B + (i + 1) * _RECORD]
                   for i in range(int(h[1]))]
        at = sum(int(r[1]) for r in records)  # the biases follow every prompt
        admissions, start = [], 0
        for r in records:
            slot1, length, flags, seed, top_k, pairs, ident = (int(x) for x in r[:_INTS])
            floats = r[_INTS:].view(np.float32).tolist()
            words = payload[at: at + 2 * pairs].reshape(pairs, 2)
            at += 2 * pairs
            bias = tuple(zip(words[:, 0].tolist(), words[:, 1].view(np.float32).tolist(),
                             strict=True))
            sampling = SamplingParams(top_k=top_k, logit_bias=bias,
                                      **dict(zip(_FLOATS, floats, strict=True)))
            ids = tuple(int(t) for t in payload[start: start + length])
            start += length
            admissions.append(Admission(slot=None if slot1 == 0 else slot1 - 1, prompt_ids=ids,
                                        sampling=sampling, seed=seed,
                                        prompt_logprobs=bool(flags & _PROMPT_LOGPROBS),
                                        constrained=bool(flags & _CONSTRAINED),
                                        adapter=self._adapter(ident)))
        return StepPlan(releases=releases, admissions=tuple(admissions),
                        step_mask=bool(h[3]))


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


# A MixedPlan's kinds: a planned mixed step, a warm-up step over a page table of trash
# (MixedWorker.warm), a prompt scored (prompt log-probs), host ops alone, stop.
STEP, WARM, SCORE, HOLD, IDLE = "step", "warm", "score", "hold", "idle"
_KINDS = (STEP, WARM, SCORE, HOLD, IDLE, "stop")
# Host ops, replayed on the page planner and the prefix cache in process 0's order:
# (FREE, slot), (START, slot, tokens, *pages a prefix-cache hit links), (INIT,), (LOOKUP, key bytes, *key words, *tokens),
# (RELEASE, hit), (ADOPT, hit, *pages), (MAKE_ROOM, pages), (CLEAR,); a hit is numbered
# by its lookup's place among all of process 0's lookups.
FREE, START, INIT, LOOKUP, RELEASE, ADOPT, MAKE_ROOM, CLEAR = range(8)
_LAST, _FRESH = 1, 2  # a row's flags


@dataclasses.dataclass(frozen=True)
class MixedPlan:
    """Process 0's engine calls since its last plan (mixed steps over several processes):
    host `ops` (tuples of integers, the module doc's) to replay, then
    the one device call of `kind`: a step of `rows` (`prefilling`: the slots still in
    their prompt; `mask_positions`: a token mask of that many positions per slot follows
    as its own array, 0 none), a warm-up step of `rows` over `width` pages of trash (with
    the LoRA pool when `lora`), the scoring of `prompt` (through `adapter`), or `slot`
    starting a `tokens`-token prompt through LoRA `adapter` (holding its row may load it
    on the device)."""

    kind: str = IDLE
    ops: tuple[tuple[int, ...], ...] = ()
    rows: tuple[MixedRow, ...] = ()
    prefilling: tuple[int, ...] = ()
    mask_positions: int = 0
    width: int = 0
    lora: bool = False
    slot: int = 0
    tokens: int = 0
    adapter: str | None = None
    prompt: tuple[int, ...] = ()
    shared: tuple[int, ...] = ()  # the prompt's pages a prefix-cache hit links (HOLD)

    @property
    def stop(self) -> bool:
        return self.kind == "stop"


class MixedPlanCodec:
    """MixedPlan <-> uint32 words (module doc); a fixed header of two words.
    `adapter_name` turns an adapter id back into the name it was loaded under (every
    process loads the same adapters: --lora-modules)."""

    header_size = 2

    def __init__(self, adapter_name: Callable[[int], str] | None = None):
        self._adapter_name = adapter_name

    def _adapter(self, ident: int) -> str | None:
        return _adapter_name(ident, self._adapter_name)

    def encode(self, plan: MixedPlan) -> tuple[np.ndarray, np.ndarray | None]:
        if plan.stop:
            return np.asarray([_KINDS.index("stop"), 0], np.uint32), None
        words: list[int] = [len(plan.ops)]
        for op in plan.ops:
            words += [len(op), *op]
        words.append(len(plan.rows))
        for r in plan.rows:
            sp = r.sampling or SamplingParams()
            if r.sampling is not None and r.seed is None:
                raise ValueError(f"slot {r.slot}: a fresh row's seed is drawn before the plan "
                                 "is sent (every process samples alike)")
            flags = (_LAST if r.last else 0) | (_FRESH if r.sampling is not None else 0)
            words += [r.slot, r.start, len(r.chunk), flags, r.seed or 0, sp.top_k,
                      len(sp.logit_bias), _ident(r.adapter)]
            words += np.asarray([getattr(sp, f) for f in _FLOATS], np.float32).view(
                np.uint32).tolist()
            words += [*r.chunk, len(r.context), *r.context]
            words += _bias_words(sp.logit_bias).tolist()
        words += [len(plan.prefilling), *plan.prefilling, plan.mask_positions, plan.width,
                  int(plan.lora), plan.slot, plan.tokens, _ident(plan.adapter),
                  len(plan.prompt), *plan.prompt, len(plan.shared), *plan.shared]
        header = np.asarray([_KINDS.index(plan.kind), _bucket(len(words))], np.uint32)
        payload = np.zeros(header[1], np.uint32)
        payload[:len(words)] = words
        return header, payload

    def payload_size(self, header: np.ndarray) -> int:
        return int(header[1])

    def decode(self, header: np.ndarray, payload: np.ndarray | None) -> MixedPlan:
        kind = _KINDS[int(header[0])]
        if kind == "stop":
            return MixedPlan(kind="stop")
        w = np.asarray(payload, np.uint32)
        at = 0

        def take(n: int) -> list[int]:
            nonlocal at
            at += n
            return w[at - n: at].tolist()

        ops = tuple(tuple(take(take(1)[0])) for _ in range(take(1)[0]))
        rows = []
        for _ in range(take(1)[0]):
            slot, start, n, flags, seed, top_k, pairs, ident = take(8)
            floats = w[at: at + len(_FLOATS)].view(np.float32).tolist()
            at += len(_FLOATS)
            chunk = take(n)
            context = take(take(1)[0])
            bias = w[at: at + 2 * pairs].reshape(pairs, 2)
            at += 2 * pairs
            sampling = None
            if flags & _FRESH:
                sampling = SamplingParams(
                    top_k=top_k, **dict(zip(_FLOATS, floats, strict=True)),
                    logit_bias=tuple(zip(bias[:, 0].tolist(),
                                         bias[:, 1].view(np.float32).tolist(), strict=True)))
            rows.append(MixedRow(slot=slot, chunk=chunk, start=start, last=bool(flags & _LAST),
                                 sampling=sampling, seed=seed if sampling else None,
                                 adapter=self._adapter(ident), context=context))
        prefilling = tuple(take(take(1)[0]))
        positions, width, lora, slot, tokens, ident = take(6)
        prompt = tuple(take(take(1)[0]))
        shared = tuple(take(take(1)[0]))
        return MixedPlan(shared=shared, kind=kind, ops=ops, rows=tuple(rows), prefilling=prefilling,
                         mask_positions=positions, width=width, lora=bool(lora), slot=slot,
                         tokens=tokens, adapter=self._adapter(ident), prompt=prompt)


def key_words(key: str) -> list[int]:
    """A prefix-cache key as [its UTF-8 length, then its bytes in uint32 words]."""
    raw = key.encode()
    padded = raw + b"\0" * (-len(raw) % 4)
    return [len(raw), *np.frombuffer(padded, np.uint32).tolist()]


def key_of(words) -> tuple[str, int]:
    """(the key at the start of `words`, how many words it took)."""
    n = int(words[0])
    size = 1 + -(-n // 4)
    raw = np.asarray(words[1:size], np.uint32).tobytes()[:n]
    return raw.decode(), size


def _ident(adapter: str | None) -> int:
    return 0 if adapter is None else adapter_id(adapter)


def _adapter_name(ident: int, name_of: Callable[[int], str] | None) -> str | None:
    """The adapter of id `ident` (0: None, the base model)."""
    if not ident:
        return None
    if name_of is None:
        raise ValueError(f"the plan names LoRA adapter id {ident}, and this engine "
                         "serves no adapters")
    return name_of(ident)


def _bias_words(bias: tuple[tuple[int, float], ...]) -> np.ndarray:
    """logit_bias pairs -> [id, f32 bits, id, f32 bits, ...] as uint32."""
    words = np.zeros((len(bias), 2), np.uint32)
    if bias:
        words[:, 0] = [t for t, _ in bias]
        words[:, 1] = np.asarray([b for _, b in bias], np.float32).view(np.uint32)
    return words.reshape(-1)


def _bucket(n: int) -> int:
    return max(_MIN_PAYLOAD, 1 << (n - 1).bit_length())
