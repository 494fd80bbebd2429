"""KL divergence with a stored baseline (eval/kld_store.py) against the side-by-side exact run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import invoke
from eval_models import N_VOCAB, make_hf_model, write_model_gguf
from gguf import GGMLQuantizationType as Q

from ggufkit.errors import UsageError
from ggufkit.eval import kl_divergence, kld_store
from ggufkit.eval.kld_store import BaselineStore, choose_kld_mode, record_dtype, stored_statistics

CTX = 64
#: Statistics that do not depend on the tail of the baseline's distribution: equal in both modes.
EXACT = ("ppl", "ppl_error", "ppl_base", "ppl_base_error", "ppl_correlation", "ln_ppl_ratio",
         "ln_ppl_ratio_error", "ppl_ratio", "ppl_diff", "mean_delta_p", "mean_delta_p_error", "rms_delta_p",
         "rms_delta_p_error", "same_top_p", "same_top_p_error", "tokens")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("kld_stored")
    base = write_model_gguf(make_hf_model("llama", seed=5), "llama", d / "f32.gguf")
    quant = write_model_gguf(make_hf_model("llama", seed=5), "llama", d / "q4_0.gguf", Q.Q4_0)
    return quant, base


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return np.random.default_rng(7).integers(3, N_VOCAB, 3 * CTX).tolist()


@pytest.fixture(scope="module")
def side_by_side(pair: tuple[Path, Path], tokens: list[int]) -> dict:
    r = kl_divergence(*pair, tokens=tokens, ctx=CTX, device="cpu", kld_mode="side-by-side")
    assert r.kld is not None and r.kld["mode"] == "side-by-side" and "store" not in r.kld
    return r.kld


def test_stored_mode_is_exact_but_for_the_kld_which_it_brackets(pair: tuple[Path, Path], tokens: list[int],
                                                                 side_by_side: dict, tmp_path: Path) -> None:
    r = kl_divergence(*pair, tokens=tokens, ctx=CTX, device="cpu", kld_mode="stored", kld_top_k=8,
                      kld_tmp_dir=tmp_path)
    got = r.kld
    assert got is not None and got["mode"] == "stored"
    for key in EXACT:
        assert got[key] == pytest.approx(side_by_side[key], rel=1e-9, abs=1e-15), key
    exact = side_by_side["mean_kld"]
    # The bucketed tail is a lower bound (log-sum inequality); the greedy fill of p_K an upper bound.
    assert got["mean_kld"] <= exact * (1 + 1e-9) <= got["mean_kld_upper"] * (1 + 2e-9)
    assert got["mean_kld"] < exact  # the tail really is approximated with K = 8 of 320 tokens
    assert got["store"] == {"top_k": 8, "bytes_per_position": 8 * 8 + 32, "positions": 93,
                            "bytes": 96 * 93, "llama_perplexity_bytes": 2 * (N_VOCAB + 4) * 93}
    assert r.ppl == pytest.approx(got["ppl"], rel=1e-8) and r.tokens_scored == 93
    assert os.listdir(tmp_path) == []


def test_stored_mode_with_the_whole_vocabulary_equals_the_exact_run(pair: tuple[Path, Path], tokens: list[int],
                                                                    side_by_side: dict) -> None:
    got = kl_divergence(*pair, tokens=tokens, ctx=CTX, device="cpu", kld_mode="stored",
                        kld_top_k=N_VOCAB + 100).kld
    assert got is not None and got["store"]["top_k"] == N_VOCAB
    for key in (*EXACT, "mean_kld", "mean_kld_error"):
        assert got[key] == pytest.approx(side_by_side[key], rel=1e-9, abs=1e-15), key
    assert got["mean_kld_upper"] == pytest.approx(side_by_side["mean_kld"], rel=1e-9)
    for name in ("kld_percentiles", "delta_p_percentiles"):
        for k, v in side_by_side[name].items():
            assert got[name][k] == pytest.approx(v, rel=1e-5, abs=1e-12), (name, k)


def _exact_kld(base: np.ndarray, model: np.ndarray) -> np.ndarray:
    lb = base - np.logaddexp.reduce(base, axis=-1, keepdims=True)
    lq = model - np.logaddexp.reduce(model, axis=-1, keepdims=True)
    return np.sum(np.exp(lb) * (lb - lq), axis=-1)


@pytest.mark.parametrize("k", [1, 3, 16, 49, 50])
def test_per_position_bounds_hold_on_hard_distributions(k: int, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(k)
    n, v = 64, 50
    monkeypatch.setattr(kld_store, "_BLOCK_ELEMENTS", 7 * v)  # rows in uneven blocks of 7, as for a big vocab
    # Flat, peaked and heavy-tailed rows; the model's rows are perturbed, sometimes far.
    scale = np.repeat([0.1, 1.0, 4.0, 12.0], n // 4)[:, None]
    base = (rng.standard_normal((n, v)) * scale).astype(np.float32)
    model = (base + rng.standard_normal((n, v)) * rng.choice([0.01, 0.5, 3.0], (n, 1))).astype(np.float32)
    targets = torch.from_numpy(rng.integers(0, v, n))
    with BaselineStore(v, k, tmp_path) as store:
        store.append(torch.from_numpy(base), targets)
        store.rewind()
        s = stored_statistics(torch.from_numpy(model), store.read(n), targets)
    exact = _exact_kld(base.astype(np.float64), model.astype(np.float64))
    tol = 1e-12 * (1 + np.abs(exact))
    assert np.all(s["kld"] <= exact + tol) and np.all(exact <= s["kld_upper"] + tol)
    if k >= v - 1:  # no tail, or a one-token tail, which its bucket describes exactly
        np.testing.assert_allclose(s["kld"], exact, rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(s["kld_upper"], exact, rtol=1e-10, atol=1e-13)
    else:
        assert np.any(s["kld"] < exact - 1e-9)
    lb = base.astype(np.float64) - np.logaddexp.reduce(base.astype(np.float64), axis=-1, keepdims=True)
    np.testing.assert_allclose(s["nll_base"], -lb[np.arange(n), targets.numpy()], rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(s["same_top"], base.argmax(-1) == model.argmax(-1))


def test_the_temporary_file_is_open_only_during_the_run_even_on_error(pair: tuple[Path, Path], tokens: list[int],
                                                                      tmp_path: Path) -> None:
    def open_in_tmp() -> list[str]:
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except FileNotFoundError:  # the descriptor listdir itself used
                continue
            if link.startswith(str(tmp_path)):
                found.append(link)
        return found

    seen: list[list[str]] = []

    def on_chunk(i: int, stats: object) -> None:
        seen.append(open_in_tmp())
        if i == 2:
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        kl_divergence(*pair, tokens=tokens, ctx=CTX, device="cpu", kld_mode="stored", kld_tmp_dir=tmp_path,
                      on_chunk=on_chunk)
    assert len(seen) == 2 and all(len(s) == 1 for s in seen)  # the store, nameless, in the directory asked for
    assert open_in_tmp() == [] and os.listdir(tmp_path) == []


def test_auto_mode_chooses_by_free_memory(pair: tuple[Path, Path], tokens: list[int]) -> None:
    k = kl_divergence(*pair, tokens=tokens[:2 * CTX], ctx=CTX, device="cpu").kld
    assert k is not None and k["mode"] == "side-by-side"  # two tiny models fit in any machine's free RAM
    assert choose_kld_mode("auto", 10, 10, 5, 100) == "side-by-side"
    assert choose_kld_mode("auto", 40, 40, 5, 80) == "stored"
    assert choose_kld_mode("stored", 1, 1, 1, 10**12) == "stored"
    assert choose_kld_mode("side-by-side", 10**12, 10**12, 0, 1) == "side-by-side"
    with pytest.raises(UsageError, match="kld-mode"):
        choose_kld_mode("disk", 1, 1, 1, 1)
    assert record_dtype(32).itemsize == 288


def test_cli_reports_the_stored_mode_and_its_size(pair: tuple[Path, Path], tokens: list[int],
                                                  side_by_side: dict, tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text(" ".join(map(str, tokens)))
    args = ["ppl", str(pair[0]), "--baseline", str(pair[1]), "--tokens", str(tmp_path / "t.txt"), "--ctx",
            str(CTX), "--device", "cpu", "--kld-mode", "stored", "--kld-top-k", "16"]
    r = invoke(*args, "--json")
    assert r.exit_code == 0, r.stderr
    k = json.loads(r.stdout)["kld"]
    assert k["mode"] == "stored" and k["store"]["bytes_per_position"] == 160 and k["store"]["positions"] == 93
    assert k["same_top_p"] == pytest.approx(side_by_side["same_top_p"])
    human = invoke(*args)
    assert human.exit_code == 0, human.stderr
    assert "stored baseline, top 16: 160 bytes x 93 positions" in human.stdout
    bad = invoke(*args[:-1], "0")
    assert bad.exit_code == 2 and "--kld-top-k" in bad.stderr


def test_a_model_against_itself_stored_has_zero_divergence(pair: tuple[Path, Path], tokens: list[int]) -> None:
    k = kl_divergence(pair[1], pair[1], tokens=tokens[:2 * CTX], ctx=CTX, device="cpu", kld_mode="stored").kld
    assert k is not None
    assert k["mean_kld"] == pytest.approx(0.0, abs=1e-12) and k["mean_kld_upper"] >= 0.0
    assert k["same_top_p"] == 1.0 and k["ppl_ratio"] == pytest.approx(1.0, rel=1e-12)
    assert k["rms_delta_p"] == pytest.approx(0.0, abs=1e-12)
