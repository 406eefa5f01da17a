"""The attention worker: an `Engine` (scheduler, paged latent cache, MLA, gate, shared experts,
LM head, sampler) stepping on its own thread, with routed experts behind an expert backend
(`RemoteExperts` over gRPC in the cluster).

`AttentionService` is the pure shell around the engine thread (no Ray): requests and control
commands enter through a queue and are applied at step boundaries, outputs leave through
per-request asyncio queues. `AttentionWorker` is the Ray actor that wraps it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import ray

from services.attention.leases import OwnerLeases
from services.attention.load_reporter import LoadReporter, LoadReporterConfig
from services.attention.ranks import RankGroup
from services.attention.tensor_parallel import lead
from services.dataplane.placement import Placement
from services.dataplane.remote_experts import DispatchConfig, RemoteExperts
from services.deadlines import Deadlines
from services.engine.engine import Engine, EngineConfig, load_engine
from services.engine.outputs import Refusal, RequestOutput, StepFailed, StepResult
from services.engine.sampling import SamplingParams
from services.engine.scheduler import QueueFullError
from services.gpus import limit_gpu_memory
from services.hf_models import ensure_local
from services.model.moe import LocalExperts
from services.model.mtp import served_experts
from services.settings import BALANCER_NAME, AttentionSettings, SharedSettings, build_config

log = logging.getLogger(__name__)


@dataclass
class AttentionWorkerConfig:
    engine: EngineConfig
    worker_id: str = "attn-0"
    tp: int = 1  # tensor-parallel ranks (processes on this node); heads split, latent cache replicated
    gpus: float = 0.0  # Ray num_gpus of each follower rank (rank 0's is the actor's own)
    # no redis_url: loads not reported; the data plane's transport, spin and secret (DispatchConfig's)
    shared: SharedSettings = field(default_factory=SharedSettings)
    dispatch_timeout_s: float = 10.0
    step_retry_s: float = 30.0  # a failing step is retried this long before its requests fail
    step_retry_wait_s: float = 0.05  # pause between retries of a failing step
    idle_wait_s: float = 0.05
    owner_timeout_s: float = 5.0  # a request whose router replica renewed no lease this long is aborted
    # the engine thread is stuck (a deadlock, a hung kernel) when one step attempt (or command at a
    # step boundary) runs past max(stuck_floor_s, the data plane's largest call deadline + 4 x the
    # p99 of step attempts): a legitimate step may wait out one dispatch deadline on a frozen
    # expert worker (up to dispatch_timeout_s, ~1.5 s learned) on top of its own compute (a long
    # prefill chunk on a loaded CPU, rarer than the p99); `ready()` reports it and the router and
    # balancer treat it as hung. Before 8 attempts are timed their part is stuck_ceiling_s.
    stuck_floor_s: float = 10.0
    stuck_ceiling_s: float = 120.0

    @classmethod
    def from_settings(
        cls, settings: AttentionSettings, shared: SharedSettings, model: str, worker_id: str = ""
    ) -> AttentionWorkerConfig:
        """A cluster's attention worker: the attention and shared settings (services/settings.py)
        named like a field of EngineConfig or of this config go to it as they are."""
        engine = build_config(EngineConfig, settings, shared, model=model, device=settings.device)
        return build_config(cls, settings, engine=engine, worker_id=worker_id, shared=shared)

    @property
    def expert_transport(self) -> str:
        """DispatchConfig.transport: auto (shm on this node, else TCP, else gRPC), shm, tcp, grpc."""
        return self.shared.transport

    @property
    def expert_spin_us(self) -> float:
        """DispatchConfig.spin_us."""
        return self.shared.spin_us


@dataclass
class StepTimes:
    """Cumulative seconds per part of the step, and counters."""

    steps: int = 0
    tokens: int = 0
    step_s: float = 0.0
    expert_wait_s: float = 0.0  # time blocked in combine (routed experts not back yet)
    failed_steps: int = 0
    max_step_s: float = 0.0

    def add(self, result: StepResult) -> None:
        self.steps += 1
        self.tokens += result.num_tokens
        self.step_s += result.seconds
        self.max_step_s = max(self.max_step_s, result.seconds)
        self.expert_wait_s += result.expert_wait_s


@dataclass
class _Command:
    kind: str  # add | abort | call
    args: tuple = ()
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class AttentionService:
    """Runs `engine` on a dedicated thread; thread-safe entry points for an asyncio caller.

    The thread's loop: apply queued commands (new requests, aborts, calls such as a placement
    switch) at the step boundary, run `engine.step()`, hand its outputs to the requests' queues
    and its expert load to the load reporter.
    """

    def __init__(
        self,
        cfg: AttentionWorkerConfig,
        engine: Engine,
        load_reporter: LoadReporter | None = None,
        dispatch_deadline_s: Callable[[], float] = lambda: 0.0,
    ):
        """`dispatch_deadline_s`: the data plane's largest call deadline now (called on the engine
        thread, which is the one that updates it)."""
        self.cfg, self.engine, self.load_reporter = cfg, engine, load_reporter
        self.dispatch_deadline_s = dispatch_deadline_s
        self.attempts = Deadlines(ceiling_s=cfg.stuck_ceiling_s, floor_s=1.0)  # step attempts' seconds
        # (what, since when, its deadline s) of the engine thread's work under way; None: between
        self._busy: tuple[str, float, float] | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.times = StepTimes()
        # (end time, seconds, sequences, tokens, placement version) per step
        self.step_trace: deque[tuple[float, float, int, int, int]] = deque(maxlen=20_000)
        self.placement_version = 0  # of the expert backend (0: experts in process)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"{cfg.worker_id}-engine", daemon=True)
        self._thread.start()

    # ---- entry points (any thread) ------------------------------------------------------
    async def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        resumed: tuple[int, int] = (0, 0),
    ) -> asyncio.Queue:
        """Queue a request (`resumed`: see Engine.add_request); returns the queue its
        RequestOutputs arrive on. Raises the engine's RequestError / QueueFullError / ValueError
        for requests it refuses."""
        out: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), out)
        try:
            await self._call("add", prompt_ids, params, request_id, resumed)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return out

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        resumed: tuple[int, int] = (0, 0),
    ) -> AsyncIterator[RequestOutput]:
        q = await self.submit(prompt_ids, params, request_id, resumed)
        finished = False
        try:
            while not finished:
                out: RequestOutput = await q.get()
                finished = out.finished
                yield out
        finally:
            if not finished:  # the consumer went away: free the request's blocks
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Command("abort", (request_id,)))

    async def between_steps(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the engine thread at the next step boundary (placement switches, stats,
        tests); returns its result."""
        return await self._call("call", fn)

    async def _call(self, kind: str, *args):
        cmd = _Command(kind, args)
        self._commands.put(cmd)
        return await asyncio.wrap_future(cmd.done)

    def stats(self) -> dict:
        return {
            "worker_id": self.cfg.worker_id,
            **self.engine.stats(),
            "placement_version": self.placement_version,
            "times": asdict(self.times),
            # mean seconds a step waited for its routed experts, per MoE layer (the data plane's
            # cost beyond the attention side's own work: docs/experts.md)
            # (speculating, the MTP pass's MoE layer is one more round trip per step)
            "expert_wait_per_moe_layer_s": self.times.expert_wait_s
            / max(1, self.times.steps * (self.engine.cfg.num_moe_layers + (self.engine.spec is not None))),
            "load_reporter": self.load_reporter.stats() if self.load_reporter else None,
        }

    def stuck(self) -> str | None:
        """Why the engine thread is thought stuck (its work under way ran past its deadline), or
        None. Read from any thread."""
        busy = self._busy  # (one read: the engine thread replaces it whole)
        if busy is None:
            return None
        what, since, deadline_s = busy
        running_s = time.monotonic() - since
        if running_s <= deadline_s:
            return None
        return f"the engine thread has been in {what} for {running_s:.1f}s (its deadline {deadline_s:.1f}s)"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self.load_reporter is not None:
            self.load_reporter.close()

    # ---- the engine thread --------------------------------------------------------------
    def _begin(self, what: str) -> float:
        """The engine thread starts `what` (a step attempt, a command): stuck if it runs past
        max(stuck_floor_s, the largest dispatch deadline + 4 x p99 of step attempts)."""
        deadline_s = max(self.cfg.stuck_floor_s, self.dispatch_deadline_s() + self.attempts.timeout_s(1))
        now = time.monotonic()
        self._busy = (what, now, deadline_s)
        return now

    def _apply(self, cmd: _Command) -> None:
        try:
            self._begin(f"a command ({cmd.kind})")
            if cmd.kind == "add":
                prompt_ids, params, request_id, resumed = cmd.args
                cmd.done.set_result(self.engine.add_request(prompt_ids, params, request_id, resumed))
            elif cmd.kind == "abort":
                (request_id,) = cmd.args
                out = self.engine.abort(request_id)
                if out is not None:
                    self._emit(out)
                cmd.done.set_result(None)
            elif cmd.kind == "call":
                cmd.done.set_result(cmd.args[0]())
        except Exception as e:  # refused request or bad command: report to the caller
            cmd.done.set_exception(e)
        finally:
            self._busy = None

    def _emit(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        loop, q = stream
        if out.finished:
            self._streams.pop(out.request_id, None)
        try:
            loop.call_soon_threadsafe(q.put_nowait, out)
        except RuntimeError:  # the consumer's event loop is gone: nobody reads this request
            self._streams.pop(out.request_id, None)
            self.engine.abort(out.request_id)

    def _loop(self) -> None:
        failing_since: dict[str, float] = {}  # request id -> when the first failed step it was in ran
        while not self._stop.is_set():
            try:
                block = not self.engine.has_unfinished()
                cmd = (
                    self._commands.get(timeout=self.cfg.idle_wait_s) if block else self._commands.get_nowait()
                )
                self._apply(cmd)
                while True:  # drain everything queued before this step
                    self._apply(self._commands.get_nowait())
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            try:
                result = self._step()
                failing_since.clear()
            except StepFailed as e:
                self.times.failed_steps += 1
                now = time.monotonic()
                expired = [
                    r for r in e.request_ids if now - failing_since.setdefault(r, now) > self.cfg.step_retry_s
                ]
                if expired:  # each request gets step_retry_s of retries, counted from its own first failure
                    log.error("%s: steps failing for %.0fs, failing %d requests: %s",
                              self.cfg.worker_id, self.cfg.step_retry_s, len(expired), e)  # fmt: skip
                    for out in self.engine.fail(expired, str(e)):
                        self._emit(out)
                    for r in expired:
                        failing_since.pop(r, None)
                else:
                    if self.times.failed_steps % 20 == 1:
                        log.warning("%s: step failed (%s); retrying", self.cfg.worker_id, e)
                    time.sleep(self.cfg.step_retry_wait_s)
                continue
            except Exception as e:  # a bug outside the model run: end what the engine holds, keep serving
                log.exception("%s: step failed outside the model run", self.cfg.worker_id)
                for out in self.engine.fail(
                    self.engine.unfinished_ids(), f"internal error: {type(e).__name__}: {e}"
                ):
                    self._emit(out)
                continue
            self._finish(result)

    def _step(self) -> StepResult:
        """One step attempt, timed (failed ones too: their time, up to a dispatch deadline, is
        legitimate)."""
        started = self._begin("a step")
        try:
            return self.engine.step()
        finally:
            self.attempts.observe(1, time.monotonic() - started)
            self._busy = None

    def _finish(self, result: StepResult) -> None:
        if not result.num_seqs:
            return
        self.times.add(result)
        self.step_trace.append(
            (time.time(), result.seconds, result.num_seqs, result.num_tokens, self.placement_version)
        )
        if self.load_reporter is not None:  # (first: a client that has its tokens finds their counts taken)
            self.load_reporter.add(result.expert_load)
        for out in result.outputs:
            self._emit(out)


def _current_placement(shared: SharedSettings, placement: dict, addresses: dict) -> tuple[dict, dict]:
    """After a restart: the balancer's current placement (the constructor's may be stale); the
    given one when the balancer does not answer (its watch tick pushes the current one later)."""
    try:
        balancer = ray.get_actor(BALANCER_NAME, namespace=shared.namespace)
        info = ray.get(balancer.placement.remote(), timeout=10)
        return info["placement"], info["addresses"]
    except Exception as e:
        log.warning("restarted without the balancer's placement (%s); using v%s", e, placement["version"])
        return placement, addresses


def refusal(e: Exception) -> Refusal:
    """A refused request, as the first (and last) item of the output stream."""
    status = 429 if isinstance(e, QueueFullError) else 400
    return Refusal(status, str(e), getattr(e, "param", None))


# (lease renewals and aborts in a group of their own: a worker holding ~1000 streams answers them)
@ray.remote(num_cpus=0, max_concurrency=1000, concurrency_groups={"control": 16})
class AttentionWorker:
    """Ray actor: loads the attention side of the model and serves requests as output streams.

    Routed experts run on the expert workers of `placement` (gRPC), or in process when
    `placement` is None (a single-process worker, for tests and laptops without expert workers).
    """

    def __init__(
        self, cfg: AttentionWorkerConfig, placement: dict | None = None, addresses: dict | None = None
    ):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        limit_gpu_memory()  # (part of a shared GPU: held to its share)
        self.remote_experts: RemoteExperts | None = None
        if placement is not None and ray.get_runtime_context().was_current_actor_reconstructed:
            placement, addresses = _current_placement(cfg.shared, placement, addresses)

        def make_experts(mcfg, reader, dtype):
            if placement is None:  # single process: every routed expert here
                mtp = cfg.engine.speculative_tokens > 0  # (the MTP module's experts too: speculative.py)
                return LocalExperts.load_all(reader, mcfg, dtype, mtp=mtp).to(cfg.engine.device)
            dispatch = DispatchConfig(timeout_s=cfg.dispatch_timeout_s, secret=cfg.shared.secret,
                                      transport=cfg.expert_transport, spin_us=cfg.expert_spin_us,
                                      device=str(cfg.engine.device))  # fmt: skip
            served = served_experts(mcfg, cfg.engine.speculative_tokens > 0)  # (the MTP module's layer too)
            self.remote_experts = RemoteExperts(served, Placement.from_dict(placement), addresses, dispatch)
            return self.remote_experts

        # (a model id's snapshot, resolved by the launcher on its node: the same commit on this one)
        cfg = dataclasses.replace(
            cfg, engine=dataclasses.replace(cfg.engine, model=ensure_local(cfg.engine.model))
        )
        mcfg, model, experts, tokenizer = load_engine(cfg.engine, make_experts)
        self.ranks: RankGroup | None = None
        on_batches = on_mtp_pass = None
        if cfg.tp > 1:  # rank 0 of a tensor-parallel group (tensor_parallel.py)
            self.ranks = RankGroup(cfg.engine, cfg.tp, cfg.gpus)
            experts, on_batches, on_mtp_pass = lead(self.ranks.group, model, experts)
        engine = Engine(mcfg, model, experts, cfg.engine, tokenizer, on_batches, on_mtp_pass)
        reporter = None
        if cfg.shared.redis_url:
            served = served_experts(mcfg, engine.spec is not None)  # (the MTP pass's routed choices too)
            reporter = LoadReporter(
                LoadReporterConfig(cfg.shared), served.num_moe_layers, mcfg.n_routed_experts
            )
        self.cfg = cfg
        self.service = AttentionService(cfg, engine, reporter, self._dispatch_deadline_s)
        self.service.placement_version = 0 if placement is None else int(placement["version"])
        self.leases = OwnerLeases(cfg.owner_timeout_s)
        self._watchdog: asyncio.Task | None = None

    def _dispatch_deadline_s(self) -> float:
        """The data plane's largest call deadline now, over the call sizes seen (the ceiling before
        any; 0: experts in process): the longest a step may wait on a frozen expert worker. (A
        size never sent before borrows a deadline that may be longer, up to the ceiling: such a
        step meeting a frozen expert worker past the stuck floor gets this worker fenced too, its
        streams moved with the same tokens.) Called on the engine thread, which updates them."""
        if self.remote_experts is None:
            return 0.0
        return self.remote_experts.deadlines.longest_s()

    async def generate(
        self,
        prompt_ids: list[int],
        params: dict,
        request_id: str,
        resumed: tuple[int, int] = (0, 0),
        owner: str | None = None,
    ):
        """Stream of `RequestOutput`s (call with num_returns="streaming"); a refused request
        yields one `Refusal`. `resumed`: a request moved here from a dead worker (its last
        resumed[0] prompt tokens are its own output, resumed[1] characters of it already sent).
        `owner`: the router replica that asked (its lease, `keepalive`, lapsing aborts the request)."""
        if owner is not None:
            self.leases.start(owner, request_id, time.monotonic())
            self._watch_leases()
        stream = self.service.generate(prompt_ids, SamplingParams(**params), request_id, tuple(resumed))
        try:
            async for out in stream:
                yield out
        except (ValueError, QueueFullError) as e:  # refused when submitted: nothing streamed yet
            yield refusal(e)
        finally:
            if owner is not None:
                self.leases.end(owner, request_id)
            await stream.aclose()  # a caller that went away aborts the request (see AttentionService)

    @ray.method(concurrency_group="control")
    async def keepalive(self, owner: str) -> None:
        """A router replica renews its lease: its requests here still have a caller."""
        self.leases.renew(owner, time.monotonic())

    def _watch_leases(self) -> None:
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._abort_orphans())

    async def _abort_orphans(self) -> None:
        """Every second: abort the requests of router replicas whose lease lapsed (a dead replica's
        generations would otherwise run to their last token for nobody)."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            if now - last > 2.0:  # this loop itself was held up: its renewals may be queued behind
                self.leases.renew_all(now)
            last = now
            for request_id in self.leases.lapsed(now):
                log.warning("aborting %s: its router replica renewed no lease for %.0fs",
                            request_id, self.leases.timeout_s)  # fmt: skip
                self.service.abort(request_id)

    @ray.method(concurrency_group="control")
    async def abort(self, request_id: str) -> None:
        self.service.abort(request_id)

    async def set_placement(self, placement: dict, addresses: dict) -> int:
        """Switch to a new placement at the next step boundary; returns (its version) once no step
        uses the previous one any more."""
        new = Placement.from_dict(placement)

        def switch() -> int:
            self.remote_experts.set_placement(new, addresses)
            self.service.placement_version = new.version
            return new.version

        if self.remote_experts is None:
            raise ValueError("this attention worker runs its experts in process")
        return await self.service.between_steps(switch)

    async def placement(self) -> dict | None:
        """The placement this worker routes with (None: experts in process)."""
        return self.remote_experts.placement.to_dict() if self.remote_experts else None

    async def pid(self) -> int:
        return os.getpid()

    async def stats(self) -> dict:
        dispatch = None
        if self.remote_experts is not None:
            experts = self.remote_experts
            dispatch = {
                **asdict(experts.stats),
                "transport": experts.transport_of(),
                "transport_events": experts.transport_events(),
                "deadlines_s": experts.deadlines.snapshot(),
            }
        return {**self.service.stats(), "dispatch": dispatch, "ranks": await self._ranks()}

    async def _ranks(self) -> list[dict]:
        """Each tensor-parallel rank: its pid and latent cache bytes (every rank holds a replica)."""
        own = {"rank": 0, "pid": os.getpid(), "kv_cache_bytes": self.service.engine.cache.nbytes}
        followers = self.ranks.followers if self.ranks else []
        return [own, *await asyncio.gather(*[f.info.remote() for f in followers])]

    async def step_trace(self, since: float = 0.0) -> list[tuple[float, float, int, int, int]]:
        """(wall-clock end, duration s, sequences, tokens, placement version) of recent steps that
        ended after `since`."""
        return [t for t in self.service.step_trace if t[0] > since]

    async def ready(self) -> dict:
        """Liveness: answered by the event loop; `stuck`: why its engine thread is thought stuck
        (AttentionService.stuck), or None. A stuck worker is hung to the router and the balancer."""
        return {"worker_id": self.cfg.worker_id, "placement_version": self.service.placement_version,
                "max_model_len": self.service.engine.max_model_len, "tp": self.cfg.tp,
                "stuck": self.service.stuck()}  # fmt: skip

    async def shutdown(self) -> None:
        if self.ranks is not None:
            await self.service.between_steps(self.ranks.stop)
        self.service.close()
