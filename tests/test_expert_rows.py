"""In-place expert rows (services/experts/rows.py, SlotStore): a re-plan stages and writes only the
experts it moves, within a stated memory bound; rows in use are never written (the old version
serves on, unchanged, while the new one loads); a released version's rows wait for its in-flight
calls; a failed load leaves the serving version intact; freed rows serve the next re-plan."""

import threading

import pytest
import torch

from services.experts.rows import plan_rows, row_map
from services.experts.store import ExpertNotFound, SlotStore

from .test_expert_store import _layout, _request, model  # noqa: F401 (a fixture)


# ---- plan_rows (pure) ----------------------------------------------------------------------------
def test_held_experts_keep_their_rows_and_new_ones_take_free_rows_lowest_first():
    # rows 0-3 hold 10, 11, 12, 13; the serving version reads rows 0-2; row 3 is free (holds 13)
    rows, writes, appended = plan_rows([10, 11, 12, 13], {0, 1, 2}, [12, 13, 20, 10])
    assert rows == [2, 3, 4, 0] and writes == {20: 4} and appended == 1  # 13 is a hit in a free row
    rows, writes, appended = plan_rows([10, 11, 12, 13], {0, 1}, [20, 21, 10])
    assert writes == {20: 2, 21: 3} and rows == [2, 3, 0] and appended == 0


def test_rows_in_use_are_never_planned_for_writing():
    expert, in_use = [5, 6, 7, 8, -1, 9], {0, 2, 5}
    for layout in ([1, 2, 3], [5, 1, 8, 2], [9, 9, 4]):
        rows, writes, appended = plan_rows(expert, in_use, layout)
        assert not set(writes.values()) & in_use
        assert len(rows) == len(layout) and all(
            rows[i] == rows[layout.index(e)] for i, e in enumerate(layout)
        )
        assert appended == max(0, len(writes) - sum(r not in in_use for r in range(6)))


def test_slots_with_one_expert_share_its_row_and_identity_needs_no_map():
    rows, writes, appended = plan_rows([], set(), [3, 3, 4])
    assert rows == [0, 0, 1] and writes == {3: 0, 4: 1} and appended == 2
    assert row_map([0, 1, 2], 3) is None
    assert row_map([0, 1, 2], 4).tolist() == [0, 1, 2] and row_map([1, 0], 2).tolist() == [1, 0]


