"""A disk cache of exported (traced and lowered) programs, so a warm start skips tracing.

jax's persistent compile cache (jetserve/compile_cache.py) keys on the lowered program,
so every start still traces and lowers each program before it can look it up. This
module keeps each program as a serialized `jax.export.Exported` under
`<compile cache>/exported/`: a start that finds one deserializes it and jits its `call`
(whose compile then hits the XLA cache); a start that does not exports the program,
saves it, and runs the very same `jit(exported.call)`, so cold and warm starts compile
the same module.

`cached_jit(fn, name=..., context=..., **jit_kwargs)` stands in for `jax.jit(fn, ...)`
for functions without static arguments. With the cache off (`set_directory(None)`, the
default) it is plain `jax.jit`.

The key of an entry is known before tracing and changes whenever the program could: a
hash of the source files that define programs (engines/, sharding/, engines/csrc/), the
jax and jaxlib versions, the platform, device kinds and count, the caller's `context`
(model and engine config, dtypes, layouts, backend), the jit options (shardings,
donation), and the abstract shapes, dtypes, weak types and tree structure of every
argument. A mismatch is a miss; an unreadable or corrupt file is a miss with one warning,
then the normal path. Files are written to a temporary name and renamed into place, so
several processes may share a directory (the last rename wins; both are the same
program).

Our CPU kernels are XLA FFI custom calls outside jax.export's stable list: export is
told to accept the targets in engines/cpu_kernels.py, and the kernels are registered
(cpu_kernels.available) before a deserialized program is compiled. Calling an exported
program on the CPU makes jax initialize its LAPACK kernels, which imports scipy (about
0.06 s of a warm start).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pathlib
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

from engines import cpu_kernels

log = logging.getLogger(__name__)

SUBDIR = "exported"
_ROOT = pathlib.Path(__file__).resolve().parent.parent
_SOURCE_DIRS = ("engines", "sharding")
_SOURCE_SUFFIXES = (".py", ".cc", ".h", ".cpp")
_TARGETS = (cpu_kernels.TARGET, cpu_kernels.ATTENTION_TARGET, cpu_kernels.ARGMAX_TARGET,
            cpu_kernels.LOG_PROBS_TARGET)

_directory: str | None = None
_lock = threading.Lock()
# What this process did, for tests and the start-up line: hits, misses (exported), errors.
stats = {"hits": 0, "exports": 0, "errors": 0, "json_hits": 0, "json_writes": 0}


def set_directory(compile_cache_dir: str | None) -> None:
    """Turns the cache on under `<compile_cache_dir>/exported/`, or off (None)."""
    global _directory
    _directory = None if compile_cache_dir is None else os.path.join(compile_cache_dir, SUBDIR)


def directory() -> str | None:
    return _directory


@functools.cache
def source_hash() -> str:
    """A hash of every source file that defines the programs (engines/, sharding/, and
    the C++ kernels under engines/csrc/)."""
    h = hashlib.sha256()
    for d in _SOURCE_DIRS:
        for p in sorted((_ROOT / d).rglob("*")):
            if p.is_file() and p.suffix in _SOURCE_SUFFIXES:
                h.update(str(p.relative_to(_ROOT)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()


def _environment() -> str:
    import jaxlib

    devices = jax.devices()
    return repr((jax.__version__, jaxlib.__version__, devices[0].platform,
                 tuple(d.device_kind for d in devices), len(devices),
                 jax.config.jax_enable_x64))


@functools.cache
def _register_types() -> None:
    """Lets jax.export serialize the tree structure of our programs' arguments and
    results (dataclass nodes without meta fields: their aux data is ())."""
    from engines.engine_api import ResultTokens
    from engines.kv_cache import DecodeState, Prefix
    from engines.sampling import SlotSampling

    for cls in (SlotSampling, Prefix, DecodeState, ResultTokens):
        jax.export.register_pytree_node_serialization(
            cls, serialized_name=f"{cls.__module__}.{cls.__qualname__}",
            serialize_auxdata=_serialize_aux, deserialize_auxdata=_deserialize_aux)


def _serialize_aux(aux) -> bytes:
    if aux != ():
        raise ValueError(f"only dataclass nodes without meta fields, got aux data {aux!r}")
    return b""


def _deserialize_aux(data: bytes):
    if data:
        raise ValueError(f"unexpected aux data {data!r}")
    return ()


def _abstract(leaf):
    """(shape, dtype, weak type, sharding) of one argument leaf; None stays None."""
    if isinstance(leaf, jax.Array | np.ndarray | np.generic):
        weak = bool(getattr(leaf, "weak_type", False))
        return (tuple(leaf.shape), str(leaf.dtype), weak)
    return (type(leaf).__name__, repr(leaf))  # a Python scalar: its value is part of it


def signature(args) -> tuple:
    leaves, tree = jax.tree_util.tree_flatten(args)
    return (str(tree), tuple(_abstract(x) for x in leaves))


def key(name: str, context: str, jit_kwargs: dict, args) -> str:
    h = hashlib.sha256()
    for part in (name, source_hash(), _environment(), context,
                 repr(sorted(jit_kwargs.items())), repr(signature(args))):
        h.update(part.encode())
        h.update(b"\0")
    return f"{name}-{h.hexdigest()[:40]}"


def cached_json(name: str, context: str, compute, encode, decode):
    """`compute()`, or its value from `<cache>/exported/` (stored as JSON by `encode`,
    read back by `decode`) under a key of `name`, `context`, the sources and the
    environment; with the cache off, `compute()`. A miss or an unreadable entry computes
    and stores it."""
    if _directory is None:
        return compute()
    path = os.path.join(_directory, key(name, context, {}, ()) + ".json")
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        text = None
    if text is not None:
        try:
            value = decode(json.loads(text))
            stats["json_hits"] += 1
            return value
        except Exception as e:  # noqa: BLE001 -- a corrupt entry is a miss, never a crash
            stats["errors"] += 1
            log.warning("cached %s %s is unreadable (%s: %s); computing it again",
                        name, path, type(e).__name__, e)
    value = compute()
    _write(path, json.dumps(encode(value)).encode())
    stats["json_writes"] += 1
    return value


def _load(path: str) -> jax.export.Exported | None:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    try:
        return jax.export.deserialize(bytearray(data))
    except Exception as e:  # noqa: BLE001 -- a corrupt entry is a miss, never a crash
        stats["errors"] += 1
        log.warning("exported program %s is unreadable (%s: %s); tracing it again",
                    path, type(e).__name__, e)
        return None


def _write(path: str, data: bytes) -> None:
    """Atomically: a temporary file in the directory, renamed into place."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        log.warning("cannot save %s: %s", path, e)


