"""A per-app rate limit on room and resume requests (issue 27, "Who may park whom"): an app may ask for room in a
loop (an allocation that fails and is tried again), and each request costs the server a look at every app on the
GPU, maybe parks, and a log line. Beyond a burst, an app's requests are slowed to a steady rate, never refused: an
app that needs much room at once (a model loading) gets it, only later."""
from __future__ import annotations

import threading
from dataclasses import dataclass

REQUESTS_PER_S = 4.0   # each app's steady rate of room and resume requests
BURST = 8              # asked at once beyond the rate, as a model's first allocations do


@dataclass
class _Bucket:
    tokens: float
    at: float


class RateLimit:
    def __init__(self, per_s: float = REQUESTS_PER_S, burst: int = BURST) -> None:
        self.per_s, self.burst = per_s, burst
        self._lock = threading.Lock()
        self._buckets: dict[int, _Bucket] = {}

    def delay(self, key: int, at: float) -> float:
        """Take one request of app `key` at time `at` (seconds): how long it must wait first (0: at once). The token
        is taken now, so requests that wait are served in turn at the rate."""
        with self._lock:
            b = self._buckets.setdefault(key, _Bucket(float(self.burst), at))
            b.tokens = min(float(self.burst), b.tokens + (at - b.at) * self.per_s)
            b.at = at
            b.tokens -= 1.0
            return 0.0 if b.tokens >= 0 else -b.tokens / self.per_s

    def forget(self, key: int) -> None:
        with self._lock:
            self._buckets.pop(key, None)
