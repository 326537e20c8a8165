"""The decode step with its weights on 4 KiB pages against the same weights on 2 MiB huge
pages, in one process, in turns (Linux 6.1+, for MADV_COLLAPSE).

    python scripts/huge_pages_ab.py --batch 1,8,32 --rounds 10

XLA places the weights with malloc on 4 KiB pages. For each batch an engine for
`random:llama-156m` is built and its parameters loaded twice; the second copy is collapsed
onto huge pages in place with madvise(MADV_COLLAPSE) over the 2 MiB-aligned part of each
buffer (the contents stay; the kernel copies them into huge pages). One decode state, every
slot holding a 192-token prompt as `jetserve bench decode` fills it, then runs `--steps`
blocked generate steps on one copy, then on the other, the order flipping every round.
Prints per batch the median, first quartile and best step of each and their ratio.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import jax

MADV_COLLAPSE = 25
HUGE = 2 << 20


def collapse(tree) -> int:
    """Bytes of the tree's buffers moved onto huge pages."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for x in jax.tree.leaves(tree):
        p = x.unsafe_buffer_pointer()
        start, end = -(-p // HUGE) * HUGE, (p + x.nbytes) // HUGE * HUGE
        if end > start:
            if libc.madvise(start, end - start, MADV_COLLAPSE) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_COLLAPSE) failed")
            done += end - start
    return done


def one_batch(batch: int, rounds: int, steps: int) -> None:
    from engines import EngineConfig
    from jetserve.bench.decode import fill_slots
    from jetserve.model_loading import build_engine

    need = 192 + 4 + 2 * rounds * steps
    engine = build_engine("random:llama-156m", engine_config=EngineConfig(
        max_concurrent_decodes=batch, max_seq_len=-(-need // 128) * 128,
        max_prefill_length=192))
    small = engine.load_params()
    huge = jax.tree.map(lambda x: x + 0, small)  # a second copy, same shardings
    jax.block_until_ready(huge)
    t0 = time.perf_counter()
    moved = collapse(huge)
    total = sum(x.nbytes for x in jax.tree.leaves(huge))
    print(f"batch {batch}: {moved / 1e6:.0f} of {total / 1e6:.0f} MB collapsed onto huge "
          f"pages in {time.perf_counter() - t0:.2f} s")
    state = fill_slots(engine, small, 192)
    for p in (small, huge):  # warm both
        for _ in range(2):
            state, res = engine.generate(p, state)
    jax.block_until_ready(res.data)
    times = {"4K": [], "huge": []}
    for r in range(rounds):
        order = [("4K", small), ("huge", huge)]
        for name, p in order if r % 2 == 0 else order[::-1]:
            for _ in range(steps):
                t0 = time.perf_counter()
                state, res = engine.generate(p, state)
                jax.block_until_ready(res.data)
                times[name].append(time.perf_counter() - t0)
    for name, t in times.items():
        t = sorted(t)
        print(f"  {name:4s} median {statistics.median(t) * 1e3:6.2f} ms, q1 "
              f"{t[len(t) // 4] * 1e3:6.2f}, best {t[0] * 1e3:6.2f}")
    ratio = statistics.median(times["4K"]) / statistics.median(times["huge"])
    print(f"  4K / huge, median: {ratio:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    for b in (int(s) for s in args.batch.split(",")):
        one_batch(b, args.rounds, args.steps)


if __name__ == "__main__":
    main()
