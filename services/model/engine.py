"""The inference engine: scheduler + model + expert backend + sampler, one step at a time.

`Engine` is what an attention worker runs (with a remote expert backend); `LocalEngine` is the
same engine with every routed expert in process: the single-process baseline every cluster
result is compared to.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import CheckpointReader
from .config import ModelConfig, parse_dtype
from .kv_cache import PagedLatentCache, blocks_needed
from .model import DeepseekV3, ExpertBackend, StepBatch, StepGen, run_interleaved
from .moe import LocalExperts
from .sampling import SamplingParams, TokenLogprobs, sample
from .scheduler import Chunk, RequestError, Scheduler, SchedulerConfig, SeqStatus, Sequence
from .tokenizer import Detokenizer, Tokenizer

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    model: str
    dtype: str = "float32"
    device: str = "cpu"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: min(max_position_embeddings, 4096)
    num_kv_blocks: int | None = None  # default: enough for max_num_seqs full-length sequences
    kv_cache_gib: float = 2.0  # upper bound for the default num_kv_blocks
    max_waiting: int = 1024
    num_threads: int | None = None  # torch intra-op threads (None: leave torch's default)
    micro_batches: int = 1  # 2 = ping-pong: one micro-batch's expert calls overlap the other's attention
    attn_tp: int = 1  # attention tensor parallelism (head slices, replicated latent cache)

    def scheduler_config(self, cfg: ModelConfig) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len or min(cfg.max_position_embeddings, 4096),
            max_waiting=self.max_waiting,
        )

    def kv_blocks(self, cfg: ModelConfig, max_model_len: int) -> int:
        if self.num_kv_blocks:
            return self.num_kv_blocks
        per_block = PagedLatentCache.bytes_per_block(
            cfg.num_hidden_layers, cfg.latent_dim, parse_dtype(self.dtype)
        )
        wanted = self.max_num_seqs * blocks_needed(max_model_len)
        return max(1, min(wanted, int(self.kv_cache_gib * 2**30) // per_block))


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
    error: str | None = None  # set with finish_reason "error"


@dataclass
class Completion:
    """A finished request (what `generate` returns)."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprobs | None]


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
    def __init__(
        self,
        cfg: ModelConfig,
        model: DeepseekV3,
        experts: ExpertBackend,
        engine_cfg: EngineConfig,
        tokenizer: Tokenizer | None = None,
    ):
        self.cfg, self.model, self.experts, self.engine_cfg = cfg, model, experts, engine_cfg
        self.tokenizer = tokenizer
        if engine_cfg.attn_tp != model.attn_tp:
            model.set_attn_tp(engine_cfg.attn_tp)
        sched_cfg = engine_cfg.scheduler_config(cfg)
        num_blocks = engine_cfg.kv_blocks(cfg, sched_cfg.max_model_len)
        self.scheduler = Scheduler(sched_cfg, num_blocks, cfg.eos_token_ids)
        self.cache = PagedLatentCache(
            cfg.num_hidden_layers, num_blocks, cfg.latent_dim, model.dtype, model.device
        )
        self._detok: dict[str, Detokenizer] = {}
        self._text: dict[str, list[str]] = {}

    @property
    def max_model_len(self) -> int:
        return self.scheduler.cfg.max_model_len

    # ---- requests -----------------------------------------------------------------------
    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        params.validate()
        bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(
                "prompt", f"token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})"
            )
        if params.stop and self.tokenizer is None:
            raise RequestError("stop", "stop strings need a tokenizer; this model runs in token-id mode")
        seq = Sequence(list(prompt_ids), params, **({"request_id": request_id} if request_id else {}))
        self.scheduler.add(seq)
        if self.tokenizer is not None:
            self._detok[seq.request_id] = Detokenizer(self.tokenizer, params.stop)
        return seq.request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request; call it between steps (its blocks are freed at once)."""
        seq = self.scheduler.abort(request_id)
        self._detok.pop(request_id, None)
        return seq is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step -----------------------------------------------------------------------
    def prepare(self) -> tuple[list[Chunk], list[StepBatch]]:
        """Schedule a step: its chunks, and one StepBatch per micro-batch (none if idle)."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return chunks, []
        return chunks, [
            self.build_batch(part) for part in split_micro_batches(chunks, self.engine_cfg.micro_batches)
        ]

    def build_batch(self, chunks: list[Chunk]) -> StepBatch:
        return StepBatch.build(
            [
                (c.seq.token_slice(c.start, c.start + c.num_tokens), c.start, c.seq.block_ids, c.wants_logits)
                for c in chunks
            ],
            self.model.device,
        )

    def forward(self, batch: StepBatch) -> StepGen:
        return self.model.forward(batch, self.cache.kv)

    def finish_step(self, chunks: list[Chunk], logits: torch.Tensor) -> list[RequestOutput]:
        """Sample from `logits` (one row per chunk that wanted logits) and advance requests."""
        want = [c.seq for c in chunks if c.wants_logits]
        tokens, logprobs = sample(logits, [s.params for s in want], [s.generator for s in want])
        advanced = self.scheduler.update(chunks, tokens, logprobs)
        outputs = []
        for seq in advanced:
            out = RequestOutput(
                seq.request_id,
                token_ids=[seq.output_ids[-1]],
                logprobs=[seq.output_logprobs[-1]],
                num_prompt_tokens=len(seq.prompt_ids),
            )
            detok = self._detok.get(seq.request_id)
            if detok is not None:
                out.text, stopped = detok.step(seq.output_ids, final=seq.status is SeqStatus.FINISHED)
                if stopped:
                    self.scheduler.finish(seq, "stop")
            if seq.status is SeqStatus.FINISHED:
                out.finished, out.finish_reason = True, seq.finish_reason
                if detok is not None and not out.text:
                    out.text = detok.step(seq.output_ids, final=True)[0]
                self._detok.pop(seq.request_id, None)
            out.num_output_tokens = len(seq.output_ids)
            outputs.append(out)
        return outputs

    def run_model(self, batches: list[StepBatch]) -> torch.Tensor:
        """Forward the micro-batches (interleaved at expert waits); logits in chunk order."""
        logits = run_interleaved([self.forward(b) for b in batches], self.experts)
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def step(self) -> list[RequestOutput]:
        chunks, batches = self.prepare()
        if not batches:
            return []
        return self.finish_step(chunks, self.run_model(batches))

    # ---- offline batch ------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Completion]:
        """Run prompts to completion; results in input order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        acc = {rid: Completion(rid, list(p), [], "", "", []) for rid, p in zip(ids, prompts, strict=True)}
        while self.has_unfinished():
            for out in self.step():
                c = acc[out.request_id]
                c.token_ids += out.token_ids
                c.logprobs += out.logprobs
                c.text += out.text
                if out.finished:
                    c.finish_reason = out.finish_reason
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
    reader = CheckpointReader.for_config(model_dir, cfg)
    model = DeepseekV3.load(reader, cfg, dtype, engine_cfg.device)
    if make_experts is None:
        experts = LocalExperts.load_all(reader, cfg, dtype).to(engine_cfg.device)
    else:
        experts = make_experts(cfg, reader, dtype)
    reader.close()
    return cfg, model, experts, Tokenizer.from_dir(model_dir)


class LocalEngine(Engine):
    """The whole model in one process: attention side + all routed experts."""

    def __init__(self, engine_cfg: EngineConfig):
        cfg, model, experts, tokenizer = load_engine(engine_cfg)
        super().__init__(cfg, model, experts, engine_cfg, tokenizer)
        log.info("LocalEngine: %s, %d layers (%d MoE), %d KV blocks", engine_cfg.model,
                 self.cfg.num_hidden_layers, self.cfg.num_moe_layers, self.cache.num_blocks)  # fmt: skip
