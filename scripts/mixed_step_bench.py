"""The mixed step against the two steps it replaces, in one process, taking turns.

    python scripts/mixed_step_bench.py [--model random:llama-156m] [--decode-rows 8]
        [--chunk 128] [--chunk-start 128] [--context 192] [--rounds 5] [--reps 3]
        [--speculative ngram:K] [--paged-attention auto|xla|cpu] [--max-prefill-length N]
        [--max-seq-len 1024] [--width PAGES]

One paged engine with decode-rows + 1 slots: every decode row holds a `--context`-token
prompt; the last slot holds the first `--chunk-start` tokens of a prompt. Each round
times, in turn (the order rotates each round, so the machine's other load hits all
alike), `--reps` blocked calls of:

  mixed     engine.mixed_step: every decode row plus the next `--chunk` tokens of the
            prompt, one ragged step (the chunk ends the prompt and samples its token);
  decode    engine.mixed_step with the decode rows alone (the ragged path's own cost);
  generate  engine.generate: one decode step of every slot;
  prefill   engine.prefill of the same chunk, continuing a prefix of `--chunk-start`
            tokens sized for the prompt (the interleaved path's prefill of one chunk;
            the copying program, since the prefix is reused; insert not counted).

With `--speculative ngram:K` every decode row is a verify row of K + 1 tokens in both
the mixed step and generate (engines/speculative.py); `decode` is then generate's own
verify program over the rows (a step of decode rows alone runs it).

Prints the median of each and the ratios mixed / (generate + prefill) (below 1: the
fused step beats running both), mixed / generate (what a decode row's step costs with a
chunk riding along) and decode / generate. The decode rows' positions advance a little
each call; the chunk is rerun at the same positions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from engines import EngineConfig
from engines.mixed_batch import MixedRow
from engines.sampling import SamplingParams
from jetserve.model_loading import build_engine


def _timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:llama-156m")
    ap.add_argument("--decode-rows", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--chunk-start", type=int, default=128)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--speculative", default="none", help="none or ngram:K")
    ap.add_argument("--max-prefill-length", type=int, default=None,
                    help="the engine's prompt chunk, which sizes the token buckets "
                         "(default: --chunk)")
    ap.add_argument("--paged-attention", default="auto",
                    help="the decode step's attention: auto, xla (gather) or cpu (kernel)")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--width", type=int, default=None,
                    help="page-table width of every step (default: the narrowest power of "
                         "two holding every position the run reaches)")
    args = ap.parse_args()
    B, ps = args.decode_rows + 1, args.page_size
    S = args.max_seq_len
    eng = build_engine(args.model, engine_config=EngineConfig(
        max_concurrent_decodes=B, max_seq_len=S,
        max_prefill_length=args.max_prefill_length or args.chunk,
        kv_layout="paged", page_size=ps, speculative=args.speculative,
        paged_attention=args.paged_attention))
    eng = getattr(eng, "engine", eng)  # the engine itself: this script plans its own pages
    params = eng.load_params()
    M = S // ps
    table = np.arange(B * M, dtype=np.int32).reshape(B, M)  # every slot's own pages
    rng = np.random.default_rng(0)
    vocab = eng.vocab_size
    state = eng.init_decode_state()
    for s in range(args.decode_rows):  # prefill + insert each decode row's prompt
        prompt = rng.integers(3, vocab, size=args.context).tolist()
        prefix = None
        for at in range(0, args.context, args.chunk):
            piece = prompt[at:at + args.chunk]
            prefix, _ = eng.prefill(params, piece, len(piece), existing_prefix=prefix)
        state = eng.insert(prefix, state, s, pages=table[s, :-(-args.context // ps)])
    last = B - 1
    head = rng.integers(3, vocab, size=args.chunk_start).tolist()
    chunk = rng.integers(3, vocab, size=args.chunk).tolist()
    if head:  # the prompt's first tokens into the last slot's pages, not yet sampling
        state, _ = eng.mixed_step(params, state, table, [
            MixedRow(slot=last, chunk=head, sampling=SamplingParams())])
    end = args.chunk_start + args.chunk
    prefix = None
    if head:  # sized for the whole prompt, as chunk loops make it (no grow when timed)
        prefix = eng.prefill(params, head, len(head), existing_prefix=eng.empty_prefix(end),
                             donate=True)[0]
    # Every position a decode row or the sampled last slot reaches over all calls.
    row = eng.config.spec.k + 1  # positions a decode row may advance a step
    reach = max(end, args.context) + 3 * (args.rounds + 1) * args.reps * row + 8
    W = 1
    while W * ps < reach:
        W *= 2
    decode_rows = [MixedRow(slot=s) for s in range(args.decode_rows)]
    with_chunk = decode_rows + [MixedRow(slot=last, chunk=chunk, start=args.chunk_start,
                                         last=True, sampling=None if head else
                                         SamplingParams())]
    if args.width is not None:
        if not W <= args.width <= S // ps:
            raise SystemExit(f"--width must be in [{W}, {S // ps}], got {args.width}")
        W = args.width
    holder = {"state": state}
    step_tokens = args.decode_rows * row + args.chunk  # the mixed step's tokens

    def mixed(rows):
        def run():
            holder["state"], res = eng.mixed_step(params, holder["state"], table[:, :W], rows)
            return res.data
        return run

    def generate():
        holder["state"], res = eng.generate(params, holder["state"], table[:, :W])
        return res.data

    def prefill():
        return eng.prefill(params, chunk, len(chunk), existing_prefix=prefix)[1].data

    cases = {"mixed": mixed(with_chunk), "decode": mixed(decode_rows),
             "generate": generate, "prefill": prefill}
    for fn in cases.values():  # compile and warm
        _timed(fn, 2)
    times: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name] += _timed(cases[name], args.reps)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model {args.model}, {args.decode_rows} decode rows at ~{args.context} tokens, "
          f"chunk {args.chunk} tokens at {args.chunk_start}; page table width {W}, "
          f"speculative {args.speculative}, paged attention {eng.attention_impl}, "
          f"token bucket {min(b for b in eng.mixed_token_buckets if b >= step_tokens)}, "
          f"devices {jax.devices()[0].platform}; medians of {args.rounds * args.reps}")
    for k, v in med.items():
        print(f"  {k:9s} {v:9.2f} ms  (best {min(times[k]):.2f})")
    print(f"  mixed / (generate + prefill) = {med['mixed'] / (med['generate'] + med['prefill']):.3f}")
    print(f"  mixed / generate             = {med['mixed'] / med['generate']:.3f}")
    print(f"  decode / generate            = {med['decode'] / med['generate']:.3f}")


if __name__ == "__main__":
    main()