# ---- SlotStore -----------------------------------------------------------------------------------
def _check(store, cfg, everything, version, experts, seed=0):
    for layer in cfg.moe_layers:
        x, slot, weight, logical = _request(cfg, experts, seed=seed + layer)
        want = everything.packed.forward(layer, x, logical, weight)
        torch.testing.assert_close(store.forward(version, layer, x, slot, weight), want, rtol=1e-5, atol=1e-6)
        out = torch.empty_like(x)  # (the decode kernel's path: into the response's buffer)
        torch.testing.assert_close(
            store.forward(version, layer, x, slot, weight, out), want, rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("spare", [0, 2])
def test_a_replan_moving_some_slots_stays_within_its_memory_bound(model, spare):  # noqa: F811
    path, cfg, everything = model
    S, moved = 8, 2
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    store = SlotStore(cfg, path, torch.float32, spare_rows=spare)
    old = list(range(S))
    store.load(1, _layout(cfg, old))
    steady = store.weight_bytes()
    assert steady == (S + spare) * expert_bytes * cfg.num_moe_layers
    new = old[moved:] + [14, 15]  # 2 of 8 slots move (and the others shift slots)
    report = store.load(2, _layout(cfg, new))
    moved_bytes = moved * expert_bytes * cfg.num_moe_layers
    layer_bytes = (S + spare) * expert_bytes
    assert report.bytes_written == moved_bytes and report.bytes_read == moved_bytes
    assert report.bytes_reused == (S - moved) * expert_bytes * cfg.num_moe_layers
    if spare >= moved:  # the spare rows take the moved experts: nothing grows
        assert report.rows_added == 0 and report.peak_extra_bytes == moved_bytes // cfg.num_moe_layers
        assert store.weight_bytes() == steady
    else:  # each layer grows by the moved rows, one layer copied at a time
        assert report.rows_added == moved * cfg.num_moe_layers
        # (the grown rows, one layer's old rows while they are copied, one layer's staged experts)
        assert report.peak_extra_bytes <= moved_bytes + layer_bytes + moved * expert_bytes
        assert store.weight_bytes() == steady + moved_bytes
    assert report.peak_extra_bytes < steady  # (the old way: a second copy of every changed layer)
    _check(store, cfg, everything, 1, old)
    _check(store, cfg, everything, 2, new)
    # the old version released, the next re-plan fits in the rows it freed
    store.release(1)
    grown = store.weight_bytes()
    report = store.load(3, _layout(cfg, [0, 1] + new[2:]))
    assert report.rows_added == 0 and store.weight_bytes() == grown
    _check(store, cfg, everything, 3, [0, 1] + new[2:])


def test_the_serving_version_is_unchanged_while_another_loads(model):  # noqa: F811
    path, cfg, everything = model
    store = SlotStore(cfg, path, torch.float32)
    store.load(1, _layout(cfg, [0, 1, 2, 3]))
    layer = cfg.moe_layers[0]
    x, slot, weight, _ = _request(cfg, [0, 1, 2, 3], seed=5)
    before = store.forward(1, layer, x, slot, weight).clone()
    stop, bad = threading.Event(), []

    def serve():
        while not stop.is_set():
            if not torch.equal(store.forward(1, layer, x, slot, weight), before):
                bad.append(1)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        for v, experts in enumerate(([4, 5, 2, 3], [6, 7, 8, 9], [3, 2, 1, 0]), start=2):
            store.load(v, _layout(cfg, experts))
            _check(store, cfg, everything, v, experts, seed=v)
            store.release(v)
    finally:
        stop.set()
        thread.join()
    assert not bad


def test_a_released_versions_rows_wait_for_its_running_calls(model, monkeypatch):  # noqa: F811
    path, cfg, everything = model
    store = SlotStore(cfg, path, torch.float32)
    store.load(1, _layout(cfg, [0, 1, 2, 3]))
    layer = cfg.moe_layers[0]
    x, slot, weight, logical = _request(cfg, [0, 1, 2, 3], seed=7)
    entered, go, got = threading.Event(), threading.Event(), []
    compute = store._compute

    def slow(held, *a):
        entered.set()
        go.wait(30)
        return compute(held, *a)

    monkeypatch.setattr(store, "_compute", slow)
    call = threading.Thread(target=lambda: got.append(store.forward(1, layer, x, slot, weight)))
    call.start()
    assert entered.wait(30)
    store.release(1)  # while its call runs
    monkeypatch.setattr(store, "_compute", compute)
    report = store.load(2, _layout(cfg, [4, 5, 6, 7]))
    assert report.rows_added == 4 * cfg.num_moe_layers  # version 1's rows were not free yet
    go.set()
    call.join(30)
    torch.testing.assert_close(
        got[0], everything.packed.forward(layer, x, logical, weight), rtol=1e-5, atol=1e-6
    )
    assert not store._draining
    assert store.load(3, _layout(cfg, [8, 9, 10, 11])).rows_added == 0  # now they are


def test_experts_being_fetched_by_a_peer_keep_their_rows_through_a_release_and_reload(model):  # noqa: F811
    """A peer copy (FetchExperts) streams rows of the packed tensors; a re-plan that releases
    their version and loads another meanwhile writes elsewhere until the stream is over."""
    path, cfg, everything = model
    store = SlotStore(cfg, path, torch.float32)
    store.load(1, _layout(cfg, [0, 1, 2, 3]))
    layer = cfg.moe_layers[0]
    with store.fetching(layer, [2, 0]) as fetched:
        before = [(e, rows.w13.clone(), rows.w2.clone()) for e, rows in fetched]
        store.release(1)  # (the balancer's next step while the stream still runs)
        report = store.load(2, _layout(cfg, [4, 5, 6, 7]))
        assert report.rows_added == 4 * cfg.num_moe_layers  # version 1's rows were not free
        for (e, w13, w2), (_, rows) in zip(before, fetched, strict=True):
            assert torch.equal(rows.w13, w13) and torch.equal(rows.w2, w2), e
    assert not store._draining  # the stream over: its rows serve the next re-plan
    assert store.load(3, _layout(cfg, [8, 9, 10, 11])).rows_added == 0
    with pytest.raises(ExpertNotFound):
        store.expert_weights(layer, [0])  # (version 1 is gone)


def test_a_fetch_stream_cancelled_midway_lets_its_rows_go(model):  # noqa: F811
    """FetchExperts holds the versions it reads while its stream runs; a client that leaves after
    the first expert (gRPC closes the generator) lets them go: a released one stops draining."""
    from services.experts.servicer import ExpertServicer
    from services.rpc import expert_pb2

    path, cfg, everything = model
    store = SlotStore(cfg, path, torch.float32)
    store.load(1, _layout(cfg, [0, 1, 2, 3]))
    store.load(2, _layout(cfg, [4, 5, 6, 7]))
    servicer = ExpertServicer(store)
    layer = cfg.moe_layers[0]
    stream = servicer.FetchExperts(expert_pb2.FetchExpertsRequest(layer=layer, logical_expert=[1, 2]), None)
    assert next(stream)  # (the first expert sent)
    assert store._versions[1].inflight == 1 and store._versions[2].inflight == 0  # (only its source held)
    store.release(1)
    assert store._draining
    stream.close()  # the client went away
    assert not store._draining
    servicer.close()


def test_a_failed_load_leaves_the_serving_version_intact(model, tmp_path):  # noqa: F811
    path, cfg, everything = model
    store = SlotStore(cfg, path, torch.float32)
    store.load(1, _layout(cfg, [0, 1, 2, 3]))
    store.model_dir = tmp_path  # (no checkpoint here any more, and no peers)
    with pytest.raises(ExpertNotFound):
        store.load(2, _layout(cfg, [0, 1, 2, 9]))
    assert store.loaded_versions == [1]
    _check(store, cfg, everything, 1, [0, 1, 2, 3])
    store.model_dir = path
    report = store.load(2, _layout(cfg, [0, 1, 2, 9]))
    _check(store, cfg, everything, 2, [0, 1, 2, 9])
    assert report.bytes_written == 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4 * cfg.num_moe_layers
