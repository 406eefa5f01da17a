"""The layout of one step's tokens: `StepBatch` (prefill chunks and decodes flattened) and its
`DecodeRows` (the decode sequences, gathered once per step for every layer)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .kv_cache import BLOCK_SIZE


@dataclass
class DecodeRows:
    rows: torch.Tensor  # [Bd] rows of the flattened tokens that are decodes
    seqs: torch.Tensor  # [Bd] int64 their sequences' index in the batch
    table: torch.Tensor  # [Bd, max_blocks] int64 block table of those sequences
    lens: torch.Tensor  # [Bd] int64 context length of each sequence (this step's token included)
    scratch: dict = field(default_factory=dict, repr=False)  # per-step state a kernel shares across layers

    @cached_property
    def pad(self) -> torch.Tensor:
        """[Bd, 1, max_blocks*64] bool: cache positions past each sequence's length (for the
        torch path, which gathers the padded context)."""
        lmax = self.table.shape[1] * BLOCK_SIZE
        return (torch.arange(lmax, device=self.lens.device)[None, :] >= self.lens[:, None])[:, None, :]


@dataclass
class StepBatch:
    """Tokens of one step, flattened over sequences (prefill chunks and decodes mixed).

    input_ids [T] int64, positions [T] int64, slot_mapping [T] int64 (flat cache row
    block*64+offset each token's latent is written to), query_lens [B] (python ints, tokens of
    each sequence in this step), seq_lens [B] int32 (context length after this step),
    block_table [B, max_blocks] int32, logits_index [B'] int64 (rows of T to compute logits for).
    DeepSeek-V4: state_table [B, max_blocks] int32, the state block attached to each block (-1:
    none; kv_cache.V4Cache). Speculative decoding: the rows of sequences with at most
    `decode_upto` tokens in the step (a verify chunk: its token and drafts) are decode rows, each
    attending causally in the absorbed form; `keep_hidden` asks the model for every row's
    final-normed state, left in `hidden` [T, H] (the MTP module's input).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens: list[int]
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    logits_index: torch.Tensor
    state_table: torch.Tensor | None = None
    decode_upto: int = 1
    keep_hidden: bool = False
    hidden: torch.Tensor | None = field(default=None, repr=False)

    @cached_property
    def state_slot_mapping(self) -> torch.Tensor:
        """[T] int64: the flat state row (state block * 64 + offset) of each token (V4)."""
        lens = torch.tensor(self.query_lens, device=self.positions.device)
        seq = torch.repeat_interleave(torch.arange(len(self.query_lens), device=lens.device), lens)
        p = self.positions
        return self.state_table[seq, p // BLOCK_SIZE].long() * BLOCK_SIZE + p % BLOCK_SIZE

    @cached_property
    def query_starts(self) -> list[int]:
        """First row of each sequence in the flattened tokens: [B + 1]."""
        return [0, *itertools.accumulate(self.query_lens)]

    @cached_property
    def context_lens(self) -> list[int]:
        return self.seq_lens.tolist()

    @cached_property
    def decode(self) -> DecodeRows | None:
        """The decode sequences (one new token each), gathered once per step for every layer; with
        `decode_upto` > 1 every row of a sequence with at most that many tokens, each row its own
        decode row over its causal context."""
        if self.decode_upto > 1:
            return self._short_chunks()
        seqs = [b for b, n in enumerate(self.query_lens) if n == 1]
        if not seqs:
            return None
        device = self.input_ids.device
        sel = torch.tensor(seqs, device=device)
        rows = torch.tensor([self.query_starts[b] for b in seqs], device=device)
        return DecodeRows(rows, sel, self.block_table[sel].long(), self.seq_lens[sel].long())

    def _short_chunks(self) -> DecodeRows | None:
        rows, seqs, lens = [], [], []
        for b, n in enumerate(self.query_lens):
            if n <= self.decode_upto:
                s0, L = self.query_starts[b], self.context_lens[b]
                rows += range(s0, s0 + n)
                seqs += [b] * n
                lens += range(L - n + 1, L + 1)
        if not rows:
            return None
        as_long = lambda v: torch.tensor(v, dtype=torch.long, device=self.input_ids.device)  # noqa: E731
        sel = as_long(seqs)
        return DecodeRows(as_long(rows), sel, self.block_table[sel].long(), as_long(lens))

    @staticmethod
    def build(
        chunks: list[tuple[list[int], int, list[int], bool] | tuple[list[int], int, list[int], bool, range]],
        device: torch.device | str = "cpu",
        block_states: torch.Tensor | None = None,
        decode_upto: int = 1,
        keep_hidden: bool = False,
    ) -> StepBatch:
        """chunks: per sequence (token_ids of this step, start position, cache block ids,
        wants_logits[, rows]): logits for its last token when wants_logits, and first for its
        `rows` (0-based in the chunk: prompt logprobs); block_states (V4) [num_blocks] int32: each
        block's state block (-1: none, `BlockAllocator.block_states`), for `state_table`."""
        ids, pos, slots, qlens, slens, logits_index = [], [], [], [], [], []
        max_blocks = max(len(c[2]) for c in chunks)
        table = torch.zeros(len(chunks), max(max_blocks, 1), dtype=torch.int32)
        t = 0
        for b, (tokens, start, blocks, want, *rows) in enumerate(chunks):
            n = len(tokens)
            logits_index.extend(t + r for r in (rows[0] if rows else ()))
            if start + n > len(blocks) * BLOCK_SIZE:
                raise ValueError(f"sequence {b}: {start + n} tokens do not fit {len(blocks)} blocks")
            ids.extend(tokens)
            positions = range(start, start + n)
            pos.extend(positions)
            slots.extend(blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions)
            qlens.append(n)
            slens.append(start + n)
            table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            t += n
            if want:
                logits_index.append(t - 1)
        as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        return StepBatch(
            input_ids=as_long(ids),
            positions=as_long(pos),
            slot_mapping=as_long(slots),
            query_lens=qlens,
            seq_lens=torch.tensor(slens, dtype=torch.int32, device=device),
            block_table=table.to(device),
            logits_index=as_long(logits_index),
            state_table=None if block_states is None else block_states[table.long()].to(device),
            decode_upto=decode_upto,
            keep_hidden=keep_hidden,
        )
