"""One decoder for the Llama, Mistral, Qwen2/3, Gemma 1/2/3, Mixtral, OLMo 2, Phi-3 and
the MoE families (Qwen3-MoE, GLM-4.5, gpt-oss, Llama 4) (Flax linen).

The model does math only: it never builds meshes or calls jit. Parameters carry logical
axis names (`sharding.axes`), which the engine maps to mesh axes. The KV cache is not
owned here: each attention layer hands its new keys and values to a `KVStore` supplied by
the caller, which returns what the layer should attend over (prefill concatenates,
generate scatters into per-slot buffers, a paged store would write pages); the attention
math itself is engines/attention.py, run by the `Backend` the engine hands in
(engines/backend.py: blockwise or a platform kernel for whole prompts).

Letters: B batch, T query length, S key length, D model, N query heads, K kv heads,
G = N/K, H head dim, F ffn, V vocab, E experts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from engines import layer_scan, moe, quantization
from engines.attention import KVStore
from engines.backend import Backend
from engines.config import SLIDING, ModelConfig
from engines.rope import rope_tables
from sharding import axes
from sharding.layout import constrain

# Logical names of activations, for sharding constraints (no-ops outside an engine's mesh).
_RESIDUAL_ACT = (axes.BATCH, axes.SEQ, axes.EMBED)  # (B, T, D)
_HEADS_ACT = (axes.BATCH, axes.SEQ, axes.HEADS, axes.HEAD_DIM)  # (B, T, N, H)
_KV_ACT = (axes.BATCH, axes.SEQ, axes.KV_HEADS, axes.HEAD_DIM)  # (B, T, K, H)


def rms_norm(x: jax.Array, w: jax.Array, eps: float, plus_one: bool,
             axes: tuple[int, ...] = (-1,)) -> jax.Array:
    """RMSNorm of x over `axes` (w shaped as those axes of x)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=axes, keepdims=True) + eps)
    scale = (1.0 + w.astype(jnp.float32)) if plus_one else w.astype(jnp.float32)
    return (xf * scale).astype(x.dtype)


def rope_inputs(cfg: ModelConfig) -> dict[str, jax.Array]:
    """Per attention kind of cfg's layers, its RoPE inverse frequencies f32[2, R/2]
    (engines.config.rope_tables): what the decoder hands every layer."""
    kinds = sorted({cfg.layer_kind(i) for i in range(cfg.num_layers)})
    return {k: jnp.asarray(rope_tables(cfg, k)[0], jnp.float32) for k in kinds}


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, *, switch_at: int = 0,
         scale: float = 1.0) -> jax.Array:
    """Rotary embedding, half-split layout as in the HF checkpoints, on the first R dims
    of each head (inv_freq f32[2, R/2]: row 1 from position `switch_at` on, where it is
    > 0, row 0 before), cos and sin times `scale`. x: [B, T, n, H]."""
    p = positions[..., None].astype(jnp.float32)
    angles = p * inv_freq[0]  # (B, T, R/2)
    if switch_at:
        angles = jnp.where(p >= switch_at, p * inv_freq[1], angles)
    cos = jnp.cos(angles)[:, :, None, :] * scale
    sin = jnp.sin(angles)[:, :, None, :] * scale
    R = 2 * inv_freq.shape[-1]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf[..., :R], 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., R:]], axis=-1)
    return out.astype(x.dtype)


