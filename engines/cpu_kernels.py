"""The CPU kernels of decode steps, as XLA FFI custom calls, in float32:

- `matmul_nt`: y = x . w^T (csrc/matmul_nt.cc). XLA's CPU backend sends every f32 dot to
  YNNPACK, which is slow at the few rows of a decode step; the kernel is made for exactly
  that shape (weights stored [out, in], as `engines.model.linear` keeps them).
- `decode_attention`: one new token per slot over the contiguous KV cache
  (csrc/decode_attention.cc), reading each slot's live entries once, where XLA copies a
  window of the cache out and runs two batched dots over it.
- `paged_decode_attention`: the same over the paged KV store's pools and a page table
  (csrc/decode_attention.cc), reading each slot's live pages once, where XLA's gather path
  copies every slot's whole table width out of the pool.
- `argmax` and `token_logprobs`: the greedy token and the log-probs of a decode step's
  logits (csrc/logits.cc), in vectors over each row, where XLA runs a generic
  (value, index) reduction, a log-softmax and a top-k.

This module builds the sources into one library with the system C++ compiler on first
use (`$CXX`, else g++), keeps it in a cache folder (`$JETSERVE_KERNEL_CACHE`, else
~/.cache/jetserve/kernels) under a name keyed by everything that could change the binary,
loads it and registers the targets with XLA.

They run on x86-64 CPUs with AVX2 and FMA, with wider tiles where the CPU has AVX-512 (the
build is -march=native); `JETSERVE_CPU_KERNELS=0` turns them off. Where
the compiler is missing or the build fails, one warning names the reason and the model
keeps XLA's ops: the kernels are an optimisation, never a reason for a job to fail.

The matmul and the attention also take a stack of layers and a layer index (a scanned
decoder's weights [L, N, K] and cache [L, ...], engines/layer_scan.py) and read that
layer where it lies, so the scan's body copies no layer out of the stack.

The engine decides whether its model uses them (`max_rows`): only on a one-device CPU mesh
(a sharded operand would make XLA's partitioner gather it around the custom call), with
plain float32 weights; the matmul for at most `MAX_ROWS` rows (decode, speculative
verification, prefill chunks and mixed steps; XLA's dot is no faster past that), the
attention for decode steps over a float32 cache, contiguous (engines.kv_cache.DecodeKV) or
paged (engines/paged_kv.py, `paged_attention` "cpu"), the argmax and log-probs for decode
steps (engines.sampling).

Concurrency: the first call builds and registers under a lock, once per process; the
library is written under a temporary name and renamed into place, so processes building
at once never load a half-written file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.sharding import Mesh

log = logging.getLogger(__name__)

TARGET = "jetserve_matmul_nt"
ATTENTION_TARGET = "jetserve_decode_attention"
PAGED_ATTENTION_TARGET = "jetserve_paged_decode_attention"
ARGMAX_TARGET = "jetserve_argmax"
LOG_PROBS_TARGET = "jetserve_log_probs"
ENV_SWITCH = "JETSERVE_CPU_KERNELS"
# Rows (tokens in one step) up to which the kernel runs the dense layers: decode,
# speculative verification and prefill chunks of up to this many tokens. Measured with
# scripts/cpu_matmul_ab.py (the 156M Llama's 57 layer and head matmuls chained, 2 cores),
# XLA time / kernel time: 0.96 at 1 row (both stream the weights; XLA keeps that case,
# engines.model), 1.8-2.2 at 2-16, 1.46-1.56 at 32, 1.3-1.4 at 40-64, 1.2 at 96, 1.13 at
# 128, 1.03-1.04 at 192-256 with AVX2; with AVX-512 (XLA's dot uses it too) 0.98 at 1
# row, 1.2-1.8 at 2-32, 1.3 at 48-64, 1.17 at 96, 1.08 at 128, ~1 at 192-256. Past that,
# with AVX2: 1.05 at 256, 1.04 at 512, 0.94-0.99 at 520-1024 (within this machine's noise).
# The bound is that high for a scanned model's layers (the CPU default): XLA's dot reads a
# copy of the layer sliced out of the stack, ~7 ms a layer of the 156M Llama, where the
# kernel reads it in place; a mixed step's 136 tokens (a 128-token chunk beside 8 decode
# rows) on XLA took 1.23x generate + prefill, 0.88x on the kernel (docs/BENCHMARKS.md).
MAX_ROWS = 1024
_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = tuple(os.path.join(_CSRC, name)
                for name in ("matmul_nt.cc", "decode_attention.cc", "logits.cc"))
HEADERS = tuple(os.path.join(_CSRC, name) for name in ("parallel.h", "simd_math.h"))
# -fno-semantic-interposition: with plain -fPIC, GCC kept the matmul's register tiles in
# memory (2.3x slower tiles than the same code in an executable).
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC",
         "-fno-semantic-interposition", "-Wall")

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


@functools.cache
def _cpu() -> tuple[str, frozenset[str]]:
    """(model name, feature flags) of the first CPU in /proc/cpuinfo; empty where absent."""
    name, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return name, flags


def _switched_on() -> bool:
    value = os.environ.get(ENV_SWITCH, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_SWITCH} must be 0 (off) or 1 (on, the default), got {value!r}")
    return value == "1"


def _cpu_supported() -> bool:
    return platform.machine() == "x86_64" and {"avx2", "fma"} <= _cpu()[1]


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CXX") or "g++")


def _library_path(compiler: list[str]) -> str:
    """Where the library built by `compiler` for these sources, jaxlib and CPU lives."""
    root = os.environ.get("JETSERVE_KERNEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "jetserve", "kernels")
    h = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        with open(source, "rb") as f:
            h.update(f.read())
    name, flags = _cpu()
    for part in (*compiler, *FLAGS, jaxlib.__version__, name, " ".join(sorted(flags))):
        h.update(part.encode() + b"\0")
    return os.path.join(root, f"jetserve_cpu-{h.hexdigest()[:20]}.so")


def _build(compiler: list[str], path: str) -> None:
    if shutil.which(compiler[0]) is None:
        raise RuntimeError(f"no C++ compiler: {compiler[0]!r} not found (set CXX)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".so.tmp")
    os.close(fd)
    try:
        # XLA's headers come in as system headers: -Wall speaks of our source only.
        cmd = [*compiler, *FLAGS, "-isystem", jax.ffi.include_dir(), *SOURCES, "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"{shlex.join(cmd)} exited with status {done.returncode}"
                               + (": " + " | ".join(tail) if tail else ""))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _load() -> bool:
    """Builds (unless cached), loads and registers the kernels, once per process."""
    global _library, _tried
    with _lock:
        if not _tried:
            _tried = True
            compiler = _compiler()
            try:
                path = _library_path(compiler)
                if not os.path.exists(path):
                    _build(compiler, path)
                lib = ctypes.cdll.LoadLibrary(path)
                for target, symbol in ((TARGET, lib.JetserveMatmulNT),
                                       (ATTENTION_TARGET, lib.JetserveDecodeAttention),
                                       (PAGED_ATTENTION_TARGET,
                                        lib.JetservePagedDecodeAttention),
                                       (ARGMAX_TARGET, lib.JetserveArgmax),
                                       (LOG_PROBS_TARGET, lib.JetserveLogProbs)):
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol),
                                                platform="cpu")
                _library = lib
            except Exception as e:  # noqa: BLE001 -- any failure means: keep XLA's dot
                log.warning("the CPU kernels are unavailable, using XLA's ops: %s", e)
        return _library is not None


def available() -> bool:
    """Whether the kernels can run in this process (they are built on the first call)."""
    return _switched_on() and _cpu_supported() and _load()


def max_rows(mesh: Mesh, dtype: Any, weight_quant: str) -> int:
    """Row count up to which a model on `mesh` runs its dense layers on the kernel; 0: none.

    Only a one-device CPU mesh with plain float32 weights qualifies: quantized kernels,
    dequantized inside the step, stay with XLA, which can fuse the dequantization into
    its dot where the custom call would read a materialized float32 copy.
    """
    one_cpu = mesh.devices.size == 1 and mesh.devices.flat[0].platform == "cpu"
    if not one_cpu or jnp.dtype(dtype) != jnp.float32 or weight_quant != "none":
        return 0
    return MAX_ROWS if available() else 0


def matmul_nt(x: jax.Array, w: jax.Array, layer: jax.Array | int | None = None) -> jax.Array:
    """x f32[..., K] times w f32[N, K] transposed -> f32[..., N]; with `layer` (an i32[]
    index), w is a stack f32[L, N, K] and its layer `layer` is read in place (a scanned
    decoder's weights: a slice would be copied out of the stack first).

    By the kernel when `available()` and lowered for a CPU, else by XLA's dot (the same
    result up to rounding).
    """
    return matmul_nt_many(x, (w,), layer)[0]


def matmul_nt_many(x: jax.Array, ws: Sequence[jax.Array],
                   layer: jax.Array | int | None = None) -> tuple[jax.Array, ...]:
    """(x . w^T for w in ws) in one kernel call: the projections that read the same x (q,
    k and v; gate and up), x packed once and their columns shared out over the threads
    together. Each w is f32[N_j, K], or with `layer` a stack f32[L, N_j, K] read at that
    layer (the same layer of every stack). By XLA's dots where the kernel is unavailable
    or lowered for another backend."""
    if not ws:
        raise ValueError("matmul_nt takes at least one weight")
    if x.dtype != jnp.float32 or any(w.dtype != jnp.float32 for w in ws):
        raise ValueError(f"matmul_nt takes float32 operands, got x {x.dtype} and w "
                         f"{', '.join(str(w.dtype) for w in ws)}")
    stacks = [_stacked("matmul_nt", "w", w, 2, layer) for w in ws]
    ws, layer = tuple(w for w, _ in stacks), stacks[0][1]
    for w in ws:
        if x.ndim < 1 or x.shape[-1] != w.shape[2]:
            raise ValueError(f"matmul_nt takes x [..., K] and w [N, K], got x {x.shape} and "
                             f"w {w.shape[1:]}")

    def dot(x, layer, *ws):
        return tuple(jax.lax.dot_general(x, jax.lax.dynamic_index_in_dim(w, layer, keepdims=False),
                                         (((x.ndim - 1,), (1,)), ((), ()))) for w in ws)

    if not available():
        return dot(x, layer, *ws)
    lead, K = x.shape[:-1], x.shape[-1]
    M = math.prod(lead)
    kernel = jax.ffi.ffi_call(TARGET, tuple(jax.ShapeDtypeStruct((M, w.shape[1]), jnp.float32)
                                            for w in ws), vmap_method="sequential")
    # The target is registered for the CPU only: lowered for another backend, XLA's dots.
    ys = _cpu_only(kernel, dot, x.reshape(M, K), layer, *ws)
    return tuple(y.reshape(*lead, w.shape[1]) for y, w in zip(ys, ws, strict=True))


def _stacked(kernel: str, name: str, a: jax.Array, ndim: int,
             layer: jax.Array | int | None) -> tuple[jax.Array, jax.Array]:
    """(a as a stack [L, ...] of layers of rank ndim, an i32[] index into it): a one-layer
    array becomes [1, ...] and index 0 (a free reshape). A concrete index is checked here;
    a traced one by the kernel, which fails the step rather than read outside the stack."""
    if layer is None:
        if a.ndim != ndim:
            raise ValueError(f"{kernel}: {name} must have rank {ndim}, got {a.shape}")
        return a[None], jnp.zeros((), jnp.int32)
    if a.ndim != ndim + 1:
        raise ValueError(f"{kernel}: a layer index needs {name} stacked [L, ...] (rank "
                         f"{ndim + 1}), got {a.shape}")
    if isinstance(layer, int) and not 0 <= layer < a.shape[0]:
        raise ValueError(f"{kernel}: layer {layer} is outside [0, {a.shape[0]}) of {name} "
                         f"{a.shape}")
    layer = jnp.asarray(layer)
    if layer.shape != () or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise ValueError(f"{kernel}: layer must be an integer scalar, got {layer.shape} "
                         f"{layer.dtype}")
    return a, layer.astype(jnp.int32)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array,
                     sliding_window: int | None,
                     layer: jax.Array | int | None = None) -> jax.Array:
    """One decode step's attention over a contiguous float32 cache -> [B, 1, N, H].

    q [B, 1, N, H]; keys [Bc, K, H, S] and values [Bc, K, S, H] as engines.kv_cache keeps
    them, entry j at position j; Bc >= B: the queries are the first B slots' (a step over a
    decode batch size below the cache's reads those rows in place); pos i32[B]: each slot's
    position (it sees entries up to it, within the sliding window), or -1 for a slot that
    is not live (zeros out). With
    `layer` (an i32[] index), keys and values are stacks [L, ...] of which that layer is
    read in place (a scanned decoder's cache). Callers check `available()` first.
    """
    B, T, N, H = q.shape
    if T != 1 or q.dtype != jnp.float32 or k.dtype != jnp.float32 or v.dtype != jnp.float32:
        raise ValueError(f"decode_attention takes one float32 token per slot, got q {q.shape} "
                         f"{q.dtype}, keys {k.dtype}, values {v.dtype}")
    k, _ = _stacked("decode_attention", "keys", k, 4, layer)
    v, layer = _stacked("decode_attention", "values", v, 4, layer)
    Bc, K, S = k.shape[1], k.shape[2], k.shape[4]
    if (Bc < B or k.shape[1:] != (Bc, K, H, S) or v.shape[1:] != (Bc, K, S, H)
            or v.shape[0] != k.shape[0] or pos.shape != (B,) or N % K):
        raise ValueError(f"decode_attention: q {q.shape}, keys {k.shape}, values {v.shape} "
                         f"and pos {pos.shape} do not agree")
    out = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct((B, N, H), jnp.float32),
                           vmap_method="sequential")(
        q.reshape(B, N, H), k, v, layer, pos.astype(jnp.int32),
        window=np.int64(sliding_window or 0))
    return out.reshape(B, 1, N, H)


def paged_decode_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                           table: jax.Array, pos: jax.Array, sliding_window: int | None,
                           layer: jax.Array | int | None = None) -> jax.Array:
    """One decode step's attention over the paged store's float32 pools -> [B, 1, N, H].

    q [B, 1, N, H]; pools [K, P + 1, ps, H] (engines/paged_kv.py), keys and values of one
    shape (a key-only cache passes its keys twice); table i32[B, W] each slot's pages in
    position order (position j at page table[b, j // ps], row j % ps); pos i32[B] each
    slot's position (it sees positions up to it, within the sliding window), -1 for a
    slot that is not live (zeros out). With `layer`, the pools are stacks [L, ...] read at
    that layer in place. Callers check `available()` first.
    """
    B, T, N, H = q.shape
    if T != 1 or not q.dtype == k_pool.dtype == v_pool.dtype == jnp.float32:
        raise ValueError(f"paged_decode_attention takes one float32 token per slot, got q "
                         f"{q.shape} {q.dtype}, keys {k_pool.dtype}, values {v_pool.dtype}")
    k_pool, _ = _stacked("paged_decode_attention", "keys", k_pool, 4, layer)
    v_pool, layer = _stacked("paged_decode_attention", "values", v_pool, 4, layer)
    if (k_pool.shape != v_pool.shape or k_pool.shape[-1] != H or table.shape[0] != B
            or table.ndim != 2 or pos.shape != (B,) or N % k_pool.shape[1]):
        raise ValueError(f"paged_decode_attention: q {q.shape}, keys {k_pool.shape}, values "
                         f"{v_pool.shape}, table {table.shape} and pos {pos.shape} do not "
                         f"agree")
    out = jax.ffi.ffi_call(PAGED_ATTENTION_TARGET, jax.ShapeDtypeStruct((B, N, H), jnp.float32),
                           vmap_method="sequential")(
        q.reshape(B, N, H), k_pool, v_pool, table.astype(jnp.int32), layer,
        pos.astype(jnp.int32), window=np.int64(sliding_window or 0))
    return out.reshape(B, 1, N, H)


def _cpu_only(kernel, fallback, *args):
    """kernel(*args) lowered for a CPU, fallback(*args) for any other backend."""
    return jax.lax.platform_dependent(*args, cpu=kernel, default=fallback)


def argmax(logits: jax.Array) -> jax.Array:
    """jnp.argmax(logits, axis=-1) of f32[B, V] -> i32[B] (a NaN counts as the largest).

    Callers check `available()` first.
    """
    if logits.ndim != 2 or logits.dtype != jnp.float32:
        raise ValueError(f"argmax takes float32 logits [B, V], got {logits.shape} {logits.dtype}")
    kernel = jax.ffi.ffi_call(ARGMAX_TARGET, jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32),
                              vmap_method="sequential")
    return _cpu_only(kernel, lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32), logits)


def token_logprobs(logits: jax.Array, tokens: jax.Array, top_n: int,
                   fallback) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-softmax of f32[B, V] at `tokens` i32[B], and its `top_n` best with their ids.

    Returns (chosen f32[B], top ids i32[B, n], top log-probs f32[B, n]), as
    `fallback(logits, tokens, top_n)` (XLA's version) does; a step where some row holds a
    NaN or an infinite maximum takes the fallback's result. Callers check `available()`.
    """
    B, V = logits.shape
    if logits.dtype != jnp.float32 or tokens.shape != (B,) or not 0 <= top_n <= V:
        raise ValueError(f"token_logprobs takes float32 logits [B, V], tokens [B] and "
                         f"0 <= top_n <= V, got {logits.shape} {logits.dtype}, "
                         f"{tokens.shape} and {top_n}")
    kernel = jax.ffi.ffi_call(
        LOG_PROBS_TARGET,
        (jax.ShapeDtypeStruct((B,), jnp.float32), jax.ShapeDtypeStruct((B, top_n), jnp.int32),
         jax.ShapeDtypeStruct((B, top_n), jnp.float32), jax.ShapeDtypeStruct((B,), jnp.int32)),
        vmap_method="sequential")

    def on_cpu(x, t):
        chosen, ids, lps, ok = kernel(x, t)
        return jax.lax.cond(jnp.all(ok != 0), lambda: (chosen, ids, lps),
                            lambda: fallback(x, t, top_n))

    return _cpu_only(on_cpu, lambda x, t: fallback(x, t, top_n), logits,
                     tokens.astype(jnp.int32))
