"""Runs batch jobs on one model sharded over several processes (`--coordinator`).

Every process of a jax.distributed run must call prefill / insert / generate in the same
order with the same inputs, which the threaded orchestrator cannot promise, so here every
process reads the same input file, builds the same jobs in the same order, and runs them
in chunks through jetserve.offline's lock-step loop (`generate_many`) and
`engine.prompt_logprobs`; process 0 alone writes the output. What the loop does not do
per row is applied to its tokens afterwards, the way the orchestrator's threads decide it
(jetserve.orchestrator.stopping and detokenize): the row's own max_tokens, stop token ids,
EOS, and stop strings. Sampled rows without a seed get one derived from a seed that
process 0 draws and shares, so every process samples the same tokens.

Not available here: top-n alternatives (`logprobs` > 0): the loop returns the chosen
token's log-prob only; such rows become error rows naming the limit.

Threads: the caller's only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import time
from collections.abc import Iterator

import numpy as np

from jetserve import distributed
from jetserve.batch.inputs import Entry
from jetserve.batch.results import error_row, generate_row, score_row
from jetserve.batch.rows import GenerateJob, Job, ScoreJob, id_key
from jetserve.batch.runner import Emit
from jetserve.offline import generate_many
from jetserve.orchestrator.detokenize import TextStream
from jetserve.orchestrator.stopping import stop_ids, token_budget, token_finish


def agree_on_done(entries: list[Entry], done: dict[str, bool]) -> dict[str, bool]:
    """Process 0's view of the output (it alone reads it), on every process."""
    n = distributed.broadcast_from_primary(np.asarray([len(entries)], np.int64))
    if int(n[0]) != len(entries):
        raise ValueError(f"process 0 reads {int(n[0])} rows from --input and this process "
                         f"{len(entries)}; every process needs the same input file")
    # 1: done and ok, 2: done with an error, 0: still to run.
    mask = np.asarray([0 if e.key not in done else (1 if done[e.key] else 2) for e in entries],
                      np.int32)
    mask = distributed.broadcast_from_primary(mask)
    return {e.key: bool(m == 1) for e, m in zip(entries, mask.tolist(), strict=True) if m}


def execute(engine, params, jobs: Iterator[Job], emit: Emit, *, chunk: int) -> None:
    base_seed = int(distributed.broadcast_from_primary([secrets.randbits(31)])[0])
    batch: list[Job] = []
    for job in jobs:
        batch.append(job)
        if len(batch) >= chunk:
            _run_chunk(engine, params, batch, emit, base_seed)
            batch = []
    if batch:
        _run_chunk(engine, params, batch, emit, base_seed)


def _run_chunk(engine, params, jobs: list[Job], emit: Emit, base_seed: int) -> None:
    t0 = time.monotonic()
    rows: list[tuple[Job, dict]] = []
    gen: dict[bool, list[GenerateJob]] = {False: [], True: []}
    for job in jobs:
        if isinstance(job, ScoreJob):
            rows.append((job, _score(engine, params, job, t0)))
        elif job.request.logprobs:
            rows.append((job, error_row(job, f"logprobs = {job.request.logprobs}: top "
                                             "alternatives are not available with "
                                             "--coordinator; use logprobs: 0 or true")))
        else:
            gen[job.request.ignore_eos].append(job)
    for ignore_eos, group in gen.items():
        if not group:
            continue
        results = generate_many(
            engine, params, [j.request.prompt_ids for j in group],
            max_tokens=max(j.request.max_tokens for j in group),
            sampling=[_seeded(j, base_seed) for j in group], ignore_eos=ignore_eos)
        latency = time.monotonic() - t0
        rows += [(j, _generate_row(engine, j, r.token_ids, r.logprobs, latency))
                 for j, r in zip(group, results, strict=True)]
    emit(rows)


def _seeded(job: GenerateJob, base_seed: int):
    s = job.request.sampling
    if s.temperature == 0 or s.seed is not None:
        return s
    h = int.from_bytes(hashlib.blake2b(id_key(job.id).encode(), digest_size=4).digest(), "big")
    return dataclasses.replace(s, seed=(base_seed + h) % 2**31)


def _generate_row(engine, job: GenerateJob, tokens: list[int], logprobs: list[float],
                  latency: float) -> dict:
    """The row the orchestrator would have streamed for these tokens (see module doc)."""
    req = job.request
    stops = stop_ids(engine.eos_ids, req.stop_token_ids, req.ignore_eos)
    budget = token_budget(len(req.prompt_ids), req.max_tokens, engine.max_seq_len)
    text_stream = TextStream(engine.tokenizer, req.prompt_ids, req.stop_strings)
    kept: list[int] = []
    text, finish, stop_reason = "", "length", None
    for t in tokens:
        kept.append(t)
        end = token_finish(t, len(kept), budget, stops)
        if end is not None and end[0] == "stop":  # a stop token's text is never emitted
            text += text_stream.finish()
            finish, stop_reason = end
            break
        piece, hit = text_stream.push(t)
        text += piece
        if hit is not None:
            finish, stop_reason = "stop", hit
            break
        if end is not None:
            text += text_stream.finish()
            break
    else:
        text += text_stream.finish()
    lps = [float(x) for x in logprobs[: len(kept)]] if req.logprobs is not None else None
    return generate_row(job, token_ids=kept, text=text, finish_reason=finish,
                        stop_reason=stop_reason, logprobs=lps, top_logprobs=None,
                        ttft=None, latency=latency)


def _score(engine, params, job: ScoreJob, t0: float) -> dict:
    out = engine.prompt_logprobs(params, np.asarray(job.request.prompt_ids, np.int32))
    lps = np.asarray(out.token_logprobs, np.float64)
    greedy = np.asarray(out.greedy).tolist()
    tops = np.asarray(out.top_logprobs)
    # Without a top-1 log-prob the tie check cannot run: compare ids only.
    top_lp = (tops[:, 0].astype(np.float64).tolist() if tops.ndim == 2 and tops.shape[1]
              else [float("inf")] * len(greedy))
    return score_row(job, lps.tolist(), greedy, top_lp, time.monotonic() - t0)
