"""``MIX@`` entries on a gpt-oss master that keeps the checkpoint's MXFP4 experts (issue #32).

The size-budget search copies the tensors the master already holds quantized (the MXFP4 experts, one
``^name$=mxfp4`` rule each, which llama-quantize copies as they are), counts their real bytes in the budget and
searches only the float tensors. Checked on the tiny gpt-oss of test_family_gpt_oss.py released as MXFP4: the
release's mix (with its importance matrix) is within its budget (the Q4_K_M file beside it), its experts are the master's bytes, the card's
llama-quantize command writes the same file and llama.cpp runs it; the budget is exact (the least reachable
size fits to the byte, one byte less is refused naming the MXFP4 bytes); a budget below the copied bytes is one
line, exit 2, nothing written; a final check that prefers a preset keeps the experts too.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_helpers import invoke
from fixtures_quantize import assert_same_quantized
from gguf import GGMLQuantizationType
from llama_cpp_sources import tool_path

from ggufkit.errors import UsageError
from ggufkit.format import open_gguf
from ggufkit.quant.target.search import quantize_to_target

MXFP4 = GGMLQuantizationType.MXFP4
RUN = ["--ctx", "32", "--chunks", "1", "--device", "cpu", "--quiet"]
ARGS = ["--no-imatrix", *RUN]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import fixtures_models as fm
    import test_family_gpt_oss as gpt_oss

    d = tmp_path_factory.mktemp("gpt_oss_mix")
    tf5 = fm.make_checkpoint(d / "tf5", gpt_oss.HF_CLASS)
    shutil.copytree(tf5, d / "release")
    gpt_oss.to_release_config(d / "release" / "config.json")
    return gpt_oss.to_mxfp4(d / "release", d / "gpt-oss-mxfp4")


@pytest.fixture(scope="module")
def master(checkpoint: Path) -> Path:
    """The master a release converts (BF16 with the MXFP4 experts kept)."""
    from ggufkit.converters import convert

    return Path(convert(checkpoint, checkpoint.parent / "master.gguf", outtype="bf16").outputs[0])


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One measurement cache for the searches on ``master``: measured once."""
    return tmp_path_factory.mktemp("cache")


def _mxfp4_tensors(path: Path) -> dict[str, bytes]:
    with open_gguf(path) as m:
        return {t.name: bytes(m.raw(t)) for t in m.tensors if t.ggml_type == MXFP4}


