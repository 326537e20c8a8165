"""What crosses the wire beside a prefix's bytes: its leaves' shapes, dtypes and layouts,
and the signature of the model that made it.

A pull (`jax.experimental.transfer`) copies shard by shard: the receiver must ask for the
arrays exactly as the sender laid them out (the same mesh shape and partition specs, on
devices of its own). So the sender describes each leaf (`describe`), laid out on at most
as many devices as the receiver has (`wire_layout`: a prefix over more is gathered onto
one device first), and the receiver rebuilds those shardings on its devices
(`pull_specs`) before it regroups and moves the prefix into its own layout.

A prefix made by an engine over several processes (`--role prefill --coordinator`) is
not gathered anywhere: each process offers its own blocks of each leaf from its own
transfer server (`local_pieces`), one block per distinct index (`owned_pieces`: the
lowest-id device holding it), and the description lists every block's leaf, index and
source process (`describe_pieces`); the receiver pulls each source's blocks and puts the
leaves back together on one device (`assemble`).

Before any byte moves the receiver compares the sender's signature (model dimensions,
dtype, pytree structure) with its own engine's (`check`): a prefix of another model or
dtype is refused with a `PrefixMismatch` naming the field, never written into a cache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding


class PrefixMismatch(ValueError):
    """A prefix that does not fit the receiving engine (another model, dtype or layout)."""


def signature(engine: Any) -> dict:
    """What a prefix made by `engine` depends on, as JSON-able values: two engines with
    equal signatures exchange prefixes (their kv heads may be repeated otherwise)."""
    # The pytree structure names the prefix type (a paged engine takes a contiguous one's).
    sig = {"vocab_size": int(engine.vocab_size),
           "treedef": str(jax.tree.structure(engine.prefix_destination_sharding())),
           "draft": bool(getattr(engine, "has_draft_model", False))}
    c = getattr(engine, "source_config", None)
    if c is not None:  # a transformer engine: the model's stored kv heads, not the repeat
        sig.update(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                   head_dim=c.head_dim, dtype=np.dtype(engine.dtype).name)
        if c.value_dim != c.head_dim:  # a key-only cache: its value arrays have width 0
            sig.update(value_dim=c.value_dim)
    return sig


def check_signature(theirs: dict, ours: dict, who: str) -> None:
    """PrefixMismatch naming the first field where `who`'s signature differs from ours."""
    for field in sorted(set(theirs) | set(ours)):
        if theirs.get(field) != ours.get(field):
            raise PrefixMismatch(
                f"{who} makes prefixes with {field}={theirs.get(field)!r}, this engine "
                f"takes {field}={ours.get(field)!r}: serve the same model and dtype on both")


def _spec_json(spec: PartitionSpec) -> list:
    return [list(p) if isinstance(p, tuple) else p for p in spec]


def describe(prefix: Any, engine: Any) -> dict:
    """The JSON-able description a receiver needs to pull `prefix` (see module doc)."""
    leaves = []
    for x in jax.tree.leaves(prefix):
        s = x.sharding
        row = {"shape": list(x.shape), "dtype": np.dtype(x.dtype).name}
        if isinstance(s, NamedSharding):
            row["mesh"] = {"axes": list(s.mesh.axis_names),
                           "shape": [int(n) for n in s.mesh.devices.shape]}
            row["spec"] = _spec_json(s.spec)
        leaves.append(row)
    return {"leaves": leaves, "signature": signature(engine)}


def wire_layout(prefix: Any, receiver_devices: int) -> Any:
    """`prefix` as it is when each leaf spans at most `receiver_devices` devices, else
    gathered onto its first device (the receiver needs a device per shard)."""
    leaves = jax.tree.leaves(prefix)
    widest = max(len(x.sharding.device_set) for x in leaves)
    if widest <= receiver_devices:
        return prefix
    first = min(leaves[0].sharding.device_set, key=lambda d: d.id)
    return jax.device_put(prefix, SingleDeviceSharding(first))


def nonempty(xs: Sequence[Any]) -> list[Any]:
    """The arrays (or ShapeDtypeStructs) of xs that hold any entry: a transfer server's
    pull of an empty array never lands (seen: never ready), so the empty leaves (a
    key-only cache's values, width 0) are not sent; the receiver makes them
    (`with_empty`)."""
    return [x for x in xs if math.prod(x.shape)]


def with_empty(specs: Sequence[jax.ShapeDtypeStruct], pulled: Sequence[jax.Array]
               ) -> list[jax.Array]:
    """Every leaf of `specs`: the pulled ones (`nonempty(specs)`, in order), and each
    empty one made here, where its spec places it."""
    it = iter(pulled)
    return [next(it) if math.prod(s.shape) else jnp.zeros(s.shape, s.dtype, device=s.sharding)
            for s in specs]


def nbytes(meta: dict) -> int:
    """Bytes of the described prefix (one copy of each leaf)."""
    return sum(int(np.prod(r["shape"], dtype=np.int64)) * np.dtype(r["dtype"]).itemsize
               for r in meta["leaves"])


