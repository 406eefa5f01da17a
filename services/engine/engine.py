"""The inference engine: scheduler + model + expert backend + sampler, one step at a time.

`Engine` is what an attention worker runs (with a remote expert backend); `LocalEngine` is the
same engine with every routed expert in process: the single-process baseline every cluster
result is compared to.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from services.model.batch import StepBatch
from services.model.checkpoint import CheckpointReader, check_keep_fp8_experts, check_keep_fp8_linears
from services.model.config import ModelConfig, check_weight_dtype, parse_dtype
from services.model.deepseek_v4 import DeepseekV4
from services.model.kv_cache import BLOCK_SIZE, blocks_needed
from services.model.messages import ExpertBackend, ExpertTally, run_interleaved
from services.model.model import DeepseekV3
from services.model.moe import LocalExperts

from .decode_graphs import DecodeGraphs, SegmentedDecodeGraphs
from .engine_config import EngineConfig
from .grammar import GrammarCompiler, GrammarError, Matcher
from .outputs import Completion, RequestOutput, StepFailed, StepResult
from .sampling import SamplingParams, prompt_logprobs, sample
from .scheduler import Chunk, RequestError, Scheduler, SeqStatus, Sequence
from .speculative import Speculator
from .tokenizer import Detokenizer, Tokenizer

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "LocalEngine", "load_engine", "split_micro_batches"]


def split_micro_batches(chunks: list[Chunk], n: int) -> list[list[Chunk]]:
    """Split a step's chunks, in order, into up to n contiguous parts of about equal tokens."""
    if n <= 1 or len(chunks) < 2:
        return [chunks]
    n = min(n, len(chunks))
    total = sum(c.num_tokens for c in chunks)
    parts, current, done = [], [], 0
    for i, c in enumerate(chunks):
        current.append(c)
        done += c.num_tokens
        left_chunks, left_parts = len(chunks) - i - 1, n - len(parts) - 1
        if left_parts and (done * n >= total * (len(parts) + 1) or left_chunks == left_parts):
            parts.append(current)
            current = []
    parts.append(current)
    return [p for p in parts if p]


