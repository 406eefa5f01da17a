"""Deterministic mode (#53, EngineConfig.deterministic; kernels/deterministic.py): a request's logits,
bit for bit, do not depend on the batch it lands in, on how its prompt is chunked, or on which and
how many expert workers compute its experts; and without the flag they do (on this CPU)."""

import random

import pytest
import torch

from services.dataplane.remote_experts import sum_rows
from services.engine.engine import EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.experts.store import SlotStore
from services.model.checkpoint import CheckpointReader
from services.model.config import ModelConfig
from services.model.kernels import deterministic
from services.model.kernels.deterministic import expand_dispatch, sum_choices
from services.model.kernels.select import select_kernels
from services.model.messages import ExpertDispatch
from services.model.moe import LocalExperts
from services.presets import PRESETS

from .staggered import run_staggered

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TINY = ModelConfig.from_hf(PRESETS["tiny"])


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(4, 384) for _ in range(rng.randint(3, 90))] for _ in range(n)]


def _run(engine: LocalEngine, prompts, stagger: int = 0) -> list[torch.Tensor]:
    """Each prompt's logits [steps, vocab] (greedy), the prompts added together or (stagger) one
    every `stagger` steps."""
    return [logits for _, logits in run_staggered(engine, prompts, GREEDY, stagger)]


def _engine(model, deterministic: bool, kernels="auto", weight_dtype=None, tokens=2048) -> LocalEngine:
    return LocalEngine(EngineConfig(model=str(model), deterministic=deterministic, kernels=kernels,
                                    weight_dtype=weight_dtype, max_num_seqs=min(tokens, 64),
                                    max_num_batched_tokens=tokens))  # fmt: skip


def _differing_rows(runs_a, runs_b) -> int:
    return sum(int((a != b).any(dim=1).sum()) for a, b in zip(runs_a, runs_b, strict=True))


@pytest.mark.parametrize(
    "kernels, weight_dtype",
    [("auto", None), ("torch", None), ("auto", "bfloat16")],
    ids=["cpp", "torch", "bf16w"],
)
def test_logits_do_not_depend_on_batch_or_chunking(tiny_model, kernels, weight_dtype):
    prompts = _prompts(12)
    engine = _engine(tiny_model, True, kernels, weight_dtype)
    assert engine.kernels.deterministic and "(deterministic)" in engine.kernels.summary()
    alone = [_run(engine, [p])[0] for p in prompts]
    together = _run(engine, prompts)  # one prefill step, then 12 decode rows a step (> 8: chunked)
    staggered = _run(engine, prompts, stagger=2)  # prefills beside decodes: the unfused layer
    chunked = _run(_engine(tiny_model, True, kernels, weight_dtype, tokens=16), prompts)  # 16-token chunks
    for other in (together, staggered, chunked):
        assert _differing_rows(alone, other) == 0


def test_per_choice_combine_gives_the_in_process_bits(tiny_model):
    """The model's own combine (one row per (token, choice), as it asks expert workers for) gives
    LocalEngine's logits bit for bit: a cluster's tokens are LocalEngine's."""
    prompts = _prompts(12, seed=3)
    local = _run(_engine(tiny_model, True), prompts)
    per_choice = _engine(tiny_model, True)
    assert per_choice.model.experts_sum_in_order
    per_choice.model.experts_sum_in_order = False  # (what an attention worker's model does)
    assert _differing_rows(local, _run(per_choice, prompts)) == 0


def test_without_the_flag_logits_depend_on_the_batch(tiny_model):
    """The flag matters here: the default kernels sum a row in another order in a 12-row step
    (C++ register tiles, MKL, the expanded prefill attention) than alone."""
    prompts = _prompts(12)
    engine = _engine(tiny_model, False)
    alone = [_run(engine, [p])[0] for p in prompts]
    assert _differing_rows(alone, _run(engine, prompts)) > 0
    assert _differing_rows(alone, _run(_engine(tiny_model, False, tokens=16), prompts)) > 0


