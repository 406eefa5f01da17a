"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (as vLLM and nano-vllm).

An eager decode step on a GPU is launch-bound: a few hundred small kernels per layer. A graph
captured once per bucket replays them all with one launch. Capture needs fixed addresses and no
device-to-host synchronisation, so a decode-only step of B sequences runs as the smallest bucket
>= B on static buffers:

- input_ids / positions / slot_mapping [maxB], seq_lens [maxB] int32, block_table [maxB,
  max_blocks] int32 (max_blocks covers max_model_len), valid [maxB] bool; each bucket's graph reads
  the first `bucket` rows of them;
- the padding rows decode token 0 at position 0 into a scratch cache block that the engine keeps
  out of the allocator, so they write nowhere a sequence reads; their routed choices are not
  counted in the step's expert load;
- the graph's outputs are static too: logits [bucket, vocab] and the expert load [moe layers, E].

With the engine's in-process experts the whole step is one graph (`DecodeGraphs`), with one
micro-batch. With remote experts (an attention worker of the cluster: every MoE layer waits on
gRPC) the step is captured in pieces between its expert messages (`SegmentedDecodeGraphs`, as
vLLM's piecewise graphs leave attention out): up to a layer's dispatch (its attention, norm and
router), the shared experts between dispatch and combine, and from the routed experts' output to
the next dispatch. Its `forward(batch)` replays them as a forward pass of its own, yielding the
same expert messages (the real rows only) to the same driver (`messages.run_interleaved`), so expert
load, ping-pong micro-batches (one instance each) and failures work as in an eager step.

Whatever does not capture (a torch op that synchronises: the routed experts' torch path without
Triton, DeepSeek-V4's per-sequence loops) is logged and the engine stays eager: after a first
eager pass (Triton compiles, libraries do their first-call set-up), each bucket's eager warm-up
runs with torch's sync check raising (`_syncs_raise`), so such a step fails before a capture
begins; a capture that fails still leaves the stream that was current. `capture=False`
runs the same static-buffer steps eagerly: how CPU tests check everything here but the capture
itself.
"""

from __future__ import annotations

import contextlib
import logging
from bisect import bisect_left

import torch

from services.model.batch import DecodeRows, StepBatch
from services.model.kv_cache import BLOCK_SIZE
from services.model.messages import ExpertCombine, ExpertDispatch, StepGen

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _syncs_raise():
    """Inside: a call that waits for the GPU (`.item()`, `nonzero`, a copy to the host, ...) raises,
    as torch's sync debug mode makes it; a capture would refuse it, less cleanly. (The mode is the
    process's: used while an engine is being built, before it serves.)"""
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


@contextlib.contextmanager
def capturing(device: torch.device):
    """Around capturing graphs on `device`: it is the current GPU (a capture records the current
    device's stream), and the stream that was current is current again after a failed capture
    (torch.cuda.graph leaves its side stream current when the capture's end raises)."""
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream()
        try:
            yield
        except BaseException:
            torch.cuda.set_stream(stream)
            raise


def buckets_up_to(max_batch: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every 8 up to 64, every 32 beyond (and max_batch)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += list(range(8, min(max_batch, 64) + 1, 8)) + list(range(96, max_batch + 1, 32))
    return sorted({*sizes, max_batch})


class StaticDecode:
    """The static input buffers of decode steps of up to `max_batch` sequences (module docstring)."""

    def __init__(
        self,
        model,
        cache: torch.Tensor,
        num_moe_layers: int,
        num_experts: int,
        scratch_block: int,
        max_batch: int,
        max_blocks: int,
        capture: bool = True,
    ):
        self.model, self.cache = model, cache
        self.num_moe_layers, self.num_experts = num_moe_layers, num_experts
        self.max_blocks, self.capture = max_blocks, capture
        self.buckets = buckets_up_to(max_batch)
        device = cache.device
        B = self.buckets[-1]
        self.input_ids = torch.zeros(B, dtype=torch.long, device=device)
        self.positions = torch.zeros(B, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((B,), scratch_block * BLOCK_SIZE, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(B, dtype=torch.int32, device=device)
        self.block_table = torch.full((B, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.valid = torch.zeros(B, dtype=torch.bool, device=device)
        self.rows = torch.arange(B, device=device)
        self.scratch_block = scratch_block

    def fits(self, batch: StepBatch) -> bool:
        """A decode-only step of at most max_batch sequences whose tables fit the static one."""
        return (
            len(batch.query_lens) <= self.buckets[-1]
            and batch.block_table.shape[1] <= self.max_blocks
            and all(n == 1 for n in batch.query_lens)
            and batch.logits_index.shape[0] == len(batch.query_lens)  # (a 1-token prefill chunk: no)
        )

    def _load_inputs(self, batch: StepBatch) -> tuple[int, int]:
        """Copy the step's rows into the static buffers; rows B..bucket-1 become padding.
        Returns (B, bucket)."""
        B, width = len(batch.query_lens), batch.block_table.shape[1]
        bucket = self.buckets[bisect_left(self.buckets, B)]
        self.input_ids[:B].copy_(batch.input_ids)
        self.positions[:B].copy_(batch.positions)
        self.slot_mapping[:B].copy_(batch.slot_mapping)
        self.seq_lens[:B].copy_(batch.seq_lens)
        self.block_table[:B, :width].copy_(batch.block_table)
        self.block_table[:B, width:].fill_(self.scratch_block)
        self.valid[:B] = True
        self._pad(B, bucket)
        return B, bucket

    def _pad(self, lo: int, hi: int) -> None:
        """Make static rows lo..hi-1 padding: token 0 at position 0, written to the scratch block."""
        self.input_ids[lo:hi].zero_()
        self.positions[lo:hi].zero_()
        self.slot_mapping[lo:hi].fill_(self.scratch_block * BLOCK_SIZE)
        self.seq_lens[lo:hi].fill_(1)
        self.block_table[lo:hi].fill_(self.scratch_block)
        self.valid[lo:hi] = False

    def _batch(self, bucket: int) -> StepBatch:
        """The StepBatch over the first `bucket` static rows, its decode rows prepared here (the
        lazy property would build them from Python lists: a host-to-device copy)."""
        seq_lens, table = self.seq_lens[:bucket], self.block_table[:bucket]
        batch = StepBatch(
            input_ids=self.input_ids[:bucket],
            positions=self.positions[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            query_lens=[1] * bucket,
            seq_lens=seq_lens,
            block_table=table,
            logits_index=self.rows[:bucket],
        )
        rows = self.rows[:bucket]  # (one row per sequence: rows and sequences coincide)
        batch.__dict__["decode"] = DecodeRows(rows, rows, table.long(), seq_lens.long())
        return batch

    def _capture_all(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool (as vLLM does): after a
        first eager pass (unchecked: Triton compiles, libraries do their first-call set-up), each
        bucket runs once eagerly with syncs raising, then is captured (`_run` / `_capture`)."""
        pool = None
        with capturing(self.cache.device):
            self._pad(0, self.buckets[-1])
            self._run(self.buckets[-1])
            for bucket in reversed(self.buckets):
                self._pad(0, bucket)
                with _syncs_raise():
                    self._run(bucket)  # nothing in it may wait for the GPU
                torch.cuda.synchronize()
                pool = self._capture(bucket, pool)
        log.info("captured decode CUDA graphs (%s) for batch sizes %s", type(self).__name__, self.buckets)


class DecodeGraphs(StaticDecode):
    """Whole decode steps of one model + in-process experts + cache, one graph per bucket (see the
    module docstring). `run(batch)` -> (logits [B, vocab] fp32, expert load [moe layers, E] int64)."""

    def __init__(self, model, experts, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        self.experts = experts
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        if self.capture:
            self._capture_all()

    def run(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        B, bucket = self._load_inputs(batch)
        if self.capture:
            graph, logits, load = self._graphs[bucket]
            graph.replay()
        else:
            logits, load = self._step(bucket)
        return logits[:B].clone(), load.clone()  # (the static outputs are overwritten next step)

    def _step(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward pass over the static rows: (logits [bucket, vocab], load [moe layers, E]),
        the load counting the valid rows' routed choices only (no bincount: it synchronises)."""
        E = self.num_experts
        load = torch.zeros(self.num_moe_layers, E + 1, dtype=torch.long, device=self.cache.device)
        valid = self.valid[:bucket, None]
        step = self.model.forward(self._batch(bucket), self.cache)
        msg = next(step)
        while True:
            if isinstance(msg, ExpertDispatch):
                counted = msg.topk_idx.masked_fill(~valid, E).reshape(-1)  # padding -> bin E
                load[msg.moe_layer].scatter_add_(0, counted, torch.ones_like(counted))
                reply = self.experts.dispatch(msg)
            else:
                assert isinstance(msg, ExpertCombine)
                reply = self.experts.combine(msg)
            try:
                msg = step.send(reply)
            except StopIteration as stop:
                return stop.value, load[:, :E]

    def _run(self, bucket: int) -> None:  # (for _capture_all)
        self._step(bucket)

    def _capture(self, bucket: int, pool):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits, load = self._step(bucket)
        self._graphs[bucket] = (graph, logits, load)
        return graph.pool()


_HANDLE = object()  # what a captured forward pass is given for a dispatch (it only passes it back)


def _advance(step: StepGen, reply) -> ExpertDispatch | ExpertCombine | torch.Tensor:
    """Run a forward pass to its next expert message, or to its end (its logits)."""
    try:
        return next(step) if reply is None else step.send(reply)
    except StopIteration as stop:
        return stop.value


class SegmentedDecodeGraphs(StaticDecode):
    """Decode steps of one model + cache whose experts are answered elsewhere (remote), captured
    in pieces between the expert messages, one list of pieces per bucket (see the module
    docstring). `forward(batch)` is a forward pass over them (messages.StepGen). One instance per
    micro-batch: a step's pieces run in order, while another instance's may run between them."""

    def __init__(self, model, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        B, device = self.buckets[-1], self.cache.device
        self.routed = torch.zeros(B, model.cfg.hidden_size, dtype=model.dtype, device=device)  # static reply
        self._pieces: dict[int, list[tuple[torch.cuda.CUDAGraph, object]]] = {}
        if self.capture:
            self._capture_all()

    def forward(self, batch: StepBatch) -> StepGen:
        """The decode step of `batch` (fits()): yields the expert messages of its real rows,
        returns fp32 logits [B, vocab]. Each piece is replayed with what the expert backend gave
        the last message (the routed output is copied into the static reply)."""
        B, bucket = self._load_inputs(batch)
        step = None if self.capture else self._pass(bucket)
        reply, i = None, 0
        while True:
            if self.capture:
                graph, out = self._pieces[bucket][i]
                graph.replay()
                i += 1
            else:  # the same pieces, run live
                out = _advance(step, reply)
            if isinstance(out, ExpertDispatch):
                handle = yield ExpertDispatch.routed(out.decoder_layer, out.moe_layer, out.x[:B], out.topk_idx[:B],
                                                     out.topk_weight[:B], self.num_experts)  # fmt: skip
                reply = _HANDLE
            elif isinstance(out, ExpertCombine):
                self.routed[:B].copy_((yield ExpertCombine(handle)))
                self.routed[B:bucket].zero_()
                reply = self.routed[:bucket]
            else:
                return out[:B].clone()  # (the static logits are overwritten next step)

    def _pass(self, bucket: int) -> StepGen:
        """model.forward over the first `bucket` static rows. Its batch (with the int64 copies of
        the static block table and lengths that attention reads) is built when the pass starts:
        inside the first piece, so that a capture records those copies (built before it, they would
        hold the capture's padding, and their memory be reused once the capture's pass ends)."""
        return (yield from self.model.forward(self._batch(bucket), self.cache))

    def _run(self, bucket: int) -> None:  # (for _capture_all)
        self._run_pieces(bucket)

    def _capture(self, bucket: int, pool):
        """(The pool is this instance's own: another micro-batch's pieces run between ours.)"""
        self._pieces[bucket], pool = self._run_pieces(bucket, pool, capture=True)
        return pool

    def _run_pieces(self, bucket: int, pool=None, capture: bool = False) -> tuple[list, object]:
        """One pass over the first `bucket` static rows, cut at its expert messages: ([(graph, the
        piece's output)], pool); each piece captured into a graph in `pool` when `capture`, else
        run (graph None)."""
        step, reply, pieces = self._pass(bucket), None, []
        while not pieces or isinstance(pieces[-1][1], ExpertDispatch | ExpertCombine):
            graph = torch.cuda.CUDAGraph() if capture else None
            with torch.cuda.graph(graph, pool=pool) if capture else contextlib.nullcontext():
                out = _advance(step, reply)
            if capture:
                pool = graph.pool()
            pieces.append((graph, out))
            reply = _HANDLE if isinstance(out, ExpertDispatch) else self.routed[:bucket]
        return pieces, pool
