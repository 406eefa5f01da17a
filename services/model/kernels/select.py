"""Which kernel runs each family of the model's work, chosen once per (device, dtype, model).

`select_kernels` looks at what is installed (triton, FlashMLA, the C++ CPU kernels' build), what
the engine asked for (`allow`: "auto", or the implementations named) and the model's static
shapes and dtypes, and for each kernel family takes the first implementation of

    flashmla > triton > cpp > torch

that can run it (torch, the reference, always can). The result, a `Kernels`, has one attribute
per kernel function, bound to the chosen implementation (the model calls `kernels.rms_norm(...)`:
no lookup of names, no "not me" None), and says what it chose: `names()` (family -> "flashmla",
"triton", "cpp" or "torch"), `reasons()` (family -> {better implementation not taken: why}),
`summary()` (the one line the engine logs at startup). A kernel that cannot take a static shape
or dtype of the model says so here, as the reason it was not taken ("cpp: kv_lora_rank 20 is
not a multiple of 8"); what is left per call is each kernel's documented size rule (cpu_kernels:
e.g. the linear's up to 8 rows), a choice of algorithm by batch size.

A GPU kernel that fails where it runs (a Triton build that cannot compile for this GPU, another
FlashMLA API) is logged and its family goes to its next implementation from then on, visible in
`names()` / `reasons()` (inside a CUDA-graph capture, or its sync-checked warm-up, the error
propagates instead: the engine stays eager). Nothing here is global: every engine, expert store
or model holds its own `Kernels`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from services.model.config import ModelConfig
from services.model.fp8 import Fp8Weight
from services.model.kv_cache import FP8_GROUP, fp8_row_bytes, quantize_latent_rows

from . import cpu_kernels, flashmla, torch_ops
from . import deterministic as deterministic_kernels
from .gpu import TL_DTYPES, FlashMLAKernels, TritonKernels, flashmla_unavailable, triton_unavailable

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("flashmla", "triton", "cpp", "torch")  # best first
GPU_IMPLEMENTATIONS = ("flashmla", "triton")

# family -> (what it computes, the Kernels attributes it binds)
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "linear": ("linears with plain (fp32 / bf16) weights", ("linear_plain",)),
    "fp8_linear": ("linears with weights kept FP8", ("fp8_linear",)),
    "rms_norm": ("RMSNorm", ("rms_norm",)),
    "add_rms_norm": ("residual add + RMSNorm", ("add_rms_norm",)),
    "rope": ("rotary embedding", ("rope",)),
    "route": ("the MoE gate (V3's router)", ("route",)),
    "dense_ffn": ("dense MLP / shared experts", ("dense_ffn",)),
    "expert_ffn": ("routed experts (fused MoE)", ("expert_ffn",)),
    "expert_dispatch": ("an expert worker's Dispatch in one call", ("expert_dispatch",)),
    "absorb": ("MLA's absorbed products with kv_b", ("absorb_q", "absorb_o")),
    "latent_to_cache": ("MLA latent norm + ropes + cache write", ("latent_to_cache",)),
    "mla_decode_layer": ("a decode-only MLA layer in one call", ("mla_decode_layer",)),
    "mla_decode": ("MLA decode attention over the paged cache", ("mla_decode",)),
    "mla_sparse_decode": ("V3.2's top-k decode attention", ("sparse_decode",)),
    "mla_prefill": ("MLA prefill attention", ("mla_prefill",)),
    "index_scores": ("the lightning indexer's scores (V3.2, V4)", ("index_scores",)),
}


@dataclass(frozen=True)
class Target:
    """What kernels are chosen for: the tensors' device and dtype, the model (an expert store's
    too: its experts' dims), how the weights are held (weight_dtype: the linears' and experts'
    storage when narrower than dtype; FP8 kept as shipped), the cache's rows (FP8 or in dtype)
    and the scope ("model": an engine's; "experts": an expert worker's store); deterministic: the
    batch-invariant implementations (kernels/deterministic.py)."""

    device: torch.device
    dtype: torch.dtype
    cfg: ModelConfig
    weight_dtype: torch.dtype | None = None
    fp8_linears: bool = False
    fp8_experts: bool = False
    fp8_cache: bool = False
    scope: str = "model"
    deterministic: bool = False  # batch-invariant kernels (kernels/deterministic.py)


def families_of(t: Target) -> tuple[str, ...]:
    """The families `t` runs: an expert worker's store (scope "experts") its routed experts; a
    DeepSeek-V4 engine those and the indexer's scores (its attention is torch code); a V3 / V3.2
    engine every family of its MLA layers. "linear" everywhere: the torch paths of the others are
    built from it (the routed experts' per-slot loop beyond decode sizes)."""
    cfg = t.cfg
    if t.scope == "experts":
        return ("linear", "expert_ffn", "expert_dispatch")
    if cfg.is_v4:
        csa = "compressed_sparse_attention" in (cfg.layer_types or ())
        return ("linear", "expert_ffn", "index_scores") if csa else ("linear", "expert_ffn")
    mla = ("mla_sparse_decode", "index_scores") if cfg.has_indexer else ("mla_decode", "mla_prefill")
    return ("linear", *(("fp8_linear",) if t.fp8_linears else ()), "rms_norm", "add_rms_norm", "rope", "route",
            "dense_ffn", "expert_ffn", "absorb", "latent_to_cache", *mla, "mla_decode_layer")  # fmt: skip


class Kernels:
    """The chosen kernel of each family for one Target (module docstring). Its function
    attributes, bound by `select_kernels` (None where the target does not run the family):

    linear(x, w, bias=None) (w plain or fp8.Fp8Weight), fp8_linear(x, w, bias=None),
    rms_norm(x, weight, eps), add_rms_norm(h, delta, weight, eps) -> (h + delta, its norm),
    rope(x, cos, sin) (the model's layout), route(x, gate_w, bias) -> (idx, weight),
    dense_ffn(x, w13, w2), expert_ffn(x, slot, weight, w13, w2, out=None, swiglu_limit=None,
    w13_scale=None, w2_scale=None, fp8_block=None), expert_dispatch(x, slot, weight, w13, w2, out,
    counts, swiglu_limit=None, rows=None) -> bool (None: the store's own path),
    absorb_q(q_nope, kv_b), absorb_o(o_lat, kv_b, D), latent_to_cache(kv, q_pe, norm_weight, cos,
    sin, slot_mapping, cache, eps, extra=None) -> q_pe roped, mla_decode_layer(x, w, cos_sin,
    cache, slot_mapping, table, lens, cfg, eps) (None: the layer runs op by op), mla_decode(q,
    cache, dec, C, scale), sparse_decode(q, cache, rows, count, C, scale), mla_prefill(q_nope,
    q_pe, cache, blocks, L, kv_b, C, scale), index_scores(q, w, keys, lens).
    """

    def __init__(self, target: Target, allow: tuple[str, ...] | None):
        self.target, self.allow = target, allow
        self.device, self.dtype = target.device, target.dtype
        # batch-invariant kernels (kernels/deterministic.py): the model then also sends one row
        # per (token, choice) to its experts and sums them itself, in top-k order
        self.deterministic = target.deterministic
        self._chosen: dict[str, str] = {}
        self._passed: dict[str, dict[str, str]] = {}
        self._next: dict[str, list[tuple[str, tuple]]] = {}  # family -> the viable ones after the chosen
        for _, attrs in FAMILIES.values():
            for attr in attrs:
                setattr(self, attr, None)

    # ---- what was chosen ---------------------------------------------------------------------
    def names(self) -> dict[str, str]:
        """family -> the implementation running it ("flashmla", "triton", "cpp" or "torch"; the
        fused decode layer "cpp" or "unfused")."""
        return dict(self._chosen)

    def reasons(self) -> dict[str, dict[str, str]]:
        """family -> {each better implementation not taken: why} (empty: the best one runs)."""
        return {f: dict(r) for f, r in self._passed.items()}

    def stats(self) -> dict:
        """What an engine's or an expert store's stats show: {"kernels": names(), "kernel_reasons":
        reasons()}."""
        return {"kernels": self.names(), "kernel_reasons": self.reasons()}

    def summary(self) -> str:
        """One line naming each family's kernel (the engine logs it at startup)."""
        where = f"{self.device} {str(self.dtype).removeprefix('torch.')}"
        where += " (deterministic)" if self.deterministic else ""
        return f"kernels on {where}: " + ", ".join(f"{f}={n}" for f, n in self._chosen.items())

    def matches(self, target: Target, allow: str | Iterable[str]) -> bool:
        """Whether these were selected for `target` and `allow` (an engine reuses its model's)."""
        return self.target == target and self.allow == _parse_allow(allow)

    def for_device(self, device: torch.device | str) -> Kernels:
        """The same selection for another device (a model moved there)."""
        device = torch.device(device)
        return self if device == self.device else _select(replace(self.target, device=device), self.allow)

    # ---- binding ------------------------------------------------------------------------------
    def _bind(self, family: str, name: str, fns: tuple) -> None:
        for attr, fn in zip(FAMILIES[family][1], fns, strict=True):
            setattr(self, attr, fn)
        self._chosen[family] = name

    def _fail(self, family: str, name: str, error: Exception) -> None:
        """`name`'s kernel for `family` failed here: logged, and the family's next viable
        implementation runs it from now on (the failure recorded as why `name` is not taken).
        Raises `error` where there is none."""
        if self._chosen.get(family) != name:
            return  # (another call moved the family on meanwhile)
        left = self._next.get(family)
        if not left:
            raise error
        nxt, fns = left.pop(0)
        log.error("the %s kernel of %s failed (%s: %s); %s runs it from now on", name, family,
                  type(error).__name__, error, nxt)  # fmt: skip
        self._passed[family][name] = f"failed here ({type(error).__name__}: {error})"
        self._bind(family, nxt, fns)


def _parse_allow(allow: str | Iterable[str]) -> tuple[str, ...] | None:
    """None for "auto", else the implementations named (ValueError for an unknown name)."""
    if isinstance(allow, str):
        if allow.strip() in ("", "auto"):
            return None
        allow = [a.strip() for a in allow.split(",") if a.strip()]
    names = tuple(allow)
    unknown = sorted(set(names) - set(IMPLEMENTATIONS))
    if unknown:
        raise ValueError(
            f"kernels: unknown implementation(s) {unknown}; known: auto, {', '.join(IMPLEMENTATIONS)}"
        )
    return names


def select_kernels(
    device: torch.device | str,
    dtype: torch.dtype,
    cfg: ModelConfig,
    *,
    weight_dtype: torch.dtype | None = None,
    fp8_linears: bool = False,
    fp8_experts: bool = False,
    fp8_cache: bool = False,
    allow: str | Iterable[str] = "auto",
    scope: str = "model",
    strict: bool = False,
    deterministic: bool = False,
) -> Kernels:
    """The kernels of a model of `cfg` computing in `dtype` on `device` (module docstring).
    weight_dtype: the linears' and routed experts' storage when narrower than dtype (bf16 under
    fp32); fp8_linears / fp8_experts: an FP8 checkpoint's weights kept FP8; fp8_cache: FP8 latent
    rows. allow: "auto" (what the device offers: FlashMLA and Triton on CUDA unless
    MOE_FLASH_MLA=0 / MOE_TRITON=0, the C++ kernels on the CPU unless MOE_CPU_KERNELS=0), or the
    implementations that may run, named ("triton,torch": the Triton kernels, also on CPU tensors
    under TRITON_INTERPRET=1, torch elsewhere; torch is always allowed). scope: "model" (an
    engine's forward pass and in-process experts) or "experts" (an expert worker's store).
    strict: ValueError where an implementation named in `allow` runs no family (with why).
    deterministic: batch-invariant kernels (kernels/deterministic.py: the CPU's, or on CUDA the
    Triton ones; ValueError where this target has none: CUDA without triton or with the Triton
    kernels not allowed, DeepSeek-V4's model on CUDA)."""
    target = Target(torch.device(device), dtype, cfg, weight_dtype, fp8_linears, fp8_experts, fp8_cache, scope,
                    deterministic)  # fmt: skip
    k = _select(target, _parse_allow(allow))
    unused = [n for n in (k.allow or ()) if n != "torch" and n not in k.names().values()]
    if strict and unused:
        why = {f: r[n] for n in unused for f, r in k.reasons().items() if n in r}
        raise ValueError(f"kernels={allow!r}: {', '.join(unused)} runs no kernel family here: {why}")
    return k


def target_of(device, dtype, cfg, **options) -> Target:
    """The Target `select_kernels` makes of these arguments (to compare with Kernels.target)."""
    return Target(torch.device(device), dtype, cfg, **options)


def _select(t: Target, allow: tuple[str, ...] | None) -> Kernels:
    why = t.deterministic and deterministic_kernels.unsupported(t.device, t.cfg, t.scope)
    if why:
        raise ValueError(f"deterministic: {why}")
    k = Kernels(t, allow)
    unavailable = _libraries(t, allow)
    if t.deterministic and t.device.type == "cuda":
        why = unavailable["triton"] or (None if t.dtype in TL_DTYPES else f"not {t.dtype} activations")
        if why:
            raise ValueError(f"deterministic: on CUDA it needs the Triton kernels ({why})")
    impls = {
        "torch": _TorchImpls(k, t.cfg),
        "cpp": None if unavailable["cpp"] else cpu_kernels.CppKernels(cpu_kernels._module(), k),
        "triton": None if unavailable["triton"] else TritonKernels(k, t.cfg.rope_interleave, t.deterministic),
        "flashmla": None if unavailable["flashmla"] else FlashMLAKernels(k),
    }
    for family in families_of(t):
        options = _options(family, t, impls)
        order = [n for n in IMPLEMENTATIONS if n in options] + [
            n for n in options if n not in IMPLEMENTATIONS
        ]
        passed, viable = {}, []
        for name in order:
            why = unavailable.get(name) or (options[name] if isinstance(options[name], str) else None)
            if why is None:
                viable.append((name, _guarded(k, family, name, options[name])))
            elif not viable:
                passed[name] = why
        k._passed[family], k._next[family] = passed, viable[1:]
        k._bind(family, *viable[0])
    if t.deterministic:  # (the batch-variant families rebound over the same choices)
        on_triton = impls["triton"] is not None and t.dtype in TL_DTYPES  # (CUDA; the interpreter when asked)
        deterministic_kernels.bind(k, t.cfg, impls["cpp"], impls["triton"] if on_triton else None,
                                   lambda family, fns: _guarded(k, family, "triton", fns))  # fmt: skip
    plain, fp8_type = k.linear_plain, Fp8Weight

    def linear(x, w, bias=None):
        """A linear: the chosen plain kernel, or for a weight kept FP8 (fp8.Fp8Weight: the
        weight's format; kv_b and the LM head stay plain) the chosen FP8 one."""
        if type(w) is fp8_type:
            return k.fp8_linear(x, w, bias)
        return plain(x, w, bias)

    k.linear = linear
    if k.fp8_linear is None:
        k.fp8_linear = _no_fp8_linears
    return k


def _no_fp8_linears(x, w, bias=None):
    raise ValueError("a linear kept FP8, with kernels selected without fp8_linears (keep_fp8_linears)")


def _guarded(k: Kernels, family: str, name: str, fns: tuple) -> tuple:
    """A GPU implementation's functions, each run with its device current (Triton launches on the
    current GPU) and moved off this family where it fails (Kernels._fail); others as they are."""
    if name not in GPU_IMPLEMENTATIONS:
        return fns
    device, cuda = k.device, k.device.type == "cuda"

    def guard(fn, attr):
        def run(*args, **kwargs):
            try:
                if not cuda:  # (triton's interpreter, FlashMLA's stand-in: tests)
                    return fn(*args, **kwargs)
                with torch.cuda.device(device):
                    return fn(*args, **kwargs)
            except Exception as e:
                if cuda and (torch.cuda.is_current_stream_capturing() or torch.cuda.get_sync_debug_mode()):
                    raise  # (a capture, or the check before one: decode_graphs; the kernel itself is fine)
                k._fail(family, name, e)
                return getattr(k, attr)(*args, **kwargs)

        return run

    return tuple(guard(fn, attr) for fn, attr in zip(fns, FAMILIES[family][1], strict=True))


# ---------------------------------------------------------------------------------------------
# What is installed
# ---------------------------------------------------------------------------------------------
def _libraries(t: Target, allow: tuple[str, ...] | None) -> dict[str, str | None]:
    """implementation -> why it cannot run here at all (None: it can)."""
    out: dict[str, str | None] = {"torch": None}
    for name in ("flashmla", "triton", "cpp"):
        if allow is not None and name not in allow:
            out[name] = f"not among the kernels asked for ({','.join(allow)})"
    if "cpp" not in out:
        if t.device.type != "cpu":
            out["cpp"] = f"the C++ kernels run on the CPU ({t.device.type} tensors)"
        elif allow is None and os.environ.get("MOE_CPU_KERNELS") == "0":
            out["cpp"] = "MOE_CPU_KERNELS=0"
        else:
            why = cpu_kernels.unavailable()
            out["cpp"] = None if why is None else f"the C++ kernels are {why}"
    if "triton" not in out:
        out["triton"] = triton_unavailable(t.device, allow is not None)
    if "flashmla" not in out:
        out["flashmla"] = flashmla_unavailable(t.device, allow is not None)
    return out


# ---------------------------------------------------------------------------------------------
# Each family's candidates: their functions, or why they cannot take this model
# ---------------------------------------------------------------------------------------------
def _not_multiple(widths: dict[str, int], of: int) -> str | None:
    """'name N is not a multiple of `of`' for the first such width (None: all are; 0: absent)."""
    for name, n in widths.items():
        if n and n % of:
            return f"{name} {n} is not a multiple of {of}"
    return None


def _fp8_weights_refuse(
    block: tuple[int, int], K: dict[str, int], I: dict[str, int] | None = None
) -> str | None:
    """Why the C++ kernels cannot read FP8 weights in `block` (bn, bk) blocks with these input
    widths K (multiples of 16) and, for SwiGLU weights, intermediate widths I (multiples of 16
    and of bn)."""
    bn, bk = block
    why = _not_multiple({"FP8 column block": bk, **K, **(I or {})}, 16)
    return why or _not_multiple({f"{name} (FP8 row block {bn})": n for name, n in (I or {}).items()}, bn)


def _options(family: str, t: Target, impls: dict) -> dict[str, tuple | str | None]:
    """implementation -> its functions for `family` on `t`, why it cannot take the model (a
    string), or None where the implementation's library is not here (its reason is
    `_libraries`'); implementations that never run the family are absent."""
    cfg, dtype = t.cfg, t.dtype
    torch_, cpp, triton, flash = impls["torch"], impls["cpp"], impls["triton"], impls["flashmla"]
    no_cpp = (
        None if dtype is torch.float32 else f"float32 activations only ({str(dtype).removeprefix('torch.')})"
    )
    no_triton = None if dtype in TL_DTYPES else f"{dtype} activations"
    H, C, R, I_moe = cfg.hidden_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.moe_intermediate_size
    block = cfg.fp8_block_size or (128, 128)

    def on_cpp(why: Callable[[], str | None], fns: Callable[[], tuple]) -> tuple | str | None:
        return None if cpp is None else (no_cpp or why() or fns())

    def on_triton(why: Callable[[], str | None], fns: Callable[[], tuple]) -> tuple | str | None:
        return None if triton is None else (no_triton or why() or fns())

    def none() -> None:
        return None

    if family == "linear":
        return {"cpp": on_cpp(none, lambda: (cpp.linear,)), "torch": (torch_ops.linear,)}
    if family == "fp8_linear":
        from_triton = lambda: _triton("triton_linear").unsupported(dtype, block)  # noqa: E731
        return {
            "triton": on_triton(from_triton, lambda: (triton.fp8_linear,)),
            "cpp": on_cpp(
                lambda: _not_multiple({"FP8 column block": block[1]}, 16), lambda: (cpp.fp8_linear,)
            ),
            "torch": (torch_ops.fp8_linear,),
        }
    if family == "rms_norm":
        widths = {"hidden_size": H, "q_lora_rank": cfg.q_lora_rank or 0, "kv_lora_rank": C}
        return {
            "triton": on_triton(none, lambda: (triton.rms_norm,)),
            "cpp": on_cpp(lambda: _not_multiple(widths, 8), lambda: (cpp.rms_norm,)),
            "torch": (torch_ops.rms_norm,),
        }
    if family == "add_rms_norm":
        return {
            "triton": on_triton(none, lambda: (triton.add_rms_norm,)),
            "cpp": on_cpp(lambda: _not_multiple({"hidden_size": H}, 8), lambda: (cpp.add_rms_norm,)),
            "torch": (torch_.add_rms_norm,),
        }
    if family == "rope":
        layout = None if cfg.rope_interleave else "interleaved rope only (this model's is rotate-half)"
        reference = torch_ops.rope_interleaved if cfg.rope_interleave else torch_ops.rope_neox
        return {"cpp": on_cpp(lambda: layout, lambda: (cpp.rope,)), "torch": (reference,)}
    if family == "route":
        router = f"{cfg.scoring_func} / {cfg.topk_method}"
        kind = None if router == "sigmoid / noaux_tc" else f"sigmoid / noaux_tc routers only (this: {router})"
        return {
            "cpp": on_cpp(lambda: kind or _not_multiple({"hidden_size": H}, 8), lambda: (cpp.router(cfg),)),
            "torch": (torch_.route,),
        }
    if family == "dense_ffn":
        widths = {}
        if cfg.first_k_dense_replace:
            widths["intermediate_size"] = cfg.intermediate_size
        if cfg.n_shared_experts:
            widths["the shared experts' width"] = I_moe * cfg.n_shared_experts

        def why() -> str | None:
            plain = _not_multiple({"hidden_size": H, **widths}, 8)
            return plain or (
                _fp8_weights_refuse(block, {"hidden_size": H}, widths) if t.fp8_linears else None
            )

        return {"cpp": on_cpp(why, lambda: (cpp.dense_ffn,)), "torch": (torch_.dense_ffn,)}
    if family == "expert_ffn":
        fp8_block = block if t.fp8_experts else None
        limit = cfg.swiglu_limit

        def why() -> str | None:
            if limit is not None and limit <= 0:
                return f"swiglu_limit {limit} (the kernel reads 0 as no clamp)"
            plain = _not_multiple({"hidden_size": H, "moe_intermediate_size": I_moe}, 8)
            fp8 = t.fp8_experts and _fp8_weights_refuse(
                block, {"hidden_size": H}, {"moe_intermediate_size": I_moe}
            )
            return plain or fp8 or None

        moe_why = lambda: _triton("triton_moe").unsupported(dtype, fp8_block)  # noqa: E731
        return {
            "triton": on_triton(moe_why, lambda: (triton.expert_ffn,)),
            "cpp": on_cpp(why, lambda: (cpp.expert_ffn,)),
            "torch": (torch_.expert_ffn,),
        }  # fmt: skip
    if family == "expert_dispatch":

        def why() -> str | None:
            if t.fp8_experts:
                return "experts kept FP8 (the expert kernel reads them)"
            if cfg.swiglu_limit is not None and cfg.swiglu_limit <= 0:
                return f"swiglu_limit {cfg.swiglu_limit}"
            return _not_multiple({"hidden_size": H, "moe_intermediate_size": I_moe}, 8)

        return {"cpp": on_cpp(why, lambda: (cpp.expert_dispatch,)), "torch": (None,)}
    if family == "absorb":
        return {
            "cpp": on_cpp(
                lambda: _not_multiple({"kv_lora_rank": C}, 8), lambda: (cpp.absorb_q, cpp.absorb_o)
            ),
            "torch": (torch_ops.absorb_q, torch_ops.absorb_o),
        }
    if family == "latent_to_cache":
        why = "V3.2's rows carry the indexer key" if cfg.has_indexer else None
        why = why or ("FP8 cache rows (quantised by torch)" if t.fp8_cache else None)
        return {
            "triton": on_triton(lambda: why, lambda: (triton.latent_to_cache,)),
            "torch": (torch_.latent_to_cache,),
        }
    if family == "mla_decode_layer":

        def why() -> str | None:
            if cfg.has_indexer:
                return "V3 layers only (V3.2's indexer)"
            if not cfg.rope_interleave:
                return "interleaved rope only"
            if t.fp8_cache:
                return "a float32 cache only (FP8 rows: the single kernels read them)"
            if triton is not None:
                return "the Triton kernels run here (the fused layer would bypass them)"
            plain = _not_multiple({"kv_lora_rank": C, "kv_lora_rank + qk_rope_head_dim": C + R,
                                   "q_lora_rank": cfg.q_lora_rank or 0}, 8)  # fmt: skip
            if plain or not t.fp8_linears:
                return plain
            K = {"hidden_size": H, "q_lora_rank": cfg.q_lora_rank or 0,
                 "heads x v_head_dim": cfg.num_attention_heads * cfg.v_head_dim}  # fmt: skip
            return _fp8_weights_refuse(block, K)

        return {"cpp": on_cpp(why, lambda: (cpp.mla_decode_layer,)), "unfused": (None,)}
    if family in ("mla_decode", "mla_sparse_decode", "mla_prefill"):
        Di = cfg.index_head_dim if cfg.has_indexer else 0
        W = fp8_row_bytes(C, R, Di) if t.fp8_cache else cfg.cache_dim
        cache_dtype = torch.uint8 if t.fp8_cache else dtype
        triton_why = lambda: _triton("triton_mla").unsupported(dtype, cache_dtype, C, R, W)  # noqa: E731
        if family == "mla_sparse_decode":
            return {
                "triton": on_triton(triton_why, lambda: (triton.sparse_decode,)),
                "torch": (torch_ops.sparse_decode,),
            }
        if family == "mla_prefill":
            return {
                "triton": on_triton(triton_why, lambda: (triton.mla_prefill,)),
                "torch": (torch_.mla_prefill,),
            }

        def cpp_why() -> str | None:
            plain = _not_multiple({"kv_lora_rank": C, "kv_lora_rank + qk_rope_head_dim": C + R}, 8)
            return plain or (
                _not_multiple({"kv_lora_rank (FP8 rows)": C}, FP8_GROUP) if t.fp8_cache else None
            )

        flash_why = None if flash is None else flashmla.unsupported(dtype, cache_dtype, C, R, W)
        if flash is not None and t.deterministic:
            flash_why = "deterministic (its split schedule follows the batch)"
        return {
            "flashmla": None if flash is None else (flash_why or (flash.mla_decode,)),
            "triton": on_triton(triton_why, lambda: (triton.mla_decode,)),
            "cpp": on_cpp(cpp_why, lambda: (cpp.mla_decode_fp8 if t.fp8_cache else cpp.mla_decode,)),
            "torch": (torch_ops.mla_decode,),
        }  # fmt: skip
    if family == "index_scores":
        Di = cfg.index_head_dim
        return {
            "cpp": on_cpp(lambda: _not_multiple({"index_head_dim": Di}, 8), lambda: (cpp.index_scores,)),
            "torch": (torch_ops.index_scores,),
        }
    raise KeyError(family)


def _triton(name: str):
    """One of the Triton kernel modules (imported only where triton is: they import it)."""
    from . import triton_linear, triton_mla, triton_moe

    return {"triton_linear": triton_linear, "triton_mla": triton_mla, "triton_moe": triton_moe}[name]


# ---------------------------------------------------------------------------------------------
# The torch implementations built from other families' choices
# ---------------------------------------------------------------------------------------------
class _TorchImpls:
    """torch_ops' composite implementations, calling the kernels `k` chose for their parts (the
    linears of a dense MLP, the RMSNorm after an add, ...)."""

    def __init__(self, k: Kernels, cfg: ModelConfig):
        self.k, self.cfg = k, cfg

    def add_rms_norm(self, h, delta, weight, eps):
        return torch_ops.add_rms_norm(h, delta, weight, eps, self.k.rms_norm)

    def route(self, x, gate_w, bias):
        return torch_ops.route(x, gate_w, bias, self.cfg, self.k.linear)

    def dense_ffn(self, x, w13, w2):
        return torch_ops.dense_ffn(x, w13, w2, self.k.linear)

    def expert_ffn(self, x, slot, weight, w13, w2, out=None, swiglu_limit=None, w13_scale=None, w2_scale=None,
                   fp8_block=None):  # fmt: skip
        return torch_ops.expert_ffn(x, slot, weight, w13, w2, out, swiglu_limit, w13_scale, w2_scale, fp8_block,
                                    linear=self.k.linear)  # fmt: skip

    def latent_to_cache(self, kv, q_pe, norm_weight, cos, sin, slot_mapping, cache, eps, extra=None):
        quantize = quantize_latent_rows if cache.dtype == torch.uint8 else None  # (FP8 rows)
        return torch_ops.latent_to_cache(kv, q_pe, norm_weight, cos, sin, slot_mapping, cache, eps, extra,
                                         norm=self.k.rms_norm, rope=self.k.rope, quantize=quantize)  # fmt: skip

    def mla_prefill(self, q_nope, q_pe, cache, blocks, L, kv_b, C, scale):
        return torch_ops.prefill_attention(q_nope, q_pe, cache, blocks, L, kv_b, C, scale, self.k.linear)
