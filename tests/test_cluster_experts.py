"""The cluster path: local attention math (`Engine`) + `RemoteExperts` + real expert workers
(Ray actors serving gRPC) give the same greedy tokens and logits as `LocalEngine`, on 1, 2 and 4
workers, with and without redundant replicas, across a re-placement mid-generation, and with a
worker dying mid-generation when its experts have replicas elsewhere."""

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import ray
import torch

from services.dataplane.placement import Placement
from services.dataplane.remote_experts import RemoteExperts
from services.engine.engine import Engine, EngineConfig, LocalEngine
from services.engine.sampling import SamplingParams
from services.engine.tokenizer import Tokenizer
from services.experts.client import ExpertClient, load_placement, release_version
from services.experts.server import ExpertWorkerConfig
from services.experts.worker import ExpertWorker
from services.model.checkpoint import CheckpointReader
from services.model.config import ModelConfig
from services.model.model import DeepseekV3
from services.presets import init_model

from .hf_oracle import V3_YARN, generate_with_logits, hf_greedy, load_hf, make_hf_checkpoint, run_requests

pytestmark = pytest.mark.cluster

NEW_TOKENS = 12
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(
        address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False
    )
    yield
    ray.shutdown()


def start_workers(model_dir: Path, n: int) -> tuple[list, list[str]]:
    actors = [
        ExpertWorker.options(num_cpus=0).remote(ExpertWorkerConfig(model=str(model_dir))) for _ in range(n)
    ]
    return actors, ray.get([a.start.remote() for a in actors])


@dataclass
class Setup:
    name: str
    path: Path
    cfg: ModelConfig
    model: DeepseekV3
    prompts: list[list[int]]
    tokens: list[list[int]]  # LocalEngine's greedy tokens
    logits: list[torch.Tensor]  # LocalEngine's logits at each request's last step
    addresses: list[str]
    versions: list[int] = field(default_factory=lambda: [0])

    def next_version(self) -> int:
        self.versions.append(self.versions[-1] + 1)
        return self.versions[-1]

    def engine(self, experts) -> Engine:
        cfg = EngineConfig(model=str(self.path), max_num_seqs=8, max_num_batched_tokens=32)
        return Engine(self.cfg, self.model, experts, cfg, Tokenizer.from_dir(self.path))


@pytest.fixture(scope="module", params=["tiny", "hf-v3"])
def setup(request, ray_cluster, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "tiny":
        init_model(path, "tiny", seed=0)
    else:
        make_hf_checkpoint(path, seed=2, rope_parameters=V3_YARN)
    cfg = ModelConfig.from_dir(path)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 40)]
    local = LocalEngine(EngineConfig(model=str(path), max_num_seqs=8, max_num_batched_tokens=32))
    outs, logits = generate_with_logits(local, prompts, PARAMS)
    tokens = [o.token_ids for o in outs]
    if request.param == "hf-v3":  # the oracle itself agrees
        hf = load_hf(path)
        assert tokens == [hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts]
    model = DeepseekV3.load(CheckpointReader.for_config(path, cfg), cfg, torch.float32)
    actors, addresses = start_workers(path, 4)
    yield Setup(request.param, path, cfg, model, prompts, tokens, logits, addresses)
    for actor in actors:
        ray.kill(actor)


def _shuffled_redundant(
    cfg: ModelConfig, workers: tuple[str, ...], slots_per_worker: int, seed: int
) -> torch.Tensor:
    """phy2log with every expert at least once and random extra replicas, different per layer."""
    g = torch.Generator().manual_seed(seed)
    E, num_slots = cfg.n_routed_experts, len(workers) * slots_per_worker
    rows = []
    for _ in cfg.moe_layers:
        extra = torch.randint(0, E, (num_slots - E,), generator=g)
        rows.append(torch.cat([torch.arange(E), extra])[torch.randperm(num_slots, generator=g)])
    return torch.stack(rows)


