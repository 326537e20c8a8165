"""The paged KV layout: device state, the decode-step KV store, insert, and attention.

Each layer keeps its keys and values in a pool of pages, [K, P + 1, page_size, H]
(kv head, page, offset, head dim): kv heads lead because that is the layout the TPU
paged-attention kernel reads, so one pool serves both attention paths. A key-only cache
(multi-head latent attention) has value pools of width 0, [K, P + 1, ps, 0]: attention
reads the key pool as the values (engines.attention.key_only). An int8 pool
(`EngineConfig.kv_dtype="int8"`) holds entries of H + 4 bytes (engines/kv_quant.py): the
H values quantized per token and kv head, as the contiguous cache does, then their f32
scale as 4 raw bytes. Scale and values sit in one entry, so a page is still one
slice of one array: inserts, prefix-cache blocks, a scan's stacked pools and the pool's
sharding move them together. Entries are packed where they are written
(`write_pages`) and unpacked to the model dtype where they are read (`unpack_entries`).
A prefill attends over its prompt's exact keys and insert quantizes them; a mixed step's
chunk attends over the pool, so with int8 pages it sees its own keys quantized, as its
decode steps do. Prefix-cache blocks read from int8 pages come back dequantized. Page P is
scratch ("trash"): writes of empty slots land there and reads of it are masked. Which
pages a slot holds is host bookkeeping (`jetserve.scheduling.page_pool.SlotPages`); the device gets
the page table with every step, cut to the batch's widest live sequence W (a power of
two), so a batch of short sequences gathers little and the step compiles once per W.

With the layers under a scan (engines/layer_scan.py) the state holds one stacked pool
per field, [L, K, P + 1, ps, H]; the stores write pages into it at their layer and
gather from it there (`write_pages` / `gather_pages` with a layer index), so the scan
carries the donated pools and no layer's pool is copied out or rebuilt.

Layers that see only a bounded reach back (a sliding window, Llama 4's attention chunks)
keep no pages behind it: with a `WindowRing` their pools hold a ring of `pages` pages
per slot instead of pages of the shared pool, [K, slots * pages + 1, ps, H] (the last
page trash). Position p of slot b lives in ring page b * pages + (p // ps) % pages, so
a page is written over once every position it held is out of reach of every query that
can still read it. The ring's table is a function of the slot, computed on the device
(`WindowRing.table`), with the shared table's shape: key j of a row is position j, the
positions behind the reach read whatever the ring holds now and the window mask hides
them. The host plans the shared pool only; the ring is fixed per slot.

Attention in the decode step:
  - "xla": gather the slot's W pages (pool[:, table] -> [K, B, W, ps, H]) and run the
    model's own masked attention over them; runs everywhere.
  - "pallas_tpu": jax.experimental.pallas.ops.tpu.paged_attention reads the pages in
    place; picked automatically on a one-device TPU slice when the model has no sliding
    window.
  - "cpu": engines/cpu_kernels.py `paged_decode_attention` reads each slot's live pages
    in place (a scanned model's stacked pools at the layer); picked automatically where
    the engine runs the CPU kernels (one CPU device, float32) over a float32 pool, with
    sliding windows, but no soft cap, attention sinks nor chunked attention.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from engines import cpu_kernels, layer_scan
from engines.attention import attention, key_only
from engines.config import ring_pages
from engines.kv_cache import Prefix, insert_slot_fields, put_layers
from engines.kv_quant import pack_entries, unpack_entries
from engines.sampling import SlotSampling

ATTENTION_IMPLS = ("auto", "xla", "pallas_tpu", "cpu")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedDecodeState:
    """What the paged generate step reads and writes, for all B slots."""

    k: tuple[jax.Array, ...]  # L x [K, P + 1, ps, H], or a scanned model's [L, K, P + 1, ps, H]
    v: tuple[jax.Array, ...]  # the same for values
    lengths: jax.Array  # i32[B] tokens in each slot's cache (= position of `tokens`)
    tokens: jax.Array  # i32[B] last sampled token, fed to the next step
    sampling: SlotSampling
    prompt_mask: jax.Array  # bool[B, V]
    counts: jax.Array  # i32[B, V]
    history: jax.Array  # i32[B, S] with speculative decoding, else i32[B, 0] (kv_cache)
    # The draft model's cache (speculative "draft:PATH:K"): contiguous, as in
    # kv_cache.DecodeState, following the same lengths; () without a draft model.
    draft_k: tuple[jax.Array, ...] = ()  # L_draft x [B, K_draft, H_draft, S]
    draft_v: tuple[jax.Array, ...] = ()  # L_draft x [B, K_draft, S, H_draft]


def resolve_attention(impl: str, platform: str, sliding_window: int | None,
                      num_devices: int, softcap: float | None = None,
                      kv_dtype: str = "auto", sinks: bool = False,
                      chunk: int | None = None, cpu_kernels: bool = False) -> str:
    """The attention path a paged engine uses ("auto": the kernel where it runs).

    The kernels are called on whole arrays, so they run on a one-device slice only (a
    sharded pool would need them wrapped per shard); elsewhere the gather path serves.
    They read pools of the model dtype: an int8 pool takes the gather path. They have no
    attention sinks (`sinks`: the model has them, gpt-oss), chunked attention (`chunk`,
    Llama 4) nor soft cap, nor has the mixed step's ragged kernel; the TPU kernel no
    sliding window either. `cpu_kernels`: the engine runs the CPU kernels
    (engines/backend.py: one CPU device, float32 model).
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"paged_attention must be one of {ATTENTION_IMPLS}, got {impl!r}")
    plain = (softcap is None and num_devices == 1 and kv_dtype != "int8" and not sinks
             and chunk is None)
    kernel_fits = platform == "tpu" and sliding_window is None and plain
    cpu_fits = platform == "cpu" and cpu_kernels and plain
    if impl == "auto":
        return "pallas_tpu" if kernel_fits else "cpu" if cpu_fits else "xla"
    if impl == "cpu" and not cpu_fits:
        raise ValueError(
            f"paged_attention='cpu' needs an engine on one CPU device running the CPU "
            f"kernels (float32, JETSERVE_CPU_KERNELS not 0) and a model without an "
            f"attention soft cap, attention sinks or chunked attention, over a pool that "
            f"is not int8 (got platform {platform!r}, {num_devices} devices, CPU kernels "
            f"{'on' if cpu_kernels else 'off'}, softcap={softcap}, sinks={sinks}, "
            f"attention_chunk_size={chunk}, kv_dtype={kv_dtype!r}); use 'xla' or 'auto'")
    if impl == "pallas_tpu" and not kernel_fits:
        raise ValueError(
            f"paged_attention='pallas_tpu' needs a TPU slice of one device and a model "
            f"without a sliding window, attention soft cap, attention sinks or chunked "
            f"attention, over a pool that is not int8 (got platform {platform!r}, "
            f"{num_devices} devices, sliding_window={sliding_window}, softcap={softcap}, "
            f"sinks={sinks}, attention_chunk_size={chunk}, kv_dtype={kv_dtype!r}); "
            f"use 'xla' or 'auto'")
    return impl


