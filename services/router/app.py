"""The router: a Ray Serve application with an OpenAI-compatible HTTP API.

It tokenizes, picks an attention worker per request (least outstanding tokens), and relays the
worker's output stream (one Ray streaming call per request) as JSON or Server-Sent Events.
Every error is OpenAI's error JSON with the right status; a client that disconnects aborts its
requests on their worker.
"""

import asyncio
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve

from services import __version__
from services.engine.outputs import RequestOutput

from . import protocol as proto
from . import responses
from .answers import PromptLogprobsOrder, off_loop, prompt_logprobs_once, share_prompt_logprobs
from .chat_format import THINK_BEGIN, THINK_END, ChatParser
from .core import RouterConfig, RouterCore, Sub
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse,
)
from .responses import ResponsesRequest

log = logging.getLogger(__name__)


# no /openapi.json, /docs or /redoc: the API is OpenAI's, and the schema would list internals
app = FastAPI(title="moe-cluster", docs_url=None, redoc_url=None, openapi_url=None)

# what a server-side error's text may hold that no client should see: addresses (IPv4/IPv6 with
# ports, URLs, host:port), Ray's node / worker / actor ids (long hex), file paths
_INTERNAL = re.compile(
    r"[a-z][a-z0-9+.-]*://\S+"  # URLs (redis://:pw@host, grpc://...)
    r"|\[?(?:[0-9a-f]{0,4}:){2,7}[0-9a-f]{0,4}\]?(?::\d+)?"  # IPv6
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"  # IPv4[:port]
    r"|\b[\w.-]+:\d{2,5}\b"  # host:port
    r"|\b[0-9a-f]{16,}\b"  # node / worker / actor / object ids
    r"|(?<![\w.])/(?:[\w.-]+/)+[\w.-]*",  # absolute paths
    re.I,
)


def public_body(e: APIError) -> dict:
    """An error's JSON as a client gets it: a server-side one (5xx, whose text comes from Ray and
    names nodes, workers, addresses) logged whole and answered without internal addresses, ids
    and paths."""
    body = e.body()
    if e.status >= 500:
        log.warning("answered %d: %s", e.status, e.message)
        body["error"]["message"] = _INTERNAL.sub("<internal>", body["error"]["message"])
    return body


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return JSONResponse(public_body(e), status_code=e.status, headers=headers)


