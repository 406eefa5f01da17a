"""The attention pool: the attention workers the balancer starts and stops as the autoscaler asks
(autoscale.py's `AttentionAutoscaler`), and the list the routers read to know where requests go.

Start: a fresh detached named actor `moe-attn-{n}` (numbered after every attention worker
running) from the template the cluster's first workers were built from, with the current
placement. It is registered with the balancer at once (placement switches reach it while it
loads) and listed as serving once it answers `ready`: each router picks it up at its next read
of the list (`RouterConfig.pool_refresh_s`).

Removal: the worker holding the fewest requests is listed as draining (routers send it nothing
new; its running requests go on), and stopped once it holds no request, at least `grace_s`
after the routers were told (one that read the list late may still have sent one), or after
`drain_timeout_s` anyway: what it still holds then moves to the other workers through the
routers' failover (resumed with the same tokens).

Machines: the balancer asks Ray's autoscaler for room for the pool's size (`Capacity`, with
the expert pool's bundles in the same request), so `ray up` / KubeRay add attention nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from services.settings import AttentionSettings, attention_worker_name, build_config

from .autoscale import AttentionLoad, AttentionScaleConfig

log = logging.getLogger(__name__)

ATTENTION_NAME = re.compile(r"^moe-attn-(\d+)$")  # attention_worker_name's: its index


async def attention_stats(actors: dict[str, Any]) -> dict[str, dict]:
    """Each attention worker's `stats()` (one that does not answer in 5 s is left out)."""
    replies = await asyncio.gather(
        *[asyncio.wait_for(a.stats.remote(), 5.0) for a in actors.values()], return_exceptions=True
    )
    return {n: r for n, r in zip(actors, replies, strict=True) if isinstance(r, dict)}


@dataclass
class AttentionScaling:
    """What the balancer needs to size the attention pool: the policy's settings and how to
    build a worker like the cluster's first ones."""

    scale: AttentionScaleConfig
    worker: Any  # AttentionWorkerConfig (worker_id set per worker)
    resources: dict[str, float] = field(default_factory=dict)  # Ray resources of each worker
    num_gpus: float = 0.0  # per worker and per TP rank

    @classmethod
    def from_settings(cls, settings: AttentionSettings, worker) -> AttentionScaling:
        """The pool of `settings` (services/settings.py), of workers built like `worker`."""
        lo, hi = settings.bounds()
        scale = build_config(AttentionScaleConfig, settings, min_workers=lo, max_workers=hi)
        return cls(scale, worker, dict(settings.resources), settings.gpus)

    @property
    def bundle(self) -> dict[str, float]:
        """What one attention worker's rank takes from a node ({} when nothing)."""
        bundle = {name: float(n) for name, n in self.resources.items() if n}
        return bundle | ({"GPU": float(self.num_gpus)} if self.num_gpus else {})


def start_attention_worker(scaling: AttentionScaling, name: str, placement: dict, addresses: dict,
                           get_if_exists: bool = False):  # fmt: skip
    """Start attention worker `name` like `scaling.worker`, routing with `placement` (expert
    workers at `addresses`): a detached named actor in the cluster's namespace, restarted in
    place by Ray (it re-attaches by name). The one way attention workers start: the launcher's
    first ones and the pool's later ones. `get_if_exists`: the running one of that name, if any
    (a re-deploy)."""
    from services.attention.worker import AttentionWorker

    wcfg = dataclasses.replace(scaling.worker, worker_id=name)
    return AttentionWorker.options(
        name=name, namespace=wcfg.shared.namespace, resources=scaling.resources or None, num_gpus=scaling.num_gpus,
        lifetime="detached", max_restarts=-1, get_if_exists=get_if_exists,
    ).remote(wcfg, placement, addresses)  # fmt: skip


