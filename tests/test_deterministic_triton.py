"""Deterministic mode on the Triton kernels (#53's GPU half; kernels/deterministic.py `bind_triton`):
each kernel gives a row the same bits alone as inside batches of other sizes beside other rows,
and matches its torch reference; the tiny model's logits of a prompt are the same alone, in a
batch and chunked.

Without a GPU these run on CPU tensors under triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py), which shows the structure (one kernel configuration whatever the batch, no split
whose count follows the batch, the sums in a fixed order) but computes each tile with numpy: the
bits a real GPU's tensor cores give are checked by running this same file there, on CUDA tensors
(benchmarks/gpu_session.sh, step `deterministic`)."""

import random

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.model.config import ModelConfig
from services.model.kernels import deterministic, torch_ops, triton_linear, triton_mla, triton_moe
from services.model.kernels.select import select_kernels
from services.model.kv_cache import BLOCK_SIZE
from services.presets import PRESETS

from .staggered import run_staggered
from .test_triton_kernels import mla_decode_reference, paged_context

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALLOW = "triton,torch"  # (on CPU tensors: the interpreter, asked for by name)
TINY = ModelConfig.from_hf(PRESETS["tiny"])
SIZES = (1, 3, 17, 32, 40)  # (32: on a GPU, Triton specialises integer arguments divisible by 16)
# (the interpreter computes masked lanes too: an empty split's 0 / 0 and log(0), never stored)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")  # fmt: skip


def det_kernels(cfg: ModelConfig = TINY, dtype: torch.dtype = torch.float32, **options):
    return select_kernels(DEVICE, dtype, cfg, allow=ALLOW, deterministic=True, **options)


def rand(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE)


def assert_rows_invariant(f, x: torch.Tensor, sizes=SIZES):
    """f(rows) [m, ...] of x's rows: each row alone == the same row among the first m rows, and
    == the same row after other rows (a batch of another make-up: other values, another place)."""
    alone = torch.cat([f(x[i : i + 1]) for i in range(max(sizes))])
    other = rand(7, *x.shape[1:], seed=99).to(x.dtype)
    for m in sizes:
        assert torch.equal(f(x[:m]), alone[:m]), m
        assert torch.equal(f(torch.cat((other, x[:m])))[7:], alone[:m]), m
    return alone


# ---- linears --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, wdtype, K, N",
    [
        (torch.float32, torch.float32, 64, 96),
        (torch.float32, torch.bfloat16, 80, 40),  # bf16 weights under fp32 (weight_dtype); K, N tails
        (torch.bfloat16, torch.bfloat16, 64, 130),
    ],
)
def test_linear_rows_do_not_depend_on_the_batch(dtype, wdtype, K, N):
    k = det_kernels(dtype=dtype)
    assert k.names()["linear"] == "triton"
    w, bias = rand(N, K, seed=1, scale=K**-0.5).to(wdtype), rand(N, seed=2).to(dtype)
    x = rand(40, K, seed=3).to(dtype)
    for b in (None, bias):
        got = assert_rows_invariant(lambda t, b=b: k.linear(t, w, b), x)
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    tiles = {triton_linear.GEMM_TILES[d] for d in (torch.float32, torch.bfloat16, torch.float16)}
    assert len(tiles) == 2  # (one configuration per dtype: nothing chosen from M)


def test_fp8_linear_rows_do_not_depend_on_the_batch(monkeypatch):
    from services.model.fp8 import Fp8Weight, dequantize_fp8_blocks, quantize_fp8_blocks

    block = (16, 32)
    weight, scale = quantize_fp8_blocks(torch.randn(72, 96, generator=torch.Generator().manual_seed(4)) * 0.05,
                                        block)  # fmt: skip
    w = Fp8Weight(weight.to(DEVICE), scale.to(DEVICE), block)
    k = det_kernels(fp8_linears=True)
    assert k.names()["fp8_linear"] == "triton"
    splits = []
    kernel = triton_linear._fp8_linear_kernel
    monkeypatch.setattr(triton_linear, "_fp8_linear_kernel", _Recorder(kernel, splits))
    x, bias = rand(40, 96, seed=5), rand(72, seed=6)
    got = assert_rows_invariant(lambda t: k.linear(t, w, bias), x)
    assert {s for s in splits} == {(1, triton_linear.DETERMINISTIC_FP8_BLOCK_M)}  # (grid z, BLOCK_M)
    want = F.linear(x.cpu(), dequantize_fp8_blocks(weight, scale, block), bias.cpu())
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


