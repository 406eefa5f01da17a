"""Attention tensor parallelism: one attention worker is a group of N rank processes on one node.

MLA has a single latent "KV head", so splitting the heads does not split the cache: every rank
holds the whole paged latent cache (a replica) and 1/N of the heads (its slices of q_b / q_proj,
kv_b and o_proj, `shard_heads`). Per layer each rank computes its heads' attention and its part
of o_proj; the parts are summed with one all-reduce. Everything else in the layer is
replicated: RMSNorm, the dense MLPs, the gate and the shared experts are computed by every rank
on the same hidden states (on the CPU boxes this runs on they cost less than a second collective
per layer would: splitting them needs another all-reduce of [T, H] per layer). The LM head and
sampling run on rank 0 only.

Rank 0 is the attention worker proper: it schedules, and per step broadcasts the micro-batches'
layout (token ids, positions, cache slots, block tables; `broadcast_step`), then every rank runs
the same forward. Exactly one rank (0) dispatches to the expert workers; at each MoE layer it
broadcasts the routed result ([T, H], after a flag saying whether the experts answered) and the
other ranks continue with it (`LeaderExperts` / `FollowerExperts`). A step whose experts failed
is abandoned on every rank in step, and rank 0 retries it like any failed step. With speculative
decoding rank 0 also broadcasts each MTP pass (its batch and the rows of the hidden states it reads:
`broadcast_mtp_pass`), which every rank runs after the step, its heads split like the main layers'.

torch.distributed with gloo (CPU) or NCCL (CUDA): the collectives run in the same order on every
rank because every rank runs the same forward over the same micro-batches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from services.engine.engine import EngineConfig, load_engine
from services.model.batch import StepBatch
from services.model.messages import ExpertCombine, ExpertDispatch, run_interleaved

log = logging.getLogger(__name__)

# what a broadcast carries (its first value): a step's micro-batches, an MTP pass (speculative
# decoding: the first after a step, a chained one, or the module's cache rows only), or the end
_STEP, _MTP_PASS, _MTP_CHAINED, _MTP_ROWS, _STOP = 0, 1, 2, 3, -1


class StepAborted(RuntimeError):
    """Rank 0 abandoned the step (its routed experts failed); followers drop it too."""


class TPGroup:
    """One attention worker's ranks (a torch.distributed world of `world_size` processes)."""

    def __init__(self, rank: int, world_size: int, init_method: str, device: str = "cpu"):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        # idle followers wait in a broadcast for as long as no request comes: no timeout to speak of
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(days=365))  # fmt: skip
        self.comm_device = self.device  # gloo takes CPU tensors, NCCL CUDA ones

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        dist.all_reduce(t)
        return t

    # ---- the step layout ----------------------------------------------------------------
    def broadcast_step(self, batches: list[StepBatch]) -> None:
        """(rank 0) Send the micro-batches every rank runs this step."""
        self._send(torch.cat((torch.tensor([_STEP]), pack_batches(batches))))

    def broadcast_mtp_pass(
        self, batch: StepBatch, rows: torch.Tensor, chained: bool, cache_only: bool
    ) -> None:
        """(rank 0) Send an MTP pass every rank runs (speculative decoding): its batch, and the rows
        [n] of its input states: of the last step's micro-batches' `hidden`, concatenated (the
        first pass), or of the last pass's (`chained`). `cache_only`: a first pass that writes the
        module's cache rows only (`mtp_cache_rows`)."""
        kind = _MTP_CHAINED if chained else _MTP_ROWS if cache_only else _MTP_PASS
        head = torch.tensor([kind, rows.numel()])
        self._send(torch.cat((head, rows.to("cpu", torch.long), pack_batches([batch]))))

    def stop(self) -> None:
        """(rank 0) Tell the followers to leave their loop."""
        self._send(torch.tensor([_STOP], dtype=torch.long))

    def _send(self, packed: torch.Tensor) -> None:
        dist.broadcast(torch.tensor([packed.numel()], dtype=torch.long, device=self.comm_device), src=0)
        dist.broadcast(packed.to(self.comm_device), src=0)

    def recv_step(self) -> tuple[int, list[StepBatch], torch.Tensor | None] | None:
        """(followers) What rank 0 runs next: (_STEP, its micro-batches, None) or (_MTP_PASS /
        _MTP_CHAINED / _MTP_ROWS, [its batch], its input rows); None when rank 0 stops the group."""
        size = torch.empty(1, dtype=torch.long, device=self.comm_device)
        dist.broadcast(size, src=0)
        packed = torch.empty(int(size), dtype=torch.long, device=self.comm_device)
        dist.broadcast(packed, src=0)
        packed = packed.cpu()
        kind = int(packed[0])
        if kind == _STOP:
            return None
        if kind == _STEP:
            return kind, unpack_batches(packed[1:], self.device), None
        n = int(packed[1])
        return kind, unpack_batches(packed[2 + n :], self.device), packed[2 : 2 + n].to(self.device)

    # ---- the routed experts' result -----------------------------------------------------
    def send_routed(self, routed: torch.Tensor | None) -> None:
        """(rank 0) The routed experts' output [T, H] of a MoE layer, or None when they failed."""
        dist.broadcast(torch.tensor([routed is not None], dtype=torch.long, device=self.comm_device), src=0)
        if routed is not None:
            dist.broadcast(routed.contiguous().to(self.comm_device), src=0)

    def recv_routed(self, like: torch.Tensor) -> torch.Tensor:
        """(followers) The routed output for hidden states like `like` [T, H]."""
        ok = torch.empty(1, dtype=torch.long, device=self.comm_device)
        dist.broadcast(ok, src=0)
        if not int(ok):
            raise StepAborted("rank 0's routed experts failed")
        out = torch.empty(like.shape, dtype=like.dtype, device=self.comm_device)
        dist.broadcast(out, src=0)
        return out.to(like.device)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class LeaderExperts:
    """Rank 0's expert backend: the real one (`inner`), each routed result broadcast to the
    followers (a failed one announced, so that they drop the step with rank 0)."""

    def __init__(self, inner, group: TPGroup):
        self.inner, self.group = inner, group

    def dispatch(self, msg: ExpertDispatch):
        return self.inner.dispatch(msg)

    def combine(self, msg: ExpertCombine) -> torch.Tensor:
        try:
            routed = self.inner.combine(msg)
        except BaseException:
            self.group.send_routed(None)
            raise
        self.group.send_routed(routed)
        return routed

    def cancel(self, handle) -> None:
        cancel = getattr(self.inner, "cancel", None)
        if cancel is not None:
            cancel(handle)