class Engine:
    """Scheduler + model + expert backend + sampler. Not thread-safe: one thread drives it
    (`add_request`, `abort`, `fail` between calls of `step`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        model: DeepseekV3,
        experts: ExpertBackend,
        engine_cfg: EngineConfig,
        tokenizer: Tokenizer | None = None,
        on_batches: Callable[[list[StepBatch]], None] | None = None,
        on_mtp_pass: Callable[[StepBatch, torch.Tensor, bool, bool], None] | None = None,
    ):
        """on_batches: called with each step's micro-batches before the model runs them (attention
        tensor parallelism broadcasts them to the other ranks); on_mtp_pass: the same for each
        MTP pass of speculative decoding (`Speculator.on_pass`)."""
        self.cfg, self.model, self.experts, self.engine_cfg = cfg, model, experts, engine_cfg
        self.tokenizer, self.on_batches = tokenizer, on_batches
        # the kernels, chosen once (load_engine's, given to the model, where chosen for this config)
        self.kernels = model.kernels = engine_cfg.select_kernels(cfg, model.device, reuse=model.kernels)
        if isinstance(experts, LocalExperts):  # (on the engine's kernels; a token's experts added in order)
            experts.use_kernels(self.kernels)
            model.experts_sum_in_order = True
        log.info("%s", self.kernels.summary())
        self.cache = engine_cfg.latent_cache(cfg, model)
        self.scheduler = Scheduler(engine_cfg.scheduler_config(cfg), self.cache.num_blocks, cfg.eos_token_ids,
                                   engine_cfg.prefix_caching, cfg.v4_state_start if cfg.is_v4 else None,
                                   self.cache.num_state_blocks)  # fmt: skip
        self._detok: dict[str, Detokenizer] = {}
        self._matchers: dict[str, Matcher] = {}  # requests with structured output: their grammar state
        self._grammar: GrammarCompiler | None = None
        self.spec: Speculator | None = None  # speculative decoding with the MTP module (speculative.py)
        if engine_cfg.speculative_tokens:  # (its MoE layer's experts: in process, or on the expert workers)
            self.spec = Speculator(model, experts, self.cache.kv, engine_cfg.speculative_tokens, self.max_model_len,
                                   self._matchers, self.scheduler.grow_blocks,
                                   engine_cfg.speculative_disable_by_batch_size,
                                   self.scheduler.allocator.block_states if cfg.is_v4 else None)  # fmt: skip
            self.spec.on_pass = on_mtp_pass
        self.graphs: DecodeGraphs | None = None  # in-process experts: whole decode steps
        self.segment_graphs: list[SegmentedDecodeGraphs] = []  # remote experts: one per micro-batch
        if engine_cfg.cuda_graphs and model.device.type == "cuda" and on_batches is None:
            self.enable_decode_graphs()

    def enable_decode_graphs(self, capture: bool = True) -> bool:
        """Run decode-only steps on static buffers, replayed from CUDA graphs (capture=False: the
        same buffers, eagerly; for tests): whole steps with in-process experts, pieces between the
        expert messages with remote ones (decode_graphs.py). Only for the V3 model; a step that
        does not capture leaves the engine eager (logged). Whether graphs are on."""
        if self.graphs is not None or self.segment_graphs:
            return True
        if self.cfg.is_v4 or self.cfg.has_indexer or self.spec is not None:
            return False  # (V3.2's top-k attention runs the torch path over the whole static table;
            # speculative steps verify 1 + k rows per sequence and keep hidden states: not graphed yet)
        scratch = self.scheduler.allocator.reserve()  # the padding rows' block
        args = (self.cache.kv, self.cfg.num_moe_layers, self.cfg.n_routed_experts, scratch,
                self.engine_cfg.max_num_seqs, blocks_needed(self.max_model_len), capture)  # fmt: skip
        try:
            if isinstance(self.experts, LocalExperts):
                self.graphs = DecodeGraphs(self.model, self.experts, *args)
            else:
                self.segment_graphs = [
                    SegmentedDecodeGraphs(self.model, *args) for _ in range(self.engine_cfg.micro_batches)
                ]
        except Exception as e:  # a synchronising op in the step, an old driver: stay eager
            log.warning("decode CUDA graphs unavailable (%s: %s); running eagerly", type(e).__name__, e)
            self.segment_graphs = []
            self.scheduler.allocator.unreserve(scratch)
            return False
        return True

    @property
    def max_model_len(self) -> int:
        return self.scheduler.cfg.max_model_len

    # ---- requests -----------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        resumed: tuple[int, int] = (0, 0),
    ) -> str:
        """Queue a request. resumed = (n, chars): the last n prompt tokens are this request's own
        output produced elsewhere (failover), of which `chars` characters were already sent: its
        text continues from there."""
        params.validate()
        bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(
                "prompt", f"token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})"
            )
        if any(t >= self.cfg.vocab_size for t in params.stop_token_ids):
            raise RequestError("stop_token_ids", f"stop_token_ids must be in [0, {self.cfg.vocab_size})")
        if any(t >= self.cfg.vocab_size for t in params.logit_bias):
            raise RequestError(
                "logit_bias", f"logit_bias names a token outside the vocabulary [0, {self.cfg.vocab_size})"
            )
        if params.stop and self.tokenizer is None:
            raise RequestError("stop", "stop strings need a tokenizer; this model runs in token-id mode")
        n, chars = resumed
        earlier = list(prompt_ids[len(prompt_ids) - n :]) if n else []  # output produced elsewhere
        matcher = self._matcher(params, earlier)
        seq = Sequence(list(prompt_ids), params, **({"request_id": request_id} if request_id else {}))
        seq.num_resumed = n
        self.scheduler.add(seq)
        if matcher is not None:
            self._matchers[seq.request_id] = matcher
        if self.tokenizer is not None:
            self._detok[seq.request_id] = Detokenizer(self.tokenizer, params.stop, earlier, chars)
        return seq.request_id

    def _matcher(self, params: SamplingParams, earlier_output: list[int]) -> Matcher | None:
        """The grammar state of a request with structured output, advanced past the output it
        produced elsewhere (failover); None without one."""
        if params.json_schema is None:
            return None
        if self.tokenizer is None:
            raise RequestError(
                "json_schema", "structured outputs need a tokenizer; this model runs in token-id mode"
            )
        if self._grammar is None:
            self._grammar = GrammarCompiler(
                self.tokenizer.to_json(), self.cfg.vocab_size, self.cfg.eos_token_ids
            )
        try:
            matcher = self._grammar.matcher(params.json_schema)
        except GrammarError as e:
            raise RequestError("json_schema", str(e)) from None
        if not all(matcher.consume(t) for t in earlier_output):
            raise RequestError("prompt", "the resumed output does not follow the request's grammar")
        return matcher

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request between steps (its blocks are freed at once); its final output, None
        if it is unknown or finished."""
        ended = self._end([request_id], "abort", None)
        return ended[0] if ended else None

    def fail(self, request_ids: list[str], error: str) -> list[RequestOutput]:
        """End these requests with finish_reason "error" (unknown or finished ids are skipped) and
        drop every state they hold (cache blocks, detokenizer); returns their final outputs."""
        return self._end(request_ids, "error", error)

    def _end(self, request_ids: list[str], reason: str, error: str | None) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            seq = self.scheduler.finish_id(request_id, reason)
            self._detok.pop(request_id, None)
            self._matchers.pop(request_id, None)
            if seq is not None:
                outputs.append(RequestOutput(request_id, finished=True, finish_reason=reason, error=error,
                                             num_prompt_tokens=len(seq.prompt_ids),
                                             num_output_tokens=len(seq.output_ids),
                                             num_cached_tokens=seq.num_cached_tokens or 0))  # fmt: skip
        return outputs

    def unfinished_ids(self) -> list[str]:
        """Requests running or waiting, running first."""
        return [s.request_id for s in (*self.scheduler.running, *self.scheduler.waiting)]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> dict:
        sched = self.scheduler
        return {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "max_num_seqs": self.engine_cfg.max_num_seqs,
            "kv_blocks_total": sched.allocator.num_blocks,  # (less a reserved scratch block)
            "kv_cache_dtype": self.engine_cfg.kv_cache_dtype,
            "kv_cache_tokens": sched.allocator.num_blocks * BLOCK_SIZE,  # tokens the cache holds
            "kv_blocks_used": sched.allocator.num_blocks - sched.num_free_blocks,
            "state_blocks_total": self.cache.num_state_blocks,  # DeepSeek-V4's window state (0 otherwise)
            "state_blocks_used": self.cache.num_state_blocks - sched.allocator.num_free_states,
            "preemptions": sched.num_preemptions,
            "prefix_cache": {
                "queried_tokens": sched.prefix_queried_tokens,
                "hit_tokens": sched.prefix_hit_tokens,
                "cached_blocks": sched.allocator.num_cached,
                "evictions": sched.allocator.evictions,
            },
            **self.kernels.stats(),  # family -> the kernel running it; -> {better ones not taken: why}
            # speculative decoding's counters (vLLM's spec_decode_* quantities); None when off
            "spec_decode": None if self.spec is None else self.spec.as_dict(),
        }

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> StepResult:
        """Schedule, run the model (micro-batches interleaved at expert waits), sample, advance.
        A step whose model run fails raises StepFailed naming its requests; it changed none of
        them, so the next step schedules the same work again."""
        t0 = time.perf_counter()
        chunks = self.scheduler.schedule()
        # routed (token, choice) pairs per MoE layer: the main model's, then the MTP pass's (speculating)
        layers = self.cfg.num_moe_layers + (len(self.model.mtp) if self.spec is not None else 0)
        tally = ExpertTally(
            torch.zeros(layers, self.cfg.n_routed_experts, dtype=torch.long, device=self.model.device)
        )
        if not chunks:
            return StepResult([], 0, 0, tally.load.cpu(), 0.0, time.perf_counter() - t0)
        decodes = all(c.num_tokens == 1 and c.wants_logits for c in chunks)
        # decodes replay one graph, unsplit (in-process experts: no expert wait to overlap)
        graphed = self.graphs is not None and decodes
        parts = [chunks] if graphed else split_micro_batches(chunks, self.engine_cfg.micro_batches)
        try:
            batches = [self._batch(part) for part in parts]
            if self.on_batches is not None:
                self.on_batches(batches)
            if graphed and self.graphs.fits(batches[0]):
                replayed, tally.load = self.graphs.run(batches[0])
                logits = [replayed]
            else:
                graphs = self.segment_graphs[: len(batches)] if decodes else []  # (one per micro-batch)
                if graphs and all(g.fits(b) for g, b in zip(graphs, batches, strict=True)):
                    steps = [g.forward(b) for g, b in zip(graphs, batches, strict=True)]
                else:
                    steps = [self.model.forward(b, self.cache.kv) for b in batches]
                logits = run_interleaved(steps, self.experts, tally)
        except Exception as e:
            raise StepFailed([c.seq.request_id for c in chunks], e) from e
        logits = logits[0] if len(logits) == 1 else torch.cat(logits)
        logits = self._score_prompts([c for part in parts for c in part], logits)
        want = [c.seq for c in chunks if c.wants_logits]
        outputs, logits, ids = self._advance(chunks, want, logits)
        if self.spec is not None:  # (the step's measure for the gate: speculating or plain, by batch size)
            self.spec.record_step(chunks, sum(len(o.token_ids) for o in outputs), time.perf_counter() - t0)
            self._draft(parts, batches, tally)
        return StepResult(
            outputs,
            num_seqs=len(chunks),
            num_tokens=sum(c.num_tokens for c in chunks),
            expert_load=tally.load.cpu(),
            expert_wait_s=tally.wait_s,
            seconds=time.perf_counter() - t0,
            logits=logits,
            logits_ids=ids,
        )

    def _draft(self, parts: list[list[Chunk]], batches: list[StepBatch], tally: ExpertTally) -> None:
        """The MTP module's pass after a step (speculative.py); a failure there costs the drafts
        only (the step's tokens are out)."""
        eos = set(self.cfg.eos_token_ids)
        try:
            self.spec.draft(parts, batches, tally, self._history, lambda s: self._held_back(s, eos),
                            len(self.scheduler.running))  # fmt: skip
        except Exception:
            log.exception("speculative decoding: the MTP pass failed; this step drafts nothing")
            for c in (c for part in parts for c in part):
                c.seq.draft, c.seq.draft_probs = [], None

    def _batch(self, chunks: list[Chunk]) -> StepBatch:
        block_states = self.scheduler.allocator.block_states if self.cfg.is_v4 else None
        return StepBatch.build(
            [(c.tokens, c.start, c.seq.block_ids, c.wants_logits, c.extra_rows) for c in chunks],
            self.model.device,
            block_states,
            decode_upto=1 + self.spec.k if self.spec else 1,  # (verify chunks: decode rows)
            keep_hidden=self.spec is not None,  # (the MTP module's input)
        )  # fmt: skip

    def _score_prompts(self, chunks: list[Chunk], logits: torch.Tensor) -> torch.Tensor:
        """Prompt logprobs from the rows the chunks asked for (each chunk's `prompt_rows`, then
        its sampled row, in `chunks`' order: the batches' logits_index), added to their
        sequences; the logits of the sampled rows only."""
        if not any(c.prompt_rows for c in chunks):
            return logits
        sampled, at = [], 0
        for c in chunks:
            rows = c.prompt_rows
            if rows:
                seq, first = c.seq, c.start + rows.start  # logits of position p score token p + 1
                targets = torch.tensor(
                    seq.prompt_ids[first + 1 : first + 1 + len(rows)], device=logits.device
                )
                seq.prompt_logprobs += prompt_logprobs(logits[at : at + len(rows)], targets,
                                                       seq.params.prompt_logprobs)  # fmt: skip
                at += len(rows)
            if c.wants_logits:  # (a verify chunk: a row per draft, then its last)
                sampled += range(at, at + 1 + len(c.draft))
                at += 1 + len(c.draft)
        return logits[sampled]

    def _held_back(self, seq: Sequence, eos: set[int]) -> set[int]:
        """The tokens min_tokens forbids for now: EOS (unless ignored) and the stop tokens. A
        request with a grammar has none: its grammar decides where the output ends."""
        if len(seq.output_ids) >= seq.params.min_tokens or seq.request_id in self._matchers:
            return set()
        return (set() if seq.params.ignore_eos else eos) | set(seq.params.stop_token_ids)

    @staticmethod
    def _history(seq: Sequence) -> tuple[list[int], list[int]]:
        """(prompt, output so far) for penalties: a resumed request's earlier output counts as output."""
        if not seq.params.processes_logits:
            return [], []
        cut = len(seq.prompt_ids) - seq.num_resumed
        return seq.prompt_ids[:cut], seq.prompt_ids[cut:] + seq.output_ids

    def _advance(
        self, chunks: list[Chunk], want: list[Sequence], logits: torch.Tensor
    ) -> tuple[list[RequestOutput], torch.Tensor, list[str]]:
        """Sample from `logits` (a row per sequence in `want`; speculating: a row per token of its
        verify chunk) and advance the requests; (outputs, the rows the emitted tokens came from,
        their request ids)."""
        eos = set(self.cfg.eos_token_ids)
        context = (
            [self._history(s) for s in want],
            [self._held_back(s, eos) for s in want],
            self._allowed(want),
        )
        if self.spec is not None:
            tokens, logprobs, used = self.spec.sample(chunks, logits, *context)
            logits, ids = logits[used], [s.request_id for s, t in zip(want, tokens, strict=True) for _ in t]
        else:
            tokens, logprobs = sample(logits, [s.params for s in want], [s.generator for s in want], *context)
            ids = [s.request_id for s in want]
        before = {s.request_id: len(s.output_ids) for s in want}
        outputs = []
        for seq in self.scheduler.update(chunks, tokens, logprobs):
            b = before[seq.request_id]
            matcher = self._matchers.get(seq.request_id)
            error = None
            if matcher is not None and seq.status is not SeqStatus.FINISHED:
                if not all(matcher.consume(t) for t in seq.output_ids[b:]):
                    error = f"structured output: {matcher.error or 'the grammar refused the sampled token'}"
                    self.scheduler.finish(seq, "error")
                elif matcher.done:  # the grammar is complete: nothing but EOS could follow
                    self.scheduler.finish(seq, "stop")
            text = self._detokenize(seq, b)
            out = RequestOutput(
                seq.request_id,
                token_ids=seq.output_ids[b:],
                logprobs=seq.output_logprobs[b:],
                text=text,
                num_prompt_tokens=len(seq.prompt_ids),
                num_cached_tokens=seq.num_cached_tokens or 0,
                error=error,
            )
            if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:  # (with the first token)
                out.prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
            if seq.status is SeqStatus.FINISHED:
                out.finished, out.finish_reason = True, seq.finish_reason
                self._detok.pop(seq.request_id, None)
                self._matchers.pop(seq.request_id, None)
            out.num_output_tokens = len(seq.output_ids)
            outputs.append(out)
        return outputs, logits, ids

    def _detokenize(self, seq: Sequence, b: int) -> str:
        """The text of seq's tokens from output index b on, token by token: at a stop string (once
        min_tokens are out, which holds stop strings too) the request stops there, and tokens
        after it (a speculative step's) are dropped."""
        detok = self._detok.get(seq.request_id)
        if detok is None:
            return ""
        text, n = "", len(seq.output_ids)
        for j in range(b + 1, n + 1):
            piece, stopped = detok.step(seq.output_ids[:j], final=seq.status is SeqStatus.FINISHED and j == n)
            text += piece
            if stopped and j >= seq.params.min_tokens:
                del seq.output_ids[j:], seq.output_logprobs[j:]
                self.scheduler.finish(seq, "stop")
                break
        if seq.status is SeqStatus.FINISHED and not text:
            text = detok.step(seq.output_ids, final=True)[0]
        return text

    def _allowed(self, want: list[Sequence]) -> tuple[list[int], torch.Tensor] | None:
        """(rows, mask [rows, vocab]): the tokens the grammars of the constrained rows allow."""
        rows = [i for i, s in enumerate(want) if s.request_id in self._matchers]
        if not rows:
            return None
        return rows, self._grammar.allowed([self._matchers[want[i].request_id] for i in rows])

    # ---- offline batch ------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Completion]:
        """Run prompts to completion; results in input order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        acc = {rid: Completion(rid, list(p), [], "", "", []) for rid, p in zip(ids, prompts, strict=True)}
        while self.has_unfinished():
            for out in self.step().outputs:
                acc[out.request_id].add(out)
        return [acc[rid] for rid in ids]


def load_engine(
    engine_cfg: EngineConfig,
    make_experts: Callable[[ModelConfig, CheckpointReader, torch.dtype], ExpertBackend] | None = None,
) -> tuple[ModelConfig, DeepseekV3, ExpertBackend, Tokenizer | None]:
    """Read a checkpoint for an engine: the attention side, the expert backend (default: every
    routed expert in process) and the tokenizer (None in token-id mode)."""
    if engine_cfg.num_threads:
        torch.set_num_threads(engine_cfg.num_threads)
    model_dir = Path(engine_cfg.model)
    cfg = ModelConfig.from_dir(model_dir)
    dtype = parse_dtype(engine_cfg.dtype)
    weight_dtype = check_weight_dtype(engine_cfg.weight_dtype, dtype, engine_cfg.device, cfg)
    if engine_cfg.keep_fp8_experts:
        check_keep_fp8_experts(cfg)
    if engine_cfg.keep_fp8_linears:
        check_keep_fp8_linears(cfg)
    # the kernels, chosen once (building the C++ CPU kernels now, once per machine, not mid-request)
    kernels = engine_cfg.select_kernels(cfg)
    reader = CheckpointReader.for_config(model_dir, cfg)
    mtp = engine_cfg.speculative_tokens > 0  # (the drafter: its layer and experts)
    if cfg.is_v4:  # (the same forward(batch, cache) contract)
        model = DeepseekV4.load(reader, cfg, dtype, engine_cfg.device, kernels=kernels, mtp=mtp)
    else:
        model = DeepseekV3.load(reader, cfg, dtype, engine_cfg.device, weight_dtype=weight_dtype,
                                keep_fp8=engine_cfg.keep_fp8_linears, kernels=kernels, mtp=mtp)  # fmt: skip
    if make_experts is None:
        experts = LocalExperts.load_all(reader, cfg, weight_dtype or dtype, keep_fp8=engine_cfg.keep_fp8_experts,
                                        kernels=kernels, mtp=mtp)  # fmt: skip
        experts = experts.to(engine_cfg.device)
    else:
        experts = make_experts(cfg, reader, weight_dtype or dtype)  # (their dtype, when held in process)
    reader.close()
    return cfg, model, experts, Tokenizer.from_dir(model_dir)


class LocalEngine(Engine):
    """The whole model in one process: attention side + all routed experts."""

    def __init__(self, engine_cfg: EngineConfig):
        cfg, model, experts, tokenizer = load_engine(engine_cfg)
        super().__init__(cfg, model, experts, engine_cfg, tokenizer)
        log.info("LocalEngine: %s, %d layers (%d MoE), %d KV blocks", engine_cfg.model,
                 self.cfg.num_hidden_layers, self.cfg.num_moe_layers, self.cache.num_blocks)  # fmt: skip
