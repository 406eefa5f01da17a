"""The router: a Ray Serve application with an OpenAI-compatible HTTP API.

It tokenizes, picks an attention worker per request (least outstanding tokens), and relays the
worker's output stream (one Ray streaming call per request) as JSON or Server-Sent Events.
Every error is OpenAI's error JSON with the right status; a client that disconnects aborts its
requests on their worker.
"""

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve

from services.model.engine import Refusal, RequestOutput
from services.model.kv_cache import BLOCK_SIZE
from services.model.tokenizer import Tokenizer
from services.settings import NAMESPACE

from . import protocol as proto
from .affinity import PrefixAffinity
from .metrics import RouterMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, parse

log = logging.getLogger(__name__)


@dataclass
class RouterConfig:
    model_dir: str
    served_model_name: str
    attention_workers: list[str]  # Ray actor names
    namespace: str = NAMESPACE  # of the attention workers and the balancer (SharedSettings.namespace)
    balancer: str | None = None  # Ray actor name of the balancer (placement/loads for operators)
    api_key: str | None = None
    max_model_len: int = 4096
    default_completion_max_tokens: int = 16
    retry_after_s: int = 1
    prefix_caching: bool = True  # affinity routing by prompt prefix; n > 1 choices prefill once
    affinity_max_imbalance_tokens: int = 8192  # how much busier the worker holding a prefix may be
    max_failovers: int = 3  # times one request moves on after its attention worker died
    failover_wait_s: float = 60.0  # how long a request waits for a live attention worker
    ready_timeout_s: float = 5.0


app = FastAPI(title="moe-cluster", docs_url=None, redoc_url=None)


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


