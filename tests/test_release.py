"""`ggufkit release` end to end on a tiny real-tokenizer LLaMA (sentencepiece vocabulary trained here).

Every number of the card and manifest is compared with `ggufkit ppl` (API) on that file alone, every GGUF is
loaded by llama.cpp (llama-cpp-python), reruns skip every step and change no byte, a run killed with SIGKILL
and rerun ends with the bytes of an uninterrupted run, and `--only` on two copies then `--card-only` gives the
single-machine release. The upload itself is not tested against the hub (only up to the upload call).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cli_helpers import invoke

from ggufkit.eval.perplexity import perplexity
from ggufkit.release.card import percent
from ggufkit.release.plan import TextInput

TYPES = "q8_0,q4_k_m,iq2_m"
ARGS = ["--types", TYPES, "--ctx", "64", "--chunks", "4", "--imatrix-chunks", "4", "--device", "cpu"]
ROOT = Path(__file__).resolve().parents[1]


def _llama_perplexity(model: Path, text_file: Path) -> float:
    """llama-perplexity's final PPL. Its log goes through a worker thread that sometimes loses the last lines at
    exit (common/log.cpp), so a run that exits 0 without the final line is run again (at most 5 times)."""
    from llama_cpp_sources import tool_path

    for _ in range(10):
        proc = subprocess.run([str(tool_path("llama-perplexity")), "-m", str(model), "-f", str(text_file), "-c",
                               "64", "--chunks", "4", "-t", "2", "--no-repack"], capture_output=True, text=True,
                              check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        output = proc.stdout + proc.stderr
        if "Final estimate: PPL = " in output:
            return float(output.split("Final estimate: PPL = ")[1].split()[0])
        # The running PPL after the last chunk is the final estimate (tools/perplexity: both print
        # exp(nll/count) with 4 decimals); use it when only the closing line was lost.
        last = re.search(r"\[4\]([0-9.]+),", output)
        if last:
            return float(last.group(1))
    raise AssertionError(output[-3000:])


def _artifacts(outdir: Path) -> dict[str, str]:
    """sha256 of every file of the release (the state directory's hash cache holds mtimes: left out)."""
    out = {}
    for p in sorted(outdir.rglob("*")):
        if p.is_file() and p.name != "hashes.json":
            out[p.relative_to(outdir).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import fixtures_models as fm

    d = tmp_path_factory.mktemp("ck") / "tiny-llama"
    fm.make_checkpoint(d, "LlamaForCausalLM", hidden_size=256, intermediate_size=512, max_position_embeddings=256)
    (d / "README.md").write_text("---\nlicense: apache-2.0\nlanguage:\n- en\n---\n# tiny\n")
    return d


@pytest.fixture(scope="module")
def released(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("rel") / "out"
    result = invoke("release", str(checkpoint), "-o", str(out), *ARGS, "--json")
    assert result.exit_code == 0, result.stderr
    return out, json.loads(result.stdout)


def test_release_numbers_equal_ggufkit_ppl_and_files_load(released: tuple[Path, dict]) -> None:
    out, report = released
    manifest = json.loads((out / "manifest.json").read_text())
    text = TextInput.bundled("evaluation").text
    master = out / report["files"][[f.endswith("-F16.gguf") for f in report["files"]].index(True)]
    alone = perplexity(master, text=text, ctx=64, chunks=4, device="cpu")
    assert report["master"]["ppl"] == alone.ppl and report["master"]["ppl_error"] == alone.ppl_error
    card = (out / "README.md").read_text()
    assert f"{alone.ppl:.4f} ± {alone.ppl_error:.4f}" in card
    for row in report["rows"]:
        path = out / row["file"]
        # issue 35: by default the master's whole vocabulary is stored (it fits the budget), so the KLD is exact
        r = perplexity(path, text=text, ctx=64, chunks=4, device="cpu", baseline=master, kld_mode="stored",
                       kld_top_k=manifest["parameters"]["kld_top_k"])
        assert r.kld is not None
        assert (row["ppl"], row["ppl_error"]) == (r.ppl, r.ppl_error)
        assert row["kld_exact"] and row["mean_kld"] == r.kld["mean_kld"]
        assert r.kld["mean_kld_upper"] == pytest.approx(r.kld["mean_kld"], rel=1e-12)
        assert row["p99_kld"] == r.kld["kld_percentiles"]["99.0"]
        assert row["same_top_p"] == r.kld["same_top_p"] and row["delta_ppl"] == r.kld["ppl_ratio"] - 1
        assert manifest["steps"][f"eval-{row['type']}"]["results"]["kld"]["mean_kld"] == r.kld["mean_kld"]
        line = next(ln for ln in card.splitlines() if ln.startswith(f"| `{row['file']}`"))
        assert f"{r.ppl:.4f} ± {r.ppl_error:.4f}" in line and f"{r.kld['mean_kld']:.5f}" in line
        assert percent(r.kld["ppl_ratio"] - 1) in line
    # Fewer bits, more divergence.
    kld = {r["type"]: r["mean_kld"] for r in report["rows"]}
    assert kld["Q8_0"] < kld["Q4_K_M"] < kld["IQ2_M"]
    # Every GGUF loads in llama.cpp and scores the same text to nearly the same perplexity. llama.cpp's
    # quantized matmuls round the activations to 8 bits, so quantized files differ by a few percent on this
    # random model; the F16 master agrees closely. --no-repack: on this machine ggml's AMX weight repacking
    # dies with SIGILL (the AMX tile state is not granted inside the VM); the plain CPU path is the oracle.
    eval_file = out.parent / "eval.txt"
    eval_file.write_text(text, encoding="utf-8")
    theirs = {name: _llama_perplexity(out / name, eval_file) for name in report["files"]
              if name.endswith(".gguf") and "imatrix" not in name}
    assert abs(theirs[master.name] / alone.ppl - 1) < 1e-3, (theirs, alone.ppl)
    for row in report["rows"]:
        assert abs(theirs[row["file"]] / row["ppl"] - 1) < 5e-2, (row["type"], theirs, row["ppl"])
    # Manifest hashes match the files.
    for name, h in manifest["files"].items():
        data = (out / name).read_bytes()
        assert h == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    assert set(manifest["files"]) | {"manifest.json"} == set(report["files"])
    # Front matter and plot.
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["base_model_relation"] == "quantized" and meta["license"] == "apache-2.0"
    assert meta["language"] == ["en"] and "gguf" in meta["tags"] and meta["pipeline_tag"] == "text-generation"
    assert {"base_model", "quantized_by"} <= set(meta)
    import matplotlib.image

    img = matplotlib.image.imread(out / "quality.png")
    assert img.shape[0] > 100 and img.shape[1] > 100
    assert "Software" not in (out / "quality.png").read_bytes().decode("latin-1")


def test_rerun_skips_every_step_and_changes_nothing(released: tuple[Path, dict], checkpoint: Path) -> None:
    out, _ = released
    before = _artifacts(out)
    result = invoke("release", str(checkpoint), "-o", str(out), *ARGS, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ran"] == [] and len(report["skipped"]) == 9
    assert _artifacts(out) == before


def test_only_on_two_machines_then_card_only_equals_single_run(released: tuple[Path, dict], checkpoint: Path,
                                                                tmp_path: Path) -> None:
    single, _ = released
    a, b = tmp_path / "a", tmp_path / "b"
    assert invoke("release", str(checkpoint), "-o", str(a), *ARGS, "--only", "q8_0").exit_code == 0
    shutil.copytree(a, b)
    for t in ("q4_k_m", "iq2_m"):
        assert invoke("release", str(checkpoint), "-o", str(b), *ARGS, "--only", t).exit_code == 0
    assert not (a / "README.md").exists()
    for p in b.rglob("*"):  # gather machine b's results into a
        if p.is_file() and not (a / p.relative_to(b)).exists():
            shutil.copy2(p, a / p.relative_to(b))
    result = invoke("release", str(checkpoint), "-o", str(a), *ARGS, "--card-only")
    assert result.exit_code == 0, result.stderr
    assert _artifacts(a) == _artifacts(single)


def _run_and_kill(checkpoint: Path, out: Path, when: str) -> int:
    cmd = [sys.executable, "-m", "ggufkit", "release", str(checkpoint), "-o", str(out), *ARGS, "--quiet"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = out / ".ggufkit-release"
    while proc.poll() is None:
        if (when in ("master", "quantize-IQ2_M") and (state / f"{when}.json").exists()) or \
                (when == "quantize" and any(p.name.endswith(".ggufkit-part") and "Q4_K_M" in p.name
                                            for p in out.glob(".*"))):
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    return proc.wait()


@pytest.mark.parametrize("when", ["master", "quantize", "quantize-IQ2_M"])
def test_sigkill_then_rerun_gives_the_bytes_of_an_uninterrupted_run(released: tuple[Path, dict], checkpoint: Path,
                                                                    tmp_path: Path, when: str) -> None:
    single, _ = released
    out = tmp_path / "killed"
    # killed after the master's record, while Q4_K_M's temporary file is being written, or after the last
    # quantization (during the evaluation)
    assert _run_and_kill(checkpoint, out, when) == -signal.SIGKILL
    assert not (out / "manifest.json").exists()
    result = invoke("release", str(checkpoint), "-o", str(out), *ARGS)
    assert result.exit_code == 0, result.stderr
    assert _artifacts(out) == _artifacts(single)
    assert not [p for p in out.glob(".*") if p.name.endswith(".ggufkit-part")]


def test_bad_input_exits_2_in_one_line_and_writes_nothing(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    short = tmp_path / "short.txt"
    short.write_text("too short")
    env = {"HF_TOKEN": "", "HF_HOME": str(tmp_path / "hf")}
    cases = [(["--types", "q4_k_m,q9_9"], "q9_9"),
             (["--types", "iq2_m", "--no-imatrix"], "IQ2_M need an importance matrix"),
             (["--types", "q8_0", "--eval-text", str(short)], "--eval-text short.txt"),
             (["--types", "q8_0", "--push", "me/x"], "token")]
    for extra, needle in cases:
        result = invoke("release", str(checkpoint), "-o", str(out), "--ctx", "64", *extra, env=env)
        assert result.exit_code == 2, (extra, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (extra, lines)
        assert not out.exists()
    # An OUTDIR holding another model's release.
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    (other / "README.md").write_text("another model")
    (out / ".ggufkit-release").mkdir(parents=True)
    (out / ".ggufkit-release" / "master.json").write_text(json.dumps({"inputs": {"source": {"x": 1}}}))
    result = invoke("release", str(other), "-o", str(out), "--ctx", "64", "--types", "q8_0")
    assert result.exit_code == 2 and "another model" in result.stderr
    assert sorted(p.name for p in out.rglob("*")) == [".ggufkit-release", "master.json"]


def test_dry_run_lists_files_and_the_upload_and_writes_nothing(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = invoke("release", str(checkpoint), "-o", str(out), *ARGS, "--dry-run", "--push", "me/tiny-GGUF",
                    "--json", env={"HF_TOKEN": "hf_dummy_not_used"})
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert not out.exists()
    names = report["files"]
    assert any(n.endswith("-F16.gguf") for n in names) and any(n.endswith("-IQ2_M.gguf") for n in names)
    assert {"README.md", "manifest.json", "quality.png"} <= set(names)
    assert report["push"]["files"] == sorted(names) and report["push"]["repo_id"] == "me/tiny-GGUF"
    assert [s["action"] for s in report["steps"]] == ["run"] * len(report["steps"])


def test_a_failed_gate_exits_1_naming_the_types_and_pushes_nothing(released: tuple[Path, dict], checkpoint: Path,
                                                                    tmp_path: Path) -> None:
    out = tmp_path / "gated"
    shutil.copytree(released[0], out)
    result = invoke("release", str(checkpoint), "-o", str(out), *ARGS, "--max-kld", "q4_k_m=1e-6",
                    "--max-kld", "all=1e6", "--push", "me/tiny-GGUF", "--json",
                    env={"HF_TOKEN": "hf_dummy_not_used", "HF_HUB_OFFLINE": "1"})
    assert result.exit_code == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["ran"] == [] and report["push"] is None
    assert [f.split(":")[0] for f in report["failures"]] == ["Q4_K_M"]
    assert "Q4_K_M: mean KLD" in result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["parameters"]["max_kld"] == {"*": 1e6, "Q4_K_M": 1e-6}


class _HubStandIn:
    """A local stand-in of the four Hub endpoints huggingface_hub's ``create_repo`` and ``upload_folder``
    call (repos/create, validate-yaml, preupload, commit), answering "regular" upload mode so that file contents arrive
    base64-encoded inside the commit. It is not the Hub: LFS/Xet transfers are not exercised."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.created: list[dict] = []
        self.validated: list[dict] = []
        self.commits: list[dict] = []
        self.unknown: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _reply(self, data: object, status: int = 200) -> None:
                body = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                path = self.path.split("?")[0]
                if path == "/api/validate-yaml":  # the Hub checks the card's front matter before the commit
                    content = json.loads(body)["content"]
                    hub.validated.append(yaml.safe_load(content.split("---\n")[1]))
                    self._reply({})
                elif path == "/api/repos/create":
                    req = json.loads(body)
                    hub.created.append(req)
                    self._reply({"url": f"{hub.endpoint}/{req['organization']}/{req['name']}"})
                elif "/preupload/" in path:
                    files = json.loads(body)["files"]
                    self._reply({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                           for f in files]})
                elif "/commit/" in path:
                    items = [json.loads(line) for line in body.splitlines() if line.strip()]
                    hub.commits.append({"path": path, "items": items})
                    repo = path.removeprefix("/api/models/").split("/commit/")[0]
                    self._reply({"commitUrl": f"{hub.endpoint}/{repo}/commit/{'0' * 40}", "commitOid": "0" * 40})
                else:
                    hub.unknown.append(f"POST {path}")
                    self._reply({"error": "not in the stand-in"}, 404)

            def do_GET(self) -> None:
                hub.unknown.append(f"GET {self.path}")
                self._reply({"error": "not in the stand-in"}, 404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def test_push_uploads_exactly_the_release_files_to_a_local_hub_stand_in(released: tuple[Path, dict],
                                                                         checkpoint: Path, tmp_path: Path) -> None:
    import base64

    out = tmp_path / "pushed"
    shutil.copytree(released[0], out)
    hub = _HubStandIn()
    try:
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": "hf_local_stand_in", "HF_HUB_DISABLE_XET": "1",
               "HF_HOME": str(tmp_path / "hf")}
        proc = subprocess.run([sys.executable, "-m", "ggufkit", "release", str(checkpoint), "-o", str(out), *ARGS,
                               "--card-only", "--push", "me/tiny-GGUF", "--private", "--json"], cwd=ROOT, env=env,
                              capture_output=True, text=True, check=False)
    finally:
        hub.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    # huggingface_hub's own background look-up of known agent tools (answered 404 here) is the only other call
    assert [u for u in hub.unknown if u != "GET /api/agent-harnesses"] == []
    assert hub.validated and all(v["base_model_relation"] == "quantized" for v in hub.validated)
    assert hub.created == [{"name": "tiny-GGUF", "organization": "me", "visibility": "private", "type": "model"}]
    assert len(hub.commits) == 1 and hub.commits[0]["path"] == "/api/models/me/tiny-GGUF/commit/main"
    sent = {i["value"]["path"]: base64.b64decode(i["value"]["content"]) for i in hub.commits[0]["items"]
            if i["key"] == "file"}
    assert sorted(sent) == report["files"] == report["push"]["files"]
    assert all(sent[name] == (out / name).read_bytes() for name in sent)  # the state directory stays home
    assert "ollama run hf.co/me/tiny-GGUF:Q4_K_M" in sent["README.md"].decode()
