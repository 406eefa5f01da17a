"""The FP8 latent cache (`kv_cache_dtype="fp8"`, FlashMLA's "FP8 with scale" rows): the layout's
bytes, quantization error, the C++ decode kernel reading the rows in place against torch on the
dequantized rows, and engines on it: greedy tokens against the full-precision cache, and prefix
caching, chunked prefill and preemption giving the same tokens as without them."""

import pytest
import torch

from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.model.batch import DecodeRows
from services.model.config import ModelConfig
from services.model.kernels import cpu_kernels
from services.model.kv_cache import (
    BLOCK_SIZE,
    Fp8Groups,
    Model1,
    PackedRows,
    V4Cache,
    dequantize_index_keys,
    dequantize_latent_rows,
    fp8_latent_bytes,
    fp8_row_bytes,
    quantize_latent_rows,
)
from services.presets import PRESETS

from .hf_oracle import V3_YARN, make_hf_checkpoint, random_prompts


def test_row_layout_bytes():
    assert fp8_row_bytes(512, 64) == 656  # DeepSeek-V3 / FlashMLA: 512 e4m3 + 4 fp32 + 64 bf16
    g = torch.Generator().manual_seed(0)
    c_kv, k_pe = torch.randn(5, 512, generator=g) * 3, torch.randn(5, 64, generator=g)
    rows = quantize_latent_rows(c_kv, k_pe)
    assert rows.dtype == torch.uint8 and rows.shape == (5, 656)
    # the layout, byte by byte: e4m3 c_kv, then the 4 fp32 scales (|max| / 448 per 128), then bf16 k_pe
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    torch.testing.assert_close(scales, c_kv.view(5, 4, 128).abs().amax(-1) / 448)
    assert torch.equal(rows[:, 528:].contiguous().view(torch.bfloat16), k_pe.to(torch.bfloat16))
    back = dequantize_latent_rows(rows, 512, 64)
    assert back.shape == (5, 576)
    err = (back[:, :512] - c_kv).abs().view(5, 4, 128)
    assert bool((err <= c_kv.view(5, 4, 128).abs() * 2**-4 + scales[..., None] * 2**-9).all())  # e4m3: 3 bits
    assert torch.equal(back[:, 512:], k_pe.to(torch.bfloat16).float())


def test_v32_rows_carry_fp8_indexer_keys():
    """DeepSeek-V3.2's rows: the V3 row, then the indexer key as e4m3 with one fp32 scale per 128
    values (FlashMLA's V3.2 format: 656 + 132 = 788 bytes, zero-padded to 800: rows are multiples
    of 16 bytes for the GPU kernels); keys of <= 128 values take one scale."""
    assert fp8_row_bytes(512, 64, 128) == 800 and fp8_row_bytes(128, 16, 16) == 192  # (184 used)
    assert fp8_latent_bytes(128, 16) == 128 + 4 + 32 and fp8_row_bytes(128, 16) == 176
    g = torch.Generator().manual_seed(1)
    c_kv, k_pe, key = (torch.randn(3, n, generator=g) for n in (512, 64, 128))
    rows = quantize_latent_rows(c_kv, k_pe, key * 5)
    assert rows.shape == (3, 800) and torch.equal(rows[:, :656], quantize_latent_rows(c_kv, k_pe))
    assert not rows[:, 788:].any()  # the pad
    assert torch.equal(rows[:, 784:].contiguous().view(torch.float32)[:, 0], (key * 5).abs().amax(-1) / 448)
    back = dequantize_index_keys(rows[:, 656:], 128)
    assert bool(((back - key * 5).abs() <= (key * 5).abs() * 2**-4 + 1e-6).all())
    assert torch.equal(dequantize_latent_rows(rows, 512, 64), dequantize_latent_rows(rows[:, :656], 512, 64))
    short = quantize_latent_rows(c_kv[:, :128], k_pe[:, :16], key[:, :16])
    assert short.shape == (3, fp8_row_bytes(128, 16, 16))
    torch.testing.assert_close(dequantize_index_keys(short[:, 164:], 16), key[:, :16], atol=0.1, rtol=0.07)