def _matches(exported: jax.export.Exported, args) -> bool:
    """Belt and braces behind the key: the entry's input avals are these arguments'."""
    leaves, tree = jax.tree_util.tree_flatten((args, {}))
    if tree != exported.in_tree or len(leaves) != len(exported.in_avals):
        return False
    return all(tuple(np.shape(x)) == a.shape and _dtype(x) == a.dtype
               for x, a in zip(leaves, exported.in_avals, strict=True))


def _dtype(x) -> np.dtype:
    """An argument's dtype: an array's own (numpy's result_type of an array is
    deprecated), a Python scalar's as numpy takes it."""
    return x.dtype if hasattr(x, "dtype") else np.result_type(x)


class CachedJit:
    """`jax.jit(fn, **jit_kwargs)` through the exported-program cache (see the module)."""

    def __init__(self, fn, *, name: str, context: str, **jit_kwargs):
        if "static_argnums" in jit_kwargs or "static_argnames" in jit_kwargs:
            raise ValueError("cached_jit takes no static arguments")
        self._fn = fn
        self._name = name
        self._context = context
        self._jit_kwargs = jit_kwargs
        self._plain = jax.jit(fn, **jit_kwargs)
        self._programs: dict[tuple, object] = {}  # signature -> jit(exported.call)

    def __call__(self, *args):
        if _directory is None:
            return self._plain(*args)
        sig = signature(args)
        program = self._programs.get(sig)
        if program is None:
            with _lock:
                program = self._programs.get(sig) or self._program(args)
                self._programs[sig] = program
        return program(*args)

    def lower(self, *args):
        return self._plain.lower(*args)

    def _program(self, args):
        _register_types()
        path = os.path.join(_directory, key(self._name, self._context, self._jit_kwargs, args)
                            + ".exported")
        exported = _load(path)
        if exported is not None and not _matches(exported, args):
            exported = None
        if exported is not None:
            stats["hits"] += 1
            cpu_kernels.available()  # our custom-call targets, before the compile
        else:
            exported = jax.export.export(self._plain, disabled_checks=[
                jax.export.DisabledSafetyCheck.custom_call(t) for t in _TARGETS])(*args)
            _write(path, exported.serialize())
            stats["exports"] += 1
        return jax.jit(_reading_kept_only(exported), **self._jit_kwargs)


def _reading_kept_only(exported: jax.export.Exported):
    """`exported.call` that reads only the leaves its module keeps. `exported.call` takes
    every leaf as an operand, so a leaf the program never reads would count as read: a
    donated argument's unread leaves would be donated (jit of the function itself leaves
    them alone), and a buffer passed both there and elsewhere fails to execute ("donate a
    buffer which is also used by the same call"). Unread leaves become zeros of their
    shape inside the trace, which the module drops."""
    kept = frozenset(exported.module_kept_var_idx)

    def call(*args):
        leaves, tree = jax.tree_util.tree_flatten(args)
        leaves = [x if i in kept else jnp.zeros(a.shape, a.dtype)
                  for i, (x, a) in enumerate(zip(leaves, exported.in_avals, strict=True))]
        return exported.call(*jax.tree_util.tree_unflatten(tree, leaves))

    return call


def cached_jit(fn, *, name: str, context: str | None, **jit_kwargs):
    """`jax.jit(fn, **jit_kwargs)` through the cache; context None: never cached (a
    caller whose programs the cache does not cover), plain jax.jit."""
    if context is None:
        return jax.jit(fn, **jit_kwargs)
    return CachedJit(fn, name=name, context=context, **jit_kwargs)
