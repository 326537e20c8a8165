"""A small Orbax checkpoint read straight from its OCDBT store, without orbax.

Importing orbax.checkpoint and starting its checkpointer (handlers, a thread pool, async
futures) costs about half a second on a loaded 2-core host, and restoring a few MB of
weights through it about as much again: for the bundled model that was a fifth of a warm
start (docs/BENCHMARKS.md, "Issue 21: a lighter warm start"). `jetserve convert` writes
its checkpoints with orbax's StandardCheckpointer into one OCDBT database, each leaf a
zarr array named by its tree path joined with "."; tensorstore (what orbax itself reads
them with) opens those arrays by name.

Only the plain case is read here: one process, an OCDBT database whose leaves are exactly
the target's, each with the target's shape and dtype, and at most MAX_BYTES in all.
Anything else returns None, and the caller restores with orbax, which also words every
error. The arrays are read whole onto the host, which is why the size is capped: orbax
reads each device's shard of a large model in parallel, without a whole copy on the host.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

MAX_BYTES = 256 << 20
_MANIFEST = "manifest.ocdbt"
_TREE_METADATA = "_METADATA"
# zarr v2 and v3 mark an array with one of these keys; tensorstore's driver for each.
_DRIVERS = {".zarray": "zarr", "zarr.json": "zarr3"}
_LOADABLE = ("jax.Array", "np.ndarray")


def leaf_name(path: tuple) -> str:
    """The name orbax stores a leaf under: its tree path's keys joined with '.'."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def stored_leaves(params_dir: str) -> set[str] | None:
    """The names of the array leaves the checkpoint's tree metadata lists, or None when
    it lists anything else (a leaf orbax would not restore as an array)."""
    with open(os.path.join(params_dir, _TREE_METADATA)) as f:
        tree = json.load(f)["tree_metadata"]
    names = set()
    for entry in tree.values():
        value = entry.get("value_metadata", {})
        if value.get("value_type") not in _LOADABLE or value.get("skip_deserialize"):
            return None
        names.add(".".join(str(k["key"]) for k in entry["key_metadata"]))
    return names


def read_small(params_dir: str, target: dict) -> dict | None:
    """The checkpoint's arrays as host numpy arrays in `target`'s tree (leaves with
    .shape and .dtype), or None when this is not the plain case the module docstring
    describes (the caller then restores with orbax)."""
    if jax.process_count() != 1 or not os.path.exists(os.path.join(params_dir, _MANIFEST)):
        return None
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    if sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for _, a in flat) > MAX_BYTES:
        return None
    names = [leaf_name(p) for p, _ in flat]
    try:
        if stored_leaves(params_dir) != set(names):
            return None
        arrays = _read(params_dir, names)
    except (OSError, ValueError, KeyError, TypeError):  # unreadable here: let orbax say why
        return None
    if arrays is None:
        return None
    for (_, want), got in zip(flat, arrays, strict=True):
        if tuple(got.shape) != tuple(want.shape) or got.dtype != np.dtype(want.dtype):
            return None
    return jax.tree_util.tree_unflatten(treedef, arrays)


def _read(params_dir: str, names: list[str]) -> list[np.ndarray] | None:
    """Every named array, read concurrently; None if one is not a zarr array."""
    import tensorstore as ts  # orbax's own dependency; only this path needs it

    kvstore = {"driver": "ocdbt", "base": "file://" + os.path.abspath(params_dir)}
    context = ts.Context()  # one open database for every array
    keys = set(ts.KvStore.open(kvstore, context=context).result().list().result())
    specs = []
    for name in names:
        driver = next((d for marker, d in _DRIVERS.items()
                       if f"{name}/{marker}".encode() in keys), None)
        if driver is None:
            return None
        specs.append({"driver": driver, "kvstore": {**kvstore, "path": name + "/"}})
    opened = [ts.open(s, open=True, read=True, context=context) for s in specs]
    reads = [o.result().read() for o in opened]
    return [np.asarray(r.result()) for r in reads]
