"""The expert pool: the expert-worker actors the balancer owns, found again after a restart, and
their health.

Expert workers are detached named actors (`moe-expert-{n}` in the cluster's namespace): they
outlive the balancer, so a restarted balancer re-attaches to them by name instead of losing the
pool. A worker that dies is not restarted in place: the balancer re-plans its experts onto the
survivors and starts a fresh worker under a new name (numbered after every worker this balancer
knows of).

Health: a grpc.health.v1 check of every worker, every `health_s` (the balancer's own loop, which
nothing else delays, and whose rounds overlap: a round waiting on a hung worker does not hold the
next). Each check's deadline is drawn from what checks took lately (deadlines.py: 4 x their p99, at
least `hung_after_s`, at most `health_timeout_s`), so a hung worker (SIGSTOP, a stuck process) is
found in about a second (two checks in a row, started `health_s` apart, unanswered within 0.75 s)
and a loaded one is given the time it has been taking. A worker whose gRPC server is unreachable and
whose actor Ray reports dead is dead at once; two failed checks in a row (unanswered within the
deadline: hung; unreachable: a lost node Ray has not declared yet) make it dead too, as does one
failed check on the node of a worker found dead. A hung worker is fenced as the dead are: it
leaves the pool (the healed placement, a new version, does not name it, so no attention worker
sends it a row once switched), and its actor is killed (SIGKILL reaches a stopped process), so a
thawed worker serves nothing.

Machines: the pool asks Ray's autoscaler for room for its target size (`request_capacity`: one
bundle of the worker's resources per worker, a request that replaces the last, so a smaller pool
stops asking), and `ray up` / KubeRay add or remove expert nodes to match. A worker that no node
has room for waits `start_timeout_s` for one (shown as pending in status), then gives up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import ray
from ray.autoscaler.sdk import request_resources

from services.deadlines import Deadlines
from services.experts.client import ExpertClient
from services.experts.server import ExpertWorkerConfig
from services.experts.worker import ExpertWorker
from services.ray_control import actor_state
from services.settings import EXPERT_WORKER_NAME, SharedSettings, expert_worker_name

log = logging.getLogger(__name__)


@dataclass
class Capacity:
    """What the balancer asks Ray's autoscaler for: one list of bundles per pool (expert,
    attention), sent together, since each `request_resources` call replaces the last."""

    asked: dict[str, list[dict[str, float]]] = field(default_factory=dict)

    def ask(self, pool: str, bundle: dict[str, float], count: int) -> None:
        """Room for `count` workers of `pool`, each taking `bundle` (nothing asked for workers
        that take no resources: they fit anywhere)."""
        bundles = [bundle] * count if bundle else []
        if self.asked.get(pool, []) == bundles:
            return
        self.asked[pool] = bundles
        request_resources(bundles=[b for pool_bundles in self.asked.values() for b in pool_bundles])
        log.info("asked Ray's autoscaler for room for %d %s workers of %s", count, pool, bundle)


@dataclass
class Member:
    """One live expert worker."""

    actor: Any  # Ray actor handle
    address: str  # host:port of its gRPC server
    node: str  # Ray node id
    client: ExpertClient  # control channel (health, stats)
    missed: int = 0  # health checks in a row that failed (unanswered within their deadline, or unreachable)


@dataclass
class DeadWorker:
    worker_id: str
    address: str
    detected_at: float  # wall clock
    reason: str
    healed_s: float | None = None  # seconds from detection until steps could flow again


@dataclass
class ExpertPool:
    shared: SharedSettings
    worker_cfg: ExpertWorkerConfig
    resources: dict[str, float] = field(default_factory=dict)
    num_gpus: float = 0.0  # Ray num_gpus of each worker
    hung_after_s: float = 0.75  # the least a health check is waited for (deadlines.py's floor)
    max_missed: int = 2  # checks in a row unanswered within their deadline (hung) or unreachable (dead)
    health_timeout_s: float = 5.0  # the most (and the deadline until enough checks were timed)
    members: dict[str, Member] = field(default_factory=dict)  # worker id -> member, in start order
    dead: list[DeadWorker] = field(default_factory=list)  # history, oldest first
    next_index: int = 0
    slow: dict[str, int] = field(default_factory=dict)  # worker id -> resume attempts it did not answer
    start_timeout_s: float = 900.0  # a worker no node has room for waits this long (a node's boot)
    pending: dict[str, float] = field(default_factory=dict)  # worker id -> wall clock it was asked for
    requested_workers: int | None = None  # workers' worth of room asked of Ray's autoscaler (None: not yet)
    capacity: Capacity = field(default_factory=Capacity)  # (shared with the attention pool)
    health_deadlines: Deadlines = field(init=False)
    # the health checks' threads (each waits up to a deadline on one worker; rounds overlap)
    _health_threads: ThreadPoolExecutor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.health_deadlines = Deadlines(ceiling_s=self.health_timeout_s, floor_s=self.hung_after_s)
        self._health_threads = ThreadPoolExecutor(32, thread_name_prefix="expert-health")

    # ---- machines -----------------------------------------------------------------------
    @property
    def bundle(self) -> dict[str, float]:
        """What one expert worker takes from a node, in Ray's resource names ({} when nothing)."""
        bundle = {name: float(n) for name, n in self.resources.items() if n}
        return bundle | ({"GPU": float(self.num_gpus)} if self.num_gpus else {})

    def request_capacity(self, num_workers: int) -> None:
        """Ask Ray's autoscaler for room for `num_workers` expert workers in all (it counts the
        running ones: `request_resources` asks for a cluster that fits these bundles); the request
        replaces the last one, so a smaller pool stops asking for the rest. Workers that take no
        resources fit anywhere and ask for nothing."""
        if not self.bundle or num_workers == self.requested_workers:
            return
        self.capacity.ask("expert", self.bundle, num_workers)
        self.requested_workers = num_workers

    async def ensure(self, num_workers: int) -> str | None:
        """Ask for room for `num_workers` workers and start the missing ones (concurrently);
        None, or why some did not start (those that did stay in the pool)."""
        await asyncio.to_thread(self.request_capacity, num_workers)
        missing = max(0, num_workers - len(self.members))
        results = await asyncio.gather(*[self.start_worker() for _ in range(missing)], return_exceptions=True)
        errors = [r for r in results if isinstance(r, Exception)]
        return str(errors[0]) if errors else None

    # ---- membership ---------------------------------------------------------------------
    @property
    def workers(self) -> list[str]:
        return list(self.members)

    @property
    def addresses(self) -> dict[str, str]:
        return {w: m.address for w, m in self.members.items()}

    @property
    def nodes(self) -> dict[str, str]:
        return {w: m.node for w, m in self.members.items()}

    async def start_worker(self) -> str:
        """Start a fresh expert worker (detached, never restarted in place); its id. TimeoutError
        when no node had room for it within `start_timeout_s` (the actor is removed)."""
        wid = f"expert-{self.next_index}"
        self.next_index += 1
        actor = ExpertWorker.options(
            name=expert_worker_name(wid),
            namespace=self.shared.namespace,
            resources=self.resources or None,
            num_gpus=self.num_gpus,
            lifetime="detached",
            max_restarts=0,
        ).remote(self.worker_cfg)
        self.pending[wid] = time.time()
        try:
            await asyncio.wait_for(self._join(wid, actor), self.start_timeout_s)
        except TimeoutError:
            self._kill(expert_worker_name(wid))
            raise TimeoutError(
                f"expert worker {wid} did not start in {self.start_timeout_s:.0f}s: no node had room "
                f"for {self.bundle or 'it'}"
            ) from None
        except BaseException:  # (its start failed, or the wait was cancelled: no stray named actor)
            self._kill(expert_worker_name(wid))
            raise
        finally:
            self.pending.pop(wid, None)
        return wid

    async def _join(self, wid: str, actor) -> None:
        address = await actor.start.remote()
        node = await actor.node_id.remote()
        self.members[wid] = Member(actor, address, node, ExpertClient(address, secret=self.shared.secret))

    async def adopt_running(self, timeout_s: float = 30.0, max_slow: int = 3) -> list[str]:
        """Re-attach to the expert workers of this namespace that are still running (after a
        balancer restart); returns their ids. A worker whose process is gone is dropped; one that
        is alive but does not answer within `timeout_s` (a loaded machine) fails this attempt
        (TimeoutError: the caller retries with backoff) and is killed only after `max_slow` such
        attempts in a row: killing a slow but healthy worker would turn a resume into a restart."""
        found, slow = [], []
        for info in ray.util.list_named_actors(all_namespaces=True):
            match = EXPERT_WORKER_NAME.match(info["name"])
            if info["namespace"] != self.shared.namespace or match is None:
                continue
            wid, index = match.group(1), int(match.group(2))
            self.next_index = max(self.next_index, index + 1)
            if wid in self.members:
                found.append(wid)
                continue
            try:
                actor = ray.get_actor(info["name"], namespace=self.shared.namespace)
                await asyncio.wait_for(self._join(wid, actor), timeout_s)
                found.append(wid)
                self.slow.pop(wid, None)
            except TimeoutError:
                self.slow[wid] = self.slow.get(wid, 0) + 1
                if self.slow[wid] >= max_slow:
                    log.warning("expert worker %s did not answer in %d tries; killing it", wid, max_slow)
                    self._kill(info["name"])
                    self.slow.pop(wid)
                else:
                    slow.append(wid)
            except Exception as e:  # gone (its actor died): not part of the pool
                log.warning("expert worker %s is gone (%s); dropping it", wid, e)
                self._kill(info["name"])
        if slow:
            raise TimeoutError(f"expert workers {slow} did not answer within {timeout_s}s; retrying")
        return found

    async def stop_worker(self, wid: str) -> None:
        """Stop a live worker that leaves the pool."""
        member = self.members.pop(wid)
        member.client.close()
        try:
            await asyncio.wait_for(member.actor.stop.remote(), 30)
        except Exception as e:
            log.warning("expert worker %s did not stop cleanly: %s", wid, e)
        finally:
            ray.kill(member.actor)

    def remove_dead(self, wid: str, reason: str) -> DeadWorker | None:
        member = self.members.pop(wid, None)
        if member is None:  # stopped meanwhile
            return None
        member.client.close()
        self._kill(expert_worker_name(wid))
        record = DeadWorker(wid, member.address, time.time(), reason)
        self.dead.append(record)
        del self.dead[:-100]
        return record

    def _kill(self, name: str) -> None:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(ray.get_actor(name, namespace=self.shared.namespace), no_restart=True)

    async def stop_all(self, release_capacity: bool = False) -> None:
        """Stop every worker; `release_capacity`: the app is going, stop asking for machines."""
        for wid in list(self.members):
            await self.stop_worker(wid)
        if release_capacity:
            await asyncio.to_thread(self.request_capacity, 0)

    # ---- health -------------------------------------------------------------------------
    async def check(self) -> dict[str, str]:
        """One health check of every member, concurrently, each within its measured deadline:
        {worker id: why it is dead or hung} for those that are. A worker whose check failed this
        round on the node of one found dead is dead too (a lost node takes its workers at once).
        Rounds may overlap (the balancer starts one every `health_s` without waiting for the last),
        so a hung worker's second missed check comes `health_s` after its first, not a deadline."""
        members = dict(self.members)
        timeout_s = self.health_deadlines.timeout_s(1)
        loop = asyncio.get_running_loop()
        answers = await asyncio.gather(
            *[loop.run_in_executor(self._health_threads, self._ask, m, timeout_s) for m in members.values()]
        )
        dead = {}
        for (wid, member), (outcome, detail, seconds) in zip(members.items(), answers, strict=True):
            if self.members.get(wid) is not member:  # (left the pool meanwhile)
                continue
            if outcome == "answered":
                self.health_deadlines.observe(1, seconds)
                member.missed = 0
                if detail != "SERVING":
                    dead[wid] = f"health status {detail}"
            elif outcome == "gone":
                dead[wid] = f"unreachable ({detail}) and its actor is dead"
            elif outcome in ("hung", "unreachable"):
                member.missed += 1  # (one failure may be a hiccup of a loaded machine)
                if member.missed >= self.max_missed:
                    dead[wid] = (
                        f"hung: {member.missed} health checks in a row failed, the last unanswered in {timeout_s:.2f}s"
                        if outcome == "hung"
                        else f"{member.missed} health checks in a row failed, the last unreachable ({detail})"
                    )
        lost_nodes = {self.members[w].node: w for w in dead if w in self.members}
        for wid, member in self.members.items():
            if wid not in dead and member.missed and member.node in lost_nodes:
                dead[wid] = f"its check failed with {lost_nodes[member.node]} on its node dead"
        return dead

    def _ask(self, member: Member, timeout_s: float) -> tuple[str, str | None, float | None]:
        """One health check (on a health thread): ("answered", its status, seconds), "hung"
        (unanswered within the deadline), "unreachable" (its code), "gone" (unreachable and Ray
        says its actor is dead), or "skipped" (this balancer stalled; the worker being stopped)."""
        t0 = time.monotonic()
        try:
            status = member.client.health(timeout=timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                if Deadlines.caller_stalled(time.monotonic() - t0, timeout_s):  # (this balancer was)
                    return "skipped", None, None
                return "hung", None, None
            if self._process_gone(member):
                return "gone", f"{e.code().name}: {e.details()}", None
            # (a lost node Ray has not declared yet, a server that failed, a blip)
            return "unreachable", e.code().name, None
        except ValueError:  # its channel was closed: the worker is being stopped
            return "skipped", None, None
        return "answered", status, time.monotonic() - t0

    @staticmethod
    def _process_gone(member: Member) -> bool:
        """Ray's word on an unreachable worker: True when the GCS holds its actor dead."""
        return actor_state(member.actor) == "DEAD"