@pytest.mark.parametrize("allow", ["auto", "torch"])
def test_each_kernel_gives_a_row_the_same_bits_in_any_batch(allow):
    k = select_kernels("cpu", torch.float32, TINY, allow=allow, deterministic=True)
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    H, E, N, D, C, V = TINY.hidden_size, TINY.n_routed_experts, 4, 16, 32, 16
    w, w13, w2, gate, bias = rand(96, H), rand(128, H), rand(H, 64), rand(E, H), rand(E)
    ew13, ew2, kv_b, cache = rand(E, 64, H), rand(E, H, 32), rand(N, D + V, C), rand(20, 64, 1, C + 8)
    slot, weight = torch.randint(0, E, (40, 2), generator=g), torch.rand(40, 2, generator=g)
    slot[:, 1] = (slot[:, 0] + 1 + slot[:, 1] % (E - 1)) % E  # (two experts per token)
    table, lens = torch.randint(0, 20, (40, 3), generator=g), torch.randint(1, 190, (40,), generator=g)
    cases = {  # name: (f(x, m): the kernel on x's first m rows, x)
        "linear": (lambda x, m: k.linear(x[:m], w), rand(40, H)),
        "route": (lambda x, m: k.route(x[:m], gate, bias)[1], rand(40, H)),
        "dense_ffn": (lambda x, m: k.dense_ffn(x[:m], w13, w2), rand(40, H)),
        "expert_ffn": (lambda x, m: k.expert_ffn(x[:m], slot[:m], weight[:m], ew13, ew2), rand(40, H)),
        "absorb_q": (lambda x, m: k.absorb_q(x[:m], kv_b), rand(40, N, D)),
        "absorb_o": (lambda x, m: k.absorb_o(x[:m], kv_b, D), rand(40, N, C)),
        "mla_decode": (lambda x, m: k.mla_decode(x[:m], cache, deterministic._Rows(table[:m], lens[:m]), C, 0.1),
                       rand(40, N, C + 8)),
    }  # fmt: skip
    for name, (f, x) in cases.items():
        alone = torch.cat([f(x, m)[m - 1 : m] for m in range(1, 41)])  # each row as the last of m rows
        for m in (2, 9, 17, 40):
            assert torch.equal(f(x, m), alone[:m]), (name, m)


def test_sigmoid_and_silu_do_not_depend_on_the_tensor_size():
    x = torch.randn(300, 16, generator=torch.Generator().manual_seed(0)) * 4
    for fn in (deterministic.sigmoid, deterministic.silu):
        alone = torch.cat([fn(x[i : i + 1]) for i in range(300)])
        assert torch.equal(fn(x), alone)
    torch.testing.assert_close(deterministic.sigmoid(x), torch.sigmoid(x), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(deterministic.silu(x), torch.nn.functional.silu(x), rtol=1e-6, atol=1e-7)


# ---- the expert side: any number of workers, any placement ----------------------------------
@pytest.fixture(scope="module")
def experts(tiny_model):
    cfg = ModelConfig.from_dir(tiny_model)
    reader = CheckpointReader.for_config(tiny_model, cfg)
    local = LocalExperts.load_all(reader, cfg, torch.float32)
    reader.close()
    return tiny_model, cfg, local


def _placements(cfg, workers: int, seed: int) -> list[list[int]]:
    """Each worker's logical experts in slot order: every expert once, shuffled, plus a replica."""
    order = list(range(cfg.n_routed_experts))
    random.Random(seed).shuffle(order)
    per = [order[w::workers] for w in range(workers)]
    per[-1].append(per[0][0])  # a replica of one expert on another worker (or slot)
    return per


def _workers_combine(stores, placement, layer, msg, pick: int) -> torch.Tensor:
    """What the dispatch client and sum_rows make of `msg` over these workers: each (row, choice)
    sent to a worker holding its expert (the `pick`-th such, round robin), the answers summed."""
    T, K = msg.topk_idx.shape
    holders = {}
    for w, experts in enumerate(placement):
        for s, e in enumerate(experts):
            holders.setdefault(e, []).append((w, s))
    local = torch.full((len(stores), T, K), -1, dtype=torch.int32)
    for t in range(T):
        for j in range(K):
            w, s = holders[int(msg.topk_idx[t, j])][(t + j + pick) % len(holders[int(msg.topk_idx[t, j])])]
            local[w, t, j] = s
    answered = []
    for w, store in enumerate(stores):
        rows = torch.nonzero((local[w] >= 0).any(dim=1)).squeeze(1)
        if rows.numel():
            weight = torch.where(local[w][rows] >= 0, msg.topk_weight[rows], 0.0)
            answered.append((rows, store.forward(1, layer, msg.x[rows].contiguous(), local[w][rows].contiguous(),
                                                 weight.contiguous())))  # fmt: skip
    return sum_rows(answered, msg.x)


def _routed(cfg, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, cfg.hidden_size, generator=g)
    idx = torch.stack(
        [torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok] for _ in range(T)]
    )
    return x, idx, torch.rand(T, cfg.num_experts_per_tok, generator=g) * 2.5


