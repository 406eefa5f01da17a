"""The Grafana dashboard (deploy/grafana/moe-cluster.json): every panel's PromQL names only
metrics the router's /metrics exports (rendered here from worker and balancer stats of the
shapes the services report), and per-expert load stays bounded in series."""

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from services.router.metrics import RouterMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "moe-cluster.json"
METRIC = re.compile(r"(?<![\w:])(moe_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
LAYERS, EXPERTS = 58, 256


def _worker(worker_id: str) -> dict:
    return {
        "worker_id": worker_id, "running": 3, "waiting": 1, "kv_blocks_used": 10, "kv_blocks_total": 100,
        "times": {"steps": 50, "step_s": 2.0, "expert_wait_s": 0.5, "failed_steps": 0},
        "expert_wait_per_moe_layer_s": 0.0003, "placement_version": 2,
        "dispatch": {"rpcs": 400, "shm_calls": 380, "resent_pairs": 0},
        "prefix_cache": {"hit_tokens": 64, "queried_tokens": 256, "cached_blocks": 4, "evictions": 0},
        "load_reporter": {"dropped_tokens": 0},
    }  # fmt: skip


def _balancer() -> dict:
    loads = [[(7 * layer + e) % 13 for e in range(EXPERTS)] for layer in range(LAYERS)]
    return {
        "workers": [{"id": f"expert-{i}", "state": "serving", "load": 1000.0 + i} for i in range(4)],
        "loads": loads, "balancedness": 0.9, "balancedness_per_layer": [0.9] * LAYERS,
        "migrations": 2, "heals": 1, "dead_workers": [{"healed_s": 3.5}],
    }  # fmt: skip


def _exported() -> dict[str, int]:
    """Sample name -> number of series, as /metrics would serve them."""
    m = RouterMetrics()
    m.request_started("chat")
    m.request_finished(200)
    m.observe_ttft(0.2)
    m.observe_tpot(0.02)
    m.failovers.labels("resumed").inc()
    text = m.render([_worker("attention-0"), _worker("attention-1")], _balancer()).decode()
    series: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series[sample.name] = series.get(sample.name, 0) + 1
    return series


def _unknown(expr: str, exported: dict[str, int]) -> list[str]:
    return [name for name in METRIC.findall(expr) if name not in exported]


def _exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


def test_every_panel_names_exported_metrics():
    exported = _exported()
    exprs = _exprs()
    assert len(exprs) >= 20
    for title, expr in exprs:
        assert METRIC.search(expr), f"{title}: no metric in {expr!r}"
        assert not _unknown(expr, exported), f"{title}: {_unknown(expr, exported)} not exported"
    # (the check can fail: a misspelt name is caught)
    assert _unknown("rate(moe_request_total[1m])", exported) == ["moe_request_total"]


def test_the_dashboard_covers_what_operators_watch():
    names = {n for _, e in _exprs() for n in METRIC.findall(e)}
    for wanted in ("moe_requests_total", "moe_time_to_first_token_seconds_bucket", "vllm:kv_cache_usage_perc",
                   "moe_prefix_cache_hit_tokens", "moe_expert_wait_seconds", "moe_expert_worker_load",
                   "moe_balancedness", "moe_expert_heals", "moe_router_failovers_total",
                   "moe_expert_load_max_over_mean"):  # fmt: skip
        assert wanted in names


def test_per_expert_load_is_bounded():
    """One series per MoE layer for the per-expert view (58), not one per (layer, expert) (14,848)."""
    exported = _exported()
    assert exported["moe_expert_load_max_over_mean"] == LAYERS
    assert exported["moe_expert_worker_load"] == 4
    assert sum(exported.values()) < 1000
