"""The slot store of one expert worker: its routed-expert weights per placement version.

A version maps every MoE layer to the logical expert held by each of this worker's S local slots
(`PackedExperts`: w13 [S, 2I, H], w2 [S, H, I] per layer). Several versions can be loaded at once:
during a re-placement the new one loads while the old one keeps serving, and the old one is
released after the switch. Where a new version's experts come from, in order:

1. tensors already held by a loaded version (a whole identical layer is shared, single experts
   are copied from memory);
2. the checkpoint on this node (mmap'd safetensors, only the experts needed), when its files
   are here;
3. a peer: the `fetch` callable given to `load` (the gRPC shell passes one that calls
   FetchExperts on other expert workers), for experts the checkpoint here cannot give (no
   safetensors files on this node, or a tensor missing from them).

`expert_weights` is the other side of 3: the rows of experts this worker holds.

Pure: no gRPC, no Ray. `load` may run in one thread while `forward` runs in another.
Errors are typed so the gRPC shell can map them to status codes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from services.model.checkpoint import (
    CheckpointReader,
    check_keep_fp8_experts,
    load_expert_weights,
    load_expert_weights_fp8,
)
from services.model.config import ModelConfig
from services.model.fp8 import dequantize_fp8_blocks, fp8_scale_shape
from services.model.kernels import cpu_kernels
from services.model.moe import PackedExperts


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


class ExpertRows(NamedTuple):
    """One logical expert's weights: w13 [2I, H] (gate rows, then up rows), w2 [H, I]; experts
    kept in FP8 (float8_e4m3fn) also carry their block scales w13_scale [2I / bn, ceil(H / bk)]
    and w2_scale [ceil(H / bn), ceil(I / bk)] fp32 (`PackedExperts`)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.w13_scale is not None

    def to(self, device: torch.device | str) -> ExpertRows:
        return ExpertRows(*(None if t is None else t.to(device) for t in self))

    def nbytes(self) -> int:
        return _nbytes(*(t for t in self if t is not None))


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


