"""The token budget of one mixed step: every decode token first, then chunks of prompts in
admission order, at most one chunk each, cut where the budget ends."""

import pytest

from jetserve.scheduling.mixed_plan import Chunk, Prefilling, fill


def test_decode_tokens_first_then_chunks_in_admission_order_up_to_the_budget():
    prompts = [Prefilling(slot=3, length=20, done=16), Prefilling(slot=0, length=30),
               Prefilling(slot=1, length=5)]
    # 2 decode tokens of 12: 4 to end slot 3's prompt, then 6 of slot 0's chunk of 8.
    assert fill(2, prompts, budget=12, chunk=8) == [Chunk(3, 16, 20, True), Chunk(0, 0, 6, False)]
    # Room for all: one chunk each, the short prompt ends.
    assert fill(0, prompts, budget=100, chunk=8) == [
        Chunk(3, 16, 20, True), Chunk(0, 0, 8, False), Chunk(1, 0, 5, True)]
    # Decode tokens fill the budget but one: a one-token chunk, the prompt still moves.
    assert fill(11, prompts, budget=12, chunk=8) == [Chunk(3, 16, 17, False)]
    assert fill(4, [], budget=12, chunk=8) == []


def test_a_budget_that_starves_prompts_or_a_bad_progress_is_refused():
    with pytest.raises(ValueError, match="no prefill token beside 12 decode tokens"):
        fill(12, [Prefilling(slot=0, length=3)], budget=12, chunk=8)
    with pytest.raises(ValueError, match=r"done=3 must be in \[0, length=3\)"):
        Prefilling(slot=0, length=3, done=3)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        fill(0, [], budget=4, chunk=0)
