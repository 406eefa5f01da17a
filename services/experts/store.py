"""The slot store of one expert worker: its routed-expert weights per placement version.

A version maps every MoE layer to the logical expert held by each of this worker's S local slots
(`PackedExperts`: w13 [S, 2I, H], w2 [S, H, I] per layer). Several versions can be loaded at once:
during a re-placement the new one loads (from the checkpoint by mmap, or from tensors already
held) while the old one keeps serving, and the old one is released after the switch.

Pure: no gRPC, no Ray. `load` may run in one thread while `forward` runs in another.
Errors are typed so the gRPC shell can map them to status codes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.model.checkpoint import CheckpointReader, load_expert_weights
from services.model.config import ModelConfig
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


@dataclass
class LoadReport:
    version: int
    bytes_read: int = 0  # expert bytes read from the checkpoint
    bytes_reused: int = 0  # expert bytes taken from versions already loaded
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
    def __init__(self, cfg: ModelConfig, model_dir: str | Path, dtype: torch.dtype, max_versions: int = 3):
        self.cfg, self.model_dir, self.dtype, self.max_versions = cfg, Path(model_dir), dtype, max_versions
        self.moe_index = {layer: n for n, layer in enumerate(cfg.moe_layers)}
        self._versions: dict[int, SlotVersion] = {}
        self._loading: set[int] = set()
        self._lock = threading.Lock()
        self.dispatch_calls = 0

    # ---- versions -----------------------------------------------------------------------
    @property
    def loaded_versions(self) -> list[int]:
        return sorted(self._versions)

    @property
    def current_version(self) -> int:
        return max(self._versions, default=0)

    def load(self, version: int, experts_per_layer: Mapping[int, Sequence[int]]) -> LoadReport:
        """Load `version`: per MoE layer, the logical expert of each local slot, in slot order.

        Slow (reads weights); run it off the serving thread. Versions already loaded keep
        serving meanwhile. An identical repeat of a loaded version is a no-op.
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
            packed, report = self._build(layout, donors)
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
        self, layout: dict[int, list[int]], donors: list[SlotVersion]
    ) -> tuple[PackedExperts, LoadReport]:
        """Packed experts for `layout`, reusing tensors of `donors` (loaded versions) when they
        hold the same experts: a whole layer with identical slots is shared without a copy,
        single experts are copied from memory, the rest is read from the checkpoint."""
        packed, report = PackedExperts(), LoadReport(0)
        reader = None
        try:
            for layer, experts in layout.items():
                same = next((d.packed for d in donors if d.packed.logical[layer] == experts), None)
                if same is not None:
                    packed.w13[layer], packed.w2[layer] = same.w13[layer], same.w2[layer]
                    packed.logical[layer] = list(experts)
                    report.bytes_reused += _nbytes(same.w13[layer], same.w2[layer])
                    continue
                held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # logical -> (w13, w2) rows
                for d in donors:
                    for row, e in enumerate(d.packed.logical[layer]):
                        held.setdefault(e, (d.packed.w13[layer][row], d.packed.w2[layer][row]))
                missing = sorted(set(experts) - held.keys())
                if missing:
                    reader = reader or CheckpointReader.for_config(self.model_dir, self.cfg)
                    before = reader.bytes_read
                    w13_read, w2_read = load_expert_weights(reader, layer, missing, self.dtype)
                    report.bytes_read += reader.bytes_read - before
                    held.update({e: (w13_read[n], w2_read[n]) for n, e in enumerate(missing)})
                report.bytes_reused += sum(_nbytes(*held[e]) for e in experts if e not in missing)
                packed.w13[layer] = torch.stack([held[e][0] for e in experts])  # [S, 2I, H]
                packed.w2[layer] = torch.stack([held[e][1] for e in experts])  # [S, H, I]
                packed.logical[layer] = list(experts)
        finally:
            if reader is not None:
                reader.close()
        return packed, report

    # ---- compute ------------------------------------------------------------------------
    def forward(
        self, version: int, layer: int, hidden: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        """Weighted sum of this worker's expert outputs per token.

        hidden [T, H] (the store's dtype), slot [T, K] int32 local slots (-1 = none),
        weight [T, K] float32 (finite). Returns [T, H] in hidden's dtype (fp32 accumulation).
        Non-finite hidden values are not checked: they only reach their own token's output.
        """
        self._check_request(layer, hidden, slot, weight)
        held = self._versions.get(version)
        if held is None:
            state = "still loading" if version in self._loading else "not loaded"
            raise VersionUnavailable(
                f"placement version {version} is {state} on this worker (loaded: {self.loaded_versions})"
            )
        num_slots = held.num_slots
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
        out = held.packed.forward(layer, hidden, slot, weight)
        with self._lock:
            held.tokens[self.moe_index[layer]] += counts
            self.dispatch_calls += 1
        return out

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
            for d in (held.packed.w13, held.packed.w2):
                for t in d.values():
                    seen[t.data_ptr()] = _nbytes(t)
        stats.weight_bytes = sum(seen.values())
        return stats


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