def test_v4_model1_rows():
    """DeepSeek-V4's FP8 rows, FlashMLA's MODEL1: 448 e4m3 + 64 bf16 rope, then 7 UE8M0 scales (a
    power of two each, the least >= the tile's largest |value| / 448, stored as its exponent +
    127) and 1 pad byte: 584 bytes."""
    m = Model1(512, 64)
    assert m.sections == (448 + 128, 8)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 512, generator=g) * 3
    x[0, :64] = torch.linspace(-448 * 4, 100, 64)  # largest |value| exactly 448 * 2^2: scale 2^2
    x[1, 64:128] = 0.0
    data, scales = m.encode(x)
    assert data.shape == (5, 576) and scales.shape == (5, 8) and not scales[:, 7].any()
    amax = x[:, :448].view(5, 7, 64).abs().amax(-1)
    assert scales[0, 0] == 2 + 127 and scales[1, 1] == 127  # (a zero tile: scale 1)
    expected = torch.ceil(torch.log2(amax / 448)).clamp(min=0) * (amax > 0) + 127
    assert torch.equal(
        scales[:, :7].float(), torch.where(amax > 0, torch.ceil(torch.log2(amax / 448)) + 127, expected)
    )
    assert torch.equal(data[:, 448:].contiguous().view(torch.bfloat16), x[:, 448:].to(torch.bfloat16))
    back = m.decode([data, scales], torch.float32)
    step = torch.exp2(scales[:, :7].float() - 127)[..., None]  # each tile's scale
    err = (back[:, :448] - x[:, :448]).abs().view(5, 7, 64)
    assert bool((err <= x[:, :448].abs().view(5, 7, 64) * 2**-4 + step * 2**-9).all())  # e4m3: 3 bits
    assert back[0, 0] == -448 * 4 and not back[1, 64:128].any()
    assert torch.equal(back[:, 448:], x[:, 448:].to(torch.bfloat16).float())
    assert Model1(32, 8).sections == (24 + 16, 8)  # (one shorter tile: the tiny preset)
    with pytest.raises(ValueError, match="MODEL1 rows need head_dim - rope <= 64 or a multiple, got 96"):
        Model1(104, 8)


def test_v4_fp8_blocks_hold_their_rows_section_by_section():
    """A block of V4 FP8 rows holds, as FlashMLA's MODEL1 blocks do, all its rows' [nope | rope]
    bytes, then all their scales (then, for CSA entries, the indexer keys and their scales);
    reads give the model's dtype, a column range within one field."""
    rows = PackedRows([Model1(32, 8), Fp8Groups(16)], num_blocks=3, rows_per_block=16, dtype=torch.float32)
    assert rows.data.shape == (3, 16 * (40 + 8 + 16 + 4))
    g = torch.Generator().manual_seed(3)
    at, values = torch.tensor([5, 20, 47]), torch.randn(3, 48, generator=g)
    rows.write(at, slice(0, None), values)
    block = rows.data[1]  # row 20: block 1, slot 4
    data, scales = Model1(32, 8).encode(values[1:2, :32])
    keys = Fp8Groups(16).encode(values[1:2, 32:])
    assert torch.equal(block[4 * 40 : 5 * 40], data[0]) and torch.equal(
        block[640 + 4 * 8 : 640 + 5 * 8], scales[0]
    )
    assert torch.equal(block[768 + 4 * 16 : 768 + 5 * 16], keys[0][0])
    assert torch.equal(block[1024 + 4 * 4 : 1024 + 5 * 4], keys[1][0])
    assert block[: 4 * 40].eq(0).all() and rows.data[0, : 5 * 40].eq(0).all()  # nothing else written
    got = rows.read(at.view(3, 1), slice(0, 32))
    assert got.shape == (3, 1, 32) and got.dtype == torch.float32
    torch.testing.assert_close(got[:, 0], values[:, :32], atol=0.1, rtol=0.07)
    torch.testing.assert_close(rows.read(at, slice(32, 48)), values[:, 32:], atol=0.1, rtol=0.07)
    torch.testing.assert_close(rows.read(at, slice(34, 40)), rows.read(at, slice(32, 48))[:, 2:8])
    whole = rows.read(at, slice(0, None))  # whole fields, one after the other
    assert whole.shape == (3, 48) and torch.equal(
        whole, torch.cat((got[:, 0], rows.read(at, slice(32, 48))), -1)
    )
    for cols in (slice(36, 48), slice(0, 40), slice(0, 20)):  # not whole fields: refused, never dropped
        with pytest.raises(ValueError, match="not whole fields"):
            rows.write(at, cols, values[:, cols])
    with pytest.raises(ValueError, match="not whole fields"):
        rows.read(at, slice(20, 40))
    # blocks are whole multiples of 16 bytes (GPU loads): one 584 + 8 ... row per block is padded
    assert PackedRows([Model1(512, 64)], num_blocks=2, rows_per_block=1, dtype=torch.bfloat16).data.shape == (
        2,
        592,
    )


