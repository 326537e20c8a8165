"""Which LoRA adapters are known, and which of them hold a row of the device pool.

Plain Python (no jax): adapters are kept on the host by name; at most `max_loras` of them
are resident in the pool at once (rows 1..max_loras; row 0 is "no adapter"). A request
for one that is not resident takes a free row, or the least recently used row that no
live decode slot holds (`pin` / `unpin` count those). Each row counts its loads, so a
prefix made with an adapter that has since been swapped out is recognised at insert.

Thread safety: every method takes the registry's lock; the engine holds it too while it
dispatches a device call that reads the pool (engines/lora_engine.py).
"""

from __future__ import annotations

import collections
import threading

from engines.lora_loading import AdapterWeights


class UnknownAdapter(KeyError):
    """A request named an adapter that is not loaded (HTTP 404 / gRPC NOT_FOUND)."""


class AdapterRegistry:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.lock = threading.RLock()
        self._host: dict[str, AdapterWeights] = {}
        self._row_of: dict[str, int] = {}
        self._name_at: dict[int, str] = {}
        self._recent: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._pins = [0] * (max_loras + 1)
        self.loads = [0] * (max_loras + 1)  # how many times each row was written

    def add(self, name: str, weights: AdapterWeights) -> None:
        """Keeps `weights` under `name` on the host (replacing a previous one evicts it)."""
        if not name:
            raise ValueError("a LoRA adapter needs a non-empty name")
        with self.lock:
            if name in self._host:
                self.remove(name)
            self._host[name] = weights

    def remove(self, name: str) -> None:
        with self.lock:
            if name not in self._host:
                raise UnknownAdapter(name)
            del self._host[name]
            row = self._row_of.pop(name, None)
            if row is not None:
                del self._name_at[row]
                self._recent.pop(row, None)

    def names(self) -> list[str]:
        with self.lock:
            return list(self._host)

    def __contains__(self, name: str) -> bool:
        return name in self._host

    def resident(self) -> dict[str, int]:
        with self.lock:
            return dict(self._row_of)

    def row_for(self, name: str) -> tuple[int, AdapterWeights | None]:
        """(pool row of `name`, weights to write there first or None when resident).
        Raises UnknownAdapter, or RuntimeError when every row is held by live slots."""
        with self.lock:
            if name not in self._host:
                raise UnknownAdapter(name)
            row = self._row_of.get(name)
            write = None
            if row is None:
                row = self._free_row()
                old = self._name_at.pop(row, None)
                if old is not None:
                    del self._row_of[old]
                self._row_of[name], self._name_at[row] = row, name
                self.loads[row] += 1
                write = self._host[name]
            self._recent[row] = None
            self._recent.move_to_end(row)
            return row, write

    def _free_row(self) -> int:
        for row in range(1, self.max_loras + 1):
            if row not in self._name_at:
                return row
        for row in self._recent:  # least recently used first
            if self._pins[row] == 0:
                self._recent.pop(row)
                return row
        raise RuntimeError(f"all {self.max_loras} LoRA rows (--max-loras) hold adapters of "
                           f"live requests; retry when one finishes")

    def pin(self, row: int) -> None:
        with self.lock:
            self._pins[row] += 1

    def unpin(self, row: int) -> None:
        with self.lock:
            self._pins[row] = max(0, self._pins[row] - 1)
