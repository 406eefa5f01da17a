"""A Hugging Face cache laid out as huggingface_hub lays it out, for tests that resolve model ids
offline: `models--{org}--{name}/blobs/{hash}` holding each file once, `snapshots/{commit}/{path}`
relative symlinks to the blobs, `refs/{branch}` holding a commit."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_snapshot(
    cache: Path, repo_id: str, checkpoint: Path, commit: str, refs: tuple[str, ...] = ("main",)
) -> Path:
    """Put the files of `checkpoint` into `cache` as commit `commit` of `repo_id` (the branches
    in `refs` pointing at it); the snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for f in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / f.relative_to(checkpoint)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # (no newline, as huggingface_hub writes it)
    return snapshot


def commit_hash(tag: str) -> str:
    """A 40-hex commit id derived from `tag`."""
    return hashlib.sha1(tag.encode()).hexdigest()
