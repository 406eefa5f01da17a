"""Deadlines drawn from observed latency (services.deadlines.py): the rule on its own,
and a real expert worker process frozen with SIGSTOP mid-serving, found in about a second (not
at the 30 s ceiling) with its pairs answered by the replica on the other worker."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from services.dataplane.placement import Placement
from services.dataplane.remote_experts import DispatchConfig, RemoteExperts
from services.deadlines import Deadlines
from services.experts.client import load_placement
from services.model.config import ModelConfig
from services.model.messages import ExpertCombine

from .wire_encoders import routed_dispatch


def test_the_ceiling_until_calls_were_seen_then_a_multiple_of_their_p99():
    d = Deadlines(ceiling_s=30.0, floor_s=1.0, factor=4.0, window=64, min_samples=8)
    assert d.timeout_s(8) == 30.0
    for _ in range(7):
        d.observe(8, 0.01)
    assert d.timeout_s(8) == 30.0  # (7 seen: not yet)
    d.observe(8, 0.01)
    assert d.timeout_s(8) == 1.0  # 4 x 10 ms under the floor: the floor
    assert d.timeout_s(12) == 1.0  # (8 and 12 rows: one class)
    assert d.timeout_s(2) == 1.0  # unlearned: from the learned neighbour (fewer rows: its deadline)
    assert d.timeout_s(1 << 10) == 4 * 0.01 * 2**7  # (more rows: its p99 doubled per class, x 4)
    for _ in range(8):
        d.observe(2048, 2.0)  # long prefill chunks
    assert d.timeout_s(2048) == 8.0 and d.timeout_s(8) == 1.0
    assert d.timeout_s(16) == 8.0  # (the nearest larger learned class: more rows take no less)
    d.observe(8, 0.5)  # a slow call: the class's p99 follows at once (0.5 s is its p99 of 9)
    assert d.timeout_s(8) == 2.0
    for _ in range(8):
        d.observe(2048, 60.0)
    assert d.timeout_s(2048) == 30.0  # (never beyond the ceiling)
    assert d.snapshot() == {"rows<=15": 2.0, "rows<=4095": 30.0}
    assert d.longest_s() == 30.0 and Deadlines(ceiling_s=7.0).longest_s() == 7.0  # (none seen: the ceiling)
    assert Deadlines(ceiling_s=0.5, floor_s=1.5).floor_s == 0.5
    with pytest.raises(ValueError):
        Deadlines(ceiling_s=30.0, factor=0.5)


def _start_worker(model_dir) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.experts.server", "--model", str(model_dir)],
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, proc.stdout.readline().strip()


def _freeze(pid: int, deadline_s: float = 10.0) -> None:
    """SIGSTOP `pid` and wait until every thread of it is stopped: kill() only queues the signal, and
    on a loaded VM a thread running on another vCPU can serve one more call before it stops."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + deadline_s
    while True:
        states = [
            (t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in Path(f"/proc/{pid}/task").iterdir()
        ]
        if all(s in ("T", "t") for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped after {deadline_s} s: {states}"
        time.sleep(0.01)


def test_a_frozen_worker_is_found_in_about_a_second_and_its_pairs_go_to_the_replica(tiny_model):
    cfg = ModelConfig.from_dir(tiny_model)
    E = cfg.n_routed_experts
    workers = [_start_worker(tiny_model) for _ in range(2)]
    try:
        addresses = tuple(a for _, a in workers)
        assert all(addresses), addresses
        both = Placement.round_robin(cfg.num_moe_layers, E, addresses, E)  # every expert on both
        load_placement(both, {a: a for a in addresses}, cfg.moe_layers)
        experts = RemoteExperts(cfg, both, dispatch_cfg=DispatchConfig(transport="shm", deadline_floor_s=1.0))
        msg = routed_dispatch(cfg, T=6, seed=3)
        want = experts.combine(ExpertCombine(experts.dispatch(msg)))
        for _ in range(12):  # (calls of this size seen: the deadline is learned from now on)
            torch.testing.assert_close(experts.combine(ExpertCombine(experts.dispatch(msg))), want)
        learned = experts.deadlines.timeout_s(6)  # (the floor, or 4 x p99 on a loaded machine)
        assert 1.0 <= learned < 30.0 and experts.stats.resent_pairs == 0
        frozen = workers[0][0]
        _freeze(frozen.pid)
        try:
            started = time.monotonic()
            got = experts.combine(ExpertCombine(experts.dispatch(msg)))
            took = time.monotonic() - started
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        torch.testing.assert_close(got, want)
        assert experts.stats.resent_pairs > 0
        assert 0.9 < took < learned + 8, (took, learned)  # (about the deadline; the ceiling is 30 s)
        experts.close()
    finally:
        for proc, _ in workers:
            proc.kill()
            proc.wait()