def check(meta: dict, engine: Any, who: str) -> None:
    """PrefixMismatch unless the described prefix fits `engine` (before any pull)."""
    ours = signature(engine)
    check_signature(meta.get("signature", {}), ours, who)
    leaves = meta["leaves"]
    want = jax.tree.structure(engine.prefix_destination_sharding()).num_leaves
    if len(leaves) != want:
        raise PrefixMismatch(f"{who} sent a prefix of {len(leaves)} arrays, this engine's "
                             f"prefixes have {want}")
    longest = engine.max_seq_len
    for i, r in enumerate(leaves):
        if len(r["shape"]) != 4:
            continue  # kv arrays [1, T, K, H] are what a cache takes in
        T, H = r["shape"][1], r["shape"][3]
        if T > longest:
            raise PrefixMismatch(f"{who} sent kv array {i} of {T} positions; this engine's "
                                 f"max_seq_len is {longest}")
        if "dtype" in ours and r["dtype"] != ours["dtype"]:
            raise PrefixMismatch(f"{who} sent kv array {i} in {r['dtype']}, this engine "
                                 f"holds {ours['dtype']}")
        widths = {ours.get("head_dim"), ours.get("value_dim", ours.get("head_dim"))}
        if "head_dim" in ours and H not in widths:  # keys', or a key-only cache's values
            raise PrefixMismatch(f"{who} sent kv array {i} with head_dim {H}, this engine's "
                                 f"is {ours['head_dim']}")


def pull_specs(meta: dict, devices: Sequence[jax.Device]) -> list[jax.ShapeDtypeStruct]:
    """The ShapeDtypeStructs to pull the described leaves with, on `devices`: the sender's
    mesh shape and specs over the first devices (one device for a gathered leaf)."""
    out = []
    for r in meta["leaves"]:
        if "mesh" in r:
            shape = tuple(r["mesh"]["shape"])
            n = int(np.prod(shape))
            if n > len(devices):
                raise PrefixMismatch(f"a prefix laid out over {n} devices cannot be pulled "
                                     f"onto {len(devices)}")
            mesh = Mesh(np.array(devices[:n]).reshape(shape), tuple(r["mesh"]["axes"]))
            spec = PartitionSpec(*(tuple(p) if isinstance(p, list) else p for p in r["spec"]))
            sharding = NamedSharding(mesh, spec)
        else:
            sharding = SingleDeviceSharding(devices[0])
        out.append(jax.ShapeDtypeStruct(tuple(r["shape"]), np.dtype(r["dtype"]),
                                        sharding=sharding))
    return out



def owned_pieces(x: jax.Array) -> list[tuple[jax.Device, list[list[int]]]]:
    """(device, [[start, stop] per dim]) for each distinct block of `x`, held by the
    lowest-id device that has it: every process computes the same list, in that order."""
    owners: dict[tuple, jax.Device] = {}
    placed = sorted(x.sharding.devices_indices_map(x.shape).items(), key=lambda kv: kv[0].id)
    for d, index in placed:
        key = tuple(sl.indices(n)[:2] for sl, n in zip(index, x.shape, strict=True))
        owners.setdefault(key, d)
    return [(d, [list(b) for b in key]) for key, d in owners.items()]


def describe_pieces(prefix: Any, engine: Any, sources: Sequence[str]) -> dict:
    """The description of a prefix offered block by block from each process's transfer
    server (`sources[process_index]`), see module doc."""
    leaves, pieces = [], []
    for i, x in enumerate(jax.tree.leaves(prefix)):
        leaves.append({"shape": list(x.shape), "dtype": np.dtype(x.dtype).name})
        pieces += [{"leaf": i, "source": d.process_index, "index": index}
                   for d, index in owned_pieces(x) if x.size]  # empty: made by `assemble`
    return {"leaves": leaves, "pieces": pieces, "sources": list(sources),
            "signature": signature(engine)}


def local_pieces(prefix: Any) -> list[jax.Array]:
    """This process's blocks of `prefix`, in `describe_pieces` order (single-device
    arrays, for its transfer server)."""
    me = jax.process_index()
    out = []
    for x in nonempty(jax.tree.leaves(prefix)):
        mine = {s.device: s.data for s in x.addressable_shards}
        out += [mine[d] for d, _ in owned_pieces(x) if d.process_index == me]
    return out


def piece_specs(meta: dict, source: int, device: jax.Device) -> list[jax.ShapeDtypeStruct]:
    """What to pull from process `source`: its blocks, each onto `device`."""
    one = SingleDeviceSharding(device)
    return [jax.ShapeDtypeStruct(tuple(b - a for a, b in p["index"]),
                                 np.dtype(meta["leaves"][p["leaf"]]["dtype"]), sharding=one)
            for p in meta["pieces"] if p["source"] == source]


def assemble(meta: dict, pulled: dict[int, list[jax.Array]], device: jax.Device
             ) -> list[jax.Array]:
    """The described leaves on `device`, put together from each source's pulled blocks
    (`pulled[source]`, in `piece_specs` order)."""
    taken = {source: iter(blocks) for source, blocks in pulled.items()}
    out = [jnp.zeros(tuple(r["shape"]), np.dtype(r["dtype"]), device=device)
           for r in meta["leaves"]]
    for p in meta["pieces"]:
        block = next(taken[p["source"]])
        where = tuple(slice(a, b) for a, b in p["index"])
        out[p["leaf"]] = out[p["leaf"]].at[where].set(block)
    return out