class _Recorder:
    """A Triton kernel whose launches record (splits, BLOCK_M)."""

    def __init__(self, kernel, seen: list):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.seen.append((grid[2], kwargs["BLOCK_M"]))
            return launch(*args, **kwargs)

        return run


def test_absorbed_products_do_not_depend_on_the_batch():
    k = det_kernels()
    assert k.names()["absorb"] == "triton"
    N, D, V, C = 4, 16, 16, 32
    kv_b = rand(N, D + V, C, seed=7, scale=C**-0.5)
    q = rand(40, N, D, seed=8)
    got = assert_rows_invariant(lambda t: k.absorb_q(t, kv_b), q)
    torch.testing.assert_close(got, torch_ops.absorb_q(q, kv_b), rtol=1e-5, atol=1e-5)
    o = rand(40, N, C, seed=9)
    got = assert_rows_invariant(lambda t: k.absorb_o(t, kv_b, D), o)
    torch.testing.assert_close(got, torch_ops.absorb_o(o, kv_b, D), rtol=1e-5, atol=1e-5)


# ---- routed experts, router -----------------------------------------------------------------
@pytest.mark.parametrize("limit", [None, 3.0])
def test_fused_moe_rows_do_not_depend_on_the_batch(limit):
    k = det_kernels()
    assert k.names()["expert_ffn"] == "triton"
    S, H, I, K = 6, 64, 32, 3
    w13, w2 = rand(S, 2 * I, H, seed=10, scale=H**-0.5), rand(S, H, I, seed=11, scale=I**-0.5)
    g = torch.Generator().manual_seed(12)
    slot = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(47)])
    slot[5, 1] = -1  # (a skipped choice)
    weight = torch.rand(47, K, generator=g)
    slot, weight = slot.to(DEVICE), weight.to(DEVICE)
    x = rand(47, H, seed=13)

    def f(rows):  # (the token ids of `rows`: their slots and weights go with them)
        t = rows[:, 0].long()
        return k.expert_ffn(rows[:, 1:].contiguous(), slot[t], weight[t], w13, w2, swiglu_limit=limit)

    ids = torch.arange(47, dtype=x.dtype, device=DEVICE)[:, None]
    got = assert_rows_invariant(f, torch.cat((ids, x), dim=1)[:40].clone())
    want = torch_ops.expert_ffn(x[:40], slot[:40], weight[:40], w13, w2, swiglu_limit=limit)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # one block configuration whatever the pairs per slot; the choices summed in slot order
    assert {triton_moe._blocks(p, S, False, (128, 128), True) for p in (1, 40, 4000)} == {(64, 64, 64)}
    pair_out = rand(2, 3, 4, seed=14)
    s = torch.tensor([[4, -1, 2], [0, 5, 1]], device=DEVICE)
    want = torch.stack(
        [pair_out[0, 1] + pair_out[0, 2] + pair_out[0, 0], pair_out[1, 0] + pair_out[1, 2] + pair_out[1, 1]]
    )
    assert torch.equal(triton_moe.sum_in_slot_order(pair_out, s), want)


def test_router_rows_do_not_depend_on_the_batch():
    k = det_kernels()
    E, H = TINY.n_routed_experts, TINY.hidden_size
    gate, bias = rand(E, H, seed=15), rand(E, seed=16)
    x = rand(40, H, seed=17)
    assert_rows_invariant(lambda t: k.route(t, gate, bias)[1], x)
    idx, wt = k.route(x, gate, bias)
    assert torch.equal(idx, idx.sort(dim=1).values)  # (ascending experts)
    ref_idx, ref_wt = torch_ops.route(x, gate, bias, TINY)
    order = ref_idx.argsort(dim=1)
    assert torch.equal(idx, ref_idx.gather(1, order))
    torch.testing.assert_close(wt, ref_wt.gather(1, order), rtol=1e-6, atol=1e-6)


