"""``quantize --target-size/--target-bpw/--target-like``: the best mix under a size budget (issue #16).

Checked: the file is never larger than the budget and its size, header included, is predicted exactly; the
``--mix-out`` rules given to the built ``llama-quantize`` (``--tensor-type-file``, same imatrix) reproduce
ggufkit's file byte for byte; bad input is one line, exit 2, nothing written, input untouched; a second
target on the same inputs measures nothing again; the file loads and runs in llama-cpp-python.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import invoke
from fixtures_quantize import imatrix_values, make_llama_gguf, write_imatrix_gguf
from llama_cpp_sources import tool_path
from test_quantize_options_oracle import assert_same_file

from ggufkit.errors import UsageError
from ggufkit.format import open_gguf
from ggufkit.quant.llama_quantize.pipeline import quantize_file
from ggufkit.quant.target.search import _hull, allocate, parse_target_size, quantize_to_target

TYPES = ("q4_0", "q5_0", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("target")
    src = make_llama_gguf(d / "m.gguf", n_embd=256, n_ff=512, n_layer=4, n_head=4, n_head_kv=1, n_vocab=256)
    odd = make_llama_gguf(d / "odd.gguf", n_embd=288, n_ff=576, n_layer=2, n_head=4, n_head_kv=4, n_vocab=256,
                          tied=True, seed=3)
    return {"src": src, "odd": odd, "im": write_imatrix_gguf(d / "im.gguf", imatrix_values(src)),
            "im_odd": write_imatrix_gguf(d / "im_odd.gguf", imatrix_values(odd)), "cache": d / "cache"}


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_parse_target_size():
    assert parse_target_size("95M") == 95_000_000
    assert parse_target_size("90MiB") == 90 * 2**20
    assert parse_target_size("1.5GiB") == int(1.5 * 2**30)
    assert parse_target_size("4096") == 4096
    for bad in ("-1", "12 parsecs", "", "0"):
        with pytest.raises(UsageError):
            parse_target_size(bad)


def test_hull_and_greedy_allocation():
    q = [(10, 5.0, "a"), (12, 6.0, "dominated"), (20, 2.0, "b"), (30, 1.5, "above"), (40, 0.5, "c")]
    assert [p[2] for p in _hull(q)] == ["a", "b", "c"]  # type: ignore[misc]
    # two tensors; the budget buys exactly one upgrade, the steeper (x: 3/10 per byte vs y: 1/10)
    pts = {"x": [(10, 5.0, "a"), (20, 2.0, "b")], "y": [(10, 5.0, "a"), (20, 4.0, "b")]}
    assert allocate(pts, 30) == {"x": 1, "y": 0}  # type: ignore[arg-type]
    assert allocate(pts, 40) == {"x": 1, "y": 1}  # type: ignore[arg-type]
    assert allocate(pts, 20) == {"x": 0, "y": 0}  # type: ignore[arg-type]


@pytest.mark.parametrize("budget", ["q4_k_m", "q3_k_m"])
def test_size_within_budget_and_predicted_exactly(model, tmp_path, budget):
    ref = tmp_path / "preset.gguf"
    quantize_file(model["src"], ref, budget, imatrix=model["im"])
    before = _sha(model["src"])
    out = tmp_path / "mix.gguf"
    dry = quantize_to_target(model["src"], None, target_like=budget, imatrix=model["im"], types=TYPES,
                             cache_dir=model["cache"], dry_run=True)
    rep = quantize_to_target(model["src"], out, target_like=budget, imatrix=model["im"], types=TYPES,
                             cache_dir=model["cache"])
    assert rep.budget == ref.stat().st_size  # --target-like is the preset's whole file
    assert out.stat().st_size == rep.predicted_size == dry.predicted_size <= rep.budget
    assert rep.predicted_size > 0.97 * rep.budget  # the budget is used, not wasted
    assert _sha(model["src"]) == before
    # the preset is one feasible assignment of these candidates: the mix estimates no more error
    assert rep.error < rep.reference_error and rep.reference_preset == budget
    with open_gguf(out) as m:
        got = {t.name: t.ggml_type for t in m.tensors}
    assert all(got[c.name] == c.type for c in rep.choices)
    # a budget one byte below the mix gives a smaller mix, never a larger file
    smaller = quantize_to_target(model["src"], None, target_size=rep.predicted_size - 1, imatrix=model["im"],
                                 types=TYPES, cache_dir=model["cache"], dry_run=True)
    assert smaller.predicted_size <= rep.predicted_size - 1


def test_target_bpw_counts_tensor_data(model, tmp_path):
    rep = quantize_to_target(model["src"], None, target_bpw=5.0, imatrix=model["im"], types=TYPES,
                             cache_dir=model["cache"], dry_run=True)
    assert rep.plan.bits_per_weight <= 5.0 and rep.plan.bits_per_weight > 4.8


@pytest.mark.parametrize("case", ["src", "odd"])
def test_mix_out_reproduces_with_llama_quantize(model, tmp_path, case):
    src, im = model[case], model["im" if case == "src" else "im_odd"]
    types = TYPES + (("iq2_xxs", "iq3_s") if case == "src" else ("q5_1", "q4_1"))
    ours, mix = tmp_path / "ours.gguf", tmp_path / "mix.txt"
    rep = quantize_to_target(src, ours, target_like="q3_k_m", imatrix=im, types=types, mix_out=mix,
                             cache_dir=model["cache"])
    assert len(mix.read_text().split()) == len(rep.choices)
    ref = tmp_path / "ref.gguf"
    r = subprocess.run([str(tool_path("llama-quantize")), "--imatrix", str(im), "--tensor-type-file", str(mix),
                        str(src), str(ref), rep.plan.target.upper(), "2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-1500:]
    assert_same_file(ref, ours)
    assert len(set(rep.plan.type_counts())) >= 3  # a real mix, not one type


def test_second_target_reuses_the_cache(model, tmp_path):
    cache = tmp_path / "cache"
    first = quantize_to_target(model["src"], None, target_like="q4_k_m", imatrix=model["im"], types=TYPES,
                               cache_dir=cache, dry_run=True)
    assert first.measured > 0 and first.cached == 0
    second = quantize_to_target(model["src"], tmp_path / "b.gguf", target_bpw=3.5, imatrix=model["im"],
                                types=TYPES, cache_dir=cache)
    assert second.measured == 0 and second.cached >= first.measured
    # another imatrix is another cache entry: measured again
    other = write_imatrix_gguf(tmp_path / "im2.gguf", imatrix_values(model["src"], seed=7))
    third = quantize_to_target(model["src"], None, target_bpw=3.5, imatrix=other, types=TYPES, cache_dir=cache,
                               dry_run=True)
    assert third.measured > 0


def test_bad_input_is_one_line_exit_2_and_nothing_written(model, tmp_path):
    src, out = model["src"], tmp_path / "out.gguf"
    before = _sha(src)
    base = [str(src), str(out), "--types", ",".join(TYPES), "--cache-dir", str(model["cache"])]
    for extra, needle in ((["--target-size", "10K"], "reachable range"),
                          (["--target-size", "1G"], "reachable range"),
                          (["--target-bpw", "0.5"], "reachable range"),
                          (["--target-size", "lots"], "not a size"),
                          (["--target-size", "1M", "--target-bpw", "4"], "exactly one"),
                          (["--target-size", "1M", "--pure"], "cannot be combined")):
        res = invoke("quantize", *base, *extra)
        assert res.exit_code == 2, (extra, res.output)
        assert needle in res.stderr and len(res.stderr.strip().splitlines()) <= 2, res.stderr
        assert not out.exists()
    res = invoke("quantize", str(src), str(out), "--target-size", "2M", "--types", "q4_0,iq2_xxs")
    assert res.exit_code == 2 and "IQ2_XXS need an importance matrix" in res.stderr
    assert not out.exists() and _sha(src) == before


def test_cli_dry_run_json_and_mix_file(model, tmp_path):
    mix = tmp_path / "mix.txt"
    res = invoke("quantize", str(model["src"]), "--target-like", "q4_k_m", "--imatrix", str(model["im"]),
                 "--types", ",".join(TYPES), "--cache-dir", str(model["cache"]), "--dry-run", "--json",
                 "--mix-out", str(mix))
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["ok"] and d["dry_run"] and d["predicted_size"] <= d["budget"]
    assert {t["name"] for t in d["tensors"]} and all("error" in t for t in d["tensors"])
    assert mix.read_text().split() == d["rules"]
    text = invoke("quantize", str(model["src"]), "--target-like", "q4_k_m", "--imatrix", str(model["im"]),
                  "--types", ",".join(TYPES), "--cache-dir", str(model["cache"]), "--dry-run")
    assert text.exit_code == 0 and "dry run: nothing written" in text.stdout


def test_mix_loads_in_llama_cpp_python(model, tmp_path):
    import llama_cpp

    out = tmp_path / "mix.gguf"
    quantize_to_target(model["src"], out, target_like="q4_k_m", imatrix=model["im"], types=TYPES,
                       cache_dir=model["cache"])
    logits = []
    for path in (model["src"], out):
        llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=64, n_batch=64, n_threads=1, verbose=False)
        try:
            llm.eval([1, 5, 9, 42, 7, 100])
            logits.append(np.array(llm.scores[:6], dtype=np.float32))
        finally:
            llm.close()
    assert np.isfinite(logits[1]).all()
    rel = np.linalg.norm(logits[1] - logits[0]) / np.linalg.norm(logits[0])
    assert rel < 0.2, rel


class _Phases:
    """A :class:`ggufkit.format.writer.Progress` that records each bar: its name, total and how far it went."""

    def __init__(self) -> None:
        self.bars: list[list] = []

    def begin(self, total: int, unit: str, desc: str) -> None:
        self.bars.append([desc, total, 0])

    def advance(self, n: int) -> None:
        self.bars[-1][2] += n

    def end(self) -> None:
        pass


def test_progress_bar_per_phase_and_none_off_a_terminal(model, tmp_path):
    phases = _Phases()
    out = tmp_path / "p.gguf"
    quantize_to_target(model["src"], out, target_like="q4_k_m", imatrix=model["im"], types=TYPES,
                       cache_dir=model["cache"], progress=phases)
    assert [b[0] for b in phases.bars] == ["planning presets", "measuring", "allocating", "quantizing (writing p.gguf)"]
    planning, measuring, allocating, writing = phases.bars
    assert planning[2] == planning[1] >= 10 and measuring[2] == measuring[1] > 0 and allocating[2] >= 3
    assert writing[2] == writing[1] > 0  # bytes of tensor data written
    # the CLI shows bars only on a terminal: under CliRunner (no terminal) stderr stays empty
    res = invoke("quantize", str(model["src"]), str(tmp_path / "q.gguf"), "--target-like", "q4_k_m", "--imatrix",
                 str(model["im"]), "--types", ",".join(TYPES), "--cache-dir", str(model["cache"]))
    assert res.exit_code == 0 and res.stderr == "", res.stderr
