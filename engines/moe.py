"""Mixture-of-experts math for `engines.model.MoeMlp`: routing, and the experts' FFN run
either densely (every expert on every token, weighted by the router) or routed (each
token's rows grouped by expert and run through only its top-k experts; dropless).

Routed: the M tokens' M*k (token, expert) rows are sorted by expert, so each expert's rows
are contiguous (`group_sizes` says how many), run as grouped matmuls, put back in token
order and summed with the router weights. The grouped matmul is `jax.lax.ragged_dot`
wherever XLA has a ragged-dot instruction (TPU, GPU). On the CPU jax lowers ragged_dot
to a dense product of every group against every row with the others masked out (E times
the FLOPs, more than running every expert densely), so there a loop over experts runs
each expert's rows in a few blocks sized to its row count (`blocked_ffn`).

Expert parallelism: under an engine's layout (`sharding.layout`) the MoE runs in a
shard_map over the mesh: each device holds E_l = E / (expert axis) experts and a slice of
F, routes its tokens over all E, runs only the rows of its own experts, and the partial
outputs are summed over the expert and mlp mesh axes. Left to GSPMD, the CPU loop's
indexing of expert-sharded weights by a traced expert id would gather every expert's
weights onto every device; the shard_map keeps each expert where it lives.

Expert biases (gpt-oss): each expert's gate, up and down projections may add a bias
(`ExpertBias`); the down bias is inside the router's weighting, as the expert's output.

Letters: M tokens, k experts per token, R = M*k rows, D model, F ffn, E experts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from sharding import axes
from sharding.layout import current as current_layout

# The gated FFN's hidden from its gate and up projections: act(gate) * up, or another
# gating (engines.model.glu).
Glu = Callable[[jax.Array, jax.Array], jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ExpertBias:
    """Biases of the experts' projections: gate and up [E, F], down [E, D]."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array

    def at(self, e) -> ExpertBias:
        """Expert e's biases ([F], [F], [D])."""
        return ExpertBias(self.gate[e], self.up[e], self.down[e])

