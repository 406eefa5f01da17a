"""Where an expert worker's weights come from besides the rows it holds: this node's checkpoint
(`Checkpoint`, opened for one load) and the check applied to experts a peer sends
(`check_expert_weights`). Pure: no gRPC."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from services.model.checkpoint import CheckpointReader, load_expert_weights, load_expert_weights_fp8
from services.model.config import ModelConfig
from services.model.fp8 import fp8_scale_shape


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


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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


class Checkpoint:
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
