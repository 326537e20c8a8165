"""The CPU matmul kernel of decode steps: y = x . w^T in float32, as an XLA FFI custom call.

XLA's CPU backend sends every f32 dot to YNNPACK, which is slow at the few rows of a decode
step. `csrc/matmul_nt.cc` is a kernel for exactly that shape (weights stored [out, in], as
`engines.model.linear` keeps them). This module builds it with the system C++ compiler on
first use (`$CXX`, else g++), keeps the library in a cache folder
(`$JETSERVE_KERNEL_CACHE`, else ~/.cache/jetserve/kernels) under a name keyed by
everything that could change the binary, loads it and registers it with XLA.

It runs on x86-64 CPUs with AVX2 and FMA; `JETSERVE_CPU_MATMUL=0` turns it off. Where the
compiler is missing or the build fails, one warning names the reason and the model keeps
XLA's dot: the kernel is an optimisation, never a reason for a job to fail.

The engine decides whether its model uses the kernel (`max_rows`): only on a one-device CPU
mesh (a sharded operand would make XLA's partitioner gather it around the custom call),
with plain float32 weights, and for at most `MAX_ROWS` rows (decode and speculative
verification; prefill stays with XLA, which is faster there).

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
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
from jax.sharding import Mesh

log = logging.getLogger(__name__)

TARGET = "jetserve_matmul_nt"
ENV_SWITCH = "JETSERVE_CPU_MATMUL"
# Rows (tokens in one step) up to which the kernel runs the dense layers. Measured on a
# chain of the 156M Llama's layer matmuls (2 cores, XLA time / kernel time): 0.9-1.05 at
# 1 row (both stream the weights), 1.6-1.8 at 2-8, 1.4 at 16, 1.15 at 32, 1.1 at 40, 1.0
# at 48, 0.9 at 64, 0.7 at 256; the 32000 x 1024 LM head alike (1.1 at 40, 1.0 at 64).
MAX_ROWS = 40
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "matmul_nt.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-Wall")

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
    """Where the library built by `compiler` for this source, jaxlib and CPU lives."""
    root = os.environ.get("JETSERVE_KERNEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "jetserve", "kernels")
    h = hashlib.sha256()
    with open(SOURCE, "rb") as f:
        h.update(f.read())
    name, flags = _cpu()
    for part in (*compiler, *FLAGS, jaxlib.__version__, name, " ".join(sorted(flags))):
        h.update(part.encode() + b"\0")
    return os.path.join(root, f"matmul_nt-{h.hexdigest()[:20]}.so")


def _build(compiler: list[str], path: str) -> None:
    if shutil.which(compiler[0]) is None:
        raise RuntimeError(f"no C++ compiler: {compiler[0]!r} not found (set CXX)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".so.tmp")
    os.close(fd)
    try:
        # XLA's headers come in as system headers: -Wall speaks of our source only.
        cmd = [*compiler, *FLAGS, "-isystem", jax.ffi.include_dir(), SOURCE, "-o", tmp]
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
    """Builds (unless cached), loads and registers the kernel, once per process."""
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
                jax.ffi.register_ffi_target(
                    TARGET, jax.ffi.pycapsule(lib.JetserveMatmulNT), platform="cpu")
                _library = lib
            except Exception as e:  # noqa: BLE001 -- any failure means: keep XLA's dot
                log.warning("the CPU matmul kernel is unavailable, using XLA's dot: %s", e)
        return _library is not None


def available() -> bool:
    """Whether the kernel can run in this process (it is built on the first call)."""
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


def matmul_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    """x f32[..., K] times w f32[N, K] transposed -> f32[..., N].

    By the kernel when `available()` and lowered for a CPU, else by XLA's dot (the same
    result up to rounding).
    """
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"matmul_nt takes float32 operands, got x {x.dtype} and w {w.dtype}")
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"matmul_nt takes x [..., K] and w [N, K], got x {x.shape} and "
                         f"w {w.shape}")
    def dot(x, w):
        return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))

    if not available():
        return dot(x, w)
    lead, (N, K) = x.shape[:-1], w.shape
    M = math.prod(lead)
    kernel = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((M, N), jnp.float32),
                              vmap_method="sequential")
    # The target is registered for the CPU only: lowered for another backend, XLA's dot.
    y = jax.lax.platform_dependent(x.reshape(M, K), w, cpu=kernel, default=dot)
    return y.reshape(*lead, N)