def _adapted(lora, module: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """y = x's projection by `module`, plus each row's LoRA delta when a hook is given."""
    return y if lora is None else lora(module, x, y)


def _param(mod: nn.Module, name: str, shape: tuple[int, ...], names: tuple[str, ...],
           dtype: Any, init=None, at: layer_scan.Layer | None = None) -> jax.Array:
    """A parameter; in a scanned layer (`at`) stacked for all layers, this layer's slice."""
    return layer_scan.param(mod, name, init or nn.initializers.normal(0.02), shape, names,
                            dtype, at)


def _kernel(mod: nn.Module, name: str, shape: tuple[int, ...], names: tuple[str, ...],
            dtype: Any, at: layer_scan.Layer | None = None,
            in_place: bool = False) -> jax.Array | layer_scan.LayerWeight:
    """A matmul kernel: a plain param, or stored quantized (cfg.weight_quant; the
    experts' by cfg.expert_quant) and dequantized here, inside the jitted step, right
    before its matmul. `in_place`: a float kernel of a scanned layer comes whole with its
    index (layer_scan.LayerWeight), which Backend.linear reads in place."""
    if quantization.kernel_scheme(mod.cfg, name)[0] == "none":
        return layer_scan.param(mod, name, nn.initializers.normal(0.02), shape, names, dtype,
                                at, whole=in_place)
    return quantization.quantized_kernel(mod, name, shape, names, dtype, at)


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: Any
    layer: int
    backend: Backend  # the engine's choice of attention implementation

    @nn.compact
    def __call__(self, x, positions, inv_freq, kv: KVStore, lora=None, at=None):
        c = self.cfg
        D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        kernel = functools.partial(_kernel, self, dtype=self.dtype, at=at, in_place=True)
        wq = kernel("q_proj", (N, H, D), (axes.HEADS, axes.HEAD_DIM, axes.EMBED))
        wk = kernel("k_proj", (K, H, D), (axes.KV_HEADS, axes.HEAD_DIM, axes.EMBED))
        wv = kernel("v_proj", (K, H, D), (axes.KV_HEADS, axes.HEAD_DIM, axes.EMBED))
        wo = kernel("o_proj", (D, N, H), (axes.EMBED, axes.HEADS, axes.HEAD_DIM))
        B, T = x.shape[:2]
        q, k, v = self.backend.linear_many(
            x, (wq.reshape(N * H, D), wk.reshape(K * H, D), wv.reshape(K * H, D)))
        q = _adapted(lora, "q_proj", x, q).reshape(B, T, N, H)
        k = _adapted(lora, "k_proj", x, k).reshape(B, T, K, H)
        v = _adapted(lora, "v_proj", x, v).reshape(B, T, K, H)
        if c.qkv_bias:
            zeros = nn.initializers.zeros
            bias = functools.partial(_param, self, dtype=self.dtype, init=zeros, at=at)
            q = q + bias("q_bias", (N, H), (axes.HEADS, axes.HEAD_DIM))
            k = k + bias("k_bias", (K, H), (axes.KV_HEADS, axes.HEAD_DIM))
            v = v + bias("v_bias", (K, H), (axes.KV_HEADS, axes.HEAD_DIM))
        if c.qk_norm in ("head", "projection"):
            q, k = self._qk_norm(q, k, at)
        kind = c.layer_kind(self.layer)  # scanned layers are all of one kind
        window, chunk = c.layer_window(self.layer), c.layer_chunk(self.layer)
        if c.layer_rope(self.layer):
            q, k = self._rope(q, k, positions, inv_freq, kind)
        elif c.attn_temperature_tuning:  # Llama 4's NoPE layers: sharper far from 0
            t = jnp.floor((positions.astype(jnp.float32) + 1.0) / c.floor_scale)
            temp = jnp.log1p(t) * c.attn_scale + 1.0  # (B, T)
            q = (q.astype(jnp.float32) * temp[:, :, None, None]).astype(q.dtype)
        if c.query_pre_attn_scalar is not None:  # the attention's 1/sqrt(H) becomes this
            q = q * jnp.asarray(math.sqrt(H / c.query_pre_attn_scalar), q.dtype)
        # Heads stay split over the model axis from projection to o_proj (one all-reduce
        # per block, after o_proj), rather than XLA gathering them around the cache.
        q = constrain(q, _HEADS_ACT, "attention q")
        k = constrain(k, _KV_ACT, "attention k")
        v = constrain(v, _KV_ACT, "attention v")
        k_all, v_all, k_pos = kv.update(self.layer, k, v)
        # A store may attend itself (the contiguous decode store over its own layout; the
        # paged store's TPU kernel reads pages in place).
        cap = c.attn_logit_softcap
        sinks = (_param(self, "sinks", (N,), (axes.HEADS,), self.dtype, at=at)
                 if c.attn_sinks else None)  # [N], each head's logit in the softmax's sum
        attend = getattr(kv, "attend", None)
        if attend is not None:
            out = attend(self.layer, q, positions, window, softcap=cap, sinks=sinks, chunk=chunk)
        else:
            out = self.backend.attention(q, k_all, v_all, positions, k_pos, window, softcap=cap,
                                         sinks=sinks, chunk=chunk)
        out = constrain(out, _HEADS_ACT, "attention output")
        out = out.reshape(B, T, N * H)
        y = _adapted(lora, "o_proj", out, self.backend.linear(out, wo.reshape(D, N * H)))
        if c.o_bias:
            y = y + _param(self, "o_bias", (D,), (axes.EMBED,), self.dtype,
                           nn.initializers.zeros, at=at)
        return y

    def _rope(self, q, k, positions, inv_freq, kind):
        """q [B, T, N, H] and k [B, T, K, H] rotated by RoPE for a layer of `kind` (then
        weightless RMS-normed per head where qk_norm is "l2", Llama 4)."""
        c = self.cfg
        _, scale = rope_tables(c, kind)
        rs = c.rope_scaling
        switch = rs.original_max_position_embeddings if rs and rs.kind == "longrope" else 0
        if kind == SLIDING and c.local_rope_theta is not None:
            switch = 0
        q = rope(q, positions, inv_freq[kind], switch_at=switch, scale=scale)
        k = rope(k, positions, inv_freq[kind], switch_at=switch, scale=scale)
        if c.qk_norm == "l2":
            one = jnp.ones((c.head_dim,), jnp.float32)
            q = rms_norm(q, one, c.rms_norm_eps, False)
            k = rms_norm(k, one, c.rms_norm_eps, False)
        return q, k

    def _qk_norm(self, q, k, at):
        """RMSNorm of q [B, T, N, H] and k [B, T, K, H] before RoPE: each head over its H
        dims ("head"), or each token's whole projection over N*H and K*H ("projection";
        with kv heads repeated, the mean over the copies is the stored heads' mean)."""
        c = self.cfg
        init = nn.initializers.zeros if c.norm_plus_one else nn.initializers.ones
        norm = functools.partial(_param, self, dtype=self.dtype, init=init, at=at)
        if c.qk_norm == "head":
            wq = norm("q_norm", (c.head_dim,), (axes.HEAD_DIM,))
            wk = norm("k_norm", (c.head_dim,), (axes.HEAD_DIM,))
            return (rms_norm(q, wq, c.rms_norm_eps, c.norm_plus_one),
                    rms_norm(k, wk, c.rms_norm_eps, c.norm_plus_one))
        wq = norm("q_norm", (c.num_heads, c.head_dim), (axes.HEADS, axes.HEAD_DIM))
        wk = norm("k_norm", (c.num_kv_heads, c.head_dim), (axes.KV_HEADS, axes.HEAD_DIM))
        return (rms_norm(q, wq, c.rms_norm_eps, c.norm_plus_one, axes=(-2, -1)),
                rms_norm(k, wk, c.rms_norm_eps, c.norm_plus_one, axes=(-2, -1)))


class MlaAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V3), run in its absorbed form: each head's
    query meets the shared latent through kv_b_proj's key rows (W_UK folded into the
    query), the heads attend as N queries over one kv head [latent | RoPE'd key] of
    C = kv_lora_rank + qk_rope_head_dim dims (what the caches hold per token: cfg.head_dim,
    one kv head, keys only: the values are the keys, cfg.value_dim 0), and each head's
    output over the latents goes through kv_b_proj's value rows (W_UV) before o_proj.
    Letters: R kv_lora_rank, Q q_lora_rank, P rope dims, A qk_nope_head_dim, E v_head_dim,
    C = R + P."""

    cfg: ModelConfig
    dtype: Any
    layer: int
    backend: Backend

    @nn.compact
    def __call__(self, x, positions, inv_freq, kv: KVStore, lora=None, at=None):
        c = self.cfg
        if lora is not None:
            raise ValueError("LoRA adapters are not implemented for multi-head latent "
                             "attention (deepseek_v3)")
        D, N, R, P = c.hidden_size, c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim
        A, E, Q = c.qk_nope_head_dim, c.v_head_dim, c.q_lora_rank
        kernel = functools.partial(_kernel, self, dtype=self.dtype, at=at)
        norm = functools.partial(_param, self, names=(None,), dtype=self.dtype,
                                 init=nn.initializers.ones, at=at)
        if Q:
            wqa = kernel("q_a_proj", (Q, D), (None, axes.EMBED))
            wqb = kernel("q_b_proj", (N, A + P, Q), (axes.HEADS, axes.HEAD_DIM, None))
            xq = rms_norm(jnp.einsum("btd,qd->btq", x, wqa), norm("q_a_layernorm", (Q,)),
                          1e-6, False)
            q = jnp.einsum("btq,nhq->btnh", xq, wqb)  # (B, T, N, A + P)
        else:
            wq = kernel("q_proj", (N, A + P, D), (axes.HEADS, axes.HEAD_DIM, axes.EMBED))
            q = jnp.einsum("btd,nhd->btnh", x, wq)
        wkva = kernel("kv_a_proj_with_mqa", (R + P, D), (None, axes.EMBED))
        wkvb = kernel("kv_b_proj", (N, A + E, R), (axes.HEADS, axes.HEAD_DIM, None))
        wo = kernel("o_proj", (D, N, E), (axes.EMBED, axes.HEADS, axes.HEAD_DIM))
        ckv = jnp.einsum("btd,cd->btc", x, wkva)  # (B, T, C)
        latent = rms_norm(ckv[..., :R], norm("kv_a_layernorm", (R,)), 1e-6, False)
        q_rot, k_rot = q[..., A:], ckv[:, :, None, R:]  # (B, T, N, P), (B, T, 1, P)
        if c.rope_interleave:  # pairs (2i, 2i+1) -> halves (i, i + P/2): same q.k
            half = jnp.asarray(list(range(0, P, 2)) + list(range(1, P, 2)))
            q_rot, k_rot = q_rot[..., half], k_rot[..., half]
        kind = c.layer_kind(self.layer)
        _, scale = rope_tables(c, kind)
        q_rot = rope(q_rot, positions, inv_freq[kind], scale=scale)
        k_rot = rope(k_rot, positions, inv_freq[kind], scale=scale)
        q_lat = jnp.einsum("btna,nar->btnr", q[..., :A], wkvb[:, :A])  # W_UK absorbed
        # The paths divide scores by sqrt(C); the family's scale is 1/sqrt(this scalar).
        q = jnp.concatenate([q_lat, q_rot], axis=-1)
        q = q * jnp.asarray(math.sqrt(c.head_dim / c.query_pre_attn_scalar), q.dtype)
        k = jnp.concatenate([latent[:, :, None, :], k_rot], axis=-1)  # (B, T, 1, C)
        q = constrain(q, _HEADS_ACT, "attention q")
        # Keys only: the stores hold values of width 0 and attention reads the keys as the
        # values (engines.attention.key_only); of its output only the latent part is used.
        k_all, _, k_pos = kv.update(self.layer, k, k[..., :0])
        attend = getattr(kv, "attend", None)
        if attend is not None:
            out = attend(self.layer, q, positions, None)
        else:
            out = self.backend.attention(q, k_all, k_all, positions, k_pos, None)
        out = jnp.einsum("btnr,ner->btne", out[..., :R], wkvb[:, A:])  # W_UV: (B, T, N, E)
        return jnp.einsum("btne,dne->btd", out, wo)


def glu(cfg: ModelConfig, gate: jax.Array, up: jax.Array) -> jax.Array:
    """The gated MLP's hidden from its gate and up projections, by cfg.activation."""
    if cfg.activation == "clamped_swiglu":  # gpt-oss
        gate = jnp.minimum(gate, cfg.swiglu_limit)
        up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
        return gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha) * (up + 1)
    act = nn.silu if cfg.activation == "silu" else functools.partial(nn.gelu, approximate=True)
    return act(gate) * up


