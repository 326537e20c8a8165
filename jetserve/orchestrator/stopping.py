"""When a generated token ends a request (plain Python; shared with jetserve.offline).

Only what the host can decide from token ids and counts lives here: stop token ids and
the length budget. Stop strings need text and live in `detokenize.StopStrings`.
"""

from __future__ import annotations

from collections.abc import Iterable

Finish = tuple[str, int | None]  # (finish_reason, stop token id or None)


def token_budget(prompt_len: int, max_tokens: int, max_seq_len: int) -> int:
    """Tokens a request may generate: max_tokens, capped by the room left in the cache.

    The sequence (prompt + generated) never exceeds max_seq_len.
    """
    return min(max_tokens, max_seq_len - prompt_len)


def stop_ids(eos_ids: Iterable[int], stop_token_ids: Iterable[int], ignore_eos: bool) -> frozenset[int]:
    return frozenset(stop_token_ids) | (frozenset() if ignore_eos else frozenset(eos_ids))


def token_finish(token: int, generated: int, budget: int, stops: frozenset[int]) -> Finish | None:
    """`generated` counts tokens including this one. A stop id wins over the budget."""
    if token in stops:
        return ("stop", token)
    if generated >= budget:
        return ("length", None)
    return None
