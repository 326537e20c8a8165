"""Machine probes that set the floors: streaming-read bandwidth and matmul FLOP/s.

Bandwidth is read with code that is not jetserve's. On the host: a float32 array of at least 1 GB is
summed by one thread per core (numpy, whose reductions release the GIL), and by torch's
own thread pool when torch is installed; each is repeated and the best pass wins, since
noise (other processes, page faults) only ever slows a pass down. On an accelerator: XLA's
own sum over an array in device memory (`device_read_bandwidth`). Matmul FLOP/s is a
square matmul jitted through XLA, the compiler jetserve's decode runs through.
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

DEFAULT_READ_BYTES = 2**31  # 2 GiB: far past any last-level cache


@dataclasses.dataclass(frozen=True)
class BandwidthResult:
    best_bps: float  # bytes/s of the best pass over all methods
    method: str  # which method gave it
    read_bytes: int
    repeats: int
    passes: dict[str, list[float]]  # method -> bytes/s of every pass

    @property
    def gbps(self) -> float:
        return self.best_bps / 1e9

    def to_json(self) -> dict:
        return {"bandwidth_gbps": round(self.gbps, 2), "method": self.method,
                "read_bytes": self.read_bytes,
                "passes_gbps": {k: [round(x / 1e9, 2) for x in v] for k, v in self.passes.items()}}


def _numpy_threaded(arr: np.ndarray, threads: int, repeats: int) -> list[float]:
    chunks = np.array_split(arr, threads)
    with ThreadPoolExecutor(threads) as pool:
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sum(pool.map(lambda c: float(c.sum()), chunks))
            out.append(arr.nbytes / (time.perf_counter() - t0))
    return out


def _torch_sum(arr: np.ndarray, threads: int, repeats: int) -> list[float]:
    try:
        import torch
    except ImportError:
        return []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t = torch.from_numpy(arr)  # shares the buffer: no copy
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            float(t.sum())
            out.append(arr.nbytes / (time.perf_counter() - t0))
        return out
    finally:
        torch.set_num_threads(before)


def stream_read_bandwidth(*, read_bytes: int | None = None, repeats: int = 5,
                          threads: int | None = None) -> BandwidthResult:
    """Best streaming-read bandwidth over `repeats` passes of each method."""
    read_bytes = read_bytes or DEFAULT_READ_BYTES
    if read_bytes < 2**20:
        raise ValueError(f"read_bytes must be >= 1 MiB, got {read_bytes}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    threads = threads or os.cpu_count() or 1
    arr = np.ones(read_bytes // 4, np.float32)  # written once, so every page is resident
    passes = {"numpy-threads": _numpy_threaded(arr, threads, repeats),
              "torch-sum": _torch_sum(arr, threads, repeats)}
    passes = {k: v for k, v in passes.items() if v}
    method = max(passes, key=lambda k: max(passes[k]))
    del arr
    return BandwidthResult(best_bps=max(passes[method]), method=method,
                           read_bytes=read_bytes, repeats=repeats, passes=passes)


def device_read_bandwidth(device, *, read_bytes: int | None = None,
                          repeats: int = 5) -> BandwidthResult:
    """An accelerator's memory: the best of `repeats` jitted XLA sums of a float32 array of
    `read_bytes` in the device's own memory (XLA's reduction, not jetserve code)."""
    import jax
    import jax.numpy as jnp

    read_bytes = read_bytes or DEFAULT_READ_BYTES
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    x = jax.jit(lambda: jnp.ones(read_bytes // 4, jnp.float32),
                out_shardings=jax.sharding.SingleDeviceSharding(device))()
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()  # compile
    passes = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        total(x).block_until_ready()
        passes.append(x.nbytes / (time.perf_counter() - t0))
    del x
    return BandwidthResult(best_bps=max(passes), method=f"xla-sum on {device.platform}",
                           read_bytes=read_bytes, repeats=repeats, passes={"xla-sum": passes})


def matmul_flops(dtype: str = "float32", *, size: int = 2048, repeats: int = 5) -> float:
    """Best FLOP/s of a [size, size] @ [size, size] matmul jitted through XLA."""
    import jax
    import jax.numpy as jnp

    if size < 16:
        raise ValueError(f"size must be >= 16, got {size}")
    a = jnp.ones((size, size), dtype)
    b = jnp.full((size, size), 0.5, dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y))
    f(a, b).block_until_ready()  # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best