@app.exception_handler(Exception)
async def _unexpected(_: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error")
    return JSONResponse(APIError(500, f"internal error: {type(e).__name__}").body(), status_code=500)


class _WorkerDied(Exception):
    """The attention worker serving a stream died."""


class _QueueFull(Exception):
    """The attention worker refused the request: its waiting queue is full."""

    def __init__(self, error: APIError):
        super().__init__(error.message)
        self.error = error


@dataclass
class _Sub:
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
        self.tokenizer = Tokenizer.from_dir(cfg.model_dir)
        self.workers = {n: ray.get_actor(n, namespace=cfg.namespace) for n in cfg.attention_workers}
        self.outstanding = dict.fromkeys(self.workers, 0)
        self.draining = False  # shutting down: new requests are refused
        self.affinity = PrefixAffinity(max_imbalance_tokens=cfg.affinity_max_imbalance_tokens)
        self.down: dict[str, float] = {}  # attention workers that died: name -> since (monotonic)
        self._probes: set[asyncio.Task] = set()
        self._rr = itertools.count()
        self.metrics = RouterMetrics()

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
        if model not in (self.cfg.served_model_name, self.cfg.model_dir):
            raise APIError(404, f"the model `{model}` does not exist", param="model", code="model_not_found")

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

    def subrequests(self, prompts: list[list[int]], params, n: int, rid: str) -> list[_Sub]:
        subs = []
        for p, ids in enumerate(prompts):
            self.check_length(ids, params.max_tokens)
            for i in range(n):
                d = dict(vars(params))
                if params.seed is not None:
                    d["seed"] = params.seed + i  # n samples from one seed: seed, seed+1, ...
                subs.append(_Sub(p * n + i, p, ids, d, f"{rid}-{p * n + i}"))
        return subs

    async def run(self, sub: _Sub) -> AsyncIterator[RequestOutput]:
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
            params = {**sub.params, "max_tokens": sub.params["max_tokens"] - len(produced)}
            request_id = sub.request_id if attempt == 0 else f"{sub.request_id}-resumed-{attempt}"
            worker = await self.pick_worker(prompt)
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
            stream = actor.generate.options(num_returns="streaming").remote(
                prompt, params, request_id, resumed
            )
            async for ref in stream:
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
        except ray.exceptions.RayActorError as e:
            finished = True
            self.mark_down(name)
            if isinstance(e, ray.exceptions.ActorUnavailableError):  # maybe alive: don't compute it twice
                actor.abort.remote(request_id)
            raise _WorkerDied(f"attention worker {name} died ({type(e).__name__})") from e
        finally:
            self.outstanding[name] -= cost
            if not finished:
                actor.abort.remote(request_id)

    # ---- attention worker health --------------------------------------------------------
    async def pick_worker(self, prompt: list[int]) -> str:
        """The live attention worker for `prompt`: the one holding its longest cached prefix unless
        it is much busier than the others (prefix affinity), else the one with the fewest
        outstanding tokens; waits (bounded) while every worker is down."""
        deadline = time.monotonic() + self.cfg.failover_wait_s
        while True:
            live = {n: v for n, v in self.outstanding.items() if n not in self.down}
            if live:
                name = self.affinity.choose(prompt, live) if self.cfg.prefix_caching else None
                if name is None:
                    least = min(live.values())
                    names = [n for n, v in live.items() if v == least]
                    name = names[next(self._rr) % len(names)]
                if self.cfg.prefix_caching:
                    self.affinity.record(prompt, name)
                return name
            if time.monotonic() > deadline:
                raise APIError(503, "no attention worker is available", retry_after=self.cfg.retry_after_s)
            await asyncio.sleep(0.1)

    def mark_down(self, name: str) -> None:
        """Skip `name` until it answers `ready` again (Ray restarts it)."""
        if name in self.down:
            return
        self.down[name] = time.monotonic()
        self._probes.add(asyncio.get_running_loop().create_task(self._probe(name)))

    async def _probe(self, name: str) -> None:
        try:
            while True:
                try:
                    await asyncio.wait_for(self.workers[name].ready.remote(), 10)
                    break
                except Exception:  # restarting, or dead for good: keep it out, ask again
                    await asyncio.sleep(0.5)
            log.info("attention worker %s is back after %.1fs", name, time.monotonic() - self.down[name])
            self.down.pop(name, None)
        finally:
            self._probes.discard(asyncio.current_task())

    async def merged(self, subs: list[_Sub]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """All sub-request streams interleaved as they arrive: (sub index, output)."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()
        # n > 1 choices of one prompt prefill it once: the others start when the first has its
        # first token (its prompt blocks are in the prefix cache by then, on the same worker)
        prefilled = {s.prompt_index: asyncio.Event() for s in subs}
        leaders: dict[int, int] = {}
        for s in subs:
            leaders.setdefault(s.prompt_index, s.index)

        async def pump(sub: _Sub):
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


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=2048)
@serve.ingress(app)
class Router:
    def __init__(self, cfg: RouterConfig):
        logging.basicConfig(level=logging.INFO)
        self.core = RouterCore(cfg)

    async def pid(self) -> int:
        """This replica's process id (fault tests kill it)."""
        return os.getpid()

    async def drain(self) -> None:
        """Refuse new generation requests from now on (shutdown); running ones go on."""
        self.core.draining = True

    # ---- operational endpoints ----------------------------------------------------------
    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(self) -> JSONResponse:
        """200 while at least one attention worker answers (the others fail over to it)."""
        names = list(self.core.workers)
        replies = await asyncio.gather(
            *[
                asyncio.wait_for(self.core.workers[n].ready.remote(), self.core.cfg.ready_timeout_s)
                for n in names
            ],
            return_exceptions=True,
        )
        states = {
            n: r if isinstance(r, dict) else {"error": type(r).__name__}
            for n, r in zip(names, replies, strict=True)
        }
        ok = any(isinstance(r, dict) for r in replies)
        return JSONResponse({"status": "ready" if ok else "not ready", "attention_workers": states},
                            status_code=200 if ok else 503)  # fmt: skip

    @app.get("/metrics")
    async def metrics(self) -> Response:
        stats = await asyncio.gather(
            *[w.stats.remote() for w in self.core.workers.values()], return_exceptions=True
        )
        balancer = await self._balancer_status()
        text = self.core.metrics.render([s for s in stats if isinstance(s, dict)], balancer)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def _balancer_status(self) -> dict | None:
        if not self.core.cfg.balancer:
            return None
        try:
            actor = ray.get_actor(self.core.cfg.balancer, namespace=self.core.cfg.namespace)
            return await asyncio.wait_for(actor.status.remote(), 5)
        except (TimeoutError, ValueError, ray.exceptions.RayError):
            return None

    @app.get("/v1/experts")
    async def experts(self, request: Request) -> JSONResponse:
        self.core.check_auth(request)
        status = await self._balancer_status()
        if status is None:
            raise APIError(503, "the balancer is not available")
        return JSONResponse(status)

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict:
        self.core.check_auth(request)
        cfg = self.core.cfg
        return {"object": "list", "data": [{"id": cfg.served_model_name, "object": "model",
                                            "created": proto.now(), "owned_by": "moe-cluster",
                                            "root": cfg.model_dir, "max_model_len": cfg.max_model_len}]}  # fmt: skip

    # ---- completions --------------------------------------------------------------------
    async def _body(self, request: Request) -> dict:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON") from None

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        core = self.core
        core.check_auth(request)
        core.check_open()
        req: CompletionRequest = parse(CompletionRequest, await self._body(request))
        core.check_model(req.model)
        req.check_unsupported()
        params = req.sampling_params(core.cfg.default_completion_max_tokens, req.logprobs)
        prompts = [core.encode(p) for p in req.prompts()]
        rid = proto.new_id("cmpl")
        subs = core.subrequests(prompts, params, req.n, rid)
        head = proto.response_head(rid, "text_completion", req.model)
        opts = {"logprobs": req.logprobs is not None, "token_ids": self._token_ids(req)}
        core.metrics.request_started("completions")
        if req.stream:
            return self._stream(subs, head, chat=False, opts=opts, usage=req.include_usage_in_stream)
        outs = await self._collect(request, subs)
        choices = [proto.completion_choice(sub.index, seq, sub.prompt_ids, core.token_str, **opts)
                   for sub, seq in zip(subs, outs, strict=True)]  # fmt: skip
        return proto.response(head, choices, self._usage(subs, proto.completion_tokens(outs), outs))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        core = self.core
        core.check_auth(request)
        core.check_open()
        req: ChatCompletionRequest = parse(ChatCompletionRequest, await self._body(request))
        core.check_model(req.model)
        if core.tokenizer is None:
            raise APIError(400, "chat needs a tokenizer; this model runs in token-id mode", param="messages")
        prompt_ids = core.tokenizer.encode(
            core.tokenizer.apply_chat_template(req.chat_messages(), req.add_generation_prompt), add_bos=False
        )
        if req.max_completion_tokens is not None and req.max_tokens is None:
            req.max_tokens = req.max_completion_tokens
        default_max = max(1, core.cfg.max_model_len - len(prompt_ids))
        params = req.sampling_params(default_max, req.num_logprobs())
        rid = proto.new_id("chatcmpl")
        subs = core.subrequests([prompt_ids], params, req.n, rid)
        opts = {"logprobs": req.logprobs, "token_ids": self._token_ids(req)}
        core.metrics.request_started("chat")
        if req.stream:
            head = proto.response_head(rid, "chat.completion.chunk", req.model)
            return self._stream(subs, head, chat=True, opts=opts, usage=req.include_usage_in_stream)
        head = proto.response_head(rid, "chat.completion", req.model)
        outs = await self._collect(request, subs)
        choices = [
            proto.chat_choice(sub.index, seq, core.token_str, **opts)
            for sub, seq in zip(subs, outs, strict=True)
        ]
        return proto.response(head, choices, self._usage(subs, proto.completion_tokens(outs), outs))

    # ---- shared plumbing ----------------------------------------------------------------
    def _token_ids(self, req: CompletionRequest | ChatCompletionRequest) -> bool:
        return req.return_token_ids or self.core.tokenizer is None  # token-id mode always returns ids

    @staticmethod
    def _usage(subs: list[_Sub], completion_tokens: int, outs: list[list[RequestOutput]]) -> dict:
        """Usage of a request; cached tokens: per prompt, those of its first choice's prefill."""
        cached = {}
        for sub, seq in zip(subs, outs, strict=True):
            if seq and sub.prompt_index not in cached:
                cached[sub.prompt_index] = seq[0].num_cached_tokens
        prompt = proto.prompt_tokens((s.prompt_index, s.prompt_ids) for s in subs)
        return proto.usage(prompt, completion_tokens, sum(cached.values()))

    async def _collect(self, request: Request, subs: list[_Sub]) -> list[list[RequestOutput]]:
        """Run sub-requests to the end (aborting them if the client disconnects)."""
        outs: list[list[RequestOutput]] = [[] for _ in subs]
        started = time.monotonic()
        first: set[int] = set()

        async def consume():
            async for index, out in self.core.merged(subs):
                if index not in first:
                    first.add(index)
                    self.core.metrics.ttft.observe(time.monotonic() - started)
                outs[index].append(out)

        task = asyncio.create_task(consume())
        try:
            while not task.done():
                await asyncio.wait([task], timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    raise APIError(499, "client disconnected")
            task.result()
        except APIError as e:
            self.core.metrics.request_finished(e.status)
            raise
        self._observe_tpot(outs, started)
        self.core.metrics.request_finished(200)
        return outs

    def _observe_tpot(self, outs: list[list[RequestOutput]], started: float) -> None:
        n = proto.completion_tokens(outs)
        if n > 1:
            self.core.metrics.tpot.observe((time.monotonic() - started) / n)

    def _stream(self, subs: list[_Sub], head: dict, chat: bool, opts: dict, usage: bool) -> StreamingResponse:
        """Stream the sub-requests' outputs as SSE chunks (`usage`: end with a usage chunk); a client
        that disconnects cancels the generator, which aborts the sub-requests."""
        core = self.core

        async def events():
            started = time.monotonic()
            completion_tokens = 0
            offsets = [0] * len(subs)  # text so far of each completion choice
            firsts: list[list[RequestOutput]] = [[] for _ in subs]  # each choice's first output
            if chat:
                for sub in subs:
                    yield proto.sse(proto.chat_role_chunk(head, sub.index))
            status = 200
            try:
                async for index, out in core.merged(subs):
                    if completion_tokens == 0:
                        core.metrics.ttft.observe(time.monotonic() - started)
                    completion_tokens += len(out.token_ids)
                    if not firsts[index]:
                        firsts[index].append(out)
                    if chat:
                        chunk = proto.chat_chunk(head, index, out, core.token_str, **opts)
                    else:
                        chunk = proto.completion_chunk(
                            head, index, out, core.token_str, offset=offsets[index], **opts
                        )
                        offsets[index] += len(out.text)
                    yield proto.sse(chunk)
                if usage:
                    yield proto.sse(proto.usage_chunk(head, self._usage(subs, completion_tokens, firsts)))
            except APIError as e:
                status = e.status
                yield proto.sse(e.body())
            finally:
                core.metrics.request_finished(status)
                if completion_tokens > 1:
                    core.metrics.tpot.observe((time.monotonic() - started) / completion_tokens)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
