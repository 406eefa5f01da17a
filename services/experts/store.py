"""The slot store of one expert worker: its routed-expert weights per placement version.

A version maps every MoE layer to the logical expert held by each of this worker's S local slots.
The weights are rows shared by every version (services/experts/rows.py: per layer w13 [P, 2I, H],
w2 [P, H, I]; a version's `PackedExperts` maps its slots to rows). Several versions can be loaded
at once: during a re-placement the new one loads while the old one keeps serving, and the old one
is released after the switch. Where a new version's experts come from, in order:

1. rows this worker already holds (no copy: the new version maps its slots to them);
2. the checkpoint on this node (mmap'd safetensors, only the experts needed), when its files
   are here;
3. a peer: the `fetch` callable given to `load` (the gRPC shell passes one that calls
   FetchExperts on other expert workers), for experts the checkpoint here cannot give (no
   safetensors files on this node, or a tensor missing from them).

`expert_weights` is the other side of 3: the rows of experts this worker holds.

Only the experts a version lacks are staged and written, one layer at a time, into rows no loaded
version reads (rows are appended only when there are not enough of those: `spare_rows` reserves
some at the first load); a released version's rows are written again only once its in-flight
calls have finished. So a re-plan's memory beyond the steady state is its moved experts (plus,
where a layer must grow, one layer while it is copied), not a second copy of the worker
(`LoadReport.peak_extra_bytes`).

Pure: no gRPC, no Ray. `load` may run in one thread while `forward` runs in another.
Errors are typed so the gRPC shell can map them to status codes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.model.checkpoint import check_keep_fp8_experts
from services.model.config import ModelConfig
from services.model.fp8 import dequantize_fp8_blocks
from services.model.kernels.select import select_kernels
from services.model.moe import PackedExperts
from services.model.mtp import mtp_moe_layers

from .rows import LayerRows, plan_rows, row_map
from .sources import Checkpoint, ExpertRows, check_expert_weights

log = logging.getLogger(__name__)


class SlotStoreError(Exception):
    """Base of the store's request errors (the worker keeps serving after any of them)."""


class InvalidRequest(SlotStoreError, ValueError):
    """Malformed request: unknown layer, wrong shape/dtype, slot out of range, bad weights."""


class VersionUnavailable(SlotStoreError):
    """The placement version is not loaded (never loaded, still loading, or released)."""


class VersionConflict(SlotStoreError):
    """LoadSlots for a version that is loading, or loaded with different slots."""


class TooManyVersions(SlotStoreError):
    """Loading one more version would exceed `max_versions`; release one first."""


class ExpertNotFound(SlotStoreError, LookupError):
    """Expert weights with no source: not held by this worker (FetchExperts), or, when loading,
    neither held, nor in this node's checkpoint, nor given by a peer."""


# fetch(layer, experts) -> {logical expert: ExpertRows} for `experts` of one MoE layer (any float
# dtype, or FP8 with scales; converted to how the store holds experts). May raise ExpertNotFound
# with the reason.
FetchExperts = Callable[[int, list[int]], Mapping[int, ExpertRows]]


@dataclass
class LoadReport:
    version: int
    bytes_read: int = 0  # expert bytes read from the checkpoint
    bytes_reused: int = 0  # expert bytes taken from versions already loaded
    bytes_from_peers: int = 0  # expert bytes received from `fetch` (as received, before any cast)
    seconds: float = 0.0
    bytes_written: int = 0  # expert bytes written into rows (the experts the version lacked)
    rows_added: int = 0  # rows appended over all layers (no free row was left for them)
    peak_extra_bytes: int = 0  # the most bytes held during the load beyond the rows before it


@dataclass(eq=False)  # (compared by identity: its fields hold tensors)
class SlotVersion:
    """One loaded placement version: packed experts + per-slot token counters."""

    version: int
    packed: PackedExperts
    tokens: torch.Tensor  # [num_moe_layers, S] int64 (token, choice) pairs computed per local slot
    inflight: int = 0  # forward calls running on it (its rows stay untouched until they end)

    @property
    def num_slots(self) -> int:
        return self.tokens.shape[1]


@dataclass
class StoreStats:
    current_version: int  # newest loaded version, 0 when none
    loaded_versions: list[int]
    loading_versions: list[int]
    # version -> layer -> (logical expert per local slot, tokens per local slot)
    slots: dict[int, dict[int, tuple[list[int], list[int]]]] = field(default_factory=dict)
    dispatch_calls: int = 0
    weight_bytes: int = 0
    kernels: dict[str, str] = field(default_factory=dict)  # family -> the kernel running it
    kernel_reasons: dict[str, dict[str, str]] = field(default_factory=dict)  # family -> {not taken: why}