# ---- MLA ------------------------------------------------------------------------------------
def _paged(lens, width, seed):
    """test_triton_kernels.paged_context's cache and block table, fp32, two spare blocks."""
    spare = sum(-(-n // BLOCK_SIZE) for n in lens) + 2
    return paged_context(lens, width, torch.float32, DEVICE, seed=seed, num_blocks=spare)


def test_mla_decode_row_alone_equals_the_row_beside_longer_and_shorter_ones():
    """Rows of 1 to 1,100 rows of context (up to 5 splits of 256 rows, the launch's SPLITS 1 alone
    and 8 beside the longest): each row alone == in every batch; the torch reference's values."""
    C, R, N, scale = 32, 16, 4, 0.3
    lens = [1, 70, 300, 1100, 257, 5]
    cache, table, lens_t = _paged(lens, C + R, seed=20)
    q = rand(len(lens), N, C + R, seed=21)
    decode = lambda i: triton_mla.mla_decode(q[i], cache, table[i], lens_t[i], C, scale, deterministic=True)  # noqa: E731
    alone = [decode([b]) for b in range(len(lens))]
    for batch in ([0, 1, 2, 3, 4, 5], [3, 0], [2, 5, 1], [4, 3]):
        got = decode(batch)
        for j, b in enumerate(batch):
            assert torch.equal(got[j : j + 1], alone[b]), (batch, b)
    want = mla_decode_reference(q, cache, table, lens_t, C, scale)
    torch.testing.assert_close(torch.cat(alone), want, rtol=1e-4, atol=1e-5)
    if DEVICE == "cpu":  # without the flag the 1,100-row one is cut by the batch (the interpreter's
        # 4 "multiprocessors": 8 splits alone, 4 beside row 0; a GPU's 132 fill at 8 either way)
        default = lambda i: triton_mla.mla_decode(q[i], cache, table[i], lens_t[i], C, scale)  # noqa: E731
        assert not torch.equal(default([3]), default([3, 0])[:1])
    # each row's cut is its own: 256-row splits, at most DETERMINISTIC_MAX_SPLITS of them
    assert triton_mla.DETERMINISTIC_SPLIT_BLOCKS * BLOCK_SIZE == 256


def test_mla_decode_bounds_a_long_rows_splits(monkeypatch):
    """A row longer than DETERMINISTIC_MAX_SPLITS splits of 256 rows is cut in that many wider ones;
    the same bits when the launch's partials are run a few rows at a time."""
    monkeypatch.setattr(triton_mla, "DETERMINISTIC_MAX_SPLITS", 2)
    C, R, N = 32, 16, 4
    lens = [700, 40, 600]
    cache, table, lens_t = _paged(lens, C + R, seed=22)
    q = rand(3, N, C + R, seed=23)
    whole = triton_mla.mla_decode(q, cache, table, lens_t, C, 0.2, deterministic=True)
    monkeypatch.setattr(triton_mla, "DETERMINISTIC_MID_BYTES", 1)  # (one row per launch)
    assert torch.equal(triton_mla.mla_decode(q, cache, table, lens_t, C, 0.2, deterministic=True), whole)
    torch.testing.assert_close(
        whole, mla_decode_reference(q, cache, table, lens_t, C, 0.2), rtol=1e-4, atol=1e-5
    )


def test_sparse_decode_rows_do_not_depend_on_the_batch():
    """V3.2's decode over chosen rows: each row's count alone == beside rows of other counts."""
    C, R, N = 32, 16, 4
    cache = rand(12, BLOCK_SIZE, 1, C + R, seed=24)
    g = torch.Generator().manual_seed(25)
    rows = torch.stack([torch.randperm(12 * BLOCK_SIZE, generator=g)[:400] for _ in range(4)]).to(DEVICE)
    count = torch.tensor([400, 3, 260, 64], device=DEVICE)
    q = rand(4, N, C + R, seed=26)
    k = det_kernels(ModelConfig.from_hf(PRESETS["tiny-v32"]))
    assert k.names()["mla_sparse_decode"] == "triton"
    alone = [k.sparse_decode(q[b : b + 1], cache, rows[b : b + 1, : max(1, int(count[b]))], count[b : b + 1], C, 0.2)
             for b in range(4)]  # fmt: skip
    together = k.sparse_decode(q, cache, rows, count, C, 0.2)
    assert all(torch.equal(together[b : b + 1], alone[b]) for b in range(4))
    want = torch_ops.sparse_decode(q, cache, rows, count, C, 0.2)
    torch.testing.assert_close(together, want, rtol=1e-4, atol=1e-5)


def test_prefill_gives_each_query_its_decode_rows_bits():
    """A prompt chunk's attention (the decode kernel, a row per query) == each query decoded alone
    at its position, through the same absorbed products."""
    k = det_kernels()
    assert k.names()["mla_prefill"] == "triton"
    N, C, R, D, V, L, n = 4, 32, 16, 16, 16, 300, 20
    cache, table, _ = _paged([L], C + R, seed=27)
    kv_b = rand(N, D + V, C, seed=28, scale=C**-0.5)
    q = rand(n, N, D + R, seed=29)
    chunk = k.mla_prefill(q[..., :D], q[..., D:], cache, table[0].long(), L, kv_b, C, 0.25)
    for j in (0, 7, n - 1):
        q_full = torch.cat((k.absorb_q(q[j : j + 1, :, :D], kv_b), q[j : j + 1, :, D:]), dim=-1)
        dec = deterministic._Rows(table[:1], torch.tensor([L - n + 1 + j], device=DEVICE))
        one = k.absorb_o(k.mla_decode(q_full, cache, dec, C, 0.25), kv_b, D)
        assert torch.equal(chunk[j : j + 1], one), j
    want = torch_ops.prefill_attention(q[..., :D], q[..., D:], cache, table[0].long(), L, kv_b, C, 0.25)
    torch.testing.assert_close(chunk.float(), want, rtol=1e-4, atol=1e-5)


def test_index_scores_rows_do_not_depend_on_the_batch():
    k = det_kernels(ModelConfig.from_hf(PRESETS["tiny-v32"]))
    assert k.names()["index_scores"] == "triton"
    Q, Hi, Di, L = 5, 4, 16, 90
    q, w, keys = rand(Q, Hi, Di, seed=30), rand(Q, Hi, seed=31), rand(L, Di, seed=32)
    lens = torch.tensor([90, 1, 40, 65, 7], device=DEVICE)
    together = k.index_scores(q, w, keys, lens)
    for i in range(Q):
        assert torch.equal(
            k.index_scores(q[i : i + 1], w[i : i + 1], keys, lens[i : i + 1]), together[i : i + 1]
        )
    torch.testing.assert_close(together, torch_ops.index_scores(q, w, keys, lens), rtol=1e-5, atol=1e-5)


# ---- selection ------------------------------------------------------------------------------
def test_selection_on_cuda(monkeypatch):
    """On CUDA (here: a CUDA target with torch told it has one; nothing is launched) the Triton
    kernels run every batch-variant family, FlashMLA is not chosen; without triton allowed, or for
    DeepSeek-V4's model, a clear refusal."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    k = select_kernels("cuda", torch.bfloat16, TINY, deterministic=True)
    names = k.names()
    assert "(deterministic)" in k.summary()
    on_triton = ("linear", "absorb", "expert_ffn", "mla_decode", "mla_prefill", "rms_norm", "latent_to_cache")
    assert {f: names[f] for f in on_triton} == dict.fromkeys(on_triton, "triton")
    assert names["route"] == "torch" and names["mla_decode_layer"] == "unfused"
    with pytest.raises(ValueError, match="deterministic: on CUDA it needs the Triton kernels"):
        select_kernels("cuda", torch.bfloat16, TINY, allow="torch", deterministic=True)
    with pytest.raises(ValueError, match="not torch.float64 activations"):
        select_kernels("cuda", torch.float64, TINY, deterministic=True)
    monkeypatch.setenv("MOE_TRITON", "0")
    with pytest.raises(ValueError, match="MOE_TRITON=0"):
        select_kernels("cuda", torch.bfloat16, TINY, deterministic=True)
    monkeypatch.delenv("MOE_TRITON")
    v4 = ModelConfig.from_hf(PRESETS["tiny-v4"])
    with pytest.raises(ValueError, match="DeepSeek-V4 on CUDA"):
        select_kernels("cuda", torch.bfloat16, v4, deterministic=True)
    assert select_kernels("cuda", torch.bfloat16, v4, scope="experts", deterministic=True).deterministic


def test_the_cpu_path_is_unchanged():
    """Without triton asked for on the CPU: the C++ / torch deterministic kernels as before."""
    k = select_kernels("cpu", torch.float32, TINY, deterministic=True)
    assert "triton" not in k.names().values() and k._det.gpu is None


# ---- the model ------------------------------------------------------------------------------
def test_tiny_model_logits_do_not_depend_on_batch_or_chunking(tiny_model):
    """LocalEngine on the Triton kernels, deterministic: each prompt's logits (prefill and decode
    steps) alone == all prompts together == prompts arriving a step apart == in 16-token chunks."""
    rng = random.Random(0)
    prompts = [[0] + [rng.randrange(4, 384) for _ in range(n)] for n in (5, 21)]  # (21: two 16-token chunks)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def engine(tokens: int = 2048) -> LocalEngine:
        return LocalEngine(EngineConfig(model=str(tiny_model), device=DEVICE, deterministic=True, kernels=ALLOW,
                                        max_num_seqs=8, max_num_batched_tokens=tokens))  # fmt: skip

    def logits(e, ps, stagger=0):
        return [x for _, x in run_staggered(e, ps, params, stagger)]

    e = engine()
    assert e.kernels.names()["linear"] == "triton" and e.kernels.deterministic
    alone = [logits(e, [p])[0] for p in prompts]
    for other in (logits(e, prompts), logits(e, prompts, stagger=1), logits(engine(16), prompts)):
        for a, b in zip(alone, other, strict=True):
            assert torch.equal(a, b)
