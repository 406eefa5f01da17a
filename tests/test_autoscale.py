"""The pools' autoscaling policies (services/balancer/autoscale.py), pure: no Ray, no clock."""

import pytest

from services.balancer import pool as pool_module
from services.balancer.autoscale import (
    AttentionAutoscaler,
    AttentionLoad,
    AttentionScaleConfig,
    AutoscaleConfig,
    ExpertAutoscaler,
    ExpertSignals,
    busy_fractions,
    expert_signals,
)


def test_the_pool_wanted_follows_busy_time_within_bounds():
    scaler = ExpertAutoscaler(AutoscaleConfig(1, 4, target_utilization=0.5), floor=2)
    assert scaler.desired([0.9, 0.8], current=2) == 4  # 1.7 busy workers at 0.5 each: 4
    assert scaler.desired([1.0] * 4, current=4) == 4  # (at most max)
    assert scaler.desired([0.1, 0.0], current=2) == 2  # (never below the placement's floor)
    assert scaler.desired([], current=3) == 3  # nothing measured: stay


def test_a_change_waits_for_its_delay_and_moves_one_step():
    scaler = ExpertAutoscaler(
        AutoscaleConfig(1, 4, target_utilization=0.5, upscale_delay_s=10, downscale_delay_s=60)
    )
    hot, cold = [1.0, 1.0], [0.05, 0.05]
    assert scaler.decide(hot, current=2, now=0.0) is None  # wanted from now ...
    assert scaler.decide(hot, current=2, now=9.0) is None
    assert scaler.decide(hot, current=2, now=10.0) == 3  # ... for 10 s: one more (not four)
    assert scaler.decide(hot, current=3, now=11.0) is None  # the delay starts over
    assert scaler.decide(cold, current=3, now=12.0) is None  # a change of mind restarts it too
    assert scaler.decide(hot, current=3, now=13.0) is None
    assert scaler.decide(hot, current=3, now=22.9) is None
    assert scaler.decide(hot, current=3, now=23.0) == 4
    for t in range(30, 90, 10):  # shrinking takes the longer delay
        assert scaler.decide(cold, current=4, now=float(t)) is None
    assert scaler.decide(cold, current=4, now=90.0) == 3
    assert scaler.decide([0.5, 0.5, 0.5], current=3, now=91.0) is None  # 1.5 / 0.5 = 3: steady


def test_every_decision_says_why():
    scaler = ExpertAutoscaler(AutoscaleConfig(1, 4, target_utilization=0.5, upscale_delay_s=10), floor=1)
    assert scaler.last_reason == "no tick yet"
    scaler.decide([0.9, 0.6], current=2, now=0.0)
    assert scaler.last_reason == (
        "busy 1.50 over 2 workers at target 0.5 wants 3 (bounds 1..4): grow after 0 of 10 s"
    )
    scaler.decide([0.9, 0.6], current=2, now=10.0)
    assert scaler.last_reason.endswith("wants 3 (bounds 1..4): 2 -> 3 workers")
    scaler.decide([0.5, 0.5, 0.4], current=3, now=11.0)
    assert scaler.last_reason.endswith(": holding at 3")


def test_busy_fractions_from_two_readings():
    before = {"a": (10.0, 100.0), "b": (5.0, 100.0), "gone": (1.0, 100.0)}
    after = {"a": (11.0, 102.0), "b": (0.5, 102.0), "new": (3.0, 102.0)}
    assert busy_fractions(before, after) == {"a": 0.5, "b": 0.25}  # b restarted: counts from zero
    assert busy_fractions({}, after) == {}


@pytest.mark.parametrize("bad", [dict(min_workers=0, max_workers=2), dict(min_workers=3, max_workers=2),
                                 dict(min_workers=1, max_workers=2, target_utilization=0.0),
                                 dict(min_workers=1, max_workers=2, upscale_delay_s=-1)])  # fmt: skip
def test_bad_bounds_are_refused(bad):
    with pytest.raises(ValueError):
        AutoscaleConfig(**bad)


def test_equal_bounds_mean_a_fixed_pool():
    assert not AutoscaleConfig(2, 2).enabled and AutoscaleConfig(1, 2).enabled


# ---- the attention pool (llm-d's saturation rule) ---------------------------------------------
def _load(kv=0.0, waiting=0, running=0, max_running=8):
    return AttentionLoad(kv, waiting, running, max_running)


def test_the_attention_pool_grows_when_saturated_and_shrinks_when_half_would_do():
    scaler = AttentionAutoscaler(AttentionScaleConfig(1, 3, kv_threshold=0.8, queue_threshold=5))
    assert scaler.desired([_load(kv=0.85), _load(kv=0.8)], current=2) == 3  # KV saturated on average
    assert scaler.desired([_load(waiting=6), _load(waiting=4)], current=2) == 3  # queues saturated
    assert scaler.desired([_load(waiting=6), _load(waiting=4)], current=3) == 3  # (at most max)
    assert scaler.desired([_load(kv=0.9), _load(kv=0.1)], current=2) == 2  # mean 0.5: holds
    # one worker fewer at half saturation: shrink; not while anything waits or the batch is busy
    assert scaler.desired([_load(kv=0.1, running=1), _load(kv=0.2, running=2)], current=2) == 1
    assert scaler.desired([_load(kv=0.1, waiting=1), _load(kv=0.1)], current=2) == 2
    assert scaler.desired([_load(running=3), _load(running=2)], current=2) == 2  # 5 of 8 on one: holds
    assert scaler.desired([_load(kv=0.3), _load(kv=0.2)], current=2) == 2  # 0.5 on one > 0.4
    assert scaler.desired([_load()], current=1) == 1  # (at least min)
    assert scaler.desired([], current=2) == 2  # nothing measured: stay


