"""OpenAI-compatible request/response shapes and their validation (pure: no Ray, no HTTP).

Requests are pydantic models; unknown fields are accepted and ignored (as OpenAI and vLLM do),
wrong types and out-of-range values become `APIError`s with OpenAI's error JSON. vLLM-compatible
extensions: `top_k`, `return_token_ids`, `ignore_eos`, `stop_token_ids`, prompts as token ids.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.model.sampling import SamplingParamError, SamplingParams


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
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code or self.status}}  # fmt: skip


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    user: str | None = None

    def sampling_params(self, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        params = SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )
        try:
            params.validate()
        except SamplingParamError as e:
            raise APIError(400, str(e), param=e.param) from None
        if not 1 <= self.n <= 16:
            raise APIError(400, f"n must be in [1, 16], got {self.n}", param="n")
        return params

    @property
    def include_usage_in_stream(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as text or token-id lists (a batch when a list of them is given)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            if any(not x for x in p):
                raise APIError(400, "prompt contains an empty prompt", param="prompt")
            return list(p)
        raise APIError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")

    def check_unsupported(self) -> None:
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, 1, self.n):
            raise APIError(400, "best_of other than n is not supported", param="best_of")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True

    def chat_messages(self) -> list[dict[str, str]]:
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def parse(model: type[BaseModel], body: Any):
    """Validate a JSON body; pydantic errors become a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if not isinstance(x, int)) or None
        raise APIError(400, f"{loc or 'body'}: {err['msg']}", param=loc) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip
