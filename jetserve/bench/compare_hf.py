"""`jetserve bench compare-hf`: jetserve's serving path against transformers `generate`.

Same HF-format weights, same prompts (random ids, `prompt_len` each), greedy, EOS ignored,
`new_tokens` each. jetserve runs through the orchestrator (continuous batching, its
prefill / generate / detokenize threads) on an engine with B slots; transformers runs
`model.generate` on PyTorch CPU in float32, and in bfloat16 as an extra column. The sides
alternate, `repeats` times, in this one process, so machine noise reaches all of them.

Decode tokens/s excludes the prompt: with T(n) the wall time for the batch to receive n
new tokens each, decode tokens/s = B (n - 1) / (T(n) - T(1)); each T is the best of its
repeats (noise from other processes only adds time).

Threads: the orchestrator's own, plus torch's intra-op pool; the two sides never run at
the same time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time
from collections.abc import Sequence

import jax
import numpy as np

from engines import EngineConfig
from jetserve.bench import bandwidth
from jetserve.model_loading import build_engine

SERVING_PATH = "orchestrator"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompareConfig:
    model: str | None = None  # HF directory; None: a random llama-156m written to a temp dir
    batches: tuple[int, ...] = (1, 32)
    prompt_len: int = 128
    new_tokens: int = 128
    repeats: int = 2
    max_seq_len: int = 1024  # `jetserve serve`'s default
    bf16: bool = True
    seed: int = 0
    read_bytes: int | None = None  # bandwidth probe size (default 2 GiB)
    torch_threads: int | None = None  # transformers' intra-op threads (default: every core)

    def __post_init__(self):
        if not self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"batches must be positive integers, got {self.batches!r}")
        if self.new_tokens < 2:
            raise ValueError(f"new_tokens must be >= 2, got {self.new_tokens}")
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {self.prompt_len}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")
        if self.prompt_len + self.new_tokens > self.max_seq_len:
            raise ValueError(f"prompt_len + new_tokens = {self.prompt_len + self.new_tokens} "
                             f"exceeds max_seq_len {self.max_seq_len}")


def prompts(batch: int, length: int, vocab: int, seed: int) -> np.ndarray:
    # Ids from 3 up: clear of the usual pad / BOS / EOS ids.
    return np.random.RandomState(seed).randint(3, vocab, (batch, length)).astype(np.int64)


class HfSide:
    """transformers generate on one model copy, greedy, never stopping at EOS."""

    def __init__(self, path: str, dtype: str):
        import torch
        import transformers as tf

        self.torch = torch
        self.model = tf.AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype)).eval()
        self.model.generation_config.eos_token_id = None  # run to max_new_tokens
        self.model.generation_config.pad_token_id = 0

    def generate(self, ids: np.ndarray, n: int) -> np.ndarray:
        torch = self.torch
        x = torch.from_numpy(ids)
        with torch.inference_mode():
            out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                      max_new_tokens=n, do_sample=False, num_beams=1)
        return out[:, ids.shape[1]:].numpy()


class JetserveSide:
    """The orchestrator over one engine with `batch` slots (started on construction)."""

    def __init__(self, path: str, batch: int, cfg: CompareConfig, params, devices):
        from jetserve.orchestrator import Orchestrator

        self.engine = build_engine(path, devices=devices, engine_config=EngineConfig(
            max_concurrent_decodes=batch, max_prefill_length=cfg.prompt_len,
            max_seq_len=cfg.max_seq_len, dtype="float32"))
        self.params = self.engine.load_params() if params is None else params
        self.orch = Orchestrator.from_engines(self.engine, params=self.params)
        self.orch.start()
        self.orch.warmup(prompt_lengths=(cfg.prompt_len,))

    def generate(self, ids: np.ndarray, n: int) -> np.ndarray:
        from jetserve.orchestrator import Request

        hs = [self.orch.submit(Request(prompt_ids=tuple(int(t) for t in row), max_tokens=n,
                                       ignore_eos=True)) for row in ids]
        out = [h.result().token_ids for h in hs]
        if any(len(t) != n for t in out):
            raise RuntimeError(f"jetserve returned {[len(t) for t in out]} tokens, wanted {n}")
        return np.asarray(out)

    def close(self):
        self.orch.stop()


def decode_rate(batch: int, n: int, t1: float, tn: float) -> float | None:
    """Decode tokens/s from the wall times to 1 and to n new tokens per sequence; None when
    T(n) <= T(1): noise swamped the decode time (tiny models, few tokens), and any figure
    would be meaningless."""
    if tn <= t1:
        return None
    return batch * (n - 1) / (tn - t1)


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def _timed(fn, ids, n) -> tuple[float, np.ndarray]:
    t0 = time.perf_counter()
    out = fn(ids, n)
    return time.perf_counter() - t0, out


@contextlib.contextmanager
def model_dir(path: str | None, seed: int, preset: str = "llama-156m"):
    if path is not None:
        yield path
        return
    from jetserve.bench.hf_model import make_hf_model

    with tempfile.TemporaryDirectory(prefix="jetserve-bench-") as d:
        yield make_hf_model(preset, d, seed=seed)


def run(cfg: CompareConfig, devices: Sequence[jax.Device] | None = None, log=print) -> dict:
    import torch

    devices = list(devices or jax.devices()[:1])
    torch.set_num_threads(cfg.torch_threads or os.cpu_count() or 1)
    load0 = os.getloadavg()[0]
    bw = bandwidth.stream_read_bandwidth(read_bytes=cfg.read_bytes)
    log(f"bandwidth {bw.gbps:.1f} GB/s ({bw.method})")
    rows = []
    with model_dir(cfg.model, cfg.seed) as path:
        sides = {"hf": HfSide(path, "float32")}
        if cfg.bf16:
            sides["hf_bf16"] = HfSide(path, "bfloat16")
        vocab = sides["hf"].model.config.vocab_size
        params = None
        for b in cfg.batches:
            js = JetserveSide(path, b, cfg, params, devices)
            params = js.params
            funcs = {"jetserve": js.generate, **{k: s.generate for k, s in sides.items()}}
            ids = prompts(b, cfg.prompt_len, vocab, cfg.seed + b)
            best = {k: [float("inf"), float("inf")] for k in funcs}  # T(1), T(n)
            tokens = {}
            try:
                for f in funcs.values():  # warm: first calls pay for allocation / compile
                    f(ids, 2)
                for rep in range(cfg.repeats):
                    for k, f in funcs.items():
                        t1, _ = _timed(f, ids, 1)
                        tn, tokens[k] = _timed(f, ids, cfg.new_tokens)
                        best[k] = [min(best[k][0], t1), min(best[k][1], tn)]
                        log(f"batch {b} run {rep + 1} {k}: T(1) {t1:.2f} s, "
                            f"T({cfg.new_tokens}) {tn:.2f} s")
            finally:
                js.close()
            rate = {k: decode_rate(b, cfg.new_tokens, t1, tn) for k, (t1, tn) in best.items()}
            for k, r in rate.items():
                if r is None:
                    log(f"batch {b} {k}: T({cfg.new_tokens}) was not above T(1), so its decode "
                        f"rate is unresolved (null); raise --new-tokens or --repeats")
            same = tokens["jetserve"] == tokens["hf"]
            js_rate, hf_rate = rate["jetserve"], rate["hf"]
            row = {"batch": b, "jetserve_tok_s": _round(js_rate, 1), "hf_tok_s": _round(hf_rate, 1),
                   "ratio": None if js_rate is None or hf_rate is None
                   else round(js_rate / hf_rate, 3)}
            if cfg.bf16:
                row["hf_bf16_tok_s"] = _round(rate["hf_bf16"], 1)
            row["sequences_identical"] = float(np.mean(np.all(same, axis=1)))
            row["tokens_identical"] = float(np.mean(same))
            rows.append(row)
            log(f"batch {b}: jetserve {row['jetserve_tok_s']} tok/s, transformers f32 "
                f"{row['hf_tok_s']} tok/s, ratio {row['ratio']}")
    return {"serving_path": SERVING_PATH, "bandwidth_gbps": round(bw.gbps, 2), "prompt_len": cfg.prompt_len,
            "new_tokens": cfg.new_tokens, "repeats": cfg.repeats, "max_seq_len": cfg.max_seq_len,
            "torch_threads": torch.get_num_threads(),
            "load_average_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],  # start, end
            "rows": rows}
