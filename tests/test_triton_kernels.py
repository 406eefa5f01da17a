"""The Triton kernels (services/model/kernels/triton_*.py) against torch references. Without a GPU they run
under triton's interpreter on CPU tensors (TRITON_INTERPRET=1), which is how CI tests them."""

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from services.model.config import ModelConfig
from services.model.kernels import hardware, torch_ops, triton_linear, triton_mla, triton_moe, triton_norm
from services.model.kernels.select import select_kernels
from services.model.kv_cache import BLOCK_SIZE
from services.presets import PRESETS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the engines of these tests: the Triton kernels (asked for by name: on CPU tensors, under the
# interpreter) with the C++ CPU kernels elsewhere, against the same without Triton
TRITON = "triton,cpp,torch" if DEVICE == "cpu" else "triton,torch"
WITHOUT = "cpp,torch" if DEVICE == "cpu" else "torch"


@pytest.fixture
def kernels():
    """(load(name) -> the kernel module, device). On CPU: the interpreter."""
    assert DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"  # (set by conftest.py)
    modules = {"mla": triton_mla, "moe": triton_moe, "norm": triton_norm, "linear": triton_linear}
    return modules.__getitem__, DEVICE


def on_triton(cfg: ModelConfig | None = None, **options):
    """Kernels selected with Triton asked for (its kernels, torch elsewhere) for cfg (tiny)."""
    cfg = cfg or ModelConfig.from_hf(PRESETS["tiny"])
    return select_kernels(DEVICE, torch.float32, cfg, allow="triton,torch", **options)


def paged_context(lens, width, dtype, device, seed=0, num_blocks=None):
    """A paged cache [blocks, 64, 1, width] holding random rows and a shuffled block table
    [B, max_blocks] int32 giving each sequence ceil(len / 64) blocks (the rest of its row 0)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = num_blocks or sum(need) + 3
    cache = torch.randn(num_blocks, BLOCK_SIZE, 1, width, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = order[used : used + n].to(torch.int32)
        used += n
    return cache.to(device), table.to(device), torch.tensor(lens, device=device)


def mla_decode_reference(q, cache, table, lens, C, scale):
    """model.mla_forward's torch decode path: gather the padded context, mask, softmax."""
    B, W = q.shape[0], cache.shape[-1]
    ctx = cache[table.long()].view(B, -1, W).float()
    scores = torch.bmm(q.float(), ctx[..., : q.shape[-1]].transpose(1, 2)) * scale
    pad = torch.arange(ctx.shape[1], device=q.device)[None, :] >= lens[:, None]
    probs = scores.masked_fill(pad[:, None, :], float("-inf")).softmax(-1)
    return torch.bmm(probs, ctx[..., :C]).to(q.dtype)


@pytest.mark.parametrize(
    "lens, heads, C, R, extra, splits",
    [
        ([1], 16, 64, 16, 0, None),  # one row of context
        ([5, 64, 65, 200], 16, 64, 16, 0, None),  # block boundaries, several blocks
        ([130, 3], 20, 32, 16, 8, 4),  # heads not a power of two, a V3.2-style wider row, 4 splits
        ([300], 4, 48, 8, 0, 8),  # C, R not powers of two; splits past the context's end
    ],
)
def test_mla_decode_matches_torch(kernels, lens, heads, C, R, extra, splits):
    load, device = kernels
    mla = load("mla")
    cache, table, lens_t = paged_context(lens, C + R + extra, torch.float32, device)
    q = torch.randn(len(lens), heads, C + R, generator=torch.Generator().manual_seed(1)).to(device)
    scale = 0.1352338
    o = mla.mla_decode(q, cache, table, lens_t, C, scale, splits=splits)
    assert o.shape == (len(lens), heads, C) and o.dtype == q.dtype
    torch.testing.assert_close(
        o, mla_decode_reference(q, cache, table, lens_t, C, scale), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("tiles", [(32, 16, 4, 2), (64, 64, 8, 1), (128, 32, 8, 2)])
def test_mla_decode_tile_shapes_agree(kernels, tiles):
    """bench_kernels' sweep shapes: more heads per program than the model has (masked), row tiles
    wider and narrower than a split's rows, several splits."""
    load, device = kernels
    mla = load("mla")
    cache, table, lens = paged_context([70, 300, 1], 32 + 16, torch.float32, device)
    q = torch.randn(3, 20, 48, generator=torch.Generator().manual_seed(2)).to(device)
    for splits in (None, 4):
        o = mla.mla_decode(q, cache, table, lens, 32, 0.2, splits=splits, tiles=mla.DecodeTiles(*tiles))
        torch.testing.assert_close(
            o, mla_decode_reference(q, cache, table, lens, 32, 0.2), rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize("L, n", [(200, 64), (70, 70), (130, 1)])
def test_absorbed_prefill_matches_the_tiled_path(kernels, L, n):
    """model.absorbed_prefill (the GPU's prefill: each query a decode row of its own causal length)
    against model.prefill_attention on the same chunk: a chunk after a cached prefix, a whole prompt,
    one query."""
    load, device = kernels
    absorbed_prefill = on_triton().mla_prefill
    N, C, R, D, V = 4, 32, 16, 24, 20
    g = torch.Generator().manual_seed(3)
    nb = -(-L // BLOCK_SIZE)
    cache = torch.randn(nb + 5, BLOCK_SIZE, 1, C + R, generator=g).to(device)
    blocks = torch.randperm(nb + 5, generator=g)[:nb].to(device)
    kv_b = (torch.randn(N, D + V, C, generator=g) / C**0.5).to(device)
    q = torch.randn(n, N, D + R, generator=g).to(device)
    got = absorbed_prefill(q[..., :D], q[..., D:], cache, blocks, L, kv_b, C, 0.3)
    torch.testing.assert_close(
        got, torch_ops.prefill_attention(q[..., :D], q[..., D:], cache, blocks, L, kv_b, C, 0.3), rtol=1e-4,
        atol=1e-5,
    )  # fmt: skip


def fp8_context(lens, C, R, device, seed=0):
    """paged_context's rows as FP8 latent rows (kv_cache.quantize_latent_rows): (uint8 cache
    [blocks, 64, 1, fp8_row_bytes(C, R)], the same rows dequantised [blocks, 64, 1, C+R] fp32,
    table, lens)."""
    from services.model.kv_cache import dequantize_latent_rows, quantize_latent_rows

    dense, table, lens_t = paged_context(lens, C + R, torch.float32, "cpu", seed)
    dense[..., :C] *= torch.linspace(0.01, 30, C)  # groups of very different scales
    rows = quantize_latent_rows(dense.view(-1, C + R)[:, :C], dense.view(-1, C + R)[:, C:])
    cache = rows.view(*dense.shape[:3], -1)
    exact = dequantize_latent_rows(cache, C, R)
    return cache.to(device), exact.to(device), table.to(device), lens_t.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens, splits", [([5, 130, 64], None), ([300], 4)])
def test_mla_decode_reads_fp8_latent_rows(kernels, dtype, lens, splits):
    """The FP8 cache (656-byte rows on V3: e4m3 latent, fp32 scales per 128, bf16 rope) read in
    place: the result of the dequantised rows, which is what the torch path attends to."""
    load, device = kernels
    mla = load("mla")
    C, R = 512, 64  # DeepSeek-V3's: 656-byte rows
    cache, exact, table, lens_t = fp8_context(lens, C, R, device)
    assert cache.dtype == torch.uint8 and cache.shape[-1] == 656
    q = torch.randn(len(lens), 4, C + R, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    o = mla.mla_decode(q, cache, table, lens_t, C, 0.05, splits=splits)
    # the same kernel over the rows dequantised by torch in q's dtype: the same values, so in fp32 the
    # same bits; in bf16 within a step (on an H200, 1-2 of 6,144 values one bf16 step apart: the
    # tensor-core sums take the tiles in another order), and under the interpreter, whose fp32 -> bf16
    # conversion truncates, bf16 noise
    same = mla.mla_decode(q, exact.to(dtype), table, lens_t, C, 0.05, splits=splits)
    if dtype == torch.float32:
        torch.testing.assert_close(o, same, rtol=0, atol=0)
        want = mla_decode_reference(q, exact, table, lens_t, C, 0.05)  # (values up to ~90 here)
        torch.testing.assert_close(o, want, rtol=1e-3, atol=1e-3)
    else:
        loose = 0.05 if device == "cpu" else 0.01
        torch.testing.assert_close(o, same, rtol=loose, atol=loose * same.abs().max())
    with pytest.raises(ValueError, match="FP8 rows of 654 bytes"):  # not the layout
        mla.mla_decode(q, cache[..., :-2].contiguous(), table, lens_t, C, 0.05)
    narrow, *_ = fp8_context(lens, 256, 16, device)  # 296 bytes used, padded to 304
    assert narrow.shape[-1] == 304
    narrow = narrow[..., :296].contiguous()  # rows not a multiple of 16 bytes
    with pytest.raises(ValueError, match="FP8 rows of 296 bytes"):
        mla.mla_decode(q[..., : 256 + 16].contiguous(), narrow, table, lens_t, 256, 0.05)


@pytest.mark.parametrize("C, R", [(384, 18), (128, 6)])
def test_mla_decode_reads_fp8_rows_of_other_widths(kernels, C, R):
    """C not a power of two (a masked scale group), one scale group, R not a power of two: rows of
    432 / 144 bytes (multiples of 16)."""
    load, device = kernels
    mla = load("mla")
    cache, exact, table, lens_t = fp8_context([70, 3], C, R, device, seed=6)
    q = torch.randn(2, 4, C + R, generator=torch.Generator().manual_seed(7)).to(device)
    for splits in (None, 2):
        o = mla.mla_decode(q, cache, table, lens_t, C, 0.05, splits=splits)
        torch.testing.assert_close(
            o, mla_decode_reference(q, exact, table, lens_t, C, 0.05), rtol=1e-3, atol=1e-3
        )


def test_absorbed_prefill_over_fp8_rows_matches_the_tiled_path(kernels):
    """FP8 rows in prefill: the Triton kernel reads them in place, the tiled path dequantises a tile
    at a time; the same attention."""
    load, device = kernels
    absorbed_prefill = on_triton().mla_prefill
    N, C, R, D, V, L, n = 4, 512, 64, 24, 20, 150, 40
    cache, _, table, _ = fp8_context([L], C, R, device, seed=4)
    blocks = table[0].long()
    g = torch.Generator().manual_seed(5)
    kv_b = (torch.randn(N, D + V, C, generator=g) / C**0.5).to(device)
    q = torch.randn(n, N, D + R, generator=g).to(device)
    got = absorbed_prefill(q[..., :D], q[..., D:], cache, blocks, L, kv_b, C, 0.3)
    torch.testing.assert_close(
        got,
        torch_ops.prefill_attention(q[..., :D], q[..., D:], cache, blocks, L, kv_b, C, 0.3),
        rtol=1e-4,
        atol=5e-4,
    )  # (fp32 sums in other orders; values up to ~30 here)


def test_decode_tiles_are_wide_only_where_they_were_measured_to_win(monkeypatch):
    """64-head tiles for >= 64 heads, 16-bit rows, batches >= 8, Hopper-class GPUs (the H200 sweep)."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(hardware, "hopper_or_newer", lambda device: True)
    assert triton_mla.decode_tiles(8, 128, torch.bfloat16, cuda) == triton_mla.WIDE_TILES
    for batch, heads, dtype in ((1, 128, torch.bfloat16), (8, 16, torch.bfloat16), (64, 128, torch.float32)):
        assert triton_mla.decode_tiles(batch, heads, dtype, cuda) == triton_mla.DECODE_TILES
    # FP8 rows: the wide tiles at every batch (the H200's mla_fp8 rows), 16-bit queries, >= 64 heads
    assert triton_mla.decode_tiles(1, 128, torch.bfloat16, cuda, fp8_rows=True) == triton_mla.FP8_WIDE_TILES
    assert triton_mla.decode_tiles(1, 16, torch.bfloat16, cuda, fp8_rows=True) == triton_mla.FP8_TILES
    assert triton_mla.decode_tiles(64, 128, torch.float32, cuda, fp8_rows=True) == triton_mla.FP8_TILES
    monkeypatch.setattr(hardware, "hopper_or_newer", lambda device: False)
    assert triton_mla.decode_tiles(64, 128, torch.bfloat16, cuda) == triton_mla.DECODE_TILES
    assert triton_mla.decode_tiles(64, 128, torch.bfloat16, cuda, fp8_rows=True) == triton_mla.FP8_TILES


def test_mla_decode_over_wide_tables_and_small_dims(kernels, monkeypatch):
    """A block table much wider than the contexts (a CUDA graph's static one: each row splits its
    own blocks; the splits past a row's end write no partial and the merge reads none: the
    partials start as NaN here), and a latent narrower than tl.dot's 16."""
    load, device = kernels
    mla = load("mla")
    cache, table, lens = paged_context([100, 7, 64], 8 + 8, torch.float32, device, seed=6)
    wide = torch.cat((table, torch.zeros(3, 30, dtype=table.dtype, device=device)), dim=1)
    q = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(7)).to(device)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    for splits in (1, 4, 32):
        o = mla.mla_decode(q, cache, wide, lens, 8, 0.3, splits=splits)
        torch.testing.assert_close(
            o, mla_decode_reference(q, cache, table, lens, 8, 0.3), rtol=1e-4, atol=1e-5
        )


def test_mla_decode_splits_hold_a_minimum_of_blocks(kernels, monkeypatch):
    """The heuristic's 8 splits (from the 32-block static table) each take at least
    MIN_SPLIT_BLOCKS of a row's blocks: its 10 blocks in 4 + 4 + 2, 1 block in one split, 5 in
    4 + 1, the other splits empty (log-sum-exp -inf); the reference's result."""
    load, device = kernels
    mla = load("mla")
    monkeypatch.setattr(hardware, "multiprocessors", lambda device: 132)
    cache, table, lens = paged_context([640, 50, 260], 16 + 8, torch.float32, device, seed=10)
    wide = torch.cat((table, torch.zeros(3, 32 - table.shape[1], dtype=table.dtype, device=device)), dim=1)
    q = torch.randn(3, 4, 24, generator=torch.Generator().manual_seed(11)).to(device)
    made, empty = [], torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: made.append(empty(*a, **k)) or made[-1])
    o = mla.mla_decode(q, cache, wide, lens, 16, 0.3)
    (lse,) = [t for t in made if t.shape == (3, 4, 8)]
    assert (lse > float("-inf")).all(1).tolist() == [[True] * n + [False] * (8 - n) for n in (3, 1, 2)]
    torch.testing.assert_close(o, mla_decode_reference(q, cache, table, lens, 16, 0.3), rtol=1e-4, atol=1e-5)


def test_mla_decode_split_count(kernels, monkeypatch):
    """Enough programs to fill the GPU twice, in splits of at least MIN_SPLIT_BLOCKS blocks of the
    widest context: on an H100 (132 SMs) at V3's 128 heads (8 groups) and 4k contexts, 16 splits
    at batch 1, one (no merge) at 64; a power of two."""
    load, _ = kernels
    mla = load("mla")
    monkeypatch.setattr(hardware, "multiprocessors", lambda device: 132)
    cpu = torch.device("cpu")
    assert [mla._splits(b, 8, 64, cpu) for b in (1, 2, 4, 8, 16, 33, 64)] == [16, 16, 16, 8, 4, 1, 1]
    assert [mla._splits(1, 8, blocks, cpu) for blocks in (1, 4, 5, 9, 2048)] == [1, 1, 2, 4, 64]


def test_a_failing_kernel_leaves_its_family_to_the_next_one(kernels, monkeypatch, caplog):
    """A Triton kernel that fails where it runs (no kernel image for this GPU, say) is logged, and
    its family's next implementation runs it from then on, visible in what the kernels say they
    run; the other families keep their Triton kernels."""
    load, device = kernels
    k = on_triton()
    assert k.names()["rms_norm"] == k.names()["add_rms_norm"] == "triton"
    x, w = torch.randn(3, 64, device=device), torch.randn(64, device=device)
    expected = k.rms_norm(x, w, 1e-6)  # (the Triton kernel, matching the torch path below)
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(load("norm"), "rms_norm", broken)
    for _ in range(2):
        torch.testing.assert_close(k.rms_norm(x, w, 1e-6), expected, rtol=1e-5, atol=1e-6)
    assert calls == [1] and "the triton kernel of rms_norm failed" in caplog.text
    assert k.names()["rms_norm"] == "torch" and "no kernel image" in k.reasons()["rms_norm"]["triton"]
    assert k.names()["add_rms_norm"] == "triton"  # only that family: the module's others still run
    k.add_rms_norm(x, x, w, 1e-6)


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32-rows", "fp8-rows"])
def test_mla_decode_over_chosen_rows(kernels, fp8):
    """V3.2's sparse decode: each row attends to its own list of flat cache rows (top-k), the
    first count[b] of them; the same as model.sparse_decode's torch gather. FP8 rows carry V3.2's
    indexer key after the latent and a pad (kv_cache.quantize_latent_rows: 176 bytes here, the
    kernel reads the first 148)."""
    from services.model.kv_cache import fp8_row_bytes, quantize_latent_rows

    load, device = kernels
    C, R, Di = (128, 8, 16) if fp8 else (64, 16, 8)
    cache, _, _ = paged_context([300], C + R + Di, torch.float32, "cpu", seed=8)
    if fp8:
        flat = cache.view(-1, C + R + Di)
        rows = quantize_latent_rows(flat[:, :C] * 10, flat[:, C : C + R], flat[:, C + R :])
        cache = rows.view(*cache.shape[:3], -1)
        assert cache.shape[-1] == fp8_row_bytes(C, R, Di) == 176
    cache = cache.to(device)
    g = torch.Generator().manual_seed(9)
    rows = torch.stack([torch.randperm(cache.shape[0] * 64, generator=g)[:70] for _ in range(3)]).to(device)
    count = torch.tensor([70, 1, 33], device=device)
    q = torch.randn(3, 20, C + R, generator=g).to(device)
    ref = torch_ops.sparse_decode(q, cache, rows, count, C, 0.2)  # the reference: a torch gather
    for splits in (None, 2):
        o = load("mla").mla_decode(q, cache, None, count, C, 0.2, splits=splits, rows=rows)
        assert o is not None
        tol = 1e-3 if fp8 else 1e-5  # (FP8: latent values up to ~40, summed in another order)
        torch.testing.assert_close(o, ref, rtol=tol, atol=tol)


def test_mla_decode_at_deepseek_v3_head_dims(kernels):
    """128 heads (8 groups of 16), 512 + 64 wide bf16 rows: DeepSeek-V3's shapes, short contexts."""
    load, device = kernels
    cache, table, lens = paged_context([100, 70], 576, torch.bfloat16, device, seed=1)
    q = torch.randn(2, 128, 576, generator=torch.Generator().manual_seed(2)).to(device, torch.bfloat16)
    o = load("mla").mla_decode(q, cache, table, lens, 512, 0.1352338)
    ref = mla_decode_reference(q.float(), cache.float(), table, lens, 512, 0.1352338)
    torch.testing.assert_close(o.float(), ref, rtol=2e-2, atol=4e-2)  # (bf16 outputs of magnitude ~1-3)


def test_mla_decode_bf16_and_int64_tables(kernels):
    load, device = kernels
    mla = load("mla")
    cache, table, lens = paged_context([70, 129], 64 + 16, torch.bfloat16, device, seed=3)
    q = torch.randn(2, 16, 80, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
    o = mla.mla_decode(q, cache, table.long(), lens, 64, 0.125)
    ref = mla_decode_reference(q.float(), cache.float(), table, lens, 64, 0.125)
    torch.testing.assert_close(o.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_torch_path(kernels, dtype):
    """Rows read with a stride (a slice of a wider tensor, as kv[:, :C]); bf16 rounded as torch
    rounds it: one step at most where the sum of squares, in another order, moves a rounding (two
    under the interpreter, whose fp32 -> bf16 conversion truncates)."""
    load, device = kernels
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 100, generator=g).to(dtype)[:, :72], (torch.rand(72, generator=g) + 0.5).to(dtype)
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    got = load("norm").rms_norm(x.to(device), w.to(device), 1e-6).cpu()
    tol = 1e-6 if dtype == torch.float32 else 2**-7 if device == "cuda" else 2**-6
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_the_torch_path(kernels, dtype):
    """The residual add fused into the norm: (h + delta, rms_norm(h + delta)) as torch computes
    them (the sum rounded once to the dtype: its bits in fp32 and on a GPU)."""
    load, device = kernels
    g = torch.Generator().manual_seed(1)
    h, delta = (torch.randn(4, 72, generator=g).to(dtype) for _ in range(2))
    w = (torch.rand(72, generator=g) + 0.5).to(dtype)
    total, y = (
        t.cpu() for t in load("norm").add_rms_norm(h.to(device), delta.to(device), w.to(device), 1e-6)
    )
    want_total = h + delta
    sf = want_total.float()
    want = w * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 2**-7 if device == "cuda" else 2**-6
    if dtype == torch.float32 or device == "cuda":
        assert torch.equal(total, want_total)
    torch.testing.assert_close(total, want_total, rtol=tol, atol=tol)
    torch.testing.assert_close(y, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("T, N, C, R", [(3, 5, 24, 8), (2, 128, 512, 64)])
def test_latent_to_cache_matches_the_torch_path(kernels, dtype, interleave, T, N, C, R):
    """The fused per-token MLA work (latent norm, both ropes, the cache write) against
    layers.rms_norm / Rope.apply's math and the cache write of the torch path: the ropes bit for
    bit in fp32 under the interpreter, within 2 bf16 steps where its fp32 -> bf16 conversion
    truncates or the GPU compiler fuses the op-by-op roundings; the norm up to the order of its
    sum; the other cache rows untouched."""
    load, device = kernels
    g = torch.Generator().manual_seed(T * N + interleave)
    kv, q = torch.randn(T, C + R, generator=g).to(dtype), torch.randn(T, N, 7 + R, generator=g).to(dtype)
    norm = (torch.rand(C, generator=g) + 0.5).to(dtype)
    angles = torch.rand(T, R // 2, generator=g) * 6
    cos, sin = (angles.cos() * 1.1).to(dtype), (angles.sin() * 1.1).to(dtype)
    slots = torch.randperm(3 * 64, generator=g)[:T]
    cache = torch.randn(3, 64, 1, C + R, generator=g).to(dtype)

    def rope(x):  # layers.Rope.apply, op by op in x's dtype
        c, s = cos.view(T, *(1,) * (x.dim() - 2), R // 2), sin.view(T, *(1,) * (x.dim() - 2), R // 2)
        if interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        x1, x2 = x[..., : R // 2], x[..., R // 2 :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    xf = kv[:, :C].float()
    want_latent = norm * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    want_cache = cache.clone().view(-1, C + R)
    want_cache[slots] = torch.cat((want_latent, rope(kv[:, C:])), dim=-1)

    got_cache = cache.to(device)
    q_pe = load("mla").latent_to_cache(kv.to(device), q.to(device)[..., 7:], norm.to(device), cos.to(device),
                                       sin.to(device), slots.to(device), got_cache, interleave, 1e-6)  # fmt: skip
    got = got_cache.cpu().view(-1, C + R)
    others = torch.ones(got.shape[0], dtype=torch.bool).index_fill_(0, slots, False)
    assert torch.equal(got[others], want_cache[others])
    if dtype == torch.float32 and device == "cpu":
        assert torch.equal(q_pe.cpu(), rope(q[..., 7:])) and torch.equal(
            got[slots, C:], want_cache[slots, C:]
        )
    else:  # the interpreter truncates bf16; the GPU build fuses (an H100: fp32 FMAs, 1 bf16 step)
        tol = 1e-6 if dtype == torch.float32 else 2**-6
        torch.testing.assert_close(q_pe.cpu(), rope(q[..., 7:]), rtol=tol, atol=tol)
        torch.testing.assert_close(got[slots, C:], want_cache[slots, C:], rtol=tol, atol=tol)
    tol = 1e-6 if dtype == torch.float32 else 2**-6
    torch.testing.assert_close(got[slots, :C], want_cache[slots, :C], rtol=tol, atol=tol)


def test_mla_decode_refuses_a_mismatched_cache(kernels):
    """What selection checks (triton_mla.unsupported), the kernel refuses too: never a silent None."""
    load, device = kernels
    mla = load("mla")
    cache, table, lens = paged_context([10], 40, torch.float32, device)
    with pytest.raises(ValueError, match="narrower than the latent"):  # q too wide
        mla.mla_decode(torch.randn(1, 16, 48, device=device), cache, table, lens, 32, 0.1)
    q16 = torch.randn(1, 16, 40, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cache under"):
        mla.mla_decode(q16, cache, table, lens, 32, 0.1)


def test_kernels_stay_off_on_cpu_unless_asked(monkeypatch):
    """On CPU tensors Triton runs only when asked for by name, under the interpreter."""
    cfg = ModelConfig.from_hf(PRESETS["tiny"])
    auto = select_kernels("cpu", torch.float32, cfg)
    assert "triton" not in auto.names().values() and "asked for" in auto.reasons()["rms_norm"]["triton"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    compiled = select_kernels("cpu", torch.float32, cfg, allow="triton,torch")  # compiled Triton needs a GPU
    assert "TRITON_INTERPRET=1" in compiled.reasons()["rms_norm"]["triton"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_kernels("cpu", torch.float32, cfg, allow="triton,torch").names()["rms_norm"] == "triton"


def test_deepseek_v32_engine_on_the_triton_kernels_keeps_greedy_outputs(tmp_path, kernels, monkeypatch):
    """V3.2 (tiny-v32): decode attends to each query's top-k rows through the sparse Triton
    kernel; the same tokens as the torch gather."""
    from services.engine.engine import EngineConfig, LocalEngine
    from services.engine.sampling import SamplingParams
    from services.presets import init_model

    load, device = kernels
    path = init_model(tmp_path / "tiny-v32", "tiny-v32", seed=0)
    sparse_calls = []
    kernel = load("mla").mla_decode
    monkeypatch.setattr(load("mla"), "mla_decode",
                        lambda *a, **kw: sparse_calls.append(kw.get("rows") is not None) or kernel(*a, **kw))  # fmt: skip
    prompts = [list(range(3, 90)), [0, 5, 6, 7]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for flag, kernels in (("0", WITHOUT), ("1", TRITON)):
        engine = LocalEngine(EngineConfig(model=str(path), device=device, max_num_seqs=4, kernels=kernels))
        assert (engine.kernels.names()["mla_sparse_decode"] == "triton") == (flag == "1")
        outs[flag] = [o.token_ids for o in engine.generate(prompts, params)]
    assert any(sparse_calls) and outs["1"] == outs["0"]


def test_engine_on_the_triton_kernels_keeps_greedy_outputs(tiny_model, kernels, monkeypatch):
    """LocalEngine with every Triton kernel on (MLA decode and latent, fused MoE, RMSNorm) against the torch
    path: the same greedy tokens and close last-step logits, across a block boundary and a batch
    mixing prefill chunks and decodes."""
    from services.engine.engine import EngineConfig, LocalEngine
    from services.engine.sampling import SamplingParams

    from .hf_oracle import generate_with_logits

    load, device = kernels
    calls = {}
    kernels = (
        ("mla", "mla_decode"),
        ("mla", "latent_to_cache"),
        ("moe", "fused_moe"),
        ("norm", "rms_norm"),
        ("norm", "add_rms_norm"),
    )
    for name, fn in kernels:
        kernel = getattr(load(name), fn)
        monkeypatch.setattr(
            load(name), fn, lambda *a, _k=kernel, _f=fn, **kw: calls.update({_f: 1}) or _k(*a, **kw)
        )
    prompts = [[0, 5, 6, 7], list(range(3, 70)), [0] + [9] * 20]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(kernels: str):
        engine = LocalEngine(EngineConfig(model=str(tiny_model), device=device, max_num_seqs=4,
                                          max_num_batched_tokens=48, kernels=kernels))  # fmt: skip
        return generate_with_logits(engine, prompts, params)

    ref, ref_logits = run(WITHOUT)
    assert not calls
    out, logits = run(TRITON)
    assert set(calls) == {fn for _, fn in kernels}  # every kernel ran
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_fp8_experts_kept_fp8_run_in_the_fused_moe(tmp_path, kernels, monkeypatch):
    """keep_fp8_experts: the fused MoE reads the FP8 experts and their block scales as they are
    held (no dequantized copy); the same greedy tokens as the torch path, which dequantizes them."""
    from services.engine.engine import EngineConfig, LocalEngine
    from services.engine.sampling import SamplingParams
    from services.presets import init_model

    from .hf_oracle import generate_with_logits

    load, device = kernels
    path = init_model(tmp_path / "fp8", "tiny", seed=3, fp8=True, fp8_block=(16, 16))
    fp8_calls = []
    kernel = load("moe").fused_moe
    monkeypatch.setattr(load("moe"), "fused_moe",
                        lambda *a, **kw: fp8_calls.append(a[3].dtype == torch.float8_e4m3fn) or kernel(*a, **kw))  # fmt: skip
    prompts = [[0, 5, 6, 7], list(range(3, 70))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for flag, names in (("0", WITHOUT), ("1", TRITON)):
        engine = LocalEngine(
            EngineConfig(model=str(path), device=device, max_num_seqs=4, keep_fp8_experts=True, kernels=names)
        )
        outs[flag] = generate_with_logits(engine, prompts, params)
    assert fp8_calls and all(fp8_calls)
    assert [o.token_ids for o in outs["1"][0]] == [o.token_ids for o in outs["0"][0]]
    for a, b in zip(outs["1"][1], outs["0"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "M, N, K, block, dtype",
    [
        (1, 72, 96, (16, 32), torch.float32),  # a partial row block and N tile
        (20, 64, 160, (128, 128), torch.float32),  # a partial column block (160 = 128 + 32)
        (70, 130, 64, (64, 16), torch.float32),  # several M tiles, 16-wide column blocks
        (5, 72, 96, (16, 32), torch.bfloat16),
        (3, 40, 96, (16, 48), torch.float32),  # a 48-wide column block: 16-wide K tiles
    ],
)
@pytest.mark.parametrize("native", [True, False], ids=["e4m3", "uint8 bits"])
def test_fp8_linear_matches_the_dequantized_weight(kernels, monkeypatch, M, N, K, block, dtype, native):
    """A linear kept FP8 (weight-only FP8 GEMM): F.linear on fp8.dequantize_fp8_blocks's
    values, with and without a bias, with K whole or split (the bias added once); the weights read
    as e4m3 (sm_89+) and as uint8 bytes converted with integer ops (GPUs without e4m3: A100)."""
    monkeypatch.setattr(hardware, "fp8_native", lambda t: native)
    from services.model.fp8 import dequantize_fp8_blocks, fp8_scale_shape, quantize_fp8_blocks

    load, device = kernels
    g = torch.Generator().manual_seed(M)
    weight, scale = quantize_fp8_blocks(torch.randn(N, K, generator=g) * 0.05, block)
    assert scale.shape == fp8_scale_shape((N, K), block)
    real = dequantize_fp8_blocks(weight, scale, block)
    x, bias = torch.randn(M, K, generator=g), torch.randn(N, generator=g)
    for b, splits in ((None, None), (bias, None), (bias, 1), (bias, 3)):  # K split in 1-3 parts
        y = load("linear").fp8_linear(x.to(device, dtype), weight.to(device), scale.to(device), block,
                                      None if b is None else b.to(device, dtype), splits=splits)  # fmt: skip
        assert y.shape == (M, N) and y.dtype == dtype
        want = F.linear(x.to(dtype).float(), real, b)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(y.float().cpu(), want, rtol=tol, atol=tol)


def test_engine_with_linears_kept_fp8_on_the_triton_kernels_keeps_greedy_outputs(
    tmp_path, kernels, monkeypatch
):
    """keep_fp8_linears and keep_fp8_experts with the Triton kernels on: the FP8 linear kernel reads
    the linears as held; the same greedy tokens as the torch path."""
    from services.engine.engine import EngineConfig, LocalEngine
    from services.engine.sampling import SamplingParams
    from services.presets import init_model

    load, device = kernels
    path = init_model(tmp_path / "fp8", "tiny", seed=3, fp8=True, fp8_block=(16, 16))
    calls = []  # (weight dtype, whether the kernel gave a result) of each call
    kernel = load("linear").fp8_linear

    def counted(*args, **kwargs):
        y = kernel(*args, **kwargs)
        calls.append((args[1].dtype, y is not None))
        return y

    monkeypatch.setattr(load("linear"), "fp8_linear", counted)
    prompts = [[0, 5, 6, 7], list(range(3, 40))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = {}
    for flag, names in (("0", WITHOUT), ("1", TRITON)):
        cfg = EngineConfig(model=str(path), device=device, max_num_seqs=4, keep_fp8_experts=True,
                           keep_fp8_linears=True, kernels=names)  # fmt: skip
        engine = LocalEngine(cfg)
        outs[flag] = [o.token_ids for o in engine.generate(prompts, params)]
    assert calls and set(calls) == {(torch.float8_e4m3fn, True)}
    assert engine.kernels.names()["fp8_linear"] == "triton" and not engine.kernels.reasons()["fp8_linear"]
    assert outs["1"] == outs["0"]  # (and none went back to torch: no failure among the reasons)