@dataclass
class SlotVersion:
    """One loaded placement version: packed experts + per-slot token counters."""

    version: int
    packed: PackedExperts
    tokens: torch.Tensor  # [num_moe_layers, S] int64 (token, choice) pairs computed per local slot

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
    ):
        """dtype: what Dispatch computes in; weight_dtype: how the experts are held when narrower
        (bf16 under fp32 on CPU: config.check_weight_dtype); None: dtype. keep_fp8: an FP8
        checkpoint's experts are held as shipped, with their block scales (ValueError where they
        cannot be: checkpoint.check_keep_fp8_experts)."""
        self.cfg, self.model_dir, self.dtype, self.max_versions = cfg, Path(model_dir), dtype, max_versions
        self.weight_dtype = weight_dtype or dtype
        if keep_fp8:
            check_keep_fp8_experts(cfg)
        self.fp8_block = cfg.fp8_block_size if keep_fp8 else None  # (bn, bk) when experts are held in FP8
        self.device = torch.device(device)  # where the packed experts live and compute
        self.moe_index = {layer: n for n, layer in enumerate(cfg.moe_layers)}
        self._versions: dict[int, SlotVersion] = {}
        self._loading: set[int] = set()
        self._lock = threading.Lock()
        self.dispatch_calls = 0
        cpu_kernels.available()  # build (once per machine) or load the decode kernel before serving

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
            donors = list(self._versions.values())
        try:
            packed, report = self._build(layout, donors, fetch)
        finally:
            with self._lock:
                self._loading.discard(version)
        num_slots = len(next(iter(layout.values())))
        with self._lock:
            self._versions[version] = SlotVersion(
                version, packed, torch.zeros(len(self.moe_index), num_slots, dtype=torch.long)
            )
        report.version, report.seconds = version, time.perf_counter() - start
        return report

    def release(self, version: int) -> list[int]:
        """Drop `version` (idempotent); returns the versions still loaded. In-flight calls on
        it finish correctly: they hold their own references to the tensors."""
        with self._lock:
            self._versions.pop(version, None)
            return sorted(self._versions)

    def _check_layout(
        self, version: int, experts_per_layer: Mapping[int, Sequence[int]]
    ) -> dict[int, list[int]]:
        if version <= 0:
            raise InvalidRequest(f"version must be > 0, got {version}")
        layers = sorted(experts_per_layer)
        if layers != self.cfg.moe_layers:
            raise InvalidRequest(
                f"LoadSlots must name every MoE layer {self.cfg.moe_layers} once, got {layers}"
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

    def _build(
        self, layout: dict[int, list[int]], donors: list[SlotVersion], fetch: FetchExperts | None
    ) -> tuple[PackedExperts, LoadReport]:
        """Packed experts for `layout`, reusing tensors of `donors` (loaded versions) when they
        hold the same experts: a whole layer with identical slots is shared without a copy,
        single experts are copied from memory, the rest is read from the checkpoint, and what
        the checkpoint here lacks comes from `fetch`."""
        packed = PackedExperts(swiglu_limit=self.cfg.swiglu_limit, fp8_block=self.fp8_block)
        report = LoadReport(0)
        checkpoint = _Checkpoint(self.model_dir, self.cfg, self.weight_dtype, self.fp8_block is not None)
        try:
            for layer, experts in layout.items():
                same = next((d.packed for d in donors if d.packed.logical[layer] == experts), None)
                if same is not None:
                    for mine, theirs in zip(packed.tensor_dicts(), same.tensor_dicts(), strict=True):
                        if layer in theirs:
                            mine[layer] = theirs[layer]
                    packed.logical[layer] = list(experts)
                    report.bytes_reused += _nbytes(*(d[layer] for d in same.tensor_dicts() if layer in d))
                    continue
                held = _held_rows(donors, layer)  # logical -> ExpertRows
                report.bytes_reused += sum(held[e].nbytes() for e in experts if e in held)
                missing = sorted(set(experts) - held.keys())
                if missing:
                    got = checkpoint.read(layer, missing)
                    report.bytes_read = checkpoint.bytes_read
                    held.update({e: rows.to(self.device) for e, rows in got.items()})
                    missing = [e for e in missing if e not in got]
                if missing:
                    fetched = self._fetch(layer, missing, fetch, checkpoint.unavailable)
                    report.bytes_from_peers += sum(fetched[e].nbytes() for e in missing)
                    held.update({e: self._as_held(rows) for e, rows in fetched.items()})
                rows = [held[e] for e in experts]
                packed.w13[layer] = torch.stack([r.w13 for r in rows])  # [S, 2I, H]
                packed.w2[layer] = torch.stack([r.w2 for r in rows])  # [S, H, I]
                if self.fp8_block is not None:
                    packed.w13_scale[layer] = torch.stack([r.w13_scale for r in rows])
                    packed.w2_scale[layer] = torch.stack([r.w2_scale for r in rows])
                packed.logical[layer] = list(experts)
        finally:
            checkpoint.close()
        return packed, report

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
        worker copies them to host memory).
        InvalidRequest for a non-MoE layer or an id out of range; ExpertNotFound when some
        expert is not held by a loaded version."""
        if layer not in self.moe_index:
            raise InvalidRequest(f"layer {layer} is not a MoE layer (MoE layers: {self.cfg.moe_layers})")
        experts = list(dict.fromkeys(int(e) for e in experts))
        bad = [e for e in experts if not 0 <= e < self.cfg.n_routed_experts]
        if bad:
            raise InvalidRequest(f"logical expert {bad[0]} outside [0, {self.cfg.n_routed_experts})")
        with self._lock:
            versions = [self._versions[v] for v in sorted(self._versions, reverse=True)]
        held = _held_rows(versions, layer)
        missing = [e for e in experts if e not in held]
        if missing:
            raise ExpertNotFound(
                f"layer {layer}: experts {missing} are not held by this worker "
                f"(loaded versions: {sorted(v.version for v in versions)})"
            )
        return [(e, held[e].to("cpu")) for e in experts]  # (no copy on a CPU worker)

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
        held = self._versions.get(version)
        if held is None:
            state = "still loading" if version in self._loading else "not loaded"
            raise VersionUnavailable(
                f"placement version {version} is {state} on this worker (loaded: {self.loaded_versions})"
            )
        num_slots = held.num_slots
        if out is not None and self._dispatch_kernel(held, layer, hidden, slot, weight, out):
            return out
        if slot.numel():
            lo, hi = int(slot.min()), int(slot.max())
            if lo < -1 or hi >= num_slots:
                bad = lo if lo < -1 else hi
                raise InvalidRequest(
                    f"slot {bad} out of range: version {version} has {num_slots} slots on this worker "
                    "(-1 = none)"
                )
        slot = slot.long()
        counts = torch.bincount(slot[slot >= 0], minlength=num_slots)
        if self.device.type == "cpu":
            out = held.packed.forward(layer, hidden, slot, weight, out)
        else:  # the request's tensors come and go through host memory (the gRPC payload)
            to = self.device
            y = held.packed.forward(layer, hidden.to(to), slot.to(to), weight.to(to))
            out = y.cpu() if out is None else out.copy_(y)
        with self._lock:
            held.tokens[self.moe_index[layer]] += counts
            self.dispatch_calls += 1
        return out

    def _dispatch_kernel(self, held: SlotVersion, layer: int, hidden, slot, weight, out) -> bool:
        """The decode-sized CPU case in one kernel call (cpu_kernels.expert_dispatch: the range
        and weight checks, the experts and the slot counts); False where it does not apply."""
        packed = held.packed
        if self.device.type != "cpu" or layer in packed.w13_scale:
            return False
        counts = torch.zeros(held.num_slots, dtype=torch.long)
        try:
            ran = cpu_kernels.expert_dispatch(hidden, slot, weight, packed.w13[layer], packed.w2[layer], out,
                                              counts, packed.swiglu_limit)  # fmt: skip
        except ValueError as e:
            raise InvalidRequest(f"{e} (placement version {held.version})") from None
        if ran:
            with self._lock:  # (calls run concurrently: the shared counters only under the lock)
                held.tokens[self.moe_index[layer]] += counts
                self.dispatch_calls += 1
        return ran

    def _check_request(self, layer: int, hidden, slot, weight) -> None:
        for name, t in (("hidden", hidden), ("slot", slot), ("weight", weight)):
            if t is None:
                raise InvalidRequest(f"{name} is missing")
            if t.dim() != 2:
                raise InvalidRequest(f"{name} must be 2-D, got shape {list(t.shape)}")
        if layer not in self.moe_index:
            raise InvalidRequest(f"layer {layer} is not a MoE layer (MoE layers: {self.cfg.moe_layers})")
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
                }
        seen: dict[int, int] = {}
        for held in versions.values():
            for d in held.packed.tensor_dicts():
                for t in d.values():
                    seen[t.data_ptr()] = _nbytes(t)
        stats.weight_bytes = sum(seen.values())
        return stats


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _held_rows(versions: Sequence[SlotVersion], layer: int) -> dict[int, ExpertRows]:
    """logical expert -> its ExpertRows in `layer` held by `versions` (first wins)."""
    held: dict[int, ExpertRows] = {}
    for v in versions:
        p = v.packed
        for row, e in enumerate(p.logical[layer]):
            if e not in held:
                scales = (p.w13_scale[layer][row], p.w2_scale[layer][row]) if layer in p.w13_scale else ()
                held[e] = ExpertRows(p.w13[layer][row], p.w2[layer][row], *scales)
    return held


def check_expert_weights(cfg: ModelConfig, rows: ExpertRows) -> str | None:
    """None when `rows` have one expert's shapes (w13 [2I, H], w2 [H, I]) and a float dtype (FP8:
    with scales of the checkpoint's block grid), else what is wrong."""
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    for name, t, shape in (("w13", rows.w13, (2 * inter, hidden)), ("w2", rows.w2, (hidden, inter))):
        if t is None:
            return f"no {name}"
        if tuple(t.shape) != shape:
            return f"{name} of shape {list(t.shape)} (want {list(shape)})"
        if not t.dtype.is_floating_point:
            return f"{name} of dtype {t.dtype}"
    parts = {"w13 FP8": rows.w13.dtype == torch.float8_e4m3fn, "w2 FP8": rows.w2.dtype == torch.float8_e4m3fn,
             "w13_scale": rows.w13_scale is not None, "w2_scale": rows.w2_scale is not None}  # fmt: skip
    if len(set(parts.values())) != 1:  # FP8 weights come with both scales, others with none
        return "a mix of FP8 parts: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in parts.items())
    fp8 = parts["w13 FP8"]
    if fp8:
        if cfg.fp8_block_size is None:
            return "FP8 weights for a checkpoint that is not FP8"
        for name, t, shape in (("w13_scale", rows.w13_scale, (2 * inter, hidden)),
                               ("w2_scale", rows.w2_scale, (hidden, inter))):  # fmt: skip
            want = fp8_scale_shape(shape, cfg.fp8_block_size)
            if tuple(t.shape) != want or t.dtype != torch.float32:
                return f"{name} {t.dtype} of shape {list(t.shape)} (want float32 {list(want)})"
    return None


