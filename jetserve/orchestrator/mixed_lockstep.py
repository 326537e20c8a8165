"""Mixed steps over several processes (jax.distributed): the mixed loop, its engine calls
made in lock step.

Every device call is one SPMD program over the devices of every process, so each process
must make the same calls in the same order with the same inputs. Process 0 alone has the
requests: it runs the mixed generate thread (mixed_worker.py) unchanged, over a
`LockStepPlanner` in place of its page planner. The others run `Follower.run` in their
main thread and never see a request.

  process 0  the mixed thread plans as in one process. Its host-side calls on the page
             planner (free_slot, start_prompt: pages only) run at once and are noted;
             before each device call (a mixed step, a warm-up step, a prompt scored, a
             fresh decode state, a prompt started through a LoRA adapter, whose row may
             be loaded) the noted calls and the device call's inputs go out as one
             `MixedPlan` (step_plan.py: its wire form), and process 0 runs the call with
             the plan's inputs as every process decodes them (sampling floats as f32, each
             fresh row's seed drawn here)
  all        exchange ── broadcast_from_primary of the encoded plan, then of the token
             mask when the step takes one (structured output: grammars live on process 0)
  others     replay the host calls on their own page planner (so every page table is
             alike), then make the device call

Results are read on process 0 alone (the read-back path of one process). When process 0
has nothing to send for `idle_wait_s` it sends the calls it noted (or none): the others
never wait long in a broadcast. `stop` sends a stop plan; every follower leaves its loop.
A call that fails fails on every process alike (same call, same state): process 0 acts
on the error as in one process (a prompt whose adapter finds every row held waits; a
failed step ends the requests it held and makes a fresh decode state, sent as any other
call), the others log it and go on.

LoRA adapters (--lora-modules, loaded alike by every process at start) are named in the
plan by id. The prefix cache (--prefix-cache-hbm-mb, in the KV pages: prefix_stores.
PageStore) is every process's own: process 0's lookups, releases, adoptions and
evictions are host calls noted as the page planner's are (`JournaledCache`), so every
cache holds the same blocks in the same pages. Its host tier (--prefix-cache-host-mb)
is refused by name at start: moving a block down reads it off the device while process 0
plans, a call the others would not make.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from typing import Any

import numpy as np

from engines import Engine
from engines.lora_registry import RowsBusy, adapter_id
from engines.mixed_batch import MixedRow
from engines.token_mask import mask_words
from jetserve import distributed
from jetserve.orchestrator.config import MIXED, OrchestratorConfig
from jetserve.orchestrator.mixed import MixedOrchestrator
from jetserve.orchestrator.mixed_worker import MixedWorker
from jetserve.orchestrator.step_masks import mask_kwargs
from jetserve.orchestrator.step_plan import (
    ADOPT,
    CLEAR,
    FREE,
    HOLD,
    IDLE,
    INIT,
    LOOKUP,
    MAKE_ROOM,
    RELEASE,
    SCORE,
    START,
    STEP,
    WARM,
    Broadcast,
    MixedPlan,
    MixedPlanCodec,
    exchange,
    key_of,
    key_words,
)

log = logging.getLogger(__name__)


def run_plan(planner: Any, params: Any, state: Any, plan: MixedPlan,
             mask: np.ndarray | None) -> tuple[Any, Any]:
    """The plan's device call on `planner` (a PagePlanner): (new state, its result)."""
    if plan.kind == STEP:
        return planner.mixed_step(params, state, list(plan.rows), prefilling=plan.prefilling,
                                  **mask_kwargs(mask))
    if plan.kind == WARM:
        return planner.warm_step(params, state, plan.width, list(plan.rows), **mask_kwargs(mask),
                                 **({"adapters": True} if plan.lora else {}))
    if plan.kind == SCORE:
        return state, planner.prompt_logprobs(params, np.asarray(plan.prompt, np.int32),
                                              adapter=plan.adapter)
    if plan.kind == HOLD:
        planner.start_prompt(plan.slot, plan.tokens, adapter=plan.adapter,
                             shared_pages=plan.shared)
    return state, None


