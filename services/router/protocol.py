"""OpenAI-compatible request/response shapes and their validation (pure: no Ray, no HTTP).

Requests are pydantic models; a field this server does not implement is refused by name, wrong
types and out-of-range values become `APIError`s with OpenAI's error JSON. vLLM-compatible
extensions: `top_k`, `return_token_ids`, `ignore_eos`, `stop_token_ids`, prompts as token ids.

Responses (whole, or streamed chunk by chunk) are built from the engine's `RequestOutput`s by
the builders at the bottom; token text comes from a `token_str` callable (the tokenizer's).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.engine.sampling import SamplingParamError, SamplingParams, TokenLogprobs
from services.router.chat_format import ChatParser, ToolChoice, ToolsError, output_schema, response_schema

if TYPE_CHECKING:
    from services.engine.outputs import RequestOutput


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}  # fmt: skip

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = (
            status,
            message,
            param,
            code,
            retry_after,
        )

    def body(self) -> dict:
        return {"error": {"message": unicode_text(self.message), "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": None if self.param is None else unicode_text(self.param), "code": self.code or self.status}}  # fmt: skip


def unicode_text(text: str) -> str:
    """`text` with what UTF-8 cannot encode (lone surrogates, echoed from a request) as U+FFFD."""
    try:
        text.encode()
        return text
    except UnicodeEncodeError:
        return "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)


# Token ids the router passes on: [0, 2**31) (every vocabulary fits; the engine checks its own).
# An id beyond int64 would overflow the prefix hashes and the engine's tensors: refused here, 400.
MAX_TOKEN_ID = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


# A budget on each answer's logprobs: choices x tokens x (1 + top alternatives), prompt logprobs
# included, summed over what the answer would hold (each entry is a dict in the router replica and
# ~100 bytes of JSON). vLLM bounds the alternatives per token (20, as SamplingParams does here); this
# bounds their product too: 256 prompts x n=16 with echo and logprobs=20 would be ~10^8 entries from
# a 2 MiB request. 2^22 lets one choice of a 163,840-token context carry top_logprobs=20 (3.4M).
MAX_LOGPROB_ENTRIES = 1 << 22


def check_logprob_budget(entries: int, limit: int, param: str) -> None:
    """A 400 naming the limit when an answer could hold more than `limit` logprob entries."""
    if entries > limit:
        raise APIError(
            400,
            f"this request's answer could hold {entries} logprob entries (choices x tokens x (1 + top "
            f"logprobs), prompt logprobs included), more than this server's max_logprob_entries of {limit}: "
            "ask for fewer choices (n), prompts or tokens (max_tokens), or fewer top logprobs",
            param=param,
        )


def check_token_ids(ids: Sequence[int], param: str) -> None:
    """A 400 naming `param` unless every id is in [0, MAX_TOKEN_ID]."""
    bad = next((t for t in ids if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        shown = (
            str(bad) if abs(bad) < 10**30 else f"{'-' if bad < 0 else ''}{abs(bad).bit_length()}-bit integer"
        )
        raise APIError(400, f"token id {shown} is not in [0, {MAX_TOKEN_ID}]", param=param)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field we do not implement is refused, by name

    model: str
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOKEN_ID)] = -1
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    user: str | None = None  # for the caller's own tracking: accepted, not used
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
    response_format: dict[str, Any] | None = None
    cache_salt: str | None = Field(
        default=None, min_length=1, max_length=1024
    )  # vLLM's: prefix-cache isolation

    def output_schema(self) -> dict | None:
        """The JSON schema the output is constrained to (None: free text)."""
        try:
            return response_schema(self.response_format)
        except ToolsError as e:
            raise APIError(400, str(e), param=e.param) from None

    def bias(self) -> dict[int, float]:
        try:
            bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        except ValueError:  # (also a key of more digits than Python converts)
            raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
        check_token_ids(list(bias), "logit_bias")
        return bias

    def sampling_params(
        self, default_max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        params = SamplingParams(
            max_tokens=1 if max_tokens == 0 and getattr(self, "echo", False) else max_tokens,  # (echo only)
            prompt_logprobs=prompt_logprobs,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            logit_bias=self.bias(),
            json_schema=self.output_schema(),
            cache_salt=self.cache_salt,
        )
        try:
            params.validate()
        except SamplingParamError as e:
            raise APIError(
                400, str(e), param=self._schema_field() if e.param == "json_schema" else e.param
            ) from None
        if not 1 <= self.n <= 16:
            raise APIError(400, f"n must be in [1, 16], got {self.n}", param="n")
        return params

    def _schema_field(self) -> str:
        """The request field a bad output schema came from."""
        return "response_format"

    @property
    def include_usage_in_stream(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: per prompt token, in each choice's "prompt_logprobs"

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt (and its logprobs) back, nothing generated
        (how lm-evaluation-harness scores loglikelihoods)."""
        return self.echo and self.max_tokens == 0

    def num_prompt_logprobs(self) -> int | None:
        """Top-n alternatives per prompt token the engine must compute: `echo` with `logprobs`
        asks for them (in `logprobs`), `prompt_logprobs` too; None: no prompt logprobs."""
        asked = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        return max(asked) if asked else None

    def logprob_entries(self, prompt_lens: Sequence[int], max_tokens: int) -> tuple[int, str]:
        """(logprob entries the answer could hold, the field that asks for them): per choice its
        tokens' (`logprobs`), with `echo` its prompt's in `logprobs` too, and its prompt's in
        `prompt_logprobs` (each choice carries its prompt's, computed once per prompt)."""
        top, echo, plp = self.logprobs, self.echo and self.logprobs is not None, self.prompt_logprobs
        generated = max_tokens * (1 + top) if top is not None else 0
        per_prompt = [generated + (n * (1 + top) if echo else 0) + (n * (1 + plp) if plp is not None else 0)
                      for n in prompt_lens]  # fmt: skip
        return self.n * sum(per_prompt), "logprobs" if top is not None else "prompt_logprobs"

    def prompts(self) -> list[str | list[int]]:
        """The prompts as text or token-id lists (a batch when a list of them is given)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            check_token_ids(p, "prompt")
            return [list(p)]
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            if any(not x for x in p):
                raise APIError(400, "prompt contains an empty prompt", param="prompt")
            for x in p:
                if isinstance(x, list):
                    check_token_ids(x, "prompt")
            return list(p)
        raise APIError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")

    def check_unsupported(self) -> None:
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens 0 needs echo: true (the prompt back, nothing generated)",
                           param="max_tokens")  # fmt: skip
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, 1, self.n):
            raise APIError(400, "best_of other than n is not supported", param="best_of")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning_content: str | None = None  # an assistant turn's reasoning (not shown to the model again)

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates take them (text content; "developer" is "system"; an assistant
    turn's tool calls with their arguments as JSON text; a tool turn's call id)."""
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(
                    400, f"messages[{i}]: only assistant messages carry tool_calls", param="messages"
                )
            msg["tool_calls"] = [_tool_call(c, i) for c in m.tool_calls]
            msg["content"] = m.text() if m.content else None  # None when the turn is only calls
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def _tool_call(call: dict[str, Any], i: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"messages[{i}].tool_calls: each call needs function.name", param="messages")
    args = fn.get("arguments", "{}")
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}  # fmt: skip


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True  # false: at most one tool call per turn
    prompt_logprobs: int | None = None  # vLLM's: per prompt token, in the response's "prompt_logprobs"

    def chat_messages(self) -> list[dict[str, Any]]:
        return chat_messages(self.messages)

    def tool_choice_spec(self) -> ToolChoice:
        try:
            return ToolChoice.parse(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ToolsError as e:
            raise APIError(400, str(e), param=e.param) from None

    def output_schema(self) -> dict | None:
        try:
            return output_schema(self.response_format, self.tool_choice_spec())
        except ToolsError as e:
            raise APIError(400, str(e), param=e.param) from None

    def _schema_field(self) -> str:
        return "tools" if self.tool_choice_spec().forced else "response_format"

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def logprob_entries(self, prompt_len: int, max_tokens: int) -> tuple[int, str]:
        """(logprob entries the answer could hold, the field that asks for them): each choice's
        tokens', and the prompt's once (`prompt_logprobs`, once for all choices)."""
        top, plp = self.num_logprobs(), self.prompt_logprobs
        entries = (self.n * max_tokens * (1 + top) if top is not None else 0) + (
            prompt_len * (1 + plp) if plp is not None else 0
        )
        return entries, "top_logprobs" if top is not None else "prompt_logprobs"


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # (vLLM's is optional: the served model)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def model_post_init(self, _) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


MAX_JSON_DEPTH = 64  # nesting levels of a request body (a deeper tool schema would exhaust recursion)


def _check_values(value: Any) -> None:
    """A 400 naming the field for the first string (or key) that is not valid Unicode text (a lone
    surrogate such as "\\udcff": JSON allows the escape, UTF-8 cannot encode it), or for nesting
    deeper than MAX_JSON_DEPTH. Iterative; each stack entry holds its top-level field only (a full
    path per value would cost memory in proportion to keys x siblings)."""
    stack: list[tuple[Any, str | None, int]] = [(value, None, 0)]
    while stack:
        v, field, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"{field}: nested more than {MAX_JSON_DEPTH} levels deep", param=field)
        if isinstance(v, str):
            try:
                v.encode()
            except UnicodeEncodeError:
                raise APIError(400, f"{field or 'body'}: text with a lone surrogate (not valid Unicode)",
                               param=field) from None  # fmt: skip
        elif isinstance(v, dict):
            for k, item in v.items():
                top = field if field is not None else str(k)
                stack.append((k, top, depth + 1))
                stack.append((item, top, depth + 1))
        elif isinstance(v, list):
            stack.extend((item, field, depth + 1) for item in v)