class Mlp(nn.Module):
    cfg: ModelConfig
    dtype: Any
    backend: Backend  # the dense layers' matmul

    @nn.compact
    def __call__(self, x, lora=None, at=None):
        D, F = self.cfg.hidden_size, self.cfg.intermediate_size
        kernel = functools.partial(_kernel, self, dtype=self.dtype, at=at, in_place=True)
        wg = kernel("gate_proj", (F, D), (axes.MLP, axes.EMBED))
        wu = kernel("up_proj", (F, D), (axes.MLP, axes.EMBED))
        wd = kernel("down_proj", (D, F), (axes.EMBED, axes.MLP))
        gate, up = self.backend.linear_many(x, (wg, wu))
        gate, up = _adapted(lora, "gate_proj", x, gate), _adapted(lora, "up_proj", x, up)
        h = constrain(glu(self.cfg, gate, up), (axes.BATCH, axes.SEQ, axes.MLP), "mlp hidden")
        return _adapted(lora, "down_proj", h, self.backend.linear(h, wd))  # h: (B, T, F)


class MoeMlp(nn.Module):
    """Top-k of E experts (engines/moe.py), routed: each token runs through its k experts
    only. With k == E every expert runs on every token anyway, and the dense form, which
    has no rows to sort, does the same work.

    No step size keeps the dense form: on the CPU, routed is faster at every decode size
    measured (1 to 32 tokens: 2.7x to 15x for one layer of 8 experts top-2, since a step
    reads only the chosen experts' weights) as well as at prefill
    (scripts/moe_prefill_ab.py, docs/BENCHMARKS.md)."""

    cfg: ModelConfig
    dtype: Any

    @nn.compact
    def __call__(self, x, at=None):
        c = self.cfg
        D, F, E = c.hidden_size, c.expert_size, c.num_experts
        router = _param(self, "router", (D, E), (axes.EMBED, None), self.dtype, at=at)
        # The sigmoid router's score-correction bias (it only picks experts) or the gpt-oss
        # router's own bias (in its logits), kept in f32.
        bias = (_param(self, "router_bias", (E,), (None,), jnp.float32,
                       nn.initializers.zeros, at=at)
                if c.moe_router in ("sigmoid", "topk_softmax") else None)
        kernel = functools.partial(_kernel, self, dtype=self.dtype, at=at)
        w1 = kernel("w1", (E, D, F), (axes.EXPERT, axes.EMBED, axes.MLP))
        w3 = kernel("w3", (E, D, F), (axes.EXPERT, axes.EMBED, axes.MLP))
        w2 = kernel("w2", (E, F, D), (axes.EXPERT, axes.MLP, axes.EMBED))
        expert_bias = None
        if c.expert_bias:
            b = functools.partial(_param, self, dtype=self.dtype, init=nn.initializers.zeros,
                                  at=at)
            expert_bias = moe.ExpertBias(gate=b("b1", (E, F), (axes.EXPERT, axes.MLP)),
                                         up=b("b3", (E, F), (axes.EXPERT, axes.MLP)),
                                         down=b("b2", (E, D), (axes.EXPERT, axes.EMBED)))
        routing = moe.Routing(kind=c.moe_router, renormalize=c.moe_renormalize,
                              groups=c.moe_groups, topk_groups=c.moe_topk_groups,
                              scale=c.moe_scale)
        return moe.moe(x, router, w1, w3, w2, c.num_experts_per_tok, functools.partial(glu, c),
                       routed=c.num_experts_per_tok < E, routing=routing, router_bias=bias,
                       expert_bias=expert_bias)