def _seeded(rows) -> tuple[MixedRow, ...]:
    """The rows with each fresh row's seed drawn (as pack_rows would, here once for all)."""
    out = []
    for r in rows:
        if r.sampling is not None and r.seed is None:
            seed = r.sampling.seed if r.sampling.seed is not None else secrets.randbits(31)
            r = dataclasses.replace(r, seed=seed)
        out.append(r)
    return tuple(out)


class LockStepPlanner:
    """Process 0's page planner for the mixed thread: host calls noted, device calls sent
    first (module doc). Everything else is the planner's."""

    def __init__(self, planner: Any, broadcast: Broadcast, idle_wait_s: float):
        self.planner = planner
        self._broadcast = broadcast
        self._codec = codec(planner)
        self._ops: list[tuple[int, ...]] = []
        self.idle_wait_s = idle_wait_s
        self._sent = time.monotonic()
        self.plans = 0  # sent

    def __getattr__(self, name: str) -> Any:
        if name == "planner":
            raise AttributeError(name)
        return getattr(self.planner, name)

    # ---- host calls: run now, sent with the next plan -----------------------------------

    def free_slot(self, slot: int) -> None:
        self.planner.free_slot(slot)
        self.note(FREE, slot)

    def note(self, *op: int) -> None:
        """A host call made on process 0, sent with the next plan."""
        self._ops.append(op)

    def start_prompt(self, slot: int, tokens: int, adapter: str | None = None, *,
                     shared_pages=()) -> None:
        """The prompt's pages now (noted); through a LoRA adapter, a call of its own
        (its row held, maybe loaded, on every process)."""
        shared = tuple(int(p) for p in shared_pages)
        if adapter is None or not hasattr(self.planner, "hold_adapter"):
            # (an adapter without a LoRA engine: refused before anything is taken)
            self.planner.start_prompt(slot, tokens, adapter, shared_pages=shared)
            self.note(START, slot, tokens, *shared)
            return
        self.planner.adapters.name_of(adapter_id(adapter))  # UnknownAdapter, before sending
        self._call(MixedPlan(kind=HOLD, slot=slot, tokens=tokens, adapter=adapter,
                             shared=shared), None, None, None)

    # ---- device calls: the plan first ---------------------------------------------------

    def mixed_step(self, params: Any, state: Any, rows, *, prefilling=(), token_mask=None):
        return self._call(MixedPlan(kind=STEP, rows=_seeded(rows), prefilling=tuple(prefilling),
                                    mask_positions=_positions(token_mask)),
                          params, state, token_mask)

    def warm_step(self, params: Any, state: Any, width: int, rows, token_mask=None, *,
                  adapters: bool = False):
        return self._call(MixedPlan(kind=WARM, rows=_seeded(rows), width=width, lora=adapters,
                                    mask_positions=_positions(token_mask)),
                          params, state, token_mask)

    def prompt_logprobs(self, params: Any, tokens, true_length=None, *, adapter=None):
        prompt = tuple(int(t) for t in np.asarray(tokens).reshape(-1))
        return self._call(MixedPlan(kind=SCORE, prompt=prompt, adapter=adapter), params, None,
                          None)[1]

    def init_decode_state(self) -> Any:
        self.note(INIT)
        self._send(MixedPlan(kind=IDLE))
        return self.planner.init_decode_state()

    def heartbeat(self) -> None:
        """Sends the noted host calls when nothing went out for idle_wait_s (the followers
        wait in the broadcast meanwhile)."""
        if time.monotonic() - self._sent >= self.idle_wait_s:
            self._send(MixedPlan(kind=IDLE))

    def stop(self) -> None:
        """The followers leave their loops (after the host calls still noted)."""
        if self._ops:
            self._send(MixedPlan(kind=IDLE))
        exchange(MixedPlan(kind="stop"), self._codec, self._broadcast)

    def _send(self, plan: MixedPlan) -> MixedPlan:
        plan = dataclasses.replace(plan, ops=tuple(self._ops))
        self._ops = []
        out = exchange(plan, self._codec, self._broadcast)
        self._sent = time.monotonic()
        self.plans += 1
        return out

    def _call(self, plan: MixedPlan, params: Any, state: Any, token_mask) -> tuple[Any, Any]:
        plan = self._send(plan)
        if token_mask is not None:
            token_mask = np.asarray(self._broadcast(np.asarray(token_mask, np.int32)), np.int32)
        # The plan's rows as every process decoded them (f32 sampling, seeds drawn).
        return run_plan(self.planner, params, state, plan, token_mask)


