"""The attention worker's lease table (services/attention/leases.py): requests of a router replica
that stopped renewing its lease are handed out once for aborting."""

from services.attention.leases import OwnerLeases


def test_requests_of_a_silent_owner_lapse_once_and_live_ones_stay():
    leases = OwnerLeases(timeout_s=5.0)
    leases.start("replica-a", "r1", now=0.0)
    leases.start("replica-a", "r2", now=0.5)
    leases.start("replica-b", "r3", now=1.0)
    leases.renew("replica-b", now=5.0)
    assert leases.lapsed(now=5.4) == []  # a renewed 4.9 s ago, b 0.4 s ago
    leases.end("replica-a", "r2")  # finished on its own
    assert leases.lapsed(now=5.6) == ["r1"]  # a is silent for 5.1 s: its running request
    assert leases.lapsed(now=5.7) == []  # handed out once
    assert leases.running() == {"replica-b": 1}
    leases.renew("replica-b", now=9.0)
    assert leases.lapsed(now=13.0) == []
    assert leases.lapsed(now=14.5) == ["r3"] and leases.running() == {}


def test_an_arrival_renews_and_an_idle_owner_is_forgotten():
    leases = OwnerLeases(timeout_s=2.0)
    leases.start("a", "r1", now=0.0)
    leases.end("a", "r1")
    assert leases.lapsed(now=10.0) == [] and leases.running() == {}
    leases.start("a", "r2", now=10.0)  # (a new request renews: no stale lapse)
    assert leases.lapsed(now=11.0) == []
