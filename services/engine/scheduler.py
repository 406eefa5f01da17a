"""Continuous-batching scheduler: waiting/running queues, chunked prefill mixed with decodes,
and the paged latent cache's block accounting. Pure Python: no tensors but the per-request
sampling generator, no Ray.

Each step: every running sequence that is decoding gets its one token; then sequences that are
still prefilling get chunks; then waiting requests are admitted (first come, first served) while
`max_num_seqs`, the `max_num_batched_tokens` budget and free cache blocks allow. A request is
admitted only if the blocks for all its current tokens fit; decodes take one more block every
64 tokens, and when none is free the newest running sequence is preempted (its blocks freed,
recomputed later from its tokens).

Prefix caching: at admission a sequence takes the cached blocks of its longest known prefix
(full blocks only, and never its last token: at least one token is always computed, into a
private block) and starts computing after them; each block a sequence fills completely is
registered under its chained hash for later requests. Shared blocks are never written.

DeepSeek-V4 (`state_start` set): a sequence also holds *state blocks* (its recent tokens' window
state, kv_cache.V4Cache) for the blocks from `state_start(num_computed)` on, taken as chunks
reach new blocks and released once its tokens move past them (at the next step's scheduling: the
MTP module's pass after a step still reads the windows of the step's rows). A prefill chunk is cut to the
state blocks there are room for (a decode preempts like for blocks), and a prefix hit counts only
up to the last block whose lookback still has its state blocks attached.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from services.model.kv_cache import BLOCK_SIZE, blocks_needed

from .block_allocator import BlockAllocator, block_hash, salt_root
from .sampling import SamplingParams, TokenLogprobs

PROMPT_LOGPROBS_CHUNK = 256  # prompt tokens per step of a request that asks for prompt logprobs


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later (HTTP 429/503)."""


