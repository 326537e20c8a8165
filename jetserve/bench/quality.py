"""`jetserve bench quality`: what quantizing weights or the KV cache costs in accuracy.

Every variant decodes the same sequences teacher-forced: the unquantized model's greedy
continuation of a few prompts (windows of the text file when one is given, else random
ids; and, for perplexity, the text file's tokens) is fed one token
per step through the decode path (KV cache included), and each step's logits are compared
with the unquantized model's at the same step. Reported per variant:

  max / mean |logit error|   over all steps and vocabulary entries;
  top-1 agreement            share of steps whose argmax is the unquantized greedy token;
  greedy run agreement       free-running greedy decode: share of tokens equal to the
                             unquantized run (a first mismatch usually changes the rest);
  perplexity                 of the text file's tokens (teacher-forced through the cache);
  bytes per parameter        all parameter arrays (embedding and norms stay float);
  bytes per KV token         k, v and scales of one token, all layers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engines import EngineConfig, TransformerEngine
from engines import quantization as qz
from engines.kv_cache import DecodeKV, DecodeState
from jetserve.model_loading import build_engine
from jetserve.offline import generate_many

# (name, weight quantization, KV cache dtype); the first is the reference.
VARIANTS = (("none", "none", "auto"), ("int8", "int8", "auto"), ("int4", "int4", "auto"),
            ("kv-int8", "none", "int8"), ("int8+kv-int8", "int8", "int8"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class QualityConfig:
    model: str | None = None
    variants: tuple[str, ...] = tuple(v[0] for v in VARIANTS)
    steps: int = 256  # decode steps per prompt
    prompts: int = 4
    prompt_len: int = 16
    text: str | None = None  # perplexity file
    text_tokens: int = 512
    group: int = qz.DEFAULT_GROUP
    seed: int = 0

    def __post_init__(self):
        known = [v[0] for v in VARIANTS]
        for v in self.variants:
            if v not in known:
                raise ValueError(f"variant {v!r} is unknown; expected some of {known}")
        for name in ("steps", "prompts", "prompt_len", "text_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _decode_logits(engine: TransformerEngine):
    """Jitted teacher-forced step: (params, state, tokens i32[B]) -> (state, logits f32[B, V])."""

    def step(params, state: DecodeState, tokens):
        kv = DecodeKV(state, state.lengths)
        logits = engine.model.apply({"params": params}, tokens[:, None],
                                    state.lengths[:, None], kv)[:, 0]
        return dataclasses.replace(state, k=tuple(kv.k), v=tuple(kv.v),
                                   k_scale=tuple(kv.k_scale), v_scale=tuple(kv.v_scale),
                                   lengths=state.lengths + 1), logits

    return jax.jit(step, donate_argnums=(1,))


def forced_logits(engine: TransformerEngine, params, seqs: Sequence[Sequence[int]],
                  prompt_len: int) -> np.ndarray:
    """Logits predicting seqs[:, t + 1] for t >= prompt_len - 1, each through the cache:
    the prompt is prefilled, the rest fed one token per step. f32[B, steps, V]."""
    seqs = np.asarray(seqs, np.int32)
    state = engine.init_decode_state()
    for slot, s in enumerate(seqs):
        prefix, _ = engine.prefill(params, s[:prompt_len - 1], prompt_len - 1)
        state = engine.insert(prefix, state, slot)
    step = _decode_logits(engine)
    B = engine.max_concurrent_decodes
    out = []
    for t in range(prompt_len - 1, seqs.shape[1] - 1):
        tokens = np.zeros((B,), np.int32)
        tokens[: len(seqs)] = seqs[:, t]
        state, logits = step(params, state, tokens)
        out.append(np.asarray(logits[: len(seqs)]))
    return np.stack(out, axis=1)


def _text_tokens(engine: TransformerEngine, path: str, n: int) -> list[int]:
    if engine.tokenizer is None:
        raise ValueError("--text needs a model with a tokenizer")
    with open(path, encoding="utf-8") as f:
        ids = engine.tokenizer.encode(f.read(), add_bos=True)
    if len(ids) < 2:
        raise ValueError(f"--text {path}: fewer than two tokens")
    return ids[:n]


def _prompts(vocab: int, text: list[int] | None, cfg: QualityConfig, rng) -> list[list[int]]:
    """Evenly spaced windows of the text when there is one (what a model was trained on
    looks like text), else random ids."""
    n = cfg.prompt_len
    if text is not None and len(text) >= n + cfg.prompts:
        starts = np.linspace(0, len(text) - n, cfg.prompts).astype(int)
        return [text[s:s + n] for s in starts]
    lo = 3 if vocab > 16 else 0
    return [list(map(int, rng.integers(lo, vocab, n))) for _ in range(cfg.prompts)]


def _perplexity(logits: np.ndarray, targets: np.ndarray) -> float:
    logp = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
    chosen = np.take_along_axis(np.asarray(logp), targets[..., None], axis=-1)[..., 0]
    return float(math.exp(-chosen.mean()))


def run(cfg: QualityConfig, log=print) -> dict:
    table = {v[0]: v for v in VARIANTS}
    names = ["none"] + [v for v in cfg.variants if v != "none"]
    devices = jax.devices()[:1]
    rng = np.random.default_rng(cfg.seed)
    base = None
    rows = []
    for name in names:
        _, scheme, kv = table[name]
        seq_len = cfg.prompt_len + cfg.steps + 1
        engine = build_engine(cfg.model, devices=devices, engine_config=EngineConfig(
            max_concurrent_decodes=cfg.prompts, max_prefill_length=cfg.prompt_len,
            max_seq_len=max(seq_len, cfg.text_tokens + 1), quantize=scheme,
            quant_group_size=cfg.group, kv_dtype=kv))
        params = engine.load_params()
        if base is None:
            text = _text_tokens(engine, cfg.text, cfg.text_tokens) if cfg.text else None
            prompts = _prompts(engine.vocab_size, text, cfg, rng)
        greedy = generate_many(engine, params, prompts, max_tokens=cfg.steps, ignore_eos=True)
        greedy = [r.token_ids for r in greedy]
        if base is None:
            seqs = [p + g for p, g in zip(prompts, greedy, strict=True)]
        logits = forced_logits(engine, params, seqs, cfg.prompt_len)  # (B, steps, V)
        ppl = None
        if text is not None:
            t_logits = forced_logits(engine, params, [text], 2)[0]
            ppl = _perplexity(t_logits, np.asarray(text[2:]))
        state = jax.eval_shape(engine.init_decode_state)
        kv_bytes = sum(x.size * x.dtype.itemsize for x in
                       jax.tree.leaves((state.k, state.v, state.k_scale, state.v_scale)))
        row = {"variant": name, "quantize": scheme, "kv_dtype": kv,
               "bytes_per_param": qz.param_bytes(params) / engine.model_config.param_count(),
               "bytes_per_kv_token": kv_bytes / (cfg.prompts * engine.max_seq_len),
               "perplexity": ppl}
        if base is None:
            base = {"logits": logits, "greedy": greedy}
        else:
            err = np.abs(logits - base["logits"])
            forced_top1 = np.argmax(logits, axis=-1) == np.argmax(base["logits"], axis=-1)
            run_same = np.mean([a == b for ga, gb in zip(greedy, base["greedy"], strict=True)
                                for a, b in zip(ga, gb, strict=True)])
            row.update(max_logit_error=float(err.max()), mean_logit_error=float(err.mean()),
                       top1_agreement=float(forced_top1.mean()),
                       greedy_run_agreement=float(run_same))
        rows.append(row)
        log(_format_row(row))
        del engine, params
    return {"model": cfg.model or "default", "steps": cfg.steps, "prompts": cfg.prompts,
            "prompt_len": cfg.prompt_len, "text": cfg.text,
            "text_tokens": len(text) if text is not None else 0, "group": cfg.group,
            "logit_scale": float(np.std(base["logits"])), "rows": rows}


def _format_row(r: dict) -> str:
    ppl = "-" if r["perplexity"] is None else f"{r['perplexity']:.3f}"
    if "top1_agreement" not in r:
        return (f"{r['variant']:>13}  reference  ppl {ppl}  {r['bytes_per_param']:.3f} B/param  "
                f"{r['bytes_per_kv_token']:.0f} B/KV token")
    return (f"{r['variant']:>13}  max err {r['max_logit_error']:.4f}  mean err "
            f"{r['mean_logit_error']:.5f}  top-1 {r['top1_agreement']:.4f}  greedy run "
            f"{r['greedy_run_agreement']:.4f}  ppl {ppl}  {r['bytes_per_param']:.3f} B/param  "
            f"{r['bytes_per_kv_token']:.0f} B/KV token")