@app.exception_handler(Exception)
async def _unexpected(_: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error")
    return JSONResponse(APIError(500, f"internal error: {type(e).__name__}").body(), status_code=500)


async def _chained(first, rest: AsyncIterator):
    """`first`, then the items of `rest`. (Defined above the deployment: Ray Serve captures the
    class, and what it uses, where the decorator runs.)"""
    yield first
    async for item in rest:
        yield item


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=2048)
@serve.ingress(app)
class Router:
    def __init__(self, cfg: RouterConfig):
        logging.basicConfig(level=logging.INFO)
        self.core = RouterCore(cfg)
        self._expert_clients: dict[str, object] = {}  # address -> ExpertClient (/metrics reads their Stats)

    async def pid(self) -> int:
        """This replica's process id (fault tests kill it)."""
        return os.getpid()

    async def drain(self) -> str:
        """Refuse new generation requests from now on (shutdown); running ones go on. Returns this
        replica's id (the caller drains until every replica has answered)."""
        self.core.draining = True
        return self.core.owner

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
        refused = await self._data_plane_refusals(balancer)
        if refused is not None:
            self.core.metrics.observe_refused(refused)
        text = self.core.metrics.render([s for s in stats if isinstance(s, dict)], balancer)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def _data_plane_refusals(self, balancer: dict | None) -> dict[tuple[str, str], int] | None:
        """The data-plane calls and connections the expert workers refused ((transport, reason) ->
        count), summed over the workers in the balancer's status that answer Stats within 2 s;
        None without a balancer."""
        from services.experts.client import ExpertClient

        if balancer is None:
            return None
        workers = balancer.get("workers", [])
        addresses = {w["address"] for w in workers if w.get("state") != "dead"} - {"-", None}
        for gone in set(self._expert_clients) - addresses:
            self._expert_clients.pop(gone).close()
        if addresses - set(self._expert_clients):
            try:  # (Stats needs the cluster's secret: the balancer hands it to the cluster's services)
                actor = ray.get_actor(self.core.cfg.balancer, namespace=self.core.cfg.namespace)
                secret = await asyncio.wait_for(actor.data_plane_secret.remote(), 5)
            except (TimeoutError, ValueError, ray.exceptions.RayError):
                return None
            for address in addresses - set(self._expert_clients):
                self._expert_clients[address] = ExpertClient(address, secret=secret)
        clients = [self._expert_clients[a] for a in sorted(addresses)]
        replies = await asyncio.gather(
            *[asyncio.to_thread(c.stats, 2.0) for c in clients], return_exceptions=True
        )
        total: dict[tuple[str, str], int] = {}
        for reply in replies:
            for r in () if isinstance(reply, BaseException) else reply.refused:
                total[r.transport, r.reason] = total.get((r.transport, r.reason), 0) + r.count
        return total

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
        return {"object": "list", "data": [{"id": name, "object": "model", "created": proto.now(),
                                            "owned_by": "moe-cluster", "root": cfg.model_dir,
                                            "max_model_len": cfg.max_model_len}
                                           for name in self.core.model_names]}  # fmt: skip

    async def _tokenizer_request(self, request: Request, model: type):
        """A /tokenize or /detokenize body, checked (auth, model, a tokenizer to use)."""
        self.core.check_auth(request)
        req = parse(model, await self._body(request))
        if req.model is not None:
            self.core.check_model(req.model)
        if self.core.tokenizer is None:
            raise APIError(400, "this model has no tokenizer (token-id mode)")
        return req

    @app.get("/tokenizer_info")
    async def tokenizer_info(self, request: Request) -> dict:
        """vLLM's /tokenizer_info (what lm-evaluation-harness's remote tokenizer reads): the
        special tokens, the chat template and the context length."""
        core = self.core
        core.check_auth(request)
        tok = core.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer (token-id mode)")
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                "pad_token": None, "chat_template": tok.chat_template, "model_max_length": core.cfg.max_model_len}  # fmt: skip

    @app.get("/version")
    async def version(self) -> dict:
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> dict:
        """vLLM's /tokenize: {"prompt": str} or {"messages": [...]} -> {"count", "max_model_len", "tokens"}."""
        core = self.core
        req: TokenizeRequest = await self._tokenizer_request(request, TokenizeRequest)
        if req.messages is not None:
            messages = proto.chat_messages(req.messages)
            chars = self._check_messages(messages)

            def template_and_encode():
                text = core.tokenizer.apply_chat_template(messages, req.add_generation_prompt)
                return core.tokenizer.encode(text, add_bos=False)

            ids = await off_loop(chars, template_and_encode)
        else:
            core.check_prompts([req.prompt])
            ids = await off_loop(len(req.prompt), core.tokenizer.encode, req.prompt, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": core.cfg.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> dict:
        """vLLM's /detokenize: {"tokens": [...]} -> {"prompt": str}."""
        core = self.core
        req: DetokenizeRequest = await self._tokenizer_request(request, DetokenizeRequest)
        vocab = core.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": core.tokenizer.decode(req.tokens)}

    # ---- completions --------------------------------------------------------------------
    async def _body(self, request: Request) -> dict:
        """The JSON body, read up to `max_body_bytes` (413 beyond, before parsing it)."""
        limit = self.core.cfg.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"the request body is larger than {limit} bytes")
        try:
            return json.loads(body)
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply") from None
        except ValueError as e:  # (JSONDecodeError, UnicodeDecodeError, an int beyond Python's digit limit)
            if "integer string conversion" in str(e):
                raise APIError(400, "the request body holds a number with too many digits") from None
            raise APIError(400, "the request body is not valid JSON") from None

    def _check_messages(self, messages: list[dict]) -> int:
        """`max_prompt_chars` over a chat's messages (their text and tool calls, all turns
        together), checked before they are templated and tokenized; their characters."""
        limit, total = self.core.cfg.max_prompt_chars, 0
        for m in messages:
            total += len(m.get("content") or "") + len(m.get("name") or "")
            for call in m.get("tool_calls") or ():
                total += len(call["function"]["name"]) + len(call["function"]["arguments"])
        if total > limit:
            raise APIError(400, f"the messages have more than {limit} characters", param="messages")
        return total

    def _check_logprob_budget(self, entries_and_param: tuple[int, str]) -> None:
        """The answer's logprob entries within `max_logprob_entries` (400 naming it otherwise)."""
        limit = self.core.cfg.max_logprob_entries
        entries, param = entries_and_param
        proto.check_logprob_budget(entries, limit, param)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        core = self.core
        core.check_auth(request)
        core.check_open()
        req: CompletionRequest = parse(CompletionRequest, await self._body(request))
        core.check_model(req.model)
        req.check_unsupported()
        params = req.sampling_params(
            core.cfg.default_completion_max_tokens, req.logprobs, req.num_prompt_logprobs()
        )
        texts = core.check_prompts(req.prompts())
        chars = sum(len(p) for p in texts if isinstance(p, str))
        prompts = await off_loop(chars, lambda: [core.encode(p) for p in texts])
        self._check_logprob_budget(req.logprob_entries([len(p) for p in prompts], params.max_tokens))
        echo = {}
        if req.echo:  # the prompt's text before the completion (a token-id prompt's decoded text)
            echo = await off_loop(sum(len(p) for p in prompts) * 4, lambda: {
                i: p if isinstance(p, str) else core.decode(p) for i, p in enumerate(texts)})  # fmt: skip
        rid = proto.new_id("cmpl")
        subs = core.subrequests(prompts, params, req.n, rid)
        prompt_logprobs_once(subs, req.n)
        head = proto.response_head(rid, "text_completion", req.model)
        opts = {"logprobs": req.logprobs is not None, "token_ids": self._token_ids(req), "echo": req.echo,
                "prompt_logprobs": req.prompt_logprobs is not None}  # fmt: skip
        core.metrics.request_started("completions")
        if req.stream:
            return await self._stream(subs, head, opts=opts, usage=req.include_usage_in_stream, echo=echo,
                                      echo_only=req.echo_only, n=req.n)  # fmt: skip
        outs = await self._collect(request, subs)
        share_prompt_logprobs(subs, outs, req.n)
        if req.echo_only:  # (the one token the engine sampled is not part of the answer)
            outs = [[proto.without_output(out) for out in seq] for seq in outs]
        choices = [proto.completion_choice(sub.index, seq, sub.prompt_ids, core.token_str,
                                           prefix=echo.get(sub.prompt_index, ""), **opts)
                   for sub, seq in zip(subs, outs, strict=True)]  # fmt: skip
        return proto.response(head, choices, self._usage(subs, proto.completion_tokens(outs), outs))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        core = self.core
        core.check_auth(request)
        core.check_open()
        req: ChatCompletionRequest = parse(ChatCompletionRequest, await self._body(request))
        rid = proto.new_id("chatcmpl")
        prompt_ids, subs, parsers = await self._chat_plan(req, rid)
        opts = {"logprobs": req.logprobs, "token_ids": self._token_ids(req)}
        core.metrics.request_started("chat")
        if req.stream:
            head = proto.response_head(rid, "chat.completion.chunk", req.model)
            return await self._stream(
                subs, head, parsers=parsers, opts=opts, usage=req.include_usage_in_stream
            )
        head = proto.response_head(rid, "chat.completion", req.model)
        outs = await self._collect(request, subs)
        choices = [
            proto.chat_choice(sub.index, seq, core.token_str, parsers[sub.index], **opts)
            for sub, seq in zip(subs, outs, strict=True)
        ]
        body = proto.response(head, choices, self._usage(subs, proto.completion_tokens(outs), outs))
        if req.prompt_logprobs is not None:  # (vLLM's field: the prompt's, once for all choices)
            plps = proto.prompt_logprobs_of([o for seq in outs for o in seq])
            body["prompt_logprobs"] = proto.vllm_prompt_logprobs(prompt_ids, plps, core.token_str)
        return body

    async def _chat_plan(
        self, req: ChatCompletionRequest, rid: str
    ) -> tuple[list[int], list[Sub], list[ChatParser]]:
        """A chat request's prompt ids, sub-requests (one per choice) and output parsers. Large
        messages are templated and tokenized off the event loop."""
        core = self.core
        core.check_model(req.model)
        if core.tokenizer is None:
            raise APIError(400, "chat needs a tokenizer; this model runs in token-id mode", param="messages")
        tools = req.tool_choice_spec()
        messages = req.chat_messages()
        chars = self._check_messages(messages)
        constrained = req.output_schema() is not None

        def template_and_encode() -> tuple[list[int], bool]:
            prompt = core.tokenizer.apply_chat_template(
                messages, req.add_generation_prompt, tools.template_tools()
            )
            thinking = prompt.rstrip().endswith(THINK_BEGIN)  # the template opened the reasoning block
            if thinking and constrained:  # constrained from the first token: no reasoning
                prompt, thinking = prompt + THINK_END, False
            return core.tokenizer.encode(prompt, add_bos=False), thinking

        prompt_ids, thinking = await off_loop(chars, template_and_encode)
        if req.max_completion_tokens is not None and req.max_tokens is None:
            req.max_tokens = req.max_completion_tokens
        default_max = max(1, core.cfg.max_model_len - len(prompt_ids))
        params = req.sampling_params(default_max, req.num_logprobs(), req.prompt_logprobs)
        if req.stream and req.prompt_logprobs is not None:
            raise APIError(
                400, "prompt_logprobs is not supported with stream in chat", param="prompt_logprobs"
            )
        self._check_logprob_budget(req.logprob_entries(len(prompt_ids), params.max_tokens))
        subs = core.subrequests([prompt_ids], params, req.n, rid)
        prompt_logprobs_once(subs, req.n)  # (the response's prompt_logprobs: once for all choices)
        return prompt_ids, subs, [ChatParser(tools, thinking) for _ in subs]

    @app.post("/v1/responses")
    async def responses(self, request: Request):
        """OpenAI's Responses API over the chat path (responses.py)."""
        core = self.core
        core.check_auth(request)
        core.check_open()
        req: ResponsesRequest = parse(ResponsesRequest, await self._body(request))
        chat = req.to_chat()
        rid = responses.new_id("resp")
        _, subs, (parser,) = await self._chat_plan(chat, rid)
        core.metrics.request_started("responses")
        if req.stream:
            return await self._stream_response(req, rid, subs, parser)
        created = proto.now()
        outs = (await self._collect(request, subs))[0]
        message, reason = parser.message("".join(o.text for o in outs), outs[-1].finish_reason)
        usage = self._usage(subs, proto.completion_tokens([outs]), [outs])
        return responses.response_object(
            req, rid, created, responses.output_items(message, reason), reason, usage
        )

    async def _stream_response(self, req: ResponsesRequest, rid: str, subs: list[Sub],
                               parser: ChatParser) -> StreamingResponse:  # fmt: skip
        """A Responses stream: its events (responses.ResponseEvents) from the choice's parser
        deltas; refused before the first output with the HTTP status, after it a response.failed."""
        core = self.core
        started = time.monotonic()
        outputs, first = await self._first_output(subs)
        events = responses.ResponseEvents(req, rid)

        async def stream():
            status, reason, outs = 200, None, []
            for event in events.start():
                yield responses.sse(event)
            core.metrics.observe_ttft(time.monotonic() - started)

            try:
                async for _, out in _chained(first, outputs):
                    outs.append(out)
                    deltas = [parser.feed(out.text)]
                    if out.finished:
                        last, reason = parser.finish(out.finish_reason)
                        deltas.append(last)
                    for delta in deltas:
                        for event in events.feed(delta):
                            yield responses.sse(event)
                usage = self._usage(subs, proto.completion_tokens([outs]), [outs])
                for event in events.finish(reason, usage):
                    yield responses.sse(event)
            except APIError as e:
                status = e.status
                yield responses.sse(events.failed(public_body(e)["error"]["message"]))
            finally:
                await outputs.aclose()
                core.metrics.request_finished(status)
                self._observe_tpot([outs], started)

        return StreamingResponse(stream(), media_type="text/event-stream")

    # ---- shared plumbing ----------------------------------------------------------------
    async def _first_output(self, subs: list[Sub]) -> tuple[AsyncIterator, tuple[int, RequestOutput]]:
        """A stream's sub-requests started: their merged outputs and the first of them. A refusal
        before it (a bad request, a full queue) raises here, to be answered with its HTTP status."""
        outputs = self.core.merged(subs)
        try:
            return outputs, await anext(outputs)
        except APIError as e:
            await outputs.aclose()
            self.core.metrics.request_finished(e.status)
            raise

    def _token_ids(self, req: CompletionRequest | ChatCompletionRequest) -> bool:
        return req.return_token_ids or self.core.tokenizer is None  # token-id mode always returns ids

    @staticmethod
    def _usage(subs: list[Sub], completion_tokens: int, outs: list[list[RequestOutput]]) -> dict:
        """Usage of a request; cached tokens: per prompt, those of its first choice's prefill."""
        cached = {}
        for sub, seq in zip(subs, outs, strict=True):
            if seq and sub.prompt_index not in cached:
                cached[sub.prompt_index] = seq[0].num_cached_tokens
        prompt = proto.prompt_tokens((s.prompt_index, s.prompt_ids) for s in subs)
        return proto.usage(prompt, completion_tokens, sum(cached.values()))

    async def _collect(self, request: Request, subs: list[Sub]) -> list[list[RequestOutput]]:
        """Run sub-requests to the end (aborting them if the client disconnects)."""
        outs: list[list[RequestOutput]] = [[] for _ in subs]
        started = time.monotonic()
        first: set[int] = set()

        async def consume():
            async for index, out in self.core.merged(subs):
                if index not in first:
                    first.add(index)
                    self.core.metrics.observe_ttft(time.monotonic() - started)
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
            self.core.metrics.observe_tpot((time.monotonic() - started) / n)

    async def _stream(
        self,
        subs: list[Sub],
        head: dict,
        opts: dict,
        usage: bool,
        echo: dict[int, str] | None = None,
        parsers: list[ChatParser] | None = None,
        echo_only: bool = False,
        n: int = 1,
    ) -> StreamingResponse:
        """Stream the sub-requests' outputs as SSE chunks (`usage`: end with a usage chunk; `echo`:
        prompt index -> text to put before each choice's first chunk; `echo_only`: without the
        generated token; `parsers`: a chat stream's, one per choice; `n`: choices per prompt). An
        error before the first output (a refused request, a full queue) is answered with its HTTP
        status; after it, it becomes an SSE error event. A client that disconnects cancels the
        generator, which aborts the sub-requests. Prompt logprobs come from each prompt's first
        choice (answers.py): a sibling's outputs wait for them."""
        core, chat = self.core, parsers is not None
        started = time.monotonic()
        outputs, first = await self._first_output(subs)
        share = not chat and bool(opts.get("prompt_logprobs") or (opts.get("echo") and opts.get("logprobs")))
        ordered = PromptLogprobsOrder(subs, n, share)

        async def events():
            completion_tokens = 0
            offsets = [0] * len(subs)  # text so far of each completion choice
            firsts: list[list[RequestOutput]] = [[] for _ in subs]  # each choice's first output
            if chat:
                for sub in subs:
                    yield proto.sse(proto.chat_role_chunk(head, sub.index))
            status = 200
            core.metrics.observe_ttft(time.monotonic() - started)

            try:
                async for arrived in _chained(first, outputs):
                    for index, out in ordered(*arrived):
                        if echo_only:
                            out = proto.without_output(out)
                        completion_tokens += len(out.token_ids)
                        prefix = ""
                        if not firsts[index]:
                            firsts[index].append(out)
                            prefix = (echo or {}).get(subs[index].prompt_index, "")
                        if chat:
                            chunk = proto.chat_chunk(head, index, out, core.token_str, parsers[index], **opts)
                        else:
                            chunk = proto.completion_chunk(head, index, out, core.token_str, offset=offsets[index],
                                                           prefix=prefix, prompt_ids=subs[index].prompt_ids, **opts)  # fmt: skip
                            offsets[index] += len(prefix) + len(out.text)
                        yield proto.sse(chunk)
                if usage:
                    yield proto.sse(proto.usage_chunk(head, self._usage(subs, completion_tokens, firsts)))
            except APIError as e:
                status = e.status
                yield proto.sse(public_body(e))
            finally:
                await outputs.aclose()
                core.metrics.request_finished(status)
                if completion_tokens > 1:
                    core.metrics.observe_tpot((time.monotonic() - started) / completion_tokens)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