def test_a_release_mix_keeps_the_mxfp4_experts_within_its_budget(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # with the release's importance matrix (the IQ2/IQ3 candidates count; the experts have no use for it)
    r = invoke("release", str(checkpoint), "-o", str(out), "--types", "q4_k_m,MIX@Q4_K_M", "--imatrix-chunks", "2",
               *RUN)
    assert r.exit_code == 0, r.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    mix = manifest["mixes"]["MIX@Q4_K_M"]
    master = next(out.glob("*-BF16.gguf"))
    preset = next(out.glob("*-Q4_K_M.gguf"))
    ours = out / mix["file"]
    # within the budget, the size of the release's own Q4_K_M file (its experts requantized), predicted exactly
    assert mix["budget"] == preset.stat().st_size and ours.stat().st_size == mix["predicted_size"] <= mix["budget"]
    # the experts are the master's MXFP4 bytes; the search chose the other tensors
    kept = _mxfp4_tensors(master)
    assert len(kept) == 12 and _mxfp4_tensors(ours) == kept
    assert mix["types"]["MXFP4"] == 12 and len(mix["types"]) > 2
    # the card's llama-quantize command, run in the release directory, writes the same file
    card = (out / "README.md").read_text()
    assert "The master's MXFP4 tensors are copied as they are" in card
    cmd = next(line for line in card.splitlines() if line.startswith("llama-quantize") and mix["recipe"] in line)
    args = shlex.split(cmd)
    args[-2] = str(tmp_path / "theirs.gguf")
    proc = subprocess.run([str(tool_path("llama-quantize")), *args[1:]], cwd=out, capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_same_quantized(tmp_path / "theirs.gguf", ours)
    # llama.cpp loads and runs it
    from fixtures_models import llama_cpp_logits

    logits = llama_cpp_logits(ours)
    assert logits.shape[1] == 50257 and np.isfinite(logits).all()


def test_the_budget_counts_the_mxfp4_bytes_exactly(master: Path, cache: Path, tmp_path: Path) -> None:
    kept = _mxfp4_tensors(master)
    kept_bytes = sum(len(b) for b in kept.values())
    lo, hi = quantize_to_target(master, None, target_like="q4_k_m", dry_run=True, cache_dir=cache).feasible
    # the least reachable size fits to the byte: every searched tensor at its cheapest, the experts as they are
    out = tmp_path / "lo.gguf"
    report = quantize_to_target(master, out, target_size=lo, cache_dir=cache)
    assert report.budget == report.predicted_size == out.stat().st_size == lo
    assert _mxfp4_tensors(out) == kept
    # one byte less is refused in one line, naming the bytes kept as they are
    with pytest.raises(UsageError, match=rf"outside the reachable range {lo}\.\.{hi} .*12 MXFP4 tensors of the "
                       rf"input are kept as they are \({kept_bytes} bytes\)$"):
        quantize_to_target(master, tmp_path / "no.gguf", target_size=lo - 1, cache_dir=cache)
    assert not (tmp_path / "no.gguf").exists()
    # a bits-per-weight target counts the same bytes (tensor data)
    bpw = quantize_to_target(master, None, target_bpw=5.5, dry_run=True, cache_dir=cache)
    assert bpw.plan.nbytes <= bpw.budget
    assert sum(e.nbytes for e in bpw.plan.entries if e.dst_type == MXFP4) == kept_bytes


def test_a_budget_below_the_kept_mxfp4_bytes_is_one_line_exit_2(checkpoint: Path, master: Path, cache: Path,
                                                                 tmp_path: Path) -> None:
    kept_bytes = sum(len(b) for b in _mxfp4_tensors(master).values())
    out = tmp_path / "out"
    for entry in (f"MIX@{kept_bytes - 1}B", "MIX@0.5bpw"):
        r = invoke("release", str(checkpoint), "-o", str(out), "--types", f"q4_k_m,{entry}", *ARGS)
        assert r.exit_code == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
        assert f"{kept_bytes} bytes of MXFP4 tensors kept as they are" in r.stderr, r.stderr
        assert not out.exists()
    # the command line's search says the same
    r = invoke("quantize", str(master), str(tmp_path / "q.gguf"), "--target-size", f"{kept_bytes - 1}",
               "--sensitivity", "off", "--cache-dir", str(cache))
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"MXFP4 tensors of the input are kept as they are ({kept_bytes} bytes)" in r.stderr
    assert not (tmp_path / "q.gguf").exists()


def test_a_final_check_that_prefers_a_preset_keeps_the_experts(master: Path, cache: Path, tmp_path: Path) -> None:
    """The final check measures the presets that fit with the experts kept (their own rules only): when it
    prefers one, the file written is that preset's, experts copied."""
    seen: dict[str, Mapping[str, GGMLQuantizationType]] = {}

    def prefer_a_preset(cands: Mapping[str, Mapping[str, GGMLQuantizationType]]) -> tuple[dict[str, float], int, int]:
        seen.update(cands)
        return {n: 1.0 if n == "mix" else 0.5 for n in cands}, len(cands), 0

    out = tmp_path / "checked.gguf"
    report: Any = quantize_to_target(master, out, target_like="q4_k_m", cache_dir=cache, final_check=prefer_a_preset)
    assert report.final_check is not None and report.final_check.chosen != "mix"
    assert report.final_check.chosen in seen and report.plan.target == report.final_check.chosen
    assert all(MXFP4 not in changed.values() for changed in seen.values())  # the experts never change
    assert _mxfp4_tensors(out) == _mxfp4_tensors(master) and out.stat().st_size <= report.budget
