"""The router's logic without HTTP or Serve: request validation helpers, worker choice (prefix
affinity, least outstanding tokens, failover), the per-request output streams and their
merging. `app.py` wires it to FastAPI routes in a Ray Serve deployment."""

import asyncio
import contextlib
import hmac
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import ray
from fastapi import Request

from services.deadlines import Deadlines
from services.engine.outputs import Refusal, RequestOutput
from services.engine.tokenizer import Tokenizer
from services.model.kv_cache import BLOCK_SIZE
from services.settings import NAMESPACE

from .affinity import PrefixAffinity
from .metrics import RouterMetrics
from .protocol import APIError

log = logging.getLogger(__name__)


@dataclass
class RouterConfig:
    model_dir: str
    served_model_name: str  # several, comma-separated: all accepted, the first is the API's name
    attention_workers: list[str]  # Ray actor names
    namespace: str = NAMESPACE  # of the attention workers and the balancer (SharedSettings.namespace)
    balancer: str | None = None  # Ray actor name of the balancer (placement/loads for operators)
    api_key: str | None = field(default=None, repr=False)
    max_model_len: int = 4096
    default_completion_max_tokens: int = 16
    max_body_bytes: int = 8 << 20  # larger request bodies get 413 before they are parsed
    max_prompts: int = 256  # prompts in one completions request
    max_prompt_chars: int = 1 << 20  # characters of one text prompt, checked before tokenizing
    chat_template: str | None = None  # a Jinja template or its file, in place of the checkpoint's
    max_logprob_entries: int = 1 << 22  # choices x tokens x (1 + top logprobs) (+ prompt logprobs) per answer
    retry_after_s: int = 1
    prefix_caching: bool = True  # affinity routing by prompt prefix; n > 1 choices prefill once
    affinity_max_imbalance_tokens: int = 8192  # how much busier the worker holding a prefix may be
    max_failovers: int = 3  # times one request moves on after its attention worker died
    failover_wait_s: float = 60.0  # how long a request waits for a live attention worker
    # a stream with no output for 4 x its worker's p99 gap between outputs (at least stall_floor_s)
    # pings the worker; no answer within 4 x the p99 of pings (at least ping_floor_s): hung
    stall_floor_s: float = 0.5
    ping_floor_s: float = 1.0
    ready_timeout_s: float = 5.0
    keepalive_s: float = 1.0  # this replica renews its lease on every attention worker this often
    pool_refresh_s: float = 1.0  # how often the attention pool's members are read from the balancer


class _WorkerDied(Exception):
    """The attention worker serving a stream died."""


class _StreamCut(Exception):
    """A worker's output stream ended before its request finished."""


class _WorkerHung(_StreamCut):
    """A worker's stream stalled and the worker did not answer a ping in time (frozen), or
    answered that its engine thread is stuck."""


class _QueueFull(Exception):
    """The attention worker refused the request: its waiting queue is full."""

    def __init__(self, error: APIError):
        super().__init__(error.message)
        self.error = error


def _stuck(ready_answer) -> str | None:
    """Why an attention worker's `ready` answer says its engine thread is stuck, or None."""
    return ready_answer.get("stuck") if isinstance(ready_answer, dict) else None


