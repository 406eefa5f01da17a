"""CPU kernels for decode-sized work, where torch's eager ops are slow or too many.

- `linear`: a small-batch fp32 linear. At decode sizes a linear is a weight read: x [M <= 8, K]
  against w [N, K]. MKL runs those matrix-vector products on one thread here (10-11 GB/s from
  memory on this box whatever torch's thread count, against ~17-20 GB/s with both cores
  reading) and gets slower per byte as M grows past 1. The kernel streams each weight row once,
  dots it with every x row while it sits in L1, and splits the rows of w over torch's intra-op
  threads: 1.3-1.8x MKL for M <= 8 on 512-wide experts (measured when it still ran on one thread).
- `expert_ffn`: a layer's routed experts for a few tokens in one call (gate/up, SwiGLU, down,
  the weighted sum), instead of ~15 torch ops per busy expert; each expert weight row is read
  once for all of its slot's rows (gate and up rows in one pass), which keeps a batch-32 step
  (~3 rows per slot) near the box's read bandwidth. `dense_ffn`: a dense MLP or the shared
  experts through the same kernel (one slot).
- `mla_decode`: MLA decode attention straight from the paged cache (no gather of the padded
  context, no padding, one call instead of ~10 ops per layer); `mla_decode_layer`: a whole MLA
  layer of a decode-only step in one call (model.mla_forward's arithmetic, run from C++).
- `route_sigmoid` (the V3 router), `rope_interleaved`, `rms_norm`, `add_rms_norm` (the residual
  add and the next norm): one op instead of 2-20.

`linear` and `expert_ffn` also take bf16 weights with fp32 inputs (`EngineConfig.weight_dtype`,
as llama.cpp's f16/bf16 files: weights stored in 16 bits, everything else fp32): each weight is
widened in registers, exactly, so the result is the fp32 kernel's on the bf16-rounded weights,
bit for bit, from half the memory. Beyond MAX_ROWS rows the weight is widened by torch for the
call (MKL on the widened copy beats the kernel there).

Every output element is one dot product or sum in a fixed order, so a token's result does not
depend on how many tokens share the call (batch invariance). The dot products use explicit fused
multiply-adds, the same in every loop; the compiler contracts nothing itself (-ffp-contract=off),
since it would contract the 4-row and the 1-row loops differently. With bf16 weights (where the
widening makes the experts compute-bound) the expert kernel also prefetches the weight rows of
the work item 4 ahead (with fp32 weights the hardware prefetcher does as well alone).

The extension is compiled on first use with torch.utils.cpp_extension (a C++ compiler and
ninja; ~1 min once, cached under $MOE_CLUSTER_CACHE/torch_extensions). Without them, or with
MOE_CPU_KERNELS=0, `unavailable()` says why and selection (select.py) takes no kernel of here.

`CppKernels` holds them as the implementations select.py binds, one method per kernel family.
Whether a family's kernel takes a model at all (fp32 activations on the CPU, widths that are
multiples of 8, ...) is decided once, at selection; what is left per call is each kernel's own
size rule, stated on its method (e.g. the linear's: up to MAX_ROWS rows, or TILE_ROWS with K %
16 == 0 and K >= 256, the kernel; beyond, MKL): a choice of algorithm by batch size, not a
fallback.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from services.model.fp8 import Fp8Weight

from . import torch_ops

log = logging.getLogger(__name__)

MAX_ROWS = 8  # small_linear streams each weight row once for up to this many rows (a weight read)
TILE_ROWS = 32  # and up to this many (K % 16 == 0, K >= 256) in register tiles (1.2-1.8x MKL's
# small-M GEMMs here); MKL beyond (csrc/attention.cpp's `lin` uses the same bounds)
FP8_TILE_ROWS = 64  # linears kept FP8: register tiles up to this many rows (decode batches; MKL
# would need the whole weight dequantised per call; `lin` again the same)
EXPERT_ROWS = 24  # the expert kernel up to this many tokens, or rows per busy slot on average: on a
# 2-core AVX-512 VM it beat MKL's grouped matmuls 1.4-1.8x at 12-16 rows per slot and broke even
# near 32 (small preset, 32-512 tokens; MKL ahead from 64)

# the C++ side, in csrc/ beside this file: one translation unit, in this order (each file uses the
# helpers of those before it)
SOURCES = ("linear.cpp", "experts.cpp", "attention.cpp")
_SOURCE = "".join((Path(__file__).parent / "csrc" / name).read_text() for name in SOURCES)

_lock = threading.Lock()
_state: dict = {}  # "module": the compiled extension (None when unavailable), "reason": why not
# (the build of this process, like an import: made once, never changed after)


def _module():
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            _state["module"], _state["reason"] = _build()
    return _state["module"]


def unavailable() -> str | None:
    """Why the kernels are not built here (None: they are; building them on first call)."""
    return None if _module() is not None else _state["reason"]


def _build():
    """(the extension, None), or (None, why not)."""
    if os.environ.get("MOE_CPU_KERNELS", "1") == "0":
        return None, "MOE_CPU_KERNELS=0"
    try:
        from torch.utils.cpp_extension import load_inline

        # -march=native: one build per CPU kind (a cache shared by unlike nodes must not mix them),
        # and one per source (two checkouts of different versions sharing a cache must not either)
        source = hashlib.sha1(_SOURCE.encode()).hexdigest()[:8]
        tag = f"torch{torch.__version__.replace('+', '_')}_{_cpu_tag()}_{source}"
        build_dir = _cache_root() / "torch_extensions" / f"cpu_kernels_{tag}"
        build_dir.mkdir(parents=True, exist_ok=True)
    except Exception as e:  # no torch.utils.cpp_extension
        log.warning("CPU kernels unavailable (%s: %s); using torch ops", type(e).__name__, e)
        return None, f"not built ({type(e).__name__}: {e})"
    # -fopenmp: at::parallel_for is an inline template that only splits work over torch's
    # threads when the extension itself is compiled with OpenMP (without it every kernel runs on
    # one thread). Linking it loads no second runtime: torch's bundled libgomp.so.1 is the one
    # already loaded under that name. A compiler without OpenMP gets the one-thread build.
    for omp in (["-fopenmp"], []):
        try:
            module = load_inline("moe_cpu_kernels", cpp_sources=_SOURCE, functions=FUNCTIONS,
                                 extra_cflags=["-O3", "-march=native", "-ffp-contract=off", *omp],
                                 extra_ldflags=omp, build_directory=str(build_dir))  # fmt: skip
            return module, None
        except Exception as e:  # no compiler, no ninja, an unsupported CPU: torch's own ops
            error = e
    log.warning("CPU kernels unavailable (%s: %s); using torch ops", type(error).__name__, error)
    return None, f"not built ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"


def _cache_root() -> Path:
    """The moe-cluster cache the builds are kept in (the same root as presets.cache_root)."""
    return Path(os.environ.get("MOE_CLUSTER_CACHE", Path.home() / ".cache" / "moe-cluster"))


def _cpu_tag() -> str:
    """A short hash of this CPU's model and instruction-set flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.machine(), platform.processor()]
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:10]