class Block(nn.Module):
    cfg: ModelConfig
    dtype: Any
    layer: int
    backend: Backend

    @nn.compact
    def __call__(self, x, positions, inv_freq, kv: KVStore, lora=None):
        return self.block(x, positions, inv_freq, kv, lora)

    def block(self, x, positions, inv_freq, kv: KVStore, lora=None, at=None):
        """at: the layer of the stacked parameters a scanned block runs (layer_scan.Layer)."""
        c = self.cfg
        ones = nn.initializers.zeros if c.norm_plus_one else nn.initializers.ones
        norm = functools.partial(_param, self, shape=(c.hidden_size,), names=(axes.EMBED,),
                                 dtype=self.dtype, init=ones, at=at)

        def normed(name, h):
            return rms_norm(h, norm(name), c.rms_norm_eps, c.norm_plus_one)

        def mlp(h):
            if c.moe_layer(self.layer):
                y = MoeMlp(c, self.dtype, name="moe")(h, at)
                if c.shared_experts:  # always on, beside the routed ones
                    shared = dataclasses.replace(c, intermediate_size=c.expert_size
                                                 * c.shared_experts)
                    y = y + Mlp(shared, self.dtype, self.backend, name="shared_experts")(h, None,
                                                                                       at)
                return y
            return Mlp(c, self.dtype, self.backend, name="mlp")(h, lora, at)

        attn = (MlaAttention if c.mla else Attention)(c, self.dtype, self.layer, self.backend, name="self_attn")
        # HF's names: "post_attention_layernorm" is the MLP's input norm in the "pre"
        # layout (Llama) and the attention output's norm in the others.
        if c.norm_layout == "pre":
            x = x + attn(normed("input_layernorm", x), positions, inv_freq, kv, lora, at)
            return x + mlp(normed("post_attention_layernorm", x))
        if c.norm_layout == "post":  # OLMo 2
            x = x + normed("post_attention_layernorm", attn(x, positions, inv_freq, kv, lora, at))
            return x + normed("post_feedforward_layernorm", mlp(x))
        # "sandwich" (Gemma 2/3)
        a = attn(normed("input_layernorm", x), positions, inv_freq, kv, lora, at)
        x = x + normed("post_attention_layernorm", a)
        return x + normed("post_feedforward_layernorm", mlp(normed("pre_feedforward_layernorm", x)))