@dataclasses.dataclass(frozen=True)
class WindowRing:
    """Ring pages of the layers with a bounded reach (module doc). `pages` per slot:
    engines.config.ring_pages, ceil((reach + span - 1) / page_size) + 1, where span is
    the most positions one step writes for a slot (a prompt chunk, or the k + 1 of a
    speculative verify step). `layers`: per layer, whether it is in the ring."""

    pages: int
    slots: int
    layers: tuple[bool, ...]

    @staticmethod
    def plan(reaches: tuple[int | None, ...], span: int, page_size: int,
             slots: int) -> WindowRing | None:
        """The ring of a model whose layer i sees `reaches[i]` positions back (None: every
        earlier one); None where no layer has a bounded reach."""
        bounded = [r for r in reaches if r is not None]
        if not bounded:
            return None
        return WindowRing(pages=ring_pages(max(bounded), span, page_size), slots=slots,
                          layers=tuple(r is not None for r in reaches))

    @property
    def num_pages(self) -> int:
        """The ring pool's pages (its trash page aside)."""
        return self.slots * self.pages

    def holds(self, layer) -> bool:
        """Whether `layer` keeps its KV in the ring. A model whose layers differ never
        scans them (engines/layer_scan.use_scan), so a traced layer index only comes
        with layers that are all alike."""
        return all(self.layers) or (any(self.layers) and self.layers[layer])

    def table(self, width: int) -> jax.Array:
        """i32[slots, width]: the ring page of each slot's logical page j."""
        return (jnp.arange(self.slots, dtype=jnp.int32)[:, None] * self.pages
                + jnp.arange(width, dtype=jnp.int32)[None, :] % self.pages)


