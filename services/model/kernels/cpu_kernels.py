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
bit for bit, from half the memory. Beyond MAX_ROWS rows, and without the kernels, the weight is
widened by torch for the call (MKL on the widened copy beats the kernel there).

Every output element is one dot product or sum in a fixed order, so a token's result does not
depend on how many tokens share the call (batch invariance). The dot products use explicit fused
multiply-adds, the same in every loop; the compiler contracts nothing itself (-ffp-contract=off),
since it would contract the 4-row and the 1-row loops differently. With bf16 weights (where the
widening makes the experts compute-bound) the expert kernel also prefetches the weight rows of
the work item 4 ahead (with fp32 weights the hardware prefetcher does as well alone).

The extension is compiled on first use with torch.utils.cpp_extension (a C++ compiler and
ninja; ~1 min once, cached under $MOE_CLUSTER_CACHE/torch_extensions). Without them, or with
MOE_CPU_KERNELS=0, every function here falls back to torch (the callers' torch path).
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

from services.model import fp8
from services.model.fp8 import Fp8Weight

from .gpu import TRITON

log = logging.getLogger(__name__)

MAX_ROWS = 8  # small_linear streams each weight row once for up to this many rows (a weight read)
TILE_ROWS = 32  # and up to this many (K % 16 == 0, K >= 256) in register tiles (1.2-1.8x MKL's
# small-M GEMMs here); MKL beyond (csrc/attention.cpp's `lin` uses the same bounds)
FP8_TILE_ROWS = 64  # linears kept FP8: register tiles up to this many rows (decode batches; MKL
# would need the whole weight dequantised per call; `lin` again the same)

# the C++ side, in csrc/ beside this file: one translation unit, in this order (each file uses the
# helpers of those before it)
SOURCES = ("linear.cpp", "experts.cpp", "attention.cpp")
_SOURCE = "".join((Path(__file__).parent / "csrc" / name).read_text() for name in SOURCES)

_lock = threading.Lock()
_state: dict = {}  # "module": the compiled extension, or None when unavailable


def _module():
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
    return _state["module"]


def _build():
    if os.environ.get("MOE_CPU_KERNELS", "1") == "0":
        return None
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
        return None
    # -fopenmp: at::parallel_for is an inline template that only splits work over torch's
    # threads when the extension itself is compiled with OpenMP (without it every kernel runs on
    # one thread). Linking it loads no second runtime: torch's bundled libgomp.so.1 is the one
    # already loaded under that name. A compiler without OpenMP gets the one-thread build.
    for omp in (["-fopenmp"], []):
        try:
            return load_inline("moe_cpu_kernels", cpp_sources=_SOURCE, functions=FUNCTIONS,
                               extra_cflags=["-O3", "-march=native", "-ffp-contract=off", *omp],
                               extra_ldflags=omp, build_directory=str(build_dir))  # fmt: skip
        except Exception as e:  # no compiler, no ninja, an unsupported CPU: torch's own ops
            error = e
    log.warning("CPU kernels unavailable (%s: %s); using torch ops", type(error).__name__, error)
    return None


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


def _fp32_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype is torch.float32 and t.is_cpu) for t in tensors)


def _weights_cpu(*tensors: torch.Tensor | None) -> bool:
    """Linear weights the kernels take: fp32 or bf16 tensors on CPU."""
    return all(
        t is None or (type(t) is torch.Tensor and t.dtype in (torch.float32, torch.bfloat16) and t.is_cpu)
        for t in tensors
    )


def _paged_cache_ok(cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, fp8: bool = False) -> bool:
    """A CPU cache the kernels can address directly, fp32 rows (or with `fp8`, FP8 latent rows:
    uint8), with int64 block tables / lengths."""
    return (
        cache.is_cpu
        and cache.dtype is (torch.uint8 if fp8 else torch.float32)
        and cache.is_contiguous()
        and table.dtype == torch.int64
        and lens.dtype == torch.int64
    )