def codec(planner: Any) -> MixedPlanCodec:
    """The plans' codec for this engine (adapter ids back to the names it loaded)."""
    adapters = getattr(planner, "adapters", None)
    return MixedPlanCodec(adapters.name_of if adapters is not None else None)


def _positions(token_mask) -> int:
    """A token mask's positions per slot as the plan says it (0: no mask)."""
    if token_mask is None:
        return 0
    mask = np.asarray(token_mask)
    return 1 if mask.ndim == 2 else mask.shape[1]


class JournaledCache:
    """Process 0's prefix cache: each call that changes it is noted on the planner (its
    hits numbered in lookup order, `_Hit`), so the others replay it. Everything else is
    the cache's."""

    def __init__(self, cache: Any, planner: LockStepPlanner):
        self.__dict__.update(cache=cache, planner=planner, _lookups=0)

    def __getattr__(self, name: str) -> Any:
        if name == "cache":
            raise AttributeError(name)
        return getattr(self.cache, name)

    def __setattr__(self, name: str, value: Any) -> None:  # `events` (KV events) included
        setattr(self.cache, name, value)

    def lookup(self, key: str, tokens, wait_s: float = 0.0, *, count: bool = True) -> _Hit:
        hit = self.cache.lookup(key, tokens, count=count)  # no wait: one thread here
        self.planner.note(LOOKUP, *key_words(key), *(int(t) for t in tokens))
        self.__dict__["_lookups"] += 1
        return _Hit(hit, self._lookups - 1, self.planner)

    def adopt(self, hit: _Hit, pages) -> None:
        self.cache.adopt(hit.hit, pages)
        self.planner.note(ADOPT, hit.number, *(int(p) for p in pages))

    def counted(self, hit: _Hit) -> None:  # the stats only: process 0's
        self.cache.counted(hit.hit)

    def make_room(self, pages: int) -> int:
        self.planner.note(MAKE_ROOM, pages)
        return self.cache.make_room(pages)

    def clear(self) -> None:
        self.planner.note(CLEAR)
        self.cache.clear()


class _Hit:
    """A hit of process 0's cache with its number; `release` is noted."""

    def __init__(self, hit: Any, number: int, planner: LockStepPlanner):
        self.hit, self.number, self._planner = hit, number, planner
        self.tokens, self.pages, self.blocks = hit.tokens, hit.pages, hit.blocks

    def release(self) -> None:
        if not self.hit._released:
            self._planner.note(RELEASE, self.number)
        self.hit.release()