class ScanBlock(Block):
    """Block as the body of the scan over layers (engines/layer_scan.py): carry (x, the
    store's stacked state), xs (layer index i, the store's per-layer inputs); its
    parameters are the stacked ones, read at layer i. `layer` is unused: the store opened
    for layer i knows its layer."""

    @nn.compact
    def __call__(self, carry, xs, positions, inv_freq, kv, lora=None):
        x, kv_carry = carry
        i, kv_xs = xs
        store = kv.scan_layer(kv_carry, kv_xs, i)
        at = layer_scan.Layer(i, self.cfg.num_layers)
        hook = None if lora is None else lora.at_layer(i)  # the pool read at layer i
        x = constrain(self.block(x, positions, inv_freq, store, hook, at=at), _RESIDUAL_ACT,
                      "layer output")
        return (x, store.scan_carry()), store.scan_ys()


class Decoder(nn.Module):
    """tokens [B, T] at positions [B, T] -> logits f32[B, T, V] (or only at `last`: [B]
    indices, one row each, or [B, R], R rows each, the mixed step's); `lora`
    (engines/lora.py LoraBatch) adds each row's adapter to the projections."""

    cfg: ModelConfig
    dtype: Any = jnp.float32
    backend: Backend = Backend()  # the engine picks it for its devices (engines.backend)

    @nn.compact
    def __call__(self, tokens, positions, kv: KVStore, last: jax.Array | None = None,
                 lora=None):
        c = self.cfg
        V, D = c.vocab_size, c.hidden_size
        embed = _param(self, "embed_tokens", (V, D), (axes.VOCAB, axes.EMBED), self.dtype)
        x = jnp.take(embed, tokens, axis=0)  # (B, T, D)
        if c.scale_embeddings:
            x = x * jnp.asarray(math.sqrt(D), self.dtype)
        # The residual stream is whole in D on every model-axis device (Megatron layout).
        x = constrain(x, _RESIDUAL_ACT, "embeddings")
        inv_freq = rope_inputs(c)
        if c.scan_layers:  # one compiled layer body, parameters stacked as "layers"
            x = layer_scan.run(ScanBlock, c, self.dtype, self.backend, x, positions, inv_freq, kv,
                               self.is_initializing(), lora)
        for i in range(0 if c.scan_layers else c.num_layers):
            hook = None if lora is None else lora.at_layer(i)
            x = Block(c, self.dtype, i, self.backend, name=f"layers_{i}")(x, positions, inv_freq, kv,
                                                                         hook)
            x = constrain(x, _RESIDUAL_ACT, f"layer {i} output")
        ones = nn.initializers.zeros if c.norm_plus_one else nn.initializers.ones
        w_norm = _param(self, "norm", (D,), (axes.EMBED,), self.dtype, ones)
        if last is not None:  # only the rows whose logits are needed: i32[B] or [B, R]
            idx = last[:, None] if last.ndim == 1 else last  # indices into T
            x = jnp.take_along_axis(x, idx[..., None], axis=1)  # (B, 1 or R, D)
        x = rms_norm(x, w_norm, c.rms_norm_eps, c.norm_plus_one)
        head = embed if c.tie_word_embeddings else _kernel(
            self, "lm_head", (V, D), (axes.VOCAB, axes.EMBED), self.dtype)
        logits = self.backend.linear(x, head, preferred_element_type=jnp.float32)
        if c.final_logit_softcap is not None:
            cap = c.final_logit_softcap
            logits = cap * jnp.tanh(logits / cap)
        return constrain(logits, (axes.BATCH, axes.SEQ, axes.VOCAB), "logits")
