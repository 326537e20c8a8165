"""Shared single-device reference tokens, computed once per family per session."""

from __future__ import annotations

import jax
import pytest

from tests.sharding import families


@pytest.fixture(scope="session")
def reference_tokens():
    """family -> greedy tokens of PROMPTS on one device with the `replicated` preset."""
    cache: dict[str, list[list[int]]] = {}

    def get(family: str) -> list[list[int]]:
        if family not in cache:
            engine = families.make_engine(family, "replicated", jax.devices()[:1])
            params = families.place(engine, families.host_params(engine))
            cache[family] = families.greedy_tokens(engine, params)
        return cache[family]

    return get
