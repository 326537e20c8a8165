"""Prefix cache: prompt prefixes -> their prefill KV, in device memory and in host memory.

A trie over blocks of `block` tokens, one per cache key (a digest of the model, the
tokenizer and the chat template, so a change of any never serves stale KV). Each node
lists the entries whose prompt passes through it; an entry is one prefill's `Prefix`
(its KV for every token of a prompt), usable for any whole-block part of that prompt.
A lookup walks the trie down the new prompt's blocks and returns the deepest hit, cut to
that many tokens by the engine (`prefix_head`), leaving at least one token to prefill:
the prefill thread then prefills only the suffix (`existing_prefix`).

Tiers: entries live on the device ("hbm") within `hbm_bytes`; the least recently used
one past that budget moves to host memory (numpy, within `host_bytes`) and past that is
dropped. A hit on a host entry moves it back to the device. An entry is pinned while a
prefill uses it, so it is not moved meanwhile.

Concurrency: every prefill thread calls lookup / release / insert; one lock guards all.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax


def cache_key(*parts: object) -> str:
    """A short digest of what the cached KV depends on (model, tokenizer, chat template)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


@dataclasses.dataclass(eq=False)
class _Entry:
    key: str
    blocks: tuple[tuple[int, ...], ...]  # the prompt's whole blocks
    prefix: Any  # device Prefix, or its host (numpy) copy when tier == "host"
    nbytes: int
    tier: str = "hbm"
    pins: int = 0


@dataclasses.dataclass(eq=False)
class _Node:
    children: dict[tuple[int, ...], _Node] = dataclasses.field(default_factory=dict)
    entries: set[_Entry] = dataclasses.field(default_factory=set)


class Hit:
    """A cached prefix for the first `tokens` tokens of a prompt; `release()` when done."""

    def __init__(self, cache: PrefixCache, entry: _Entry, prefix: Any, tokens: int):
        self._cache, self._entry = cache, entry
        self.prefix, self.tokens = prefix, tokens

    def release(self) -> None:
        self._cache._unpin(self._entry)