class SlotStore:
    def __init__(
        self,
        cfg: ModelConfig,
        model_dir: str | Path,
        dtype: torch.dtype,
        max_versions: int = 3,
        device: str | torch.device = "cpu",
        weight_dtype: torch.dtype | None = None,
        keep_fp8: bool = False,
        spare_rows: int = 0,
        deterministic: bool = False,
    ):
        """dtype: what Dispatch computes in; weight_dtype: how the experts are held when narrower
        (bf16 under fp32 on CPU: config.check_weight_dtype); None: dtype. keep_fp8: an FP8
        checkpoint's experts are held as shipped, with their block scales (ValueError where they
        cannot be: checkpoint.check_keep_fp8_experts). spare_rows: rows per layer allocated beyond
        the first version's, for later re-plans' moved experts (none: a layer that needs more rows
        grows, copied once). deterministic: batch-invariant expert kernels (kernels/deterministic.py:
        each (token, expert) pair's output has the same bits however many rows share the call)."""
        self.cfg, self.model_dir, self.dtype, self.max_versions = cfg, Path(model_dir), dtype, max_versions
        self.weight_dtype = weight_dtype or dtype
        if keep_fp8:
            check_keep_fp8_experts(cfg)
        self.fp8_block = cfg.fp8_block_size if keep_fp8 else None  # (bn, bk) when experts are held in FP8
        self.device = torch.device(device)  # where the packed experts live and compute
        # the MoE layers a version may name: the main model's, then (the cluster speculating) the MTP
        # modules' (model/mtp.py); LoadSlots names the main ones alone or all of them
        self.main_layers, self.mtp_layers = cfg.moe_layers, mtp_moe_layers(cfg)
        self.moe_index = {layer: n for n, layer in enumerate(self.main_layers + self.mtp_layers)}
        self.spare_rows = spare_rows
        self._versions: dict[int, SlotVersion] = {}
        self._draining: list[SlotVersion] = []  # released, with calls still running on them
        self._layers: dict[int, LayerRows] = {}  # decoder layer -> its rows, shared by all versions
        self._loading: set[int] = set()
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()  # one load at a time: it alone claims and writes rows
        self.dispatch_calls = 0
        # the expert kernels, chosen once (building the C++ CPU kernels now, not mid-request)
        self.kernels = select_kernels(self.device, dtype, cfg, weight_dtype=weight_dtype, fp8_experts=keep_fp8,
                                      scope="experts", deterministic=deterministic)  # fmt: skip
        self._dispatch = self.kernels.expert_dispatch  # (None: checked here, then the expert kernel)
        log.info("expert store %s", self.kernels.summary())

    # ---- versions -----------------------------------------------------------------------
    @property
    def loaded_versions(self) -> list[int]:
        return sorted(self._versions)

    @property
    def current_version(self) -> int:
        return max(self._versions, default=0)

    def load(
        self,
        version: int,
        experts_per_layer: Mapping[int, Sequence[int]],
        fetch: FetchExperts | None = None,
    ) -> LoadReport:
        """Load `version`: per MoE layer, the logical expert of each local slot, in slot order.

        Slow (reads weights); run it off the serving thread. Versions already loaded keep
        serving meanwhile. An identical repeat of a loaded version is a no-op. Experts that are
        neither held nor in this node's checkpoint come from `fetch` (peer copy); without one,
        or when it cannot give them, ExpertNotFound (nothing is loaded).
        """
        start = time.perf_counter()
        layout = self._check_layout(version, experts_per_layer)
        with self._lock:
            held = self._versions.get(version)
            if held is not None:
                if held.packed.logical == layout:
                    return LoadReport(version)
                raise VersionConflict(f"version {version} is already loaded with different slots")
            if version in self._loading:
                raise VersionConflict(f"version {version} is already loading")
            if len(self._versions) + len(self._loading) >= self.max_versions:
                raise TooManyVersions(
                    f"{len(self._versions)} versions loaded and {len(self._loading)} loading "
                    f"(max {self.max_versions}); release one first"
                )
            self._loading.add(version)
        num_slots = len(next(iter(layout.values())))
        try:
            with self._load_lock:  # (registered before the next load plans: its rows are in use)
                packed, report = self._place(layout, fetch)
                with self._lock:
                    self._versions[version] = SlotVersion(
                        version, packed, torch.zeros(len(self.moe_index), num_slots, dtype=torch.long)
                    )
        finally:
            with self._lock:
                self._loading.discard(version)
        report.version, report.seconds = version, time.perf_counter() - start
        return report

    def release(self, version: int) -> list[int]:
        """Drop `version` (idempotent); returns the versions still loaded. In-flight calls on
        it finish correctly: its rows are not written again until they have ended."""
        with self._lock:
            held = self._versions.pop(version, None)
            if held is not None and held.inflight:
                self._draining.append(held)
            return sorted(self._versions)

    def _check_layout(
        self, version: int, experts_per_layer: Mapping[int, Sequence[int]]
    ) -> dict[int, list[int]]:
        if version <= 0:
            raise InvalidRequest(f"version must be > 0, got {version}")
        layers = sorted(experts_per_layer)
        if layers not in (self.main_layers, self.main_layers + self.mtp_layers):
            mtp = f" (and the MTP modules' {self.mtp_layers})" if self.mtp_layers else ""
            raise InvalidRequest(
                f"LoadSlots must name every MoE layer {self.main_layers}{mtp} once, got {layers}"
            )
        layout = {layer: [int(e) for e in experts_per_layer[layer]] for layer in layers}
        sizes = {len(experts) for experts in layout.values()}
        if len(sizes) != 1 or 0 in sizes:
            raise InvalidRequest(
                f"every MoE layer needs the same number (>= 1) of slots, got {sorted(sizes)}"
            )
        num_experts = self.cfg.n_routed_experts
        for layer, experts in layout.items():
            bad = [e for e in experts if not 0 <= e < num_experts]
            if bad:
                raise InvalidRequest(f"layer {layer}: logical expert {bad[0]} outside [0, {num_experts})")
        return layout

    def _place(
        self, layout: dict[int, list[int]], fetch: FetchExperts | None
    ) -> tuple[PackedExperts, LoadReport]:
        """The new version's slots mapped to rows, layer by layer (rows.plan_rows): experts held in
        some row are used where they are; the others are read (checkpoint, then `fetch`) for one
        layer at a time and written into rows no version reads, appended where none is left."""
        packed = PackedExperts(swiglu_limit=self.cfg.swiglu_limit, fp8_block=self.fp8_block,
                               ffn=self.kernels.expert_ffn)  # fmt: skip
        report = LoadReport(0)
        checkpoint = Checkpoint(self.model_dir, self.cfg, self.weight_dtype, self.fp8_block is not None)
        before = self.weight_bytes()
        try:
            for layer, experts in layout.items():
                with self._lock:
                    rows = self._layers.get(layer)
                    in_use = self._rows_in_use(layer)
                held = rows.expert if rows is not None else []
                slot_rows, writes, appended = plan_rows(held, in_use, experts)
                staged = self._read(layer, sorted(writes), checkpoint, fetch, report)  # {expert: ExpertRows}
                staged_bytes = sum(r.nbytes() for r in staged.values())
                copied = 0  # (a layer that grows: its old rows stay alive while they are copied)
                if appended or rows is None:
                    copied = 0 if rows is None else rows.nbytes()
                    rows = self._grow(
                        layer, rows, appended + (self.spare_rows if rows is None else 0), staged
                    )
                    report.rows_added += appended
                report.peak_extra_bytes = max(report.peak_extra_bytes,
                                              self.weight_bytes() - before + copied + staged_bytes)  # fmt: skip
                for e, r in writes.items():
                    rows.expert[r] = -1  # (being written: not a hit for a later load if this one fails)
                    for dst, src in zip(rows.tensors, staged[e], strict=False):
                        dst[r].copy_(src)
                    rows.expert[r] = e
                    report.bytes_written += staged[e].nbytes()
                per_expert = rows.nbytes() // rows.num_rows
                report.bytes_reused += per_expert * len(set(experts) - writes.keys())
                for d, t in zip(packed.tensor_dicts(), rows.tensors, strict=False):
                    d[layer] = t
                mapped = row_map(slot_rows, rows.num_rows)
                if mapped is not None:
                    packed.rows[layer] = mapped.to(self.device)
                packed.logical[layer] = list(experts)
        finally:
            checkpoint.close()
        return packed, report

    def _rows_in_use(self, layer: int) -> set[int]:
        """(under the lock) The rows of `layer` that loaded and draining versions read."""
        used: set[int] = set()
        for held in (*self._versions.values(), *self._draining):
            if layer in held.packed.w13:
                row_map = held.packed.rows.get(layer)
                used.update(range(held.num_slots) if row_map is None else row_map.tolist())
        return used

    def _read(self, layer: int, experts: list[int], checkpoint: Checkpoint, fetch: FetchExperts | None,
              report: LoadReport) -> dict[int, ExpertRows]:  # fmt: skip
        """`experts` of `layer` as this store holds them, from the checkpoint here, else `fetch`."""
        if not experts:
            return {}
        got = {e: rows.to(self.device) for e, rows in checkpoint.read(layer, experts).items()}
        report.bytes_read = checkpoint.bytes_read
        missing = [e for e in experts if e not in got]
        if missing:
            fetched = self._fetch(layer, missing, fetch, checkpoint.unavailable)
            report.bytes_from_peers += sum(fetched[e].nbytes() for e in missing)
            got.update({e: self._as_held(fetched[e]) for e in missing})
        return got

    def _grow(
        self, layer: int, rows: LayerRows | None, extra: int, staged: dict[int, ExpertRows]
    ) -> LayerRows:
        """`layer`'s rows with `extra` more (a copy of the old ones, made while they serve; every
        version switched to the new tensors under the lock)."""
        shapes = (
            [t[0] for t in rows.tensors]
            if rows is not None
            else [t for t in next(iter(staged.values())) if t is not None]
        )
        old = 0 if rows is None else rows.num_rows
        tensors = [torch.empty(old + extra, *t.shape, dtype=t.dtype, device=self.device) for t in shapes]
        if rows is not None:
            for new, t in zip(tensors, rows.tensors, strict=True):
                new[:old].copy_(t)
        grown = LayerRows(tensors, (rows.expert if rows is not None else []) + [-1] * extra)
        with self._lock:
            self._layers[layer] = grown
            for held in (*self._versions.values(), *self._draining):
                if layer in held.packed.w13 and layer not in held.packed.rows:  # (slot s was row s of
                    # exactly S rows: the map says so now, before the tensors have more rows)
                    held.packed.rows[layer] = torch.arange(held.num_slots, device=self.device)
                for d, t in zip(held.packed.tensor_dicts(), tensors, strict=False):
                    if layer in d:
                        d[layer] = t
        return grown

    def weight_bytes(self) -> int:
        """Bytes of the expert rows held (every version's: they share them)."""
        with self._lock:
            return sum(rows.nbytes() for rows in self._layers.values())

    def _as_held(self, rows: ExpertRows) -> ExpertRows:
        """A peer's expert as this store holds experts: FP8 kept as sent, or (FP8 from a worker
        that keeps it, for one that does not) dequantized, then in weight_dtype on the device."""
        if self.fp8_block is not None:
            return rows.to(self.device)
        if rows.fp8:
            block = self.cfg.fp8_block_size
            rows = ExpertRows(dequantize_fp8_blocks(rows.w13, rows.w13_scale, block),
                              dequantize_fp8_blocks(rows.w2, rows.w2_scale, block))  # fmt: skip
        return ExpertRows(
            rows.w13.to(self.device, self.weight_dtype), rows.w2.to(self.device, self.weight_dtype)
        )

    def _fetch(
        self, layer: int, missing: list[int], fetch: FetchExperts | None, why: str
    ) -> Mapping[int, ExpertRows]:
        """`missing` experts of `layer` from the peers (`fetch`), checked."""
        where = f"layer {layer}: experts {missing} cannot be read from the checkpoint here ({why})"
        if fetch is None:
            raise ExpertNotFound(f"{where} and no peers were given to copy them from")
        try:
            fetched = fetch(layer, list(missing))
        except ExpertNotFound as e:
            raise ExpertNotFound(f"{where}; {e}") from None
        lacking = [e for e in missing if e not in fetched]
        if lacking:
            raise ExpertNotFound(f"{where}; the peers did not send experts {lacking}")
        for e in missing:
            problem = check_expert_weights(self.cfg, fetched[e])
            if not problem and self.fp8_block is not None and not fetched[e].fp8:
                problem = f"{fetched[e].w13.dtype} weights, and this worker keeps its experts in FP8"
            if problem:
                raise ExpertNotFound(f"{where}; a peer sent expert {e} with {problem}")
        return fetched

    # ---- peer copy (source side) ----------------------------------------------------------
    def expert_weights(self, layer: int, experts: Sequence[int]) -> list[tuple[int, ExpertRows]]:
        """(expert, its ExpertRows) for each distinct expert of `experts` (first-seen order),
        from the newest loaded version holding it: rows of the packed tensors (no copy; a GPU
        worker copies them to host memory), valid while no re-plan writes their rows (`fetching`
        holds them).
        InvalidRequest for a non-MoE layer or an id out of range; ExpertNotFound when some
        expert is not held by a loaded version."""
        with self.fetching(layer, experts) as rows:
            return rows

    @contextlib.contextmanager
    def fetching(self, layer: int, experts: Sequence[int]) -> Iterator[list[tuple[int, ExpertRows]]]:
        """`expert_weights` for a peer copy that reads them while a re-plan may go on: the
        versions they come from are held as in-flight (as a Dispatch holds its version) until the
        block ends, so a release and a reload meanwhile cannot write new experts into their rows."""
        if layer not in self.moe_index:
            raise InvalidRequest(f"layer {layer} is not a MoE layer (MoE layers: {list(self.moe_index)})")
        experts = list(dict.fromkeys(int(e) for e in experts))
        bad = [e for e in experts if not 0 <= e < self.cfg.n_routed_experts]
        if bad:
            raise InvalidRequest(f"logical expert {bad[0]} outside [0, {self.cfg.n_routed_experts})")
        with self._lock:  # (only the versions the rows come from are held: the newest holding each)
            loaded = [self._versions[v] for v in sorted(self._versions, reverse=True)]
            source = {}
            for held in loaded:
                for e in held.packed.logical.get(layer, ()):
                    source.setdefault(int(e), held)
            versions = list({id(source[e]): source[e] for e in experts if e in source}.values())
            for held in versions:
                held.inflight += 1
        try:
            held_rows = _held_rows(versions, layer)
            missing = [e for e in experts if e not in held_rows]
            if missing:
                raise ExpertNotFound(
                    f"layer {layer}: experts {missing} are not held by this worker "
                    f"(loaded versions: {sorted(v.version for v in loaded)})"
                )
            yield [(e, held_rows[e].to("cpu")) for e in experts]  # (no copy on a CPU worker)
        finally:
            with self._lock:
                for held in versions:
                    held.inflight -= 1
                    if not held.inflight and held in self._draining:
                        self._draining.remove(held)

    # ---- compute ------------------------------------------------------------------------
    def forward(
        self,
        version: int,
        layer: int,
        hidden: torch.Tensor,
        slot: torch.Tensor,
        weight: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Weighted sum of this worker's expert outputs per token.

        hidden [T, H] (the store's dtype), slot [T, K] int32 local slots (-1 = none),
        weight [T, K] float32 (finite). Returns [T, H] in hidden's dtype (fp32 accumulation),
        written into `out` when given (the response's payload: no copy after the compute).
        Non-finite hidden values are not checked: they only reach their own token's output.
        """
        self._check_request(layer, hidden, slot, weight)
        if out is not None and (out.shape != hidden.shape or out.dtype != hidden.dtype):
            raise InvalidRequest(
                f"out is {out.dtype} {list(out.shape)}, hidden {hidden.dtype} {list(hidden.shape)}"
            )
        with self._lock:
            held = self._versions.get(version)
            if held is not None and layer not in held.packed.logical:
                raise InvalidRequest(f"layer {layer} (an MTP module's) is not served by version {version}: "
                                     "the cluster does not speculate")  # fmt: skip
            if held is not None:
                held.inflight += 1  # (its rows are not written again while this call runs)
                tensors = held.packed.layer_tensors(layer)  # (together: a growing layer swaps them)
        if held is None:
            state = "still loading" if version in self._loading else "not loaded"
            raise VersionUnavailable(
                f"placement version {version} is {state} on this worker (loaded: {self.loaded_versions})"
            )
        done = None  # (pairs per slot, output) once computed
        try:
            done = self._compute(held, tensors, hidden, slot, weight, out)
            return done[1]
        finally:
            with self._lock:
                held.inflight -= 1
                if done is not None:
                    held.tokens[self.moe_index[layer]] += done[0]
                    self.dispatch_calls += 1
                if not held.inflight and held in self._draining:
                    self._draining.remove(held)

    def _compute(self, held: SlotVersion, t, hidden, slot, weight, out) -> tuple[torch.Tensor, torch.Tensor]:
        """(pairs per slot [S], the output) of one checked request on `held`, whose layer's tensors
        `t` (LayerTensors) were read under the lock."""
        num_slots, packed = held.num_slots, held.packed
        if out is not None and self._dispatch is not None:  # (the C++ Dispatch: its size rule says)
            counts = torch.zeros(num_slots, dtype=torch.long)  # (decode sizes: one call checks and computes)
            try:
                ran = self._dispatch(
                    hidden, slot, weight, t.w13, t.w2, out, counts, packed.swiglu_limit, t.rows
                )
            except ValueError as e:
                raise InvalidRequest(f"{e} (placement version {held.version})") from None
            if ran:
                return counts, out
        if slot.numel():
            lo, hi = int(slot.min()), int(slot.max())
            if lo < -1 or hi >= num_slots:
                bad = lo if lo < -1 else hi
                raise InvalidRequest(
                    f"slot {bad} out of range: version {held.version} has {num_slots} slots on this worker "
                    "(-1 = none)"
                )
        slot = slot.long()
        counts = torch.bincount(slot[slot >= 0], minlength=num_slots)
        if self.device.type == "cpu":
            out = packed.forward_tensors(t, hidden, slot, weight, out)
        else:  # the request's tensors come and go through host memory (the gRPC payload)
            to = self.device
            y = packed.forward_tensors(t, hidden.to(to), slot.to(to), weight.to(to))
            out = y.cpu() if out is None else out.copy_(y)
        return counts, out

    def _check_request(self, layer: int, hidden, slot, weight) -> None:
        for name, t in (("hidden", hidden), ("slot", slot), ("weight", weight)):
            if t is None:
                raise InvalidRequest(f"{name} is missing")
            if t.dim() != 2:
                raise InvalidRequest(f"{name} must be 2-D, got shape {list(t.shape)}")
        if layer not in self.moe_index:
            raise InvalidRequest(f"layer {layer} is not a MoE layer (MoE layers: {list(self.moe_index)})")
        if hidden.dtype != self.dtype:
            raise InvalidRequest(f"hidden is {hidden.dtype}, this worker computes in {self.dtype}")
        if hidden.shape[1] != self.cfg.hidden_size:
            raise InvalidRequest(
                f"hidden has width {hidden.shape[1]}, the model's hidden size is {self.cfg.hidden_size}"
            )
        if slot.dtype != torch.int32:
            raise InvalidRequest(f"slot must be int32, got {slot.dtype}")
        if weight.dtype != torch.float32:
            raise InvalidRequest(f"weight must be float32, got {weight.dtype}")
        if slot.shape[0] != hidden.shape[0] or weight.shape != slot.shape:
            raise InvalidRequest(
                f"shapes disagree: hidden {list(hidden.shape)}, slot {list(slot.shape)}, "
                f"weight {list(weight.shape)} (want [T, H], [T, K], [T, K])"
            )
        if weight.numel() and not bool(torch.isfinite(weight).all()):
            raise InvalidRequest("weight has NaN or infinite values")

    # ---- stats --------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        with self._lock:
            versions = dict(self._versions)
            stats = StoreStats(
                current_version=max(versions, default=0),
                loaded_versions=sorted(versions),
                loading_versions=sorted(self._loading),
                dispatch_calls=self.dispatch_calls,
            )
            for v, held in sorted(versions.items()):
                stats.slots[v] = {
                    layer: (list(held.packed.logical[layer]), held.tokens[n].tolist())
                    for layer, n in self.moe_index.items()
                    if layer in held.packed.logical  # (MTP layers: where the version serves them)
                }
        stats.weight_bytes = self.weight_bytes()
        stats.kernels, stats.kernel_reasons = self.kernels.names(), self.kernels.reasons()
        return stats


def _held_rows(versions: Sequence[SlotVersion], layer: int) -> dict[int, ExpertRows]:
    """logical expert -> its ExpertRows in `layer` held by `versions` (first wins)."""
    held: dict[int, ExpertRows] = {}
    for v in versions:
        p = v.packed
        rows = p.rows.get(layer)
        for slot, e in enumerate(p.logical[layer]):
            if e not in held:
                row = slot if rows is None else int(rows[slot])
                scales = (p.w13_scale[layer][row], p.w2_scale[layer][row]) if layer in p.w13_scale else ()
                held[e] = ExpertRows(p.w13[layer][row], p.w2[layer][row], *scales)
    return held
