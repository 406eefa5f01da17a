"""Sampling parameters and the sampler: logits processing (repetition, frequency and presence
penalties, logit bias, min_tokens, grammar masks), then greedy or temperature / top-k / top-p / min-p sampling,
with seeds and logprobs.

Each request owns a `torch.Generator`, advanced only by its own samples, so a seeded request
gives the same tokens whatever it is batched with and whichever topology serves it. The
processing is batched: one tensor operation per kind over the rows that use it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from .grammar import GrammarError, check_json_schema

GRAMMAR_BLOCKED = -1e30  # the logit of a token a grammar forbids: never sampled, finite so adds stay cheap


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
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (vLLM's)
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt+output tokens
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability
    min_tokens: int = 0  # no EOS / stop token before this many tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    json_schema: dict | None = None  # the output must be JSON valid against it (grammar-constrained)
    # not a sampling parameter, carried with them: prefix-cache isolation (block_allocator.salt_root)
    cache_salt: str | None = None

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
        if self.prompt_logprobs is not None and not (
            isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20
        ):
            bad(
                "prompt_logprobs",
                f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}",
            )
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "stop_token_ids must be non-negative integers")
        if any(not isinstance(s, str) or not s for s in self.stop) or len(self.stop) > 16:
            bad("stop", "stop must be up to 16 non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad("repetition_penalty", f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if len(self.logit_bias) > 1024 or any(
            not isinstance(t, int) or t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()
        ):
            bad("logit_bias", "logit_bias maps up to 1024 token ids to biases in [-100, 100]")
        if self.json_schema is not None:
            try:
                check_json_schema(self.json_schema)
            except GrammarError as e:
                bad("json_schema", str(e))

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before sampling (penalties, bias, min_tokens)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias or self.min_tokens
        )  # fmt: skip

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
    rank: int | None = None  # the token's rank in the distribution (1 = most likely); prompt tokens


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, n: int) -> list[TokenLogprobs]:
    """Logprobs of prompt tokens: logits [P, V] (row p predicts targets[p]), targets [P] int64 ->
    per row the target's logprob and rank under the model's distribution (log_softmax of the raw
    logits) and the `n` most likely tokens."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, targets.view(-1, 1)).view(-1)
    ranks = (lp > chosen.view(-1, 1)).sum(-1).add_(1)
    top = torch.topk(lp, n) if n else None
    return [
        TokenLogprobs(float(chosen[p]), list(zip(top.indices[p].tolist(), top.values[p].tolist(), strict=True))
                      if top is not None else [], int(ranks[p]))
        for p in range(lp.shape[0])
    ]  # fmt: skip


def process_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    history: list[tuple[list[int], list[int]]],
    held_back: list[set[int]],
) -> torch.Tensor:
    """Penalties, logit bias and min_tokens applied to logits [B, V] (a new tensor when any row
    uses them). history: per row (prompt ids, output ids so far); held_back: per row the tokens
    min_tokens forbids for now (EOS and stop_token_ids; empty once enough were generated).
    Each row touches only the ids it names (its history, its bias), never a [V]-wide temporary."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    logits = logits.clone()
    V = logits.shape[1]
    for i in rows:
        p, row = params[i], logits[i]
        prompt, output = history[i]
        if p.repetition_penalty != 1.0 and (prompt or output):
            seen = torch.tensor(prompt + output, dtype=torch.long).unique()
            seen = seen[seen < V]
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and output:
            ids, counts = torch.tensor(output, dtype=torch.long).unique(return_counts=True)
            keep = ids < V
            row[ids[keep]] -= p.frequency_penalty * counts[keep] + p.presence_penalty
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            keep = ids < V
            row[ids[keep]] += torch.tensor(list(p.logit_bias.values()))[keep]
        if held_back[i]:
            ids = torch.tensor(sorted(held_back[i]), dtype=torch.long)
            row[ids[ids < V]] = float("-inf")
    return logits


TOP_P_CANDIDATES = 1024  # top-p looks at this many best tokens first; a full sort only if they fall short


def _top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """logits [R, V]; every token below row r's ks[r]-th best masked (k <= 0 or >= V: off)."""
    V = logits.shape[1]
    active = [r for r, k in enumerate(ks) if 0 < k < V]
    if not active:
        return logits
    sub = logits[active]
    kth = sub.topk(max(ks[r] for r in active), dim=-1).values
    kth = kth.gather(1, torch.tensor([ks[r] - 1 for r in active]).unsqueeze(1))
    logits = logits.clone()
    logits[active] = sub.masked_fill(sub < kth, float("-inf"))
    return logits