def pool_shape(pools: tuple[jax.Array, ...]) -> tuple[int, int, int, int]:
    """One layer's pool shape (K, P + 1, ps, entry width), whether the pools are stacked
    or not."""
    K, P1, ps, H = pools[0].shape[-4:]
    return K, P1, ps, H


class PageTables:
    """What a step's KV store writes through: the shared pool's page table and each
    written entry's page there, and the ring's for the layers in it (WindowRing)."""

    def set_tables(self, pools: tuple[jax.Array, ...], table: jax.Array,
                   ring: WindowRing | None, write_page: Callable) -> None:
        """write_page(table, trash): each new entry's page in `table` (trash where the
        step writes nothing)."""
        self.table, self.ring = table, ring
        self.write_page = write_page(table, shared_trash(pools, ring))
        if ring is not None:
            self.ring_table = ring.table(table.shape[1])
            self.ring_write_page = write_page(self.ring_table, ring.num_pages)

    def pages_of(self, layer) -> tuple[jax.Array, jax.Array]:
        """(page table, write pages) of `layer`: the ring's for a layer in the ring."""
        if self.ring is not None and self.ring.holds(layer):
            return self.ring_table, self.ring_write_page
        return self.table, self.write_page


def shared_trash(pools: tuple[jax.Array, ...], ring: WindowRing | None) -> int:
    """The shared pool's trash page (its last), read off the first layer not in the ring
    (0 where every layer is: no shared page is written then)."""
    for i, pool in enumerate(pools):
        if ring is None or not ring.holds(i):
            return pool.shape[-3] - 1
    return 0


def write_pages(pool: jax.Array, pages: jax.Array, offsets: jax.Array, new: jax.Array,
                layer: jax.Array | None = None) -> jax.Array:
    """pool [K, P+1, ps, H]; new [n, K, H] (model dtype) goes to (pages[i], offsets[i]),
    packed as the pool's entries; out-of-range page indices are dropped. With `layer`
    (i32[]), pool is a stack [L, K, P+1, ps, H] written at that layer: one scatter into
    the stack, which a scan carries in place."""
    new = pack_entries(new, pool.dtype)
    if layer is None:
        return pool.at[:, pages, offsets].set(jnp.swapaxes(new, 0, 1), mode="drop")
    # The index arrays are apart (the K slice between), so n leads the update: [n, K, H].
    return pool.at[layer, :, pages, offsets].set(new, mode="drop")


def gather_pages(pool: jax.Array, table: jax.Array, dtype,
                 layer: jax.Array | None = None) -> jax.Array:
    """pool [K, P+1, ps, H], table i32[B, W] -> [B, W * ps, K, H] in `dtype` (each slot's
    keys in position order, an int8 pool's dequantized). With `layer`, pool is a stack
    [L, K, P+1, ps, H] read at that layer by one gather (no copy of the layer's pool)."""
    K, _, ps, H = pool.shape[-4:]
    B, W = table.shape
    if layer is None:
        g = jnp.take(pool, table, axis=1)  # (K, B, W, ps, H)
        g = jnp.transpose(g.reshape(K, B, W * ps, H), (1, 2, 0, 3))
    else:
        g = pool[layer, :, table]  # (B, W, K, ps, H): the index arrays' axes lead
        g = jnp.transpose(g, (0, 1, 3, 2, 4)).reshape(B, W * ps, K, H)
    return unpack_entries(g, dtype)


