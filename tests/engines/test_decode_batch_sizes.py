"""A generate step over the first slots only (EngineConfig.decode_batch_sizes, generate
`rows=`): the slots it runs get what a step over every slot gives them, the others are left
bit-identical and get no token, each size is one program, and what cannot work is refused
by name."""

import jax
import numpy as np
import pytest

from engines import EngineConfig, SamplingParams, cpu_kernels, create_engine
from engines.config import ModelConfig
from engines.token_mask import allow_all

CFG = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)
SIZES = (1, 2, 4)


def _engine(**kw):
    return create_engine(CFG, config=EngineConfig(
        max_concurrent_decodes=8, max_prefill_length=32, max_seq_len=64,
        decode_batch_sizes=SIZES, **kw), devices=jax.devices()[:1], seed=5)


# The CPU kernels' attention (reads the first rows of the cache in place) and XLA's (reads
# a slice of them), a scanned decoder's stacked cache, and an int8 cache.
VARIANTS = {
    "kernels": {},
    "xla": {"env": "0"},
    "loop": {"layers": "loop"},
    "int8": {"kv_dtype": "int8"},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def engine(request):
    kw = dict(VARIANTS[request.param])
    with pytest.MonkeyPatch.context() as mp:
        if "env" in kw:
            mp.setenv(cpu_kernels.ENV_SWITCH, kw.pop("env"))
        eng = _engine(**kw)
    return eng, eng.load_params()


def _filled(eng, params, slots):
    """A decode state with a prompt in each of `slots` (different lengths and sampling)."""
    rng = np.random.default_rng(0)
    state = eng.init_decode_state()
    for i, slot in enumerate(slots):
        prompt = rng.integers(3, 100, size=5 + 3 * i).astype(np.int32)
        sampling = SamplingParams(temperature=0.8, seed=i) if i % 2 else SamplingParams()
        prefix, _ = eng.prefill(params, prompt, len(prompt), sampling=sampling, seed=100 + i)
        state = eng.insert(prefix, state, slot)
    return state


def _slot(state, slot):
    """Every field of one slot, cache included, as host arrays."""
    leaves = jax.tree.leaves(state)
    B = state.lengths.shape[0]
    out = []
    for a in leaves:
        a = np.asarray(a)
        if a.ndim >= 1 and a.shape[0] == B:
            out.append(a[slot])
        elif a.ndim >= 2 and a.shape[1] == B:  # a stacked cache [L, B, ...]
            out.append(a[:, slot])
    return out


def test_a_step_over_the_first_slots_is_that_slice_of_a_whole_step(engine):
    eng, params = engine
    assert eng.decode_batch_sizes == (1, 2, 4, 8)
    live = [0, 1, 2]
    whole, part = _filled(eng, params, live), _filled(eng, params, live + [6])
    parked = _slot(part, 6)  # a slot past the step's rows: must not move
    for step in range(5):
        whole, res_w = eng.generate(params, whole)
        part, res_p = eng.generate(params, part, rows=4)
        hw, hp = res_w.to_host(), res_p.to_host()
        assert hp.data.shape == hw.data.shape  # a row per slot either way
        for slot in live:
            assert hp.tokens(slot) == hw.tokens(slot), (step, slot)
            assert hp.length(slot) == hw.length(slot)
            np.testing.assert_allclose(hp.data[slot], hw.data[slot], rtol=1e-4, atol=1e-4)
        for slot in (3, 4, 5, 6, 7):
            assert hp.tokens(slot) == []  # no token for a slot the step did not run
    for slot in live:
        for a, b in zip(_slot(part, slot), _slot(whole, slot), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    for a, b in zip(_slot(part, 6), parked, strict=True):
        np.testing.assert_array_equal(a, b)


def test_sizes_can_change_from_step_to_step(engine):
    eng, params = engine
    whole, mixed = _filled(eng, params, [0, 1]), _filled(eng, params, [0, 1])
    got, want = [], []
    for rows in (2, 8, 4, 2, 8):
        whole, rw = eng.generate(params, whole)
        mixed, rm = eng.generate(params, mixed, rows=rows)
        want.append([rw.to_host().tokens(s) for s in (0, 1)])
        got.append([rm.to_host().tokens(s) for s in (0, 1)])
    assert got == want


def test_a_moved_slot_goes_on_as_it_would_have(engine):
    """move_slot copies a running slot (cache, sampling key, counts) into a free one: the
    request then decodes there, in a smaller step, what it decodes where it was."""
    eng, params = engine
    stay, moved = _filled(eng, params, [0, 5]), _filled(eng, params, [0, 5])
    moved = eng.move_slot(moved, 5, 1)
    for _ in range(4):
        stay, rs = eng.generate(params, stay)
        moved, rm = eng.generate(params, moved, rows=2)
        hs, hm = rs.to_host(), rm.to_host()
        assert hm.tokens(0) == hs.tokens(0) and hm.tokens(1) == hs.tokens(5)
        np.testing.assert_allclose(hm.data[1], hs.data[5], rtol=1e-4, atol=1e-4)
    for a, b in zip(_slot(moved, 1), _slot(stay, 5), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_a_token_mask_has_the_steps_rows(engine):
    eng, params = engine
    state = _filled(eng, params, [0])
    mask = np.zeros((1, allow_all(1, CFG.vocab_size).shape[1]), np.int32)
    mask[0, 0] = 1 << 7  # token 7 only
    state, res = eng.generate(params, state, mask, rows=1)
    assert res.to_host().tokens(0) == [7]


def test_each_size_is_one_program_and_others_are_refused():
    eng = _engine()
    params = eng.load_params()
    state = _filled(eng, params, [0])
    before = eng.trace_counts()["generate"]
    for _ in range(2):
        for rows in (1, 2, 4, None):
            state, _ = eng.generate(params, state, rows=rows)
    assert eng.trace_counts()["generate"] - before == 4
    with pytest.raises(ValueError, match=r"rows=3: this engine's decode batch sizes are "
                                         r"\(1, 2, 4, 8\)"):
        eng.generate(params, state, rows=3)


@pytest.mark.parametrize("sizes,kw,match", [
    ((4, 2), {}, "ascending"),
    ((8,), {}, r"in \[1, max_concurrent_decodes=8\)"),
    ((0, 2), {}, r"in \[1, max_concurrent_decodes=8\)"),
    ([2, 4], {}, "tuple of integers"),
    ((2,), {"kv_layout": "paged"}, "kv_layout 'paged'"),
    ((2,), {"speculative": "ngram:2"}, "speculative decoding"),
    ((2,), {"max_loras": 2}, "LoRA adapters"),
])
def test_bad_sizes_are_refused_by_name(sizes, kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(max_concurrent_decodes=8, decode_batch_sizes=sizes, **kw)
