"""The Flax transformer engine: the decoder behind prefill / insert / generate.

The three device functions are module-level pure functions (engines/device_functions.py),
jitted in the engine's constructor with explicit in/out shardings; insert and generate
donate the decode state. prefill compiles once per bucket (its input shape), insert once,
generate once per decode batch size (EngineConfig.decode_batch_sizes, and every slot)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from engines import (
    cpu_kernels,
    device_functions,
    exported_programs,
    kv_heads,
    layer_scan,
    param_loading,
    quantization,
)
from engines.backend import Backend, backend_for
from engines.config import ModelConfig
from engines.device_functions import PromptLogprobs, ScoreCache
from engines.engine_api import Engine, ResultTokens, Tokenizer
from engines.engine_config import EngineConfig, resolve_dtype
from engines.kv_cache import DecodeState, Prefix, empty_slot_fields, insert_prefix, move_slot
from engines.model import Decoder
from engines.param_layout import InLayout, ParamViews
from engines.prefill_program import PrefillProgram, PrefillRows
from engines.prefix_blocks import PrefixBlocks
from engines.prompt_scoring import score_prompt
from engines.sampling import MAX_LOGIT_BIAS, SamplingParams, SlotSampling
from engines.speculative import generate_step
from sharding import MODEL_DIMS, ShardingConfig, axes, traced_under

# Decode cache layouts (engines.kv_cache): keys [B, K, H, S], values [B, K, S, H], int8
# scales [B, K, S].
K_CACHE_AXES = (axes.CACHE_BATCH, axes.CACHE_HEADS, axes.HEAD_DIM, axes.CACHE_SEQ)
V_CACHE_AXES = (axes.CACHE_BATCH, axes.CACHE_HEADS, axes.CACHE_SEQ, axes.HEAD_DIM)
SCALE_AXES = (axes.CACHE_BATCH, axes.CACHE_HEADS, axes.CACHE_SEQ)
PREFIX_AXES = (None, None, axes.CACHE_HEADS, axes.HEAD_DIM)

# Why a layout cannot hold a preset's KV placement, for the refusal (ShardingConfig.kv_layouts).
_LAYOUT_LIMITS = {
    "paged": "its page pool [K, P + 1, page_size, H] has no slot axis to split (a slot's "
             "pages may lie anywhere in the pool), so it cannot be split by slot",
}


def _check_kv_layout(sharding: ShardingConfig, kv_layout: str) -> None:
    if kv_layout not in sharding.kv_layouts:
        why = _LAYOUT_LIMITS.get(kv_layout, "")
        raise ValueError(
            f"sharding {sharding.name!r} places the KV cache for kv_layout "
            f"{' or '.join(map(repr, sharding.kv_layouts))} only, not {kv_layout!r}"
            f"{': ' + why if why else ''}; use kv_layout "
            f"{sharding.kv_layouts[0]!r} (--kv-layout {sharding.kv_layouts[0]}) or another "
            f"preset")


class TransformerEngine(ParamViews, PrefixBlocks, Engine):
    """One decoder on one slice of devices, laid out by a sharding preset.

    Args:
      model_config: shapes and family options.
      weights: a HF directory, a jetserve Orbax directory, or None for random weights.
      devices: the slice; defaults to all devices.
      sharding: the preset that maps logical axes to this slice's mesh.
      config: serving shapes (slots, prefill length, sequence length, dtype).
      tokenizer: host tokenizer, or None for a token-ids-only model.
      seed: RNG seed for random weights (a random draft model's too).
      draft_config, draft_weights: the draft model of speculative "draft:PATH:K" (its
        config, and its weights as `weights`), replicated on the same devices.
      backend: the hot ops' implementations (engines/backend.py); by default the one
        `backend_for` picks for the devices and dtype.

    Build engines with `engines.create_engine`, which picks this class or the paged one
    (engines/paged_engine.py) for `config.kv_layout`.
    """

    KV_LAYOUT = "contiguous"  # the EngineConfig.kv_layout this class implements

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        weights: str | None = None,
        devices: Sequence[jax.Device] | None = None,
        sharding: ShardingConfig | None = None,
        config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
        seed: int = 0,
        draft_config: ModelConfig | None = None,
        draft_weights: str | None = None,
        backend: Backend | None = None,
    ):
        self.config = config or EngineConfig()
        if self.config.kv_layout != self.KV_LAYOUT:
            raise ValueError(f"{type(self).__name__} keeps its KV {self.KV_LAYOUT}, but "
                             f"config.kv_layout is {self.config.kv_layout!r}: build the "
                             f"engine with engines.create_engine, which picks the class "
                             f"for the layout")
        self.model_config = model_config = quantization.with_weight_quant(
            model_config, self.config.quantize, self.config.quant_group_size)
        self.weights = weights
        self.seed = seed
        self._tokenizer = tokenizer
        devices = list(devices) if devices is not None else jax.devices()
        self.sharding = sharding or ShardingConfig()
        _check_kv_layout(self.sharding, self.config.kv_layout)
        self._mesh = self.sharding.make_mesh(
            devices, {d: getattr(model_config, d) for d in MODEL_DIMS})
        self.dtype = resolve_dtype(self.config.dtype, devices)
        # More devices on the kv-head axis than kv heads: the decoder runs with K' kv
        # heads, each stored head repeated kv_repeat times (engines/kv_heads.py).
        self.kv_repeat = self.sharding.kv_head_replicas(
            self._mesh, model_config.num_kv_heads, model_config.num_heads,
            "parameter layers_0/self_attn/k_proj")
        if model_config.mla and self.kv_repeat > 1:
            raise ValueError(
                f"sharding {self.sharding.name!r}: multi-head latent attention (deepseek_v3) "
                f"has one latent kv head, which is not repeated over the "
                f"{self.kv_repeat} devices of the kv_heads mesh axis; use a preset that "
                f"keeps that axis at one device (ep_tp on no more devices than experts, "
                f"dp_ep, or replicated)")
        # The weights as stored (what a checkpoint holds); model_config is what runs.
        self.source_config = model_config
        # Where it runs decides the CPU kernels and the layer scan; the model only reads them.
        rows = cpu_kernels.max_rows(self._mesh, self.dtype, model_config.weight_quant)
        self.model_config = model_config = dataclasses.replace(
            model_config, num_kv_heads=model_config.num_kv_heads * self.kv_repeat,
            scan_layers=layer_scan.use_scan(self.config, devices[0].platform, rows > 0,
                                            model_config.mixed_layers))
        self.backend = dataclasses.replace(backend or backend_for(devices, self.dtype),
                                           cpu_matmul_rows=rows)
        self.model = Decoder(model_config, dtype=self.dtype, backend=self.backend)
        self.abstract_params, self._logical = param_loading.trace_params(self.model)
        self.param_shardings = param_loading.param_shardings(
            self.sharding, self._mesh, self._logical, self.abstract_params)
        # Another engine's parameters (the other layer layout) are converted at the door.
        self._in_layout = InLayout(self.abstract_params, self.param_shardings,
                                   model_config.num_layers)
        self._draft = self._draft_engine(draft_config, draft_weights, devices)
        self._draft_params = None
        self._build_jits()

    def _draft_engine(self, draft_config, draft_weights, devices) -> TransformerEngine | None:
        """The draft model of speculative "draft:PATH:K" as an engine of its own (its
        model, parameters and cache layout), on the same devices, replicated."""
        spec = self.config.spec
        if spec.kind != "draft":
            if draft_config is not None:
                raise ValueError(f"a draft model was given but speculative is "
                                 f"{self.config.speculative!r}, not 'draft:PATH:K'")
            return None
        if draft_config is None:
            raise ValueError(f"speculative {self.config.speculative!r} needs the draft "
                             f"model's config (jetserve.model_loading.build_engine reads PATH)")
        if draft_config.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"draft model {spec.path!r} has a vocabulary of "
                             f"{draft_config.vocab_size} tokens, the target "
                             f"{self.model_config.vocab_size}: speculative decoding needs "
                             f"the same tokenizer")
        e = self.config
        config = EngineConfig(max_concurrent_decodes=e.max_concurrent_decodes,
                              max_prefill_length=e.max_prefill_length,
                              max_seq_len=e.max_seq_len, dtype=e.dtype)
        return TransformerEngine(draft_config, weights=draft_weights, devices=devices,
                                 config=config, seed=self.seed, backend=self.backend)

    # ---- shardings ---------------------------------------------------------------------

    def _named(self, names, shape, tensor: str) -> NamedSharding:
        return self.sharding.named(self._mesh, tuple(names), shape, tensor)

    def _replicated(self) -> NamedSharding:
        return NamedSharding(self._mesh, PartitionSpec())

    def _sampling_shardings(self, batch_axis: str | None) -> SlotSampling:
        s1 = self._named((batch_axis,), (self.config.max_concurrent_decodes,), "sampling")
        s2 = self._named((batch_axis, None), (self.config.max_concurrent_decodes, 2), "rng keys")
        sb = self._named((batch_axis, None), (self.config.max_concurrent_decodes, MAX_LOGIT_BIAS),
                         "logit bias")
        return SlotSampling(temperature=s1, top_k=s1, top_p=s1, min_p=s1,
                            repetition_penalty=s1, frequency_penalty=s1,
                            presence_penalty=s1, key=s2, bias_ids=sb, bias_values=sb)

    def decode_state_shardings(self) -> DecodeState:
        c, e = self.model_config, self.config
        B, S, K, H = e.max_concurrent_decodes, e.max_seq_len, c.num_kv_heads, c.head_dim
        k_cache = self._named(K_CACHE_AXES, (B, K, H, S), "key cache")
        v_cache = self._named(V_CACHE_AXES, (B, K, S, c.value_dim), "value cache")
        vec = self._named((axes.CACHE_BATCH,), (e.max_concurrent_decodes,), "slot lengths")
        bv = self._named((axes.CACHE_BATCH, None), (e.max_concurrent_decodes, c.vocab_size),
                         "token counts")
        L = c.num_layers
        scales = ()
        if e.kv_dtype == "int8":
            scales = (self._named(SCALE_AXES, (B, K, S), "kv cache scales"),) * L
        v_scales = scales if c.value_dim else ()  # a key-only cache has no values to scale
        hist = self._named((axes.CACHE_BATCH, None), (B, S if e.spec.enabled else 0),
                           "token history")
        draft = self._draft.decode_state_shardings() if self._draft else None
        return layer_scan.stack_cache(DecodeState(
            k=(k_cache,) * L, v=(v_cache,) * L, k_scale=scales, v_scale=v_scales, lengths=vec,
            tokens=vec, sampling=self._sampling_shardings(axes.CACHE_BATCH), prompt_mask=bv,
            counts=bv, history=hist, draft_k=draft.k if draft else (),
            draft_v=draft.v if draft else ()), c.scan_layers)

    def prefix_destination_sharding(self) -> Prefix:
        c = self.model_config
        kv = self._named(PREFIX_AXES, (1, 1, c.num_kv_heads, c.head_dim), "prefix kv")
        values = self._named(PREFIX_AXES, (1, 1, c.num_kv_heads, c.value_dim), "prefix values")
        r = self._replicated()
        samp = SlotSampling(**{f.name: r for f in dataclasses.fields(SlotSampling)})
        L = c.num_layers
        draft = self._draft.prefix_destination_sharding() if self._draft else None
        return Prefix(k=(kv,) * L, v=(values,) * L, k_pos=r, tokens=r, length=r, token=r,
                      sampling=samp, prompt_mask=r,
                      draft_k=draft.k if draft else (), draft_v=draft.v if draft else ())

    # ---- jitted functions --------------------------------------------------------------

    def _counted(self, name: str, fn):
        """Wraps fn so each trace (a new compile) is counted in self.traces."""

        def traced(*args):
            self.traces[name] += 1
            return fn(*args)

        return traced

    def _build_jits(self):
        top_n = self.config.top_logprobs
        state_sh = self.decode_state_shardings()
        prefix_sh = self.prefix_destination_sharding()
        r = self._replicated()
        self.traces = {"prefill": 0, "insert": 0, "generate": 0, "prompt_logprobs": 0}
        # Each function traces under this engine's layout, for the model's activation
        # constraints (sharding.constrain).
        laid_out = functools.partial(traced_under, self.sharding, self._mesh)
        draft_model = self._draft.model if self._draft else None
        # With a draft model its parameters come last (self._draft_args()).
        draft_sh = (self._draft.param_shardings,) if self._draft else ()
        # What the exported-program cache keys these programs on besides their arguments.
        context = repr((type(self).__name__, self.model_config, self.config, self.dtype,
                        self.backend, self.sharding, dict(self._mesh.shape), top_n,
                        self._draft.model_config if self._draft else None))
        self._prefill = PrefillProgram(
            self._counted("prefill", laid_out(functools.partial(
                device_functions.prefill, self.model, top_n, draft_model=draft_model))),
            in_shardings=(self.param_shardings, r, r, r, prefix_sh.sampling, r, None, r,
                          *draft_sh),
            out_shardings=(prefix_sh, r), bucket_for=self.bucket_for,
            max_seq_len=self.max_seq_len, config=self.model_config, dtype=self.dtype,
            draft_config=self._draft.model_config if self._draft else None, context=context)
        self._prefill_rows = PrefillRows(
            self._counted("prefill", laid_out(functools.partial(
                device_functions.prefill_rows, self.model, top_n, draft_model=draft_model))),
            param_shardings=self.param_shardings, sampling_sharding=prefix_sh.sampling,
            prefix_sharding=prefix_sh, replicated=r, buckets=self.prefill_buckets(),
            max_rows=self.config.prefill_batch, vocab_size=self.model_config.vocab_size,
            extra_shardings=draft_sh)
        self._prompt_logprobs_jit = jax.jit(
            self._counted("prompt_logprobs", laid_out(functools.partial(
                device_functions.prompt_logprobs, self.model, top_n))),
            in_shardings=(self.param_shardings, r, r), out_shardings=r,
        )
        score_sh = ScoreCache(k=prefix_sh.k, v=prefix_sh.v, k_pos=r)
        self._score_chunk_jit = jax.jit(
            # A chunk of a long prompt's scoring: counted with the one-pass programs.
            self._counted("prompt_logprobs", laid_out(functools.partial(
                device_functions.score_chunk, self.model, top_n))),
            in_shardings=(self.param_shardings, r, r, r, r, score_sh),
            out_shardings=(r, score_sh), donate_argnums=(5,),
        )
        c = self.model_config
        self._score_cache_jit = jax.jit(
            functools.partial(device_functions.empty_score_cache, c.num_layers, c.num_kv_heads,
                              c.head_dim, self.dtype),
            static_argnums=(0,), out_shardings=score_sh)
        self._insert_jit = exported_programs.cached_jit(
            self._counted("insert", insert_prefix), name="insert", context=context,
            in_shardings=(prefix_sh, state_sh, r),
            out_shardings=state_sh, donate_argnums=(1,),
        )
        gen = generate_step(self.model, top_n, self.config.spec, draft_model)
        # One program per decode batch size (device_functions.generate `rows`); None, every
        # slot, is the plain step.
        self._generate_jits = {rows: exported_programs.cached_jit(
            self._counted("generate", laid_out(
                gen if rows is None else functools.partial(gen, rows=rows))),
            name=f"generate{rows or ''}", context=context,
            in_shardings=(self.param_shardings, state_sh, r, *draft_sh),  # r: token_mask
            out_shardings=(state_sh, r), donate_argnums=(1,),
        ) for rows in (*self.decode_batch_sizes[:-1], None)}
        self._generate_jit = self._generate_jits[None]
        self._build_block_jits(prefix_sh)
        self._move_slot_jit = exported_programs.cached_jit(
            move_slot, name="move_slot", context=context, in_shardings=(state_sh, r, r),
            out_shardings=state_sh, donate_argnums=(0,))

    # ---- Engine API --------------------------------------------------------------------

    def load_params(self) -> dict:
        """The target's parameters (a draft model's are loaded too, and kept here)."""
        if self._draft is not None:
            self._draft_params = self._draft.load_params()
        return self._load_own_params()

    def _draft_args(self) -> tuple:
        """The draft model's parameters as the device functions' last argument, if any."""
        if self._draft is None:
            return ()
        if self._draft_params is None:
            raise RuntimeError("load_params() loads the draft model; call it before "
                               "prefill / generate")
        return (self._draft_params,)

    def _load_own_params(self) -> dict:
        return param_loading.load_params(
            self.model, self.weights, seed=self.seed, sharding=self.sharding,
            mesh=self._mesh, shardings=self.param_shardings, abstract=self.abstract_params,
            kv_repeat=self.kv_repeat)

    def receive_prefix(self, prefix: Prefix) -> Prefix:
        """A prefix made by another engine of this model (whose kv heads may be repeated
        otherwise: disaggregated slices on other presets or device counts), with this
        engine's kv heads; it still runs where the prefix is, before the move."""
        if not prefix.k:
            return prefix
        return kv_heads.regroup_prefix(prefix, self.source_config.num_kv_heads,
                                       self.model_config.num_kv_heads)

    def init_decode_state(self) -> DecodeState:
        c, e = self.model_config, self.config
        B, S = e.max_concurrent_decodes, e.max_seq_len

        def make():
            int8 = e.kv_dtype == "int8"
            K, H, dtype = c.num_kv_heads, c.head_dim, jnp.int8 if int8 else self.dtype
            L = c.num_layers
            scales = (jnp.zeros((B, K, S), jnp.float32),) * L if int8 else ()
            Hv = c.value_dim  # 0: a key-only cache (engines.attention.key_only)
            return layer_scan.stack_cache(DecodeState(
                k=(jnp.zeros((B, K, H, S), dtype),) * L, v=(jnp.zeros((B, K, S, Hv), dtype),) * L,
                k_scale=scales, v_scale=scales if Hv else (),
                **empty_slot_fields(B, S, c.vocab_size, history=e.spec.enabled),
                **self._empty_draft_cache(),
            ), c.scan_layers)

        return jax.jit(make, out_shardings=self.decode_state_shardings())()

    def _empty_draft_cache(self) -> dict:
        if self._draft is None:
            return {}
        draft = self._draft.init_decode_state()
        return dict(draft_k=draft.k, draft_v=draft.v)

    def prefill(self, params, tokens, true_length, *, sampling: SamplingParams | None = None,
                existing_prefix: Prefix | None = None, seed: int | None = None,
                donate: bool = False, token_mask=None):
        """tokens: the prompt padded to a bucket (or unpadded: it is padded here).
        `donate`: the caller never reads `existing_prefix` again, so its KV is updated in
        place (engines/prefill_program.py)."""
        return self._prefill(self._in_layout(params), tokens, true_length, sampling=sampling,
                             existing_prefix=existing_prefix, seed=seed, donate=donate,
                             token_mask=token_mask, extra=self._draft_args())

    def prefill_rows(self, params, prompts, *, samplings, seeds=None):
        """Several whole prompts in one call (see Engine.prefill_rows)."""
        seeds = [None] * len(prompts) if seeds is None else seeds
        return self._prefill_rows(self._in_layout(params), prompts, samplings, seeds,
                                  extra=self._draft_args())

    def prefill_row_shapes(self) -> list[tuple[int, int]]:
        return self._prefill_rows.shapes()

    def prefill_rows_for(self, waiting: int, longest: int) -> int:
        return self._prefill_rows.rows_for(waiting, longest)

    def lower_prefill(self, params, tokens, true_length, *,
                      existing_prefix: Prefix | None = None,
                      donate: bool = False) -> jax.stages.Lowered:
        """The prefill program these arguments run, lowered (for its compiled memory and
        cost analyses; nothing runs)."""
        return self._prefill.lower(self._in_layout(params), tokens, true_length,
                                   existing_prefix=existing_prefix, donate=donate,
                                   extra=self._draft_args())

    def empty_prefix(self, length: int) -> Prefix:
        """See Engine.empty_prefix (with room for a draft model's KV too)."""
        return self._prefill.empty(length)

    def prompt_logprobs(self, params, tokens, true_length: int | None = None, *,
                        adapter: str | None = None) -> PromptLogprobs:
        """Scores a prompt: host arrays of length true_length (see PromptLogprobs). One
        pass up to max_prefill_length tokens; a longer prompt (up to max_seq_len) in
        chunks of max_prefill_length, each attending over the KV of the ones before.
        `adapter`: a LoRA adapter's name, for the engines that serve them
        (engines/lora_engine.py)."""
        if adapter is not None:
            raise ValueError(f"adapter {adapter!r}: this engine serves no LoRA adapters")
        return self._score(params, tokens, true_length, self._prompt_logprobs_jit,
                           self._score_chunk_jit)

    def _score(self, params, tokens, true_length: int | None, one_pass, chunk):
        """prompt_logprobs with the programs given, called as the jits above (the LoRA
        engines hand in theirs, bound to an adapter)."""
        params = self._in_layout(params)
        return score_prompt(tokens, true_length, max_prefill_length=self.max_prefill_length,
                            max_seq_len=self.max_seq_len, bucket_for=self.bucket_for,
                            empty_cache=self._score_cache_jit,
                            one_pass=functools.partial(one_pass, params),
                            chunk=functools.partial(chunk, params))

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        return self._insert_jit(prefix, decode_state, np.int32(slot))

    def generate(self, params, decode_state, token_mask=None, *, rows: int | None = None
                 ) -> tuple[DecodeState, ResultTokens]:
        jit = self._generate_jits.get(None if rows == self.max_concurrent_decodes else rows)
        if jit is None:
            raise ValueError(f"generate rows={rows}: this engine's decode batch sizes are "
                             f"{self.decode_batch_sizes}")
        return jit(self._in_layout(params), decode_state, token_mask, *self._draft_args())

    @property
    def decode_batch_sizes(self) -> tuple[int, ...]:
        return (*self.config.decode_batch_sizes, self.max_concurrent_decodes)

    def move_slot(self, decode_state: DecodeState, src: int, dst: int) -> DecodeState:
        return self._move_slot_jit(decode_state, np.int32(src), np.int32(dst))

    # ---- properties --------------------------------------------------------------------

    @property
    def max_concurrent_decodes(self) -> int:
        return self.config.max_concurrent_decodes

    @property
    def max_prefill_length(self) -> int:
        return self.config.max_prefill_length

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @property
    def chunked_prefill(self) -> bool:
        """Prefill continues an existing prefix (a draft model's KV continues with it)."""
        return True

    @property
    def has_draft_model(self) -> bool:
        """Speculative "draft:PATH:K": the prefix carries the draft's KV too (so there is
        no prefix cache, whose blocks hold the target's only)."""
        return self._draft is not None

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    @property
    def top_logprobs(self) -> int:
        return self.config.top_logprobs

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def eos_ids(self) -> tuple[int, ...]:
        tok = self._tokenizer  # the tokenizer's, else the model config's
        return tuple(tok.eos_ids) if tok and tok.eos_ids else self.model_config.eos_token_ids

    @property
    def bos_id(self) -> int | None:
        tok = self._tokenizer
        return tok.bos_id if tok and tok.bos_id is not None else self.model_config.bos_token_id

    def trace_counts(self) -> dict[str, int]:
        """How many times each device function was traced (each trace is a compile)."""
        return dict(self.traces)
