"""`jetserve batch --ray`: one batch job over a pool of engine actors on a Ray cluster.

The driver (the process that runs the command) does what one host does today, minus
the device work: it checks the paths, scans the input and verifies the output it resumes
(`runner.prepare`, before Ray starts), writes the rows that cannot run, and is the one
writer of the output (the `Journal`: every row appended and fsync'd once, in the order
blocks finish). The rows still to run become a Ray dataset: the driver reads their lines
(as one host does, so the input lives on the driver's machine alone) into blocks of
`block_rows` rows in the object store, and `Dataset.map_batches` runs them on a fixed
pool of `EngineActor`s (ray_actor.py), one per engine, each reserving `resources`;
Ray Data gives a block to each actor as it frees up. A block's result rows come back to
the driver, which writes each key once and stops with an error if any row got none.

An actor whose process dies is started again by Ray (on another host when its own is
gone), and its block runs again; the ledger (ray_ledger.py) makes that retry run only
the rows not finished, one at a time, so that a row that kills its engine twice becomes
an error row rather than taking the pool down.

Progress: the bar counts rows written, with rows/s, tokens/s and the actors alive; the
summary adds the actors, their restarts and the blocks retried.

Ray is an extra (`pip install 'jetserve[ray]'`); nothing else in jetserve imports it.
Threads: everything here runs on the caller's thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping

from jetserve.batch import inputs
from jetserve.batch.runner import BatchConfig, Prepared, Record, Summary, run_rows

EXTRA = "jetserve[ray]"


def import_ray():
    """Ray, or a ValueError naming the extra that installs it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--ray needs Ray Data, which is not installed ({e}); install "
                         f"it with: pip install '{EXTRA}'") from None
    return ray


@dataclasses.dataclass(frozen=True, kw_only=True)
class RayPool:
    """Args:
      address: the cluster (`ray://HOST:10001`, `HOST:6379`, `auto`); None: Ray's own
        rule (RAY_ADDRESS, a cluster started on this host, else a new local one).
      actors: engine actors (one per slice).
      resources: what each actor reserves, e.g. {"TPU": 4, "CPU": 8}: CPU and GPU are
        Ray's num_cpus / num_gpus, any other name a custom resource.
      block_rows: rows handed to an actor at a time.
    """

    address: str | None = None
    actors: int = 1
    resources: Mapping[str, float] = dataclasses.field(default_factory=lambda: {"CPU": 1})
    block_rows: int = 64

    def __post_init__(self):
        if not isinstance(self.actors, int) or self.actors < 1:
            raise ValueError(f"--ray-actors must be >= 1, got {self.actors!r}")
        if not isinstance(self.block_rows, int) or self.block_rows < 1:
            raise ValueError(f"--ray-block-rows must be >= 1, got {self.block_rows!r}")
        for name, n in self.resources.items():
            if not isinstance(n, (int, float)) or n < 0:
                raise ValueError(f"--ray-actor-resources: {name} must be a number >= 0, "
                                 f"got {n!r}")

    def remote_args(self) -> dict:
        res = dict(self.resources)
        args = {"num_cpus": res.pop("CPU", 0), "num_gpus": res.pop("GPU", 0)}
        if res:
            args["resources"] = res
        return args


