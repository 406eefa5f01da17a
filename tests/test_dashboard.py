"""The Grafana dashboard (deploy/grafana/moe-cluster.json): every panel's PromQL names only
metrics the router's /metrics exports, and per-expert load stays bounded in series.

/metrics is rendered here from stats the services' own code produces, in process and without
Ray: a real attention worker (`AttentionWorker`'s class: engine thread, in-process experts, a
load reporter whose Redis is down) serving requests, and a real balancer (`Balancer`'s class
over `BalancerCore`, DeepSeek-V3's 58 MoE layers x 256 experts) after two autoscaling ticks of
its own. Each exported value is checked against the number the services count (their objects'
counters, not their stats dicts), so a stats key renamed in a service fails here: the router
would read nothing under the old name and export a zero, or nothing."""

import asyncio
import contextlib
import copy
import dataclasses
import json
import re
import shutil
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
import torch
from prometheus_client.parser import text_string_to_metric_families

from services.attention.load_reporter import LoadReporter, LoadReporterConfig
from services.attention.worker import AttentionWorker, AttentionWorkerConfig
from services.balancer.actor import Balancer
from services.balancer.attention_pool import AttentionScaling
from services.balancer.autoscale import AttentionScaleConfig, ExpertSignals
from services.balancer.policy import MigrationRecord, Pool, initial_placement, slots_per_worker
from services.balancer.pool import DeadWorker, Member
from services.balancer.service import BalancerConfig
from services.dataplane.remote_experts import RemoteExperts
from services.engine.engine import EngineConfig
from services.engine.sampling import SamplingParams
from services.presets import PRESETS
from services.router.metrics import RouterMetrics
from services.rpc import expert_pb2
from services.settings import BalancerSettings, ExpertSettings, SharedSettings

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "moe-cluster.json"
METRIC = re.compile(r"(?<![\w:])(moe_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
LAYERS, EXPERTS = 58, 256  # DeepSeek-V3's MoE layers and routed experts
WORKER = "moe-attn-0"
EXPERT_WORKERS = 4
DEADLINE_S = 120.0  # for anything the engine thread does (a loaded machine is slow, not stuck)


def _closed_port() -> int:
    """A loopback port nothing listens on (Redis down: every flush is refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _run(service, prompt: list[int], max_tokens: int, rid: str) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async with asyncio.timeout(DEADLINE_S):
        async for out in service.generate(prompt, params, rid):
            assert out.error is None, out


class _Pause:
    """Holds the engine thread at a step boundary (a call queued behind the others) until
    released: what it counts stands still meanwhile."""

    def __init__(self, service):
        self.held, self.release = threading.Event(), threading.Event()
        self.done = asyncio.ensure_future(service.between_steps(self._hold))

    def _hold(self) -> None:
        self.held.set()
        assert self.release.wait(DEADLINE_S), "the test never released the engine thread"

    async def wait_held(self) -> None:
        assert await asyncio.to_thread(self.held.wait, DEADLINE_S), "the engine thread never paused"

    async def end(self) -> None:
        self.release.set()
        await asyncio.wait_for(self.done, DEADLINE_S)


async def _serve_and_snapshot(tiny_model) -> tuple[AttentionWorker, dict, dict]:
    """A real attention worker serves a scenario that makes every counter it reports non-zero;
    then, with the engine thread held, its `stats()` and what its objects count."""
    engine_cfg = EngineConfig(model=str(tiny_model), max_num_seqs=1, num_kv_blocks=12)
    worker = AttentionWorker.__ray_actor_class__(AttentionWorkerConfig(engine=engine_cfg, worker_id=WORKER))
    service, engine = worker.service, worker.service.engine
    sched, alloc, mcfg = engine.scheduler, engine.scheduler.allocator, engine.cfg
    # routed-expert counts go to Redis, which is down: with no grace, a flush drops them
    shared = SharedSettings(redis_url=f"redis://127.0.0.1:{_closed_port()}")
    reporter = LoadReporter(LoadReporterConfig(shared, flush_seconds=3600, max_pending_seconds=0),
                            mcfg.num_moe_layers, mcfg.n_routed_experts)  # fmt: skip
    service.load_reporter = reporter
    # the data plane's client, switched to a placement the way the balancer does it (the engine
    # keeps its in-process experts: this client only reports)
    pool = Pool.grouped({"expert-0": "node-a", "expert-1": "node-a"})
    placement = initial_placement(mcfg, pool, slots_per_worker(mcfg, 2, 0))
    addresses = {w: f"127.0.0.1:{_closed_port()}" for w in placement.workers}  # (nobody answers)
    worker.remote_experts = RemoteExperts(mcfg, placement, addresses)
    assert await worker.set_placement(placement.to_dict(), addresses) == placement.version
    # what a dispatch counts on its client (no expert worker runs here)
    dispatch = worker.remote_experts.stats
    dispatch.rpcs, dispatch.shm_calls, dispatch.resent_pairs = 40, 30, 5

    # evictions: distinct prompts of four full blocks each, until the cache gave one up
    for i in range(alloc.num_blocks):
        if alloc.evictions:
            break
        await _run(service, [0] + [4 + (i * 37 + j) % 380 for j in range(255)], 1, f"fill-{i}")
    assert alloc.evictions > 0, "scenario: the cache never evicted a block"
    # a prefix hit: the same 200-token prompt twice (3 full blocks, never the last token's)
    prompt = [0] + list(range(100, 299))
    await _run(service, prompt, 2, "first")
    hits = sched.prefix_hit_tokens
    await _run(service, prompt, 2, "again")
    assert sched.prefix_hit_tokens - hits == 192

    # one request running (max_num_seqs=1), one waiting, the engine held in between
    long = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)
    running = await service.submit([0, 5, 6, 7], long, "running")
    assert (await asyncio.wait_for(running.get(), DEADLINE_S)).token_ids  # it ran a step
    first = _Pause(service)
    await first.wait_held()
    waiting = asyncio.ensure_future(service.submit([0, 8, 9], long, "waiting"))
    await asyncio.sleep(0)  # (its add is queued: it runs before the second pause, no step between)
    second = _Pause(service)
    await asyncio.sleep(0)
    await first.end()
    await second.wait_held()
    await asyncio.wait_for(waiting, DEADLINE_S)

    assert reporter.flush() is False and reporter.dropped_tokens > 0  # (refused: dropped)
    stats = await worker.stats()
    times, used = service.times, alloc.num_blocks - sched.num_free_blocks
    counted = {
        "moe_requests_running": len(sched.running),
        "moe_requests_waiting": len(sched.waiting),
        "vllm:num_requests_running": len(sched.running),
        "vllm:num_requests_waiting": len(sched.waiting),
        "moe_kv_blocks_total": alloc.num_blocks,
        "moe_kv_blocks_used": used,
        "vllm:kv_cache_usage_perc": used / alloc.num_blocks,
        "moe_state_blocks_total": engine.cache.num_state_blocks,  # (0: not DeepSeek-V4)
        "moe_state_blocks_used": engine.cache.num_state_blocks - alloc.num_free_states,
        "moe_engine_steps": times.steps,
        "moe_engine_step_seconds": times.step_s,
        "moe_expert_wait_seconds": times.expert_wait_s,
        "moe_expert_wait_per_moe_layer_seconds": times.expert_wait_s / (times.steps * mcfg.num_moe_layers),
        "moe_engine_failed_steps": times.failed_steps,
        "moe_dispatch_rpcs": 40,
        "moe_dispatch_shm_calls": 30,
        "moe_dispatch_resent_pairs": 5,
        "moe_prefix_cache_hit_tokens": sched.prefix_hit_tokens,
        "moe_prefix_cache_queried_tokens": sched.prefix_queried_tokens,
        "vllm:prefix_cache_hits": sched.prefix_hit_tokens,
        "vllm:prefix_cache_queries": sched.prefix_queried_tokens,
        "moe_prefix_cache_blocks": alloc.num_cached,
        "moe_prefix_cache_evictions": alloc.evictions,
        # every token of every step routed to top-k experts in every MoE layer, all dropped
        "moe_load_counts_dropped": times.tokens * mcfg.num_experts_per_tok * mcfg.num_moe_layers,
        "moe_placement_version": placement.version,
    }
    assert reporter.dropped_tokens == counted["moe_load_counts_dropped"]
    assert counted["moe_requests_running"] == counted["moe_requests_waiting"] == 1
    zero = {"moe_engine_failed_steps", "moe_state_blocks_total", "moe_state_blocks_used"}
    assert all(v > 0 for k, v in counted.items() if k not in zero), counted  # (a zero proves nothing)
    await second.end()
    service.abort("running")
    service.abort("waiting")
    return worker, stats, counted


def _v3_shaped_model(directory: Path) -> Path:
    """config.json of DeepSeek-V3's expert layout (61 layers, the first 3 dense, 256 routed
    experts, top-8 of 8 groups) on the tiny dims: all the balancer reads of a model."""
    config = {**PRESETS["tiny"], "num_hidden_layers": 61, "first_k_dense_replace": 3,
              "n_routed_experts": EXPERTS, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return directory


class _ExpertClient:
    """An expert worker's control channel: Stats replies (the real message) whose cumulative
    counters grow by the same amount between two reads."""

    def __init__(self):
        self.reads = 0

    def stats(self, timeout: float) -> expert_pb2.StatsResponse:
        self.reads += 1
        return expert_pb2.StatsResponse(compute_seconds=1000.0 * self.reads, queue_seconds=500.0 * self.reads,
                                        dispatch_calls=100 * self.reads, compute_slots=1)  # fmt: skip

    def close(self) -> None:
        pass


def _handle(worker) -> SimpleNamespace:
    """What the balancer calls on an attention worker's Ray handle, answered by the worker."""
    return SimpleNamespace(
        stats=SimpleNamespace(remote=worker.stats), ready=SimpleNamespace(remote=worker.ready)
    )


