"""KV cache events as vLLM publishes them, from the prefix cache: which blocks a replica
holds, for KV-aware routers (vllm-router's `kv_aware` with `--kv-event-source`, llm-d's
precise prefix routing).

Configured as vLLM is: `--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://127.0.0.1:5557", "topic": "kv-events"}'`.

Wire format (vLLM's): a ZMQ PUB socket sends one multipart message per batch of events,
[topic, seq, payload]: `seq` the batch's number (8 bytes, big-endian, from 0), `payload`
msgpack of an EventBatch as the array [ts, events, data_parallel_rank], each event a map
tagged with its kind under "type" (msgspec's tag=True) and its fields by name:

  {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
   "lora_id", "medium", "lora_name"}
  {"type": "BlockRemoved", "block_hashes", "medium"}
  {"type": "AllBlocksCleared"}

vLLM has encoded events both as positional arrays and as maps over its versions; the maps
are what vllm-router's kv_aware (0.1.17) decodes, and a reader of either kind finds every
field by name.

What is published: a prefix-cache block (a trie node of `block_size` tokens, see
prefix_cache.py) stored on the device ("GPU", vLLM's name for the accelerator's memory),
moved to the host tier ("CPU": removed from GPU, stored on CPU) or back, and dropped; a
cache cleared is AllBlocksCleared. Block hash: the first 8 bytes of sha256(parent's hash,
the block's token ids as int32), as an integer below 2**63, where a prompt's first block's
"parent" is a hash of the cache key (model, tokenizer, chat template): so a hash names the
whole prefix up to and including its block, and differs between models. BlockStored carries the block's token ids, as vLLM's does:
a router that tokenizes requests (vllm-router's kv_aware) matches prompts to blocks by
them. No text is ever published, only token ids, hashes and counts.
`data_parallel_rank` is the index of the prefill engine whose cache the block is in.

Concurrency: `EventSink.emit` is called under the prefix cache's lock (on the prefill and
generate threads) and only puts a batch on a queue; one publisher thread encodes and sends.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

GPU, CPU = "GPU", "CPU"  # vLLM's medium names: the device tier and the host tier
MEDIUM = {"hbm": GPU, "host": CPU}


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of a block below `parent`'s (see the module docstring)."""
    h = hashlib.sha256(parent.to_bytes(8, "big"))
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens))
    return int.from_bytes(h.digest()[:8], "big") >> 1


def root_hash(key: str) -> int:
    """The "parent" of a prompt's first block under cache key `key`."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> 1


def stored(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int,
           medium: str) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": token_ids, "block_size": block_size, "lora_id": None,
            "medium": medium, "lora_name": None}


def node_stored(node: Any, block_size: int) -> dict:
    """BlockStored of one prefix-cache node (its tier's medium; no parent at the root)."""
    parent = node.parent.hash if node.parent.tier != "root" else None
    return stored([node.hash], parent, list(node.tokens), block_size, MEDIUM[node.tier])


def removed(hashes: list[int], medium: str) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


CLEARED = {"type": "AllBlocksCleared"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVEventsConfig:
    """vLLM's --kv-events-config fields that jetserve reads (the others are refused)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" publishes; "null" nothing
    endpoint: str = "tcp://*:5557"  # where the PUB socket binds
    topic: str = ""
    hwm: int = 100_000  # ZMQ send high-water mark (messages)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread

    def __post_init__(self):
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv-events-config enable_kv_cache_events must be true or false, "
                             f"got {self.enable_kv_cache_events!r}")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv-events-config publisher must be \"zmq\" or \"null\", got "
                             f"{self.publisher!r}")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(f"kv-events-config endpoint must be a ZMQ address such as "
                             f"tcp://127.0.0.1:5557, got {self.endpoint!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv-events-config topic must be a string, got {self.topic!r}")
        for name in ("hwm", "max_queue_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"kv-events-config {name} must be an integer >= 1, got {v!r}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """From --kv-events-config's JSON."""
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config must be a JSON object: {e}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"--kv-events-config must be a JSON object, got {text!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {unknown} (jetserve reads "
                             f"{sorted(known)}; no replay socket yet)")
        return cls(**fields)


class EventSink:
    """Where one prefix cache's events go: a publisher, as data_parallel_rank `rank`."""

    def __init__(self, publisher: ZmqPublisher, rank: int):
        self.publisher, self.rank = publisher, rank

    def emit(self, events: list[list]) -> None:
        if events:
            self.publisher.publish(events, self.rank)


class ZmqPublisher:
    """A ZMQ PUB socket and the thread that sends the batches `publish` queues."""

    def __init__(self, config: KVEventsConfig):
        try:
            import zmq
        except ImportError:
            raise ValueError("--kv-events-config with publisher \"zmq\" needs pyzmq and "
                             "msgpack: pip install 'jetserve[kv-events]'") from None

        self.config = config
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, config.hwm)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.bind(config.endpoint)
        self.endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._queue: queue.Queue = queue.Queue(config.max_queue_size)
        self.seq = 0  # the next batch's number
        self.dropped = 0  # batches lost to a full queue
        self._thread = threading.Thread(target=self._run, name="jetserve-kv-events",
                                        daemon=True)
        self._thread.start()

    def sink(self, rank: int) -> EventSink:
        return EventSink(self, rank)

    def publish(self, events: list[list], rank: int) -> None:
        """Queues one batch (never blocks: a full queue drops it, counted)."""
        try:
            self._queue.put_nowait((time.time(), events, rank))
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        import msgpack

        topic = self.config.topic.encode()
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    break
                payload = msgpack.packb(list(item), use_bin_type=True)
                self._sock.send_multipart([topic, self.seq.to_bytes(8, "big"), payload])
                self.seq += 1
            except Exception:  # a publisher must never take the cache down
                log.exception("publishing a KV event batch failed")
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Waits until every batch queued so far is sent."""
        self._queue.join()

    def close(self) -> None:
        """Sends what is queued, then closes the socket."""
        self._queue.put(None)
        self._thread.join(timeout=10)
        self._sock.close()


def attach(orch: Any, config: KVEventsConfig) -> ZmqPublisher:
    """A publisher for every prefix cache of `orch` (ValueError when it has none)."""
    caches = orch.prefix_caches() if hasattr(orch, "prefix_caches") else []
    if not caches:
        raise ValueError("--kv-events-config: KV events come from the prefix cache; give it "
                         "a budget (--prefix-cache-hbm-mb / --prefix-cache-host-mb)")
    publisher = ZmqPublisher(config)
    for rank, cache in caches:
        cache.events = publisher.sink(rank)
    return publisher
