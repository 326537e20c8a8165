"""Every preset gives the single-device greedy tokens, for every family, on 8 devices (and
on 4 for the cases in FAST).

Where a preset cannot split a family's shapes on that many devices (4 or 8), building the
engine fails with a message naming the tensor, the dimension and the mesh axis. A few
cases run by default; the rest of the family x preset matrix on 8 devices is `slow` (one
compile set each). On 4 devices every refusal runs, and the tokens of one case per preset
(ON_4): a 4-device case differs from its 8-device one only in how coarsely the mesh axes
split, and the other 4-device token cases (about 30, near 10 s each) made this the
suite's second longest module.
"""

from __future__ import annotations

import itertools
import re

import jax
import pytest

from tests.sharding import families

# Every preset at least once on two families (two reference runs), both device counts.
# Cases that must fail compile nothing, so they all run by default.
FAST = {
    ("llama3", "tp", 4), ("llama3", "tp_kv_batch", 8), ("llama3", "seq_tp", 8),
    ("mixtral", "ep_tp", 8), ("mixtral", "replicated", 4), ("mixtral", "dp_ep", 4),
}
# The 4-device cases whose tokens are checked: one per preset.
ON_4 = {("llama3", "tp", 4), ("llama3", "tp_kv_batch", 4), ("llama3", "seq_tp", 4),
        ("mixtral", "ep_tp", 4), ("mixtral", "replicated", 4), ("mixtral", "dp_ep", 4)}
ALL = list(itertools.product(families.FAMILIES, families.PRESET_NAMES, families.DEVICE_COUNTS))
MATRIX = [
    pytest.param(*c, id="-".join(map(str, c)),
                 marks=() if c in FAST or families.expected_error(*c) else pytest.mark.slow)
    for c in ALL
    if c[2] == 8 or c in FAST | ON_4 or families.expected_error(*c)
]


@pytest.mark.parametrize("family,preset,n", MATRIX)
def test_preset_matches_single_device(family, preset, n, reference_tokens):
    devices = jax.devices()[:n]
    bad = families.expected_error(family, preset, n)
    if bad is not None:
        with pytest.raises(ValueError) as e:
            families.make_engine(family, preset, devices)
        msg = str(e.value)
        if bad == "expert":  # dp_ep: the experts over every device
            assert re.search(rf"parameter \S+/w[123]: dimension 0 \(expert\) of size "
                             rf"{families.model_config(family).num_experts} does not divide "
                             rf"over mesh axis 'data' of size {n} in sharding '{preset}'",
                             msg), msg
            return
        # Names the tensor, the dimension, its size, the mesh axis and the preset.
        # (A q/k/v projection's kernel, or its bias where the family has one: qwen2.)
        assert re.search(rf"parameter \S+/[kv]_(proj|bias): dimension 0 "
                         rf"\({bad}\) of size "
                         rf"{families.model_config(family).num_kv_heads} does not divide over "
                         rf"mesh axis 'model' of size \d+ in sharding '{preset}'", msg), msg
        return
    engine = families.make_engine(family, preset, devices)
    params = families.place(engine, families.host_params(engine))
    tokens = families.greedy_tokens(engine, params)
    assert tokens == reference_tokens(family)
    # One program per function: prompts share a bucket, nothing recompiled per step.
    assert engine.trace_counts() == {"prefill": 1, "insert": 1, "prompt_logprobs": 0,
                                     "generate": 1}


def test_matrix_has_both_outcomes():
    """The tiny configs are chosen so that the matrix checks tokens and errors alike."""
    outcomes = {families.expected_error(*c) is None for c in ALL}
    assert outcomes == {True, False}
    fast_ok = [c for c in FAST if families.expected_error(*c) is None]
    assert {c[1] for c in fast_ok} == set(families.PRESET_NAMES)
