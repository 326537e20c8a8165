"""How the orchestrator's workers are wired to each other and to the engines: which
generate worker a prefill hands its prefix to, when a prefill thread counts as having work,
what an interleaved prefill does between its chunks (one step, or decode-first's token
budget), and the checks, scheduling knobs and prefix caches that `Orchestrator.__init__`
builds."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from engines import Engine
from jetserve.orchestrator.config import OrchestratorConfig
from jetserve.orchestrator.fair_queue import FairQueue
from jetserve.orchestrator.generate_worker import GenerateWorker
from jetserve.orchestrator.prefill_worker import PrefillWorker
from jetserve.orchestrator.prefix_cache import PrefixCache
from jetserve.orchestrator.prefix_stores import ArrayStore, PageStore
from jetserve.orchestrator.transfer_worker import TransferWorker
from jetserve.scheduling.policy import DECODE_FIRST, StepPolicy, resolve
from jetserve.scheduling.step_budget import StepBudget


def build_prefix_cache(engine: Engine, config: OrchestratorConfig,
                  own: GenerateWorker | None) -> PrefixCache | None:
    """A prefix cache for one prefill engine, when the config gives it a budget: in the
    engine's own KV pages when it is a paged engine that also generates (own) and keeps
    every layer in its pages, else in device arrays of its own."""
    hbm, host = config.prefix_cache_hbm_bytes, config.prefix_cache_host_bytes
    if not hbm and not host:
        return None
    if not hasattr(engine, "prefix_from_blocks"):
        raise ValueError(f"a prefix cache needs an engine that continues prefixes; "
                         f"{type(engine).__name__} does not")
    # A ring of pages (sliding-window layers, engines/paged_kv.py WindowRing) keeps no
    # page of those layers behind their window: blocks of the cache's own then.
    if own is not None and own.pages is not None and not engine.page_geometry.ring_pages:
        own.cache = PrefixCache(store=PageStore(engine, own.read_pages, own.sched.kv),
                                hbm_bytes=hbm, host_bytes=host)
        return own.cache
    return PrefixCache(store=ArrayStore(engine, config.prefix_cache_block), hbm_bytes=hbm,
                       host_bytes=host)


def generate_stats(g: GenerateWorker) -> dict:
    """A generate thread's steps (how many ran at each decode batch size), read-back
    counts and, on a paged engine, its pages and preemptions."""
    pages = {} if g.pages is None else {**g.sched.kv.stats(), "preemptions": g.preemptions}
    return {"steps": g.steps, "steps_by_batch": dict(g.batch_steps), "slot_moves": g.moves,
            **g.readback.counts(), **pages}


def check_engines(pe, ge, pp, gp) -> None:
    if not pe or not ge:
        raise ValueError("give at least one prefill engine and one generate engine")
    if len(pe) != len(pp):
        raise ValueError(f"prefill_params has {len(pp)} entries for {len(pe)} prefill engines")
    if len(ge) != len(gp):
        raise ValueError(f"generate_params has {len(gp)} entries for {len(ge)} generate engines")
    if len({id(e) for e in ge}) != len(ge) or len({id(e) for e in pe}) != len(pe):
        raise ValueError("an engine appears twice in one list; each engine runs one thread")
    vocab = {e.vocab_size for e in list(pe) + list(ge)}
    if len(vocab) != 1:
        raise ValueError(f"engines disagree on vocab_size: {sorted(vocab)}")
    check_kv_heads(pe, ge)


def check_kv_heads(pe, ge) -> None:
    """Prefixes move from every prefill engine to every generate engine. Engines may
    repeat the model's kv heads differently (the transfer regroups them), but must hold
    the same model's heads."""
    def held(kind, i, e):
        c = getattr(e, "source_config", None)
        if c is None:
            return None
        name = getattr(getattr(e, "sharding", None), "name", "?")
        return (f"{kind} engine {i} (sharding {name!r}, {len(e.mesh.devices.flat)} devices)",
                (c.num_kv_heads, c.head_dim, c.num_layers))

    rows = [r for kind, es in (("prefill", pe), ("generate", ge))
            for i, e in enumerate(es) if (r := held(kind, i, e)) is not None]
    if len({shape for _, shape in rows}) > 1:
        (a, sa), (b, sb) = rows[0], next(r for r in rows if r[1] != rows[0][1])
        raise ValueError(
            f"{a} holds {sa[0]} kv heads of {sa[1]} dims in {sa[2]} layers, {b} holds "
            f"{sb[0]} of {sb[1]} in {sb[2]}: a prefix cannot move between them; serve one "
            f"model on both")


