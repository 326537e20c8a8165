"""The backend seam: which implementation of a hot op a model runs, chosen for devices.

The engine picks a `Backend` for its devices (`backend_for`) and hands it to the model as
a static field; model files call its methods and never name a kernel or read a
deployment flag. It holds the dense layers' matmul (`linear`: our CPU kernel at decode
sizes on one CPU device, engines/cpu_kernels.py; XLA's dot elsewhere), whether the decode
step's attention, greedy token and log-probs take the CPU kernels (`cpu_kernels`), and
prefill attention (whole prompts, chunks after a prefix, prompt scoring):

  - "xla": engines/blockwise_attention.py, everywhere.
  - "plain": engines/attention.py's one-shot [T, S] scores for every shape: quadratic
    memory; a reference and the baseline `jetserve bench prefill --attention plain` runs.
  - "cudnn": jax.nn.dot_product_attention's cuDNN kernel (GPU, 16-bit dtypes).
  - "pallas_tpu": the Pallas splash attention kernel jax ships (TPU).

The two kernels take aligned prompts only and fall back to "xla" on the device for the
rest (engines/attention_kernels.py), and to "xla" statically for shapes they do not take.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from engines import attention_kernels, cpu_kernels, layer_scan
from engines.attention import attention
from engines.blockwise_attention import blockwise_attention

PREFILL_ATTENTION = ("xla", "plain", "cudnn", "pallas_tpu")
SPLASH_BLOCK = 128  # splash's tile; prompts must be whole tiles (buckets are)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backend:
    """Implementations of the hot ops for one engine's devices (hashable: a static field).

    block_q, block_k: the query / key tile of the XLA blockwise attention. Inputs whose
    whole score matrix is no bigger than one tile (T * S <= block_q * block_k: decode
    steps, short prompts, small tests) take the plain one-shot path instead: it holds no
    more memory than one tile would, and skips the loop's per-tile overhead.
    interpret: run Pallas kernels in interpret mode (tests on the CPU).
    cpu_matmul_rows: dense layers of a step with 2 to this many tokens run on the CPU
      matmul kernel, and the decode step's attention, greedy token and log-probs on the
      CPU kernels; 0: XLA's ops everywhere. The engine sets it for its devices
      (`cpu_kernels.max_rows`): where the model runs, not what it is.
    """

    prefill_attention: str = "xla"
    block_q: int = 512
    block_k: int = 512
    interpret: bool = False
    cpu_matmul_rows: int = 0

    def __post_init__(self):
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"prefill_attention must be one of {PREFILL_ATTENTION}, "
                             f"got {self.prefill_attention!r}")
        for name in ("block_q", "block_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        r = self.cpu_matmul_rows
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise ValueError(f"cpu_matmul_rows must be an integer >= 0, got {r!r}")

    @property
    def cpu_kernels(self) -> bool:
        """Whether the decode step uses the CPU kernels (attention, argmax, log-probs)."""
        return self.cpu_matmul_rows > 0

    def linear(self, x: jax.Array, w: jax.Array | layer_scan.LayerWeight, **kw) -> jax.Array:
        """x [..., in] times a kernel stored [out, in] (as HF stores linear weights).

        Kernels are kept output-major because XLA's CPU matmul (YNNPACK) runs this form
        faster than [in, out] at the few rows of a decode step (1-32; the whole step
        1.1-1.25x) and no slower at prefill sizes; see docs/BENCHMARKS.md. Steps of 2 to
        cpu_matmul_rows tokens use our kernel for this form instead, faster still there.
        At one row both stream the weights at the same speed, and XLA's dot stays, except
        for a scanned layer's kernel (layer_scan.LayerWeight): our kernel reads the layer
        in the stack where XLA's dot would read a copy of it sliced out."""
        stacked = isinstance(w, layer_scan.LayerWeight)
        if self._on_kernel(x, w):
            return (cpu_kernels.matmul_nt(x, w.stack, w.index) if stacked
                    else cpu_kernels.matmul_nt(x, w))
        w = w.value() if stacked else w
        return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), **kw)

    def linear_many(self, x: jax.Array,
                    ws: Sequence[jax.Array | layer_scan.LayerWeight]) -> tuple[jax.Array, ...]:
        """(self.linear(x, w) for w in ws): the projections that read the same x (q, k and
        v; gate and up). Where the CPU kernel takes each of them, one call runs them all: x
        is packed once and the threads share out their columns together, one parallel
        section where separate calls made one each. Otherwise each goes its own way."""
        if len(ws) > 1 and all(self._on_kernel(x, w) for w in ws):
            if all(isinstance(w, layer_scan.LayerWeight) for w in ws):
                if all(w.index is ws[0].index for w in ws):  # one scanned layer's stacks
                    return cpu_kernels.matmul_nt_many(x, [w.stack for w in ws], ws[0].index)
            elif not any(isinstance(w, layer_scan.LayerWeight) for w in ws):
                return cpu_kernels.matmul_nt_many(x, ws)
        return tuple(self.linear(x, w) for w in ws)

    def _on_kernel(self, x: jax.Array, w: jax.Array | layer_scan.LayerWeight) -> bool:
        """Whether linear(x, w) runs on the CPU matmul kernel."""
        rows = math.prod(x.shape[:-1])  # static at trace time
        fewest = 1 if isinstance(w, layer_scan.LayerWeight) else 2  # see linear
        return (fewest <= rows <= self.cpu_matmul_rows
                and x.dtype == w.dtype == jnp.float32)

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                  k_pos: jax.Array, sliding_window: int | None,
                  softcap: float | None = None, sinks: jax.Array | None = None,
                  chunk: int | None = None) -> jax.Array:
        """`engines.attention.attention` (same arguments and result) by this backend.
        The platform kernels take no soft cap, attention sinks nor chunked attention:
        with any, the XLA paths serve."""
        T, S, H = q.shape[1], k.shape[1], q.shape[3]
        if self.prefill_attention == "plain" or T * S <= self.block_q * self.block_k:
            return attention(q, k, v, q_pos, k_pos, sliding_window, softcap, sinks, chunk)
        if softcap is not None or sinks is not None or chunk is not None:
            return blockwise_attention(q, k, v, q_pos, k_pos, sliding_window, softcap=softcap,
                                       sinks=sinks, chunk=chunk, block_q=self.block_q,
                                       block_k=self.block_k)
        if (self.prefill_attention == "cudnn" and T == S and H % 8 == 0 and H <= 128
                and q.dtype in (jnp.bfloat16, jnp.float16)):
            return attention_kernels.cudnn_attention(
                q, k, v, q_pos, k_pos, sliding_window, fallback=self._blockwise)
        if (self.prefill_attention == "pallas_tpu"
                and attention_kernels.splash_shapes_ok(T, S, SPLASH_BLOCK)):
            return attention_kernels.splash_attention(
                q, k, v, q_pos, k_pos, sliding_window, fallback=self._blockwise,
                block=SPLASH_BLOCK, interpret=self.interpret)
        return self._blockwise(q, k, v, q_pos, k_pos, sliding_window)

    def _blockwise(self, q, k, v, q_pos, k_pos, sliding_window):
        return blockwise_attention(q, k, v, q_pos, k_pos, sliding_window,
                                   block_q=self.block_q, block_k=self.block_k)


def backend_for(devices: Sequence[jax.Device], dtype: Any) -> Backend:
    """The backend an engine on `devices` computing in `dtype` uses: a platform's kernel
    where the installed jax ships it (and the dtype and slice suit it), else XLA."""
    platform = devices[0].platform
    if (platform == "gpu" and attention_kernels.cudnn_available()
            and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)):
        return Backend(prefill_attention="cudnn")
    # The splash kernel is called per device here (no shard_map around it yet), so a
    # slice of several TPU devices keeps the XLA path, which GSPMD partitions.
    if platform == "tpu" and len(devices) == 1 and attention_kernels.splash_available():
        return Backend(prefill_attention="pallas_tpu")
    return Backend()
