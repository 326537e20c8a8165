"""The host side of a paged engine's calls: plan the pages, then call the stateless engine.

A paged engine (engines/paged_engine.py) takes the page table as an input and holds none.
`PagePlanner` wraps one and keeps the old call shape for everyone who runs it (the
generate worker, the lock-step driver, offline generation, warm-up, benches, tests):

  insert(prefix, state, slot, shared_pages=)  gives the slot pages for the prefix
                                              (SlotPages.insert), then engine.insert
  generate(params, state)                     takes the pages this step writes
                                              (SlotPages.before_step; OutOfPages before
                                              anything runs), then engine.generate with
                                              the table
  start_prompt(slot, tokens, adapter=,       mixed steps: a prompt's pages, before
               shared_pages=)                 its chunks run (SlotPages.insert), a prefix
                                              cache hit's pages linked, and its LoRA
                                              adapter's row held for the slot
  mixed_step(params, state, rows, prefilling=, before_step, engine.mixed_step, then the
             token_mask=)                     slots still in their prompt (and those a
                                              mask sat out) keep their length; with
                                              speculative decoding, the lengths read
                                              back first, as generate's
  warm_step(params, state, width, rows)      a mixed step over a table of trash pages
                                              (warm-up compiles each width)
  free_slot(slot) / init_decode_state()       give the pages back (free_slot the
                                              engine's hold on the slot too)

Everything else is the engine's (attribute access passes through). With speculative
decoding a slot may keep fewer of the positions a step wrote than planned: `generate`
first reads the previous step's lengths back (waiting for that step, here on the host,
never inside the engine) so the pages only rejected positions used return to the pool.

Plain Python: jax arrays are only passed through (and read back by numpy).
Concurrency: a planner is used by the one thread that owns the engine's decode state.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jetserve.scheduling.page_pool import SlotPages, width_buckets


class PagePlanner:
    """A paged engine with its page table (see module doc). `kv_pages`: the SlotPages."""

    def __init__(self, engine: Any):
        g = engine.page_geometry
        if g is None:
            raise ValueError(f"{type(engine).__name__} has a contiguous KV cache: no pages "
                             "to plan (use the engine itself)")
        self.engine = engine
        self.kv_pages = SlotPages(slots=g.slots, page_size=g.page_size,
                                  num_pages=g.num_pages, max_seq_len=g.max_seq_len,
                                  lookahead=g.lookahead, page_bytes=g.page_bytes,
                                  ring_bytes=g.ring_bytes)

    def __getattr__(self, name: str) -> Any:  # the engine's everything else
        if name == "engine":  # not set yet (a half-built planner): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)

    def init_decode_state(self) -> Any:
        """An empty state; every slot's pages go back to the pool."""
        for s in self.kv_pages.live_slots():
            self.kv_pages.free(s)
        return self.engine.init_decode_state()

    def insert(self, prefix: Any, decode_state: Any, slot: int, *,
               shared_pages: tuple[int, ...] | list[int] = ()) -> Any:
        """engine.insert into fresh pages of `slot`. shared_pages: held pages that already
        hold the prefix's first len(shared_pages) * page_size positions (a prefix cache
        hit); the slot links them."""
        n = int(prefix.length)  # the prefix is ready: its first token was read already
        pages = self.kv_pages.insert(slot, n, shared=shared_pages)
        return self.engine.insert(prefix, decode_state, slot, pages=pages,
                                  shared=len(shared_pages))

    def generate(self, params: Any, decode_state: Any, **kw: Any) -> tuple[Any, Any]:
        """engine.generate over the pages this step writes (raises OutOfPages, taking
        none and running nothing, when the pool cannot cover the step); `kw` (a token
        mask) goes on to the engine. A slot whose mask row allows nothing sits the step
        out on the device (engines/token_mask.hold_paused), so its length stays."""
        pages = self.kv_pages
        if pages.lookahead:
            # How far the last step really got is known on the device only: wait for it
            # (this step's pages are then planned from exact lengths).
            pages.sync(np.asarray(decode_state.lengths))
        width = pages.before_step()
        table = pages.table[:, :width].copy()  # the device may read it later
        out = self.engine.generate(params, decode_state, table, **kw)
        pages.after_step(held=_sat_out(kw.get("token_mask")))
        return out

    def start_prompt(self, slot: int, tokens: int, adapter: str | None = None, *,
                     shared_pages: tuple[int, ...] | list[int] = ()) -> None:
        """Mixed steps: `slot` takes the pages of a whole `tokens`-token prompt now; its
        chunks write them over the next steps (no insert). `adapter`: the prompt's LoRA
        adapter, whose row the engine holds for the slot first (engine.hold_adapter,
        until free_slot; its errors leave the pages untaken). shared_pages: held pages
        that already hold the prompt's first len(shared_pages) * page_size positions (a
        prefix cache hit): the slot links them and its chunks start after them."""
        if adapter is not None:
            hold = getattr(self.engine, "hold_adapter", None)
            if hold is None:
                raise ValueError(f"lora_adapter {adapter!r}: this engine serves no LoRA "
                                 "adapters (start it with --lora-modules)")
            hold(slot, adapter)
        self.kv_pages.insert(slot, tokens, shared=shared_pages)

    def mixed_step(self, params: Any, decode_state: Any, rows: Any, *,
                   prefilling: Any = (), token_mask: Any = None) -> tuple[Any, Any]:
        """engine.mixed_step over the pages this step writes (OutOfPages as generate's);
        `prefilling`: the slots still in their prompt, whose pages were all taken by
        start_prompt and whose length does not grow with the step. token_mask (None or
        i32[B, W']) goes on to the engine: a decode row allowing nothing sits the step
        out there, so its length stays here too."""
        pages = self.kv_pages
        if pages.lookahead:  # as generate's; a slot in its prompt is not live there yet
            pages.sync(np.asarray(decode_state.lengths), skip=prefilling)
        width = pages.before_step(skip=prefilling)
        table = pages.table[:, :width].copy()  # the device may read it later
        kw = {} if token_mask is None else {"token_mask": token_mask}
        out = self.engine.mixed_step(params, decode_state, table, rows, **kw)
        pages.after_step(held={*prefilling, *_sat_out(token_mask)})
        return out

    def warm_step(self, params: Any, decode_state: Any, width: int, rows: Any, *,
                  token_mask: Any = None, **program: Any) -> tuple[Any, Any]:
        """engine.mixed_step of `rows` over a page table `width` pages wide that is all
        trash (warm-up: nothing is written, no page is taken); `program` goes on to the
        engine (a LoRA engine's `adapters`)."""
        g = self.engine.page_geometry
        table = np.full((g.slots, width), g.trash, np.int32)
        kw = {} if token_mask is None else {"token_mask": token_mask}
        return self.engine.mixed_step(params, decode_state, table, rows, **kw, **program)

    def free_slot(self, slot: int) -> None:
        """The slot's pages back to the pool, and the engine's own hold (a LoRA
        engine's adapter row)."""
        self.kv_pages.free(slot)
        self.engine.free_slot(slot)

    def generate_widths(self) -> tuple[int, ...]:
        """The page-table widths generate is called with: one compiled program each."""
        return width_buckets(self.kv_pages.max_pages)


def _sat_out(token_mask: Any) -> list[int]:
    """The slots a step's token mask sits out: rows allowing nothing at the first position
    (a verify step's mask has one a position)."""
    if token_mask is None:
        return []
    mask = np.asarray(token_mask)
    mask = mask[:, 0] if mask.ndim == 3 else mask
    return np.flatnonzero(~mask.any(axis=1)).tolist()


def with_pages(engine: Any) -> Any:
    """The engine to call: a PagePlanner over a paged engine (the planner itself when
    given one), a contiguous engine unchanged."""
    if isinstance(engine, PagePlanner) or getattr(engine, "page_geometry", None) is None:
        return engine
    return PagePlanner(engine)
