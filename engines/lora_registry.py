"""Which LoRA adapters are known, and which of them hold a row of the device pool.

Plain Python (no jax): adapters are kept on the host by name; at most `max_loras` of them
are resident in the pool at once (rows 1..max_loras; row 0 is "no adapter"). A request
for one that is not resident takes a free row, or the least recently used row that
nothing pins (`pin` / `unpin`: waiting prefixes and live decode slots).

Each name also has an id (`adapter_id`, a hash of the name, the same in every engine), which
a prefix carries on the device: the engine that inserts it, maybe another than the one
that prefilled it (disaggregated serving), finds the adapter's row in its own pool.

Thread safety: every method takes the registry's lock; the engine holds it too while it
dispatches a device call that reads the pool (engines/lora_engine.py). `row_for` may wait
(`wait_s`) for a row to be unpinned: the wait releases the lock, and `unpin` wakes it.
"""

from __future__ import annotations

import collections
import threading
import time
import zlib

from engines.lora_loading import AdapterWeights


class UnknownAdapter(KeyError):
    """A request named an adapter that is not loaded (HTTP 404 / gRPC NOT_FOUND)."""


class RowsBusy(RuntimeError):
    """Every pool row holds an adapter that live requests pin: retry once one ends."""


def adapter_id(name: str) -> int:
    """A name's id: positive (0 is the base model), the same in every process."""
    return (zlib.crc32(name.encode()) & 0x7FFFFFFF) or 1


class AdapterRegistry:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.lock = threading.RLock()
        self._unpinned = threading.Condition(self.lock)
        self._host: dict[str, AdapterWeights] = {}
        self._row_of: dict[str, int] = {}
        self._name_at: dict[int, str] = {}
        self._recent: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._pins = [0] * (max_loras + 1)
        self._by_id: dict[int, str] = {}

    def add(self, name: str, weights: AdapterWeights) -> None:
        """Keeps `weights` under `name` on the host (replacing a previous one evicts it)."""
        if not name:
            raise ValueError("a LoRA adapter needs a non-empty name")
        with self.lock:
            other = self._by_id.get(adapter_id(name))
            if other is not None and other != name:
                raise ValueError(f"LoRA adapter names {other!r} and {name!r} have the same "
                                 f"id; rename one")
            if name in self._host:
                self.remove(name)
            self._host[name] = weights
            self._by_id[adapter_id(name)] = name

    def remove(self, name: str) -> None:
        with self.lock:
            if name not in self._host:
                raise UnknownAdapter(name)
            del self._host[name]
            del self._by_id[adapter_id(name)]
            row = self._row_of.pop(name, None)
            if row is not None:
                del self._name_at[row]
                self._recent.pop(row, None)

    def names(self) -> list[str]:
        with self.lock:
            return list(self._host)

    def __contains__(self, name: str) -> bool:
        return name in self._host

    def name_of(self, ident: int) -> str:
        """The adapter with id `ident` (UnknownAdapter when none is loaded)."""
        with self.lock:
            if ident not in self._by_id:
                raise UnknownAdapter(f"no LoRA adapter with id {ident} is loaded (unloaded "
                                     f"while its request waited?)")
            return self._by_id[ident]

    def resident(self) -> dict[str, int]:
        with self.lock:
            return dict(self._row_of)

    def row_for(self, name: str, wait_s: float = 0.0) -> tuple[int, AdapterWeights | None]:
        """(pool row of `name`, weights to write there first or None when resident).
        Raises UnknownAdapter, or RowsBusy when every row stays pinned for `wait_s`."""
        with self.lock:
            if name not in self._host:
                raise UnknownAdapter(name)
            row = self._row_of.get(name)
            write = None
            if row is None:
                row = self._free_row(name, time.monotonic() + wait_s)
                old = self._name_at.pop(row, None)
                if old is not None:
                    del self._row_of[old]
                self._row_of[name], self._name_at[row] = row, name
                write = self._host[name]
            self._recent[row] = None
            self._recent.move_to_end(row)
            return row, write

    def _free_row(self, name: str, deadline: float) -> int:
        while True:
            for row in range(1, self.max_loras + 1):
                if row not in self._name_at:
                    return row
            for row in self._recent:  # least recently used first
                if self._pins[row] == 0:
                    self._recent.pop(row)
                    return row
            left = deadline - time.monotonic()
            if left <= 0 or name not in self._host:
                raise RowsBusy(f"all {self.max_loras} LoRA rows (--max-loras) hold "
                                   f"adapters of live requests; retry when one finishes")
            self._unpinned.wait(left)

    def pin(self, row: int) -> None:
        with self.lock:
            self._pins[row] += 1

    def unpin(self, row: int) -> None:
        with self.lock:
            self._pins[row] = max(0, self._pins[row] - 1)
            self._unpinned.notify_all()
