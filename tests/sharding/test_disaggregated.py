"""Prefill on one slice, generate on another with another layout, the same tokens as one engine.

The orchestrator's transfer thread does `jax.device_put(prefix,
engine_g.prefix_destination_sharding())`; here the engine calls are made directly, so a
layout mismatch between the slices shows up without threads in the way.
"""

from __future__ import annotations

import jax
import pytest

from tests.sharding import families


def disaggregated_tokens(family: str, prefill_preset: str, generate_preset: str):
    devices = jax.devices()
    pe = families.make_engine(family, prefill_preset, devices[:4])
    ge = families.make_engine(family, generate_preset, devices[4:8])
    host = families.host_params(pe)
    pp, gp = families.place(pe, host), families.place(ge, host)
    state = ge.init_decode_state()
    dest = ge.prefix_destination_sharding()
    tokens = []
    for slot, prompt in enumerate(families.PROMPTS):
        prefix, first = pe.prefill(pp, prompt, len(prompt))
        tokens.append([first.to_host().token(0)])
        moved = jax.device_put(prefix, dest)
        # The prefix now lives on the generate slice only, laid out as it expects.
        assert {d.id for d in moved.k[0].devices()} == {d.id for d in devices[4:8]}
        assert moved.k[0].sharding.is_equivalent_to(dest.k[0], moved.k[0].ndim)
        state = ge.insert(moved, state, slot)
    for _ in range(families.MAX_TOKENS - 1):
        state, res = ge.generate(gp, state)
        h = res.to_host()
        for slot in range(len(families.PROMPTS)):
            tokens[slot].append(h.token(slot))
    return tokens, pe, ge


@pytest.mark.parametrize("family,prefill_preset,generate_preset", [
    # Same logical layout on disjoint devices (model 4 on both).
    ("llama3", "tp", "tp_kv_batch"),
    # A real reshard: seq 2 x model 2 -> data 2 x model 2 (two kv heads).
    ("mistral", "seq_tp", "tp_kv_batch"),
])
def test_prefill_slice_to_generate_slice(family, prefill_preset, generate_preset,
                                         reference_tokens):
    tokens, pe, ge = disaggregated_tokens(family, prefill_preset, generate_preset)
    if family == "mistral":
        assert dict(pe.mesh.shape) == {"seq": 2, "model": 2}
        assert dict(ge.mesh.shape) == {"data": 2, "model": 2}
    assert tokens == reference_tokens(family)
