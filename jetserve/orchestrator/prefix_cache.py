"""Prefix cache: a trie over blocks of prompt tokens, each node holding its block's KV once.

One trie per cache key (a digest of the model, the tokenizer and the chat template, so a
change of any never serves stale KV). A node is one block of `block` tokens below its
parent's and holds that block's KV (engines/prefix_blocks.py), whichever prompt put it
there: a system prompt shared by many prompts is stored once.

Tiers: a node's KV is on the device ("hbm") or on the host ("host": numpy [L, 2, b, K, H];
of an engine over several processes, each process's own shards of it, `LocalShards`).
The device tier is one of two stores (jetserve/orchestrator/prefix_stores.py):
  - `PageStore`: pages of the engine's own KV pool, when one paged engine prefills and
    generates (interleaved). A node holds one reference to its page, taken through the
    generate worker's KV-cache manager (jetserve/scheduling); a request that hits links
    the same pages into its slot, so nothing is copied. The block is the page size, and only whole pages are cached: the partial last
    page of a prompt stays the slot's own, so a shared page is never written.
  - `ArrayStore`: one device array per node on the prefill engine (contiguous engines,
    prefill on another slice than generate, a paged engine whose sliding layers keep
    rings of pages, several processes).
Budgets: each tier holds at most its bytes' worth of blocks. Past them, least recently
used first and leaves before their parents: a device node whose children are all on the
host moves to the host, a host node without children is dropped. A node is pinned from
the lookup that found it to that request's release, and is not moved or dropped meanwhile.

Flow (prefill_worker.py, generate_worker.py):
  - `lookup` (prefill thread): the longest cached whole-block prefix of a prompt, short of
    its last token, pinned, with a snapshot of where its blocks are (`Hit`);
  - `existing_prefix(hit)`: those blocks as a Prefix; the prefill continues it;
  - array store: `insert(hit, prefix)` after the prefill caches the prompt's new whole
    blocks (cut from the prefix), then `hit.release()`;
  - page store: the generate thread inserts the prefix into a slot that links the hit's
    device pages, then `adopt(hit, slot_pages)`: the prompt's whole pages become nodes (a
    reference more each, no copy) and host nodes on its path move back up into the slot's
    fresh pages; this releases the hit. `make_room(n)` frees pages only the cache holds,
    for admission, before anything waits or is preempted.

Events (kv_events.py): with `events` set (an EventSink), every block stored, moved between
tiers, dropped or cleared is published as vLLM's KV events, each node carrying its block
hash; emitted under the lock, in the order the trie changed.

Concurrency: one lock guards the trie. With a page store, every call that changes pages
(adopt, make_room, clear) runs on the generate thread, which owns the pool and the decode
state; the prefill thread only looks up, reads pages (`read_pages` takes the generate
worker's state lock) and releases.

Several processes (an engine whose mesh spans them: orchestrator/lockstep.py,
disagg/prefill_lockstep.py): every process keeps a cache of its own, an array store, and
calls it with the same arguments in the same order (the broadcast plan's admissions, in
plan order, lookups with no wait). Nothing in the trie depends on anything else (no
clock, no thread), so the tries stay identical by construction and every process takes
the same hit decision; each holds its own shards of the blocks (device arrays over the
global mesh; on the host, `LocalShards`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from jetserve.orchestrator import kv_events as ev
from jetserve.orchestrator.prefix_stores import ArrayStore, PageStore

TIERS = ("hbm", "host")


def cache_key(*parts: object) -> str:
    """A short digest of what the cached KV depends on (model, tokenizer, chat template)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


@dataclasses.dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]
    parent: _Node | None
    tier: str  # "hbm", "host", or "root"
    children: dict[tuple[int, ...], _Node] = dataclasses.field(default_factory=dict)
    page: int | None = None  # device tier of a page store
    kv: Any = None  # device tier of an array store (a device block); host tier (numpy)
    pins: int = 0
    used: int = 0  # the LRU clock when last used
    hash: int = 0  # names the prefix up to this block (kv_events.block_hash)


