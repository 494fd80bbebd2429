"""Upload a finished release through huggingface_hub (nothing of ggufkit's own speaks HTTP).

The repository is created when missing (``create_repo(exist_ok=True)``), the branch too with ``revision``;
the files go up in one commit with ``upload_folder`` (huggingface_hub 2.x has no ``upload_large_folder``);
files the hub already holds with the same content are not sent again, so a failed or interrupted upload is
retried by running the command again. Only the release's files are sent (``allow_patterns``), never the
state directory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def push_plan(repo_id: str, files: Sequence[str], *, private: bool, revision: str | None) -> dict[str, Any]:
    """What :func:`push` will do: the repository, branch and exact files."""
    return {"repo_id": repo_id, "repo_type": "model", "private": private, "revision": revision or "main",
            "files": sorted(files), "method": "huggingface_hub.HfApi.upload_folder",
            "commit_message": commit_message(files)}


def commit_message(files: Sequence[str]) -> str:
    return f"ggufkit release: {len(files)} files"


def push(outdir: Path, repo_id: str, files: Sequence[str], *, private: bool = False,
         revision: str | None = None) -> dict[str, Any]:
    """Create the repository if missing and upload ``files`` (names relative to ``outdir``).

    Returns:
        :func:`push_plan`'s description plus the repository URL.
    """
    from huggingface_hub import HfApi

    api = HfApi()
    url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    if revision is not None:
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=outdir, repo_type="model", revision=revision,
                      allow_patterns=sorted(files), commit_message=commit_message(files))
    return {**push_plan(repo_id, files, private=private, revision=revision), "url": str(url)}