class FollowerExperts:
    """A follower's expert backend: routed results come from rank 0."""

    def __init__(self, group: TPGroup):
        self.group = group

    def dispatch(self, msg: ExpertDispatch) -> torch.Tensor:
        return msg.x

    def combine(self, msg: ExpertCombine) -> torch.Tensor:
        return self.group.recv_routed(msg.handle)


# ---- the step layout on the wire -----------------------------------------------------------
_FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "block_table", "logits_index")


def pack_batches(batches: list[StepBatch]) -> torch.Tensor:
    """Micro-batches -> one int64 tensor: [n, then per batch T, B, max_blocks, n_logits, has a
    state table (V4), decode_upto, keep_hidden, query_lens (B), then its tensors flattened in
    _FIELDS order, then the state table if it has one]."""
    parts = [torch.tensor([len(batches)])]
    for b in batches:
        B, max_blocks = b.block_table.shape
        states = [] if b.state_table is None else [b.state_table]
        head = [b.input_ids.numel(), B, max_blocks, b.logits_index.numel(), len(states), b.decode_upto,
                int(b.keep_hidden), *b.query_lens]  # fmt: skip
        parts.append(torch.tensor(head))
        parts += [t.reshape(-1).to("cpu", torch.long) for t in [getattr(b, f) for f in _FIELDS] + states]
    return torch.cat(parts)


