"""The CPU matmul kernel with several weights in one call (engines/cpu_kernels.py
matmul_nt_many): each result against numpy and against one call per weight, over every
form of the kernel, and the model's projections (q, k and v; gate and up) fused into one
call where the kernel runs them."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engines import EngineConfig, ModelConfig, cpu_kernels, create_engine
from engines.backend import Backend
from engines.layer_scan import LayerWeight
from jetserve.offline import generate_many


@pytest.fixture(scope="module")
def kernel():
    if not cpu_kernels.available():
        pytest.skip("the kernel needs x86-64 with AVX2 and FMA and a C++ compiler")


def _calls(fn, *args) -> int:
    """How many matmul custom calls the compiled fn holds."""
    return len(re.findall(cpu_kernels.TARGET, jax.jit(fn).lower(*args).compile().as_text()))


# Row counts of every form (the dot tiles below 8 rows, an 8-wide packed block, 16-row
# blocks and a part block); widths whose column tails differ from part to part, and parts
# of very different sizes (a small part shares its chunks with a large one).
ROWS = (1, 2, 5, 8, 16, 33)
PARTS = ((13, 66, 5), (1030, 24), (7, 1, 300, 12))


@pytest.mark.parametrize("m", ROWS)
def test_each_result_equals_numpy_and_its_own_call(kernel, m):
    rng = np.random.default_rng(m)
    for k, widths in zip((67, 1031, 9), PARTS, strict=True):
        x = rng.standard_normal((m, k), dtype=np.float32)
        ws = [rng.standard_normal((n, k), dtype=np.float32) for n in widths]
        got = jax.jit(cpu_kernels.matmul_nt_many)(x, ws)
        assert len(got) == len(ws)
        for y, w in zip(got, ws, strict=True):
            want = x.astype(np.float64) @ w.astype(np.float64).T
            assert y.shape == want.shape and y.dtype == np.float32
            np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.sqrt(k))
            # one weight alone takes the same tiles: the same float32 result
            np.testing.assert_array_equal(np.asarray(y),
                                          np.asarray(jax.jit(cpu_kernels.matmul_nt)(x, w)))


def test_stacks_are_read_at_the_same_layer(kernel):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 40), dtype=np.float32)  # leading dims flattened, restored
    ws = [rng.standard_normal((4, n, 40), dtype=np.float32) for n in (24, 8, 8)]
    fn = jax.jit(cpu_kernels.matmul_nt_many)
    assert _calls(fn, x, ws, jnp.int32(1)) == 1
    for i in range(4):
        got = fn(x, ws, jnp.int32(i))
        for y, w in zip(got, ws, strict=True):
            assert y.shape == (2, 3, w.shape[1])
            np.testing.assert_array_equal(np.asarray(y), np.asarray(
                cpu_kernels.matmul_nt(x, w[i])))
    with pytest.raises(Exception, match="layer 4 is outside"):
        jax.block_until_ready(fn(x, ws, jnp.int32(4)))


def test_bad_operands_are_named(kernel):
    x = jnp.ones((2, 4))
    with pytest.raises(ValueError, match="at least one weight"):
        cpu_kernels.matmul_nt_many(x, [])
    with pytest.raises(ValueError, match=r"x \(2, 4\) and w \(3, 5\)"):
        cpu_kernels.matmul_nt_many(x, [jnp.ones((6, 4)), jnp.ones((3, 5))])
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.matmul_nt_many(x, [jnp.ones((6, 4)), jnp.ones((3, 4), jnp.bfloat16)])


def test_the_backend_fuses_only_what_the_kernel_takes(kernel):
    on, off = Backend(cpu_matmul_rows=cpu_kernels.MAX_ROWS), Backend()
    rng = np.random.default_rng(4)
    ws = [jnp.asarray(rng.standard_normal((n, 16), dtype=np.float32)) for n in (8, 4)]
    layer = jnp.int32(1)  # one scanned layer: one index for all its stacks
    stacks = [LayerWeight(jnp.stack([w, -w]), layer) for w in ws]
    x = jnp.asarray(rng.standard_normal((3, 16), dtype=np.float32))
    assert _calls(lambda x, a, b: on.linear_many(x, (a, b)), x, *ws) == 1
    assert _calls(lambda x, a, b: off.linear_many(x, (a, b)), x, *ws) == 0
    # one row keeps XLA's dot for plain weights, as linear does; a scanned layer's stacks
    # take the kernel, in one call
    assert _calls(lambda x, a, b: on.linear_many(x, (a, b)), x[:1], *ws) == 0
    one = jax.jit(lambda x: on.linear_many(x, stacks))
    assert _calls(one, x[:1]) == 1
    for y, w in zip(one(x[:1]), ws, strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(-x[:1] @ w.T), rtol=1e-5,
                                   atol=1e-5)
    for y, w in zip(on.linear_many(x, ws), ws, strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x @ w.T), rtol=1e-5, atol=1e-5)


CFG = ModelConfig(vocab_size=99, hidden_size=36, intermediate_size=70, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=10)
ENGINE = EngineConfig(max_concurrent_decodes=4, max_prefill_length=16, max_seq_len=48,
                      layers="loop")


@pytest.mark.parametrize("layers", ["loop", "scan"])
def test_a_layer_makes_four_matmul_calls_and_the_same_tokens(kernel, layers):
    """q, k, v in one call and gate, up in another: 4 calls a layer (with o and down) and
    one for the head, where one call per projection made 7; greedy tokens and log-probs
    as XLA's."""
    config = dataclasses.replace(ENGINE, layers=layers)
    on = create_engine(CFG, config=config, devices=jax.devices()[:1], seed=3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpu_kernels.ENV_SWITCH, "0")
        off = create_engine(CFG, config=config, devices=jax.devices()[:1], seed=3)
    params = on.load_params()
    lowered = on._generate_jit.lower(params, on.init_decode_state(), None)
    text = lowered.compile().as_text()
    calls = len(re.findall(cpu_kernels.TARGET, text))
    # the scan holds one layer body; the loop one per layer
    assert calls == (4 if layers == "scan" else 4 * CFG.num_layers) + 1, calls
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 99, size=n).tolist() for n in (5, 13, 9, 16)]
    a = generate_many(on, params, prompts, max_tokens=8, ignore_eos=True)
    b = generate_many(off, params, prompts, max_tokens=8, ignore_eos=True)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=1e-5, atol=1e-5)