def parse(model: type[BaseModel], body: Any):
    """Validate a JSON body; pydantic errors become a 400 naming the first bad field, and so do text
    that is not valid Unicode (lone surrogates) and nesting beyond MAX_JSON_DEPTH."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_values(body)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if not isinstance(x, int)) or None
        if err["type"] == "extra_forbidden":
            raise APIError(
                400, f"unsupported field `{loc}`: this server does not implement it", param=loc
            ) from None
        raise APIError(400, f"{loc or 'body'}: {err['msg']}", param=loc) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---- response builders ----------------------------------------------------------------------
TokenStr = Callable[[int], str]  # token id -> its text


def response_head(id_: str, object_: str, model: str, created: int | None = None) -> dict:
    """The fields every response and chunk starts with."""
    return {"id": id_, "object": object_, "created": now() if created is None else created, "model": model}


def response(head: dict, choices: list[dict], usage: dict) -> dict:
    return {**head, "choices": choices, "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # fmt: skip


def prompt_tokens(choice_prompts: Iterable[tuple[int, Sequence[int]]]) -> int:
    """Prompt tokens of a request from each choice's (prompt index, prompt ids): each prompt
    counted once whatever n is."""
    return sum({index: len(ids) for index, ids in choice_prompts}.values())


def completion_tokens(outs: Iterable[Iterable[RequestOutput]]) -> int:
    return sum(len(o.token_ids) for seq in outs for o in seq)


def without_output(out: RequestOutput) -> RequestOutput:
    """An output with its generated tokens and text taken out (echo with max_tokens 0); a
    finished one says "length" (the 0 tokens asked for)."""
    return dataclasses.replace(out, token_ids=[], logprobs=[], text="",
                               finish_reason="length" if out.finish_reason in ("stop", "length") else out.finish_reason)  # fmt: skip


def prompt_logprobs_of(outs: Sequence[RequestOutput]) -> list[TokenLogprobs | None] | None:
    """A choice's prompt logprobs (they come with its first output)."""
    return next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)


