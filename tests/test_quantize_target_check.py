"""The measured decisions of ``quantize --target-size`` (issue #16): the second probe of a group whose weights
lie on its first probe's grid, and the final check of the mix against the presets that fit.

Oracles: ggufkit's evaluator on files written by the quantizer (``kl_divergence``; the group KLDs and the
final check's KLDs must equal it on the same text), the built ``llama-quantize`` (given ``--mix-out`` it
reproduces the returned file byte for byte, preset or mix) and llama-cpp-python (the file loads and runs).
The models are made so that the answer is known: a tiny model quantized to a preset and dequantized to F16
(the preset is then nearly lossless: it must not lose to a mix), and the random original (a mix beats the
preset there).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import invoke
from fixtures_quantize import imatrix_values, make_llama_gguf, write_imatrix_gguf
from llama_cpp_sources import tool_path

from ggufkit.eval import kl_divergence
from ggufkit.eval.perplexity import sample_text
from ggufkit.eval.target_sensitivity import ON_GRID_RATIO, measure_sensitivity, quantize_to_target_kld
from ggufkit.format import open_gguf
from ggufkit.quant.llama_quantize.pipeline import quantize_file

CTX, CHUNKS, BANDS = 64, 2, 2


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("target_check")
    src = make_llama_gguf(d / "m.gguf", n_embd=256, n_ff=512, n_layer=4, n_head=4, n_head_kv=1, n_vocab=512,
                          seed=5)
    im = write_imatrix_gguf(d / "im.gguf", imatrix_values(src))
    # the preset situation of a published file: Q4_K_M, dequantized to F16
    q = d / "q4_k_m.gguf"
    quantize_file(src, q, "q4_k_m", imatrix=im)
    ongrid = d / "ongrid.gguf"
    quantize_file(q, ongrid, "f16", allow_requantize=True)
    # only ffn_down on Q4_K's grid
    qd = d / "down.gguf"
    quantize_file(src, qd, "q8_0", imatrix=im, tensor_types=[r"ffn_down=q4_k", r"\.weight$=f16"])
    down = d / "down-f16.gguf"
    quantize_file(qd, down, "f16", allow_requantize=True)
    calib = d / "calib.txt"
    calib.write_text(sample_text())
    return {"src": src, "im": im, "ongrid": ongrid, "down": down, "calib": calib, "cache": d / "cache"}


def _kld_of_file(path: Path, base: Path) -> float:
    ref = kl_divergence(path, base, text=sample_text(), ctx=CTX, chunks=CHUNKS, device="cpu")
    assert ref.kld is not None
    return float(ref.kld["mean_kld"])


def test_on_grid_group_gets_a_second_probe(models, tmp_path):
    down = measure_sensitivity(models["down"], imatrix=models["im"], ctx=CTX, chunks=CHUNKS, bands=BANDS,
                               cache_dir=models["cache"], device="cpu", threads=2)
    src = measure_sensitivity(models["src"], imatrix=models["im"], ctx=CTX, chunks=CHUNKS, bands=BANDS,
                              cache_dir=models["cache"], device="cpu", threads=2)
    by, by_src = {g.group: g for g in down.groups}, {g.group: g for g in src.groups}
    tiny = {g for g, x in by.items() if x.tiny}
    assert tiny == {"ffn_down@0-1", "ffn_down@2-3"}, tiny
    assert down.measured == len(down.groups) + 2 + 2  # the two second probes
    g = by["ffn_down@2-3"]
    # on its probe's grid: the first probe measures (almost) nothing; the second is a real error
    assert set(g.probes_alt) == {"Q3_K"} and g.proxy_alt is not None and g.kld_alt is not None
    assert g.proxy < ON_GRID_RATIO * g.proxy_alt and by_src[g.group].proxy > 10 * g.proxy
    # the second probe's KLD is the evaluator's on a file with that group at Q3_K
    q = tmp_path / "alt.gguf"
    rules = [f"^{re.escape(n)}$=q3_k" for n in g.tensors] + [r"\.weight$=f16"]
    quantize_file(models["down"], q, "q8_0", imatrix=models["im"], tensor_types=rules)
    assert g.kld_alt == pytest.approx(_kld_of_file(q, models["down"]), rel=1e-4, abs=1e-9)
    # least squares through the origin over both points, and no ratio of near-zeros: the factor is the
    # one the same group measures on the original weights (off every grid), within a factor 3
    assert g.factor == pytest.approx((g.kld * g.proxy + g.kld_alt * g.proxy_alt) / (g.proxy ** 2 + g.proxy_alt ** 2))
    assert all(down.sensitivity[n] == pytest.approx(g.factor) for n in g.tensors)
    ratio = g.factor / by_src["ffn_down@2-3"].factor
    assert 1 / 3 < ratio < 3, (g.factor, by_src["ffn_down@2-3"].factor)
    assert any("second probe Q3_K" in n for n in down.notes)


def _run(models, tmp_path, model: str, target: str | int):  # type: ignore[no-untyped-def]
    """``target``: a preset's name (``--target-like``) or a size in bytes (``--target-size``)."""
    out, mix = tmp_path / f"{model}-{target}.gguf", tmp_path / f"{model}-{target}.txt"
    budget = {"target_size": target} if isinstance(target, int) else {"target_like": target}
    rep, sens = quantize_to_target_kld(models[model], out, **budget, imatrix=models["im"],
                                       calibration_text=models["calib"], cache_dir=models["cache"], ctx=CTX,
                                       chunks=CHUNKS, bands=BANDS, mix_out=mix, device="cpu", threads=2)
    assert sens is not None and rep.final_check is not None and rep.output == out
    return rep, out, mix