def linear(x: torch.Tensor, w: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias), computed in x's dtype (w may be stored narrower, e.g. bf16 under fp32
    x, or kept FP8: `fp8_linear`); fp32 x [M, K] on CPU with fp32 or bf16 w goes through the kernel
    for M <= MAX_ROWS (K % 8 == 0) and M <= TILE_ROWS (K % 16 == 0, K >= 256)."""
    if type(w) is Fp8Weight:
        return fp8_linear(x, w, bias)
    if (  # (spelled out: this runs ~60 times per decode step)
        x.dtype is torch.float32
        and (w.dtype is torch.float32 or w.dtype is torch.bfloat16)
        and x.is_cpu
        and x.dim() == 2
        and (
            x.shape[1] % 8 == 0
            if x.shape[0] <= MAX_ROWS
            else x.shape[0] <= TILE_ROWS and x.shape[1] % 16 == 0 and x.shape[1] >= 256
        )
        and (bias is None or bias.dtype is torch.float32)
    ):
        module = _state.get("module") or _module()
        if module is not None:
            return module.small_linear(
                x.contiguous(), w.contiguous(), None if bias is None else bias.contiguous()
            )
    return F.linear(x, w if w.dtype is x.dtype else w.to(x.dtype), bias)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` with a weight kept FP8 (fp8.Fp8Weight), computed in x's dtype with the
    dequantised weight's values: the Triton kernel on CUDA (triton_linear.py); on an fp32 CPU the
    C++ kernel up to FP8_TILE_ROWS rows (each FP8 row dequantised as it is read; up to TILE_ROWS
    rows the bits of `linear` on the dequantised weight, beyond them the register tiles' sums where
    `linear` has MKL's); beyond (prefill) the weight dequantised FP8_DEQUANT_BYTES of rows at a
    time, for F.linear."""
    N, K = w.shape
    y = TRITON.fp8_linear(x, w.weight, w.scale, w.block, bias)  # CUDA
    if y is not None:
        return y
    bn, bk = w.block
    if (
        x.dtype is torch.float32
        and x.dim() == 2
        and K % 16 == 0
        and (x.shape[0] <= MAX_ROWS or x.shape[0] <= FP8_TILE_ROWS and K >= 256)
        and bk % 16 == 0
        and _fp32_cpu(x, w.scale, bias)
        and w.weight.is_cpu
    ):
        module = _state.get("module") or _module()
        if module is not None:
            return module.small_linear_fp8(x.contiguous(), w.weight.contiguous(), w.scale.contiguous(), bn, bk,
                                           None if bias is None else bias.contiguous())  # fmt: skip
    rows = max(bn, fp8.FP8_DEQUANT_BYTES // (4 * K) // bn * bn)  # whole row blocks per chunk
    parts = [
        F.linear(
            x, w.dequantize(slice(n, n + rows)).to(x.dtype), None if bias is None else bias[n : n + rows]
        )
        for n in range(0, N, rows)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(h + delta, rms_norm(h + delta)) for fp32 CPU h, delta [M, K] (K % 8 == 0) in one call:
    the residual stream's update and the next sublayer's input. None where the kernel does not
    apply."""
    if (
        h.dim() != 2
        or h.shape != delta.shape
        or not (h.is_contiguous() and delta.is_contiguous())
        or h.shape[1] % 8
        or h.numel() == 0
        or weight.numel() != h.shape[1]
        or not _fp32_cpu(h, delta, weight)
    ):
        return None
    module = _state.get("module") or _module()
    if module is None:
        return None
    h, x = module.add_rms_norm(h, delta, weight.contiguous(), eps)
    return h, x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * (x * rsqrt(mean(x^2) + eps)) over the last dim of fp32 CPU x [..., K] (K % 8 ==
    0); None where the kernel does not apply (the caller computes it with torch)."""
    K = x.shape[-1]
    if K % 8 or not _fp32_cpu(x, weight) or x.numel() == 0 or x.stride(-1) != 1:
        return None
    module = _module()
    if module is None:
        return None
    return module.rms_norm(x.reshape(-1, K), weight.contiguous(), eps).view(x.shape)


def expert_ffn(
    x: torch.Tensor,
    slot: torch.Tensor,
    weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    swiglu_limit: float | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    fp8_block: tuple[int, int] | None = None,
) -> torch.Tensor | None:
    """The routed experts of a few tokens in one call: x [T, H], slot [T, K] int64 (-1 = none),
    weight [T, K] fp32, w13 [S, 2I, H], w2 [S, H, I] (fp32, or both bf16) -> fp32 [T, H] (see
    layers.grouped_expert_ffn for the math). FP8 experts kept FP8 (float8_e4m3fn, with w13_scale /
    w2_scale and fp8_block (bn, bk): bn divides I, bk % 16 == 0, H and I % 16 == 0): each row is
    dequantized as it is read, to the values of fp8.dequantize_fp8_blocks, so the result
    is this kernel's on the dequantized weights, bit for bit. None where the kernel does not apply."""
    H, I = x.shape[1], w2.shape[2]
    if H % 8 or I % 8 or slot.dtype != torch.int64 or not _fp32_cpu(x, weight):
        return None
    if swiglu_limit is not None and swiglu_limit <= 0:  # (the kernel reads 0 as "no clamp")
        return None
    fp8 = w13_scale is not None
    if fp8:
        bn, bk = fp8_block
        if I % bn or bk % 16 or H % 16 or I % 16 or not _fp32_cpu(w13_scale, w2_scale) or not w13.is_cpu:
            return None
    elif not _weights_cpu(w13, w2) or w13.dtype is not w2.dtype:
        return None
    module = _module()
    if module is None:
        return None
    limit = 0.0 if swiglu_limit is None else float(swiglu_limit)
    args = (x.contiguous(), slot.contiguous(), weight.contiguous(), w13.contiguous(), w2.contiguous())
    if fp8:
        return module.expert_ffn_fp8(*args, w13_scale.contiguous(), w2_scale.contiguous(), bn, bk, limit)
    return module.expert_ffn(*args, limit)


def expert_dispatch(
    x: torch.Tensor,
    slot: torch.Tensor,
    weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor,
    counts: torch.Tensor,
    swiglu_limit: float | None = None,
    rows: torch.Tensor | None = None,
) -> bool:
    """An expert worker's Dispatch at decode sizes in one call, straight from the request: out
    [T, H] fp32 = expert_ffn(x, slot, weight, w13, w2) for slot [T, K] int32 local slots (-1 =
    none), checked (ValueError, nothing written: a slot outside [-1, S), a weight not finite), and
    counts [S] int64 = the pairs each slot computed. rows [S] int64: the row of w13 / w2 [P, ...]
    each slot reads (None: slot s is row s, P == S). False (nothing done) where the kernel does
    not apply: not fp32 / bf16 on the CPU, no kernels, misaligned buffers (a gRPC payload's views
    can be), or too many rows per slot (grouped matmuls)."""
    H, I = x.shape[1], w2.shape[2]
    if H % 8 or I % 8 or slot.dtype != torch.int32 or not _fp32_cpu(x, weight, out):
        return False
    if any(t.data_ptr() % t.element_size() for t in (x, slot, weight, out)):
        return False
    if (
        (swiglu_limit is not None and swiglu_limit <= 0)
        or not _weights_cpu(w13, w2)
        or w13.dtype is not w2.dtype
    ):
        return False
    module = _module()
    if module is None or not (w13.is_contiguous() and w2.is_contiguous()):
        return False
    limit = 0.0 if swiglu_limit is None else float(swiglu_limit)
    rows = _NO_ROWS if rows is None else rows.contiguous()
    return module.expert_dispatch(x.contiguous(), slot.contiguous(), weight.contiguous(), w13, w2, out, counts,
                                  rows, MAX_ROWS, limit)  # fmt: skip


_NO_ROWS = torch.empty(0, dtype=torch.long)


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


def dense_ffn(
    x: torch.Tensor, w13: torch.Tensor | Fp8Weight, w2: torch.Tensor | Fp8Weight
) -> torch.Tensor | None:
    """layers.dense_ffn for decode-sized fp32 CPU x [T <= MAX_ROWS, H]: the C++ `dense_ffn`, the
    expert kernel with one slot holding w13 [2I, H] / w2 [H, I] and weight 1 for every token (the
    same sums as a dense MLP; kept FP8: `expert_ffn_fp8`); None where the kernel does not apply."""
    if type(w13) is Fp8Weight and type(w2) is Fp8Weight:
        if x.dim() != 2 or not 0 < x.shape[0] <= MAX_ROWS or w13.block != w2.block or not _fp32_cpu(x):
            return None
        T = x.shape[0]
        return expert_ffn(x, torch.zeros(T, 1, dtype=torch.long), torch.ones(T, 1), w13.weight[None], w2.weight[None],
                          None, w13.scale[None], w2.scale[None], w13.block)  # fmt: skip
    if (
        x.dim() != 2
        or not 0 < x.shape[0] <= MAX_ROWS
        or x.shape[1] % 8
        or w2.shape[1] % 8
        or not _fp32_cpu(x)
        or not _weights_cpu(w13, w2)
        or w13.dtype is not w2.dtype
    ):
        return None
    module = _state.get("module") or _module()
    if module is None:
        return None
    return module.dense_ffn(x.contiguous(), w13.contiguous(), w2.contiguous())


def mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    latent_dim: int,
    scale: float,
) -> torch.Tensor | None:
    """MLA decode attention from the paged cache: q [B, N, C+R] (latent query), cache [blocks, 64,
    1, W], table [B, max_blocks] int64, lens [B] int64 -> o [B, N, C], the softmax(scale * q .
    row[:C+R])-weighted sum of the rows' first C = latent_dim values. None where the kernel does
    not apply."""
    fp8 = cache.dtype == torch.uint8  # FP8 latent rows (kv_cache.fp8_row_bytes), dequantized as read
    if q.shape[-1] % 8 or latent_dim % 8 or not _fp32_cpu(q) or not _paged_cache_ok(cache, table, lens, fp8):
        return None
    if fp8 and latent_dim % 128:  # (one scale per 128 values)
        return None
    module = _module()
    if module is None:
        return None
    args = (q.contiguous(), cache, table.contiguous(), lens.contiguous(), latent_dim)
    if fp8:
        return module.mla_decode_fp8(*args, q.shape[-1] - latent_dim, scale)
    return module.mla_decode(*args, scale)


def absorb(x: torch.Tensor, kv_b: torch.Tensor, D: int, side: str) -> torch.Tensor | None:
    """The absorbed MLA attention's products with kv_b [N, D + V, C] (fp32, contiguous) for up to
    MAX_ROWS tokens, per head as dot products (torch.bmm runs a small GEMM per head): side "q":
    x = q_nope [T, N, D] (last dim contiguous) -> q_nope @ kv_b[:, :D] [T, N, C]; side "o": x =
    o_lat [T, N, C] -> o_lat @ kv_b[:, D:]^T [T, N, V]. None where the kernel does not apply."""
    if (
        x.shape[0] > MAX_ROWS
        or kv_b.shape[-1] % 8
        or x.stride(-1) != 1
        or not _fp32_cpu(x, kv_b)
        or not kv_b.is_contiguous()
    ):
        return None
    module = _module()
    if module is None:
        return None
    return module.absorb_q(x, kv_b, D) if side == "q" else module.absorb_o(x.contiguous(), kv_b, D)


def index_scores(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor | None:
    """DeepSeek-V3.2's lightning-indexer scores in one call (indexer.IndexQueries' math, no
    [Q, Hi, L] temporaries): q [Q, Hi, Di], w [Q, Hi], keys [L, Di] (one shared context) or [Q, L,
    Di], lens [Q] int64 (query q sees its first lens[q] tokens) -> [Q, L] fp32, -inf beyond each
    query's tokens. None where the kernel does not apply (not fp32 on the CPU, Di % 8)."""
    keys = keys if keys.dim() == 3 else keys.unsqueeze(0)
    if q.shape[-1] % 8 or not _fp32_cpu(q, w, keys) or lens.dtype != torch.int64:
        return None
    module = _module()
    if module is None:
        return None
    return module.index_scores(q.contiguous(), w.contiguous(), keys.contiguous(), lens.contiguous(),
                               q.shape[-1] ** -0.5)  # fmt: skip


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """layers.Rope.apply's interleaved form for fp32 CPU x [T, R] or [T, N, R] (last dim
    contiguous, any other strides) with cos / sin [T, R/2]; None where the kernel does not apply."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or not _fp32_cpu(x, cos, sin):
        return None
    module = _module()
    if module is None:
        return None
    out = module.rope_interleaved(x if x.dim() == 3 else x.unsqueeze(1), cos.contiguous(), sin.contiguous())
    return out.view(x.shape)


def route_sigmoid(
    x: torch.Tensor,
    gate_w: torch.Tensor,
    bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    top_k: int,
    norm: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """layers.route for sigmoid scores with noaux_tc on fp32 CPU (x [T, H], gate_w [E, H]) in one
    call: (topk_idx [T, K] int64, best first; topk_weight [T, K] fp32). None where the kernel
    does not apply."""
    if x.shape[1] % 8 or x.shape[0] == 0 or not _fp32_cpu(x, gate_w, bias):
        return None
    module = _module()
    if module is None:
        return None
    empty = torch.empty(0)
    idx, weight = module.route_sigmoid(x.contiguous(), gate_w.contiguous(), empty if bias is None else bias.contiguous(),
                                       n_group, topk_group, top_k, norm, scale)  # fmt: skip
    return idx, weight


def mla_decode_layer(x, w, cos_sin, cache, slot_mapping, table, lens, cfg, eps: float) -> torch.Tensor | None:
    """model.mla_forward for a decode-only step of a V3 layer (no indexer, interleaved rope) in
    one call: x [T, H] fp32 on CPU, w a weights.MLAWeights, cos_sin [T, R/2] each, cache [blocks, 64,
    1, C+R], table [T, max_blocks] / lens [T] int64 (batch.DecodeRows); the rows of this step are
    written at slot_mapping [T]; eps of the latent norms. None where the kernel does not apply."""
    C, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    linears = (w.q_a, w.q_b, w.q_proj, w.kv_a, w.o)
    fp8 = _fp8_linears(linears)  # (kept FP8: their blocks scales, in this order; else None)
    if (
        w.indexer is not None
        or cache.shape[-1] != C + R
        or (C + R) % 8
        or C % 8
        or not _fp32_cpu(x, w.kv_b, w.kv_a_norm, w.q_a_norm)
        or not (fp8 is not None or _weights_cpu(*linears))
        or not _fp32_cpu(w.q_a_bias, w.kv_a_bias, w.o_bias, *cos_sin)
        or (w.q_a_norm is not None and w.q_a_norm.numel() % 8)  # (its RMSNorm runs in the kernel)
        or not _paged_cache_ok(cache, table, lens)
    ):
        return None
    module = _module()
    if module is None:
        return None
    cos, sin = cos_sin
    q_a, q_b, q_proj, kv_a, o = (t.weight if type(t) is Fp8Weight else t for t in linears)
    scales, (bn, bk) = ([], (0, 0)) if fp8 is None else fp8
    return module.mla_decode_layer(x, q_a, w.q_a_bias, w.q_a_norm, q_b, q_proj, kv_a, w.kv_a_bias,
                                   w.kv_a_norm, w.kv_b, o, w.o_bias, cos.contiguous(), sin.contiguous(),
                                   cache, slot_mapping, table, lens, cfg.qk_nope_head_dim, R, C, cfg.v_head_dim,
                                   eps, cfg.softmax_scale, scales, bn, bk)  # fmt: skip


def _fp8_linears(linears) -> tuple[list[torch.Tensor], tuple[int, int]] | None:
    """For MLA linears all kept FP8 on CPU in one block shape the kernel reads (K, bk % 16 == 0):
    their scales (an empty tensor for an absent one) and the block; None otherwise."""
    held = [t for t in linears if t is not None]
    if not all(type(t) is Fp8Weight for t in held):
        return None
    block = held[0].block
    if block[1] % 16 or any(
        t.block != block
        or t.shape[1] % 16
        or not (t.weight.is_cpu and t.weight.is_contiguous())
        or not _fp32_cpu(t.scale)
        for t in held
    ):
        return None
    return [torch.empty(0) if t is None else t.scale.contiguous() for t in linears], block
