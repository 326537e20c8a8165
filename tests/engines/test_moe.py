"""Routed mixture of experts (engines/moe.py): the grouped FFN of both paths (the CPU's
blocked loop and `jax.lax.ragged_dot`) against a per-row reference, routed against dense,
the expert subsets that devices hold under expert parallelism summing to the whole, the
model forming no [tokens, E, F] product when routed, `ep_tp` gathering no expert weights,
and a quantized Mixtral under `ep_tp` giving one device's tokens. (Parity with transformers: tests/parity/test_moe_parity.py.)"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engines import create_engine, moe
from engines import quantization as qz
from engines.kv_cache import PrefillKV
from sharding import load_preset, traced_under
from tests.sharding import families


def silu(gate, up):  # SwiGLU's hidden from its gate and up projections
    return jax.nn.silu(gate) * up


def _weights(E, D, F, seed=0):
    rng = np.random.default_rng(seed)
    draw = lambda *s: jnp.asarray(0.3 * rng.standard_normal(s), jnp.float32)  # noqa: E731
    return draw(E, D, F), draw(E, D, F), draw(E, F, D)


def _ffn_reference(xs, sizes, w1, w3, w2):
    """Row by row in numpy (float64): row r through the expert whose group holds it."""
    xs, w1, w3, w2 = (np.asarray(a, np.float64) for a in (xs, w1, w3, w2))
    expert = np.repeat(np.arange(len(sizes)), sizes)
    out = np.zeros_like(xs)
    for r, e in enumerate(expert):
        a = xs[r] @ w1[e]
        out[r] = (a / (1 + np.exp(-a)) * (xs[r] @ w3[e])) @ w2[e]
    return out, len(expert)


@pytest.mark.parametrize("sizes", [[7, 0, 12, 1], [20, 0, 0, 0], [0, 0, 0, 20],
                                   [1, 1, 1, 1], [5, 9, 0, 3]])
@pytest.mark.parametrize("block", [None, 1, 4, 16])
def test_grouped_ffn_paths_match_reference(sizes, block):
    D, F, R = 8, 12, 20  # R rows; rows past sum(sizes) are not any expert's
    w1, w3, w2 = _weights(len(sizes), D, F)
    xs = jnp.asarray(np.random.default_rng(1).standard_normal((R, D)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    want, n = _ffn_reference(xs, sizes, w1, w3, w2)
    blocked = jax.jit(lambda *a: moe.blocked_ffn(*a, silu, block=block))(xs, gs, w1, w3, w2)
    np.testing.assert_allclose(np.asarray(blocked)[:n], want[:n], rtol=1e-5, atol=1e-5)
    if block is None:
        ragged = moe.ragged_ffn(xs, gs, w1, w3, w2, silu)
        np.testing.assert_allclose(np.asarray(ragged)[:n], want[:n], rtol=1e-5, atol=1e-5)


def _tokens_and_routing(M, E, k, D=16, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, D)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((D, E)), jnp.float32)
    weights, experts = moe.route(x, router, k)
    return x, weights, experts


@pytest.mark.parametrize("M,E,k", [(1, 8, 2), (3, 8, 2), (32, 8, 2), (300, 8, 2),
                                   (40, 4, 1), (40, 5, 3), (16, 4, 4)])
def test_routed_matches_dense(M, E, k):
    x, weights, experts = _tokens_and_routing(M, E, k)
    w = _weights(E, 16, 24)
    dense = moe.dense_experts(x, weights, experts, *w, silu)
    routed = jax.jit(lambda *a: moe.routed_experts(*a, silu))(x, weights, experts, *w)
    np.testing.assert_allclose(np.asarray(routed), np.asarray(dense), rtol=1e-5, atol=1e-5)
    # Each token's top-k, renormalised: the weights of a token sum to one.
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("shards", [2, 4])
def test_expert_subsets_sum_to_the_whole(shards):
    """What each device of an expert axis computes (its experts' rows only) sums to the
    whole layer, for both forms."""
    E = 8
    x, weights, experts = _tokens_and_routing(50, E, 2)
    w = _weights(E, 16, 24)
    whole = moe.dense_experts(x, weights, experts, *w, silu)
    n = E // shards
    for form in (moe.routed_experts, moe.dense_experts):
        parts = [form(x, weights, experts, *(a[i * n:(i + 1) * n] for a in w), silu,
                      first=i * n) for i in range(shards)]
        np.testing.assert_allclose(np.asarray(sum(parts)), np.asarray(whole), rtol=1e-5,
                                   atol=1e-5)


def _expert_products(cfg, T):
    """Shapes of the dot products in the model's program for one prompt of T tokens."""
    eng = create_engine(cfg, devices=jax.devices()[:1], config=families.ENGINE_CONFIG)
    tokens = jnp.zeros((1, T), jnp.int32)
    pos = jnp.arange(T)[None]
    jaxpr = jax.make_jaxpr(lambda p: eng.model.apply({"params": p}, tokens, pos,
                                                     PrefillKV(pos, None)))(eng.abstract_params)
    shapes = set()

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "dot_general":
                shapes.add(tuple(eqn.outvars[0].aval.shape))
            for v in eqn.params.values():  # loops, conditionals, shard_map bodies
                for sub in v if isinstance(v, tuple | list) else (v,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        walk(sub)

    walk(jaxpr.jaxpr)
    return shapes


def test_routed_model_forms_no_product_over_every_expert():
    cfg = families.model_config("mixtral")  # 4 experts, top 2
    E, F, T = cfg.num_experts, cfg.intermediate_size, 16

    def every_expert(shapes):  # an F-wide product as large as all T tokens x all E
        return [s for s in shapes if F in s and math.prod(s) >= T * E * F]

    assert not every_expert(_expert_products(cfg, T))
    # With k == E every expert runs on every token anyway, densely.
    assert every_expert(_expert_products(dataclasses.replace(cfg, num_experts_per_tok=E), T))


def test_ep_tp_gathers_no_expert_weights():
    """Under ep_tp each device runs only the experts it holds: the compiled prefill never
    gathers a whole [E, ...] expert kernel (as GSPMD would around an expert index)."""
    eng = families.make_engine("mixtral", "ep_tp", jax.devices()[:8])  # {expert: 4, model: 2}
    tokens = jnp.zeros((1, 16), jnp.int32)
    pos = jnp.arange(16)[None]
    fn = traced_under(eng.sharding, eng.mesh, lambda p, t, pos: eng.model.apply(
        {"params": p}, t, pos, PrefillKV(pos, None)))
    hlo = jax.jit(fn, in_shardings=(eng.param_shardings, None, None)).lower(
        eng.abstract_params, tokens, pos).compile().as_text()
    E = eng.model_config.num_experts
    gathers = [ln for ln in hlo.splitlines() if "all-gather(" in ln]
    assert not [ln for ln in gathers if re.search(rf"= f32\[{E},", ln)], gathers
    assert "all-reduce(" in hlo  # the experts' partial outputs are summed


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_mixtral_ep_tp_matches_one_device(scheme):
    cfg = families.model_config("mixtral")
    ec = dataclasses.replace(families.ENGINE_CONFIG, quantize=scheme)
    host = families.host_params(families.make_engine("mixtral", "replicated",
                                                     jax.devices()[:1]))
    host = qz.quantize_params(host, scheme, qz.DEFAULT_GROUP, np)
    tokens = {}
    for preset, n in (("replicated", 1), ("ep_tp", 8)):
        eng = create_engine(cfg, devices=jax.devices()[:n], sharding=load_preset(preset),
                            config=ec)
        params = families.place(eng, host)
        tokens[preset] = families.greedy_tokens(eng, params)
    w1 = params["layers_0"]["moe"]["w1"][qz.QVALUE]  # ep_tp: 4 experts over 4 devices
    assert w1.sharding.shard_shape(w1.shape)[0] == 1
    assert tokens["ep_tp"] == tokens["replicated"]


def _biases(E, D, F, seed=3):
    rng = np.random.default_rng(seed)
    draw = lambda *s: jnp.asarray(0.5 * rng.standard_normal(s), jnp.float32)  # noqa: E731
    return moe.ExpertBias(gate=draw(E, F), up=draw(E, F), down=draw(E, D))


@pytest.mark.parametrize("block", [None, 1, 4])
def test_grouped_ffn_with_expert_biases(block):
    """gpt-oss's expert biases on both grouped paths, against the rows in numpy."""
    sizes, D, F, R = [7, 0, 12, 1], 8, 12, 20
    w1, w3, w2 = _weights(len(sizes), D, F)
    b = _biases(len(sizes), D, F)
    xs = jnp.asarray(np.random.default_rng(1).standard_normal((R, D)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    expert = np.repeat(np.arange(len(sizes)), sizes)
    want = np.stack([np.asarray(silu(xs[r] @ w1[e] + b.gate[e], xs[r] @ w3[e] + b.up[e])
                                @ w2[e] + b.down[e]) for r, e in enumerate(expert)])
    n = len(expert)
    blocked = jax.jit(lambda *a: moe.blocked_ffn(*a, silu, block=block, bias=b))(xs, gs, w1,
                                                                                 w3, w2)
    np.testing.assert_allclose(np.asarray(blocked)[:n], want, rtol=1e-5, atol=1e-5)
    ragged = moe.ragged_ffn(xs, gs, w1, w3, w2, silu, b)
    np.testing.assert_allclose(np.asarray(ragged)[:n], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M,E,k", [(1, 4, 2), (40, 8, 2), (16, 4, 4)])
def test_topk_softmax_routing_and_biased_experts(M, E, k):
    """gpt-oss's router: a biased linear layer, the top k logits, a softmax over those k;
    routed equals dense with the experts' biases, and each expert subset sums to the
    whole (the down bias counted once, with its expert)."""
    x, _, _ = _tokens_and_routing(M, E, k)
    rng = np.random.default_rng(4)
    router = jnp.asarray(rng.standard_normal((16, E)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(E), jnp.float32)
    weights, experts = moe.route(x, router, k, moe.Routing(kind="topk_softmax"), bias)
    logits = np.asarray(x) @ np.asarray(router) + np.asarray(bias)
    top = np.argsort(-logits, axis=1)[:, :k]
    np.testing.assert_array_equal(np.asarray(experts), top)
    chosen = np.take_along_axis(logits, top, 1)
    soft = np.exp(chosen - chosen.max(1, keepdims=True))
    np.testing.assert_allclose(np.asarray(weights), soft / soft.sum(1, keepdims=True),
                               rtol=1e-5)
    w, b = _weights(E, 16, 24), _biases(E, 16, 24)
    dense = moe.dense_experts(x, weights, experts, *w, silu, bias=b)
    routed = jax.jit(lambda *a: moe.routed_experts(*a, silu, bias=b))(x, weights, experts, *w)
    np.testing.assert_allclose(np.asarray(routed), np.asarray(dense), rtol=1e-5, atol=1e-5)
    n = E // 2
    halves = []
    for i in range(2):
        part = slice(i * n, (i + 1) * n)
        halves.append(moe.routed_experts(x, weights, experts, *(a[part] for a in w), silu,
                                         first=i * n, bias=moe.ExpertBias(
                                             b.gate[part], b.up[part], b.down[part])))
    np.testing.assert_allclose(np.asarray(sum(halves)), np.asarray(dense), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("k", [1, 2])
def test_topk_sigmoid_routing_scales_each_experts_input(k):
    """Llama 4's router: the top k logits, each weight its sigmoid, multiplying the
    chosen expert's input (the outputs summed unweighted), in the routed and the dense
    form alike, against a float64 reference; scaling the outputs instead differs."""
    M, E, D, F = 24, 4, 16, 24
    x, _, _ = _tokens_and_routing(M, E, k, D)
    router = jnp.asarray(np.random.default_rng(6).standard_normal((D, E)), jnp.float32)
    routing = moe.Routing(kind="topk_sigmoid")
    weights, experts = moe.route(x, router, k, routing)
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    top = np.argsort(-logits, axis=1)[:, :k]
    np.testing.assert_array_equal(np.asarray(experts), top)
    sig = 1 / (1 + np.exp(-np.take_along_axis(logits, top, 1)))
    np.testing.assert_allclose(np.asarray(weights), sig, rtol=1e-5)
    w = _weights(E, D, F)
    w1, w3, w2 = (np.asarray(a, np.float64) for a in w)
    want = np.zeros((M, D))
    for m, j in np.ndindex(M, k):
        e, xin = top[m, j], sig[m, j] * np.asarray(x, np.float64)[m]
        a = xin @ w1[e]
        want[m] += (a / (1 + np.exp(-a)) * (xin @ w3[e])) @ w2[e]
    for routed in (True, False):
        got = moe.moe(x[None], router, *w, k, silu, routed=routed, routing=routing)[0]
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    out_scaled = moe.dense_experts(x, weights, experts, *w, silu)  # weights on the outputs
    assert np.max(np.abs(np.asarray(out_scaled) - want)) > 1e-3