async def _balancer_status(model_dir: Path, worker, worker_cfg) -> tuple[dict, dict, torch.Tensor]:
    """A real balancer's status after two autoscaling ticks of each pool, its placement over
    four expert workers (one more died and was healed, one waits for a node); what it counted."""
    experts = ExpertSettings(
        workers=EXPERT_WORKERS, min_workers=1, max_workers=EXPERT_WORKERS, redundant_experts=32
    )
    cfg = BalancerConfig(model=str(model_dir), experts=experts, settings=BalancerSettings(period_s=0), watch_s=0,
                         attention=AttentionScaling(AttentionScaleConfig(1, 2), worker_cfg))  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:  # (the one question it asks Ray: was it restarted)
        mp.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(was_current_actor_reconstructed=False))
        balancer = Balancer.__ray_actor_class__(cfg)
    core = balancer.core
    for i in range(EXPERT_WORKERS):
        core.pool.members[f"expert-{i}"] = Member(
            None, f"127.0.0.1:{7000 + i}", f"node-{i % 2}", _ExpertClient()
        )
    core.placement = initial_placement(core.model_cfg, core.eplb_pool(), core._slots_for(EXPERT_WORKERS))
    core.slots = core.placement.slots_per_worker
    g = torch.Generator().manual_seed(0)
    core.last_loads = torch.randint(0, 1000, (LAYERS, EXPERTS), generator=g)
    core.last_loads[:, 7] = 20_000  # a hot expert in every layer
    core.pool.dead.append(DeadWorker("expert-9", "127.0.0.1:7009", time.time() - 10, "killed"))
    core.pool.dead[-1].healed_s = 3.5
    core.heals += 1
    core.migrations.append(MigrationRecord(2, "heal: expert-9 died", 0.5, 0.9, 10, 1, 0.1, 0.1, 0.2, True))
    core.pool.pending["expert-5"] = time.time() - 2.0
    core.attention[WORKER] = _handle(worker)
    core.attention_state[WORKER] = await worker.ready()  # (the watch tick's record of it)
    for _ in range(2):
        await balancer._autoscale()
        await balancer._autoscale_attention()
    status = await balancer.status()
    counted = {
        "moe_expert_workers": EXPERT_WORKERS,
        "moe_expert_workers_pending": 1,
        "moe_migrations": 1,
        "moe_expert_heals": 1,
        "moe_expert_workers_died": 1,
        "moe_expert_recovery_seconds": 3.5,
        "moe_expert_workers_desired": EXPERT_WORKERS,  # (busy: it wants more than its maximum)
        "moe_attention_workers_desired": balancer.attention_scaler.last_desired,
    }
    assert balancer.autoscaler.last_desired == EXPERT_WORKERS and balancer.attention_scaler.last_desired >= 1
    return status, counted, core.last_loads