def test_expert_outputs_do_not_depend_on_workers_placement_or_batch(experts):
    path, cfg, local = experts
    local.use_kernels(select_kernels("cpu", torch.float32, cfg, deterministic=True))
    layer = cfg.moe_layers[0]
    x, idx, wt = _routed(cfg, 120, seed=1)  # ~30 rows per expert: beyond the decode-size kernels

    def in_process(rows, per_choice: bool):  # (LocalExperts adds a token's experts in expert order itself)
        if per_choice:
            msg = expand_dispatch(layer, 0, x[rows], idx[rows], wt[rows], cfg.n_routed_experts)
            return sum_choices(local.dispatch(msg), idx[rows])
        return local.dispatch(
            ExpertDispatch.routed(layer, 0, x[rows], idx[rows], wt[rows], cfg.n_routed_experts)
        )

    want = in_process(slice(None), False)
    assert torch.equal(in_process(slice(None), True), want)
    assert torch.equal(torch.cat([in_process(slice(t, t + 1), False) for t in range(120)]), want)  # alone
    for workers, seed in ((1, 0), (3, 1), (3, 2), (2, 3)):
        placement = _placements(cfg, workers, seed)
        stores = []
        for experts_of in placement:
            store = SlotStore(cfg, path, torch.float32, deterministic=True)
            store.load(1, {moe: experts_of for moe in cfg.moe_layers})
            stores.append(store)
        msg = expand_dispatch(layer, 0, x, idx, wt, cfg.n_routed_experts)
        got = sum_choices(_workers_combine(stores, placement, layer, msg, pick=seed), idx)
        assert torch.equal(got, want), (workers, seed)


def test_without_the_flag_the_combine_depends_on_the_workers(experts):
    """Per-worker partial sums, then a sum over workers: another order of the same fp32 adds (and
    at these sizes the workers' grouped matmuls sum each product in another order too)."""
    path, cfg, local = experts
    local.use_kernels(select_kernels("cpu", torch.float32, cfg))
    layer = cfg.moe_layers[0]
    x, idx, wt = _routed(cfg, 120, seed=1)
    msg = ExpertDispatch.routed(layer, 0, x, idx, wt, cfg.n_routed_experts)
    want = local.dispatch(msg)
    placement = _placements(cfg, 3, 1)
    stores = []
    for experts_of in placement:
        store = SlotStore(cfg, path, torch.float32)
        store.load(1, {moe: experts_of for moe in cfg.moe_layers})
        stores.append(store)
    got = _workers_combine(stores, placement, layer, msg, pick=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, want)


def test_refused_where_there_are_no_batch_invariant_kernels():
    if not torch.cuda.is_available():  # (on CUDA: the Triton kernels, tests/test_deterministic_triton.py)
        with pytest.raises(ValueError, match="deterministic: CPU only on this machine"):
            select_kernels("cuda", torch.float32, TINY, deterministic=True)
    for preset in ("tiny-v4", "tiny-v32"):  # (V3.2 and V4: tests/test_deterministic_v32_v4.py)
        assert select_kernels(
            "cpu", torch.float32, ModelConfig.from_hf(PRESETS[preset]), deterministic=True
        ).deterministic
    experts = select_kernels("cpu", torch.float32, ModelConfig.from_hf(PRESETS["tiny-v4"]), scope="experts",
                             deterministic=True)  # fmt: skip
    assert experts.deterministic


def test_the_flag_reaches_the_engine_from_cli_and_yaml():
    from services.attention.worker import AttentionWorkerConfig
    from services.cli import build_parser, up_flags
    from services.cluster import ClusterConfig

    assert "deterministic" in up_flags()
    assert build_parser().parse_args(["generate", "--deterministic"]).deterministic
    for given, on in (
        ({"deterministic": True}, True),
        ({"shared": {"deterministic": True}}, True),
        ({}, False),
    ):
        cfg = ClusterConfig.from_dict(given)
        assert (
            AttentionWorkerConfig.from_settings(cfg.attention, cfg.shared, "/model").engine.deterministic
            is on
        )