class RequestError(ValueError):
    """A request that can never be served as asked (HTTP 400)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full, computed blocks
    num_computed: int = 0  # tokens whose latent rows are in the cache
    state_blocks: range = range(0)  # DeepSeek-V4: indices of the blocks whose state blocks it holds
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    num_resumed: int = 0  # the last prompt tokens are this request's own earlier output (failover)
    prefix_hashes: tuple[int, list[int]] | None = field(default=None, repr=False)  # (num_tokens, hashes) memo
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # stop | length | abort | error
    generator: torch.Generator | None = None
    # params.prompt_logprobs: entry p for prompt token p (None for the first), filled as prefill goes
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    # speculative decoding: tokens drafted after output_ids (checked by the next step's verify
    # chunk) and, for a sampled request, the draft distribution [len(draft), vocab] they came from
    draft: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.generator is None:
            self.generator = self.params.make_generator()
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def prompt_logprobs_to_go(self) -> int:
        """Prompt positions still to score for prompt logprobs (a resumed request's own earlier
        output, at the end of its prompt, is not scored again)."""
        if self.prompt_logprobs is None:
            return 0
        return len(self.prompt_ids) - self.num_resumed - len(self.prompt_logprobs)

    def prompt_rows(self, start: int, n: int) -> range:
        """Rows (0-based within a chunk of positions start .. start+n-1) whose logits score the
        next prompt token for prompt logprobs: each prompt position but the last, once."""
        if not self.prompt_logprobs_to_go:
            return range(0)
        first = len(self.prompt_logprobs) - 1  # the position whose logits score the next token
        last = len(self.prompt_ids) - self.num_resumed - 1
        lo, hi = max(start, first), min(start + n, last)
        return range(lo - start, hi - start) if hi > lo else range(0)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end]


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    max_waiting: int = 1024

    def validate(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs")
        if self.max_model_len < 2 or self.max_waiting < 1:
            raise ValueError("need max_model_len >= 2 and max_waiting >= 1")


@dataclass
class Chunk:
    seq: Sequence
    start: int  # first position of this step's tokens
    num_tokens: int  # (a verify chunk's drafts included)
    draft: list[int] = field(default_factory=list)  # speculative decoding: drafts after the last token
    # whether the chunk reaches its sequence's last token (so its last row is sampled): as scheduled
    wants_logits: bool = field(init=False)

    def __post_init__(self):
        self.wants_logits = self.start + self.num_tokens - len(self.draft) == self.seq.num_tokens

    @property
    def tokens(self) -> list[int]:
        """This step's tokens (a verify chunk: its last token, then the drafts)."""
        n = self.num_tokens - len(self.draft)
        return self.seq.token_slice(self.start, self.start + n) + self.draft

    @property
    def prompt_rows(self) -> range:
        """Rows of this chunk whose logits give prompt logprobs (before the sampled row, if any)."""
        return self.seq.prompt_rows(self.start, self.num_tokens)

    @property
    def extra_rows(self) -> range:
        """Rows before the last whose logits the step computes: prompt-logprob rows, or a verify
        chunk's rows before its drafts (the target's distribution at each)."""
        return range(len(self.draft)) if self.draft else self.prompt_rows


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        num_blocks: int,
        eos_token_ids: tuple[int, ...] = (),
        prefix_caching: bool = True,
        state_start: Callable[[int], int] | None = None,
        num_state_blocks: int = 0,
    ):
        """state_start (DeepSeek-V4, `ModelConfig.v4_state_start`): the first position whose
        window state a step computing from a given position reads; `num_state_blocks` the pool."""
        cfg.validate()
        self.cfg, self.state_start = cfg, state_start
        self.allocator = BlockAllocator(num_blocks, prefix_caching, num_state_blocks)
        self.prefix_queried_tokens = 0  # prompt tokens looked up at first admissions
        self.prefix_hit_tokens = 0  # of which found in the cache
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self._prompt_rows_left = PROMPT_LOGPROBS_CHUNK  # (set per step by `schedule`)

    # ---- admission ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a request; raises RequestError if it can never run, QueueFullError if full."""
        n = len(seq.prompt_ids)
        if n == 0:
            raise RequestError("prompt", "the prompt is empty")
        if n + seq.params.max_tokens > self.cfg.max_model_len:
            raise RequestError(
                "max_tokens",
                f"prompt ({n} tokens) + max_tokens ({seq.params.max_tokens}) exceeds the context "
                f"length {self.cfg.max_model_len}",
            )
        if blocks_needed(n + seq.params.max_tokens) > self.allocator.num_blocks:
            raise RequestError(
                "max_tokens",
                f"prompt ({n} tokens) + max_tokens ({seq.params.max_tokens}) needs "
                f"{blocks_needed(n + seq.params.max_tokens) * BLOCK_SIZE} tokens of KV cache; it holds "
                f"{self.allocator.num_blocks * BLOCK_SIZE}",
            )
        if seq.request_id in self._by_id:
            raise RequestError("request_id", f"duplicate request id {seq.request_id!r}")
        if len(self.waiting) >= self.cfg.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.cfg.max_waiting} requests)")
        self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def finish_id(self, request_id: str, reason: str) -> Sequence | None:
        """Finish a request now (abort, error) and free its blocks; None if unknown/finished."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        self.finish(seq, reason)
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self._by_id.pop(seq.request_id, None)

    def _free(self, seq: Sequence) -> None:
        self.allocator.release_state([seq.block_ids[i] for i in seq.state_blocks][::-1])
        seq.state_blocks = range(0)
        # last block first: a cached prefix is evicted from its tail, its head stays reusable
        self.allocator.free(seq.block_ids[::-1])
        seq.block_ids, seq.block_hashes = [], []
        seq.num_computed = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> list[Chunk]:
        budget = self.cfg.max_num_batched_tokens
        self._prompt_rows_left = PROMPT_LOGPROBS_CHUNK  # (this step's rows of prompt-logprob logits)
        chunks: list[Chunk] = []
        if self.state_start is not None:  # (after the last step's MTP pass, which read its chunks' windows)
            for seq in self.running:
                self._release_state(seq)

        # 1. decodes (one token each, with its drafts where speculating), allocating a block every
        # 64 tokens; preempt if needed. Drafts take only budget that leaves every decode its token.
        decoding = [s for s in self.running if s.num_tokens - s.num_computed == 1]
        spare = budget - len(decoding)
        for seq in decoding:
            if seq.status is not SeqStatus.RUNNING:
                continue
            draft = seq.draft[:spare]  # (as many drafts as the budget leaves room for)
            if not self._ensure_blocks(seq, seq.num_tokens + len(draft)):
                continue  # seq itself was preempted
            chunks.append(Chunk(seq, seq.num_computed, 1 + len(draft), draft))
            budget -= 1 + len(draft)
            spare -= len(draft)

        # 2. prefills already running (chunked)
        for seq in list(self.running):
            remaining = seq.num_tokens - seq.num_computed
            if seq.status is SeqStatus.RUNNING and remaining > 1 and budget > 0 and self._logits_room(seq):
                n = min(remaining, budget, self._state_room(seq), self._logits_room(seq))
                if n < 1:  # no state block free (V4): wait, unless nothing else can run
                    if chunks or not self._ensure_blocks(seq, seq.num_computed + 1):
                        continue
                    n = 1
                self._hold_state(seq, seq.num_computed + n)
                self._add_chunk(chunks, Chunk(seq, seq.num_computed, n))
                budget -= n

        # 3. admit waiting requests, first come first served, reusing cached prefix blocks
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if not self._logits_room(seq):  # (this step's prompt-logprob rows are spent: next step)
                break
            hashes = self._prefix_hashes(seq)
            # prompt logprobs need every prompt position computed: no cache hit (vLLM does the same)
            hit = [] if seq.prompt_logprobs_to_go else self._usable(self.allocator.lookup(hashes))
            seq.block_ids, seq.num_computed = hit, len(hit) * BLOCK_SIZE
            if self.state_start is not None:  # the hit's lookback keeps its attached state blocks
                first = self._first_state_block(len(hit))
                seq.state_blocks = range(first, first)
                self._hold_state(seq, seq.num_computed)
            need = blocks_needed(seq.num_tokens) - len(hit)
            n = min(seq.num_tokens - seq.num_computed, budget, self._state_room(seq), self._logits_room(seq))
            if n < 1 or not self.allocator.can_allocate(need):
                self._free(seq)  # (gives the hit back)
                break
            seq.block_ids = hit + self.allocator.allocate(need)
            seq.block_hashes = hashes[: len(hit)]
            self.waiting.popleft()
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.num_computed
                self.prefix_queried_tokens += seq.num_tokens
                self.prefix_hit_tokens += seq.num_computed
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._hold_state(seq, seq.num_computed + n)
            self._add_chunk(chunks, Chunk(seq, seq.num_computed, n))
            budget -= n
        return chunks

    def _add_chunk(self, chunks: list[Chunk], chunk: Chunk) -> None:
        chunks.append(chunk)
        self._prompt_rows_left -= len(chunk.prompt_rows)

    def _logits_room(self, seq: Sequence) -> int:
        """A prefill chunk scoring prompt logprobs computes logits for each of its rows: at most
        PROMPT_LOGPROBS_CHUNK such rows in a step, over all its sequences, so [rows, vocab]
        stays bounded (0: none left for this step)."""
        return max(0, self._prompt_rows_left) if seq.prompt_logprobs_to_go else seq.num_tokens

    def _prefix_hashes(self, seq: Sequence) -> list[int]:
        """Chained hashes of the full blocks a cached prefix of `seq` may cover: all but the
        block of its last token (which must be computed)."""
        if not self.allocator.caching:
            return []
        if seq.prefix_hashes is not None and seq.prefix_hashes[0] == seq.num_tokens:
            return seq.prefix_hashes[1]
        hashes, parent = [], salt_root(seq.params.cache_salt)
        for i in range((seq.num_tokens - 1) // BLOCK_SIZE):
            parent = block_hash(parent, seq.token_slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE))
            hashes.append(parent)
        seq.prefix_hashes = (seq.num_tokens, hashes)
        return hashes

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks `seq` has filled completely since the last call."""
        while len(seq.block_hashes) < seq.num_computed // BLOCK_SIZE:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else salt_root(seq.params.cache_salt)
            h = block_hash(parent, seq.token_slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE))
            self.allocator.register(seq.block_ids[i], h)
            seq.block_hashes.append(h)

    def _ensure_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's blocks (and DeepSeek-V4 state blocks) to hold num_tokens, preempting newer
        sequences if needed. Returns False if seq itself had to be preempted."""
        need = max(0, blocks_needed(num_tokens) - len(seq.block_ids))
        new_tokens = num_tokens - seq.num_computed
        while not self.allocator.can_allocate(need) or self._state_room(seq) < new_tokens:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        seq.block_ids += self.allocator.allocate(need)
        self._hold_state(seq, num_tokens)
        return True

    def grow_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Give seq the blocks (DeepSeek-V4: and state blocks) to hold num_tokens now, from free
        ones only (no one is preempted): the MTP module's chained passes write its rows at drafted
        positions before the next step schedules them. False where too few are free."""
        need = max(0, blocks_needed(num_tokens) - len(seq.block_ids))
        states = 0 if self.state_start is None else max(0, blocks_needed(num_tokens) - seq.state_blocks.stop)
        if not need and not states:
            return True
        if not self.allocator.can_allocate(need) or states > self.allocator.num_free_states:
            return False
        seq.block_ids += self.allocator.allocate(need)
        self._hold_state(seq, num_tokens)
        return True

    # ---- DeepSeek-V4 state blocks -------------------------------------------------------
    def _state_room(self, seq: Sequence) -> int:
        """How many tokens past num_computed the free state blocks let seq compute now (without
        state blocks: all of its tokens)."""
        if self.state_start is None:
            return seq.num_tokens
        held_to = (seq.state_blocks.stop + self.allocator.num_free_states) * BLOCK_SIZE
        return held_to - seq.num_computed

    def _hold_state(self, seq: Sequence, num_tokens: int) -> None:
        """Hold the state blocks of seq's blocks up to the one of token num_tokens - 1."""
        if self.state_start is None:
            return
        lo, hi = seq.state_blocks.start, seq.state_blocks.stop
        end = max(hi, blocks_needed(num_tokens))
        self.allocator.hold_state(seq.block_ids[hi:end])
        seq.state_blocks = range(lo, end)

    def _release_state(self, seq: Sequence) -> None:
        """Let go of the state blocks of seq's blocks that no later step reads."""
        lo, hi = seq.state_blocks.start, seq.state_blocks.stop
        first = min(self.state_start(seq.num_computed) // BLOCK_SIZE, hi)
        self.allocator.release_state(seq.block_ids[lo:first])
        seq.state_blocks = range(max(lo, first), hi)

    def _usable(self, hit: list[int]) -> list[int]:
        """The longest head of a prefix hit whose lookback blocks all still have state blocks
        (DeepSeek-V4; all of it otherwise); the references to the rest are dropped."""
        keep = len(hit)
        if self.state_start is not None:
            state = self.allocator.state
            while keep and any(state(b) < 0 for b in hit[self._first_state_block(keep) : keep]):
                keep -= 1
            self.allocator.free(hit[keep:][::-1])
        return hit[:keep]

    def _first_state_block(self, num_blocks: int) -> int:
        """The first block whose state a sequence with num_blocks full blocks computed reads."""
        return self.state_start(num_blocks * BLOCK_SIZE) // BLOCK_SIZE

    def _preempt(self, seq: Sequence) -> None:
        seq.draft, seq.draft_probs = [], None  # (drafted again after its recompute)
        self.running.remove(seq)
        self._free(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- after the model ran ------------------------------------------------------------
    def update(self, chunks: list[Chunk], tokens: list, logprobs: list) -> list[Sequence]:
        """Advance the scheduled sequences; `tokens`/`logprobs` hold one entry per chunk that
        wanted logits, in chunk order: a token and its logprobs, or (speculative decoding) lists of
        the tokens a step emits for it, its accepted drafts first. Tokens after a stop are dropped.
        Returns the sequences that got new tokens."""
        sampled = iter(zip(tokens, logprobs, strict=True))
        out = []
        for c in chunks:
            seq = c.seq
            wanted = c.wants_logits
            if seq.status is not SeqStatus.RUNNING:  # aborted while the step ran
                if wanted:
                    next(sampled)
                continue
            seq.draft, seq.draft_probs = [], None  # (checked by this step, or dropped)
            new, lps = next(sampled) if wanted else ([], [])
            new, lps = (new, lps) if isinstance(new, list) else ([new], [lps])
            reason, kept = None, 0
            for token, lp in zip(new, lps, strict=True):
                seq.output_ids.append(token)
                seq.output_logprobs.append(lp)
                kept += 1
                reason = self._stop_reason(seq, token)
                if reason:
                    break
            # the rows computed: the chunk's own tokens, and a verify chunk's accepted drafts (the
            # tokens it emits before its last one) as far as they were kept
            accepted = min(len(new) - 1, kept) if c.draft else 0
            seq.num_computed += c.num_tokens - len(c.draft) + accepted
            if self.allocator.caching:
                self._register_full_blocks(seq)
            if new:
                out.append(seq)
            if reason:
                self.finish(seq, reason)
        return out

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.cfg.max_model_len:
            return "length"
        return None

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free
