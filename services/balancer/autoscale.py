"""The expert pool sizes itself from measured load: a pure policy, and the loop that feeds it.

Each tick the loop reads every expert worker's cumulative compute seconds (Stats) and turns the
increase over the tick into a *busy fraction* (time computing / wall time) per worker; the policy
asks for `ceil(sum of busy fractions / target_utilization)` workers, within
[`min_workers`, `max_workers`] (any pool of one worker or more holds every expert once; `floor`
raises the minimum where a deployment needs more). Like Ray Serve's `autoscaling_config`, a change must be wanted for `upscale_delay_s` (grow)
or the longer `downscale_delay_s` (shrink) before it happens, and the pool moves one worker at a
time (hysteresis). The resize itself is the balancer's live one (re-plan, load, switch, retire:
no request lost, no token changed). A manual `scale-experts N` pins the pool until
`scale-experts auto` hands it back.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class AutoscaleConfig:
    min_workers: int
    max_workers: int
    target_utilization: float = 0.6  # busy fraction each worker should run at
    upscale_delay_s: float = 30.0  # a larger pool wanted this long before it grows
    downscale_delay_s: float = 120.0  # a smaller pool wanted this long before it shrinks
    period_s: float = 2.0  # seconds between ticks

    def __post_init__(self):
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(
                f"expert workers: need 1 <= min ({self.min_workers}) <= max ({self.max_workers})"
            )
        if not 0.0 < self.target_utilization <= 1.0:
            raise ValueError(f"target utilization {self.target_utilization} not in (0, 1]")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0 or self.period_s <= 0:
            raise ValueError("autoscaling delays must be >= 0 and its period > 0")

    @property
    def enabled(self) -> bool:
        return self.min_workers < self.max_workers


class ExpertAutoscaler:
    """`decide(busy, current, now)` -> the pool size to move to now, or None. Pure (no clock of
    its own, no Ray): the caller passes time and measurements."""

    def __init__(self, cfg: AutoscaleConfig, floor: int = 1):
        self.cfg, self.floor = cfg, floor  # floor: the fewest workers the placement can use
        self._wanted_since: tuple[int, float] | None = None  # (direction, since)
        self.last_desired: int | None = None
        self.last_reason = "no tick yet"  # the last decision, in words

    def desired(self, busy: list[float], current: int) -> int:
        """The pool size the measured busy fractions ask for (clamped)."""
        want = math.ceil(sum(busy) / self.cfg.target_utilization - 1e-9) if busy else current
        lo = max(self.cfg.min_workers, self.floor)
        return max(lo, min(self.cfg.max_workers, want))

    def decide(self, busy: list[float], current: int, now: float) -> int | None:
        """One step (current +- 1) once the same direction has been wanted for its delay."""
        want = self.last_desired = self.desired(busy, current)
        asks = (
            f"busy {sum(busy):.2f} over {len(busy)} workers at target {self.cfg.target_utilization:g} "
            f"wants {want} (bounds {max(self.cfg.min_workers, self.floor)}..{self.cfg.max_workers})"
        )
        direction = (want > current) - (want < current)
        if direction == 0:
            self._wanted_since = None
            self.last_reason = f"{asks}: holding at {current}"
            return None
        if self._wanted_since is None or self._wanted_since[0] != direction:
            self._wanted_since = (direction, now)
        delay = self.cfg.upscale_delay_s if direction > 0 else self.cfg.downscale_delay_s
        waited = now - self._wanted_since[1]
        if waited < delay:
            verb = "grow" if direction > 0 else "shrink"
            self.last_reason = f"{asks}: {verb} after {waited:.0f} of {delay:g} s"
            return None
        self._wanted_since = None
        self.last_reason = f"{asks}: {current} -> {current + direction} workers"
        return current + direction


def busy_fractions(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Per worker present in both: (compute seconds, wall time) readings -> busy fraction over the
    interval (0..1; a worker that restarted, with a smaller counter, counts from zero)."""
    out = {}
    for w, (busy1, t1) in after.items():
        if w not in before or t1 <= before[w][1]:
            continue
        busy0, t0 = before[w]
        spent = busy1 - busy0 if busy1 >= busy0 else busy1
        out[w] = min(1.0, max(0.0, spent / (t1 - t0)))
    return out
