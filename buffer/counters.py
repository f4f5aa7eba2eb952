"""Small bounded counters for the buffer's statistics and duplicate detection."""

from __future__ import annotations

import collections


class RateWindow:
    """Events per second over the last ``seconds``, in one-second buckets."""

    def __init__(self, seconds: int = 60):
        self.seconds = seconds
        self._buckets: collections.deque[list[float]] = collections.deque()  # [second, count]

    def add(self, now: float, count: int) -> None:
        second = float(int(now))
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += count
        else:
            self._buckets.append([second, float(count)])
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._buckets and self._buckets[0][0] <= now - self.seconds:
            self._buckets.popleft()

    def rate(self, now: float, started: float) -> float:
        self._trim(now)
        span = min(float(self.seconds), max(now - started, 1.0))
        return sum(c for _, c in self._buckets) / span


class BoundedSet:
    """Remembers the most recent ``limit`` keys (insertion order)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._keys: dict[str, None] = {}

    def add(self, key: str) -> None:
        self._keys.pop(key, None)
        self._keys[key] = None
        while len(self._keys) > self.limit:
            del self._keys[next(iter(self._keys))]

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> list[str]:
        return list(self._keys)
