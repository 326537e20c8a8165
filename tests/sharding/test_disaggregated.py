"""Prefill on one slice, generate on another with another layout: the same tokens as one engine.

The prefix crosses slices by `jax.device_put(prefix, engine_g.prefix_destination_sharding())`:
first called here directly (a layout mismatch shows up without threads in the way), then
through the orchestrator's transfer thread on the same engines (nothing recompiles).
Where one slice replicates the kv heads and the other does not (`tp` on more devices
than kv heads), `engine_g.receive_prefix` regroups the heads first.
"""

from __future__ import annotations

import jax
import pytest

from jetserve.orchestrator import Orchestrator, Request
from tests.sharding import families

CASES = {
    # Same logical layout on disjoint devices (model 4 on both).
    "llama3-tp-to-tp_kv_batch": ("llama3", "tp", "tp_kv_batch"),
    # A real reshard: seq 2 x model 2 -> data 2 x model 2 (two kv heads).
    "mistral-seq_tp-to-tp_kv_batch": ("mistral", "seq_tp", "tp_kv_batch"),
    # Two kv heads each on two devices (4 heads run) -> two heads on model 2, data 2.
    "mistral-tp-to-tp_kv_batch": ("mistral", "tp", "tp_kv_batch"),
    # And back: two heads -> each of them on two devices.
    "mistral-tp_kv_batch-to-tp": ("mistral", "tp_kv_batch", "tp"),
    # Experts over `expert` -> attention data parallel, the experts over the same devices.
    "mixtral-ep_tp-to-dp_ep": ("mixtral", "ep_tp", "dp_ep"),
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def slices(request):
    family, prefill_preset, generate_preset = CASES[request.param]
    devices = jax.devices()
    pe = families.make_engine(family, prefill_preset, devices[:4])
    ge = families.make_engine(family, generate_preset, devices[4:8])
    host = families.host_params(pe)
    return family, pe, ge, families.place(pe, host), families.place(ge, host)


def test_engine_level_transfer(slices, reference_tokens):
    family, pe, ge, pp, gp = slices
    if (pe.sharding.name, ge.sharding.name) == ("seq_tp", "tp_kv_batch"):
        assert dict(pe.mesh.shape) == {"seq": 2, "model": 2}
        assert dict(ge.mesh.shape) == {"data": 2, "model": 2}
    devices = jax.devices()
    state = ge.init_decode_state()
    dest = ge.prefix_destination_sharding()
    tokens = []
    for slot, prompt in enumerate(families.PROMPTS):
        prefix, first = pe.prefill(pp, prompt, len(prompt))
        tokens.append([first.to_host().token(0)])
        moved = jax.device_put(ge.receive_prefix(prefix), dest)
        # The prefix now lives on the generate slice only, laid out as it expects.
        assert {d.id for d in moved.k[0].devices()} == {d.id for d in devices[4:8]}
        assert moved.k[0].sharding.is_equivalent_to(dest.k[0], moved.k[0].ndim)
        state = ge.insert(moved, state, slot)
    for _ in range(families.MAX_TOKENS - 1):
        state, res = ge.generate(gp, state)
        h = res.to_host()
        for slot in range(len(families.PROMPTS)):
            tokens[slot].append(h.token(slot))
    assert tokens == reference_tokens(family)


def test_through_the_orchestrator(slices, reference_tokens):
    family, pe, ge, pp, gp = slices
    orch = Orchestrator(prefill_engines=[pe], generate_engines=[ge],
                        prefill_params=[pp], generate_params=[gp])
    orch.start()
    try:
        handles = [orch.submit(Request(prompt_ids=tuple(p), max_tokens=families.MAX_TOKENS,
                                       ignore_eos=True)) for p in families.PROMPTS]
        tokens = [list(h.result(120).token_ids) for h in handles]
    finally:
        orch.stop()
    assert tokens == reference_tokens(family)
    assert pe.trace_counts()["prefill"] == 1 and ge.trace_counts()["generate"] == 1