def vllm_prompt_logprobs(prompt_ids: Sequence[int], plps: list[TokenLogprobs | None] | None,
                         token_str: TokenStr) -> list[dict | None] | None:  # fmt: skip
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or {token id (str): {logprob,
    rank, decoded_token}} for the prompt's token and the top alternatives."""
    if plps is None:
        return None
    out: list[dict | None] = []
    for tok, lp in zip(prompt_ids, plps, strict=True):
        if lp is None:
            out.append(None)
            continue
        entry = {
            str(t): {"logprob": v, "rank": r + 1, "decoded_token": token_str(t)}
            for r, (t, v) in enumerate(lp.top)
        }
        entry[str(tok)] = {"logprob": lp.token_logprob, "rank": lp.rank, "decoded_token": token_str(tok)}
        out.append(entry)
    return out


def completion_logprobs(outs: Sequence[RequestOutput], token_str: TokenStr, offset: int = 0,
                        prompt: tuple[Sequence[int], list[TokenLogprobs | None]] | None = None) -> dict:  # fmt: skip
    """The completions API's logprobs; `offset`: where the first token's text starts in the
    choice; `prompt` (echo): (prompt ids, their logprobs) first, from offset 0."""
    tokens, lps, tops, offsets = [], [], [], []
    at = 0
    for tok, lp in zip(*prompt, strict=True) if prompt is not None else ():
        s = token_str(tok)
        tokens.append(s)
        lps.append(lp.token_logprob if lp else None)
        # (the prompt's own token too, as vLLM adds it: lm-evaluation-harness checks greediness there)
        tops.append({token_str(t): v for t, v in lp.top} | {s: lp.token_logprob} if lp else None)
        offsets.append(at)
        at += len(s)
    for out in outs:
        for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
            s = token_str(tok)
            tokens.append(s)
            lps.append(lp.token_logprob if lp else None)
            tops.append({token_str(t): v for t, v in lp.top} if lp else None)
            offsets.append(offset)
            offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(outs: Sequence[RequestOutput], token_str: TokenStr) -> dict:
    def entry(token: int, logprob: float) -> dict:
        s = token_str(token)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

    return {"content": [{**entry(tok, lp.token_logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for out in outs for tok, lp in zip(out.token_ids, out.logprobs, strict=True)
                        if lp is not None]}  # fmt: skip


def _choice(index: int, body: dict, logprobs: dict | None, outs: Sequence[RequestOutput], token_ids: bool,
            finish_reason: str | None = None) -> dict:  # fmt: skip
    """{"index", <body's keys>, "logprobs", "finish_reason"[, "token_ids"]}: a choice of `outs`
    (finish_reason: `outs`' own unless given)."""
    choice = {"index": index, **body, "logprobs": logprobs,
              "finish_reason": finish_reason or outs[-1].finish_reason}  # fmt: skip
    if token_ids:
        choice["token_ids"] = [t for o in outs for t in o.token_ids]
    return choice


def _text(outs: Sequence[RequestOutput]) -> str:
    return "".join(o.text for o in outs)


def completion_choice(index: int, outs: Sequence[RequestOutput], prompt_ids: Sequence[int],
                      token_str: TokenStr, *, logprobs: bool = False, token_ids: bool = False,
                      prefix: str = "", echo: bool = False, prompt_logprobs: bool = False) -> dict:  # fmt: skip
    """One choice of a whole completion from all its outputs; `token_ids` adds the generated and
    the prompt's token ids (vLLM's `return_token_ids`); `prefix`: text before it (echo; with
    `logprobs` its tokens' logprobs come first); `prompt_logprobs`: vLLM's field too."""
    plps = prompt_logprobs_of(outs)
    prompt = (prompt_ids, plps) if echo and plps is not None else None
    lps = completion_logprobs(outs, token_str, len(prefix), prompt) if logprobs else None
    choice = _choice(index, {"text": prefix + _text(outs)}, lps, outs, token_ids)
    if token_ids:
        choice["prompt_token_ids"] = list(prompt_ids)
    if prompt_logprobs:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt_ids, plps, token_str)
    return choice


def chat_choice(index: int, outs: Sequence[RequestOutput], token_str: TokenStr, parser: ChatParser, *,
                logprobs: bool = False, token_ids: bool = False) -> dict:  # fmt: skip
    """One choice of a whole chat completion from all its outputs; `parser` splits the text into
    content, reasoning and tool calls."""
    lps = chat_logprobs(outs, token_str) if logprobs else None
    message, reason = parser.message(_text(outs), outs[-1].finish_reason)
    return _choice(index, {"message": message}, lps, outs, token_ids, reason)


def completion_chunk(head: dict, index: int, out: RequestOutput, token_str: TokenStr, *, offset: int = 0,
                     logprobs: bool = False, token_ids: bool = False, prefix: str = "",
                     prompt_ids: Sequence[int] = (), echo: bool = False, prompt_logprobs: bool = False) -> dict:  # fmt: skip
    """A streamed completion chunk of one output; `offset`: the length of the choice's text so far;
    `prefix`: text before the output's (echo, on a choice's first chunk, with its tokens'
    logprobs first when asked); prompt logprobs come on the chunk whose output carries them."""
    prompt = (
        (prompt_ids, out.prompt_logprobs) if echo and prefix and out.prompt_logprobs is not None else None
    )
    lps = completion_logprobs([out], token_str, offset + len(prefix), prompt) if logprobs else None
    choice = _choice(index, {"text": prefix + out.text}, lps, [out], token_ids)
    if prompt_logprobs and out.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt_ids, out.prompt_logprobs, token_str)
    return {**head, "choices": [choice]}


