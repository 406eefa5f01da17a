"""Load counts through a real Redis: bucketed writes, window reads, Redis outages."""

import time

import torch

from services.attention.load_reporter import LoadReporter, LoadReporterConfig
from services.redis_store import (
    EmbeddedRedis,
    connect,
    current_bucket,
    persist_placement,
    read_load_window,
    restore_placement,
    write_loads,
)
from services.settings import SharedSettings


def test_write_and_read_window(redis_server):
    client = connect(redis_server.url)
    a = torch.tensor([[0, 3, 0], [5, 0, 1]])
    b = torch.tensor([[1, 0, 0], [0, 0, 2]])
    write_loads(client, "t1", 100, a, ttl_seconds=60)
    write_loads(client, "t1", 101, b, ttl_seconds=60)
    write_loads(client, "t1", 101, b, ttl_seconds=60)
    assert torch.equal(read_load_window(client, "t1", 101, 2, 2, 3), a + 2 * b)
    assert torch.equal(read_load_window(client, "t1", 101, 1, 2, 3), 2 * b)
    assert 0 < client.ttl("t1:load:100") <= 60


def test_placement_round_trip(redis_server):
    client = connect(redis_server.url)
    assert restore_placement(client, "t2") is None
    persist_placement(client, "t2", {"version": 7, "phy2log": [[0, 1]], "workers": ["a"]})
    assert restore_placement(client, "t2")["version"] == 7 and client.get("t2:placement:version") == b"7"


def test_reporter_flushes_in_the_background(redis_server):
    cfg = LoadReporterConfig(
        SharedSettings(redis_url=redis_server.url, key_prefix="t3", bucket_seconds=60), 0.05
    )
    rep = LoadReporter(cfg, 2, 4)
    rep.add(torch.tensor([[1, 0, 0, 2], [0, 0, 7, 0]]))
    rep.add(torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]]))
    deadline = time.monotonic() + 5
    while rep.flushed_tokens < 11 and time.monotonic() < deadline:
        time.sleep(0.02)
    rep.close()
    total = read_load_window(connect(redis_server.url), "t3", current_bucket(60), 2, 2, 4)
    assert torch.equal(total, torch.tensor([[2, 0, 0, 2], [0, 0, 7, 0]]))


def test_redis_down_keeps_counts_then_flushes_when_back():
    server = EmbeddedRedis.start()
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    cfg = LoadReporterConfig(SharedSettings(redis_url=server.url, key_prefix="t4", bucket_seconds=60), 3600)
    rep = LoadReporter(cfg, 1, 2)
    server.stop()
    rep.add(torch.tensor([[4, 1]]))
    t = time.monotonic()
    assert not rep.flush()
    assert time.monotonic() - t < 2.0  # fails fast, never stalls the caller
    assert rep.failed_flushes == 1 and rep.dropped_tokens == 0
    server = EmbeddedRedis.start(port=port, password=server.password)  # (the same server again)
    try:
        rep.add(torch.tensor([[1, 0]]))
        assert rep.flush()
        total = read_load_window(connect(server.url), "t4", current_bucket(60), 2, 1, 2)
        assert torch.equal(total, torch.tensor([[5, 1]]))
        rep.close()
    finally:
        server.stop()


def test_counts_pending_too_long_are_dropped_and_counted():
    cfg = LoadReporterConfig(SharedSettings(redis_url="redis://127.0.0.1:1/0"), 3600, max_pending_seconds=0.0)
    rep = LoadReporter(cfg, 1, 2)
    rep.add(torch.tensor([[3, 3]]))
    time.sleep(0.01)
    assert not rep.flush()
    assert rep.dropped_tokens == 6 and rep.stats()["redis_error"]
    rep.close()