def parse_resources(text: str) -> dict[str, float]:
    """'CPU=8,TPU=4' -> {'CPU': 8.0, 'TPU': 4.0}."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            eq = ""
        if not eq or not name.strip():
            raise ValueError(f"--ray-actor-resources: expected NAME=NUMBER[,NAME=NUMBER...] "
                             f"(e.g. TPU=4,CPU=8), got {part!r}")
    return out


@dataclasses.dataclass
class RaySummary(Summary):
    actors: int = 0  # the pool's size
    actors_alive: int = 0  # heard from at the end
    actor_restarts: int = 0  # processes Ray started again after a death
    blocks_retried: int = 0  # attempts at a block after its actor died
    engines_s: float = 0.0  # first block's start to last block's end (no actor start)

    @property
    def rows_per_s(self) -> float:
        return (self.ok + self.failed) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def engine_rows_per_s(self) -> float:
        return (self.ok + self.failed) / self.engines_s if self.engines_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {**super().as_dict(), "engines_s": round(self.engines_s, 3),
                "rows_per_s": round(self.rows_per_s, 2),
                "engine_rows_per_s": round(self.engine_rows_per_s, 2)}

    def line(self) -> str:
        return (f"{super().line()}; {self.rows_per_s:.2f} rows/s ("
                f"{self.engine_rows_per_s:.2f} from the first block's start to the last's "
                f"end); ray: {self.actors} actors ({self.actors_alive} alive at the end, "
                f"{self.actor_restarts} restarted), {self.blocks_retried} blocks retried")


@dataclasses.dataclass(frozen=True)
class Progress:
    """What the driver knows after writing a block (given to run's on_progress)."""

    rows_done: int  # rows written by this run
    rows_per_s: float
    tokens_per_s: float
    actors_alive: int
    busy: list[dict]  # per busy actor: actor, pid, node, block, since (s)


def run(cfg: BatchConfig, make_orchestrator: Callable, pool: RayPool, *,
        prepared: Prepared | None = None,
        on_progress: Callable[[Progress], None] | None = None) -> RaySummary:
    """The job of cfg on a Ray cluster (the Python entry point of `jetserve batch --ray`).

    make_orchestrator: a picklable zero-argument callable each actor calls to build its
    orchestrator (not started), e.g. jetserve.commands.batch.orchestrator_factory(flags).
    prepared: runner.prepare(cfg), done already. on_progress: called after each block
    the driver writes. Connects to pool.address unless Ray is initialized already (then
    its cluster is used, and left running).
    """
    driver = _Driver(import_ray(), cfg, make_orchestrator, pool, on_progress)
    return run_rows(cfg, driver.run, prepared, driver.summary, driver.postfix)


class _Driver:
    """The Ray side of one job: the cluster, the ledger, the pool's dataset, and each
    output block's rows into the job's Record."""

    def __init__(self, ray, cfg: BatchConfig, make_orchestrator: Callable, pool: RayPool,
                 on_progress: Callable[[Progress], None] | None):
        self.ray, self.cfg, self.pool = ray, cfg, pool
        self.make_orchestrator, self.on_progress = make_orchestrator, on_progress
        self.summary = RaySummary(actors=pool.actors)
        self.alive = 0
        self.t0 = time.monotonic()

    def postfix(self) -> str:
        return f"{self.alive}/{self.pool.actors} actors alive"

    def run(self, entries: list[inputs.Entry], record: Record) -> None:
        if not entries:
            return  # nothing left to run: no cluster needed
        ray = self.ray
        started = not ray.is_initialized()
        if started:
            ray.init(address=self.pool.address, logging_level=logging.WARNING)
        from jetserve.batch.ray_ledger import remote_ledger

        name = f"jetserve-batch-ledger-{uuid.uuid4().hex[:12]}"
        ledger = remote_ledger(name)
        try:
            self._run_pool(entries, record, ledger, name)
            final = ray.get(ledger.status.remote())
            s = self.summary
            s.actors_alive, s.actor_restarts = final["alive"], final["restarts"]
            s.blocks_retried, s.engines_s = final["blocks_retried"], final["engines_s"]
        finally:
            ray.kill(ledger)
            if started:
                ray.shutdown()

    def _run_pool(self, entries: list[inputs.Entry], record: Record, ledger,
                  ledger_name: str) -> None:
        from jetserve.batch.ray_actor import EngineActor

        ray, pool = self.ray, self.pool
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False  # ours is the job's bar (and no warning it is off)
        ctx.print_on_execution_start = False
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
        ds = ray.data.from_arrow_refs(list(_blocks(ray, self.cfg.input, entries,
                                                   pool.block_rows)))
        ds = ds.map_batches(
            EngineActor, batch_size=pool.block_rows, batch_format="pyarrow",
            fn_constructor_kwargs={"cfg": self.cfg, "make_orchestrator": self.make_orchestrator,
                                   "ledger": ledger_name},
            compute=ray.data.ActorPoolStrategy(size=pool.actors,
                                               max_tasks_in_flight_per_actor=1),
            **pool.remote_args())
        want = {e.key for e in entries}
        written: set[str] = set()
        try:
            self._drain(ds, want, written, record, ledger)
        except ray.exceptions.RayError as e:  # an engine that cannot start, a bug in a block
            raise ValueError(f"the Ray job stopped ({_cause(e)}); the rows written before "
                             "are kept for --resume") from None
        missing = [e for e in entries if e.key not in written]
        if missing:
            e = missing[0]
            raise ValueError(f"{len(missing)} rows got no result from the Ray job (first: "
                             f"line {e.line}, id {e.id!r}); run it again with --resume")

    def _drain(self, ds, want: set[str], written: set[str], record: Record, ledger) -> None:
        """Writes each output block's rows, each key once, as blocks finish."""
        for out in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            rows, tokens = [], []
            for key, line, n in zip(out["key"].to_pylist(), out["row"].to_pylist(),
                                    out["prompt_tokens"].to_pylist(), strict=True):
                if key in written or key not in want:
                    continue  # each row once, whatever Ray ran twice
                written.add(key)
                rows.append(json.loads(line))
                tokens.append(n)
            status = self.ray.get(ledger.status.remote())
            self.alive = status["alive"]
            record.rows(rows, tokens)
            if self.on_progress is not None:
                s = record.summary
                elapsed = max(time.monotonic() - self.t0, 1e-9)
                self.on_progress(Progress(
                    rows_done=s.ok + s.failed, rows_per_s=(s.ok + s.failed) / elapsed,
                    tokens_per_s=s.completion_tokens / elapsed, actors_alive=self.alive,
                    busy=status["busy"]))


def _cause(e: Exception) -> str:
    """The last line of a Ray error's text: the exception that started it (the worker's
    whole traceback is on stderr already)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


def _blocks(ray, path: str, entries: list[inputs.Entry], block_rows: int) -> Iterator:
    """The entries' lines as Arrow tables of block_rows rows, put in the object store one
    at a time (the driver holds one block's text at once)."""
    import pyarrow as pa

    by_line = {e.line: e for e in entries}
    lines: list[int] = []
    keys: list[str] = []
    texts: list[str] = []

    def put():
        ref = ray.put(pa.table({"line": lines, "key": keys, "text": texts}))
        lines.clear(), keys.clear(), texts.clear()
        return ref

    for n, text in inputs.read_lines(path, by_line):
        lines.append(n)
        keys.append(by_line[n].key)
        texts.append(text)
        if len(lines) == block_rows:
            yield put()
    if lines:
        yield put()
