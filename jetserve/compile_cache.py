"""The persistent XLA compilation cache, and counting what a start compiled.

Every command that builds an engine turns the cache on before its first compile (see
`enable`), so a second start of the same model on the same machine reads its programs
from disk instead of compiling them. Where it lives, in order: `--compile-cache DIR`,
`$JETSERVE_COMPILE_CACHE`, `$JAX_COMPILATION_CACHE_DIR`, `~/.cache/jetserve/xla`; the
word `off` (in the flag or the variable) turns it off.

Why sharing one directory is safe (jax 0.10): an entry's key hashes the program, the
compile options (device count and assignment), the jaxlib version, the platform version
and the XLA flags, so a cache written by another topology or another jax is simply a
miss. Entries are never rewritten once present. jax writes an entry in place (not
through a rename), so a process reading it while another one writes may see it torn;
jax catches any error reading an entry, warns, and compiles the program instead (unless
`jax_raise_persistent_cache_errors` is set), so a torn or foreign entry costs a compile,
never a crash. jax never rewrites an entry that exists, so one torn by a process killed
mid-write stays a miss (a warning each start) until the directory is cleared. In a run
over several processes (jax.distributed) only process 0 writes.

Concurrency: `CompileCounter` listens to jax's monitoring events, which fire on whichever
thread compiles; its counts are guarded by a lock.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

ENV = "JETSERVE_COMPILE_CACHE"
DEFAULT_DIR = os.path.join("~", ".cache", "jetserve", "xla")
OFF = "off"

# jax's monitoring event names (jax/_src/dispatch.py, jax/_src/compiler.py). The compile
# event wraps every XLA compile, read from the cache or not; a hit also fires cache_hits.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
# Tracing to a jaxpr and lowering it to StableHLO: paid again on every start, cache or not.
_TRACE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                 "/jax/core/compile/jaxpr_to_mlir_module_duration")


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="persistent cache of compiled programs, so later starts skip "
                        f"compiling; 'off' to disable (default: ${ENV}, else "
                        f"$JAX_COMPILATION_CACHE_DIR, else {DEFAULT_DIR})")


def resolve(flag: str | None) -> str | None:
    """The cache directory that `flag` (None: not given) and the environment choose, as
    an absolute path; None when the cache is off."""
    value = flag
    if value is None:
        value = (os.environ.get(ENV) or os.environ.get("JAX_COMPILATION_CACHE_DIR")
                 or DEFAULT_DIR)
    value = value.strip()
    if value.lower() == OFF:
        return None
    if not value:
        raise ValueError(f"--compile-cache must be a directory or '{OFF}', got an empty value")
    return os.path.abspath(os.path.expanduser(value))


def enable(flag: str | None) -> str | None:
    """Points jax's persistent cache at the chosen directory (or turns it off), caching
    every program however small or quick to compile. Call before the first compile: jax
    opens the cache once per process. Returns the directory, or None when off.

    A directory given with --compile-cache that cannot be created is an error naming the
    flag; the default or the environment's is only a warning (the cache is off then).
    """
    import jax

    path = resolve(flag)
    if path is not None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            if flag is not None:
                raise ValueError(f"--compile-cache: cannot create {path}: {e.strerror}") from None
            print(f"jetserve: compile cache {path} is unusable ({e.strerror}); compiling "
                  f"without it (set --compile-cache DIR or {ENV})", file=sys.stderr)
            path = None
    from engines import exported_programs  # traced programs, next to the compiled ones

    exported_programs.set_directory(path)
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


class CompileCounter:
    """Counts the XLA programs compiled while it is entered, how many of them came from
    the persistent cache, the seconds spent compiling (or reading the cache), and the
    seconds spent tracing and lowering (which the cache does not save).

        with CompileCounter() as c:
            ...
        print(c.summary())
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.programs = 0
        self.from_cache = 0
        self.compile_s = 0.0
        self.trace_s = 0.0
        self._t0 = self._t1 = None

    def _on_duration(self, event: str, duration_secs: float, **kwargs) -> None:
        if event == _COMPILE_EVENT:
            with self._lock:
                self.programs += 1
                self.compile_s += duration_secs
        elif event in _TRACE_EVENTS:
            with self._lock:
                self.trace_s += duration_secs

    def _on_event(self, event: str, **kwargs) -> None:
        if event == _CACHE_HIT_EVENT:
            with self._lock:
                self.from_cache += 1

    def __enter__(self) -> CompileCounter:
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(self._on_duration)
        monitoring.register_event_listener(self._on_event)
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        from jax import monitoring

        self._t1 = time.monotonic()
        monitoring.unregister_event_duration_listener(self._on_duration)
        monitoring.unregister_event_listener(self._on_event)

    @property
    def elapsed_s(self) -> float:
        """Wall seconds from entering to leaving (or to now, while entered)."""
        if self._t0 is None:
            return 0.0
        return (self._t1 if self._t1 is not None else time.monotonic()) - self._t0

    def as_dict(self) -> dict:
        with self._lock:
            return {"programs": self.programs, "from_cache": self.from_cache,
                    "compile_s": round(self.compile_s, 3), "trace_s": round(self.trace_s, 3),
                    "elapsed_s": round(self.elapsed_s, 3)}

    def summary(self, seconds: float | None = None) -> str:
        """'compiled N programs in X s (M from cache)'; X is `seconds`, by default the
        wall time while entered."""
        with self._lock:
            n, m = self.programs, self.from_cache
        x = self.elapsed_s if seconds is None else seconds
        return f"compiled {n} program{'s' if n != 1 else ''} in {x:.2f} s ({m} from cache)"
