"""``quantize --target-size`` on a mixture-of-experts model (issue 16): 3-D expert tensors in the search.

A tiny random Mixtral (8 experts, top-2) from transformers' class, converted by ggufkit to F16, with a per-expert
importance matrix; the budget lies between the sizes of llama-quantize's Q3_K_M and Q4_K_M for it. The file is
not larger than the budget and its size is predicted exactly, the ``--mix-out`` rules given to the built
``llama-quantize`` (same imatrix) write the same tensors and metadata, every ``ffn_*_exps`` tensor gets one of the
candidates whose blocks fit its rows, and llama.cpp (llama-cpp-python) loads and runs the mix.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from fixtures_quantize import assert_same_quantized, imatrix_values, write_imatrix_gguf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from llama_cpp_sources import tool_path

from ggufkit.format import open_gguf
from ggufkit.quant.target.search import quantize_to_target

TYPES = ("q4_0", "q5_0", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq2_xs", "iq3_s")


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import fixtures_models as fm

    from ggufkit.converters import convert

    d = tmp_path_factory.mktemp("target_moe")
    ck = fm.make_checkpoint(d / "tiny-mixtral", "MixtralForCausalLM", hidden_size=256, intermediate_size=256,
                            num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256)
    src = d / "moe-f16.gguf"
    convert(ck, src, outtype="f16")
    return {"src": src, "im": write_imatrix_gguf(d / "im.gguf", imatrix_values(src)), "cache": d / "cache"}


def test_moe_target_size_between_presets_reproduced_by_llama_quantize(moe: dict[str, Path], tmp_path: Path) -> None:
    src, im = moe["src"], moe["im"]
    with open_gguf(src) as m:
        experts = {t.name: t.ne for t in m.tensors if "_exps." in t.name}
    assert len(experts) == 6 and all(len(ne) == 3 and ne[2] == 8 for ne in experts.values())
    sizes = {p: quantize_to_target(src, None, target_like=p, imatrix=im, types=TYPES, cache_dir=moe["cache"],
                                   dry_run=True).budget for p in ("q3_k_m", "q4_k_m")}
    assert sizes["q3_k_m"] < sizes["q4_k_m"]
    budget = (sizes["q3_k_m"] + sizes["q4_k_m"]) // 2
    ours, mix = tmp_path / "mix.gguf", tmp_path / "mix.txt"
    rep = quantize_to_target(src, ours, target_size=budget, imatrix=im, types=TYPES, mix_out=mix,
                             cache_dir=moe["cache"])
    assert rep.measured == 0  # the two dry runs measured every (tensor, candidate)
    assert ours.stat().st_size == rep.predicted_size <= budget and rep.predicted_size > 0.97 * budget
    r = subprocess.run([str(tool_path("llama-quantize")), "--imatrix", str(im), "--tensor-type-file", str(mix),
                        str(src), str(tmp_path / "ref.gguf"), rep.plan.target.upper(), "2"], capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0, r.stderr[-1500:]
    assert_same_quantized(tmp_path / "ref.gguf", ours)
    cands = {GGMLQuantizationType[t.upper()] for t in TYPES}
    with open_gguf(ours) as m:
        got = {t.name: t.ggml_type for t in m.tensors if t.name in experts}
    assert set(got) == set(experts)
    for name, t in got.items():
        assert t in cands and experts[name][0] % GGML_QUANT_SIZES[t][0] == 0, (name, t)
    chosen = {c.name: c.type for c in rep.choices}
    assert all(chosen[n] == got[n] for n in experts)
    assert len(set(rep.plan.type_counts())) >= 2
    import llama_cpp

    llm = llama_cpp.Llama(str(ours), logits_all=True, n_ctx=64, n_batch=64, n_threads=1, verbose=False)
    try:
        llm.eval([1, 5, 9, 42, 7, 100])
        assert np.isfinite(np.array(llm.scores[:6], dtype=np.float32)).all()
    finally:
        llm.close()
