"""Output rows: a finished job (its Completion, or lock-step results) -> one JSON object.

Generation rows: `id, text, token_ids, finish_reason, stop_reason, prompt_tokens,
completion_tokens`, with `logprobs` (and `top_logprobs` as [id, logprob] pairs) when the
row asked, and `ttft` / `latency` in seconds from submission. A chat row with tools in
play also has the message as /v1/chat/completions returns it: `content` (the text outside
any calls, null when there is none) and `tool_calls` when the model called, with
finish_reason "tool_calls" then; `text` stays the whole generated text. Scoring rows: `id, logprob,
is_greedy, num_tokens, latency`. A failed job: `id, error`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from jetserve.batch.rows import GenerateJob, Job, ScoreJob
from jetserve.server import tool_output


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def generate_row(job: GenerateJob, *, token_ids: list[int], text: str, finish_reason: str,
                 stop_reason, logprobs: list[float] | None,
                 top_logprobs: list[list[tuple[int, float]]] | None,
                 ttft: float | None, latency: float | None) -> dict:
    row = {"id": job.id, "text": text, "token_ids": list(token_ids),
           "finish_reason": finish_reason}
    if job.tools is not None:
        message, row["finish_reason"] = tool_output.message(job.tools, text, finish_reason)
        row["content"] = message["content"]
        if "tool_calls" in message:
            row["tool_calls"] = message["tool_calls"]
    if stop_reason is not None:
        row["stop_reason"] = stop_reason
    row["prompt_tokens"] = job.prompt_len
    row["completion_tokens"] = len(token_ids)
    if job.request.logprobs is not None:
        row["logprobs"] = [float(x) for x in (logprobs or [])]
        if job.request.logprobs > 0:
            row["top_logprobs"] = [[[int(i), float(lp)] for i, lp in alts]
                                   for alts in (top_logprobs or [])]
    row["ttft"] = _rounded(ttft)
    row["latency"] = _rounded(latency)
    return _with_metadata(row, job)


def score_row(job: ScoreJob, token_logprobs: Sequence[float | None],
              top_ids: Sequence[int | None], top_logprobs: Sequence[float | None],
              latency: float | None) -> dict:
    """token_logprobs[t]: log p(prompt[t] | prompt[:t]); top_ids / top_logprobs[t]: the
    most likely token there and its log-prob (None when unknown)."""
    ids = job.request.prompt_ids
    k = job.context_len
    cont = range(k, len(ids))
    total = math.fsum(float(token_logprobs[t]) for t in cont)
    greedy: bool | None = True
    for t in cont:
        if top_ids[t] is None:
            greedy = None  # the engine returns no alternatives: cannot tell
            break
        # A tie with the top token still counts: greedy decoding could have picked it.
        if top_ids[t] != ids[t] and not float(top_logprobs[t]) <= float(token_logprobs[t]):
            greedy = False
            break
    row = {"id": job.id, "logprob": total, "is_greedy": greedy, "num_tokens": len(cont),
           "latency": _rounded(latency)}
    return _with_metadata(row, job)


def from_completion(job: Job, c) -> dict:
    """The output row of an orchestrator Completion."""
    if c.finish_reason == "error" or c.error:
        return error_row(job, c.error or "the engine failed on this row")
    t = c.timing
    if isinstance(job, ScoreJob):
        tops = c.prompt_top_logprobs or []
        first = [alts[0] if alts else (None, None) for alts in tops]
        first += [(None, None)] * (job.prompt_len - len(first))
        return score_row(job, c.prompt_logprobs, [a for a, _ in first],
                         [b for _, b in first], t.latency)
    return generate_row(job, token_ids=c.token_ids, text=c.text,
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                        logprobs=c.logprobs, top_logprobs=c.top_logprobs, ttft=t.ttft,
                        latency=t.latency)


def error_row(job: Job, message: str) -> dict:
    return _with_metadata({"id": job.id, "error": message}, job)


def _with_metadata(row: dict, job: Job) -> dict:
    if job.metadata is not None:
        row["metadata"] = job.metadata
    return row