def test_the_attention_pool_moves_one_step_after_its_delay_and_says_why():
    scaler = AttentionAutoscaler(AttentionScaleConfig(1, 4, upscale_delay_s=5, downscale_delay_s=20))
    hot, idle = [_load(waiting=9)] * 2, [_load(), _load()]
    assert scaler.last_reason == "no tick yet"
    assert scaler.decide(hot, current=2, now=0.0) is None
    assert "mean waiting 9.0 (at 5)" in scaler.last_reason and scaler.last_reason.endswith(
        "grow after 0 of 5 s"
    )
    assert scaler.decide(hot, current=2, now=5.0) == 3 and scaler.last_desired == 3
    assert scaler.decide(idle, current=2, now=6.0) is None
    assert scaler.decide(idle, current=2, now=26.0) == 1
    assert scaler.last_reason.endswith("2 -> 1 workers")


def test_attention_load_from_worker_stats():
    stats = {"kv_blocks_used": 30, "kv_blocks_total": 120, "waiting": 2, "running": 4, "max_num_seqs": 8}
    assert AttentionLoad.from_stats(stats) == AttentionLoad(0.25, 2, 4, 8)


@pytest.mark.parametrize("bad", [dict(min_workers=0, max_workers=2), dict(min_workers=2, max_workers=1),
                                 dict(min_workers=1, max_workers=2, kv_threshold=1.5),
                                 dict(min_workers=1, max_workers=2, queue_threshold=0)])  # fmt: skip
def test_bad_attention_bounds_are_refused(bad):
    with pytest.raises(ValueError):
        AttentionScaleConfig(**bad)


def test_both_pools_ask_rays_autoscaler_in_one_request(monkeypatch):
    asked = []
    monkeypatch.setattr(pool_module, "request_resources", lambda bundles: asked.append(bundles))
    capacity = pool_module.Capacity()
    capacity.ask("expert", {"expert_node": 1.0}, 2)
    capacity.ask("attention", {"attention_node": 1.0, "GPU": 1.0}, 1)
    capacity.ask("attention", {"attention_node": 1.0, "GPU": 1.0}, 1)  # (unchanged: not asked again)
    capacity.ask("expert", {"expert_node": 1.0}, 1)
    capacity.ask("attention", {}, 3)  # (workers that take nothing fit anywhere)
    e, a = {"expert_node": 1.0}, {"attention_node": 1.0, "GPU": 1.0}
    assert asked == [[e, e], [e, e, a], [e, a], [e]]


def test_contended_dispatches_grow_the_pool_and_queues_keep_it_from_shrinking():
    scaler = ExpertAutoscaler(AutoscaleConfig(1, 4, target_utilization=0.5))
    contended = ExpertSignals(queue_delay_s=0.004, compute_s=0.001, expert_wait_share=0.5)
    assert contended.contended
    assert scaler.desired([0.2, 0.2], current=2, signals=contended) == 3  # busy alone: 1
    calm = ExpertSignals(queue_delay_s=0.004, compute_s=0.001, expert_wait_share=0.1)  # steps barely wait
    assert (
        not calm.contended and scaler.desired([0.2, 0.2], current=2, signals=calm) == 2
    )  # (queues: no shrink)
    idle = ExpertSignals(queue_delay_s=0.0001, compute_s=0.001, expert_wait_share=0.5)
    assert scaler.desired([0.2, 0.2], current=2, signals=idle) == 1
    scaler.decide([0.2, 0.2], current=2, now=0.0, signals=contended)
    assert "queue 4.00 ms per dispatch over 1.00 ms compute, expert wait 50% of steps" in scaler.last_reason
    assert "(contended) wants 3" in scaler.last_reason


def test_expert_signals_from_two_readings():
    before = {"a": (1.0, 2.0, 100), "b": (5.0, 0.0, 50), "gone": (9.0, 9.0, 9)}
    after = {"a": (1.5, 2.5, 200), "b": (0.5, 0.1, 10), "new": (3.0, 3.0, 3)}  # b restarted
    att0 = {"x": {"times": {"step_s": 10.0, "expert_wait_s": 4.0, "tokens": 100}, "waiting": 0}}
    att1 = {"x": {"times": {"step_s": 12.0, "expert_wait_s": 5.0, "tokens": 300}, "waiting": 3},
            "y": {"times": {"step_s": 1.0, "expert_wait_s": 1.0, "tokens": 10}, "waiting": 1}}  # fmt: skip
    s = expert_signals(before, after, att0, att1, seconds=4.0)
    assert s.compute_s == pytest.approx(1.0 / 110) and s.queue_delay_s == pytest.approx(0.6 / 110)
    assert s.expert_wait_share == 0.5 and s.tokens_per_s == 50.0 and s.pending == 4
    assert expert_signals({}, after, {}, att1, 4.0) == ExpertSignals(pending=4)  # nothing to compare yet