def direct_route(g: GenerateWorker, stopping: threading.Event, poll_s: float):
    def route(live, prefix) -> bool:
        return g.backlog.put((live, prefix), stopping, poll_s)

    return route


def least_loaded_route(generate: list[GenerateWorker], transfers: list[TransferWorker]):
    def route(live, prefix) -> bool:
        i = min(range(len(generate)), key=lambda k: generate[k].load())
        return transfers[i].offer(live, prefix)

    return route


def pending_for(p: PrefillWorker, admission: FairQueue,
                 resume: queue.Queue) -> Callable[[], tuple[bool, bool]]:
    """(prefill work on its way, that prefill paused between its chunks): what the
    scheduler weighs to step or to wait for the prefill (Scheduler.yield_to_prefill)."""
    # unfinished_tasks counts admitted requests until a prefill thread has handed them on
    # (task_done), so there is no gap between taking one off the queue and prefilling it.
    def pending() -> tuple[bool, bool]:
        work = admission.unfinished_tasks > 0 or resume.qsize() > 0 or p.busy
        return work, p.waiting_between_chunks

    return pending


def step_between(g: GenerateWorker) -> Callable[[], None]:
    def between() -> None:
        g.backlog.poke()  # it may be idling on the backlog, waiting for prefill
        g.wait_for_step()

    return between


def step_policy(config: OrchestratorConfig, pe, ge) -> StepPolicy:
    """The scheduling knobs of `config` against the engines (policy.resolve); every
    generate engine gets the same cap, so the smallest engine bounds it."""
    if config.step_policy == DECODE_FIRST and any(e.prefill_row_shapes() for e in pe):
        raise ValueError("--prefill-batch with --step-policy decode-first: the step budget "
                         "admits one prompt a prefill call; leave one of them out")
    return resolve(slots=min(e.max_concurrent_decodes for e in ge),
                   max_prefill_length=min(e.max_prefill_length for e in pe),
                   chunked_prefill=all(getattr(e, "chunked_prefill", False) for e in pe),
                   shares_devices={id(e) for e in pe} <= {id(e) for e in ge},
                   max_num_seqs=config.max_num_seqs,
                   max_num_batched_tokens=config.max_num_batched_tokens,
                   prefill_chunk=config.prefill_chunk, step_policy=config.step_policy,
                   prefill_lookahead=config.prefill_lookahead)


def budget_between(p: PrefillWorker, g: GenerateWorker, policy: StepPolicy,
                   stopping: threading.Event, poll_s: float) -> None:
    """Decode-first on an interleaved engine: its prefill calls and decode steps share one
    token budget per step (step_budget.py), which replaces the one step between chunks."""
    if not policy.decode_first:
        return
    # The backlog is read first: an insert takes its slot before it leaves the backlog, so
    # a request moving between them is counted twice at worst, never missed.
    budget = StepBudget(policy.max_num_batched_tokens, policy.max_num_seqs,
                        lambda: len(g.backlog) + g.slots.in_use,
                        stopping=stopping, poll_s=poll_s, ending=lambda: g.ending)
    p.budget, g.step_window = budget.prefill, budget.step
    p.between_chunks = lambda: None