@dataclass
class Sub:
    """One generation (prompt x n) of a request."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: dict
    request_id: str


class RouterCore:
    """Everything the HTTP routes do, without FastAPI/Serve (so it can be driven directly)."""

    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.tokenizer = Tokenizer.from_dir(cfg.model_dir, cfg.chat_template)
        self.workers = {n: ray.get_actor(n, namespace=cfg.namespace) for n in cfg.attention_workers}
        self.outstanding = dict.fromkeys(self.workers, 0)
        self.serving = set(self.workers)  # the workers new requests may go to (not draining)
        self._refresh: asyncio.Task | None = None
        self.draining = False  # shutting down: new requests are refused
        self.affinity = PrefixAffinity(max_imbalance_tokens=cfg.affinity_max_imbalance_tokens)
        self.down: dict[str, float] = {}  # attention workers that died: name -> since (monotonic)
        # liveness measured, not assumed: gaps between a stream's outputs per worker, ping times
        self.gaps: dict[str, Deadlines] = {}
        self.pings = Deadlines(ceiling_s=max(3.0, cfg.ping_floor_s), floor_s=cfg.ping_floor_s)
        self._pinging: dict[str, asyncio.Task] = {}
        self._probes: set[asyncio.Task] = set()
        self._rr = itertools.count()
        self.metrics = RouterMetrics()
        # this replica's id on the attention workers: its requests there are aborted when it stops
        # renewing its lease (it died: attention/leases.py)
        self.owner = uuid.uuid4().hex
        self._keepalive: threading.Thread | None = None

    @property
    def model_names(self) -> list[str]:
        """The names the API answers to (`--served-model-name a b`: both), the first its own."""
        return [n for n in self.cfg.served_model_name.split(",") if n]

    # ---- helpers ------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if not self.cfg.api_key:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {self.cfg.api_key}".encode()):
            raise APIError(401, "missing or invalid API key", code="invalid_api_key")

    def check_open(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", retry_after=self.cfg.retry_after_s)

    def check_model(self, model: str) -> None:
        if model not in (*self.model_names, self.cfg.model_dir):
            raise APIError(404, f"the model `{model}` does not exist", param="model", code="model_not_found")

    def check_prompts(self, prompts: list[str | list[int]]) -> list[str | list[int]]:
        """Prompt count and size limits, checked before anything is tokenized."""
        if len(prompts) > self.cfg.max_prompts:
            raise APIError(400, f"at most {self.cfg.max_prompts} prompts per request", param="prompt")
        for p in prompts:
            if isinstance(p, str) and len(p) > self.cfg.max_prompt_chars:
                raise APIError(
                    400, f"a prompt has more than {self.cfg.max_prompt_chars} characters", param="prompt"
                )
            if isinstance(p, list) and len(p) > self.cfg.max_model_len:
                raise APIError(400, f"a prompt has more than {self.cfg.max_model_len} tokens", param="prompt")
        return prompts

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer else ""

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send prompts as token ids", param="prompt")
        return self.tokenizer.encode(prompt)

    def token_str(self, token: int) -> str:
        return self.tokenizer.token_text(token) if self.tokenizer else f"token_id:{token}"

    def check_length(self, prompt_ids: list[int], max_tokens: int) -> None:
        if len(prompt_ids) + max_tokens > self.cfg.max_model_len:
            raise APIError(
                400,
                f"this model's maximum context length is {self.cfg.max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)} tokens and max_tokens is {max_tokens}",
                param="max_tokens",
                code="context_length_exceeded",
            )

    def subrequests(self, prompts: list[list[int]], params, n: int, rid: str) -> list[Sub]:
        subs = []
        for p, ids in enumerate(prompts):
            self.check_length(ids, params.max_tokens)
            for i in range(n):
                d = dict(vars(params))
                if params.seed is not None:
                    d["seed"] = params.seed + i  # n samples from one seed: seed, seed+1, ...
                subs.append(Sub(p * n + i, p, ids, d, f"{rid}-{p * n + i}"))
        return subs

    async def run(self, sub: Sub) -> AsyncIterator[RequestOutput]:
        """The output stream of one sub-request; aborts it if the consumer leaves.

        Failover: when its attention worker dies, the request goes on on a live worker (the dead
        one is skipped until it answers again). A request that had produced no token yet is just
        resubmitted; one that had is resumed: its produced tokens are appended to the prompt
        (re-prefilled there) and it asks for the tokens still missing, so the stream continues
        where it stopped (its text too: the new worker's detokenizer starts from the tokens and
        characters already sent, so a character or stop string across the seam comes out right).
        Greedy decoding continues exactly; sampling continues from a fresh generator state. A
        moved request that finds the live worker's queue full waits and tries again."""
        produced: list[int] = []
        sent_chars = 0
        for attempt in itertools.count():
            prompt = sub.prompt_ids + produced
            params = {**sub.params, "max_tokens": sub.params["max_tokens"] - len(produced),
                      "min_tokens": max(0, sub.params.get("min_tokens", 0) - len(produced))}  # fmt: skip
            request_id = sub.request_id if attempt == 0 else f"{sub.request_id}-resumed-{attempt}"
            worker = await self.pick_worker(prompt, sub.params.get("cache_salt"))
            stream = self._stream(worker, prompt, params, request_id, (len(produced), sent_chars))
            try:
                async with contextlib.aclosing(stream):
                    async for out in stream:
                        produced += out.token_ids
                        sent_chars += len(out.text)
                        yield out
                return
            except (_WorkerDied, _QueueFull) as e:
                if isinstance(e, _QueueFull) and attempt == 0:  # a new request: the client retries
                    raise e.error from None
                if attempt >= self.cfg.max_failovers:
                    raise APIError(503, f"{e}; gave up after {attempt + 1} attempts",
                                   retry_after=self.cfg.retry_after_s) from None  # fmt: skip
                if isinstance(e, _QueueFull):
                    await asyncio.sleep(0.5 * (attempt + 1))
                self.metrics.failovers.labels("resumed" if produced else "resubmitted").inc()
                log.warning("%s; %s %s on another worker", e, "resuming" if produced else "resubmitting",
                            sub.request_id)  # fmt: skip

    async def _stream(self, name: str, prompt: list[int], params: dict, request_id: str, resumed=(0, 0)):
        """One worker's output stream; raises _WorkerDied when the worker dies meanwhile, _QueueFull
        when it refuses the request for a full queue."""
        cost = len(prompt) + params["max_tokens"]
        self.outstanding[name] += cost
        actor = self.workers[name]
        finished = False
        try:
            self._keep_leases()
            stream = actor.generate.options(num_returns="streaming").remote(
                prompt, params, request_id, resumed, self.owner
            )
            while True:
                try:
                    ref = await self._next_output(name, stream)
                except StopAsyncIteration:
                    break
                out: RequestOutput | Refusal = await ref
                if isinstance(out, Refusal):
                    finished = True
                    retry = self.cfg.retry_after_s if out.status == 429 else None
                    error = APIError(out.status, out.message, param=out.param, retry_after=retry)
                    if out.status == 429:
                        raise _QueueFull(error)
                    raise error
                finished = out.finished
                if out.finish_reason == "error":
                    raise APIError(503, f"generation failed: {out.error}", retry_after=self.cfg.retry_after_s)
                yield out
                if finished:
                    return
            # the stream ended without the request's last output: its node went away with the
            # stream (seen when a whole attention node dies), which is a death like any other
            raise _StreamCut(f"the stream of attention worker {name} ended before its request finished")
        except ray.exceptions.RayTaskError:  # generate itself raised: not a death
            raise
        except (ray.exceptions.RayError, _StreamCut) as e:  # the actor, its node or its objects gone
            finished = True
            self.mark_down(name, hung=str(e) if isinstance(e, _WorkerHung) else None)
            if not isinstance(e, ray.exceptions.ActorDiedError):  # maybe alive: don't compute it twice
                actor.abort.remote(request_id)
            what = "is hung" if isinstance(e, _WorkerHung) else "died"
            raise _WorkerDied(f"attention worker {name} {what} ({type(e).__name__}: {e})") from e
        finally:
            self.outstanding[name] -= cost
            if not finished:
                actor.abort.remote(request_id)

    # ---- attention worker health --------------------------------------------------------
    async def _next_output(self, name: str, stream):
        """The next item of `name`'s output stream. While none comes for the stall deadline (4 x
        the p99 of this worker's gaps between outputs, at least `stall_floor_s`) the worker is
        pinged; a worker that does not answer within the ping deadline, or answers that its engine
        thread is stuck (AttentionService.stuck), is hung (_WorkerHung): its streams move as a dead
        worker's do. A slow but live worker (a long prefill, a full batch) answers and is waited for."""
        gaps = self.gaps.get(name)
        if gaps is None:
            gaps = self.gaps[name] = Deadlines(ceiling_s=5.0, floor_s=self.cfg.stall_floor_s)
        t0 = time.monotonic()
        pending = asyncio.ensure_future(stream.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({pending}, timeout=gaps.timeout_s(1))
                if done:
                    item = pending.result()  # (StopAsyncIteration at the stream's end)
                    gaps.observe(1, time.monotonic() - t0)
                    return item
                why = await self._hung(name)
                if why is not None:
                    raise _WorkerHung(f"no output for {time.monotonic() - t0:.1f}s and {why}")
        finally:
            if not pending.done():
                pending.cancel()

    async def _hung(self, name: str) -> str | None:
        """Why attention worker `name` is hung (None: it is not): no answer to a ping within the
        measured deadline, or an answer that its engine thread is stuck (a deadlocked step: its
        event loop answers, its streams get nothing). One ping per worker at a time, shared by
        every stream waiting on it."""
        task = self._pinging.get(name)
        if task is None or task.done():
            task = self._pinging[name] = asyncio.ensure_future(self._ping(name))
        return await asyncio.shield(task)

    async def _ping(self, name: str) -> str | None:
        deadline, t0 = self.pings.timeout_s(1), time.monotonic()
        try:
            answer = await asyncio.wait_for(self.workers[name].ready.remote(), deadline)
        except Exception as e:  # noqa: BLE001 (no answer in time, or dead: either way not serving)
            if isinstance(e, TimeoutError) and Deadlines.caller_stalled(time.monotonic() - t0, deadline):
                return None  # (this replica itself was stalled: the worker is given another chance)
            log.warning(
                "attention worker %s: no answer to a ping in %.2fs (%s)", name, deadline, type(e).__name__
            )
            return f"no answer to a ping within {deadline:.2f}s"
        self.pings.observe(1, time.monotonic() - t0)
        stuck = _stuck(answer)
        if stuck:
            log.warning("attention worker %s answers a ping, but %s", name, stuck)
            return f"its ping answer says {stuck}"
        return None

    def _fence(self, name: str, reason: str) -> None:
        """Ask the balancer to fence hung worker `name` (it checks for itself, then kills it and
        Ray restarts it); fire and forget."""
        if not self.cfg.balancer:
            log.warning("attention worker %s is hung (%s); no balancer to fence it", name, reason)
            return
        try:
            balancer = ray.get_actor(self.cfg.balancer, namespace=self.cfg.namespace)
            balancer.fence_attention.remote(name, reason)
        except Exception as e:  # noqa: BLE001 (the balancer restarting: the worker stays out until it answers)
            log.warning("could not ask the balancer to fence %s: %s", name, e)

    def _keep_leases(self) -> None:
        if self._keepalive is None:
            self._keepalive = threading.Thread(target=self._renew_leases, name="leases", daemon=True)
            self._keepalive.start()

    def _renew_leases(self) -> None:
        """Renew this replica's lease on every attention worker, from a thread of its own (a busy
        event loop must not starve it), fire and forget: a worker that misses a few renewals
        gives its requests `owner_timeout_s` before aborting them."""
        while True:
            for actor in list(self.workers.values()):
                try:
                    actor.keepalive.remote(self.owner)
                except Exception as e:  # noqa: BLE001 (a worker restarting: the next round reaches it)
                    log.debug("lease renewal: %s", e)
            time.sleep(self.cfg.keepalive_s)

    # ---- the attention pool's members ----------------------------------------------------
    def _follow_pool(self) -> None:
        if self._refresh is None and self.cfg.balancer:
            self._refresh = asyncio.get_running_loop().create_task(self._refresh_pool())

    async def _refresh_pool(self) -> None:
        """Follow the attention pool as the balancer resizes it: a new worker gets requests at
        once, a draining one gets no new request (its streams go on), a stopped one is dropped."""
        balancer = None
        while True:
            try:
                balancer = balancer or ray.get_actor(self.cfg.balancer, namespace=self.cfg.namespace)
                pool = await asyncio.wait_for(balancer.attention_workers.remote(), 5.0)
                if pool and pool["serving"]:  # (None: the balancer does not know yet)
                    self.set_pool(pool["serving"], pool["draining"])
            except Exception as e:  # noqa: BLE001 (the balancer restarting: keep the last members)
                log.debug("reading the attention pool: %s", e)
                balancer = None
            await asyncio.gather(*[self._check_live(n) for n in self.serving if n not in self.down])
            await asyncio.sleep(self.cfg.pool_refresh_s)

    async def _check_live(self, name: str) -> None:
        """Ping a serving worker (the pings' times are the ping deadline's measure; a worker
        frozen with no stream on it is found here before a request is sent to it)."""
        why = await self._hung(name)
        if why is not None:
            self.mark_down(name, hung=f"liveness ping: {why}")

    def set_pool(self, serving: list[str], draining: list[str]) -> None:
        """The attention pool's members: `serving` take new requests, `draining` finish theirs.
        (`workers` is replaced, not changed in place: the lease thread reads it.)"""
        workers = dict(self.workers)
        for name in [*serving, *draining]:
            if name not in workers:
                try:
                    workers[name] = ray.get_actor(name, namespace=self.cfg.namespace)
                except ValueError as e:  # (gone meanwhile: the next read of the pool tells)
                    log.info("attention worker %s: %s", name, e)
                    continue
                self.outstanding[name] = 0
                log.info("attention worker %s joined the pool", name)
        for name in [n for n in workers if n not in serving and n not in draining]:
            if not self.outstanding[name]:  # (a stream still open on it: dropped when it ends)
                del workers[name], self.outstanding[name]
                self.down.pop(name, None)
                log.info("attention worker %s left the pool", name)
        self.workers, self.serving = workers, set(serving) & set(workers)

    async def pick_worker(self, prompt: list[int], cache_salt: str | None = None) -> str:
        """The live attention worker for `prompt`: the one holding its longest cached prefix unless
        it is much busier than the others (prefix affinity), else the one with the fewest
        outstanding tokens; waits (bounded) while every worker is down."""
        self._follow_pool()
        deadline = time.monotonic() + self.cfg.failover_wait_s
        while True:
            live = {n: v for n, v in self.outstanding.items() if n in self.serving and n not in self.down}
            if live:
                name = self.affinity.choose(prompt, live, cache_salt) if self.cfg.prefix_caching else None
                if name is None:
                    least = min(live.values())
                    names = [n for n, v in live.items() if v == least]
                    name = names[next(self._rr) % len(names)]
                if self.cfg.prefix_caching:
                    self.affinity.record(prompt, name, cache_salt)
                return name
            if time.monotonic() > deadline:
                raise APIError(503, "no attention worker is available", retry_after=self.cfg.retry_after_s)
            await asyncio.sleep(0.1)

    def mark_down(self, name: str, hung: str | None = None) -> None:
        """Skip `name` until it answers `ready` again (Ray restarts it); `hung`: why it is
        thought hung (the balancer is asked to fence it)."""
        if name in self.down:
            return
        self.down[name] = time.monotonic()
        if hung:
            self._fence(name, hung)
        self._probes.add(asyncio.get_running_loop().create_task(self._probe(name)))

    async def _probe(self, name: str) -> None:
        try:
            while name in self.workers:  # (a worker that left the pool is not waited for)
                try:
                    if not _stuck(await asyncio.wait_for(self.workers[name].ready.remote(), 10)):
                        break
                except Exception:  # noqa: BLE001 (restarting, or dead for good: keep it out, ask again)
                    pass
                await asyncio.sleep(0.5)  # (or still stuck: fenced, it is restarted)
            since = self.down.pop(name, None)
            if name in self.workers and since is not None:
                log.info("attention worker %s is back after %.1fs", name, time.monotonic() - since)
        finally:
            self._probes.discard(asyncio.current_task())

    async def merged(self, subs: list[Sub]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """All sub-request streams interleaved as they arrive: (sub index, output)."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()
        # n > 1 choices of one prompt prefill it once: the others start when the first has its
        # first token (its prompt blocks are in the prefix cache by then, on the same worker)
        prefilled = {s.prompt_index: asyncio.Event() for s in subs}
        leaders: dict[int, int] = {}
        for s in subs:
            leaders.setdefault(s.prompt_index, s.index)

        async def pump(sub: Sub):
            gate = prefilled[sub.prompt_index]
            follower = leaders[sub.prompt_index] != sub.index and len(sub.prompt_ids) > BLOCK_SIZE
            try:
                if self.cfg.prefix_caching and follower:
                    await gate.wait()
                async for out in self.run(sub):
                    gate.set()
                    await queue.put((sub.index, out))
            except BaseException as e:  # noqa: BLE001 (re-raised in the consumer)
                await queue.put((sub.index, e))
            finally:
                gate.set()
                await queue.put((sub.index, done))

        tasks = [asyncio.create_task(pump(s)) for s in subs]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