class _Checkpoint:
    """This node's checkpoint for one `load`: opened on first use; `unavailable` says why an
    expert could not be read (no safetensors files here, a tensor or shard file missing)."""

    def __init__(self, model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, keep_fp8: bool = False):
        self.model_dir, self.cfg, self.dtype, self.keep_fp8 = model_dir, cfg, dtype, keep_fp8
        self.reader: CheckpointReader | None = None
        self.unavailable = ""  # the last reason an expert could not be read, "" while none
        self.absent = False  # no checkpoint on this node: do not try again
        self.bytes_read = 0

    def read(self, layer: int, experts: list[int]) -> dict[int, ExpertRows]:
        """{expert: ExpertRows} for the experts of `experts` it could read (FP8 as stored with
        keep_fp8, else in dtype)."""
        if self.absent:
            return {}
        if self.reader is None:
            try:
                self.reader = CheckpointReader.for_config(self.model_dir, self.cfg)
            except OSError as e:  # FileNotFoundError: no safetensors files (or no such dir)
                self.absent, self.unavailable = True, f"no checkpoint on this node: {e}"
                return {}
        got = {}
        for e in experts:
            before = self.reader.bytes_read
            try:
                if self.keep_fp8:
                    tensors = load_expert_weights_fp8(self.reader, layer, [e])
                else:
                    tensors = load_expert_weights(self.reader, layer, [e], self.dtype)
            except (KeyError, OSError, ValueError) as err:  # tensor not in the checkpoint, shard file
                self.unavailable = str(err).strip("'\"")  # missing, (keep_fp8) an expert not stored in FP8
                continue
            got[e] = ExpertRows(*(t[0] for t in tensors))
            self.bytes_read += self.reader.bytes_read - before
        return got

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
