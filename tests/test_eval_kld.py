"""KL divergence against a baseline: llama-perplexity's statistics, computed side by side."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from eval_models import N_VOCAB, make_hf_model, write_model_gguf
from gguf import GGMLQuantizationType as Q

from ggufkit.errors import EvaluationError
from ggufkit.eval import kl_divergence, load_model
from ggufkit.eval.kld import mean_and_uncertainty, median, percentile
from ggufkit.eval.perplexity import check_gates

CTX = 64


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("kld")
    base = write_model_gguf(make_hf_model("llama", seed=4), "llama", d / "f32.gguf")
    quant = write_model_gguf(make_hf_model("llama", seed=4), "llama", d / "q4_0.gguf", Q.Q4_0)
    return quant, base


def stream(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, N_VOCAB, n).tolist()


def reference_stats(quant: Path, base: Path, tokens: list[int], ctx: int) -> dict[str, float]:
    """KL(base || Q), NLLs, Δp and top-token agreement from both models' logits, in numpy float64."""
    kld, nll, nll_b, same = [], [], [], 0
    with load_model(quant, device="cpu") as mq, load_model(base, device="cpu") as mb:
        for k in range(len(tokens) // ctx):
            w = torch.tensor([tokens[k * ctx:(k + 1) * ctx]])
            w[0, 0] = 1
            lq, lb = (m.logits(w)[0].double().numpy() for m in (mq, mb))
            for j in range(ctx // 2, ctx - 1):
                pq = lq[j] - np.log(np.exp(lq[j] - lq[j].max()).sum()) - lq[j].max()
                pb = lb[j] - np.log(np.exp(lb[j] - lb[j].max()).sum()) - lb[j].max()
                t = tokens[k * ctx + j + 1]
                kld.append(float(np.sum(np.exp(pb) * (pb - pq))))
                nll.append(-pq[t])
                nll_b.append(-pb[t])
                same += int(np.argmax(lq[j]) == np.argmax(lb[j]))
    nll, nll_b = np.array(nll), np.array(nll_b)
    dp = np.exp(-nll) - np.exp(-nll_b)
    return {"mean_kld": float(np.mean(kld)), "max_kld": float(np.max(kld)), "same_top_p": same / len(kld),
            "ppl": math.exp(nll.mean()), "ppl_base": math.exp(nll_b.mean()),
            "ppl_ratio": math.exp(nll.mean() - nll_b.mean()), "mean_delta_p": float(dp.mean()),
            "rms_delta_p": float(np.sqrt(np.mean(dp**2))),
            "ppl_correlation": float(np.corrcoef(nll, nll_b)[0, 1])}


def test_statistics_match_an_independent_computation(pair: tuple[Path, Path]) -> None:
    quant, base = pair
    tokens = stream(3 * CTX, seed=2)
    result = kl_divergence(quant, base, tokens=tokens, ctx=CTX, device="cpu")
    want = reference_stats(quant, base, tokens, CTX)
    got = result.kld
    assert got is not None and got["tokens"] == result.tokens_scored == 93
    for key in ("mean_kld", "same_top_p", "ppl", "ppl_base", "ppl_ratio", "mean_delta_p", "rms_delta_p"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-12), key
    assert got["kld_percentiles"]["max"] == pytest.approx(want["max_kld"], rel=1e-6)
    # Pearson correlation of the per-token NLLs, as llama-perplexity's "Cor(ln(PPL(Q)), ln(PPL(base)))".
    assert got["ppl_correlation"] == pytest.approx(want["ppl_correlation"], rel=1e-3)
    assert got["mean_kld"] > 0 and result.ppl == pytest.approx(got["ppl"], rel=1e-9)


def test_a_model_against_itself_has_zero_divergence(pair: tuple[Path, Path]) -> None:
    _, base = pair
    k = kl_divergence(base, base, tokens=stream(2 * CTX), ctx=CTX, device="cpu").kld
    assert k is not None
    assert k["mean_kld"] == 0.0 and k["same_top_p"] == 1.0 and k["ppl_ratio"] == 1.0 and k["rms_delta_p"] == 0.0


def test_different_vocabularies_are_refused(pair: tuple[Path, Path], tmp_path: Path) -> None:
    other = write_model_gguf(make_hf_model("llama", vocab_size=N_VOCAB + 32), "llama", tmp_path / "other.gguf")
    with pytest.raises(EvaluationError, match="same vocabulary"):
        kl_divergence(pair[0], other, tokens=stream(2 * CTX), ctx=CTX, device="cpu")


def test_percentiles_interpolate_in_float32_like_llama_perplexity() -> None:
    v = np.array([0.0, 1.0, 2.0, 10.0], dtype=np.float32)
    assert percentile(v, 0.5) == pytest.approx(1.5)
    assert percentile(v, 0.999) == pytest.approx(2.0 + 0.997 * 8.0, rel=1e-6)
    assert percentile(v, 0.0) == 0.0 and percentile(v, 1.0) == 10.0
    assert median(v) == 1.5 and median(v[:3]) == 1.0


def test_mean_uncertainty_is_zero_for_ten_or_fewer_values() -> None:
    assert mean_and_uncertainty(10.0, 20.0, 10) == (1.0, 0.0)
    m, e = mean_and_uncertainty(11.0, 23.0, 11)
    assert m == 1.0 and e == pytest.approx(math.sqrt((23 / 11 - 1) / 10))


def test_gates_report_each_exceeded_threshold(pair: tuple[Path, Path]) -> None:
    quant, base = pair
    result = kl_divergence(quant, base, tokens=stream(2 * CTX), ctx=CTX, device="cpu")
    assert result.kld is not None
    assert check_gates(result, max_ppl=result.ppl * 2, max_kld=result.kld["mean_kld"] * 2,
                       max_delta_ppl=result.kld["ppl_ratio"]) == []
    failures = check_gates(result, max_ppl=result.ppl / 2, max_kld=result.kld["mean_kld"] / 2,
                           max_delta_ppl=-1.0)
    assert [f.split()[0] for f in failures] == ["PPL", "PPL/PPL(base)", "mean"]
