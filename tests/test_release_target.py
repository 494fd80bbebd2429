"""``ggufkit release --types ... MIX@TARGET``: size-budget mixes beside the presets in one release (issue 16).

A tiny real-tokenizer LLaMA released with the preset Q4_K_M, the best mix at Q4_K_M's size and a mix at 3.5
bits per weight: the mix is not larger than the preset's file (the budget is that file's size), the second mix
measures nothing (the release's cache), the card's llama-quantize command run in the release directory writes
the mix's file (tensors and metadata the same), the card and manifest say how each mix was chosen, a rerun runs
nothing, a changed entry reruns only its own steps, and bad entries are one line, exit 2, nothing written.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from cli_helpers import invoke
from fixtures_quantize import assert_same_quantized

from ggufkit.errors import UsageError
from ggufkit.format import open_gguf
from ggufkit.release.mix import parse_mix
from ggufkit.release.plan import parse_max_kld

TYPES = "Q4_K_M,mix@q4_k,MIX@3.5BPW"
ARGS = ["--ctx", "64", "--chunks", "4", "--imatrix-chunks", "4", "--device", "cpu"]


def _artifacts(outdir: Path) -> dict[str, str]:
    return {p.relative_to(outdir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(outdir.rglob("*")) if p.is_file() and p.name != "hashes.json"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import fixtures_models as fm

    d = tmp_path_factory.mktemp("ck") / "tiny-llama"
    fm.make_checkpoint(d, "LlamaForCausalLM", hidden_size=256, intermediate_size=512, max_position_embeddings=256)
    return d


@pytest.fixture(scope="module")
def released(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("rel") / "out"
    result = invoke("release", str(checkpoint), "-o", str(out), "--types", TYPES, *ARGS, "--json")
    assert result.exit_code == 0, result.stderr
    return out, json.loads(result.stdout)


def test_parse_mix_syntax() -> None:
    assert parse_mix("mix@q4_k").name == "MIX@Q4_K_M" and parse_mix("MIX@Q4_K_M").preset == "q4_k_m"
    assert (parse_mix("Mix@2.50g").name, parse_mix("mix@2.5G").size) == ("MIX@2.5G", 2_500_000_000)
    assert (parse_mix("mix@90mib").name, parse_mix("mix@90MiB").size) == ("MIX@90MiB", 90 * 2**20)
    assert (parse_mix("MIX@4.50BPW").name, parse_mix("mix@4.5bpw").bpw) == ("MIX@4.5bpw", 4.5)
    assert parse_mix("MIX@Q3_K_M").label == "MIX-Q3_K_M"
    assert parse_max_kld(["mix@q4_k=0.1", "Mix@2.5g=0.2"]) == {"MIX@Q4_K_M": 0.1, "MIX@2.5G": 0.2}
    for bad, needle in (("MIX@3", "give a unit"), ("MIX@q9_9", "q9_9"), ("MIX@3parsecs", "unknown unit"),
                        ("MIX@0bpw", "positive"), ("MIX@0G", "positive"), ("MIX@", "expected"),
                        ("MIX@f16", "not a quantized preset"), ("MIX@-1G", "neither")):
        with pytest.raises(UsageError, match=needle):
            parse_mix(bad)


def test_mixes_within_budget_reproducible_and_in_card_and_manifest(released: tuple[Path, dict]) -> None:
    from llama_cpp_sources import tool_path

    out, report = released
    rows = {r["type"]: r for r in report["rows"]}
    assert list(rows) == ["Q4_K_M", "MIX@Q4_K_M", "MIX@3.5bpw"]
    prefix = rows["Q4_K_M"]["file"].removesuffix("-Q4_K_M.gguf")
    mix_file, recipe = f"{prefix}-MIX-Q4_K_M.gguf", f"{prefix}-MIX-Q4_K_M.tensor-types.txt"
    assert rows["MIX@Q4_K_M"]["file"] == mix_file and rows["MIX@3.5bpw"]["file"] == f"{prefix}-MIX-3.5bpw.gguf"
    # the budget is the preset's file; the mix fits it and uses it
    preset_size = (out / rows["Q4_K_M"]["file"]).stat().st_size
    manifest = json.loads((out / "manifest.json").read_text())
    mix = manifest["mixes"]["MIX@Q4_K_M"]
    assert mix["budget"] == preset_size and mix["budget_kind"] == "file"
    assert (out / mix_file).stat().st_size == mix["predicted_size"] == rows["MIX@Q4_K_M"]["size"] <= preset_size
    assert mix["predicted_size"] > 0.97 * preset_size
    assert mix["target"]["kind"] == "like" and mix["target"]["preset"] == "Q4_K_M" and mix["recipe"] == recipe
    assert "IQ2_XXS" in mix["candidates"] and "Q4_K" in mix["candidates"]  # the release has an imatrix
    assert mix["reference"]["preset"] == "Q4_K_M" and mix["estimated_error"] < mix["reference"]["estimated_error"]
    with open_gguf(out / f"{prefix}-MIX-3.5bpw.gguf") as m:
        assert 8 * sum(t.nbytes for t in m.tensors) / sum(t.n_elements for t in m.tensors) <= 3.5
    # the second mix measured nothing: the release's cache (inside its state directory) had every measurement
    assert report["searches"]["MIX@Q4_K_M"]["measured"] > 0 and report["searches"]["MIX@Q4_K_M"]["cached"] == 0
    assert report["searches"]["MIX@3.5bpw"] == {"measured": 0,
                                                "cached": report["searches"]["MIX@Q4_K_M"]["measured"]}
    assert list((out / ".ggufkit-release" / "target-cache").glob("*.json"))
    # recipes are shipped: listed, hashed, one rule per chosen tensor
    for name in (mix_file, recipe):
        data = (out / name).read_bytes()
        assert manifest["files"][name] == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        assert name in report["files"]
    assert all(rule.startswith("^") and "=" in rule for rule in (out / recipe).read_text().split())
    # evaluated like the presets
    assert rows["MIX@Q4_K_M"]["mean_kld"] > 0 and "eval-MIX@Q4_K_M" in manifest["steps"]
    card = (out / "README.md").read_text()
    assert f"| `{mix_file}` | MIX@Q4_K_M |" in card
    assert "best mix at the size of Q4_K_M: per-tensor types chosen by measured error (imatrix-weighted" in card
    assert f"under a budget of {preset_size} bytes" in card and f"Recipe: `{recipe}`" in card
    assert "ollama run hf.co/<user>/<repo>:Q4_K_M" in card and ":MIX@" not in card
    # the card's llama-quantize command, run in the release directory, writes the mix's file
    cmd = next(line for line in card.splitlines() if line.startswith("llama-quantize") and recipe in line)
    args = shlex.split(cmd)
    assert args[-2] == mix_file
    args[-2] = "../reproduced.gguf"
    proc = subprocess.run([str(tool_path("llama-quantize")), *args[1:]], cwd=out, capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_same_quantized(out.parent / "reproduced.gguf", out / mix_file)


def test_rerun_runs_nothing_and_a_changed_entry_reruns_only_its_steps(released: tuple[Path, dict],
                                                                       checkpoint: Path, tmp_path: Path) -> None:
    out, _ = released
    before = _artifacts(out)
    result = invoke("release", str(checkpoint), "-o", str(out), "--types", TYPES, *ARGS, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ran"] == [] and report["searches"] == {} and _artifacts(out) == before
    changed = tmp_path / "changed"
    shutil.copytree(out, changed)
    result = invoke("release", str(checkpoint), "-o", str(changed), "--types", "Q4_K_M,MIX@Q4_K_M,MIX@3bpw",
                    *ARGS, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ran"] == ["quantize-MIX@3bpw", "eval-MIX@3bpw"]
    assert report["searches"]["MIX@3bpw"]["measured"] == 0
    manifest = json.loads((changed / "manifest.json").read_text())
    assert sorted(manifest["mixes"]) == ["MIX@3bpw", "MIX@Q4_K_M"]


def test_bad_mix_entries_exit_2_in_one_line_and_write_nothing(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cases = [("q4_k_m,MIX@q9_9", "q9_9"), ("MIX@3", "give a unit"), ("MIX@1G", "above the largest mix"),
             ("MIX@10K", "below the smallest mix"), ("MIX@1bpw", "outside what a mix"),
             ("MIX@20bpw", "outside what a mix"), ("MIX@Q4_K_M,mix@q4_k", "twice"),
             ("MIX@2.5M,MIX@2500K", "same budget"), ("MIX@copy", "not a quantized preset")]
    for types, needle in cases:
        result = invoke("release", str(checkpoint), "-o", str(out), "--ctx", "64", "--types", types)
        assert result.exit_code == 2, (types, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (types, lines)
        assert not out.exists()
    result = invoke("release", str(checkpoint), "-o", str(out), "--types", "MIX@IQ2_M", "--no-imatrix")
    assert result.exit_code == 2 and "MIX@IQ2_M need an importance matrix" in result.stderr
    assert not out.exists()


def test_dry_run_lists_the_mix_and_its_recipe(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = invoke("release", str(checkpoint), "-o", str(out), *ARGS, "--types", "q8_0,mix@700KiB", "--dry-run",
                    "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    step = next(s for s in report["steps"] if s["step"] == "quantize-MIX@700KiB")
    assert [f.split("-MIX-")[1] for f in step["files"]] == ["700KiB.gguf", "700KiB.tensor-types.txt"]
    assert step["estimated_bytes"] == 700 * 1024 and not out.exists()