TOPOLOGIES = {
    "1-worker": (1, 16, False),
    "2-workers": (2, 8, False),
    "4-workers": (4, 4, False),
    "2-workers-redundant": (2, 10, False),  # 16 experts on 20 slots: 4 replicated
    "4-workers-redundant-shuffled": (4, 7, True),  # 28 slots, random replicas, per-layer layout
}


def _placement(setup: Setup, topology: str) -> Placement:
    n, slots, shuffled = TOPOLOGIES[topology]
    workers = tuple(setup.addresses[:n])
    version = setup.next_version()
    cfg = setup.cfg
    if shuffled:
        return Placement(version, _shuffled_redundant(cfg, workers, slots, seed=version), workers)
    return Placement.round_robin(cfg.num_moe_layers, cfg.n_routed_experts, workers, slots, version)


def _check(setup: Setup, outs, logits):
    assert [o.token_ids for o in outs] == setup.tokens
    for got, want in zip(logits, setup.logits, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_cluster_matches_local_engine(setup, topology):
    placement = _placement(setup, topology)
    reports = load_placement(placement, {a: a for a in placement.workers}, setup.cfg.moe_layers)
    assert all(r.version == placement.version for r in reports)
    experts = RemoteExperts(setup.cfg, placement)
    try:
        outs, logits, load = run_requests(setup.engine(experts), setup.prompts, PARAMS)
        _check(setup, outs, logits)
        # every routed (token, choice) pair was counted, and computed by some worker slot
        stats = [ExpertClient(a).stats() for a in placement.workers]
        computed = sum(
            sum(sum(layer.tokens) for layer in v.layers)
            for s in stats
            for v in s.versions
            if v.version == placement.version
        )
        assert computed == int(load.sum()) > 0
        if len(placement.workers) > 1:
            assert experts.stats.rpcs > len(setup.cfg.moe_layers)  # several workers per layer
    finally:
        experts.close()
        release_version(placement.version, placement.workers)


def test_replacement_mid_generation(setup):
    """Load a new placement while generating, switch at a step boundary, release the old one."""
    cfg = setup.cfg
    first = _placement(setup, "2-workers")
    load_placement(first, {a: a for a in first.workers}, cfg.moe_layers)
    experts = RemoteExperts(cfg, first)
    engine = setup.engine(experts)
    ids = [engine.add_request(p, PARAMS) for p in setup.prompts]
    tokens = {rid: [] for rid in ids}
    second, steps = None, 0
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens[out.request_id] += out.token_ids
        steps += 1
        if steps == 4:
            second = _placement(setup, "4-workers-redundant-shuffled")
            load_placement(second, {a: a for a in second.workers}, cfg.moe_layers)
            experts.set_placement(second)
            release_version(first.version, first.workers)
    experts.close()
    release_version(second.version, second.workers)
    assert second is not None and [tokens[rid] for rid in ids] == setup.tokens


def test_worker_death_resends_to_replicas(setup):
    """Every expert on two workers; one dies mid-generation: its pairs go to the other."""
    cfg = setup.cfg
    actors, (doomed,) = start_workers(setup.path, 1)
    workers = (setup.addresses[0], doomed)
    placement = Placement.round_robin(
        cfg.num_moe_layers, cfg.n_routed_experts, workers, 16, setup.next_version()
    )
    load_placement(placement, {a: a for a in workers}, cfg.moe_layers)
    experts = RemoteExperts(cfg, placement)
    engine = setup.engine(experts)
    ids = [engine.add_request(p, PARAMS) for p in setup.prompts]
    tokens = {rid: [] for rid in ids}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens[out.request_id] += out.token_ids
        steps += 1
        if steps == 3:
            ray.kill(actors[0])
    experts.close()
    release_version(placement.version, workers[:1])
    assert [tokens[rid] for rid in ids] == setup.tokens
    assert experts.stats.resent_pairs > 0