class Follower:
    """A process other than 0: replays process 0's plans on its own page planner."""

    def __init__(self, planner: Any, params: Any, state: Any, broadcast: Broadcast,
                 cache: Any = None):
        self.planner, self.params, self.state, self.cache = planner, params, state, cache
        self._hits: dict[int, Any] = {}  # process 0's hit number -> this cache's hit
        self._lookups = 0
        self._broadcast = broadcast
        self._codec = codec(planner)
        self.plans = self.failures = 0

    def run(self) -> None:
        """Until process 0 stops."""
        while True:
            plan = exchange(None, self._codec, self._broadcast)
            if plan.stop:
                return
            self.plans += 1
            self.apply(plan)

    def apply(self, plan: MixedPlan) -> None:
        for op, *args in plan.ops:
            self._replay(op, args)
        mask = None
        if plan.mask_positions:
            g = self.planner.page_geometry
            lead = (g.slots,) if plan.mask_positions == 1 else (g.slots, plan.mask_positions)
            mask = np.asarray(self._broadcast(np.zeros(
                (*lead, mask_words(self.planner.vocab_size)), np.int32)), np.int32)
        try:
            self.state, _ = run_plan(self.planner, self.params, self.state, plan, mask)
        except Exception as e:  # noqa: BLE001 -- process 0's call failed alike; it acts on it
            self.failures += 1
            if not isinstance(e, RowsBusy):  # a prompt that waits for an adapter row
                log.exception("a %s call of process 0's plan failed here too", plan.kind)


    def _replay(self, op: int, args: list[int]) -> None:
        """One of process 0's host calls, on this process's planner and cache."""
        if op == FREE:
            self.planner.free_slot(args[0])
        elif op == START:
            self.planner.start_prompt(args[0], args[1], shared_pages=args[2:])
        elif op == INIT:
            self.state = self.planner.init_decode_state()
        elif op == LOOKUP:
            key, used = key_of(args)
            self._hits[self._lookups] = self.cache.lookup(key, args[used:], count=False)
            self._lookups += 1
        elif op == RELEASE:
            self._hits.pop(args[0]).release()
        elif op == ADOPT:
            self.cache.adopt(self._hits.pop(args[0]), args[1:])
        elif op == MAKE_ROOM:
            self.cache.make_room(args[0])
        elif op == CLEAR:
            self.cache.clear()
        else:
            raise ValueError(f"a plan with host op {op}, which this process does not know")


class LockStepMixedWorker(MixedWorker):
    """Process 0's mixed thread over a LockStepPlanner: sends the calls it noted when idle,
    and a stop plan when it ends."""

    def _turn(self) -> None:
        super()._turn()
        self.engine.heartbeat()

    def run(self) -> None:
        try:
            super().run()
        finally:
            self.engine.stop()


def refuse(config: OrchestratorConfig) -> None:
    """What mixed steps over several processes do not serve, by name."""
    if config.prefix_cache_host_bytes:
        raise ValueError("--scheduling mixed over several processes keeps its prefix cache "
                         "in the KV pages alone (moving a block to the host tier reads it "
                         "off the device while process 0 plans): leave out "
                         "--prefix-cache-host-mb, or use one process")


class MixedLockStepOrchestrator(MixedOrchestrator):
    """`--scheduling mixed` over several processes (module doc). On process 0 it serves as
    MixedOrchestrator does; on the others `run` follows process 0's plans until it stops.

    primary: whether this is process 0 (default: jax.process_index() == 0); broadcast:
    process 0's array on every process (default: distributed.broadcast_from_primary);
    idle_wait_s: the longest process 0 goes without sending a plan.
    """

    worker = LockStepMixedWorker

    def __init__(self, engine: Engine, params: Any, config: OrchestratorConfig | None = None,
                 *, primary: bool | None = None, broadcast: Broadcast | None = None,
                 idle_wait_s: float = 0.25):
        config = config or OrchestratorConfig(scheduling=MIXED)
        refuse(config)
        super().__init__(engine, params, config)
        self.primary = distributed.is_primary() if primary is None else primary
        broadcast = broadcast or distributed.broadcast_from_primary
        w = self._generate[0]
        self.follower = None if self.primary else Follower(w.engine, params, w.state, broadcast,
                                                           w.cache)
        if self.primary:
            w.engine = LockStepPlanner(w.engine, broadcast, idle_wait_s)
            if w.cache is not None:
                w.cache = JournaledCache(w.cache, w.engine)

    def submit_many(self, requests):
        if not self.primary:
            raise RuntimeError("requests go to process 0; this process follows its plans")
        return super().submit_many(requests)

    def run(self) -> None:
        """A follower's loop, in its main thread, until process 0 stops."""
        if self.primary:
            raise RuntimeError("process 0 serves with start(); run() is the followers' loop")
        self.follower.run()

    def _clear_prefix_caches(self) -> None:
        """Kept at stop: process 0's cache stays as every follower's (they never clear)."""

    def stats(self) -> dict:
        s = super().stats()
        if self.primary:
            s["generate"][0]["plans"] = self._generate[0].engine.plans
        return s
