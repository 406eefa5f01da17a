"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, seeds, logprobs).

Each request owns a `torch.Generator`, advanced only by its own samples, so a seeded request
gives the same tokens whatever it is batched with and whichever topology serves it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings (need a tokenizer)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n alternatives per token (0 = only the chosen token)

    def validate(self) -> None:
        """Raise ValueError(param, message) for the first invalid field."""

        def bad(param: str, msg: str):
            raise SamplingParamError(param, msg)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**64):
            bad("seed", f"seed must be a 64-bit integer, got {self.seed!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20):
            bad("logprobs", f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "stop_token_ids must be non-negative integers")
        if any(not isinstance(s, str) or not s for s in self.stop) or len(self.stop) > 16:
            bad("stop", "stop must be up to 16 non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def make_generator(self) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed((self.seed if self.seed is not None else secrets.randbits(63)) % 2**64)
        return g


class SamplingParamError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class TokenLogprobs:
    token_logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits [B, V] fp32 -> one token per row, and logprobs where requested.

    Logprobs are those of the model's distribution (log_softmax of the raw logits), as vLLM
    reports by default; the sampled token comes from the temperature/top-k/top-p-processed one.
    """
    logits = logits.float().cpu()  # per-request generators live on the CPU
    tokens = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if 0 < p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_row, order = torch.sort(row, descending=True)
            probs = sorted_row.softmax(-1)
            drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix reaching top_p
            row = row.scatter(0, order, sorted_row.masked_fill(drop, float("-inf")))
        probs = row.softmax(-1)
        tokens[i] = torch.multinomial(probs, 1, generator=generators[i])[0]

    out_tokens = tokens.tolist()
    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        lp = torch.log_softmax(logits[want], dim=-1)
        for row, i in enumerate(want):
            n = params[i].logprobs
            top = torch.topk(lp[row], n) if n else None
            logprobs[i] = TokenLogprobs(
                token_logprob=float(lp[row, out_tokens[i]]),
                top=list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                if top is not None
                else [],
            )
    return out_tokens, logprobs
