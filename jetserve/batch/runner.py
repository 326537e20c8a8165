"""A batch job from input file to output file: what to run, in what order, and the record.

`run_job` owns the job's bookkeeping and leaves the device work to an executor (a function
that takes an iterator of jobs and calls `emit` with finished rows), in practice
`orchestrated.execute` (an orchestrator at full occupancy). Every row goes through the
`Journal`, so resume and exactly-once hold however the rows ran. `prepare` does what can
refuse a job (the paths, the input's first pass, verifying the output it resumes), so
the command runs it before loading a model.

Order: the rows still to run are read a window at a time (`window` rows: bounded memory
for inputs of millions of rows), tokenized, and sorted by prompt-length bucket, longest
first. The engine pads each prompt to a power-of-two bucket, so a window's prompts of one
bucket run back to back (one compiled prefill, no padding beyond the bucket), and the
longest jobs start first, so the end of the job is not a few long rows on an idle batch.
Results are written as they complete; `jetserve batch --merge` (or sorting by input
line) restores input order.

Threads: everything here runs on the caller's thread; the orchestrated executor's
orchestrator has its own (see jetserve/orchestrator/driver.py).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Iterable, Iterator

from jetserve.batch import inputs
from jetserve.batch.journal import Journal
from jetserve.batch.preflight import check_paths
from jetserve.batch.rows import Job, RowError, build_job, parse_line
from jetserve.generation_config import GenerationDefaults
from jetserve.server.tool_formats import DEFAULT_PARSER, HARMONY, check_parser
from jetserve.server.validation import ModelLimits

Emit = Callable[[list[tuple[Job | None, dict]]], None]
Executor = Callable[[Iterator[Job], Emit], None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """Args:
      input / output: the JSONL files (output: the file this process writes).
      resume: continue an existing output file (skip the ids it holds).
      retry_failed: with resume, run the rows whose output is an error row again (they
        are removed from the output first).
      repair: with resume, rewrite an output that fails verification to its valid rows
        (the first valid row of each input row) instead of refusing it.
      process_id / num_processes: this process's share of the rows (by id hash).
      default_max_tokens: max_tokens of rows that give none (None: the model's
        generation_config default, else rows.MAX_TOKENS).
      generation_defaults: the model's default sampling (its generation_config.json), for
        the fields a row leaves unset.
      window: rows tokenized and ordered at a time.
      progress: draw a progress bar on stderr.
      lora_adapters: the LoRA adapter names a generation row's `model` may give.
      tool_call_parser: the format chat rows' tool calls are read in (tool_formats).
    """

    input: str
    output: str
    resume: bool = False
    retry_failed: bool = False
    repair: bool = False
    process_id: int = 0
    num_processes: int = 1
    default_max_tokens: int | None = None
    generation_defaults: GenerationDefaults = GenerationDefaults()
    window: int = 4096
    progress: bool = True
    lora_adapters: tuple[str, ...] = ()
    tool_call_parser: str = DEFAULT_PARSER

    def __post_init__(self):
        if not isinstance(self.num_processes, int) or self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes!r}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, {self.num_processes}), "
                             f"got {self.process_id!r}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.retry_failed and not self.resume:
            raise ValueError("retry_failed continues an existing output: it needs resume")
        if self.repair and not self.resume:
            raise ValueError("repair continues an existing output: it needs resume")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        check_parser(self.tool_call_parser, "tool_call_parser")
        if self.tool_call_parser == HARMONY:
            raise ValueError("tool_call_parser 'openai' (gpt-oss's harmony) is served by "
                             "`jetserve serve` only; batch reads calls from text")


@dataclasses.dataclass
class Summary:
    rows: int = 0  # rows this process owns
    resumed: int = 0  # already in the output before this run
    ok: int = 0
    failed: int = 0  # in this run
    failed_before: int = 0  # error rows already in the output
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        t = self.prompt_tokens + self.completion_tokens
        return t / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def all_ok(self) -> bool:
        return self.failed == 0 and self.failed_before == 0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["wall_s"] = round(self.wall_s, 3)
        d["tokens_per_s"] = round(self.tokens_per_s, 1)
        d["total_tokens_per_s"] = round(self.total_tokens_per_s, 1)
        return d

    def line(self) -> str:
        before = f", {self.failed_before} failed earlier" if self.failed_before else ""
        return (f"batch: {self.rows} rows ({self.resumed} done before this run, {self.ok} ok, "
                f"{self.failed} failed{before}); tokens in {self.prompt_tokens}, out "
                f"{self.completion_tokens}; wall {self.wall_s:.1f} s; "
                f"{self.tokens_per_s:.1f} tokens/s out, {self.total_tokens_per_s:.1f} "
                "tokens/s in+out")


@dataclasses.dataclass
class Prepared:
    """A job ready to run: its input scanned, its output verified and open."""

    entries: list[inputs.Entry]  # the input rows this process owns
    journal: Journal


def prepare(cfg: BatchConfig) -> Prepared:
    """Everything about a job that can be refused before its model loads: the paths,
    the input's first pass, the output's recovery and verification."""
    check_paths(cfg.input, cfg.output)
    entries = inputs.mine(inputs.scan(cfg.input), cfg.process_id, cfg.num_processes)
    journal = Journal(cfg.output, resume=cfg.resume, retry_failed=cfg.retry_failed,
                      repair=cfg.repair, expected={e.key for e in entries})
    if journal.torn_bytes:
        print(f"jetserve batch: removed a torn last line ({journal.torn_bytes} bytes) from "
              f"{cfg.output}", file=sys.stderr)
    if journal.repaired:
        print(f"jetserve batch: --repair removed {len(journal.repaired)} bad lines from "
              f"{cfg.output} (first: {journal.repaired[0]}); input rows left without a "
              "result run again",
              file=sys.stderr)
    if journal.dropped:
        print(f"jetserve batch: running {journal.dropped} failed rows again (removed from "
              f"{cfg.output})", file=sys.stderr)
    return Prepared(entries, journal)


def run_job(cfg: BatchConfig, limits: ModelLimits, execute: Executor,
            prepared: Prepared | None = None) -> Summary:
    """Runs the rows of cfg.input this process owns that cfg.output does not hold yet.
    prepared: `prepare(cfg)`, when the caller checked the job before loading a model."""

    def run(entries: list[inputs.Entry], record: Record) -> None:
        execute(_jobs(cfg, limits, entries, record.emit), record.emit)

    return run_rows(cfg, run, prepared)


def run_rows(cfg: BatchConfig, run: Callable[[list[inputs.Entry], Record], None],
             prepared: Prepared | None = None, summary: Summary | None = None,
             postfix: Callable[[], str] | None = None) -> Summary:
    """The bookkeeping of a job around `run`, which gets the input rows still to run
    (each readable and with a unique id) and records each result once through the
    `Record` it is given. summary: the Summary to fill (a subclass with fields of its
    own); postfix: more to show on the progress bar."""
    t0 = time.monotonic()
    prepared = prepared or prepare(cfg)
    entries, journal = prepared.entries, prepared.journal
    done = journal.done
    s = summary if summary is not None else Summary()
    s.rows = len(entries)
    todo = [e for e in entries if e.key not in done]
    s.resumed = len(entries) - len(todo)
    s.failed_before = sum(1 for e in entries if done.get(e.key) is False)
    record = Record(s, journal, _progress(cfg, len(todo)), t0, postfix)
    try:
        record.emit([(None, e.error_row()) for e in todo if e.error is not None])
        run([e for e in todo if e.error is None], record)
    finally:
        record.close()
    s.wall_s = time.monotonic() - t0
    return s


class Record:
    """Results into the journal, the summary and the progress bar (the caller's thread)."""

    def __init__(self, summary: Summary, journal: Journal, bar, t0: float,
                 postfix: Callable[[], str] | None = None):
        self.summary, self._journal, self._bar = summary, journal, bar
        self._t0, self._postfix = t0, postfix

    def emit(self, items: list[tuple[Job | None, dict]]) -> None:
        """Rows with the jobs they ran (None: a row that never became a job)."""
        self.rows([row for _, row in items], [job.prompt_len if job else 0 for job, _ in items])

    def rows(self, rows: list[dict], prompt_tokens: list[int]) -> None:
        """Output rows with the prompt tokens each job ran (0 when none ran)."""
        s = self.summary
        for row, n in zip(rows, prompt_tokens, strict=True):
            if "error" in row:
                s.failed += 1
            else:
                s.ok += 1
                s.prompt_tokens += n
                s.completion_tokens += len(row.get("token_ids", ()))
        self._journal.append(rows)
        if self._bar is not None:
            self._bar.update(len(rows))
            elapsed = max(time.monotonic() - self._t0, 1e-9)
            more = f", {self._postfix()}" if self._postfix else ""
            self._bar.set_postfix_str(f"{s.completion_tokens / elapsed:.0f} tok/s{more}",
                                      refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._journal.close()


def _jobs(cfg: BatchConfig, limits: ModelLimits, entries: list[inputs.Entry],
          emit: Emit) -> Iterator[Job]:
    """Jobs of the given entries, a window at a time, each window in run order; rows that
    fail validation are emitted as error rows on the way."""
    by_line = {e.line: e for e in entries}
    rows = ((by_line[n], text) for n, text in inputs.read_lines(cfg.input, by_line))
    return jobs_of(cfg, limits, rows, emit)


def jobs_of(cfg: BatchConfig, limits: ModelLimits,
            rows: Iterable[tuple[inputs.Entry, str]], emit: Emit) -> Iterator[Job]:
    """Jobs of (entry, its line's text) pairs, cfg.window at a time, each window in run
    order; rows that fail validation are emitted as error rows on the way."""
    window: list[tuple[int, Job]] = []
    for entry, text in rows:
        job = build(cfg, limits, entry, text)
        if isinstance(job, dict):
            emit([(None, job)])
            continue
        window.append((entry.line, job))
        if len(window) >= cfg.window:
            yield from _ordered(window)
            window = []
    yield from _ordered(window)


def build(cfg: BatchConfig, limits: ModelLimits, entry: inputs.Entry, text: str) -> Job | dict:
    """The job of one input line, or its error row."""
    n = entry.line
    try:
        return build_job(parse_line(text), limits, default_max_tokens=cfg.default_max_tokens,
                         adapters=cfg.lora_adapters, tool_parser=cfg.tool_call_parser)
    except RowError as e:
        return entry.error_row(f"line {n}: {e}")
    except Exception as e:  # noqa: BLE001 (a tokenizer or template bug: this row only)
        return entry.error_row(f"line {n}: the row could not be prepared ({_brief(e)})")


def _brief(e: Exception, limit: int = 200) -> str:
    """An unexpected exception in a few words (its text may quote the whole row)."""
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= limit else text[:limit] + "..."


def _ordered(window: list[tuple[int, Job]]) -> Iterator[Job]:
    def key(item: tuple[int, Job]):
        n, job = item
        return (-_bucket(job.prompt_len), -job.work, n)

    for _, job in sorted(window, key=key):
        yield job


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _progress(cfg: BatchConfig, total: int):
    if not cfg.progress or total == 0:
        return None
    from tqdm import tqdm

    # ETA comes from tqdm's smoothed rate of rows; tokens/s is the job's average so far.
    return tqdm(total=total, unit="row", desc="batch", file=sys.stderr, mininterval=0.5,
                dynamic_ncols=True)
