"""Whether a decode step speculates, by batch size (vLLM's `disable_by_batch_size`, and `auto`).

Speculating pays at small batches (a verify step's extra rows are nearly free where the step is
bound by reading weights and by round trips) and may cost at large ones (the rows are real work,
and the MTP module's passes come on top). `SpeculationGate` answers, before the MTP module drafts
for the next step, whether that step speculates:

- `disable_above=N` (N > 0): speculate while at most N sequences run, never above; nothing measured.
- `auto` (`disable_above=0`): per batch-size bucket (the power of two at or above the number of
  running sequences: 1, 2, 4, 8, ...) it keeps the last `window` decode steps' seconds and tokens
  emitted per sequence, for speculating steps and for plain ones (a plain step's seconds include
  the MTP module's cache rows, all it runs then: engine/speculative.py). Until each side has
  `min_samples`, one decision in `probe_every` is a plain step (the others speculate: a bucket is
  decided after about min_samples * probe_every steps); after that a bucket speculates while its
  speculating steps emit at least as many tokens per sequence and second as its plain ones, and
  every `refresh_every` decisions it takes the other side for `min_samples` steps in a row (a
  burst). The chosen side is measured over its last `window` steps, the other over its last
  `min_samples` (its latest burst), so a bucket's choice follows the load and an early decision
  made on unlucky steps is revisited at the next burst. A change of a bucket's choice is logged.

Pure Python, no model: the engine records each pure decode step (`record`) and asks `speculate`.
Greedy tokens do not depend on it: plain and speculative steps are interchangeable.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


def bucket_of(batch_size: int) -> int:
    """The power of two at or above batch_size (>= 1): 1, 2, 4, 8, ..."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class BucketTimes:
    """One bucket's recent decode steps: (seconds, tokens emitted per sequence) per kind."""

    speculating: deque = field(default_factory=deque)
    plain: deque = field(default_factory=deque)
    decisions: int = 0  # times `speculate` was asked for this bucket
    on: bool = True  # the bucket's choice once both sides are measured
    burst: int = 0  # decisions left that take the other side (refreshing its measure)

    @staticmethod
    def rate(samples: deque, last: int | None = None) -> float | None:
        """Tokens per sequence and second over the samples, or the `last` of them (None: none)."""
        recent = list(samples)[-last:] if last else samples
        seconds = sum(s for s, _ in recent)
        return sum(t for _, t in recent) / seconds if seconds > 0 else None


class SpeculationGate:
    """See the module's doc. `speculate(n)`: whether the next step, with n running sequences,
    speculates; `record(n, speculated, seconds, tokens_per_seq)`: a finished pure decode step."""

    def __init__(
        self,
        disable_above: int = 0,
        probe_every: int = 4,
        min_samples: int = 8,
        refresh_every: int = 256,
        window: int = 32,
    ):
        if disable_above < 0:
            raise ValueError(f"disable_by_batch_size must be >= 0 (0: auto), got {disable_above}")
        self.disable_above = disable_above
        self.probe_every, self.min_samples = probe_every, min_samples
        self.refresh_every, self.window = refresh_every, window
        self.buckets: dict[int, BucketTimes] = {}

    @property
    def auto(self) -> bool:
        return self.disable_above == 0

    def _bucket(self, batch_size: int) -> BucketTimes:
        b = bucket_of(batch_size)
        if b not in self.buckets:
            self.buckets[b] = BucketTimes(deque(maxlen=self.window), deque(maxlen=self.window))
        return self.buckets[b]

    def measured(self, times: BucketTimes) -> bool:
        return min(len(times.speculating), len(times.plain)) >= self.min_samples

    def speculate(self, batch_size: int) -> bool:
        if not self.auto:
            return batch_size <= self.disable_above
        times = self._bucket(batch_size)
        n = times.decisions
        times.decisions += 1
        if not self.measured(times):
            return n % self.probe_every != self.probe_every - 1  # (a plain step now and then)
        if n % self.refresh_every == self.refresh_every - 1:
            times.burst = self.min_samples  # (the other side for a while, to keep its measure current)
        if times.burst:
            times.burst -= 1
            return not times.on
        return times.on

    def record(self, batch_size: int, speculated: bool, seconds: float, tokens_per_seq: float) -> None:
        if not self.auto or seconds <= 0:
            return
        times = self._bucket(batch_size)
        (times.speculating if speculated else times.plain).append((seconds, tokens_per_seq))
        if not self.measured(times):
            return
        spec, plain = self.rates(times)
        on = spec >= plain
        if on != times.on:
            times.on, times.burst = on, 0  # (a burst that changed the choice has done its work)
            lo = bucket_of(batch_size) // 2 + 1
            log.info("speculative decoding %s at %d-%d running sequences: %.1f tokens/s per sequence "
                     "speculating, %.1f plain", "on" if on else "off", lo, bucket_of(batch_size), spec,
                     plain)  # fmt: skip

    def rates(self, times: BucketTimes) -> tuple[float | None, float | None]:
        """(speculating, plain) tokens per sequence and second as the bucket compares them: the side
        it chose over its window, the other over its last `min_samples` (its latest burst)."""
        return (BucketTimes.rate(times.speculating, None if times.on else self.min_samples),
                BucketTimes.rate(times.plain, self.min_samples if times.on else None))  # fmt: skip

    def as_dict(self) -> dict:
        """For the engine's stats: the setting, and per bucket each side's tokens per sequence and
        second, its samples and whether it speculates."""
        buckets = {}
        for b, t in sorted(self.buckets.items()):
            spec, plain = self.rates(t)
            buckets[str(b)] = {
                "speculating_tok_s": spec,
                "plain_tok_s": plain,
                "samples": [len(t.speculating), len(t.plain)],
                "on": t.on if self.measured(t) else None,  # (None: still measuring, mostly speculating)
            }
        return {"disable_by_batch_size": "auto" if self.auto else self.disable_above, "buckets": buckets}

    def summary(self) -> str:
        """One line for `moe-cluster status`: 'auto (off above 8)', 'auto (measuring)', 'above 16'."""
        if not self.auto:
            return f"off above {self.disable_above} running"
        off = [b for b, t in sorted(self.buckets.items()) if self.measured(t) and not t.on]
        on = [b for b, t in sorted(self.buckets.items()) if self.measured(t) and t.on]
        if not off and not on:
            return "auto (measuring)"
        parts = [f"on up to {max(on)}"] if on else []
        if off:
            parts.append(f"off at {', '.join(map(str, off))}")
        return f"auto ({'; '.join(parts)} running, by power-of-two bucket)"