def test_v4_fp8_capacity():
    """DeepSeek-V4 (the published config): compressed entries, the cache that grows with the
    context, take 1.78x fewer bytes in FP8 than in bf16 (CSA: 584 + 132 against 1,280 bytes; HCA 592
    against 1,024); the window state keeps its compressor inputs in bf16 (1.1x)."""
    import json

    from transformers import DeepseekV4Config

    cfg = ModelConfig.from_hf(json.loads(DeepseekV4Config().to_json_string()))
    (entries, state), (entries8, state8) = (
        V4Cache.bytes_per_block(cfg, torch.bfloat16, fp8) for fp8 in (False, True)
    )
    assert entries == 64 * 6768 and entries8 == 20 * 16 * (584 + 132) + 23 * 592  # (HCA: 1 entry, padded)
    assert entries / entries8 > 1.78 and 1.1 < state / state8 < 1.2
    fp8, full = (EngineConfig(model="-", dtype="bfloat16", kv_cache_gib=12, num_state_blocks=64, max_num_seqs=64,
                              kv_cache_dtype=kv) for kv in ("fp8", "auto"))  # fmt: skip
    assert fp8.kv_blocks(cfg, 65536) > 1.78 * full.kv_blocks(cfg, 65536)  # (the same GiB)
    with pytest.raises(ValueError, match="index_head_dim <= 128 or a multiple, got 144"):
        fp8.fp8_cache(ModelConfig.from_hf({**PRESETS["tiny-v4"], "index_head_dim": 144}))
    assert fp8.fp8_dims(cfg) is None  # (V3 / V3.2 rows only)


