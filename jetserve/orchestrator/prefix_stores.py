"""Where a prefix cache's device tier keeps its blocks (jetserve/orchestrator/prefix_cache.py
holds the trie and calls these):

  - `ArrayStore`: one device array per block, on the prefill engine (contiguous engines,
    split roles, an engine whose layers keep rings of pages, several processes);
  - `PageStore`: pages of a paged engine's own KV pool, linked into the slots that hit;
  - `LocalShards`: the host tier of a block that spans several processes, this process's
    own shards of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jetserve.scheduling.kv_cache_manager import KVCacheManager

# A store's calls take the trie's nodes and hits (prefix_cache.Any, prefix_cache.Hit),
# typed Any here: the trie imports the stores, not the other way.

def block_bytes(engine: Any, block: int) -> int:
    """Bytes of one block's KV on `engine` (all layers, keys and values; keys only for a
    key-only cache)."""
    return block * engine.model_config.kv_bytes_per_token(np.dtype(engine.dtype).itemsize)


class LocalShards:
    """The host tier of a device block that spans several processes (an engine over
    several processes, lockstep.py): this process's own shards of it (numpy, one per
    distinct index), and where each goes back. Every process keeps its part; none holds
    the whole block."""

    def __init__(self, block: jax.Array):
        self.shape, self.sharding = block.shape, block.sharding
        self.parts: dict[str, np.ndarray] = {}
        self.where: list[tuple[Any, str]] = []  # (device, key of its part)
        for shard in block.addressable_shards:
            key = repr(shard.index)
            if key not in self.parts:
                self.parts[key] = np.asarray(shard.data)
            self.where.append((shard.device, key))

    def to_device(self) -> jax.Array:
        arrays = [jax.device_put(self.parts[key], d) for d, key in self.where]
        return jax.make_array_from_single_device_arrays(self.shape, self.sharding, arrays)


class ArrayStore:
    """Device tier as one device array per node, on the prefill engine."""

    in_pages = False
    moves_up_on_lookup = True  # a host hit comes back to the device at once

    def __init__(self, engine: Any, block: int):
        self.engine, self.block = engine, block
        self.block_bytes = block_bytes(engine, block)
        self._sharding = engine.cache_block_sharding()

    def blocks_of(self, prefix: Any, first: int, n: int) -> list[Any]:
        return self.engine.cache_blocks(prefix, first, n, self.block)

    def to_device(self, host: Any) -> Any:
        if isinstance(host, LocalShards):
            return host.to_device()
        return jax.device_put(host, self._sharding)

    def to_host(self, nodes: list[Any]) -> list[Any]:
        blocks = [n.kv for n in nodes]
        if all(b.is_fully_addressable for b in blocks):
            return jax.device_get(blocks)
        return [LocalShards(b) for b in blocks]  # an engine over several processes

    def free(self, nodes: list[Any]) -> None:
        for n in nodes:
            n.kv = None

    def existing_prefix(self, hit: Any, tokens: Sequence[int]) -> Any:
        stack = self.engine.stack_blocks(hit.blocks)
        return self.engine.prefix_from_blocks(stack, tokens[:hit.tokens])


class PageStore:
    """Device tier as pages of a paged engine's own pool (generate-thread calls aside from
    `existing_prefix`, see the module doc). read_pages(pages) -> their blocks, a device
    stack (engine.page_blocks under the generate worker's state lock)."""

    in_pages = True
    moves_up_on_lookup = False  # host blocks come back in the slot's pages, at adopt

    def __init__(self, engine: Any, read_pages: Callable[[list[int]], Any],
                 kv: KVCacheManager | None = None):
        self.engine, self.read_pages = engine, read_pages
        # Holding a page is the KV-cache manager's business: the generate worker's own,
        # so its admission counts the cache's pages.
        self.kv = kv if kv is not None else KVCacheManager(engine.kv_pages)
        self.block = self.kv.page_size
        self.block_bytes = block_bytes(engine, self.block)

    def hold(self, page: int) -> None:
        self.kv.share([page])

    def sole_holder(self, node: Any) -> bool:
        return self.kv.sole_holder(node.page)

    def to_host(self, nodes: list[Any]) -> list[np.ndarray]:
        stack = np.asarray(jax.device_get(self.read_pages([n.page for n in nodes])))
        return [stack[i].copy() for i in range(len(nodes))]

    def free(self, nodes: list[Any]) -> None:
        self.kv.unshare([n.page for n in nodes])
        for n in nodes:
            n.page = None

    def existing_prefix(self, hit: Any, tokens: Sequence[int]) -> Any:
        if not hit.blocks:
            stack = self.read_pages(hit.pages)
        else:  # some blocks are on the host: join them there
            dev = list(jax.device_get(self.read_pages(hit.pages))[:len(hit.pages)]) \
                if hit.pages else []
            stack = self.engine.stack_blocks(dev + hit.blocks)
        return self.engine.prefix_from_blocks(stack, tokens[:hit.tokens])
