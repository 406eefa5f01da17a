"""The gate that turns speculative decoding off by batch size (engine/spec_gate.py), with synthetic
step timings: no model. And the settings that carry it (flags, vLLM's JSON key, the cluster's)."""

import logging

import pytest

from services.engine.spec_gate import SpeculationGate, bucket_of
from services.engine.speculative import (
    check_speculation,
    parse_speculative_config,
    speculative_disable_by_batch_size,
)


def _drive(
    gate: SpeculationGate, batch: int, steps: int, spec_tok_s: float, plain_tok_s: float
) -> list[bool]:
    """Ask the gate `steps` times at `batch` running sequences and record each step as the
    timings say: a speculating step emits 2 tokens per sequence at spec_tok_s, a plain one 1 at
    plain_tok_s (tokens per sequence and second). The decisions, in order."""
    choices = []
    for _ in range(steps):
        speculate = gate.speculate(batch)
        choices.append(speculate)
        tokens = 2.0 if speculate else 1.0
        gate.record(batch, speculate, tokens / (spec_tok_s if speculate else plain_tok_s), tokens)
    return choices


def test_buckets_are_powers_of_two():
    assert [bucket_of(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 33)] == [1, 1, 2, 4, 4, 8, 8, 16, 64]


def test_an_explicit_limit_speculates_at_or_below_it_and_measures_nothing():
    gate = SpeculationGate(disable_above=8)
    assert [gate.speculate(n) for n in (1, 8, 9, 64)] == [True, True, False, False]
    gate.record(4, True, 0.1, 2.0)
    assert gate.as_dict() == {"disable_by_batch_size": 8, "buckets": {}}
    assert gate.summary() == "off above 8 running"
    with pytest.raises(ValueError, match="0: auto"):
        SpeculationGate(disable_above=-1)


def test_auto_probes_plain_steps_then_keeps_the_faster_side_per_bucket(caplog):
    """Batch 1: speculating emits 150 tokens/s per sequence against 100 plain: it stays on.
    Batch 32: 60 against 100: off once both sides have their samples; logged once."""
    gate = SpeculationGate(probe_every=4, min_samples=3, refresh_every=50)
    small = _drive(gate, 1, 12, spec_tok_s=150, plain_tok_s=100)
    assert small == [True, True, True, False] * 3  # (1 plain step in probe_every while measuring)
    assert _drive(gate, 1, 20, 150, 100) == [True] * 20
    with caplog.at_level(logging.INFO, logger="services.engine.spec_gate"):
        big = _drive(gate, 30, 40, spec_tok_s=60, plain_tok_s=100)
    assert big[:12] == [True, True, True, False] * 3 and not any(big[12:40])
    assert [r.getMessage() for r in caplog.records] == [
        "speculative decoding off at 17-32 running sequences: 60.0 tokens/s per sequence speculating, 100.0 plain"
    ]
    stats = gate.as_dict()["buckets"]
    assert stats["1"]["on"] is True and stats["32"]["on"] is False
    assert stats["32"]["speculating_tok_s"] == pytest.approx(60)
    assert stats["32"]["plain_tok_s"] == pytest.approx(100)
    assert gate.summary() == "auto (on up to 1; off at 32 running, by power-of-two bucket)"
    assert gate.speculate(3) is True  # (another bucket: its own measure, speculating meanwhile)


def test_auto_keeps_measuring_the_other_side_and_follows_a_change():
    """Every refresh_every decisions the side not chosen runs for min_samples steps (a burst), and is
    measured over that burst; when the load makes speculating pay again (e.g. drafts accepted more
    often), the bucket turns back on at the next burst."""
    gate = SpeculationGate(probe_every=4, min_samples=3, refresh_every=10, window=4)
    _drive(gate, 8, 40, spec_tok_s=50, plain_tok_s=100)
    assert gate.as_dict()["buckets"]["8"]["on"] is False
    later = _drive(gate, 8, 60, spec_tok_s=200, plain_tok_s=100)  # (the bursts measure it)
    assert gate.as_dict()["buckets"]["8"]["on"] is True
    assert all(later[9:19])  # (turned on by the first burst's samples)
    runs = "".join("S" if x else "p" for x in later[19:59]).split("S")
    assert [len(r) for r in runs if r] == [3] * 4  # (on again: a burst of 3 plain steps every 10 decisions)


def test_the_vllm_key_and_the_flag_agree_or_are_refused():
    config = '{"method": "deepseek_mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 8}'
    assert parse_speculative_config(config) == 2
    assert speculative_disable_by_batch_size(None, config) == 8
    assert speculative_disable_by_batch_size(8, config) == 8
    assert speculative_disable_by_batch_size(None, '{"num_speculative_tokens": 2}') == 0  # (auto)
    assert (
        speculative_disable_by_batch_size(None, None) == 0 and speculative_disable_by_batch_size(3, None) == 3
    )
    with pytest.raises(ValueError, match="disagree"):
        speculative_disable_by_batch_size(4, config)
    for bad in ('{"disable_by_batch_size": -1}', '{"disable_by_batch_size": "auto"}'):
        with pytest.raises(ValueError, match="disable_by_batch_size must be an integer"):
            parse_speculative_config(bad)


def test_k_is_bounded_with_a_clear_error():
    from types import SimpleNamespace

    cfg = SimpleNamespace(is_v4=False, num_nextn_predict_layers=1)
    for k in (1, 2, 4):
        check_speculation(cfg, k)
    for k in (0, 5):
        with pytest.raises(ValueError, match="1 to 4 draft tokens per step"):
            check_speculation(cfg, k)


def test_the_cli_and_the_cluster_settings_carry_it():
    from services.cli import build_parser
    from services.cluster import ClusterConfig
    from services.settings import SharedSettings

    args = build_parser().parse_args(
        ["generate", "--speculative-tokens", "2", "--speculative-disable-by-batch-size", "8"]
    )
    assert (args.speculative_tokens, args.speculative_disable_by_batch_size) == (2, 8)
    up = build_parser().parse_args(
        ["up", "--speculative-tokens", "3", "--speculative-disable-by-batch-size", "16"]
    )
    assert (up.speculative_tokens, up.speculative_disable_by_batch_size) == (3, 16)
    assert "speculative_disable_by_batch_size" in ClusterConfig.settings()
    from services.attention.worker import AttentionWorkerConfig

    cluster = ClusterConfig(model="m", speculative_tokens=2, speculative_disable_by_batch_size=8)
    engine = AttentionWorkerConfig.from_settings(cluster.attention, cluster.shared, "m").engine
    assert (engine.speculative_tokens, engine.speculative_disable_by_batch_size) == (2, 8)
    SharedSettings(speculative_tokens=4, speculative_disable_by_batch_size=16).validate()
    for bad in (dict(speculative_tokens=-1), dict(speculative_disable_by_batch_size=-1)):
        with pytest.raises(ValueError):
            SharedSettings(
                **bad
            ).validate()  # (k > 4: check_speculation, which the launcher runs before anything starts)
