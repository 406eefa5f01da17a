"""Selective, mmap'd reading of Hugging Face safetensors checkpoints.

Single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`) checkpoints,
original per-expert names (`model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight`; DeepSeek-V4:
`model.layers.{l}.ffn.experts.{e}.{w1,w3,w2}.weight`),
bf16/fp16/fp32 and FP8 e4m3 with block `weight_scale_inv` (dequantisation multiplies; edge
blocks may be partial, e.g. the 576-row kv_a_proj_with_mqa of DeepSeek-V3).

Every tensor is read on its own through `safe_open` (an mmap of the file), so an attention
worker never touches expert bytes and an expert worker reads only the experts of its slots.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig
from .fp8 import FP8_DTYPES, Fp8Weight, dequantize_fp8_blocks, fp8_scale_shape


class CheckpointReader:
    """Name -> tensor access over one or many safetensors files, one tensor at a time."""

    def __init__(
        self, model_dir: str | Path, fp8_block: tuple[int, int] | None = None, v4_names: bool = False
    ):
        self.model_dir = Path(model_dir)
        self.fp8_block = fp8_block or (128, 128)
        self.v4_names = v4_names  # DeepSeek-V4's expert tensor names (`expert_name`)
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: self.model_dir / f for name, f in weight_map.items()}
        else:
            files = sorted(self.model_dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {self.model_dir}")
            self._file_of = {}
            for f in files:
                with safe_open(f, framework="pt") as h:
                    for name in h.keys():  # noqa: SIM118 (safe_open has no __iter__)
                        self._file_of[name] = f
        self._stored: dict[str, str] = {}  # a name read under another (for_config's aliases) -> as stored
        self._handles: dict[Path, object] = {}
        self.bytes_read = 0
        self.names_read: list[str] = []  # every tensor read, in order (for accounting and tests)

    @classmethod
    def for_config(cls, model_dir: str | Path, cfg: ModelConfig) -> CheckpointReader:
        reader = cls(model_dir, cfg.fp8_block_size, cfg.is_v4)
        if cfg.is_v4:  # DeepSeek's V4 release keeps MTP module j as `mtp.{j}.*`: read as its layer's
            for name in [n for n in reader._file_of if n.startswith("mtp.")]:
                j, rest = name[len("mtp.") :].split(".", 1)
                alias = f"model.layers.{cfg.num_hidden_layers + int(j)}.{rest}"
                reader._file_of.setdefault(alias, reader._file_of[name])
                reader._stored[alias] = name
        return reader

    def names(self) -> Iterable[str]:
        return self._file_of.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _handle(self, path: Path):
        h = self._handles.get(path)
        if h is None:
            h = self._handles[path] = safe_open(path, framework="pt")
        return h

    def raw(self, name: str) -> torch.Tensor:
        """The stored tensor, as stored (no dequantisation)."""
        try:
            path = self._file_of[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} not in checkpoint {self.model_dir}") from None
        t = self._handle(path).get_tensor(self._stored.get(name, name))
        self.bytes_read += t.numel() * t.element_size()
        self.names_read.append(name)
        return t

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor, FP8 blocks dequantised, converted to `dtype` when given."""
        t = self.raw(name)
        if t.dtype in FP8_DTYPES:
            scale_name = name + "_scale_inv"
            if scale_name not in self:
                raise KeyError(f"FP8 tensor {name!r} has no {scale_name!r}")
            t = dequantize_fp8_blocks(t, self.raw(scale_name), self.fp8_block)
        return t.to(dtype) if dtype is not None else t

    def get_fp8(self, name: str) -> Fp8Weight:
        """A 2-D FP8 tensor as stored, with its block scales; ValueError where it is not FP8."""
        w, scale = _fp8_with_scale(self, name)
        return Fp8Weight(w, scale.float(), self.fp8_block)

    def get_optional(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return self.get(name, dtype) if name in self else None

    def close(self) -> None:
        self._handles.clear()


_V4_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}


def expert_name(layer: int, expert: int, proj: str, v4: bool = False) -> str:
    """proj: gate / up / down. v4: DeepSeek-V4's naming (`ffn.experts.E.w1/w3/w2`)."""
    if v4:
        return f"model.layers.{layer}.ffn.experts.{expert}.{_V4_PROJ[proj]}.weight"
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"


def is_routed_expert_tensor(name: str) -> bool:
    return ".mlp.experts." in name or ".ffn.experts." in name