def unpack_batches(packed: torch.Tensor, device: torch.device) -> list[StepBatch]:
    """The inverse of `pack_batches`, tensors on `device`."""
    values = packed.tolist()
    n, pos, batches = values[0], 1, []
    for _ in range(n):
        T, B, max_blocks, n_logits, has_states, decode_upto, keep_hidden = values[pos : pos + 7]
        query_lens = values[pos + 7 : pos + 7 + B]
        pos += 7 + B
        sizes = (T, T, T, B, B * max_blocks, n_logits) + (B * max_blocks,) * has_states
        tensors = []
        for size in sizes:
            tensors.append(packed[pos : pos + size])
            pos += size
        ids, positions, slots, seq_lens, table, logits_index, *states = tensors
        batches.append(
            StepBatch(
                input_ids=ids.to(device),
                positions=positions.to(device),
                slot_mapping=slots.to(device),
                query_lens=query_lens,
                seq_lens=seq_lens.to(device, torch.int32),
                block_table=table.view(B, max_blocks).to(device, torch.int32),
                logits_index=logits_index.to(device),
                state_table=states[0].view(B, max_blocks).to(device, torch.int32) if states else None,
                decode_upto=decode_upto,
                keep_hidden=bool(keep_hidden),
            )
        )
    return batches


class Follower:
    """A follower rank: the attention side with its slice of the heads, its own replica of the
    latent cache, and its place in the group (joins when built; every rank must be starting)."""

    def __init__(self, engine_cfg: EngineConfig, rank: int, tp: int, init_method: str):
        cfg, model, _, _ = load_engine(engine_cfg, lambda *_: None)
        self.cache = engine_cfg.latent_cache(cfg, model)
        self.group = TPGroup(rank, tp, init_method, engine_cfg.device)
        model.shard_attention(rank, tp, self.group.all_reduce)
        self.model, self.rank = model, rank

    def run(self) -> int:
        """Run every step (and MTP pass) rank 0 broadcasts until it stops the group; the number of
        steps run. An MTP pass reads rows of the last step's hidden states (or of the last pass's),
        which this rank computed alike."""
        experts, steps, hidden, mtp_hidden = FollowerExperts(self.group), 0, None, None
        while (message := self.group.recv_step()) is not None:
            kind, batches, rows = message
            try:
                if kind == _STEP:
                    hidden = None
                    for b in batches:  # only rank 0 samples: no LM head here
                        b.logits_index = b.logits_index[:0]
                    run_interleaved([self.model.forward(b, self.cache.kv) for b in batches], experts)
                    steps += 1
                    if batches[0].keep_hidden:
                        hidden = torch.cat([b.hidden for b in batches])
                elif kind == _MTP_ROWS:
                    self.model.mtp_cache_rows(self.model.mtp[0], batches[0], hidden[rows], self.cache.kv)
                else:  # (its logits rows kept: they are the rows a chained pass reads)
                    (batch,) = batches
                    source = mtp_hidden if kind == _MTP_CHAINED else hidden
                    mtp_hidden = None
                    step = self.model.mtp_forward(self.model.mtp[0], batch, source[rows], self.cache.kv)
                    run_interleaved([step], experts)
                    mtp_hidden = batch.hidden
            except StepAborted:
                continue
        return steps


def lead(group: TPGroup, model, experts) -> tuple[LeaderExperts, Callable[[list[StepBatch]], None], Callable]:
    """Make `model` rank 0 of `group`: its slice of the heads, the expert backend that shares the
    routed results, and the Engine's `on_batches` and `on_mtp_pass` hooks that broadcast each step
    and each MTP pass."""
    model.shard_attention(0, group.world_size, group.all_reduce)
    return LeaderExperts(experts, group), group.broadcast_step, group.broadcast_mtp_pass


def run_follower(engine_cfg: EngineConfig, rank: int, tp: int, init_method: str) -> int:
    """A follower process's whole life (tests and benchmarks start it without Ray)."""
    follower = Follower(engine_cfg, rank, tp, init_method)
    try:
        return follower.run()
    finally:
        follower.group.close()
