"""The page planner on plain Python: a stand-in engine records what each call was given,
so the pages planned for insert and generate, the table's width, the speculative
read-back and the pass-through of a contiguous engine are checked without jax."""

from __future__ import annotations

import types

import numpy as np
import pytest

from jetserve.scheduling.page_planner import PagePlanner, with_pages
from jetserve.scheduling.page_pool import OutOfPages


class _Engine:
    """Records each insert's pages and each generate's table; the state is the device's
    per-slot lengths, which a step advances by `kept` tokens per live slot."""

    def __init__(self, num_pages=8, lookahead=0, kept=1):
        self.page_geometry = types.SimpleNamespace(slots=2, page_size=4, max_seq_len=16,
                                                   num_pages=num_pages, lookahead=lookahead,
                                                   page_bytes=0, ring_bytes=0)
        self.kept, self.calls, self.freed = kept, [], []

    def init_decode_state(self):
        return types.SimpleNamespace(lengths=np.zeros(2, np.int32))

    def insert(self, prefix, state, slot, *, pages, shared):
        self.calls.append(("insert", slot, list(pages), shared))
        state.lengths[slot] = prefix.length
        return state

    def free_slot(self, slot):  # a LoRA engine's adapter row of the slot
        self.freed.append(slot)

    def generate(self, params, state, page_table):
        self.calls.append(("generate", page_table.tolist()))
        state.lengths[state.lengths > 0] += self.kept
        return state, None


def _prefix(n):
    return types.SimpleNamespace(length=n)


def test_insert_and_steps_pass_the_planned_pages():
    eng = _Engine()
    planner = PagePlanner(eng)
    state = planner.insert(_prefix(6), planner.init_decode_state(), 1)
    assert eng.calls[-1] == ("insert", 1, [0, 1], 0)
    state, _ = planner.generate(None, state)  # writes position 6: still page 1
    assert eng.calls[-1] == ("generate", [[8, 8], [0, 1]])  # width 2, trash is 8
    state, _ = planner.generate(None, state)
    state, _ = planner.generate(None, state)  # writes position 8: a third page
    assert eng.calls[-1] == ("generate", [[8, 8, 8, 8], [0, 1, 2, 8]])  # width bucket 4
    planner.free_slot(1)
    assert planner.kv_pages.free_count == 8 and planner.generate_widths() == (1, 2, 4)
    assert eng.freed == [1]  # the engine frees its own hold on the slot too


def test_a_step_without_pages_calls_nothing():
    eng = _Engine(num_pages=4)
    planner = PagePlanner(eng)
    state = planner.insert(_prefix(12), planner.init_decode_state(), 0)  # 3 pages
    state = planner.insert(_prefix(4), state, 1)  # the last page
    calls = list(eng.calls)
    with pytest.raises(OutOfPages):  # both slots start a new page
        planner.generate(None, state)
    assert eng.calls == calls  # the engine was not called
    planner.kv_pages.check()
    planner.free_slot(1)  # room for slot 0 to grow
    planner.generate(None, state)
    assert eng.calls[-1] == ("generate", [[0, 1, 2, 3], [4, 4, 4, 4]])


def test_speculative_steps_read_lengths_back_and_return_rejected_pages():
    eng = _Engine(lookahead=3, kept=1)  # every draft rejected: one token per step
    planner = PagePlanner(eng)
    state = planner.insert(_prefix(3), planner.init_decode_state(), 0)
    state, _ = planner.generate(None, state)  # plans positions 3..6: pages 0 and 1
    assert planner.kv_pages.pages_of(0) == [0, 1]
    assert planner.kv_pages.length(0) == 3 + 4  # the host's upper bound after the step
    state, _ = planner.generate(None, state)
    # Read back first (length 4), so positions 4..7 take 2 pages; planned from the upper
    # bound 7 they would have taken 3.
    assert planner.kv_pages.free_count == 8 - 2
    state, _ = planner.generate(None, state)
    assert int(state.lengths[0]) == 6 and planner.kv_pages.pages_of(0) == [0, 1, 2]
    planner.kv_pages.check()


def test_a_contiguous_engine_is_left_alone():
    eng = _Engine()
    eng.page_geometry = None
    assert with_pages(eng) is eng
    with pytest.raises(ValueError, match="contiguous"):
        PagePlanner(eng)
    planner = PagePlanner(_Engine())
    assert with_pages(planner) is planner and planner.kept == 1  # the engine's attributes


class _MaskedEngine(_Engine):
    """As _Engine, taking a token mask: a slot whose row allows nothing gains nothing
    (engines/token_mask.hold_paused)."""

    def generate(self, params, state, page_table, token_mask):
        self.calls.append(("generate", page_table.tolist()))
        live = (state.lengths > 0) & token_mask.any(axis=1)
        state.lengths[live] += self.kept
        return state, None


def test_a_slot_that_sits_a_step_out_keeps_its_length_and_pages():
    eng = _MaskedEngine()
    planner = PagePlanner(eng)
    state = planner.insert(_prefix(7), planner.init_decode_state(), 0)
    state = planner.insert(_prefix(3), state, 1)
    held_out = np.array([[-1], [0]], np.int32)  # slot 1 sits out
    for _ in range(3):
        state, _ = planner.generate(None, state, token_mask=held_out)
    assert [planner.kv_pages.length(s) for s in (0, 1)] == [10, 3] == state.lengths.tolist()
    assert planner.kv_pages.pages_of(1) == [2]  # position 3 is still page 2's
    planner.kv_pages.check()
    state, _ = planner.generate(None, state, token_mask=np.full((2, 1), -1, np.int32))
    assert [planner.kv_pages.length(s) for s in (0, 1)] == [11, 4] == state.lengths.tolist()
    state, _ = planner.generate(None, state, token_mask=np.full((2, 1), -1, np.int32))
    assert planner.kv_pages.pages_of(1) == [2, 4]  # writing position 4 took a page
    planner.kv_pages.check()