class PrefixCache:
    """See the module docstring.

    Args:
      block: tokens per trie edge; a hit covers whole blocks only.
      hbm_bytes / host_bytes: budgets of the two tiers (0: that tier holds nothing).
      to_device: puts a host copy of a Prefix back where the prefill engine reads it.
      head: head(prefix, n, tokens) -> the prefix cut to its first n tokens.
    """

    def __init__(self, *, block: int, hbm_bytes: int, host_bytes: int,
                 to_device: Callable[[Any], Any], head: Callable[[Any, int, Sequence[int]], Any]):
        if block < 1:
            raise ValueError(f"prefix cache block must be >= 1 token, got {block}")
        if hbm_bytes < 0 or host_bytes < 0 or hbm_bytes + host_bytes == 0:
            raise ValueError(f"prefix cache budgets must be >= 0 and not both 0, got "
                             f"hbm {hbm_bytes} and host {host_bytes} bytes")
        self.block, self.hbm_budget, self.host_budget = block, hbm_bytes, host_bytes
        self._to_device, self._head = to_device, head
        self._roots: dict[str, _Node] = {}
        self._lru: collections.OrderedDict[_Entry, None] = collections.OrderedDict()
        self._bytes = {"hbm": 0, "host": 0}
        self._counts = collections.Counter()
        self._lock = threading.Lock()

    # ---- the prefill thread's calls ------------------------------------------------------

    def lookup(self, key: str, tokens: Sequence[int]) -> Hit | None:
        """The longest cached whole-block prefix of `tokens` (short of the last token)."""
        blocks = self._blocks(tokens, len(tokens) - 1)
        with self._lock:
            self._counts["lookups"] += 1
            self._counts["lookup_tokens"] += len(tokens)
            node, best, depth = self._roots.get(key), None, 0
            for i, b in enumerate(blocks):
                node = node.children.get(b) if node is not None else None
                if node is None or not node.entries:
                    break
                best, depth = node, i + 1
            if best is None:
                return None
            entry = max(best.entries, key=lambda e: e.tier == "hbm")
            entry.pins += 1
            self._lru.move_to_end(entry)
            if entry.tier == "host":
                self._bytes["host"] -= entry.nbytes
                entry.prefix, entry.tier = self._to_device(entry.prefix), "hbm"
                self._bytes["hbm"] += entry.nbytes
                self._counts["host_hits"] += 1
            self._counts["hits"] += 1
            n = depth * self.block
            self._counts["hit_tokens"] += n
            self._evict()
            prefix = entry.prefix
        return Hit(self, entry, self._head(prefix, n, tokens[:n]), n)

    def insert(self, key: str, tokens: Sequence[int], prefix: Any) -> None:
        """Caches a prefill's prefix for the whole blocks of `tokens` (unless a cached
        entry already covers them)."""
        blocks = self._blocks(tokens, len(tokens))
        if not blocks:
            return
        nbytes = sum(int(x.nbytes) for x in jax.tree.leaves(prefix))
        with self._lock:
            node = self._roots.setdefault(key, _Node())
            path = []
            for b in blocks:
                node = node.children.setdefault(b, _Node())
                path.append(node)
            if node.entries:  # as deep as an existing entry: keep that one
                self._lru.move_to_end(next(iter(node.entries)))
                return
            entry = _Entry(key, blocks, prefix, nbytes)
            for n in path:
                n.entries.add(entry)
            self._lru[entry] = None
            self._bytes["hbm"] += nbytes
            self._counts["inserted"] += 1
            self._evict()

    def stats(self) -> dict:
        with self._lock:
            c = dict(self._counts)
            tiers = collections.Counter(e.tier for e in self._lru)
            out = {f"{k}": c.get(k, 0) for k in ("lookups", "hits", "host_hits", "hit_tokens",
                                                 "lookup_tokens", "inserted", "evicted_to_host",
                                                 "dropped")}
            out.update(hbm_bytes=self._bytes["hbm"], host_bytes=self._bytes["host"],
                       hbm_entries=tiers["hbm"], host_entries=tiers["host"],
                       hbm_budget=self.hbm_budget, host_budget=self.host_budget)
        out["hit_rate"] = out["hits"] / out["lookups"] if out["lookups"] else 0.0
        return out

    # ---- internals (under the lock) ------------------------------------------------------

    def _blocks(self, tokens: Sequence[int], limit: int) -> list[tuple[int, ...]]:
        """The whole blocks of tokens[:limit]."""
        n = max(limit, 0) // self.block
        t = [int(x) for x in tokens[: n * self.block]]
        return [tuple(t[i * self.block:(i + 1) * self.block]) for i in range(n)]

    def _unpin(self, entry: _Entry) -> None:
        with self._lock:
            entry.pins -= 1
            self._evict()

    def _evict(self) -> None:
        """Least recently used first: device entries past the budget go to the host, host
        entries past its budget are dropped. Pinned entries stay where they are."""
        for entry in list(self._lru):
            if self._bytes["hbm"] <= self.hbm_budget:
                break
            if entry.tier == "hbm" and not entry.pins:
                self._bytes["hbm"] -= entry.nbytes
                if entry.nbytes <= self.host_budget:
                    entry.prefix, entry.tier = jax.device_get(entry.prefix), "host"
                    self._bytes["host"] += entry.nbytes
                    self._counts["evicted_to_host"] += 1
                else:
                    self._drop(entry)
        for entry in list(self._lru):
            if self._bytes["host"] <= self.host_budget:
                break
            if entry.tier == "host" and not entry.pins:
                self._bytes["host"] -= entry.nbytes
                self._drop(entry)

    def _drop(self, entry: _Entry) -> None:
        del self._lru[entry]
        self._counts["dropped"] += 1
        node, path = self._roots[entry.key], []
        for b in entry.blocks:
            path.append((node, b))
            node = node.children[b]
            node.entries.discard(entry)
        for parent, b in reversed(path):  # prune nodes no entry passes through any more
            if parent.children[b].entries:
                break
            del parent.children[b]

    def entries(self) -> list[tuple[str, str, int]]:
        """(key, tier, blocks) of every entry, least recently used first."""
        with self._lock:
            return [(e.key, e.tier, len(e.blocks)) for e in self._lru]


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
