"""Prometheus metrics of the router, plus gauges filled from worker/balancer stats at scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()

        def per_worker(name: str, doc: str) -> Gauge:
            """A gauge with one value per attention worker (filled from its stats at scrape)."""
            return Gauge(name, doc, ["worker"], registry=r)

        self.requests = Counter(
            "moe_requests", "HTTP generation requests by endpoint", ["endpoint"], registry=r
        )
        self.responses = Counter(
            "moe_responses", "Finished generation requests by status", ["status"], registry=r
        )
        self.ttft = Histogram(
            "moe_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "moe_time_per_output_token_seconds", "Time per output token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.running = per_worker("moe_requests_running", "Requests running")
        self.waiting = per_worker("moe_requests_waiting", "Requests waiting")
        self.kv_used = per_worker("moe_kv_blocks_used", "KV cache blocks in use")
        self.kv_total = per_worker("moe_kv_blocks_total", "KV cache blocks")
        self.state_used = per_worker("moe_state_blocks_used", "DeepSeek-V4 window-state blocks in use")
        self.state_total = per_worker("moe_state_blocks_total", "DeepSeek-V4 window-state blocks (0: not V4)")
        self.steps = per_worker("moe_engine_steps", "Engine steps run")
        self.step_s = per_worker("moe_engine_step_seconds", "Cumulative engine step time")
        self.wait_s = per_worker("moe_expert_wait_seconds", "Cumulative time steps waited for routed experts")
        self.wait_per_layer = per_worker(
            "moe_expert_wait_per_moe_layer_seconds",
            "Mean time a step waited for routed experts, per MoE layer",
        )
        self.dispatch_rpcs = per_worker("moe_dispatch_rpcs", "Dispatch calls sent (every transport)")
        self.shm_calls = per_worker("moe_dispatch_shm_calls", "Dispatch calls through shared memory")
        self.calls_by_transport = Gauge(
            "moe_dispatch_calls", "Dispatch calls sent, by transport", ["worker", "transport"], registry=r
        )
        self.transport = Gauge(
            "moe_dispatch_transport",
            "1 for the transport each (attention worker, expert worker) pair uses (chosen once per pair)",
            ["worker", "expert_worker", "transport"], registry=r,
        )  # fmt: skip
        self.transport_events = per_worker(
            "moe_dispatch_transport_events",
            "Transports chosen and changed (fallbacks, restorations), last 64",
        )
        self.dropped = per_worker(
            "moe_load_counts_dropped", "Routed-token counts dropped (Redis down too long)"
        )
        self.version = per_worker("moe_placement_version", "Placement version in use")
        self.balancedness = Gauge(
            "moe_layer_balancedness", "Mean/max expert-worker load per MoE layer", ["layer"], registry=r
        )
        self.balancedness_all = Gauge(
            "moe_balancedness", "Mean/max expert-worker load over all MoE layers", registry=r
        )
        self.worker_load = Gauge(
            "moe_expert_worker_load", "Routed (token, expert) pairs per expert worker in the balancer's window",
            ["worker"], registry=r,
        )  # fmt: skip
        # per-expert load, bounded: one series per MoE layer (not one per layer x expert)
        self.hottest = Gauge(
            "moe_expert_load_max_over_mean",
            "Load of a MoE layer's busiest logical expert over the layer's mean expert load",
            ["layer"],
            registry=r,
        )
        self.migrations = Gauge("moe_migrations", "Expert re-placements completed", registry=r)
        self.expert_workers = Gauge("moe_expert_workers", "Expert workers in the pool", registry=r)
        self.expert_workers_desired = Gauge(
            "moe_expert_workers_desired", "Expert workers the autoscaler's last tick asked for", registry=r
        )
        self.expert_workers_pending = Gauge(
            "moe_expert_workers_pending", "Expert workers waiting for a node with room", registry=r
        )
        self.expert_signals = Gauge(
            "moe_expert_autoscale_signal",
            "The expert autoscaler's last tick: queue_delay_s and compute_s per dispatch, expert_wait_share of the "
            "attention steps, tokens_per_s, pending requests",
            ["signal"], registry=r,
        )  # fmt: skip
        self.attention_workers = Gauge(
            "moe_attention_workers",
            "Attention workers by state (serving, starting, draining)",
            ["state"],
            registry=r,
        )
        self.attention_workers_desired = Gauge(
            "moe_attention_workers_desired",
            "Attention workers the autoscaler's last tick asked for",
            registry=r,
        )
        self.expert_busy = Gauge(
            "moe_expert_busy_fraction", "Busy fraction (compute time / wall time) per expert worker, last tick",
            ["worker"], registry=r,
        )  # fmt: skip
        self.failovers = Counter(
            "moe_router_failovers",
            "Requests moved to another attention worker after theirs died, by kind (resubmitted: no "
            "token sent yet; resumed: re-prefilled with the tokens already sent)",
            ["kind"],
            registry=r,
        )
        self.resent_pairs = per_worker(
            "moe_dispatch_resent_pairs", "(token, expert) pairs resent after an expert worker failed"
        )
        self.failed_steps = per_worker("moe_engine_failed_steps", "Engine steps that failed and were retried")
        self.prefix_hits = per_worker(
            "moe_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"
        )
        self.prefix_queries = per_worker(
            "moe_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_evictions = per_worker(
            "moe_prefix_cache_evictions", "Cached prefix blocks evicted to make room"
        )
        self.prefix_blocks = per_worker(
            "moe_prefix_cache_blocks", "Cache blocks holding a registered prompt prefix"
        )
        # the same quantities under vLLM's names, so that existing dashboards work
        self.vllm_running = per_worker("vllm:num_requests_running", "Requests running (vLLM name)")
        self.vllm_waiting = per_worker("vllm:num_requests_waiting", "Requests waiting (vLLM name)")
        self.vllm_kv_usage = per_worker(
            "vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (vLLM name)"
        )
        self.vllm_prefix_queries = per_worker(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (vLLM name)"
        )
        self.vllm_prefix_hits = per_worker(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (vLLM name)"
        )
        # speculative decoding (engine stats' spec_decode), under vLLM's names
        self.spec_drafts = per_worker("vllm:spec_decode_num_drafts", "Drafts verified (vLLM name)")
        self.spec_draft_tokens = per_worker(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens verified (vLLM name)"
        )
        self.spec_accepted = per_worker(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted (vLLM name)"
        )
        self.spec_accepted_per_pos = Gauge(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft (vLLM name)",
            ["worker", "position"], registry=r,
        )  # fmt: skip
        self.vllm_ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token (vLLM name)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.vllm_tpot = Histogram(
            "vllm:time_per_output_token_seconds", "Time per output token (vLLM name)", buckets=_LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.heals = Gauge("moe_expert_heals", "Placements re-planned after expert workers died", registry=r)
        self.dead_workers = Gauge(
            "moe_expert_workers_died", "Expert workers that died (since the balancer started)", registry=r
        )
        self.recovery_s = Gauge(
            "moe_expert_recovery_seconds", "Seconds from an expert worker's death until its experts served again (last)",
            registry=r,
        )  # fmt: skip
        self.refused = Gauge(  # (a sum of the live workers' counters: one that leaves takes its own away)
            "moe_data_plane_refused_total",
            "Data-plane calls and connections the expert workers refused, by transport and reason "
            "(services/dataplane/auth.py Refusals), summed over the live workers",
            ["transport", "reason"], registry=r,
        )  # fmt: skip

    def observe_refused(self, counts: dict[tuple[str, str], int]) -> None:
        """The expert workers' refusals (their Stats), summed: (transport, reason) -> count."""
        self.refused.clear()
        for (transport, reason), n in counts.items():
            self.refused.labels(transport, reason).set(n)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.vllm_ttft.observe(seconds)

    def observe_tpot(self, seconds: float) -> None:
        self.tpot.observe(seconds)
        self.vllm_tpot.observe(seconds)

    def request_started(self, endpoint: str) -> None:
        self.requests.labels(endpoint).inc()

    def request_finished(self, status: int) -> None:
        self.responses.labels(str(status)).inc()

    def render(self, worker_stats: list[dict], balancer: dict | None) -> bytes:
        self.transport.clear()  # (pairs that ended drop out)
        for s in worker_stats:
            w = s["worker_id"]
            dispatch = s.get("dispatch") or {}
            for expert_worker, transport in (dispatch.get("transport") or {}).items():
                self.transport.labels(w, expert_worker, transport).set(1)
            for transport, calls in (dispatch.get("calls_by_transport") or {}).items():
                self.calls_by_transport.labels(w, transport).set(calls)
            self.transport_events.labels(w).set(len(dispatch.get("transport_events") or ()))
            self.running.labels(w).set(s["running"])
            self.waiting.labels(w).set(s["waiting"])
            self.kv_used.labels(w).set(s["kv_blocks_used"])
            self.kv_total.labels(w).set(s["kv_blocks_total"])
            self.state_used.labels(w).set(s.get("state_blocks_used", 0))
            self.state_total.labels(w).set(s.get("state_blocks_total", 0))
            self.steps.labels(w).set(s["times"]["steps"])
            self.step_s.labels(w).set(s["times"]["step_s"])
            self.wait_s.labels(w).set(s["times"]["expert_wait_s"])
            self.wait_per_layer.labels(w).set(s.get("expert_wait_per_moe_layer_s", 0.0))
            self.dispatch_rpcs.labels(w).set((s.get("dispatch") or {}).get("rpcs", 0))
            self.shm_calls.labels(w).set((s.get("dispatch") or {}).get("shm_calls", 0))
            self.resent_pairs.labels(w).set((s.get("dispatch") or {}).get("resent_pairs", 0))
            self.failed_steps.labels(w).set(s["times"]["failed_steps"])
            prefix = s.get("prefix_cache") or {}
            self.prefix_hits.labels(w).set(prefix.get("hit_tokens", 0))
            self.prefix_queries.labels(w).set(prefix.get("queried_tokens", 0))
            self.prefix_blocks.labels(w).set(prefix.get("cached_blocks", 0))
            self.prefix_evictions.labels(w).set(prefix.get("evictions", 0))
            self.vllm_running.labels(w).set(s["running"])
            self.vllm_waiting.labels(w).set(s["waiting"])
            self.vllm_kv_usage.labels(w).set(s["kv_blocks_used"] / max(1, s["kv_blocks_total"]))
            self.vllm_prefix_queries.labels(w).set(prefix.get("queried_tokens", 0))
            self.vllm_prefix_hits.labels(w).set(prefix.get("hit_tokens", 0))
            spec = s.get("spec_decode")
            if spec:
                self.spec_drafts.labels(w).set(spec["num_drafts"])
                self.spec_draft_tokens.labels(w).set(spec["num_draft_tokens"])
                self.spec_accepted.labels(w).set(spec["num_accepted_tokens"])
                for pos, n in enumerate(spec["num_accepted_tokens_per_pos"]):
                    self.spec_accepted_per_pos.labels(w, str(pos)).set(n)
            self.dropped.labels(w).set((s.get("load_reporter") or {}).get("dropped_tokens", 0))
            self.version.labels(w).set(s["placement_version"])
        if balancer:
            for layer, b in enumerate(balancer.get("balancedness_per_layer") or []):
                self.balancedness.labels(str(layer)).set(b)
            if balancer.get("balancedness") is not None:
                self.balancedness_all.set(balancer["balancedness"])
            for w in balancer.get("workers", []):
                if w.get("load") is not None:
                    self.worker_load.labels(w["id"]).set(w["load"])
            for layer, loads in enumerate(balancer.get("loads") or []):
                mean = sum(loads) / max(1, len(loads))
                self.hottest.labels(str(layer)).set(max(loads, default=0) / mean if mean > 0 else 0.0)
            self.migrations.set(balancer.get("migrations", 0))
            self.expert_workers.set(sum(w.get("state") == "serving" for w in balancer.get("workers", [])))
            self.heals.set(balancer.get("heals", 0))
            self.expert_workers_pending.set(len(balancer.get("pending_workers") or {}))
            autoscale = balancer.get("autoscale") or {}
            if autoscale.get("desired") is not None:
                self.expert_workers_desired.set(autoscale["desired"])
            self.expert_busy.clear()  # (workers that left the pool drop out)
            for w, busy in (autoscale.get("busy_by_worker") or {}).items():
                self.expert_busy.labels(w).set(busy)
            for name, value in (autoscale.get("signals") or {}).items():
                self.expert_signals.labels(name).set(value)
            attention = balancer.get("attention_autoscale") or {}
            for state in ("serving", "starting", "draining"):
                if state in attention:
                    self.attention_workers.labels(state).set(len(attention[state]))
            if attention.get("desired") is not None:
                self.attention_workers_desired.set(attention["desired"])
            dead = balancer.get("dead_workers") or []
            self.dead_workers.set(len(dead))
            healed = [d["healed_s"] for d in dead if d.get("healed_s") is not None]
            if healed:
                self.recovery_s.set(healed[-1])
        return generate_latest(self.registry)