FUNCTIONS = [
    "small_linear",
    "rms_norm",
    "expert_ffn",
    "mla_decode",
    "rope_interleaved",
    "route_sigmoid",
    "mla_decode_layer",
    "absorb_q",
    "absorb_o",
    "dense_ffn",
    "add_rms_norm",
    "expert_ffn_fp8",
    "small_linear_fp8",
    "expert_dispatch",
    "mla_decode_fp8",
    "index_scores",
    "dispatch_rows",
    "pack_share",
]


def available() -> bool:
    """Whether the kernels are built (building them on first call)."""
    return _module() is not None


def _few_rows_per_slot(slot: torch.Tensor) -> bool:
    """Whether the busy slots of slot [T, K] get at most EXPERT_ROWS rows on average (where the
    expert kernel beats MKL's blocked matmuls)."""
    busy = slot[slot >= 0]
    return busy.numel() <= EXPERT_ROWS * torch.unique(busy).numel()


_NO_ROWS = torch.empty(0, dtype=torch.long)
_EMPTY = torch.empty(0)


class CppKernels:
    """The C++ kernels of this process's build as kernel-family implementations (select.py binds
    the methods). `kernels` is the select.Kernels they are bound into: where a method's size rule
    leaves a call to other kernels (a prefill's linears), it calls that object's choice.

    What selection has checked for every method: fp32 activations on the CPU, the model's widths
    (multiples of 8, of 16 for FP8 weights), weights fp32 or bf16 (or FP8 with their fp32 scales),
    int64 block tables. What each method still decides per call is its size rule."""

    def __init__(self, module, kernels):
        # (the extension's functions are looked up on it per call, like any module's: what
        # observes them, a test's patch, sees every call)
        self.k, self._m = kernels, module

    # ---- linears -----------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, w, bias) for x [M, K] fp32, w [N, K] fp32 or bf16. Size rule: M <=
        MAX_ROWS (K % 8 == 0), or M <= TILE_ROWS with K % 16 == 0 and K >= 256: the kernel;
        otherwise MKL (F.linear, a bf16 weight widened for the call)."""
        if x.dim() == 2 and (  # (spelled out: this runs up to ~60 times per decode step)
            x.shape[1] % 8 == 0
            if x.shape[0] <= MAX_ROWS
            else x.shape[0] <= TILE_ROWS and x.shape[1] % 16 == 0 and x.shape[1] >= 256
        ):
            return self._m.small_linear(
                x.contiguous(), w.contiguous(), None if bias is None else bias.contiguous()
            )
        return F.linear(x, w if w.dtype is x.dtype else w.to(x.dtype), bias)

    def fp8_linear(self, x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`linear` with a weight kept FP8 (fp8.Fp8Weight), with the dequantised weight's values.
        Size rule: up to MAX_ROWS rows, or FP8_TILE_ROWS with K >= 256 (K % 16 == 0), the kernel
        (each FP8 row dequantised as it is read; up to TILE_ROWS rows the bits of `linear` on the
        dequantised weight, beyond them the register tiles' sums where `linear` has MKL's);
        beyond (prefill) torch_ops.fp8_linear, the weight dequantised a few row blocks at a time."""
        K = w.shape[1]
        M = x.shape[0]
        if x.dim() == 2 and K % 16 == 0 and (M <= MAX_ROWS or M <= FP8_TILE_ROWS and K >= 256):
            bn, bk = w.block
            return self._m.small_linear_fp8(x.contiguous(), w.weight.contiguous(), w.scale.contiguous(), bn, bk,
                                          None if bias is None else bias.contiguous())  # fmt: skip
        return torch_ops.fp8_linear(x, w, bias)

    # ---- norms, rope, router, MLPs -------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """torch_ops.rms_norm over the last dim of x [..., K] in one call."""
        if x.numel() == 0:
            return torch.empty_like(x)
        K = x.shape[-1]
        rows = x.reshape(-1, K) if x.stride(-1) == 1 else x.contiguous().view(-1, K)
        return self._m.rms_norm(rows, weight.contiguous(), eps).view(x.shape)

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, rms_norm(h + delta)) for h, delta [M, K] in one call: the residual stream's
        update and the next sublayer's input (the bits of the add, then `rms_norm`)."""
        if h.numel() == 0:
            return h + delta, torch.empty_like(h)
        h, x = self._m.add_rms_norm(h.contiguous(), delta.contiguous(), weight.contiguous(), eps)
        return h, x

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """torch_ops.rope_interleaved for x [T, R] or [T, N, R] (any strides but the last dim's)
        with cos / sin [T, R/2], in one call."""
        flat = x if x.dim() == 3 else x.reshape(x.shape[0], -1, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        return self._m.rope_interleaved(flat, cos.contiguous(), sin.contiguous()).view(x.shape)

    def router(self, cfg):
        """route(x, gate_w, bias): torch_ops.route for cfg's sigmoid scores with noaux_tc in one
        call (x [T, H], gate_w [E, H], bias [E] or None) -> (topk_idx [T, K] int64, best first;
        topk_weight [T, K] fp32)."""
        module, empty = self._m, _EMPTY
        args = (
            cfg.n_group,
            cfg.topk_group,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
        )
        top_k = cfg.num_experts_per_tok

        def route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None):
            if x.shape[0] == 0:
                return torch.empty(0, top_k, dtype=torch.long), torch.empty(0, top_k)
            idx, weight = module.route_sigmoid(
                x.contiguous(), gate_w.contiguous(), empty if bias is None else bias.contiguous(), *args
            )
            return idx, weight

        return route

    def dense_ffn(self, x: torch.Tensor, w13, w2) -> torch.Tensor:
        """torch_ops.dense_ffn (the dense MLP, the shared experts). Size rule: 1 to MAX_ROWS rows,
        the expert kernel with one slot holding w13 [2I, H] / w2 [H, I] and weight 1 for every
        token (the same sums as a dense MLP; kept FP8: `expert_ffn_fp8`); more (prefill), the two
        linears of the chosen `linear`."""
        T = x.shape[0]
        if not 0 < T <= MAX_ROWS:
            return torch_ops.dense_ffn(x, w13, w2, self.k.linear)
        if type(w13) is Fp8Weight:
            slot, weight = torch.zeros(T, 1, dtype=torch.long), torch.ones(T, 1)
            return self._experts(x, slot, weight, w13.weight[None], w2.weight[None], None, w13.scale[None],
                                 w2.scale[None], w13.block)  # fmt: skip
        return self._m.dense_ffn(x.contiguous(), w13.contiguous(), w2.contiguous())

    # ---- routed experts ------------------------------------------------------------------------
    def _experts(self, x, slot, weight, w13, w2, swiglu_limit, w13_scale, w2_scale, block) -> torch.Tensor:
        """The expert kernel: x [T, H], slot [T, K] int64 (-1 = none), weight [T, K] fp32, w13 [S,
        2I, H], w2 [S, H, I] (fp32, or both bf16; or FP8 with w13_scale / w2_scale and block (bn,
        bk): each row dequantised as it is read, to fp8.dequantize_fp8_blocks's values, so the
        result is the kernel's on the dequantised weights, bit for bit) -> fp32 [T, H]."""
        limit = 0.0 if swiglu_limit is None else float(swiglu_limit)  # (the kernel reads 0 as "no clamp")
        args = (x.contiguous(), slot.contiguous(), weight.contiguous(), w13.contiguous(), w2.contiguous())
        if w13_scale is not None:
            bn, bk = block
            return self._m.expert_ffn_fp8(*args, w13_scale.contiguous(), w2_scale.contiguous(), bn, bk, limit)
        return self._m.expert_ffn(*args, limit)

    def expert_ffn(self, x, slot, weight, w13, w2, out=None, swiglu_limit=None, w13_scale=None, w2_scale=None,
                   fp8_block=None) -> torch.Tensor:  # fmt: skip
        """torch_ops.expert_ffn (the routed experts). Size rule: decode sizes (at most EXPERT_ROWS
        tokens, or at most EXPERT_ROWS rows per busy slot on average), the whole layer in one call
        (each expert weight row read once for all of its slot's rows); beyond, torch_ops's
        grouped matmuls (FP8 experts: their slots dequantised per call, then this method)."""
        if slot.shape[0] <= EXPERT_ROWS or _few_rows_per_slot(slot):
            y = self._experts(x, slot, weight, w13, w2, swiglu_limit, w13_scale, w2_scale, fp8_block)
            return y if out is None else out.copy_(y)
        return torch_ops.expert_ffn(x, slot, weight, w13, w2, out, swiglu_limit, w13_scale, w2_scale, fp8_block,
                                    linear=self.k.linear, plain=self.expert_ffn)  # fmt: skip

    def expert_dispatch(self, x, slot, weight, w13, w2, out, counts, swiglu_limit=None, rows=None) -> bool:
        """An expert worker's Dispatch at decode sizes in one call, straight from the request: out
        [T, H] fp32 = expert_ffn(x, slot, weight, w13, w2) for slot [T, K] int32 local slots (-1 =
        none), checked (ValueError, nothing written: a slot outside [-1, S), a weight not finite),
        and counts [S] int64 = the pairs each slot computed. rows [S] int64: the row of w13 / w2
        [P, ...] each slot reads (None: slot s is row s, P == S). Its rule (False, nothing done):
        buffers that are not aligned to their dtype (a gRPC payload's views can be), weights not
        contiguous, or beyond decode sizes (more than EXPERT_ROWS tokens and rows per busy slot):
        then the store's own checks and the expert kernel."""
        if any(t.data_ptr() % t.element_size() for t in (x, slot, weight, out)):
            return False
        if not (w13.is_contiguous() and w2.is_contiguous()):
            return False
        limit = 0.0 if swiglu_limit is None else float(swiglu_limit)
        rows = _NO_ROWS if rows is None else rows.contiguous()
        return self._m.expert_dispatch(x.contiguous(), slot.contiguous(), weight.contiguous(), w13, w2, out, counts,
                                     rows, EXPERT_ROWS, limit)  # fmt: skip

    # ---- MLA -----------------------------------------------------------------------------------
    def mla_decode(self, q: torch.Tensor, cache: torch.Tensor, dec, C: int, scale: float) -> torch.Tensor:
        """MLA decode attention from the paged cache: q [B, N, C+R] (latent query), cache [blocks,
        64, 1, W] fp32, dec a batch.DecodeRows (table [B, max_blocks] / lens [B] int64) -> o [B, N,
        C], the softmax(scale * q . row[:C+R])-weighted sum of the rows' first C values, read in
        place."""
        return self._m.mla_decode(
            q.contiguous(), cache, dec.table.contiguous(), dec.lens.contiguous(), C, scale
        )

    def mla_decode_fp8(self, q: torch.Tensor, cache: torch.Tensor, dec, C: int, scale: float) -> torch.Tensor:
        """`mla_decode` over FP8 latent rows (uint8 cache, kv_cache.fp8_row_bytes), dequantized as
        read."""
        return self._m.mla_decode_fp8(q.contiguous(), cache, dec.table.contiguous(), dec.lens.contiguous(), C,
                                    q.shape[-1] - C, scale)  # fmt: skip

    def absorb_q(self, q_nope: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
        """torch_ops.absorb_q: q_nope [T, N, D] @ kv_b[:, :D] -> [T, N, C]. Size rule: up to
        MAX_ROWS tokens, per-head dot products (torch.bmm runs a small GEMM per head); more,
        torch.bmm."""
        if q_nope.shape[0] > MAX_ROWS:
            return torch_ops.absorb_q(q_nope, kv_b)
        q_nope = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
        return self._m.absorb_q(q_nope, kv_b, q_nope.shape[-1])

    def absorb_o(self, o_lat: torch.Tensor, kv_b: torch.Tensor, D: int) -> torch.Tensor:
        """torch_ops.absorb_o: o_lat [T, N, C] through kv_b[:, D:] -> [T, N, V]; `absorb_q`'s size
        rule."""
        if o_lat.shape[0] > MAX_ROWS:
            return torch_ops.absorb_o(o_lat, kv_b, D)
        return self._m.absorb_o(o_lat.contiguous(), kv_b, D)

    def mla_decode_layer(
        self, x, w, cos_sin, cache, slot_mapping, table, lens, cfg, eps: float
    ) -> torch.Tensor:
        """model.mla_forward for a decode-only step of a V3 layer (no indexer, interleaved rope) in
        one call: x [T, H] fp32, w a weights.MLAWeights (linears fp32 / bf16, or all kept FP8 in
        one block shape), cos_sin [T, R/2] each, cache [blocks, 64, 1, C+R] fp32, table [T,
        max_blocks] / lens [T] int64 (batch.DecodeRows); the rows of this step are written at
        slot_mapping [T]; eps of the latent norms."""
        C, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        linears = (w.q_a, w.q_b, w.q_proj, w.kv_a, w.o)
        cos, sin = cos_sin
        scales, (bn, bk) = [], (0, 0)
        if type(w.kv_a) is Fp8Weight:  # (kept FP8: their scales, an empty tensor for an absent one)
            scales = [_EMPTY if t is None else t.scale.contiguous() for t in linears]
            bn, bk = w.kv_a.block
        q_a, q_b, q_proj, kv_a, o = (t.weight if type(t) is Fp8Weight else t for t in linears)
        return self._m.mla_decode_layer(x, q_a, w.q_a_bias, w.q_a_norm, q_b, q_proj, kv_a, w.kv_a_bias,
                                      w.kv_a_norm, w.kv_b, o, w.o_bias, cos.contiguous(), sin.contiguous(),
                                      cache, slot_mapping, table, lens, cfg.qk_nope_head_dim, R, C,
                                      cfg.v_head_dim, eps, cfg.softmax_scale, scales, bn, bk)  # fmt: skip

    # ---- indexer -------------------------------------------------------------------------------
    def index_scores(
        self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        """torch_ops.index_scores in one call (no [Q, Hi, L] temporaries): q [Q, Hi, Di], w [Q,
        Hi], keys [L, Di] (one shared context) or [Q, L, Di], lens [Q] int64 -> [Q, L] fp32, -inf
        beyond each query's tokens."""
        keys = keys if keys.dim() == 3 else keys.unsqueeze(0)
        return self._m.index_scores(q.contiguous(), w.contiguous(), keys.contiguous(), lens.contiguous(),
                                  q.shape[-1] ** -0.5)  # fmt: skip


# ---- the data plane's packing (services/dataplane/remote_experts.py) --------------------------
def dispatch_rows(slot: torch.Tensor, S: int, W: int) -> list[int] | None:
    """The rows of a dispatch each of W workers gets (a row counts for a worker when any of its
    pairs is there): slot [T, K] int64 global slots (-1: none), S per worker. None without kernels."""
    module = _module()
    if module is None or slot.dtype != torch.int64 or not slot.is_cpu:
        return None
    return module.dispatch_rows(slot.contiguous(), S, W).tolist()


def pack_share(x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, S: int, w: int, hidden: torch.Tensor,
               local: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:  # fmt: skip
    """Worker w's request of a dispatch written straight into its buffers (one pass instead of
    ~10 torch ops): hidden [Tw, H] the rows of x [T, H] with a pair on w, local [Tw, K] int32
    their slots on w (-1 elsewhere), weights [Tw, K] fp32 (0 elsewhere); returns the rows [Tw]
    int64. None where it does not apply (no kernels, not CPU, misaligned buffers)."""
    aligned = all(t.data_ptr() % t.element_size() == 0 for t in (hidden, local, weights))
    if not (
        x.is_cpu and hidden.is_cpu and aligned and weight.dtype == torch.float32 and slot.dtype == torch.int64
    ):
        return None
    module = _module()
    if module is None:
        return None
    return module.pack_share(
        x.contiguous(), slot.contiguous(), weight.contiguous(), S, w, hidden, local, weights
    )
