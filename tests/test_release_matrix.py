"""`ggufkit release` spread over a CI's jobs: `--matrix` (GitHub Actions strategy.matrix), `--shared-only`, one
`--only TYPE` job per type and `--card-only`, each a separate process in its own folder, exchanging the master,
the imatrix and the manifest parts through an `--exchange` folder copied between them as an artifact step does.
The type files and the card, plot and manifest are those of one plain `release`, byte for byte."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import invoke

TYPES = "q8_0,q4_k_m"
ARGS = ["--types", TYPES, "--ctx", "32", "--chunks", "2", "--imatrix-chunks", "2", "--device", "cpu"]
ROOT = Path(__file__).resolve().parents[1]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _job(checkpoint: Path, outdir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """One CI job: its own process, its own OUTDIR."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "ggufkit", "release", str(checkpoint), "-o", str(outdir), *ARGS,
                           "--quiet", *extra], cwd=ROOT, env=env, capture_output=True, text=True, check=False)


def _artifact(src: Path, dst: Path, names: list[str] | None = None) -> None:
    """An upload-artifact / download-artifact pair: the named files of ``src`` (default all) into ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.iterdir()):
        if p.is_file() and (names is None or p.name in names):
            shutil.copy(p, dst / p.name)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import fixtures_models as fm

    d = tmp_path_factory.mktemp("ck") / "tiny-llama"
    fm.make_checkpoint(d, "LlamaForCausalLM", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       max_position_embeddings=128)
    return d


@pytest.fixture(scope="module")
def single(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("single") / "out"
    result = invoke("release", str(checkpoint), "-o", str(out), *ARGS, "--quiet")
    assert result.exit_code == 0, result.stderr
    return out


def test_matrix_jobs_in_separate_processes_and_folders_equal_one_release(single: Path, checkpoint: Path,
                                                                        tmp_path: Path) -> None:
    result = invoke("release", str(checkpoint), "-o", str(tmp_path / "plan"), *ARGS, "--matrix")
    assert result.exit_code == 0, result.stderr
    matrix = json.loads(result.stdout)
    assert matrix == {"include": [{"type": "Q8_0"}, {"type": "Q4_K_M"}]}
    assert result.stdout.count("\n") == 1  # one line, for $GITHUB_OUTPUT
    assert not (tmp_path / "plan").exists()

    # the shared job: master + imatrix into its exchange folder
    shared = _job(checkpoint, tmp_path / "shared" / "out", "--shared-only", "--exchange", str(tmp_path / "shared/x"))
    assert shared.returncode == 0, shared.stderr
    manifest = json.loads((single / "manifest.json").read_text())
    shared_files = [*manifest["steps"]["master"]["outputs"], *manifest["steps"]["imatrix"]["outputs"]]
    assert sorted(p.name for p in (tmp_path / "shared/x").iterdir()) == sorted(["shared.json", *shared_files])
    for name in shared_files:
        assert _sha(tmp_path / "shared/x" / name) == _sha(single / name)
    assert not list((tmp_path / "shared/out").glob("*Q8_0*"))

    # one job per matrix entry, each on a fresh machine with the shared artifact downloaded
    parts = tmp_path / "card" / "x"
    for job in matrix["include"]:
        t = job["type"]
        xchg, out = tmp_path / t / "x", tmp_path / t / "out"
        _artifact(tmp_path / "shared/x", xchg)
        run = _job(checkpoint, out, "--only", t, "--exchange", str(xchg))
        assert run.returncode == 0, run.stderr
        (name,) = manifest["steps"][f"quantize-{t}"]["outputs"]
        assert _sha(out / name) == _sha(single / name)
        assert not (out / "README.md").exists()
        _artifact(xchg, parts, [f"part-{t}.json"])  # each job uploads its manifest part only

    # the card job: the parts and the shared job's small record, not the type files nor the master
    _artifact(tmp_path / "shared/x", parts, ["shared.json"])
    card = _job(checkpoint, tmp_path / "card" / "out", "--card-only", "--exchange", str(parts))
    assert card.returncode == 0, card.stderr
    for name in ("README.md", "manifest.json", "quality.png"):
        assert _sha(tmp_path / "card/out" / name) == _sha(single / name), name

    # a part made with other options is refused in one line (exit 2), naming the file
    bad = json.loads((parts / "part-Q8_0.json").read_text())
    bad["records"]["quantize-Q8_0"]["params"]["type"] = "Q6_K"
    (parts / "part-Q8_0.json").write_text(json.dumps(bad))
    again = invoke("release", str(checkpoint), "-o", str(tmp_path / "card2"), *ARGS, "--card-only",
                   "--exchange", str(parts))
    assert again.exit_code == 2 and "part-Q8_0.json" in again.stderr and len(again.stderr.strip().splitlines()) == 1


def test_fan_out_flags_are_checked_before_any_work(checkpoint: Path, tmp_path: Path) -> None:
    out, xchg = tmp_path / "out", tmp_path / "x"
    for args, words in ([["--exchange", str(xchg)], "--exchange goes with"],
                        [["--shared-only", "--only", "q8_0"], "--shared-only"],
                        [["--matrix", "--only", "q8_0"], "--matrix"],
                        [["--only", "q8_0", "--exchange", str(xchg)], "shared.json"]):
        r = invoke("release", str(checkpoint), "-o", str(out), *ARGS, *args)
        assert r.exit_code == 2 and words in r.stderr, (args, r.stderr)
    assert not xchg.exists() and not list(out.glob("*.gguf"))
