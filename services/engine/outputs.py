"""What the engine gives back: per-step deltas for each request (`RequestOutput`), a refused
request (`Refusal`), a finished one (`Completion`), what a step did (`StepResult`) or why it
failed (`StepFailed`). The router and the attention worker speak these types."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import TokenLogprobs


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set with finish_reason "error"
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), on the
    # request's first output
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class Refusal:
    """A request the engine would not take (the only item of its output stream): HTTP `status`
    (400 invalid, 429 queue full), the message and the offending request field."""

    status: int
    message: str
    param: str | None = None


@dataclass
class Completion:
    """A finished request (what `generate` returns)."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.text += out.text
        if out.finished:
            self.finish_reason = out.finish_reason


class StepFailed(RuntimeError):
    """The model run of a step failed (e.g. routed experts unreachable); `request_ids` were in it."""

    def __init__(self, request_ids: list[str], cause: Exception):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids, self.cause = request_ids, cause


@dataclass
class StepResult:
    """What one engine step did."""

    outputs: list[RequestOutput]  # one per request that got a token or finished
    num_seqs: int  # sequences in the step
    num_tokens: int  # tokens computed (prefill chunks + decodes)
    expert_load: torch.Tensor  # [num_moe_layers, n_routed_experts] int64 routed pairs (CPU)
    expert_wait_s: float  # seconds blocked on routed experts
    seconds: float  # wall time of the step
    logits: torch.Tensor | None = None  # [len(logits_ids), vocab] fp32: the rows sampled from
    logits_ids: list[str] = field(default_factory=list)  # request id of each logits row