class AttentionPool:
    """Starts and drains attention workers for the balancer (`core`: a BalancerCore, whose
    `attention` dict is the membership the placement pushes use)."""

    grace_s = 3.0  # a drained worker is stopped no sooner than this after the routers were told

    def __init__(self, core, scaling: AttentionScaling, capacity):
        self.core, self.scaling, self.capacity = core, scaling, capacity
        self.starting: dict[str, Any] = {}  # name -> actor, until it answers `ready`
        self._next_index = 0  # the number of the next worker (never one this balancer has seen)
        self.draining: dict[str, float] = {}  # name -> monotonic time it started draining
        self.loads: dict[str, AttentionLoad] = {}  # the last tick's measurements
        self.last_error: str | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def serving(self) -> list[str]:
        """The attention workers that take requests: answered `ready` at the last watch tick (the
        balancer's `attention_state`) and not draining."""
        state = self.core.attention_state
        return [
            n
            for n in self.core.attention
            if "placement_version" in state.get(n, {}) and n not in self.draining
        ]

    @property
    def busy(self) -> bool:
        """A start or a drain in progress (the autoscaler moves one step at a time)."""
        return bool(self.starting or self.draining)

    def listing(self) -> dict[str, list[str]]:
        return {"serving": self.serving, "draining": list(self.draining)}

    async def measure(self) -> dict[str, AttentionLoad]:
        """Each serving worker's load (a worker that does not answer in 5 s is left out)."""
        stats = await attention_stats({n: self.core.attention[n] for n in self.serving})
        self.loads = {n: AttentionLoad.from_stats(r) for n, r in stats.items()}
        return self.loads

    def ask_capacity(self, num_workers: int) -> None:
        tp = getattr(self.scaling.worker, "tp", 1)
        self.capacity.ask("attention", self.scaling.bundle, num_workers * tp)

    def _next_name(self) -> str:
        used = {int(m.group(1)) for n in self.core.attention if (m := ATTENTION_NAME.match(n))}
        with contextlib.suppress(Exception):
            for info in ray.util.list_named_actors(all_namespaces=True):
                if info["namespace"] == self.core.shared.namespace and (
                    m := ATTENTION_NAME.match(info["name"])
                ):
                    used.add(int(m.group(1)))
        self._next_index = max(self._next_index, max(used, default=-1) + 1) + 1
        return attention_worker_name(self._next_index - 1)

    async def start_worker(self) -> str:
        """Start one more attention worker; its name once it answers `ready`. TimeoutError when no
        node had room for it within `start_timeout_s` (then it is removed again)."""
        name = self._next_name()
        info = self.core.placement_info()
        actor = start_attention_worker(self.scaling, name, info["placement"], info["addresses"])
        self.starting[name] = actor
        try:
            ready = await asyncio.wait_for(actor.ready.remote(), self.scaling.scale.start_timeout_s)
            if ready["placement_version"] != self.core.placement.version:  # (a migration meanwhile)
                info = self.core.placement_info()
                await actor.set_placement.remote(info["placement"], info["addresses"])
        except BaseException as e:
            self._stop(actor)
            if isinstance(e, TimeoutError):
                raise TimeoutError(
                    f"attention worker {name} did not start in {self.scaling.scale.start_timeout_s:.0f}s: "
                    f"no node had room for {self.scaling.bundle or 'it'}"
                ) from None
            raise
        finally:
            self.starting.pop(name, None)
        self.core.attention[name] = actor  # (listed as serving once the watch tick has its `ready`)
        log.info("attention worker %s started", name)
        return name

    def drain_one(self) -> str:
        """List the serving worker holding the fewest requests as draining and stop it in the
        background once it is idle; its name."""
        serving = self.serving
        if len(serving) <= 1:
            raise ValueError("the attention pool needs at least one serving worker")
        load = {n: (x.running + x.waiting) if (x := self.loads.get(n)) else 0 for n in serving}
        name = min(reversed(serving), key=lambda n: load[n])  # (ties: the newest goes)
        self.draining[name] = time.monotonic()
        task = asyncio.get_running_loop().create_task(self._drain(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return name

    async def _drain(self, name: str) -> None:
        since, actor = self.draining[name], self.core.attention[name]
        deadline = since + self.scaling.scale.drain_timeout_s
        try:
            while time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                try:
                    s = await asyncio.wait_for(actor.stats.remote(), 5.0)
                except ray.exceptions.ActorDiedError:
                    break
                except Exception:  # (restarting or slow: ask again)
                    continue
                if s["running"] + s["waiting"] == 0 and time.monotonic() >= since + self.grace_s:
                    break
            else:
                log.warning("attention worker %s still held requests after %.0fs of draining; they move",
                            name, self.scaling.scale.drain_timeout_s)  # fmt: skip
        finally:
            self._forget(name)
            self._stop(actor)
            log.info("attention worker %s drained and stopped", name)

    def _forget(self, name: str) -> None:
        self.core.attention.pop(name, None)
        self.core.attention_state.pop(name, None)
        self.draining.pop(name, None)

    @staticmethod
    def _stop(actor) -> None:
        """Kill it for good (its TP ranks go with it); a router still streaming from it sees a
        death and resumes the request elsewhere."""
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)

    async def resize(self, target: int) -> None:
        """One step toward `target` (the autoscaler's): start one worker or drain one."""
        self.ask_capacity(target)
        current = len(self.serving)
        try:
            if target > current:
                await self.start_worker()
            elif target < current:
                self.drain_one()
            self.last_error = None
        except Exception as e:
            self.last_error = str(e)
            log.warning("resizing the attention pool to %d: %s", target, e)
            self.ask_capacity(len(self.serving))

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
