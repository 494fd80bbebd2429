"""`ggufkit release` as a new publisher types it in the first hour (issue 35, the release items).

A tiny real-tokenizer LLaMA (320 tokens) released once with an importance matrix; every other case reruns
that release (every step skipped) or is refused before any work. Checked: a release never writes into or
over its source, nor over a file it did not make; one KLD per file (exact by default here, equal to the
side-by-side figure) in the gate, table, card, --json and manifest, and an upper bound labelled as such with
a small --kld-top-k; a file that fails its gate is never recommended and the card says so; the dry run's sizes
are the files' sizes; MiB everywhere and no -0.00%; the release's own files and GGUFs are never source files;
the card's "how to run" runs the recommended file; --base-model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_helpers import invoke

TYPES = "q8_0,q4_k_m,q2_k"
ARGS = ["--types", TYPES, "--ctx", "64", "--chunks", "4", "--imatrix-chunks", "2", "--device", "cpu"]
USER_CARD = "---\nlicense: apache-2.0\nlanguage:\n- en\n---\n# tiny: the user's own card\n"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import fixtures_models as fm

    d = tmp_path_factory.mktemp("ck") / "tiny-llama"
    fm.make_checkpoint(d, "LlamaForCausalLM", hidden_size=256, intermediate_size=512, max_position_embeddings=256)
    (d / "README.md").write_text(USER_CARD)
    return d


@pytest.fixture(scope="module")
def released(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    """(outdir, the dry run's report made before it, the release's report)."""
    out = tmp_path_factory.mktemp("rel") / "out"
    dry = invoke("release", str(checkpoint), "-o", str(out), *ARGS, "--dry-run", "--json")
    assert dry.exit_code == 0, dry.stderr
    assert not out.exists()
    result = invoke("release", str(checkpoint), "-o", str(out), *ARGS, "--json")
    assert result.exit_code == 0, result.stderr
    return out, json.loads(dry.stdout), json.loads(result.stdout)


def _listing(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _one_line_refusal(result: Any, *needles: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.stdout[-2000:], result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _card_line(card: str, file: str) -> str:
    return next(ln for ln in card.splitlines() if ln.startswith(f"| `{file}`"))


# 1. never into or over the source, never over a file the release did not make


def test_outdir_that_is_or_is_inside_the_source_is_refused(checkpoint: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    before = _listing(checkpoint)
    link = tmp_path / "link-to-ck"
    link.symlink_to(checkpoint, target_is_directory=True)
    monkeypatch.chdir(checkpoint.parent)
    name = checkpoint.name
    for outdir in (str(checkpoint), f"{checkpoint}/", name, f"./{name}/", f"./{name}/../{name}", f"{name}/GGUF",
                   f"./{name}/sub/dir/", str(link), f"{link}/", f"{link}/out"):
        result = invoke("release", str(checkpoint), "-o", outdir, *ARGS)
        _one_line_refusal(result, "source")
        assert _listing(checkpoint) == before, outdir  # README.md untouched, nothing written
    # the model given by a relative path, the OUTDIR by an absolute one
    _one_line_refusal(invoke("release", f"./{name}", "-o", str(checkpoint), *ARGS), "source")
    assert _listing(checkpoint) == before


def test_outdir_holding_a_file_the_release_did_not_make_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("my notes")
    _one_line_refusal(invoke("release", str(checkpoint), "-o", str(out), *ARGS), "README.md", "overwrite")
    assert _listing(out) == {"README.md": b"my notes"}
    from ggufkit.release.plan import source_file_hashes

    # an earlier release's manifest says which files are its own: README.md is not among them here
    manifest = {"format": "ggufkit-release/1", "source": {"files": source_file_hashes(checkpoint)},
                "files": {"tiny-llama-F16.gguf": {"sha256": "0" * 64, "size": 1}}}
    (out / "manifest.json").write_text(json.dumps(manifest))
    _one_line_refusal(invoke("release", str(checkpoint), "-o", f"{out}/", *ARGS), "README.md")
    assert (out / "README.md").read_text() == "my notes"
    # when the manifest lists README.md as the release's own card, the rule that no output is an input
    # still refuses it as the evaluation text
    manifest["files"]["README.md"] = {"sha256": "0" * 64, "size": 8}
    (out / "manifest.json").write_text(json.dumps(manifest))
    line = _one_line_refusal(invoke("release", str(checkpoint), "-o", str(out), *ARGS, "--eval-text",
                                    str(out / "README.md")), "would overwrite the input")
    assert "README.md" in line
    assert (out / "README.md").read_text() == "my notes"


# 2. one KLD per file


def test_one_kld_per_file_exact_by_default_in_gate_table_card_json_and_manifest(
        released: tuple[Path, dict, dict], checkpoint: Path, tmp_path: Path) -> None:
    from ggufkit.eval.perplexity import perplexity
    from ggufkit.release.plan import TextInput

    out, _, report = released
    manifest = json.loads((out / "manifest.json").read_text())
    card = (out / "README.md").read_text()
    master = out / next(f for f in report["files"] if f.endswith("-F16.gguf"))
    text = TextInput.bundled("evaluation").text
    # the whole 320-token vocabulary fits the budget: K covers it
    assert manifest["parameters"]["kld_top_k"] == 320
    for row in report["rows"]:
        t = row["type"]
        side = perplexity(out / row["file"], text=text, ctx=64, chunks=4, device="cpu", baseline=master,
                          kld_mode="side-by-side")
        assert side.kld is not None
        assert row["kld_exact"] is True
        assert row["mean_kld"] == pytest.approx(side.kld["mean_kld"], rel=1e-9, abs=1e-12)
        assert manifest["quality"][t]["mean_kld"] == row["mean_kld"] and manifest["quality"][t]["kld_exact"]
        assert manifest["steps"][f"eval-{t}"]["results"]["kld"]["mean_kld"] == row["mean_kld"]
        assert f"| {row['mean_kld']:.5f} |" in _card_line(card, row["file"])
    assert "exact" in card.split("## How to run")[0]
    # the gate compares that very number
    row = max(report["rows"], key=lambda r: r["mean_kld"])
    gated = tmp_path / "gated"
    shutil.copytree(out, gated)
    above = invoke("release", str(checkpoint), "-o", str(gated), *ARGS, "--max-kld",
                   f"{row['type']}={row['mean_kld'] * 1.001}", "--json")
    assert above.exit_code == 0, above.stderr
    below = invoke("release", str(checkpoint), "-o", str(gated), *ARGS, "--max-kld",
                   f"{row['type']}={row['mean_kld'] * 0.999}", "--json")
    assert below.exit_code == 1, below.stderr
    assert f"{row['type']}: mean KLD {row['mean_kld']:.6f} > --max-kld" in below.stderr
    assert json.loads(below.stdout)["ran"] == []


def test_a_kld_that_is_not_exact_is_the_upper_bound_labelled_as_such(released: tuple[Path, dict, dict],
                                                                     checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "bound"
    shutil.copytree(released[0], out)
    result = invoke("release", str(checkpoint), "-o", str(out), *ARGS, "--kld-top-k", "8", "--max-kld",
                    "all=1e-9", "--json")
    assert result.exit_code == 1, result.stderr
    report = json.loads(result.stdout)
    manifest = json.loads((out / "manifest.json").read_text())
    card = (out / "README.md").read_text()
    assert manifest["parameters"]["kld_top_k"] == 8
    for row in report["rows"]:
        t = row["type"]
        kld = manifest["steps"][f"eval-{t}"]["results"]["kld"]
        assert row["kld_exact"] is False and "mean_kld" not in kld
        assert row["mean_kld"] == kld["mean_kld_upper"] > kld["mean_kld_lower"]
        assert manifest["quality"][t]["mean_kld"] == row["mean_kld"]
        assert f"≤ {row['mean_kld']:.5f}" in _card_line(card, row["file"])
        assert f"{t}: mean KLD upper bound {row['mean_kld']:.6f} > --max-kld" in result.stderr
    assert "upper bound" in card


# 3. a file that fails its gate is never recommended; 7. "how to run" runs the recommended file


def _run_file(card: str) -> str:
    return re.search(r"^llama-cli -m (\S+) ", card, re.M).group(1)  # type: ignore[union-attr]


def test_a_failed_file_is_never_recommended_and_how_to_run_uses_the_recommended_file(
        released: tuple[Path, dict, dict], checkpoint: Path, tmp_path: Path) -> None:
    out, _, report = released
    card = (out / "README.md").read_text()
    rec = [r for r in report["rows"] if "**recommended**" in _card_line(card, r["file"])]
    assert len(rec) == 1, card
    assert _run_file(card) == rec[0]["file"]
    assert f"-hf <user>/<repo>:{rec[0]['type']} " in card
    gated = tmp_path / "gated"
    shutil.copytree(out, gated)
    result = invoke("release", str(checkpoint), "-o", str(gated), *ARGS, "--max-kld",
                    f"{rec[0]['type']}=1e-12", "--json")
    assert result.exit_code == 1
    card = (gated / "README.md").read_text()
    line = _card_line(card, rec[0]["file"])
    assert "**recommended**" not in line and "failed the quality gate" in line and "1e-12" in line
    assert _run_file(card) != rec[0]["file"]
    others = [r for r in report["rows"] if "**recommended**" in _card_line(card, r["file"])]
    if others:
        assert _run_file(card) == others[0]["file"]
    assert [r["gate"] for r in json.loads(result.stdout)["rows"] if r["type"] == rec[0]["type"]] == ["failed"]


# 4. the dry run's sizes are the files' sizes


def test_dry_run_sizes_are_the_real_file_sizes(released: tuple[Path, dict, dict], checkpoint: Path) -> None:
    out, dry, _ = released
    sized = {s["files"][0]: s["estimated_bytes"] for s in dry["steps"] if s["estimated_bytes"]}
    assert len(sized) == 4  # the master and three types, planned before the master existed
    for name, size in sized.items():
        assert size == (out / name).stat().st_size, name
    # planned again on the release's own master and imatrix: every step skipped, the same sizes
    again = invoke("release", str(checkpoint), "-o", str(out), *ARGS, "--dry-run", "--json")
    assert again.exit_code == 0, again.stderr
    steps = json.loads(again.stdout)["steps"]
    assert all(s["action"] == "skip" for s in steps if s["step"] != "card")
    assert {s["files"][0]: s["estimated_bytes"] for s in steps if s["estimated_bytes"]} == sized


# 5. MiB everywhere, no -0.00%


def test_card_and_table_use_mib_and_never_print_minus_zero(released: tuple[Path, dict, dict], checkpoint: Path
                                                           ) -> None:
    from ggufkit.cli.release import _render
    from ggufkit.release.card import render_card
    from ggufkit.release.plan import ReleaseOptions, build_plan

    out, _, report = released
    card = (out / "README.md").read_text()
    table = card.split("## Files")[1].split("PPL: perplexity")[0]
    assert "MiB" in table and not re.search(r"\d (MB|kB|GB)\b", table)
    rows = [dict(r, delta_ppl=-1e-7 if i == 0 else r["delta_ppl"]) for i, r in enumerate(report["rows"])]
    d = dict(report, rows=rows)
    text = _render(d)
    assert "-0.00%" not in text and " 0.00%" in text and "MiB" in text
    plan = build_plan(ReleaseOptions(model=str(checkpoint), outdir=out, types=tuple(TYPES.split(",")), ctx=64,
                                     chunks=4, imatrix_chunks=2, device="cpu"))
    files = {r["type"]: [r["file"]] for r in rows}
    files["master"] = [next(f for f in report["files"] if f.endswith("-F16.gguf"))]
    rendered = render_card(plan, report["master"], rows, files, None, "0")
    assert "-0.00%" not in rendered and "| 0.00% |" in rendered


# 6. the release's own files and GGUFs are never source files


def test_release_outputs_and_ggufs_in_the_checkpoint_are_not_source_files(checkpoint: Path, tmp_path: Path
                                                                          ) -> None:
    from ggufkit.release.plan import ReleaseOptions, build_plan

    ck = tmp_path / "tiny-llama"
    shutil.copytree(checkpoint, ck)
    assert invoke("convert", str(ck), "--outtype", "q8_0").exit_code == 0  # leaves its GGUF in the folder
    # what `release ck -o ck` left there before it was refused
    (ck / ".ggufkit-release").mkdir(exist_ok=True)
    (ck / ".ggufkit-release" / "master.json").write_text(json.dumps({"outputs": {"tiny-llama-F16.gguf": {}}}))
    (ck / "quality.png").write_bytes(b"png")
    (ck / "tiny-llama.imatrix.dat").write_bytes(b"dat")
    (ck / "manifest.json").write_text(json.dumps({"format": "ggufkit-release/1", "files": {
        "quality.png": {}, "tiny-llama.imatrix.dat": {}}}))
    plan = build_plan(ReleaseOptions(model=str(ck), outdir=tmp_path / "out", types=("Q8_0",), ctx=64, chunks=4,
                                     no_imatrix=True, device="cpu"))
    assert sorted(plan.source_files) == sorted(p.name for p in checkpoint.iterdir() if p.is_file())
    assert "README.md" in plan.source_files and not any(n.endswith(".gguf") for n in plan.source_files)


# 8. --base-model


def test_base_model_names_the_card_base_model(released: tuple[Path, dict, dict], checkpoint: Path,
                                              tmp_path: Path) -> None:
    out = tmp_path / "based"
    shutil.copytree(released[0], out)
    result = invoke("release", str(checkpoint), "-o", str(out), *ARGS, "--base-model", "someone/Tiny-Llama-1B",
                    "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["ran"] == []
    card = (out / "README.md").read_text()
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["base_model"] == "someone/Tiny-Llama-1B"
    assert "[someone/Tiny-Llama-1B](https://huggingface.co/someone/Tiny-Llama-1B)" in card
    assert json.loads((out / "manifest.json").read_text())["source"]["base_model"] == "someone/Tiny-Llama-1B"
    _one_line_refusal(invoke("release", str(checkpoint), "-o", str(tmp_path / "x"), *ARGS, "--base-model",
                             "not an id"), "--base-model")
    assert not (tmp_path / "x").exists()
    assert os.listdir(tmp_path) == ["based"]