def _llama_quantize_reproduces(models, tmp_path, model: str, rep, out: Path, mix: Path) -> None:  # type: ignore[no-untyped-def]
    ref = tmp_path / "ref.gguf"
    r = subprocess.run([str(tool_path("llama-quantize")), "--imatrix", str(models["im"]), "--tensor-type-file",
                        str(mix), str(models[model]), str(ref), rep.plan.target.upper(), "2"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-1500:]
    # same tensors and bytes, same KV pairs in the same order; ggufkit's own keys aside on both sides (an input
    # written by ggufkit carries them, and llama-quantize copies them)
    with open_gguf(ref) as a, open_gguf(out) as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for ta, tb in zip(a.tensors, b.tensors):
            assert bytes(a.raw(ta)) == bytes(b.raw(tb)), ta.name
        assert [k for k in a.kv if not k.startswith("ggufkit.")] == [k for k in b.kv if not k.startswith("ggufkit.")]


def _loads_in_llama_cpp_python(path: Path) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=64, n_batch=64, n_threads=1, verbose=False)
    try:
        llm.eval([1, 5, 9, 42, 7, 100])
        assert np.isfinite(np.array(llm.scores[:6], dtype=np.float32)).all()
    finally:
        llm.close()


def test_preset_wins_where_it_is_lossless(models, tmp_path):
    rep, out, mix = _run(models, tmp_path, "ongrid", "q4_k_m")
    fc = rep.final_check
    assert fc.chosen == "q4_k_m" and "q4_k_m" in fc.kld and fc.kld["q4_k_m"] < fc.kld["mix"], fc
    assert "Q4_K_M" in fc.reason and fc.measured >= 2
    # the returned plan is the preset's, tensor for tensor, and its measured KLD is the evaluator's on the file
    preset = tmp_path / "preset.gguf"
    quantize_file(models["ongrid"], preset, "q4_k_m", imatrix=models["im"])
    with open_gguf(preset) as a, open_gguf(out) as b:
        assert {t.name: t.ggml_type for t in a.tensors} == {t.name: t.ggml_type for t in b.tensors}
    assert out.stat().st_size <= rep.budget == preset.stat().st_size
    assert mix.read_text().split() == [] and rep.plan.target == "q4_k_m"  # the preset alone: no rule
    assert fc.kld["q4_k_m"] == pytest.approx(_kld_of_file(out, models["ongrid"]), rel=1e-3, abs=1e-8)
    _llama_quantize_reproduces(models, tmp_path, "ongrid", rep, out, mix)
    _loads_in_llama_cpp_python(out)
    # a second run measures nothing again
    again, _, _ = _run(models, tmp_path, "ongrid", "q4_k_m")
    assert again.final_check is not None and again.final_check.measured == 0
    assert again.final_check.kld == fc.kld and again.final_check.chosen == "q4_k_m"


def test_mix_wins_where_no_preset_of_its_size_fits(models, tmp_path):
    # one byte under Q3_K_M's file: the fitting presets are the smaller ones, and the mix, which spends
    # nearly Q3_K_M's bytes, must measure lower than each of them. (At Q3_K_M's own size this random model's
    # preset measures lower than the mix, 0.0075 vs 0.0114, and the check rightly returns the preset.)
    ref = tmp_path / "q3_k_m-preset.gguf"
    quantize_file(models["src"], ref, "q3_k_m", imatrix=models["im"])
    rep, out, mix = _run(models, tmp_path, "src", ref.stat().st_size - 1)
    fc = rep.final_check
    presets = {k: v for k, v in fc.kld.items() if k != "mix"}
    assert presets and "q3_k_m" not in presets, fc
    assert fc.chosen == "mix" and fc.kld["mix"] < min(presets.values()), fc
    assert fc.kld["mix"] == pytest.approx(_kld_of_file(out, models["src"]), rel=1e-3, abs=1e-8)
    assert out.stat().st_size <= rep.budget
    _llama_quantize_reproduces(models, tmp_path, "src", rep, out, mix)
    _loads_in_llama_cpp_python(out)


def test_dry_run_and_json_say_what_was_chosen(models):
    args = [str(models["ongrid"]), "--target-like", "q4_k_m", "--imatrix", str(models["im"]), "--cache-dir",
            str(models["cache"]), "--calibration-text", str(models["calib"]), "--dry-run"]
    res = invoke("quantize", *args, "--json")
    assert res.exit_code == 0, res.output
    fc = json.loads(res.stdout)["final_check"]
    assert fc["chosen"] in fc["measured_kld"] and "mix" in fc["measured_kld"] and fc["reason"]
    human = invoke("quantize", *args)
    assert human.exit_code == 0 and "final check" in human.stdout and f"chosen {fc['chosen']}" in human.stdout