# The CPU path's smallest block of rows (`blocked_ffn`): each used expert wastes up to
# one. Sizes from 4 to 64 timed alike, within the noise of a shared machine
# (scripts/moe_prefill_ab.py --parts blocks, docs/BENCHMARKS.md).
MAX_BLOCK_ROWS = 16


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a router picks a token's experts and weighs them.

    "softmax" (Mixtral, Qwen3-MoE): softmax over all E, the top k.
    "sigmoid" (GLM-4.5, DeepSeek-V3): a sigmoid score per expert; the top k are chosen by
      score + a learned bias (`router_bias`, for the choice only), among the `topk_groups`
      best of `groups` equal groups of experts (a group's worth: its two best scores);
      their weights are their scores.
    "topk_softmax" (gpt-oss): the router is a linear layer with a bias (`router_bias`);
      the k largest logits, their weights the softmax over those k alone.
    "topk_sigmoid" (Llama 4): the k largest logits, their weights their sigmoids, which
      scale each chosen expert's input rather than its output (`scales_input`).
    Then `renormalize` makes the k weights sum to one ("sigmoid"; the softmaxes' already
    do, over the top k; "topk_sigmoid" keeps its sigmoids), and `scale` multiplies them."""

    kind: str = "softmax"
    renormalize: bool = True
    groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0

    @property
    def scales_input(self) -> bool:
        """Whether a token's weight multiplies its expert's input (the expert's output is
        then summed unweighted): not the same where the FFN is not linear in its input."""
        return self.kind == "topk_sigmoid"


def route(x: jax.Array, router: jax.Array, k: int, routing: Routing = Routing(),
          router_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x [M, D], router [D, E] -> (weights f32[M, k], experts i32[M, k]) as `routing`
    says, in f32."""
    if routing.kind == "topk_sigmoid":
        top, experts = jax.lax.top_k((x @ router).astype(jnp.float32), k)
        return jax.nn.sigmoid(top) * routing.scale, experts
    if routing.kind == "topk_softmax":
        logits = (x @ router).astype(jnp.float32)  # (M, E)
        if router_bias is not None:
            logits = logits + router_bias.astype(jnp.float32)
        top, experts = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1) * routing.scale, experts
    if routing.kind == "softmax":
        probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)  # (M, E)
        weights, experts = jax.lax.top_k(probs, k)
        if routing.renormalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights * routing.scale, experts
    scores = jax.nn.sigmoid(x.astype(jnp.float32) @ router.astype(jnp.float32))  # (M, E)
    choice = scores if router_bias is None else scores + router_bias.astype(jnp.float32)
    if routing.groups > 1:
        M, E = choice.shape
        per = E // routing.groups
        grouped = choice.reshape(M, routing.groups, per)
        worth = jnp.sum(jax.lax.top_k(grouped, min(2, per))[0], axis=-1)  # (M, groups)
        _, best = jax.lax.top_k(worth, routing.topk_groups)
        kept = jnp.any(jax.nn.one_hot(best, routing.groups, dtype=bool), axis=1)  # (M, groups)
        choice = jnp.where(jnp.repeat(kept, per, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if routing.renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * routing.scale, experts


def dense_experts(x, weights, experts, w1, w3, w2, glu: Glu, first=0,
                  bias: ExpertBias | None = None) -> jax.Array:
    """Every one of the E_l experts w*[E_l, ...] (global ids first..first+E_l-1) on every
    token of x [M, D]; each weighted by its router weight, zero where not chosen."""
    E = w1.shape[0]
    gates = jnp.sum(jax.nn.one_hot(experts - first, E) * weights[..., None], axis=-2)  # (M, E)
    g, u = jnp.einsum("md,edf->mef", x, w1), jnp.einsum("md,edf->mef", x, w3)
    if bias is not None:
        g, u = g + bias.gate, u + bias.up
    y = jnp.einsum("mef,efd->med", glu(g, u), w2)  # (M, E, D)
    if bias is not None:
        y = y + bias.down
    return jnp.einsum("med,me->md", y, gates.astype(y.dtype))


def routed_experts(x, weights, experts, w1, w3, w2, glu: Glu, first=0,
                   bias: ExpertBias | None = None) -> jax.Array:
    """As `dense_experts`, running each token through only its chosen experts; rows whose
    expert is not among the E_l held here contribute nothing."""
    (M, D), k, E = x.shape, experts.shape[1], w1.shape[0]
    local = experts.reshape(-1) - first  # (R,)
    key = jnp.where((local >= 0) & (local < E), local, E)  # E: held elsewhere
    order = jnp.argsort(key, stable=True)  # (R,) sorted row -> its (token, slot) row
    group_sizes = jnp.bincount(key, length=E + 1)[:E].astype(jnp.int32)
    ys = grouped_ffn(x[order // k], group_sizes, w1, w3, w2, glu, bias)  # (R, D)
    # Rows past the groups (other devices' experts) are not defined by ragged_dot.
    ys = jnp.where((jnp.arange(M * k) < jnp.sum(group_sizes))[:, None], ys, 0)
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(M, k, D)
    return jnp.einsum("mkd,mk->md", y, weights.astype(y.dtype))


def grouped_ffn(xs, group_sizes, w1, w3, w2, glu: Glu,
                bias: ExpertBias | None = None) -> jax.Array:
    """The gated FFN of expert e on rows xs[start_e : start_e + group_sizes[e]] (rows sorted
    by expert), for every e -> [R, D]; rows past sum(group_sizes) are undefined."""
    return jax.lax.platform_dependent(xs, group_sizes, w1, w3, w2, bias,
                                      cpu=lambda *a: blocked_ffn(*a[:5], glu, bias=a[5]),
                                      default=lambda *a: ragged_ffn(*a[:5], glu, a[5]))


def ragged_ffn(xs, group_sizes, w1, w3, w2, glu: Glu,
               bias: ExpertBias | None = None) -> jax.Array:
    """`grouped_ffn` as three `jax.lax.ragged_dot`s."""
    g = jax.lax.ragged_dot(xs, w1, group_sizes)
    u = jax.lax.ragged_dot(xs, w3, group_sizes)
    if bias is None:
        return jax.lax.ragged_dot(glu(g, u), w2, group_sizes)
    # Each row's expert (rows past the groups get the last: undefined rows anyway).
    row = jnp.repeat(jnp.arange(w1.shape[0]), group_sizes, total_repeat_length=xs.shape[0])
    b = bias.at(row)
    return jax.lax.ragged_dot(glu(g + b.gate, u + b.up), w2, group_sizes) + b.down


def block_rows(R: int, E: int) -> int:
    """The smallest block of the CPU path for R rows over E experts: a power of two, at
    most MAX_BLOCK_ROWS, no larger than an even share of the rows (a decode step of a few
    tokens runs one block of one or two rows per chosen expert)."""
    share = -(-R // E)
    return min(MAX_BLOCK_ROWS, 1 << (share - 1).bit_length())


def blocked_ffn(xs, group_sizes, w1, w3, w2, glu: Glu, block: int | None = None,
                bias: ExpertBias | None = None) -> jax.Array:
    """`grouped_ffn` as a loop over experts, each running its n rows in a few blocks.

    n is rounded up to a multiple of the smallest block b (`block`, default `block_rows`)
    and run in one block per binary digit of that (n = 138, b = 16: 128 + 16 rows), the
    largest first, so the matmuls are as large as the rows allow and at most b - 1 rows
    are wasted. The last block may read the next expert's rows; only the expert's own
    rows are written back, and the next expert writes its own after.
    """
    R, E = xs.shape[0], group_sizes.shape[0]
    b = block or block_rows(R, E)
    sizes = [b << i for i in range((-(-R // b)).bit_length())][::-1]  # ..., 2b, b
    xs = jnp.pad(xs, ((0, b), (0, 0)))  # the last block may run past the last row
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes

    def expert(e, out):
        w1e, w3e, w2e = w1[e], w3[e], w2[e]
        be = None if bias is None else bias.at(e)

        def run(out, s, n):  # rows [s, s + n) through expert e, those up to ends[e] kept
            xb = jax.lax.dynamic_slice_in_dim(xs, s, n)  # (n, D)
            if be is None:
                y = glu(xb @ w1e, xb @ w3e) @ w2e
            else:
                y = glu(xb @ w1e + be.gate, xb @ w3e + be.up) @ w2e + be.down
            mine = (s + jnp.arange(n) < ends[e])[:, None]
            y = jnp.where(mine, y.astype(out.dtype), jax.lax.dynamic_slice_in_dim(out, s, n))
            return jax.lax.dynamic_update_slice_in_dim(out, y, s, 0)

        padded, s = (group_sizes[e] + b - 1) // b * b, starts[e]
        for n in sizes:
            take = (padded & n) != 0
            out = jax.lax.cond(take, functools.partial(run, s=s, n=n), lambda out: out, out)
            s = s + jnp.where(take, n, 0)
        return out

    return jax.lax.fori_loop(0, E, expert, jnp.zeros_like(xs))[:R]


def moe(x, router, w1, w3, w2, k: int, glu: Glu, routed: bool,
        routing: Routing = Routing(), router_bias: jax.Array | None = None,
        expert_bias: ExpertBias | None = None) -> jax.Array:
    """x [B, T, D] through the top-k of E experts (router [D, E], w1/w3 [E, D, F],
    w2 [E, F, D]) -> [B, T, D]; `routed` picks the routed or the dense form (same result);
    `routing` and `router_bias` ([E] or None) as `route`'s; `expert_bias`: the
    experts' projection biases, or None."""
    experts_fn = routed_experts if routed else dense_experts
    bias = jnp.zeros((router.shape[1],), jnp.float32) if router_bias is None else router_bias

    def run(x, router, bias, w1, w3, w2, eb, first=0):
        B, T, D = x.shape
        x = x.reshape(B * T, D)
        weights, experts = route(x, router, k, routing, bias)
        if routing.scales_input:  # each (token, expert) a row of its own, weight one
            rows = (x[:, None, :] * weights[..., None].astype(x.dtype)).reshape(-1, D)
            ones = jnp.ones((rows.shape[0], 1), jnp.float32)
            y = experts_fn(rows, ones, experts.reshape(-1, 1), w1, w3, w2, glu, first, eb)
            return jnp.sum(y.reshape(B * T, k, D), axis=1).reshape(B, T, D)
        return experts_fn(x, weights, experts, w1, w3, w2, glu, first, eb).reshape(B, T, D)

    cur = current_layout()
    if cur is None or cur[1].size == 1:
        return run(x, router, bias, w1, w3, w2, expert_bias)
    config, mesh = cur
    w_spec = config.spec((axes.EXPERT, None, axes.MLP), w1.shape, mesh, "moe w1", strict=False)
    e_axis, f_axis = w_spec[0], w_spec[2]
    sums = tuple(a for a in (e_axis, f_axis) if a is not None)
    # Tokens split as the residual stream is, except over an axis that splits the weights
    # (each device must see every token its experts and F slice serve).
    x_spec = config.spec((axes.BATCH, axes.SEQ, None), x.shape, mesh, "moe input", strict=False)
    x_spec = PartitionSpec(*(None if a in sums else a for a in x_spec))

    def local(x, router, bias, w1, w3, w2, eb):
        first = 0 if e_axis is None else jax.lax.axis_index(e_axis) * w1.shape[0]
        if eb is not None and f_axis is not None:  # F's shards sum: one adds the down bias
            keep = (jax.lax.axis_index(f_axis) == 0).astype(eb.down.dtype)
            eb = dataclasses.replace(eb, down=eb.down * keep)
        y = run(x, router, bias, w1, w3, w2, eb, first)
        return jax.lax.psum(y, sums) if sums else y

    w2_spec = PartitionSpec(e_axis, f_axis, None)
    eb_spec = None if expert_bias is None else ExpertBias(
        PartitionSpec(e_axis, f_axis), PartitionSpec(e_axis, f_axis), PartitionSpec(e_axis))
    return jax.shard_map(local, mesh=mesh, in_specs=(x_spec, PartitionSpec(), PartitionSpec(),
                                                     w_spec, w_spec, w2_spec, eb_spec),
                         out_specs=x_spec, check_vma=False)(x, router, bias, w1, w3, w2,
                                                            expert_bias)
