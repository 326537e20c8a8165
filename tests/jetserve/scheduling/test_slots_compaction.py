"""Moving running requests down to free lower slots (jetserve/scheduling/slots.py):
which moves let a step run a smaller decode batch size, and the slot table after one."""

import pytest

from jetserve.scheduling.slots import SlotTable, compaction, step_batch

SIZES = (1, 2, 4, 8)


def _rows(slots):
    return [(s, f"r{s}") for s in slots]


@pytest.mark.parametrize("held,moves", [
    ([], []),
    ([0], []),
    ([6], [(6, 0)]),                  # alone in slot 6: a step of 1 after the move
    ([0, 5], [(5, 1)]),               # two: a step of 2
    ([1, 2, 7], [(7, 0)]),            # three hold in 4: slots 1 and 2 stay
    ([0, 1, 2, 3, 6], []),            # five need 8 anyway
    ([2, 3], [(2, 0), (3, 1)]),       # two past 2: both move
])
def test_moves_only_where_the_step_shrinks(held, moves):
    assert compaction(_rows(held), SIZES) == moves
    after = sorted({*held} - {s for s, _ in moves} | {d for _, d in moves})
    if held:
        assert step_batch(_rows(after), SIZES) == next(b for b in SIZES if b >= len(held))


def test_a_move_hands_the_slot_over_and_frees_the_old_one():
    t: SlotTable[object] = SlotTable(8)
    a, b, c = object(), object(), object()  # requests, found by identity
    assert [t.acquire(r) for r in (a, b, c)] == [0, 1, 2]
    t.release(0)
    t.move(2, 0)
    assert t.owner(0) is c and t.owner(2) is None and t.slot_of(c) == 0
    assert t.slot_of(b) == 1 and t.slot_of(a) is None
    assert t.acquire(object()) == 2 and t.in_use == 3  # the lowest free slot again
    with pytest.raises(RuntimeError, match="cannot move slot 1 to 0"):
        t.move(1, 0)  # 0 is taken
