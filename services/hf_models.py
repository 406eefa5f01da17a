"""`--model` as a local directory or a Hugging Face id (`org/name`, with `--revision`), resolved
through huggingface_hub's cache the way vLLM resolves it.

    resolve_model("deepseek-ai/DeepSeek-V3")            # -> ResolvedModel(path=".../snapshots/<sha>", ...)
    resolve_model("/models/v3")                          # a directory: itself

An id goes to `huggingface_hub.snapshot_download` with the files a checkpoint here needs
(`ALLOW_PATTERNS`: config, tokenizer, safetensors and their index); what the cache holds is
used as it is, what it lacks is downloaded (with huggingface_hub's progress bars) unless
HF_HUB_OFFLINE=1. The cache is huggingface_hub's: HF_HUB_CACHE, else HF_HOME/hub, else
~/.cache/huggingface/hub (read when called, not when huggingface_hub was imported). HF_TOKEN (or
a `huggingface-cli login`) opens gated and private models.

The path handed on is the snapshot directory, `.../models--org--name/snapshots/<commit>`: it
names the id and the exact commit, so a process on another node that lacks it resolves the same
revision into its own cache (`ensure_local`).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# what a checkpoint here is read from (vLLM's set for a safetensors checkpoint): config.json,
# generation config, tokenizer files, chat templates, the safetensors shards and their index
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "tokenizer*"]

# org/name as the Hub spells them (a name alone is taken as a directory: `tiny` is not a Hub id)
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
# a snapshot in a huggingface_hub cache: models--{org}--{name}/snapshots/{commit}
SNAPSHOT = re.compile(r"(?:^|/)models--(?P<folder>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})/?$")
_TRUE = {"1", "true", "yes", "on"}


class ModelNotFound(ValueError):
    """`--model` names neither a directory nor a Hugging Face model this process can have."""


@dataclass(frozen=True)
class ResolvedModel:
    path: str  # the local checkpoint directory
    repo_id: str | None = None  # the Hugging Face id it came from (None: a directory was given)
    commit: str | None = None  # the commit the id's revision resolved to

    @property
    def served_name(self) -> str:
        """The model's name in the API by default: the id as given (vLLM's), else the directory's name."""
        return self.repo_id or Path(self.path).name


def is_repo_id(model: str) -> bool:
    return bool(REPO_ID.match(model)) and ".." not in model and "--" not in model


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", os.environ.get("TRANSFORMERS_OFFLINE"))
    return env.strip().lower() in _TRUE if env is not None else bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir() -> str:
    """huggingface_hub's cache directory as the environment names it now (HF_HUB_CACHE, then
    HUGGINGFACE_HUB_CACHE, then HF_HOME/hub, then huggingface_hub's default)."""
    from huggingface_hub import constants

    for env in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(env):
            return os.path.expanduser(os.environ[env])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return str(constants.HF_HUB_CACHE)


def resolve_model(
    model: str,
    revision: str | None = None,
    *,
    download: bool = True,
    cache_dir: str | None = None,
    token: str | None = None,
) -> ResolvedModel:
    """`model` as a local checkpoint directory: a directory as it is (a `revision` for it is
    ignored, as vLLM does), a Hugging Face id through the cache, downloaded where missing unless
    `download` is False or HF_HUB_OFFLINE is set. Raises ModelNotFound with what to do."""
    path = Path(model).expanduser()
    if path.is_dir():
        if revision:
            log.warning("--revision %s ignored: %s is a local directory", revision, model)
        return ResolvedModel(str(path.resolve()))
    if path.exists():
        raise ModelNotFound(f"--model {model}: a file, not a checkpoint directory")
    if not is_repo_id(model):
        raise ModelNotFound(f"--model {model}: no such directory, and not a Hugging Face id (org/name)")
    return _snapshot(model, revision, download=download, cache_dir=cache_dir, token=token)


def _snapshot(repo_id: str, revision: str | None, *, download: bool, cache_dir: str | None,
              token: str | None) -> ResolvedModel:  # fmt: skip
    from huggingface_hub import errors, snapshot_download

    cache = cache_dir or hub_cache_dir()
    local_only = offline() or not download
    what = f"{repo_id} (revision {revision or 'main'})"
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=ALLOW_PATTERNS,
                                   local_files_only=local_only, token=token or None)  # fmt: skip
    except errors.GatedRepoError:
        raise ModelNotFound(
            f"{what} is gated: accept its terms on https://huggingface.co/{repo_id} and set HF_TOKEN"
        ) from None
    except errors.RepositoryNotFoundError:
        raise ModelNotFound(
            f"{repo_id}: no such model on the Hugging Face Hub (a private one: set HF_TOKEN)"
        ) from None
    except errors.RevisionNotFoundError:
        raise ModelNotFound(f"{repo_id} has no revision {revision!r}") from None
    except errors.LocalEntryNotFoundError as e:
        if type(e).__name__ == "IncompleteSnapshotError":  # (huggingface_hub >= 1.x: files missing, offline)
            raise ModelNotFound(f"{what}: {e}") from None
        why = ("downloads are off (HF_HUB_OFFLINE=1)" if offline() else "downloads are off" if not download
               else f"the Hub cannot be reached ({str(e).splitlines()[0][:200]})")  # fmt: skip
        raise ModelNotFound(
            f"{what} is not in the Hugging Face cache {cache} and {why}: download it once where the "
            f"Hub is reachable (`hf download {repo_id}`), or pass a checkpoint directory"
        ) from None
    except errors.HfHubHTTPError as e:  # (an incomplete snapshot offline, the Hub failing)
        raise ModelNotFound(f"{what}: {e}") from None
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelNotFound(f"{what}: no config.json in {folder}")
    if not any(folder.glob("*.safetensors")):
        raise ModelNotFound(
            f"{what}: no safetensors weights in {folder} (only safetensors checkpoints are read)"
        )
    log.info("model %s: %s", what, folder)
    return ResolvedModel(str(folder), repo_id, folder.name)


def snapshot_id(path: str | Path) -> tuple[str, str] | None:
    """(repo id, commit) of a huggingface_hub cache snapshot path; None for any other path."""
    m = SNAPSHOT.search(Path(path).as_posix())
    if m is None:
        return None
    return m.group("folder").replace("--", "/"), m.group("commit")


def ensure_local(path: str | Path, download: bool = True) -> str:
    """`path` on this node: itself where it exists; a cache snapshot path that does not (the
    launcher resolved it on another node) resolved to the same commit here, in this node's own
    cache, downloaded unless offline. For a process about to open a checkpoint it was handed."""
    if Path(path).exists():
        return str(path)
    found = snapshot_id(path)
    if found is None:
        raise ModelNotFound(f"{path}: no such directory on this node")
    repo_id, commit = found
    return resolve_model(repo_id, commit, download=download).path
