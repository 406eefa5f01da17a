"""Speculative decoding with the checkpoint's MTP module as the drafter (issue #54; model/mtp.py).

A step of a speculating sequence is a *verify chunk*: its last token and the drafted tokens,
1 + k rows through the main model (as decode rows, each over its causal context: the absorbed
form, `StepBatch.decode_upto`), logits at every row. `Speculator.sample` turns them into the
tokens the step emits:

- greedy: each draft is accepted while it is the target's argmax; then the target's own token
  (the correction, or after k accepted drafts the bonus), so the tokens are those of plain decoding;
- sampled: standard rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft d drawn
  from the draft distribution q is accepted with probability min(1, p(d) / q(d)), p the target's;
  on a rejection the token is drawn from norm(max(0, p - q)), and after k accepted drafts the bonus
  from p. Each emitted token is then distributed as the target's. p and q are the distributions
  the request samples from (penalties, temperature, top-k / top-p / min-p applied), p at row i with
  the drafts before it counted as output.

After the scheduler has taken the emitted tokens, `Speculator.draft` runs the MTP module over the
positions the step computed (each with the main model's hidden state there and the token after
it), which writes its latent rows into its own cache slot, and drafts the next token of each
sequence that may speculate: the argmax of the module's (processed) logits for a greedy request,
a draw from them for a sampled one. The module runs for every sequence of the step, so its cache
rows are complete wherever a later request's prefix hit or a preempted sequence lands.

k > 1 draft tokens chain the module as DeepSeek and vLLM do: draft i + 1 is the module run again at
the next position, over its own output state there (before its shared head) and the embedding of
draft i; one batched pass per chained position for every sequence still drafting (its MoE layer
dispatched like the first pass's, counted in the same tally row). The chained passes write the
module's latent rows at the drafted positions, into blocks taken for them now from free ones
(`Scheduler.grow_blocks`; where none is free a sequence drafts fewer): those rows are read only by
the later chained passes of the same step, and overwritten when their positions are computed for
real. A sequence with fewer than k + 1 tokens left to generate (or to the context's end) drafts
fewer; a sampled request's drafts each come with their distribution ([k, V] `draft_probs`), each
position processed with the drafts before it counted as output, as verification processes p.

Whether a step speculates at all is the `SpeculationGate`'s (spec_gate.py: vLLM's
`disable_by_batch_size`, or `auto`: measured per batch-size bucket). After a step that drafts for
none of its sequences (the gate said no, or none may) the module only writes its cache rows at the
computed positions (`model.mtp_cache_rows`: the same rows, from two small projections, without its
attention, its MoE layer's expert round trip or its head), so its cache stays complete and any
later step may speculate again at full acceptance, while a plain step costs little over plain
decoding without the module.

Refused, falling back to plain decoding for that request: structured outputs (a grammar would have
to be advanced speculatively). Penalties, logit bias, min_tokens, stop tokens and strings,
max_tokens, logprobs, prompt logprobs, preemption (drafts are dropped and drafted again after the
recompute), prefix caching and chunked prefill compose, and attention tensor parallelism (every
rank runs each pass: `on_pass`). Not yet: CUDA graphs.

The model runs the module (`model.mtp_forward`): DeepSeek-V3 / V3.2's layer (model/mtp.py) over the
main model's final-normed states, DeepSeek-V4's MTPBlock (deepseek_v4.py) over its hyper-connection
streams; `batch.hidden` holds whichever the model keeps. V4's passes address its state blocks
(`block_states`); a rejected draft's rows need no rollback (its position is computed again).

In the cluster (an attention worker's engine over `RemoteExperts`) nothing here changes: a verify
chunk's 1 + k rows go through each MoE layer's one dispatch with the step's other rows, and the MTP
pass's MoE layer is dispatched to the expert workers like any other (its `moe_index` after the main
model's, model/mtp.py `served_experts`: the placement, the load counts and EPLB cover it). Its
routed choices are counted in the step's tally after the main model's layers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.model.batch import StepBatch
from services.model.kv_cache import BLOCK_SIZE
from services.model.messages import ExpertTally, run_interleaved

from .sampling import TokenLogprobs, draw, processed_logits, sampling_probs, token_logprobs
from .scheduler import Chunk, SeqStatus, Sequence
from .spec_gate import SpeculationGate

SPEC_METHODS = ("deepseek_mtp", "mtp")
MAX_SPECULATIVE_TOKENS = 4  # (the chained module's acceptance falls with each position)


def _given(text: str | dict) -> dict:
    return json.loads(text) if isinstance(text, str) else dict(text)


def parse_speculative_config(text: str | dict | None) -> int:
    """Draft tokens per step from vLLM's `--speculative-config` JSON ({"method": "deepseek_mtp",
    "num_speculative_tokens": 1}; None or empty: 0); ValueError for another method or count, or a
    `disable_by_batch_size` that is not an integer >= 0 (`speculative_disable_by_batch_size`)."""
    if not text:
        return 0
    given = _given(text)
    speculative_disable_by_batch_size(None, given)
    method = given.get("method", "deepseek_mtp")
    if method not in SPEC_METHODS:
        raise ValueError(
            f"speculative-config method {method!r}: only {' / '.join(SPEC_METHODS)} (the MTP module)"
        )
    k = given.get("num_speculative_tokens", 1)
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"num_speculative_tokens must be an integer >= 0, got {k!r}")
    return k


def speculative_disable_by_batch_size(flag: int | None, config: str | dict | None) -> int:
    """Running sequences above which a step does not speculate, from
    `--speculative-disable-by-batch-size N` and / or vLLM's `--speculative-config` JSON key
    `disable_by_batch_size` (0, or neither given: `auto`, measured: spec_gate.py); ValueError
    where both are given and disagree, or for a value that is not an integer >= 0."""
    given = _given(config).get("disable_by_batch_size") if config else None
    for value in (flag, given):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"disable_by_batch_size must be an integer >= 0 (0: auto), got {value!r}")
    if flag is not None and given is not None and flag != given:
        raise ValueError(f"--speculative-disable-by-batch-size {flag} and --speculative-config's "
                         f"disable_by_batch_size {given} disagree")  # fmt: skip
    return flag if flag is not None else given or 0


def speculative_tokens(flag: int | None, config: str | dict | None) -> int:
    """Draft tokens per step from `--speculative-tokens N` and / or vLLM's `--speculative-config`
    JSON (the same thing); ValueError where both are given and disagree."""
    from_config = parse_speculative_config(config) if config else None
    if flag is not None and from_config is not None and flag != from_config:
        raise ValueError(f"--speculative-tokens {flag} and --speculative-config's num_speculative_tokens "
                         f"{from_config} disagree")  # fmt: skip
    n = flag if flag is not None else from_config or 0
    if n < 0:
        raise ValueError(f"speculative tokens must be >= 0, got {n}")
    return n


def check_speculation(cfg, k: int) -> None:
    """ValueError where the model (a ModelConfig) cannot speculate `k` tokens per step: what an engine
    refuses at start, checked by the launcher before it starts anything."""
    if cfg.num_nextn_predict_layers < 1:
        raise ValueError("speculative decoding needs the checkpoint's MTP module (num_nextn_predict_layers >= 1 "
                         "and its weights); 0 declared")  # fmt: skip
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"speculative_tokens {k}: 1 to {MAX_SPECULATIVE_TOKENS} draft tokens per step (the MTP "
                         "module chained)")  # fmt: skip


@dataclass
class SpecStats:
    """Counters with vLLM's meaning: drafts checked (`spec_decode_num_drafts`), their tokens
    (`..._num_draft_tokens`), the tokens accepted (`..._num_accepted_tokens`, and per position)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    refused_requests: int = 0  # requests that could not speculate (structured outputs): plain decoding

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.drafts,
            "num_draft_tokens": self.draft_tokens,
            "num_accepted_tokens": self.accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.accepted_per_position),
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
            "mean_acceptance_length": 1 + self.accepted_tokens / self.drafts if self.drafts else None,
            "refused_requests": self.refused_requests,
        }


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) up to scale: where a rejected draft's replacement is drawn from (p where
    rounding leaves nothing)."""
    r = (p - q).clamp_(min=0.0)
    return r if float(r.sum()) > 0 else p


def accept(
    p: torch.Tensor, q: torch.Tensor | None, draft: list[int], generator: torch.Generator
) -> list[int]:
    """Rejection sampling of `draft`: target distributions p [k+1, V] (each row summing to 1) at
    the draft rows and after them, draft distributions q [k, V] the drafts were drawn from (None:
    each draft was the draft model's argmax, q one-hot). The emitted tokens: the accepted drafts,
    then one drawn from `residual` at the first rejection, or the bonus from p[k]."""
    out = []
    for i, d in enumerate(draft):
        qd = 1.0 if q is None else float(q[i, d])
        u = float(torch.rand(1, generator=generator))
        if u * qd < float(p[i, d]):  # accepted with probability min(1, p(d) / q(d))
            out.append(d)
            continue
        qi = torch.zeros_like(p[i]).index_fill_(0, torch.tensor([d]), 1.0) if q is None else q[i]
        out.append(int(draw(residual(p[i], qi)[None], [generator])[0]))
        return out
    out.append(int(draw(p[len(draft)][None], [generator])[0]))
    return out


def accept_greedy(processed: torch.Tensor, draft: list[int]) -> list[int]:
    """Greedy verification: processed logits [k+1, V]; drafts kept while each is the argmax,
    then the argmax of the first row that disagrees (or of the last)."""
    best = processed.argmax(dim=-1).tolist()
    out = []
    for i, d in enumerate(draft):
        out.append(best[i])
        if best[i] != d:
            return out
    out.append(best[len(draft)])
    return out


class Speculator:
    """Speculative decoding for an engine (see the module's doc): `sample` checks the drafts of a
    step's verify chunks, `draft` runs the MTP module after the step (chained for k > 1).
    `num_drafts(seq)` says how many drafts a request gets (none with a grammar, fewer near its
    end); `gate` whether a step speculates at all, `record_step` feeds it.

    grow_blocks(seq, num_tokens) -> bool: the scheduler's `grow_blocks` (blocks for the chained
    passes' rows, from free ones); disable_by_batch_size: the gate's setting (0: auto)."""

    def __init__(self, model, experts, cache_kv, k: int, max_model_len: int, grammar_ids: set,
                 grow_blocks: Callable[[Sequence, int], bool], disable_by_batch_size: int = 0,
                 block_states: torch.Tensor | None = None):  # fmt: skip
        check_speculation(model.cfg, k)
        if not model.mtp:
            raise ValueError(f"speculative decoding needs the checkpoint's MTP module (num_nextn_predict_layers >= 1 "
                             f"and its weights); {model.cfg.num_nextn_predict_layers} declared")  # fmt: skip
        self.model, self.experts, self.kv, self.k = model, experts, cache_kv, k
        self.max_model_len, self.grammar_ids, self.grow_blocks = max_model_len, grammar_ids, grow_blocks
        self.block_states = block_states  # (DeepSeek-V4: the allocator's, for the passes' state tables)
        # attention tensor parallelism: called with each pass's batch, input rows, whether it is
        # chained and whether it writes the cache rows only, before it runs
        # (tensor_parallel.TPGroup.broadcast_mtp_pass), so that every rank runs it
        self.on_pass: Callable[[StepBatch, torch.Tensor, bool, bool], None] | None = None
        self.stats = SpecStats(accepted_per_position=[0] * k)
        self.gate = SpeculationGate(disable_by_batch_size)
        self._refused: set[str] = set()
        self._draft_s = 0.0  # seconds of the last MTP pass (the cost of the next step's drafts)
        self._after_decode = False  # whether the last step was a pure decode step (its pass: decode rows)

    def num_drafts(self, seq: Sequence) -> int:
        """Drafts seq may get for its next step: up to k, fewer than the tokens it has left to
        generate (its last one is the step's own) and to the context's end; none with a grammar."""
        if seq.request_id in self.grammar_ids:
            if seq.request_id not in self._refused:
                self._refused.add(seq.request_id)
                self.stats.refused_requests += 1
            return 0
        left = seq.params.max_tokens - len(seq.output_ids)
        return max(0, min(self.k, left - 1, self.max_model_len - seq.num_tokens - 1))

    def as_dict(self) -> dict:
        """The engine's `spec_decode` stats: vLLM's counters, and the gate's by batch size."""
        return {**self.stats.as_dict(), "num_speculative_tokens": self.k, "by_batch_size": self.gate.as_dict(),
                "by_batch_size_summary": self.gate.summary()}  # fmt: skip

    def record_step(self, chunks: list[Chunk], num_emitted: int, seconds: float) -> None:
        """A step's measure for the gate, where it was a pure decode step (every chunk one token,
        or a verify chunk) after another: its seconds with the MTP pass that drafted for it, and the
        tokens it emitted per sequence; whether any chunk verified drafts says which side it counts
        on. (After a step with prefill chunks the pass ran over their rows too: not a decode
        step's cost, so the step after is not measured.)"""
        decode = bool(chunks) and all(c.wants_logits and c.num_tokens == 1 + len(c.draft) for c in chunks)
        if decode and self._after_decode:
            speculated = any(c.draft for c in chunks)
            self.gate.record(len(chunks), speculated, seconds + self._draft_s, num_emitted / len(chunks))
        self._after_decode = decode

    # ---- verification ---------------------------------------------------------------------
    def sample(
        self,
        chunks: list[Chunk],
        logits: torch.Tensor,
        history: list[tuple[list[int], list[int]]],
        held_back: list[set[int]],
        allowed: tuple[list[int], torch.Tensor] | None,
    ) -> tuple[list[list[int]], list[list[TokenLogprobs | None]], list[int]]:
        """The tokens each chunk wanting logits emits, their logprobs, and the logits rows they were
        drawn from. logits: 1 + len(draft) rows per such chunk, in order; history / held_back /
        allowed: per such chunk, as `sampling.sample` takes them (a grammar's row: a plain one)."""
        want = [c for c in chunks if c.wants_logits]
        first, rp, rh, rb = [], [], [], []  # per chunk its first row; per row params, history, held back
        for c, (prompt, output), held in zip(want, history, held_back, strict=True):
            first.append(len(rp))
            for i in range(1 + len(c.draft)):
                rp.append(c.seq.params)
                rh.append((prompt, output + c.draft[:i]) if i else (prompt, output))
                rb.append(held if len(c.seq.output_ids) + i < c.seq.params.min_tokens or not i else set())
        if allowed is not None:
            allowed = ([first[j] for j in allowed[0]], allowed[1])
        raw, processed = processed_logits(logits, rp, rh, rb, allowed)
        tokens, logprobs, used = [], [], []
        for j, c in enumerate(want):
            r0, p, seq = first[j], c.seq.params, c.seq
            rows = slice(r0, r0 + 1 + len(c.draft))
            if p.greedy:
                new = accept_greedy(processed[rows], c.draft)
            elif not c.draft:  # (one draw from the request's generator, as plain decoding takes)
                new = draw(sampling_probs(processed[r0 : r0 + 1], [p]), [seq.generator]).tolist()
            else:
                probs = sampling_probs(processed[rows], [p] * (1 + len(c.draft)))
                new = accept(probs / probs.sum(-1, keepdim=True), seq.draft_probs, c.draft, seq.generator)
            if c.draft:
                self._count(c.draft, new)
            tokens.append(new)
            used += range(r0, r0 + len(new))
            logprobs.append([None if p.logprobs is None else token_logprobs(raw[r0 + i], t, p.logprobs)
                             for i, t in enumerate(new)])  # fmt: skip
        return tokens, logprobs, used

    def _count(self, draft: list[int], emitted: list[int]) -> None:
        s = self.stats
        s.drafts += 1
        s.draft_tokens += len(draft)
        n = len(emitted) - 1  # (accepted drafts: the emitted tokens before the last)
        s.accepted_tokens += n
        for i in range(n):
            s.accepted_per_position[i] += 1

    # ---- drafting -------------------------------------------------------------------------
    def draft(self, parts: list[list[Chunk]], batches: list[StepBatch], tally: ExpertTally, history_of,
              held_of, num_running: int) -> None:  # fmt: skip
        """Run the MTP module over what the step computed (`parts`' chunks, run as `batches`, each
        holding its rows' hidden states) and, where the gate lets the next step (`num_running`
        sequences) speculate, draft the next tokens of each sequence that may: the first from the
        module's logits, the others from its chained passes, each processed as the request's
        (history_of(seq): prompt and output for penalties, held_of(seq): what min_tokens holds back
        now). Its routed load (rows after the main model's MoE layers) and expert waits go to the
        step's `tally`."""
        t0 = time.perf_counter()
        try:
            speculate = num_running > 0 and self.gate.speculate(num_running)  # (none left: nothing to ask)
            self._draft(parts, batches, tally, history_of, held_of, speculate)
        finally:
            self._draft_s = time.perf_counter() - t0

    def _draft(self, parts, batches, tally, history_of, held_of, speculate: bool) -> None:
        rows, drafting = [], []  # drafting: (seq, how many drafts)
        at, offset = [], 0  # the rows read, in the step's batches' `hidden` concatenated
        for part, batch in zip(parts, batches, strict=True):
            for b, c in enumerate(part):
                seq = c.seq
                m = seq.num_computed - c.start  # (rows computed, their next tokens known)
                if seq.status is not SeqStatus.RUNNING or m <= 0:
                    continue
                n = self.num_drafts(seq) if c.wants_logits else 0
                if n > 1 and speculate and not self.grow_blocks(seq, seq.num_tokens + n - 2):
                    n = min(n, len(seq.block_ids) * BLOCK_SIZE - seq.num_tokens + 2)  # (rows that fit)
                want = n > 0 and speculate
                rows.append((seq.token_slice(c.start + 1, c.start + 1 + m), c.start, seq.block_ids, want))
                s0 = batch.query_starts[b]
                at += range(offset + s0, offset + s0 + m)
                if want:
                    drafting.append((seq, n))
            offset += len(batch.input_ids)
        if not rows:
            return
        model = self.model
        chained = any(n > 1 for _, n in drafting)
        batch = StepBatch.build(
            rows, model.device, self.block_states, decode_upto=1 + self.k, keep_hidden=chained
        )
        at = torch.tensor(at)
        if self.on_pass is not None:
            self.on_pass(batch, at, False, not drafting)
        hidden = torch.cat([b.hidden for b in batches])[at.to(model.device)]
        if not drafting:  # (nothing to draft: only the module's cache rows, no expert round trip)
            model.mtp_cache_rows(model.mtp[0], batch, hidden, self.kv)
            return
        step = model.mtp_forward(model.mtp[0], batch, hidden, self.kv)
        # (its MoE layer's load counted in the step's tally, after the main model's layers)
        logits = run_interleaved([step], self.experts, tally)[0]
        for seq, _ in drafting:
            seq.draft, seq.draft_probs = [], None
        probs: dict[int, list[torch.Tensor]] = {id(seq): [] for seq, _ in drafting}
        self._pick([seq for seq, _ in drafting], logits, history_of, held_of, probs)
        alive, state = drafting, batch.hidden  # (the last pass's rows: their sequences, output states)
        for j in range(1, max(n for _, n in drafting)):
            keep = [r for r, (_, n) in enumerate(alive) if n > j]
            alive = [alive[r] for r in keep]
            seqs = [seq for seq, _ in alive]
            # at position num_tokens - 2 + j: the draft before as input, the last pass's output state
            chain = StepBatch.build([([s.draft[-1]], s.num_tokens - 2 + j, s.block_ids, True) for s in seqs],
                                    model.device, self.block_states, decode_upto=1 + self.k,
                                    keep_hidden=True)  # fmt: skip
            if self.on_pass is not None:
                self.on_pass(chain, torch.tensor(keep), True, False)
            step = model.mtp_forward(model.mtp[0], chain, state[keep], self.kv)
            logits = run_interleaved([step], self.experts, tally)[0]
            self._pick(seqs, logits, history_of, held_of, probs)
            state = chain.hidden
        for seq, _ in drafting:
            if probs[id(seq)]:
                seq.draft_probs = torch.cat(probs[id(seq)])

    def _pick(self, seqs: list[Sequence], logits: torch.Tensor, history_of, held_of,
              probs: dict[int, list[torch.Tensor]]) -> None:  # fmt: skip
        """Append a draft to each of `seqs` from its row of the module's logits [len(seqs), V]:
        processed as the request's with its drafts so far counted as output (min_tokens' hold by
        the output index the draft would take); greedy: the argmax, sampled: a draw, its
        distribution [1, V] appended to probs[id(seq)]."""
        history, held = [], []
        for seq in seqs:
            prompt, output = history_of(seq)
            history.append((prompt, output + seq.draft))
            j = len(seq.draft)
            held.append(held_of(seq) if not j or len(seq.output_ids) + j < seq.params.min_tokens else set())
        _, processed = processed_logits(logits, [s.params for s in seqs], history, held)
        greedy = processed.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            if seq.params.greedy:
                seq.draft.append(greedy[i])
                continue
            q = sampling_probs(processed[i : i + 1], [seq.params])
            q = q / q.sum(-1, keepdim=True)
            seq.draft.append(int(draw(q, [seq.generator])[0]))
            probs[id(seq)].append(q)