def load_expert_weights(
    reader: CheckpointReader, layer: int, experts: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed weights of `experts` (logical ids, in slot order) of one MoE layer.

    Returns w13 [S, 2I, H] (gate rows then up rows) and w2 [S, H, I], in `dtype`.
    Only these experts' tensors are read.
    """
    if not experts:
        raise ValueError("load_expert_weights needs at least one expert")
    v4 = reader.v4_names
    first_gate = reader.get(expert_name(layer, experts[0], "gate", v4), dtype)
    inter, hidden = first_gate.shape
    w13 = torch.empty(len(experts), 2 * inter, hidden, dtype=dtype)
    w2 = torch.empty(len(experts), hidden, inter, dtype=dtype)
    for s, e in enumerate(experts):
        w13[s, :inter] = first_gate if s == 0 else reader.get(expert_name(layer, e, "gate", v4), dtype)
        w13[s, inter:] = reader.get(expert_name(layer, e, "up", v4), dtype)
        w2[s] = reader.get(expert_name(layer, e, "down", v4), dtype)
    return w13, w2


def load_expert_weights_fp8(
    reader: CheckpointReader, layer: int, experts: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`load_expert_weights` for FP8 experts kept as stored: w13 [S, 2I, H] and w2 [S, H, I]
    float8_e4m3fn with their block scales (`weight_scale_inv`) w13_scale [S, 2I / bn, ceil(H / bk)]
    and w2_scale [S, ceil(H / bn), ceil(I / bk)] fp32, (bn, bk) = reader.fp8_block: a weight is
    its FP8 value times its block's scale (`dequantize_fp8_blocks`). Gate and up rows are stacked
    with their scale rows, so I must be a multiple of bn; ValueError otherwise, or when the
    experts are not FP8."""
    if not experts:
        raise ValueError("load_expert_weights_fp8 needs at least one expert")
    bn, _ = reader.fp8_block
    v4 = reader.v4_names
    w13, w2, s13, s2 = [], [], [], []
    for e in experts:
        (gate, gs), (up, us), (down, ds) = (
            _fp8_with_scale(reader, expert_name(layer, e, p, v4)) for p in ("gate", "up", "down")
        )
        if gate.shape[0] % bn:
            raise ValueError(f"FP8 experts kept FP8 need the expert width ({gate.shape[0]}) to be a multiple of "
                             f"the quantisation block's rows ({bn})")  # fmt: skip
        w13.append(torch.cat([gate, up]))
        s13.append(torch.cat([gs, us]))
        w2.append(down)
        s2.append(ds)
    return torch.stack(w13), torch.stack(w2), torch.stack(s13).float(), torch.stack(s2).float()


def _fp8_with_scale(reader: CheckpointReader, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    w = reader.raw(name)
    if w.dtype not in FP8_DTYPES or name + "_scale_inv" not in reader:
        raise ValueError(f"{name} is {w.dtype}, not FP8 with a weight_scale_inv: nothing to keep in FP8")
    scale = reader.raw(name + "_scale_inv")
    if scale.shape != fp8_scale_shape(w.shape, reader.fp8_block):
        raise ValueError(f"{name}_scale_inv of shape {list(scale.shape)} does not match the weight {list(w.shape)} "
                         f"in blocks of {reader.fp8_block}")  # fmt: skip
    return w, scale


def check_keep_fp8_experts(cfg: ModelConfig) -> None:
    """A clear error where `EngineConfig.keep_fp8_experts` cannot hold."""
    _check_keep_fp8(cfg, "keep_fp8_experts", [cfg.moe_intermediate_size])


def check_keep_fp8_linears(cfg: ModelConfig) -> None:
    """A clear error where `EngineConfig.keep_fp8_linears` cannot hold (the dense layers' MLPs and
    the shared experts stack gate and up as the experts do)."""
    dense = any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    widths = [cfg.intermediate_size] if dense else []
    widths += [cfg.moe_intermediate_size * cfg.n_shared_experts] if cfg.n_shared_experts else []
    _check_keep_fp8(cfg, "keep_fp8_linears", widths)


def _check_keep_fp8(cfg: ModelConfig, what: str, mlp_widths: list[int]) -> None:
    """An FP8 block-quantised, non-V4 checkpoint whose MLPs (gate and up stacked by rows, sharing
    one scale grid) are multiples of the block's rows wide; ValueError naming `what` otherwise."""
    if cfg.fp8_block_size is None:
        raise ValueError(f"{what}: the checkpoint is not FP8 block-quantised (no quantization_config)")
    if cfg.is_v4:
        raise ValueError(f"{what} is not supported for DeepSeek-V4 checkpoints yet")
    bn = cfg.fp8_block_size[0]
    for width in mlp_widths:
        if width % bn:
            raise ValueError(
                f"{what}: MLP width {width} is not a multiple of the FP8 block's rows ({bn}), so gate and up "
                "cannot share one stacked scale grid"
            )