@pytest.mark.parametrize("lens", [[1, 70, 200], [130]])
def test_decode_kernel_reads_fp8_rows(lens):
    if not cpu_kernels.available():
        pytest.skip("no CPU kernels")
    g = torch.Generator().manual_seed(len(lens))
    C, R, N, blocks = 128, 16, 6, 16
    cache = quantize_latent_rows(torch.randn(blocks * BLOCK_SIZE, C, generator=g),
                                 torch.randn(blocks * BLOCK_SIZE, R, generator=g)).view(blocks, BLOCK_SIZE, 1, -1)  # fmt: skip
    B, MB = len(lens), 4
    table = torch.stack([torch.randperm(blocks, generator=g)[:MB] for _ in lens])
    lens_t = torch.tensor(lens)
    q = torch.randn(B, N, C + R, generator=g)
    kernels = cpu_kernels.CppKernels(cpu_kernels._module(), None)  # (the decode kernel, called directly)
    got = kernels.mla_decode_fp8(q, cache, DecodeRows(None, None, table, lens_t), C, 0.1)
    ctx = dequantize_latent_rows(cache[table].view(B, -1, cache.shape[-1]), C, R)
    scores = torch.bmm(q, ctx.transpose(1, 2)) * 0.1
    scores.masked_fill_(torch.arange(ctx.shape[1])[None, None, :] >= lens_t[:, None, None], float("-inf"))
    torch.testing.assert_close(got, torch.bmm(scores.softmax(-1), ctx[..., :C]), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A V3 checkpoint whose kv_lora_rank is a multiple of 128 (the FP8 rows' scale groups)."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("fp8cache") / "v3", rope_parameters=V3_YARN,
                              kv_lora_rank=128, vocab_size=320)  # fmt: skip


def _run(path, prompts, **engine):
    e = LocalEngine(EngineConfig(model=str(path), **engine))
    return [
        c.token_ids
        for c in e.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    ]


def top1_agreement(full, other, prompts, outs) -> tuple[int, int]:
    """Teacher-forced along `full`'s greedy outputs `outs` (prompt logprobs of prompt + output, so
    one early difference does not derail the rest): (positions where `other`'s top-1 is `full`'s,
    positions)."""
    scored = SamplingParams(max_tokens=1, prompt_logprobs=1)
    agree = total = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ids = prompt + out.token_ids
        a, b = (e.generate([ids], scored)[0].prompt_logprobs[len(prompt) :] for e in (full, other))
        agree += sum(x.top[0][0] == y.top[0][0] for x, y in zip(a, b, strict=True))
        total += len(a)
    return agree, total


def test_fp8_engine_follows_the_full_precision_cache(checkpoint):
    """Teacher-forced along the full-precision cache's greedy output (prompt logprobs of prompt +
    output, so one early difference does not derail the rest): the FP8 cache's top-1 agrees at
    most positions (measured 88 % over 300 here, where bf16 weights alone change ~10-50 % of a
    random model's flat top-1s: benchmarks/results/fp8_cache.json), and its first tokens are the same."""
    prompts = random_prompts(320, seed=1, lengths=[5, 60, 130])
    full = LocalEngine(EngineConfig(model=str(checkpoint)))
    fp8 = LocalEngine(EngineConfig(model=str(checkpoint), kv_cache_dtype="fp8"))
    greedy = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    outs = full.generate(prompts, greedy)
    assert [c.token_ids[:2] for c in outs] == [c.token_ids[:2] for c in fp8.generate(prompts, greedy)]
    agree, total = top1_agreement(full, fp8, prompts, outs)
    assert agree >= 0.75 * total, agree / total


def test_prefix_caching_chunked_prefill_and_preemption_on_fp8(checkpoint):
    """Cache features work on FP8 rows: the same tokens with each of them on or off."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(320, seed=2, lengths=[150, 150])
    prompts[1][:128] = prompts[0][:128]  # a shared 2-block prefix
    plain = _run(checkpoint, prompts, kv_cache_dtype="fp8", prefix_caching=False)
    engine = LocalEngine(EngineConfig(model=str(checkpoint), kv_cache_dtype="fp8", max_num_batched_tokens=48,
                                      max_num_seqs=4))  # fmt: skip
    first = engine.generate(prompts[:1], params)[0].token_ids  # (chunks of 48)
    second = engine.generate(prompts[1:], params)[0].token_ids  # (a prefix hit on FP8 blocks)
    assert engine.scheduler.prefix_hit_tokens >= 128
    assert [first, second] == plain
    # two 120-token prompts growing to 144 (3 blocks each) in 5 blocks: one is preempted, recomputed
    prompts = random_prompts(320, seed=3, lengths=[120, 120])
    plain = _run(checkpoint, prompts, kv_cache_dtype="fp8", prefix_caching=False)
    tight = LocalEngine(EngineConfig(model=str(checkpoint), kv_cache_dtype="fp8", num_kv_blocks=5))
    assert [c.token_ids for c in tight.generate(prompts, params)] == plain
    assert tight.scheduler.num_preemptions >= 1


def test_capacity_and_refusals(tmp_path):
    cfg = ModelConfig.from_hf(PRESETS["small"])
    full = EngineConfig(model="-", kv_cache_gib=1.0)
    fp8 = EngineConfig(model="-", kv_cache_gib=1.0, kv_cache_dtype="fp8", max_num_seqs=10**6)
    full.max_num_seqs = 10**6
    assert fp8.kv_blocks(cfg, 4096) / full.kv_blocks(cfg, 4096) >= 1.9  # (fp32 rows: 576 x 4 / 176 B)
    assert fp8.latent_bytes_per_token(cfg) == cfg.num_hidden_layers * fp8_row_bytes(128, 16)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        EngineConfig(model="-", kv_cache_dtype="fp8").fp8_dims(ModelConfig.from_hf(PRESETS["tiny"]))
    v32 = ModelConfig.from_hf({**PRESETS["tiny-v32"], "kv_lora_rank": 128})  # (index_head_dim 16)
    assert EngineConfig(model="-", kv_cache_dtype="fp8").fp8_dims(v32) == (128, v32.qk_rope_head_dim, 16)
    with pytest.raises(ValueError, match="index_head_dim"):
        EngineConfig(model="-", kv_cache_dtype="fp8").fp8_dims(
            ModelConfig.from_hf({**PRESETS["tiny-v32"], "kv_lora_rank": 128, "index_head_dim": 192})
        )
    with pytest.raises(ValueError, match="'auto' or 'fp8'"):
        EngineConfig(model="-", kv_cache_dtype="int4").fp8_dims(cfg)


@pytest.mark.parametrize("model", ["v3", "v32"])
def test_fp8_rows_on_the_triton_kernels_keep_greedy_outputs(tmp_path, monkeypatch, model):
    """The GPU's path over FP8 rows (under triton's interpreter here): the Triton MLA kernel reads
    them in place in decode and prefill (V3: each query a row of its own causal length; V3.2: the
    rows its indexer picks, its keys in the rows' tails), and gives the C++ kernel's / torch
    path's greedy tokens and close logits, a prompt across a block boundary and a batch mixing
    prefill chunks and decodes."""
    pytest.importorskip("triton")
    from services.model.kernels import triton_mla

    from .hf_oracle import generate_with_logits

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if model == "v3":  # V3's 656-byte rows
        checkpoint = make_hf_checkpoint(tmp_path / "v3", rope_parameters=V3_YARN, kv_lora_rank=512,
                                        qk_rope_head_dim=64, vocab_size=320)  # fmt: skip
    else:  # V3.2's rows: 148 latent bytes, the 16-value key and its scale, padded to 176
        checkpoint = make_hf_checkpoint(
            tmp_path / "v32", model_type="deepseek_v32", kv_lora_rank=128, vocab_size=320
        )
    read = []
    kernel = triton_mla.mla_decode
    monkeypatch.setattr(
        triton_mla,
        "mla_decode",
        lambda q, cache, *a, **kw: read.append(cache.dtype) or kernel(q, cache, *a, **kw),
    )
    prompts = random_prompts(320, seed=2, lengths=[4, 70, 21])
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(kernels: str):
        engine = LocalEngine(EngineConfig(model=str(checkpoint), device=device, kv_cache_dtype="fp8",
                                          max_num_seqs=4, max_num_batched_tokens=48, kernels=kernels))  # fmt: skip
        return engine, *generate_with_logits(engine, prompts, params)

    _, ref, ref_logits = run("cpp,torch" if device == "cpu" else "torch")
    assert not read
    engine, out, logits = run("triton,cpp,torch" if device == "cpu" else "triton,torch")
    attention = "mla_decode" if model == "v3" else "mla_sparse_decode"
    assert read and set(read) == {torch.uint8} and engine.kernels.names()[attention] == "triton"
    assert "triton" not in engine.kernels.reasons()[attention]  # (none failed)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    tol = 1e-4 if device == "cpu" else 1e-3  # (on an H200 3e-4 apart: other kernels' sums too)
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def v32_checkpoint(tmp_path_factory):
    """A V3.2 checkpoint (transformers' DeepseekV32) whose kv_lora_rank is a multiple of 128."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("fp8v32") / "v32", model_type="deepseek_v32",
                              kv_lora_rank=128, vocab_size=320)  # fmt: skip


def test_v32_fp8_rows_follow_the_full_precision_cache(v32_checkpoint):
    """DeepSeek-V3.2 on FP8 rows (latent and indexer keys): its first tokens are the full cache's,
    its top-1 agrees at most positions teacher-forced along the full cache's output (as the V3 test
    above; 68 % measured here: this random model's flat distributions amplify the latent's
    rounding layer by layer, 2.5 % in layer 0's rows, 22 % by layer 2's; the FP8 keys alone
    change no top-1), over contexts longer than the indexer's top-k (16) so the keys choose the
    rows; and layer 0's rows hold the full cache's values within each format's rounding."""
    prompts = random_prompts(320, seed=4, lengths=[5, 60, 130])
    full = LocalEngine(EngineConfig(model=str(v32_checkpoint)))
    fp8 = LocalEngine(EngineConfig(model=str(v32_checkpoint), kv_cache_dtype="fp8"))
    assert fp8.cache.kv.dtype == torch.uint8 and fp8.cache.kv.shape[-1] == fp8_row_bytes(128, 8, 16)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = full.generate(prompts, greedy)
    assert [c.token_ids[:1] for c in outs] == [c.token_ids[:1] for c in fp8.generate(prompts, greedy)]
    agree, total = top1_agreement(full, fp8, prompts, outs)
    assert agree >= 0.6 * total, agree / total  # (measured 82 / 120: see below)
    # what the rows hold, layer 0 (before any FP8 difference upstream): each part within its
    # format's rounding of the full cache's values (e4m3: 3 bits, ~2.5 % here; bf16 rope)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    a, b = (LocalEngine(EngineConfig(model=str(v32_checkpoint), prefix_caching=False, **kw))
            for kw in ({}, {"kv_cache_dtype": "fp8"}))  # fmt: skip
    a.generate(prompts[2:], one), b.generate(prompts[2:], one)
    ref, rows = (
        a.cache.kv[0].reshape(-1, a.cache.kv.shape[-1]),
        b.cache.kv[0].reshape(-1, b.cache.kv.shape[-1]),
    )
    used = ref.abs().sum(-1) > 0
    C, R = 128, 8  # (hf_oracle BASE: qk_rope_head_dim 8)
    lat, keys = (
        dequantize_latent_rows(rows[used], C, R),
        dequantize_index_keys(rows[used, fp8_latent_bytes(C, R) :], 16),
    )

    def rel(x, y):
        return ((x - y).norm() / y.norm()).item()

    assert (
        used.sum() == 130 and rel(lat[:, :C], ref[used, :C]) < 0.04 and rel(keys, ref[used, C + R :]) < 0.04
    )
    assert rel(lat[:, C:], ref[used, C : C + R]) < 0.005


def test_v32_prefix_caching_and_chunked_prefill_on_fp8(v32_checkpoint):
    """V3.2's FP8 rows under chunked prefill (each chunk's indexer reads the keys the earlier
    chunks wrote) and a prefix hit on FP8 blocks: the same tokens as one unchunked pass."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(320, seed=5, lengths=[150, 150])
    prompts[1][:128] = prompts[0][:128]
    plain = _run(v32_checkpoint, prompts, kv_cache_dtype="fp8", prefix_caching=False)
    engine = LocalEngine(EngineConfig(model=str(v32_checkpoint), kv_cache_dtype="fp8", max_num_batched_tokens=48,
                                      max_num_seqs=4))  # fmt: skip
    first = engine.generate(prompts[:1], params)[0].token_ids
    second = engine.generate(prompts[1:], params)[0].token_ids
    assert engine.scheduler.prefix_hit_tokens >= 128
    assert [first[:16], second[:16]] == [p[:16] for p in plain]
