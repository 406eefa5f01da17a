"""The pools size themselves from measured load: pure policies (the balancer's actor feeds them).

The expert pool:

Each tick the loop reads every expert worker's cumulative compute seconds (Stats) and turns the
increase over the tick into a *busy fraction* (time computing / wall time) per worker; the policy
asks for `ceil(sum of busy fractions / target_utilization)` workers, within
[`min_workers`, `max_workers`] (any pool of one worker or more holds every expert once; `floor`
raises the minimum where a deployment needs more). Like Ray Serve's `autoscaling_config`, a change must be wanted for `upscale_delay_s` (grow)
or the longer `downscale_delay_s` (shrink) before it happens, and the pool moves one worker at a
time (hysteresis). Queueing delay and the attention side's expert wait guard it (`ExpertSignals`). The resize itself is the balancer's live one (re-plan, load, switch, retire:
no request lost, no token changed). A manual `scale-experts N` pins the pool until
`scale-experts auto` hands it back.

The attention pool (`AttentionAutoscaler`): llm-d's saturation rule on each worker's KV cache use
and queue, with the same bounds, delays and one-step moves; the balancer starts a new attention
worker or drains one (the routers stop sending it requests, it finishes what it has) and stops it.
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


class Hysteresis:
    """A pool size wanted -> one step toward it, once the same direction has been wanted for its
    delay (`upscale_delay_s` to grow, `downscale_delay_s` to shrink); says why in `last_reason`."""

    def __init__(self, upscale_delay_s: float, downscale_delay_s: float, unit: str = "workers"):
        self.upscale_delay_s, self.downscale_delay_s, self.unit = upscale_delay_s, downscale_delay_s, unit
        self._wanted_since: tuple[int, float] | None = None  # (direction, since)
        self.last_reason = "no tick yet"  # the last decision, in words

    def step(self, want: int, current: int, now: float, asks: str) -> int | None:
        """`want` (the policy's size, `asks` its why) at time `now` -> current +- 1, or None."""
        direction = (want > current) - (want < current)
        if direction == 0:
            self._wanted_since = None
            self.last_reason = f"{asks}: holding at {current}"
            return None
        if self._wanted_since is None or self._wanted_since[0] != direction:
            self._wanted_since = (direction, now)
        delay = self.upscale_delay_s if direction > 0 else self.downscale_delay_s
        waited = now - self._wanted_since[1]
        if waited < delay:
            verb = "grow" if direction > 0 else "shrink"
            self.last_reason = f"{asks}: {verb} after {waited:.0f} of {delay:g} s"
            return None
        self._wanted_since = None
        self.last_reason = f"{asks}: {current} -> {current + direction} {self.unit}"
        return current + direction


@dataclass(frozen=True)
class ExpertSignals:
    """What an expert autoscaling tick measured beside the busy fractions (means over the tick)."""

    queue_delay_s: float = 0.0  # seconds a Dispatch waited for its worker's compute (queueing delay)
    compute_s: float = 0.0  # seconds a Dispatch computed
    expert_wait_share: float = 0.0  # of the attention workers' step time, blocked on routed experts
    tokens_per_s: float = 0.0  # tokens the attention workers ran through their steps
    pending: int = 0  # requests waiting at the attention workers

    @property
    def contended(self) -> bool:
        """Dispatches wait longer for a worker than they compute on it while the attention side
        spends `CONTENDED_WAIT_SHARE` of its steps waiting: bursts meet (several attention workers or
        micro-batches at once), and more workers would shorten the steps even with busy time low."""
        return self.queue_delay_s > self.compute_s > 0 and self.expert_wait_share >= CONTENDED_WAIT_SHARE

    def describe(self) -> str:
        return (f"queue {self.queue_delay_s * 1e3:.2f} ms per dispatch over {self.compute_s * 1e3:.2f} ms compute, "
                f"expert wait {self.expert_wait_share:.0%} of steps, {self.tokens_per_s:.0f} tok/s, "
                f"{self.pending} waiting")  # fmt: skip


CONTENDED_WAIT_SHARE = 0.3


class ExpertAutoscaler:
    """`decide(busy, current, now, signals)` -> the pool size to move to now, or None. Pure (no
    clock of its own, no Ray): the caller passes time and measurements.

    The busy fractions set the size; `signals` (when measured) add two guards: a contended pool
    (`ExpertSignals.contended`) grows by one even under the busy target, and a pool whose
    dispatches still queue (over half their compute time) does not shrink."""

    def __init__(self, cfg: AutoscaleConfig, floor: int = 1):
        self.cfg, self.floor = cfg, floor  # floor: the fewest workers the placement can use
        self.hysteresis = Hysteresis(cfg.upscale_delay_s, cfg.downscale_delay_s)
        self.last_desired: int | None = None

    @property
    def last_reason(self) -> str:
        return self.hysteresis.last_reason

    @last_reason.setter
    def last_reason(self, reason: str) -> None:
        self.hysteresis.last_reason = reason

    def desired(self, busy: list[float], current: int, signals: ExpertSignals | None = None) -> int:
        """The pool size the measured busy fractions (and signals) ask for (clamped)."""
        want = math.ceil(sum(busy) / self.cfg.target_utilization - 1e-9) if busy else current
        if signals is not None and signals.contended:
            want = max(want, current + 1)
        elif signals is not None and want < current and signals.queue_delay_s > signals.compute_s / 2:
            want = current
        lo = max(self.cfg.min_workers, self.floor)
        return max(lo, min(self.cfg.max_workers, want))

    def decide(
        self, busy: list[float], current: int, now: float, signals: ExpertSignals | None = None
    ) -> int | None:
        """One step (current +- 1) once the same direction has been wanted for its delay."""
        want = self.last_desired = self.desired(busy, current, signals)
        measured = f"busy {sum(busy):.2f} over {len(busy)} workers at target {self.cfg.target_utilization:g}"
        if signals is not None:
            measured += f"; {signals.describe()}{' (contended)' if signals.contended else ''}"
        asks = f"{measured} wants {want} (bounds {max(self.cfg.min_workers, self.floor)}..{self.cfg.max_workers})"
        return self.hysteresis.step(want, current, now, asks)


def expert_signals(
    before: dict[str, tuple[float, float, int]],
    after: dict[str, tuple[float, float, int]],
    attention_before: dict[str, dict],
    attention_after: dict[str, dict],
    seconds: float,
) -> ExpertSignals:
    """The signals of a tick from two readings of each expert worker's (compute s, queue s,
    dispatch calls) and each attention worker's stats (`times`: step_s, expert_wait_s, tokens;
    `waiting`), taken `seconds` apart. Workers in one reading only (new, gone) are left out; a
    counter that went down (a restart) counts from zero."""

    compute = queue = calls = 0.0
    for w, (c1, q1, n1) in after.items():
        if w in before:
            c0, q0, n0 = before[w]
            compute, queue, calls = (
                compute + _increase(c0, c1),
                queue + _increase(q0, q1),
                calls + _increase(n0, n1),
            )
    step = wait = tokens = 0.0
    for a, s1 in attention_after.items():
        if a in attention_before:
            t0, t1 = attention_before[a]["times"], s1["times"]
            step += _increase(t0["step_s"], t1["step_s"])
            wait += _increase(t0["expert_wait_s"], t1["expert_wait_s"])
            tokens += _increase(t0["tokens"], t1["tokens"])
    return ExpertSignals(
        queue_delay_s=queue / calls if calls else 0.0,
        compute_s=compute / calls if calls else 0.0,
        expert_wait_share=min(1.0, wait / step) if step > 0 else 0.0,
        tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
        pending=sum(s["waiting"] for s in attention_after.values()),
    )


def _increase(before: float, after: float) -> float:
    """How much a cumulative counter grew (a counter that went down restarted: from zero)."""
    return after - before if after >= before else after


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
        spent = _increase(busy0, busy1)
        out[w] = min(1.0, max(0.0, spent / (t1 - t0)))
    return out


# ---- the attention pool ----------------------------------------------------------------------
@dataclass
class AttentionScaleConfig:
    """The attention pool's autoscaling, on llm-d's saturation rule: a worker is saturated when its
    latent KV cache is `kv_threshold` full or `queue_threshold` requests wait for it."""

    min_workers: int
    max_workers: int
    kv_threshold: float = 0.8  # KV cache use (0..1) that saturates a worker
    queue_threshold: int = 5  # waiting requests that saturate a worker
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 120.0
    period_s: float = 2.0
    drain_timeout_s: float = (
        120.0  # a worker being removed finishes its requests within this (then moves them)
    )
    start_timeout_s: float = 900.0  # a new worker that no node has room for waits this long

    def __post_init__(self):
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(
                f"attention workers: need 1 <= min ({self.min_workers}) <= max ({self.max_workers})"
            )
        if not 0.0 < self.kv_threshold <= 1.0 or self.queue_threshold < 1:
            raise ValueError("attention autoscaling: kv_threshold in (0, 1] and queue_threshold >= 1")
        if min(self.upscale_delay_s, self.downscale_delay_s, self.drain_timeout_s) < 0 or self.period_s <= 0:
            raise ValueError("autoscaling delays must be >= 0 and its period > 0")

    @property
    def enabled(self) -> bool:
        return self.min_workers < self.max_workers


@dataclass(frozen=True)
class AttentionLoad:
    """One attention worker's load, from its stats."""

    kv_usage: float  # latent KV blocks in use / all (0..1)
    waiting: int  # requests queued for a batch slot
    running: int  # requests in the batch
    max_running: int  # the batch's size limit (max_num_seqs)

    @classmethod
    def from_stats(cls, stats: dict) -> AttentionLoad:
        return cls(stats["kv_blocks_used"] / max(1, stats["kv_blocks_total"]), stats["waiting"],
                   stats["running"], stats["max_num_seqs"])  # fmt: skip


class AttentionAutoscaler:
    """`decide(loads, current, now)` -> the attention pool size to move to now, or None. Pure.

    Grow when the pool is saturated on average (mean KV use >= kv_threshold or mean waiting >=
    queue_threshold: the router spreads requests evenly, so the mean is every worker). Shrink when
    one worker fewer would carry today's load at half saturation: nothing waiting, and per worker
    KV use below kv_threshold / 2 and running requests below half the batch limit. Between the two
    it holds (no flapping: a pool that just shrank is not saturated)."""

    def __init__(self, cfg: AttentionScaleConfig):
        self.cfg = cfg
        self.hysteresis = Hysteresis(cfg.upscale_delay_s, cfg.downscale_delay_s)
        self.last_desired: int | None = None

    @property
    def last_reason(self) -> str:
        return self.hysteresis.last_reason

    def desired(self, loads: list[AttentionLoad], current: int) -> int:
        cfg, n = self.cfg, len(loads)
        want = current
        if n:
            kv, waiting = sum(x.kv_usage for x in loads), sum(x.waiting for x in loads)
            running, limit = sum(x.running for x in loads), min(x.max_running for x in loads)
            if kv / n >= cfg.kv_threshold or waiting / n >= cfg.queue_threshold:
                want = current + 1
            elif (
                n > 1
                and not waiting
                and kv / (n - 1) < cfg.kv_threshold / 2
                and running / (n - 1) < limit / 2
            ):
                want = current - 1
        return max(cfg.min_workers, min(cfg.max_workers, want))

    def decide(self, loads: list[AttentionLoad], current: int, now: float) -> int | None:
        want = self.last_desired = self.desired(loads, current)
        n = max(1, len(loads))
        asks = (
            f"mean KV use {sum(x.kv_usage for x in loads) / n:.2f} (saturated at {self.cfg.kv_threshold:g}), "
            f"mean waiting {sum(x.waiting for x in loads) / n:.1f} (at {self.cfg.queue_threshold}), "
            f"running {sum(x.running for x in loads)} over {len(loads)} workers wants {want} "
            f"(bounds {self.cfg.min_workers}..{self.cfg.max_workers})"
        )
        return self.hysteresis.step(want, current, now, asks)