class PagedDecodeKV(layer_scan.StackedStore, PageTables):
    """KVStore of the paged decode step: write each slot's new k, v into its page, then
    attend over its live pages (gathered, or read in place by the kernel). Under a scan
    over layers the stacked pools are the loop's carry (layer_scan.StackedStore)."""

    def __init__(self, state: PagedDecodeState, table: jax.Array, pos: jax.Array,
                 live: jax.Array, impl: str, ring: WindowRing | None = None):
        self.state = state  # table i32[B, W]
        # i32[B]: where this step's token goes; i32[B, T]: T consecutive positions per
        # slot (speculative verification, with the "xla" attention path only).
        self.pos, self.live = pos, live
        self.impl = impl
        ps = pool_shape(state.k)[2]
        self.page_size = ps
        idx = pos // ps
        W = table.shape[1]
        in_table = (live if pos.ndim == 1 else live[:, None]) & (idx < W)

        def write_page(table, trash):  # (B,) or (B, T)
            at = jnp.minimum(idx, W - 1)
            page = (jnp.take_along_axis(table, at[:, None], 1)[:, 0] if pos.ndim == 1
                    else jnp.take_along_axis(table, at, 1))
            return jnp.where(in_table, page, trash)

        self.set_tables(state.k, table, ring, write_page)
        self.write_off = pos % ps
        self.k: list[jax.Array] = []
        self.v: list[jax.Array] = []

    @property
    def attend(self):
        """The model attends through this when a store offers one (None: it attends over
        what `update` returns, else those gathers are unused and XLA drops them). A
        property, so a scanned layer's copy of the store (layer_scan) attends over its
        own pools."""
        return {"pallas_tpu": self._kernel_attend, "cpu": self._cpu_attend}.get(self.impl)

    def update(self, layer, k, v):
        table, page = self.pages_of(layer)
        if self.pos.ndim == 1:
            off, k, v, last = self.write_off, k[:, 0], v[:, 0], self.pos
        else:  # [B, T] new entries, written as B * T
            flat = lambda x: x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])  # 0-wide v too
            page, off, k, v = map(flat, (page, self.write_off, k, v))
            last = self.pos[:, -1]
        k_pool = write_pages(self.state.k[layer], page, off, k, self.at)
        v_pool = write_pages(self.state.v[layer], page, off, v, self.at)
        self.k.append(k_pool)
        self.v.append(v_pool)
        k_all = gather_pages(k_pool, table, k.dtype, self.at)
        v_all = gather_pages(v_pool, table, v.dtype, self.at)
        j = jnp.arange(k_all.shape[1])[None, :]
        k_pos = jnp.where(j <= last[:, None], j, -1)  # (B, W * ps)
        return k_all, v_all, k_pos

    def _kernel_attend(self, layer, q, positions, sliding_window, softcap=None, sinks=None,
                       chunk=None):
        """Attention of this step's queries q [B, 1, N, H], read in place by the kernel
        (after `update(layer)`); the model calls it instead of its own attention."""
        # positions are pos; no window, soft cap nor sinks (resolve_attention)
        del positions, sliding_window, softcap
        if sinks is not None:
            raise ValueError("paged_attention 'pallas_tpu' takes no attention sinks (a "
                             "gpt-oss model); use 'xla'")
        if chunk is not None:
            raise ValueError("paged_attention 'pallas_tpu' takes no chunked attention (a "
                             "Llama 4 model); use 'xla'")
        # Under a scan the kernel gets the layer's pools sliced out: it takes no layer
        # index (TODO(#21): a pool layout the kernel can read at a layer in place).
        k_pool = self.layer_of(self.k, layer)
        v_pool = self.layer_of(self.v, layer)
        return pallas_decode_attention(q, k_pool, k_pool if key_only(v_pool) else v_pool,
                                       self.table, self.pos + 1)

    def _cpu_attend(self, layer, q, positions, sliding_window, softcap=None, sinks=None,
                    chunk=None):
        """The CPU kernel's attention of q [B, 1, N, H] over the layer's pages, read in
        place (a scanned model's stacked pools at the layer); no soft cap, sinks nor
        chunked attention (resolve_attention)."""
        del positions, softcap, sinks, chunk
        table = self.pages_of(layer)[0]
        k_pool, v_pool = self.k[layer], self.v[layer]
        live_pos = jnp.where(self.live, self.pos, -1)
        return cpu_kernels.paged_decode_attention(
            q, k_pool, k_pool if key_only(v_pool) else v_pool, table, live_pos,
            sliding_window, layer=self.at)