def _nucleus(
    vals: torch.Tensor, order: torch.Tensor, probs: torch.Tensor, p: torch.Tensor, V: int
) -> torch.Tensor:
    """[R, V] logits keeping, of the candidates `vals` / `order` [R, k] (best first, with their
    probabilities `probs`), the smallest prefix whose probability reaches p [R, 1]; -inf elsewhere."""
    drop = probs.cumsum(-1) - probs > p
    kept = vals.masked_fill(drop, float("-inf"))
    return torch.full((vals.shape[0], V), float("-inf"), dtype=vals.dtype).scatter(1, order, kept)


def _top_p(logits: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """logits [R, V]; row r keeps the smallest set of best tokens whose probability reaches
    ps[r] (1.0: off). Exact without sorting the vocabulary when the best TOP_P_CANDIDATES tokens
    already reach it (the usual case): only rows that fall short are fully sorted."""
    active = [r for r, p in enumerate(ps) if p < 1.0]
    if not active:
        return logits
    sub, p = logits[active], torch.tensor([ps[r] for r in active]).unsqueeze(1)
    V = sub.shape[1]
    vals, order = sub.topk(min(TOP_P_CANDIDATES, V), dim=-1)  # best first
    probs = (vals - sub.logsumexp(-1, keepdim=True)).exp()
    kept = _nucleus(vals, order, probs, p, V)
    short = probs.sum(-1) <= p.squeeze(1)  # the candidates do not reach top_p: sort the whole row
    if bool(short.any()):
        full_vals, full_order = sub[short].sort(dim=-1, descending=True)
        kept[short] = _nucleus(full_vals, full_order, full_vals.softmax(-1), p[short], V)
    logits = logits.clone()
    logits[active] = kept
    return logits


def processed_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    history: list[tuple[list[int], list[int]]] | None = None,
    held_back: list[set[int]] | None = None,
    allowed: tuple[list[int], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw, processed): logits [B, V] as fp32 on the CPU, and after penalties, bias, min_tokens
    (`process_logits`) and the grammar masks of `allowed` (see `sample`); the same tensor where
    nothing changes them. A greedy row's token is the processed row's argmax."""
    raw = logits.float().cpu()  # per-request generators live on the CPU
    if history is None:
        history = [([], [])] * len(params)
    logits = process_logits(raw, params, history, held_back or [set()] * len(params))
    if allowed is not None and allowed[0]:
        rows, mask = allowed
        blocked = (
            mask.float().sub_(1.0).mul_(-GRAMMAR_BLOCKED)
        )  # 0 where allowed (an add beats masked_fill on CPU)
        if len(rows) == logits.shape[0]:
            logits = logits + blocked
        else:
            logits = logits.clone() if logits is raw else logits
            logits[rows] += blocked
    return raw, logits


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row of processed logits [R, V] samples from (temperature, top-k,
    top-p, min-p), batched: [R, V], not renormalised after min-p (`draw` scales by the total)."""
    sub = logits / torch.tensor([p.temperature for p in params]).unsqueeze(1)
    sub = _top_k(sub, [p.top_k for p in params])
    sub = _top_p(sub, [p.top_p for p in params])
    probs = sub.softmax(-1)
    min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    return probs


def draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of probs [R, V] (any positive scale), by inverse CDF; row r's uniform
    from generators[r] (one draw each): [R] int64."""
    u = torch.cat([torch.rand(1, generator=g) for g in generators]).unsqueeze(1)
    cdf = probs.cumsum(-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=probs.shape[1] - 1).squeeze(1)


def token_logprobs(raw: torch.Tensor, token: int, n: int) -> TokenLogprobs:
    """A token's logprob under raw logits [V] (the model's distribution) and the n most likely."""
    lp = torch.log_softmax(raw, dim=-1)
    top = torch.topk(lp, n) if n else None
    return TokenLogprobs(
        token_logprob=float(lp[token]),
        top=list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else [],
    )


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    history: list[tuple[list[int], list[int]]] | None = None,
    held_back: list[set[int]] | None = None,
    allowed: tuple[list[int], torch.Tensor] | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits [B, V] fp32 -> one token per row, and logprobs where requested.

    history / held_back: see `process_logits` (needed when a row uses penalties, bias or
    min_tokens). allowed: (rows, mask [len(rows), V] bool), the tokens a grammar allows in
    those rows; every other token of theirs is masked out, in one batched op. Logprobs are those of the model's distribution (log_softmax of the raw
    logits), as vLLM reports by default; the sampled token comes from the processed one.
    """
    raw, logits = processed_logits(logits, params, history, held_back, allowed)
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:  # temperature, top-k, top-p and min-p batched over the sampled rows
        probs = sampling_probs(logits[rows], [params[i] for i in rows])
        # inverse-CDF draw, batched; each request's uniform comes from its own generator
        tokens[rows] = draw(probs, [generators[i] for i in rows])

    out_tokens = tokens.tolist()
    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        lp = torch.log_softmax(raw[want], dim=-1)
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
