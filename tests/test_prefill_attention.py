"""Tiled prefill attention (kernels/torch_ops.prefill_attention, the torch implementation of MLA
prefill) against the whole-matrix softmax it
replaces: causal chunks at the end of a longer context, several key and query tiles, score
magnitudes that move the running max."""

import pytest
import torch

from services.model.kernels import torch_ops as model
from services.model.kv_cache import BLOCK_SIZE

N, D, R, V, C = 4, 16, 8, 16, 32


def _case(L, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    nblocks = -(-L // BLOCK_SIZE)
    cache = torch.randn(nblocks + 3, BLOCK_SIZE, 1, C + R, generator=g)
    blocks = torch.randperm(nblocks + 3, generator=g)[:nblocks]  # scattered, as the allocator gives
    q = torch.randn(n, N, D + R, generator=g)
    kv_b = torch.randn(N, D + V, C, generator=g) / C**0.5
    return q, cache, blocks, kv_b


def _reference(q, cache, blocks, L, kv_b, scale):
    """The whole [N, n, L] score matrix at once (what mla_forward did before)."""
    n = q.shape[0]
    ctx = cache[blocks].view(-1, C + R)[:L]
    kv = (ctx[:, :C] @ kv_b.view(-1, C).t()).view(L, N, D + V)
    k = torch.cat((kv[..., :D], ctx[:, None, C:].expand(L, N, R)), dim=-1)
    scores = torch.einsum("qnd,knd->nqk", q, k) * scale
    visible = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
    scores.masked_fill_(~visible[None], float("-inf"))
    return torch.einsum("nqk,knv->qnv", scores.softmax(-1), kv[..., D:])


@pytest.mark.parametrize("L, n", [(5, 5), (64, 64), (300, 300), (300, 37), (1000, 1), (1000, 130)])
@pytest.mark.parametrize("score_bytes", [32 << 20, 4 * N * 64 * 16])  # one query tile; tiles of 16 queries
def test_tiled_equals_whole_softmax(monkeypatch, L, n, score_bytes):
    monkeypatch.setattr(model, "PREFILL_KEY_TILE", 64)
    monkeypatch.setattr(model, "PREFILL_SCORE_BYTES", score_bytes)
    q, cache, blocks, kv_b = _case(L, n)
    got = model.prefill_attention(q[..., :D], q[..., D:], cache, blocks, L, kv_b, C, 0.3)
    torch.testing.assert_close(got, _reference(q, cache, blocks, L, kv_b, 0.3), rtol=1e-5, atol=1e-5)


def test_large_score_magnitudes_stay_finite(monkeypatch):
    """Scores far below zero in early tiles and far above in later ones (the running max moves)."""
    monkeypatch.setattr(model, "PREFILL_KEY_TILE", 64)
    L, n = 256, 256
    q, cache, blocks, kv_b = _case(L, n, seed=3)
    got = model.prefill_attention(q[..., :D] * 40, q[..., D:] * 40, cache, blocks, L, kv_b, C, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _reference(q * 40, cache, blocks, L, kv_b, 1.0), rtol=1e-4, atol=1e-4)
