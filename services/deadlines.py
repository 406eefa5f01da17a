"""Deadlines drawn from observed latency: a hung peer is found in about a second, a busy one is not
mistaken for a hung one. Every hop that waits on another process uses one: the attention worker's
dispatch per MoE layer (dataplane/remote_experts.py, by rows sent), the router's pings of an
attention worker whose streams stall (router/core.py), the balancer's health checks of expert
workers and pings of attention workers (balancer/pool.py, balancer/service.py; one size class).

A fixed deadline must be long enough for the slowest legitimate call (a long prefill chunk on a
loaded worker, the first call that compiles a kernel), so a frozen worker stalls every stream
for that long. Instead, each call's deadline comes from what calls of its size took lately:

    deadline(rows) = clamp(factor x p99(recent latencies of rows' size class), floor_s, ceiling_s)

Size classes are powers of two of the rows sent to one worker (a decode step's 8 rows and a
prefill chunk's 2,048 are different things). A class with fewer than `min_samples` answered calls
borrows from its learned neighbours: the deadline of the nearest larger learned class (more rows
take no less time), else one from the nearest smaller class's p99 doubled per class between them
(rows double per class); with no class learned yet, the ceiling (the configured timeout). So warm-up is
never cut short, and a rare size (a resend's share, a short last chunk) is not waited for at the
ceiling on a worker that froze. Latency is measured from a call's start to its answer being read, an upper bound of the
worker's time (the client reads answers in turn), which only errs towards patience.
Pure Python, not thread-safe (one per caller; callers with one kind of call use rows=1).
"""

from __future__ import annotations

import collections


class Deadlines:
    REFRESH = 16  # observations of a class between recomputations of its p99 (a sort of the window)

    def __init__(self, ceiling_s: float, floor_s: float = 1.5, factor: float = 4.0, window: int = 256,
                 min_samples: int = 8):  # fmt: skip
        if not (floor_s > 0 and factor >= 1 and window >= min_samples >= 1):
            raise ValueError(
                f"deadlines: floor {floor_s} s, factor {factor}, window {window}, min {min_samples}"
            )
        self.ceiling_s, self.floor_s, self.factor = ceiling_s, min(floor_s, ceiling_s), factor
        self.window, self.min_samples = window, min_samples
        self._seen: dict[int, collections.deque[float]] = {}
        self._cached: dict[int, float] = {}  # size class -> its deadline (recomputed every REFRESH calls)
        self._count: dict[int, int] = {}

    @staticmethod
    def size_class(rows: int) -> int:
        return max(rows, 1).bit_length()

    def timeout_s(self, rows: int) -> float:
        """The deadline, in seconds from its start, of a call sending `rows` rows to one worker."""
        c = self.size_class(rows)
        deadline = self._cached.get(c)
        if deadline is None:
            learned = [k for k, seen in self._seen.items() if len(seen) >= self.min_samples]
            larger, smaller = [k for k in learned if k >= c], [k for k in learned if k < c]
            if larger:
                deadline = self._learned(min(larger))
            elif smaller:
                k = max(smaller)
                deadline = self._learned(k, scale=2.0 ** (c - k))
            else:
                deadline = self.ceiling_s
            if c in learned:
                self._cached[c] = deadline  # (a borrowed deadline is recomputed: its class may learn)
        return deadline

    def _learned(self, c: int, scale: float = 1.0) -> float:
        """factor x p99 of class c (x `scale`: a larger class's time estimated from c's), clamped."""
        ordered = sorted(self._seen[c])
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return min(self.ceiling_s, max(self.floor_s, self.factor * p99 * scale))

    def observe(self, rows: int, seconds: float) -> None:
        """An answered call of `rows` rows took `seconds`."""
        c = self.size_class(rows)
        seen = self._seen.get(c)
        if seen is None:
            seen = self._seen[c] = collections.deque(maxlen=self.window)
        seen.append(seconds)
        n = self._count[c] = self._count.get(c, 0) + 1
        if n == self.min_samples or n % self.REFRESH == 0 or seconds * self.factor > self._cached.get(c, 0.0):
            self._cached.pop(c, None)  # (a slower call than the deadline assumed: at once)

    @staticmethod
    def caller_stalled(elapsed_s: float, timeout_s: float) -> bool:
        """Did a call that timed out after `elapsed_s` (deadline `timeout_s`) time out because
        the caller itself was stalled (frozen, starved of CPU), not the peer? A deadline fires on
        time in a running process; one noticed much later (by more than the deadline, and more
        than half a second) proves nothing about the peer, so the call is not held against it."""
        return elapsed_s - timeout_s > max(0.5, timeout_s)

    def longest_s(self) -> float:
        """The longest deadline of the size classes seen (the ceiling before any call was seen)."""
        return max((self.timeout_s((1 << c) - 1) for c in self._seen), default=self.ceiling_s)

    def snapshot(self) -> dict[str, float]:
        """{"rows<=N": deadline s} of the size classes seen (status)."""
        return {f"rows<={(1 << c) - 1}": round(self.timeout_s((1 << c) - 1), 3) for c in sorted(self._seen)}