def xla_decode_attention(q, k_pool, v_pool, table, lengths):
    """Reference paged attention: q [B, N, H], pools [K, P+1, ps, H], table i32[B, W],
    lengths i32[B] (keys 0..length-1 are visible) -> [B, N, H]."""
    k_all = gather_pages(k_pool, table, q.dtype)
    v_all = gather_pages(v_pool, table, q.dtype)
    j = jnp.arange(k_all.shape[1])[None, :]
    k_pos = jnp.where(j < lengths[:, None], j, -1)
    out = attention(q[:, None], k_all, v_all, (lengths - 1)[:, None], k_pos, None)
    return out[:, 0]


def pallas_decode_attention(q, k_pool, v_pool, table, lengths):
    """The TPU kernel over the same pools: q [B, 1, N, H] -> [B, 1, N, H]."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    H = q.shape[-1]
    W = table.shape[1]
    # The kernel does not scale the logits itself.
    scaled = (q[:, 0].astype(jnp.float32) / math.sqrt(H)).astype(q.dtype)
    out = paged_attention(scaled, k_pool, v_pool, lengths.astype(jnp.int32), table,
                          pages_per_compute_block=math.gcd(W, 8))
    return out[:, None].astype(q.dtype)


def insert_paged(prefix: Prefix, state: PagedDecodeState, slot: jax.Array,
                 pages: jax.Array, ring: WindowRing | None = None) -> PagedDecodeState:
    """Scatters a prefix into the pages the host gave its slot (pages i32[ceil(T/ps)],
    in position order; entries past the shared pool are not written); other slots' pages
    and rows are untouched. Stacked pools (a scanned model's) take every layer in one
    batched scatter. Layers in the `ring` take the positions of the prefix's last
    ring.pages pages into the slot's ring (those before are out of reach)."""
    ps = pool_shape(state.k)[2]
    kp = prefix.k_pos[0]  # (T,)
    valid = kp >= 0
    safe = jnp.where(valid, kp, 0)
    drop = shared_trash(state.k, ring) + 1  # past the pool: dropped
    page = jnp.where(valid, pages[jnp.minimum(safe // ps, pages.shape[0] - 1)], drop)
    off = safe % ps

    def put(pool, new):  # new [1, T, K, H]
        return write_pages(pool, page, off, new[0])

    put_of = lambda layer: put  # noqa: E731
    if ring is not None:
        logical = safe // ps
        kept = valid & (logical > (prefix.length - 1) // ps - ring.pages)
        ring_page = jnp.where(kept, slot * ring.pages + logical % ring.pages,
                              ring.num_pages + 1)

        def put_ring(pool, new):
            return write_pages(pool, ring_page, off, new[0])

        put_of = lambda layer: put_ring if ring.holds(layer) else put  # noqa: E731

    def put_each(caches, news):
        if layer_scan.is_stacked(caches, news[0].ndim):  # layers alike: one scatter
            return put_layers(put_of(0), caches, news)
        return tuple(put_of(i)(c, n) for i, (c, n) in enumerate(zip(caches, news, strict=True)))

    return PagedDecodeState(
        k=put_each(state.k, prefix.k),
        v=put_each(state.v, prefix.v),
        **insert_slot_fields(state, prefix, slot),
    )
