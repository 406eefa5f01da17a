"""`--model` as a Hugging Face id (services/hf_models.py): resolved through a huggingface_hub cache
laid out in a temp dir as huggingface_hub lays it out, offline (no network in these tests: the
Hub client's calls fail them), with the revision pinned; `moe-cluster generate` and `up` take the
id and hand the services the snapshot directory."""

import json

import huggingface_hub
import pytest

from services.cli import build_parser, main, up_config
from services.hf_models import ModelNotFound, ensure_local, resolve_model, snapshot_id
from services.presets import init_model

from .hub_cache import add_snapshot, commit_hash

REPO = "test-org/tiny-moe"
OLD, NEW = commit_hash("old"), commit_hash("new")
PROMPT = ["--prompt-token-ids", "0,5,6,7", "--prompt-token-ids", "0,9", "--max-tokens", "6", "--json"]


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any call to the Hub fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the Hub was called")

    for name in ("repo_info", "model_info", "list_repo_tree", "list_repo_files"):
        monkeypatch.setattr(huggingface_hub.HfApi, name, refuse)


@pytest.fixture(scope="module")
def checkpoints(tiny_model, tmp_path_factory):
    """Two commits of the tiny preset: OLD (seed 0: `tiny_model`) and NEW (seed 1), `main` at NEW."""
    newer = init_model(tmp_path_factory.mktemp("tiny-seed1"), "tiny", seed=1)
    return {OLD: tiny_model, NEW: newer}


@pytest.fixture
def hub(tmp_path, monkeypatch, checkpoints):
    """HF_HUB_CACHE: the two commits of REPO (branch `stable` at OLD); HF_HUB_OFFLINE=1."""
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, checkpoints[OLD], OLD, refs=("stable",))
    add_snapshot(cache, REPO, checkpoints[NEW], NEW, refs=("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HOME", raising=False)
    return cache


def _snapshot(cache, commit):
    return str(cache / "models--test-org--tiny-moe" / "snapshots" / commit)


def test_an_id_resolves_to_its_snapshot_and_a_pinned_revision_to_its_own(hub):
    latest = resolve_model(REPO)
    assert (latest.path, latest.repo_id, latest.commit) == (_snapshot(hub, NEW), REPO, NEW)
    assert latest.served_name == REPO
    pinned = resolve_model(REPO, OLD)
    assert (pinned.path, pinned.commit) == (_snapshot(hub, OLD), OLD)
    assert resolve_model(REPO, "stable").path == _snapshot(hub, OLD)  # a branch, through refs/
    assert resolve_model(REPO, "main").path == _snapshot(hub, NEW)


def test_hf_home_names_the_cache(hub, tmp_path, monkeypatch, checkpoints):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    with pytest.raises(ModelNotFound, match="not in the Hugging Face cache .*home/hub"):
        resolve_model(REPO)
    add_snapshot(tmp_path / "home" / "hub", REPO, checkpoints[OLD], OLD)
    assert resolve_model(REPO).path == str(
        tmp_path / "home" / "hub" / "models--test-org--tiny-moe" / "snapshots" / OLD
    )


def test_what_the_cache_lacks_offline_is_an_error_that_says_so(hub, monkeypatch):
    with pytest.raises(
        ModelNotFound,
        match=r"other/model \(revision main\) is not in the Hugging Face cache .*HF_HUB_OFFLINE=1",
    ):
        resolve_model("other/model")
    with pytest.raises(ModelNotFound, match="revision v9"):
        resolve_model(REPO, "v9")
    with pytest.raises(ModelNotFound, match="revision " + commit_hash("never")):
        resolve_model(REPO, commit_hash("never"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # online, but downloads not allowed: the cache only
    assert resolve_model(REPO, download=False).path == _snapshot(hub, NEW)
    with pytest.raises(ModelNotFound, match="downloads are off"):
        resolve_model("other/model", download=False)


def test_directories_pass_through_and_other_names_are_refused(hub, tiny_model, tmp_path):
    assert resolve_model(str(tiny_model)).path == str(tiny_model.resolve())
    assert resolve_model(str(tiny_model), "v1").repo_id is None  # (a revision of a directory: ignored)
    with pytest.raises(ModelNotFound, match="no such directory, and not a Hugging Face id"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ModelNotFound, match="a file"):
        resolve_model(str(tiny_model / "config.json"))
    with pytest.raises(ModelNotFound, match="not a Hugging Face id"):
        resolve_model("tiny")  # (a bare name is a directory that is not there)


def test_a_snapshot_path_from_another_node_resolves_to_the_same_commit_here(hub):
    elsewhere = f"/mnt/other-node/hf/models--test-org--tiny-moe/snapshots/{OLD}"
    assert snapshot_id(elsewhere) == (REPO, OLD)
    assert snapshot_id("/models/deepseek-v3") is None
    assert ensure_local(elsewhere) == _snapshot(hub, OLD)
    assert ensure_local(_snapshot(hub, NEW)) == _snapshot(hub, NEW)  # (here already)
    with pytest.raises(ModelNotFound, match="no such directory on this node"):
        ensure_local("/mnt/other-node/models/v3")


def _generate(capsys, *model_args) -> list[list[int]]:
    assert main(["generate", *model_args, *PROMPT]) == 0
    return [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]


def test_generate_serves_an_id_from_the_offline_cache_at_the_pinned_revision(hub, checkpoints, capsys):
    pinned = _generate(capsys, "--model", REPO, "--revision", OLD)
    assert len(pinned) == 2 and all(len(t) == 6 for t in pinned)
    assert pinned == _generate(capsys, "--model", str(checkpoints[OLD]))  # the OLD checkpoint's tokens
    assert _generate(capsys, "--model", REPO) == _generate(capsys, "--model", str(checkpoints[NEW]))
    assert main(["generate", "--model", "other/model", *PROMPT]) == 2
    assert "not in the Hugging Face cache" in capsys.readouterr().err


def test_up_hands_the_services_the_snapshot_and_serves_it_under_its_id(hub):
    args = build_parser().parse_args(["up", "--model", REPO, "--revision", OLD])
    cfg = up_config(args)
    assert (cfg.model, cfg.router.served_model_name) == (_snapshot(hub, OLD), REPO)
    args = build_parser().parse_args(["up", "--model", REPO, "--served-model-name", "tiny"])
    cfg = up_config(args)
    assert (cfg.model, cfg.router.served_model_name) == (_snapshot(hub, NEW), "tiny")
    with pytest.raises(ModelNotFound, match="other/model"):
        up_config(build_parser().parse_args(["up", "--model", "other/model"]))


def test_the_launcher_resolves_an_id_without_the_cli(hub):
    """services/serve.py (KubeRay) and Cluster.start take an id too: the launcher resolves it."""
    from services.cluster import ClusterConfig
    from services.cluster import resolve_model as launcher_model

    assert launcher_model(ClusterConfig(model=REPO)) == _snapshot(hub, NEW)
    with pytest.raises(ModelNotFound):
        launcher_model(ClusterConfig(model="/no/such/dir"))