def chat_chunk(head: dict, index: int, out: RequestOutput, token_str: TokenStr, parser: ChatParser, *,
               logprobs: bool = False, token_ids: bool = False) -> dict:  # fmt: skip
    """A streamed chat chunk of one output, its text split by the choice's `parser` into content,
    reasoning and (on the last chunk) tool calls. Mid-stream a chunk with nothing to show has
    content "" (as vLLM sends: bytes held back in the middle of a UTF-8 character or a marker);
    the final chunk with no text has an empty delta, as OpenAI sends."""
    delta, reason = parser.feed(out.text), None
    if out.finished:
        last, reason = parser.finish(out.finish_reason)
        for key, value in last.items():
            delta[key] = delta.get(key, "" if key != "tool_calls" else []) + value
    elif not delta:
        delta = {"content": ""}
    lps = chat_logprobs([out], token_str) if logprobs else None
    return {**head, "choices": [_choice(index, {"delta": delta}, lps, [out], token_ids, reason)]}


def chat_role_chunk(head: dict, index: int) -> dict:
    """The first chunk of each streamed chat choice."""
    return {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]}  # fmt: skip


def usage_chunk(head: dict, usage: dict) -> dict:
    """The last chunk of a stream when `stream_options.include_usage` asks for it."""
    return {**head, "choices": [], "usage": usage}


def sse(obj: Any) -> str:
    """One Server-Sent Event."""
    return f"data: {json.dumps(obj)}\n\n"
