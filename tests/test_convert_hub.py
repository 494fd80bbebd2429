"""MODEL as a hub repo id: resolved through huggingface_hub's local cache, with HF_HUB_OFFLINE respected
(no network in tests: the cache is laid out in tmp_path the way huggingface_hub writes it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fixtures_models import make_checkpoint

REVISION = "0123456789abcdef0123456789abcdef01234567"


def _run(args: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache.parent / "home")}
    return subprocess.run([sys.executable, "-m", "ggufkit", *args], capture_output=True, text=True, env=env,
                          cwd=cache.parent)


def test_cached_repo_id_converts_offline_with_repo_and_revision_in_provenance(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-llama"
    snapshot = make_checkpoint(repo / "snapshots" / REVISION, "LlamaForCausalLM")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    before = sorted(p.name for p in snapshot.iterdir())
    result = _run(["convert", "tiny-org/tiny-llama", "--outtype", "f16", "--no-check", "--json"], cache)
    assert result.returncode == 0, result.stderr
    out = Path(json.loads(result.stdout)["outputs"][0])
    assert out == tmp_path / "tiny-llama-115K-F16.gguf"  # hub ids write into the current directory
    from ggufkit.format import open_gguf

    with open_gguf(out) as m:
        assert m.get("ggufkit.source.repo") == "tiny-org/tiny-llama"
        assert m.get("ggufkit.source.revision") == REVISION
        assert m.get("general.name") == "tiny-llama"
    assert sorted(p.name for p in snapshot.iterdir()) == before  # nothing is written into the cache


def test_uncached_repo_id_offline_is_a_one_line_error(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    cache.mkdir()
    result = _run(["convert", "nobody/nothing", "--no-check"], cache)
    assert result.returncode == 2
    assert result.stderr.startswith("ggufkit: error: hub repo 'nobody/nothing' is not available")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
