"""MODEL as a hub repo id: resolved through huggingface_hub's local cache, with HF_HUB_OFFLINE respected
(no network in tests: the cache is laid out in tmp_path the way huggingface_hub writes it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fixtures_models import make_checkpoint

REVISION = "0123456789abcdef0123456789abcdef01234567"


def _run(args: list[str], cache: Path, *, offline: bool = True,
         endpoint: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_ENDPOINT")}
    env.update({"HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent / "home")})
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if endpoint is not None:
        env["HF_ENDPOINT"] = endpoint
    return subprocess.run([sys.executable, "-m", "ggufkit", *args], capture_output=True, text=True, env=env,
                          cwd=cache.parent)


@pytest.fixture
def fake_hub() -> Iterator[tuple[str, list[str]]]:
    """A local HTTP server standing in for the hub (nothing leaves the machine): it records every request
    and answers 404, as the hub does for an unknown repo."""
    requests: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            requests.append(f"{self.command} {self.path}")
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("X-Error-Code", "RepoNotFound")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(b'{"error": "Repository not found"}')

        do_GET = do_HEAD = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()


def _cached_repo(cache: Path) -> Path:
    repo = cache / "models--tiny-org--tiny-llama"
    snapshot = make_checkpoint(repo / "snapshots" / REVISION, "LlamaForCausalLM")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def test_cached_repo_id_converts_offline_with_repo_and_revision_in_provenance(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    snapshot = _cached_repo(cache)
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
    assert result.stderr.startswith("ggufkit: error: hub repo 'nobody/nothing' is not in the local cache and "
                                    "HF_HUB_OFFLINE=1 forbids downloading it")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not list(tmp_path.glob("*.gguf"))


def test_cached_repo_id_makes_no_request_even_when_online(tmp_path: Path, fake_hub: tuple[str, list[str]]) -> None:
    endpoint, requests = fake_hub
    cache = tmp_path / "hub"
    _cached_repo(cache)
    result = _run(["convert", "tiny-org/tiny-llama", "--outtype", "f16", "--no-check", "--json"], cache,
                  offline=False, endpoint=endpoint)
    assert result.returncode == 0, result.stderr
    assert requests == []  # resolved from the cache: the hub was never asked
    assert Path(json.loads(result.stdout)["outputs"][0]).is_file()


def test_uncached_repo_id_online_is_downloaded_and_a_missing_repo_is_one_line(
        tmp_path: Path, fake_hub: tuple[str, list[str]]) -> None:
    endpoint, requests = fake_hub
    cache = tmp_path / "hub"
    cache.mkdir()
    result = _run(["convert", "nobody/nothing", "--no-check"], cache, offline=False, endpoint=endpoint)
    assert any("/nobody/nothing/" in r for r in requests)  # a download was attempted
    assert result.returncode == 2
    assert result.stderr.startswith("ggufkit: error: hub repo 'nobody/nothing' could not be downloaded: ")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not list(tmp_path.glob("*.gguf"))