class Hit:
    """The cached part of one prompt: its first `tokens` tokens, in `pages` (the device
    pages of a page store, leading) then `blocks` (a block each for the rest: device arrays
    of an array store, numpy of the host tier). Pinned until `release()`."""

    def __init__(self, cache: PrefixCache, key: str, sequence: Sequence[int],
                 nodes: list[_Node]):
        self._cache, self._nodes, self._released = cache, nodes, False
        self.key, self.sequence = key, sequence
        self.whole_blocks = cache._blocks(sequence, len(sequence))
        self.tokens = len(nodes) * cache.block
        self.pages = [n.page for n in itertools.takewhile(lambda n: n.page is not None, nodes)]
        self.blocks = [n.kv for n in nodes[len(self.pages):]]

    def release(self) -> None:
        """Unpins (once; later calls do nothing)."""
        if not self._released:
            self._released = True
            self._cache._unpin(self, self._nodes)


class PrefixCache:
    """See the module docstring.

    Args:
      store: the device tier (PageStore or ArrayStore); its block is the cache's.
      hbm_bytes / host_bytes: budgets of the two tiers (0: that tier holds nothing).
    """

    def __init__(self, *, store: ArrayStore | PageStore, hbm_bytes: int, host_bytes: int):
        if hbm_bytes < 0 or host_bytes < 0 or hbm_bytes + host_bytes == 0:
            raise ValueError(f"prefix cache budgets must be >= 0 and not both 0, got "
                             f"hbm {hbm_bytes} and host {host_bytes} bytes")
        self.store, self.block = store, store.block
        self.hbm_budget, self.host_budget = hbm_bytes, host_bytes
        self.max_blocks = {"hbm": hbm_bytes // store.block_bytes,
                           "host": host_bytes // store.block_bytes}
        self._roots: dict[str, _Node] = {}
        self._tier: dict[str, set[_Node]] = {t: set() for t in TIERS}
        self._clock = itertools.count(1)
        self._counts = collections.Counter()
        self._lock = threading.Lock()
        self._adopted = threading.Condition(self._lock)
        self._handed_on: set[Hit] = set()  # page store: hits on their way to adopt
        self.events: ev.EventSink | None = None  # KV events, when published

    @property
    def pages(self) -> bool:
        """Whether the device tier is the engine's KV pages."""
        return self.store.in_pages

    # ---- the prefill thread's calls ------------------------------------------------------

    def lookup(self, key: str, tokens: Sequence[int], wait_s: float = 0.0, *,
               count: bool = True) -> Hit:
        """The longest cached whole-block prefix of `tokens` short of the last token
        (possibly none: hit.tokens == 0), pinned until hit.release().

        wait_s: how long to wait for a request handed on earlier (`hand_on`) to have its
        pages adopted, when they would make this hit longer (requests through one system
        prompt arriving together: the second should not recompute what the first's insert
        is about to cache).
        count: counts the lookup in the stats now; else `counted(hit)` does once the hit
        is used (a mixed step's admission may look a waiting prompt up again and again).
        """
        blocks = self._blocks(tokens, len(tokens) - 1)
        end = time.monotonic() + wait_s
        with self._lock:
            while True:
                path = self._walk(key, blocks)
                if not self._would_extend(key, blocks, len(path)):
                    break
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._adopted.wait(left)
            for n in path:
                n.pins += 1
            self._touch(path)
            if count:
                self._count(len(tokens), path)
            up = [n for n in path if n.tier == "host"]
            if up and self.store.moves_up_on_lookup:
                for n in up:
                    self._move(n, "hbm", kv=self.store.to_device(n.kv))
                self._counts["restored"] += len(up)
                self._evict()
            return Hit(self, key, tokens, path)

    def counted(self, hit: Hit) -> None:
        """Counts a lookup made with count=False in the stats (once per hit)."""
        with self._lock:
            self._count(len(hit.sequence), hit._nodes)

    def existing_prefix(self, hit: Hit, tokens: Sequence[int]) -> Any:
        """The hit's blocks as a Prefix of tokens[:hit.tokens] (hit.tokens > 0)."""
        return self.store.existing_prefix(hit, tokens)

    def insert(self, hit: Hit, prefix: Any) -> None:
        """Array store: caches the whole blocks of hit.sequence that are not cached yet,
        cut from `prefix` (its prefill)."""
        blocks = hit.whole_blocks
        with self._lock:
            node, path = self._root(hit.key), []
            for i, b in enumerate(blocks):
                child = node.children.get(b)
                if child is None:
                    new = self.store.blocks_of(prefix, i, len(blocks) - i)
                    for b2, kv in zip(blocks[i:], new, strict=True):
                        node = self._add(node, b2, kv=kv)
                        path.append(node)
                    break
                node = child
                path.append(node)
            self._touch(path)
            self._evict()

    def hand_on(self, hit: Hit) -> None:
        """Page store: the hit travels with its request to the generate thread, to adopt."""
        with self._lock:
            self._handed_on.add(hit)

    # ---- the generate thread's calls (page store) ----------------------------------------

    def adopt(self, hit: Hit, pages: Sequence[int]) -> None:
        """After the hit's request was inserted into a slot holding `pages` (in position
        order): its sequence's whole pages become nodes; host nodes on the way move up
        into those pages (unless the device budget is 0). Releases the hit."""
        blocks = hit.whole_blocks
        with self._lock:
            node, path = self._root(hit.key), []
            for b, page in zip(blocks, pages, strict=False):
                child = node.children.get(b)
                if child is None:
                    child = self._add(node, b, page=page)
                    self.store.hold(page)
                elif child.tier == "host" and self.max_blocks["hbm"]:
                    self._move(child, "hbm", page=page)
                    self.store.hold(page)
                    self._counts["restored"] += 1
                node = child
                path.append(node)
            self._touch(path)
        hit.release()
        with self._lock:
            self._evict()
            self._adopted.notify_all()

    def make_room(self, pages: int) -> int:
        """Moves down (or drops) least recently used device nodes whose page nobody else
        holds until `pages` pages are free or none is left to move; returns pages freed."""
        with self._lock:
            return self._demote(pages, sole=True)

    def page_owners(self) -> dict[object, list[int]]:
        """The pages the cache holds, by node (for SlotPages.check)."""
        with self._lock:
            return {("prefix cache", id(n)): [n.page] for n in self._tier["hbm"]
                    if n.page is not None}

    def clear(self) -> None:
        """Drops every node (their pages go back to the pool); on the generate thread, or
        after it ended."""
        with self._lock:
            events, self.events = self.events, None  # one AllBlocksCleared says it all
            try:
                for root in self._roots.values():
                    for child in list(root.children.values()):
                        self._drop(child)
            finally:
                self.events = events
            self._roots.clear()
            self._emit(ev.CLEARED)
            for h in self._handed_on:  # their pages are gone: insert all of their prefix
                h.pages = []

    # ---- any thread ----------------------------------------------------------------------

    def stats(self) -> dict:
        with self._lock:
            c = dict(self._counts)
            out = {k: c.get(k, 0) for k in ("lookups", "hits", "host_hits", "hit_tokens",
                                            "lookup_tokens", "inserted", "evicted_to_host",
                                            "restored", "dropped")}
            for t in TIERS:
                n = len(self._tier[t])
                out.update({f"{t}_blocks": n, f"{t}_bytes": n * self.store.block_bytes})
            out.update(hbm_budget=self.hbm_budget, host_budget=self.host_budget,
                       block=self.block, device_store="pages" if self.pages else "arrays")
        out["hit_rate"] = out["hits"] / out["lookups"] if out["lookups"] else 0.0
        return out

    def blocks(self) -> dict[int, tuple[str, tuple[int, ...]]]:
        """{block hash: (tier, the block's tokens)} of every node (what KV events tell)."""
        with self._lock:
            return {n.hash: (t, n.tokens) for t in TIERS for n in self._tier[t]}

    def nodes(self) -> list[tuple[str, int, str, int]]:
        """(key, depth in blocks, tier, pins) of every node."""
        out = []
        with self._lock:
            for key, root in self._roots.items():
                stack = [(c, 1) for c in root.children.values()]
                while stack:
                    n, d = stack.pop()
                    out.append((key, d, n.tier, n.pins))
                    stack.extend((c, d + 1) for c in n.children.values())
        return sorted(out)

    # ---- internals (under the lock) ------------------------------------------------------

    def _blocks(self, tokens: Sequence[int], limit: int) -> list[tuple[int, ...]]:
        """The whole blocks of tokens[:limit]."""
        n = max(limit, 0) // self.block
        t = [int(x) for x in tokens[: n * self.block]]
        return [tuple(t[i * self.block:(i + 1) * self.block]) for i in range(n)]

    def _count(self, tokens: int, path: list[_Node]) -> None:
        """A lookup of `tokens` tokens that found `path` (before any moved up)."""
        self._counts["lookups"] += 1
        self._counts["lookup_tokens"] += tokens
        if path:
            self._counts["hits"] += 1
            self._counts["hit_tokens"] += len(path) * self.block
            if any(n.tier == "host" for n in path):
                self._counts["host_hits"] += 1

    def _touch(self, path: list[_Node]) -> None:
        # Deeper nodes count as older: a leaf goes before its parent.
        for n in reversed(path):
            n.used = next(self._clock)

    def _root(self, key: str) -> _Node:
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = _Node((), None, "root", hash=ev.root_hash(key))
        return root

    def _add(self, parent: _Node, tokens: tuple[int, ...], **where) -> _Node:
        node = _Node(tokens, parent, "hbm", hash=ev.block_hash(parent.hash, tokens), **where)
        parent.children[tokens] = node
        self._tier["hbm"].add(node)
        self._counts["inserted"] += 1
        self._stored(node)
        return node

    def _move(self, node: _Node, tier: str, **where) -> None:
        self._tier[node.tier].discard(node)
        self._tier[tier].add(node)
        self._emit(ev.removed([node.hash], ev.MEDIUM[node.tier]))
        node.tier, node.page, node.kv = tier, where.get("page"), where.get("kv")
        self._stored(node)

    def _stored(self, node: _Node) -> None:
        if self.events is not None:
            self._emit(ev.node_stored(node, self.block))

    def _emit(self, event: list) -> None:
        if self.events is not None:
            self.events.emit([event])

    def _walk(self, key: str, blocks: list[tuple[int, ...]]) -> list[_Node]:
        node, path = self._roots.get(key), []
        for b in blocks:
            node = node.children.get(b) if node is not None else None
            if node is None:
                break
            path.append(node)
        return path

    def _would_extend(self, key: str, blocks: list[tuple[int, ...]], cached: int) -> bool:
        """Whether a handed-on hit shares more than `cached` leading blocks with `blocks`."""
        for h in self._handed_on:
            if h.key == key and len(h.whole_blocks) > cached and cached < len(blocks) \
                    and h.whole_blocks[cached] == blocks[cached]:
                return True
        return False

    def _unpin(self, hit: Hit, nodes: list[_Node]) -> None:
        with self._lock:
            self._handed_on.discard(hit)
            self._adopted.notify_all()
            for n in nodes:
                n.pins -= 1
            if not self.pages:  # a page store moves pages on the generate thread only
                self._evict()

    def _evict(self) -> None:
        over = len(self._tier["hbm"]) - self.max_blocks["hbm"]
        if over > 0:
            self._demote(over, sole=False)
        while len(self._tier["host"]) > self.max_blocks["host"]:
            leaves = [n for n in self._tier["host"] if not n.pins and not n.children]
            if not leaves:
                break
            self._drop(min(leaves, key=lambda n: n.used))

    def _demote(self, count: int, sole: bool) -> int:
        """Moves up to `count` device nodes down (least recently used leaves of the device
        tier first; with `sole`, only nodes whose page the cache alone holds)."""
        chosen: list[_Node] = []
        picked: set[_Node] = set()
        while len(chosen) < count:
            ok = [n for n in self._tier["hbm"] if n not in picked and not n.pins
                  and not any(c.tier == "hbm" and c not in picked for c in n.children.values())
                  and (not sole or self.store.sole_holder(n))]
            if not ok:
                break
            n = min(ok, key=lambda n: n.used)
            chosen.append(n)
            picked.add(n)
        if not chosen:
            return 0
        if self.max_blocks["host"]:
            host = self.store.to_host(chosen)
            self.store.free(chosen)
            for n, h in zip(chosen, host, strict=True):
                self._move(n, "host", kv=h)
            self._counts["evicted_to_host"] += len(chosen)
            self._evict()  # the host tier may be over its budget now
        else:
            for n in chosen:
                self._drop(n)
        return len(chosen)

    def _drop(self, node: _Node) -> None:
        """Removes a node and everything below it."""
        for child in list(node.children.values()):
            self._drop(child)
        if node.tier == "hbm":
            self.store.free([node])
        self._tier[node.tier].discard(node)
        del node.parent.children[node.tokens]
        self._counts["dropped"] += 1
        self._emit(ev.removed([node.hash], ev.MEDIUM[node.tier]))


def model_cache_key(model: str | None, model_config: Any) -> str:
    """The cache key of a served model: its name or directory, its config, and the
    contents of its tokenizer and chat-template files (hashed)."""
    parts: list[object] = [model, model_config]
    if model and os.path.isdir(model):
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                     "chat_template.jinja", "chat_template.json"):
            path = os.path.join(model, name)
            if os.path.exists(path):
                with open(path, "rb") as f:
                    parts.append((name, hashlib.sha256(f.read()).hexdigest()))
    return cache_key(*parts)