@pytest.fixture(scope="module")
def scraped(tiny_model, tmp_path_factory) -> dict:
    """/metrics from the real services' stats: the text, its samples, and what they counted."""
    model_dir = _v3_shaped_model(tmp_path_factory.mktemp("v3-shaped"))
    ray_before = ray.is_initialized()

    async def main():
        worker, stats, counted = await _serve_and_snapshot(tiny_model)
        try:
            status, balancer_counted, loads = await _balancer_status(model_dir, worker, worker.cfg)
        finally:
            worker.remote_experts.close()
            await worker.shutdown()
        return stats, status, {**counted, **balancer_counted}, loads

    stats, status, counted, loads = asyncio.run(main())
    assert ray.is_initialized() == ray_before  # (nothing here started Ray)
    m = RouterMetrics()  # the router's own counters, as its request handlers move them
    m.request_started("chat")
    m.request_finished(200)
    m.observe_ttft(0.2)
    m.observe_tpot(0.02)
    m.failovers.labels("resumed").inc()
    text = m.render([stats], status).decode()
    return {"text": text, "stats": stats, "status": status, "counted": counted, "loads": loads}


def _samples(text: str) -> dict[str, dict[tuple, float]]:
    """Sample name -> {labels: value}, as /metrics serves them."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _exported(text: str) -> dict[str, int]:
    """Sample name -> number of series."""
    return {name: len(series) for name, series in _samples(text).items()}


def _mismatches(text: str, counted: dict) -> dict[str, tuple]:
    """Metrics whose exported value is not what the services counted (or that are missing)."""
    samples, wrong = _samples(text), {}
    for name, want in counted.items():
        series = samples.get(name, {})
        per_worker = [v for labels, v in series.items() if ("worker", WORKER) in labels]
        got = per_worker or list(series.values())
        if len(got) != 1 or got[0] != pytest.approx(want, rel=1e-9):
            wrong[name] = (got, want)
    return wrong


def _unknown(expr: str, exported: dict[str, int]) -> list[str]:
    return [name for name in METRIC.findall(expr) if name not in exported]


def _exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


def test_every_panel_names_exported_metrics(scraped):
    exported = _exported(scraped["text"])
    exprs = _exprs()
    assert len(exprs) >= 20
    for title, expr in exprs:
        assert METRIC.search(expr), f"{title}: no metric in {expr!r}"
        assert not _unknown(expr, exported), f"{title}: {_unknown(expr, exported)} not exported"
    # (the check can fail: a misspelt name is caught)
    assert _unknown("rate(moe_request_total[1m])", exported) == ["moe_request_total"]


def test_exported_values_are_what_the_services_counted(scraped):
    """Every gauge filled from worker or balancer stats shows the services' own count (non-zero
    where a zero would hide a key the router no longer finds)."""
    assert _mismatches(scraped["text"], scraped["counted"]) == {}
    samples = _samples(scraped["text"])
    loads = scraped["loads"].double()
    hottest = {dict(k)["layer"]: v for k, v in samples["moe_expert_load_max_over_mean"].items()}
    for layer in range(LAYERS):
        assert hottest[str(layer)] == pytest.approx(float(loads[layer].max() / loads[layer].mean()))
    worker_load = samples["moe_expert_worker_load"]  # (each expert's load split over its replicas)
    assert len(worker_load) == EXPERT_WORKERS
    assert sum(worker_load.values()) == pytest.approx(float(loads.sum()))
    balancedness = [*samples["moe_layer_balancedness"].values(), *samples["moe_balancedness"].values()]
    assert len(balancedness) == LAYERS + 1 and all(0 < b < 1 for b in balancedness)
    assert set(samples["moe_expert_busy_fraction"].values()) == {1.0}  # (4 workers, busy throughout)
    signals = {dict(k)["signal"]: v for k, v in samples["moe_expert_autoscale_signal"].items()}
    assert set(signals) == {f.name for f in dataclasses.fields(ExpertSignals)}
    assert (
        signals["queue_delay_s"] == 5.0 and signals["compute_s"] == 10.0
    )  # (per dispatch: 500 s, 1000 s / 100)
    states = {dict(k)["state"]: v for k, v in samples["moe_attention_workers"].items()}
    assert states == {"serving": 1.0, "starting": 0.0, "draining": 0.0}


def test_a_renamed_stats_key_is_caught(scraped):
    """(the check can fail) the worker's stats with a key under another name: the router exports
    a zero for it, which is not what the worker counted."""
    stats = copy.deepcopy(scraped["stats"])
    stats["prefix_cache"]["hits"] = stats["prefix_cache"].pop("hit_tokens")
    status = {**scraped["status"], "heal_count": scraped["status"]["heals"]}
    del status["heals"]
    text = RouterMetrics().render([stats], status).decode()
    assert set(_mismatches(text, scraped["counted"])) == {
        "moe_prefix_cache_hit_tokens", "vllm:prefix_cache_hits", "moe_expert_heals"
    }  # fmt: skip


def test_the_dashboard_covers_what_operators_watch():
    names = {n for _, e in _exprs() for n in METRIC.findall(e)}
    for wanted in ("moe_requests_total", "moe_time_to_first_token_seconds_bucket", "vllm:kv_cache_usage_perc",
                   "moe_prefix_cache_hit_tokens", "moe_expert_wait_seconds", "moe_expert_worker_load",
                   "moe_balancedness", "moe_expert_heals", "moe_router_failovers_total",
                   "moe_expert_load_max_over_mean"):  # fmt: skip
        assert wanted in names


def test_per_expert_load_is_bounded(scraped):
    """One series per MoE layer for the per-expert view (58), not one per (layer, expert) (14,848)."""
    exported = _exported(scraped["text"])
    assert exported["moe_expert_load_max_over_mean"] == LAYERS
    assert exported["moe_expert_worker_load"] == EXPERT_WORKERS
    assert sum(exported.values()) < 1000


# ---- the dashboard against a real Prometheus scraping a running cluster ----------------------

PROMETHEUS = shutil.which("prometheus") or (
    "/usr/bin/prometheus" if Path("/usr/bin/prometheus").is_file() else None
)
SCRAPE_S = 1  # Prometheus' scrape interval (rate() needs two samples in its window)
# Grafana's variables, as a panel over a short range would fill them in
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}
# panels whose series exist only after what this test does not cause, and why
NEEDS_A_FAULT = {
    "Router failovers / s": "moe_router_failovers_total has a series per kind only once a request moved off an "
    "attention worker that died (tests/faults/ kill one)",
}


def _prometheus_query(base: str, expr: str) -> list[dict]:
    import httpx

    r = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def _panel_series(base: str) -> dict[str, list[int]]:
    """Panel title -> the series each of its queries returned, counted."""
    out: dict[str, list[int]] = {}
    for title, expr in _exprs():
        for var, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"{title}: a Grafana variable this test does not fill: {expr}"
        out.setdefault(title, []).append(len(_prometheus_query(base, expr)))
    return out


def _traffic(url: str, stop: threading.Event, counts: dict) -> None:
    """A little of everything the router counts: completions and streamed chats, sharing a prefix."""
    import httpx

    with httpx.Client(base_url=url, timeout=60) as client:
        i = 0
        while not stop.is_set():
            if i % 2 == 0:
                body = {"model": "tiny", "prompt": [0, 5, 6, 7] * 20 + [i % 50], "max_tokens": 6,
                        "temperature": 0, "ignore_eos": True}  # fmt: skip
                r = client.post("/v1/completions", json=body)
            else:
                body = {"model": "tiny", "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 6,
                        "stream": True, "ignore_eos": True}  # fmt: skip
                with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    r.read()
            counts[r.status_code] = counts.get(r.status_code, 0) + 1
            i += 1


@contextlib.contextmanager
def _prometheus(target: str, workdir: Path, deadline: float):
    """A Prometheus of its own (free port, data in `workdir`) scraping `target`'s /metrics every
    SCRAPE_S seconds: yields its base URL once ready; stopped on exit."""
    import subprocess

    import httpx

    from services.net import free_port

    (workdir / "prometheus.yml").write_text(
        f"global:\n  scrape_interval: {SCRAPE_S}s\n  scrape_timeout: {SCRAPE_S}s\n"
        f"scrape_configs:\n  - job_name: moe-cluster\n    metrics_path: /metrics\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    port = free_port()
    base, log = f"http://127.0.0.1:{port}", workdir / "prometheus.log"
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
    try:
        while True:
            assert process.poll() is None, f"prometheus exited: {log.read_text()}"
            try:
                if httpx.get(f"{base}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:  # (not listening yet)
                pass
            assert time.monotonic() < deadline, f"prometheus not ready: {log.read_text()}"
            time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@pytest.mark.cluster
@pytest.mark.skipif(
    PROMETHEUS is None,
    reason="prometheus is not installed (Debian: apt-get install prometheus; .ci/run installs it where it can)",
)
def test_every_panel_returns_series_from_a_real_prometheus(tiny_model, tmp_path):
    """A local cluster under a little traffic, scraped by a real Prometheus every second: every
    panel's PromQL, evaluated by Prometheus' HTTP API, returns a series (but NEEDS_A_FAULT's)."""
    import urllib.parse

    from .clusters import tiny_cluster

    settings = dict(expert_workers=2, router_replicas=1, max_num_seqs=4, balancer_period_s=1.0,
                    balancer_bucket_seconds=1.0, balancer_min_gain=1.0)  # (loads read every second, no migration)  # fmt: skip
    with tiny_cluster(tiny_model, **settings) as cluster:
        deadline = time.monotonic() + 60  # (the panels fill within ~10 s of traffic on an idle 2-core box)
        stop, counts = threading.Event(), {}
        traffic = threading.Thread(target=_traffic, args=(cluster.url, stop, counts), daemon=True)
        traffic.start()
        try:
            with _prometheus(urllib.parse.urlsplit(cluster.url).netloc, tmp_path, deadline) as base:
                while True:  # until every panel has its series, or the deadline
                    series = _panel_series(base)
                    empty = {t for t, n in series.items() if 0 in n} - set(NEEDS_A_FAULT)
                    if not empty or time.monotonic() > deadline:
                        break
                    time.sleep(SCRAPE_S)
                up = _prometheus_query(base, "up")
        finally:
            stop.set()
            traffic.join(60)
    print(f"\n{'panel':46} series per query  (requests by status: {counts})")
    for title, n in series.items():
        why = f"  ({NEEDS_A_FAULT[title]})" if title in NEEDS_A_FAULT else ""
        print(f"{title:46} {', '.join(map(str, n))}{why}")
    assert [s["value"][1] for s in up] == ["1"], f"the scrape target is not up: {up}"
    assert set(counts) == {200}, counts
    assert set(NEEDS_A_FAULT) <= set(series), "NEEDS_A_FAULT names a panel the dashboard does not have"
    empty = {t: n for t, n in series.items() if 0 in n and t not in NEEDS_A_FAULT}
    assert not empty, f"panels with a query that returned no series: {empty}"
