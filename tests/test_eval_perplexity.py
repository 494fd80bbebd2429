"""llama-perplexity's method: chunking, BOS overwrite, scored positions, error formula, llama.cpp parity."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from eval_models import N_VOCAB, make_hf_model, write_model_gguf
from gguf import GGMLQuantizationType as Q

from ggufkit.errors import EvaluationError, UsageError
from ggufkit.eval import load_model, perplexity
from ggufkit.eval.perplexity import RunningStats, read_text_file, read_tokens_file, sample_text

CTX = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ppl")
    return {
        "llama": write_model_gguf(make_hf_model("llama"), "llama", d / "llama.gguf"),
        "llama_f16": write_model_gguf(make_hf_model("llama"), "llama", d / "llama_f16.gguf", Q.F16),
        "llama_q8": write_model_gguf(make_hf_model("llama"), "llama", d / "llama_q8.gguf", Q.Q8_0),
        "qwen2": write_model_gguf(make_hf_model("qwen2"), "qwen2", d / "qwen2.gguf"),
        "gptneox": write_model_gguf(make_hf_model("gptneox"), "gptneox", d / "gptneox.gguf"),
    }


def stream(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, N_VOCAB, n).tolist()


def manual_nll(path: Path, tokens: list[int], ctx: int, bos: int | None) -> list[float]:
    """Per-token NLL from the model's full logits, positions picked by hand (float64 log-sum-exp)."""
    out = []
    with load_model(path, device="cpu") as model:
        for k in range(len(tokens) // ctx):
            window = torch.tensor([tokens[k * ctx:(k + 1) * ctx]])
            if bos is not None:
                window[0, 0] = bos
            logits = model.logits(window)[0].double()
            for j in range(ctx // 2, ctx - 1):
                out.append(float(torch.logsumexp(logits[j], 0) - logits[j, tokens[k * ctx + j + 1]]))
    return out


def test_chunks_are_whole_ctx_windows_and_the_tail_is_dropped(models: dict[str, Path]) -> None:
    tokens = stream(3 * CTX + CTX - 1)
    result = perplexity(models["llama"], tokens=tokens, ctx=CTX, device="cpu")
    assert result.chunks == 3
    assert result.tokens_scored == 3 * (CTX - 1 - CTX // 2)
    assert result.n_tokens == len(tokens)
    assert len(result.chunk_ppl) == 3 and result.chunk_ppl[-1] == result.ppl


def test_ppl_and_error_follow_llama_perplexitys_formulas(models: dict[str, Path]) -> None:
    tokens = stream(4 * CTX, seed=3)
    result = perplexity(models["llama"], tokens=tokens, ctx=CTX, device="cpu")
    nll = np.array(manual_nll(models["llama"], tokens, CTX, bos=1))
    n, mean = len(nll), nll.mean()
    var = (nll**2).mean() - mean**2
    assert result.ppl == pytest.approx(math.exp(mean), rel=1e-7)  # float32 log-softmax vs float64 here
    assert result.ppl_error == pytest.approx(math.exp(mean) * math.sqrt(var / (n - 1)), rel=1e-6)
    assert result.add_bos and result.bos_id == 1


def test_first_token_of_each_chunk_is_overwritten_by_bos_not_inserted(models: dict[str, Path]) -> None:
    tokens = stream(2 * CTX, seed=5)
    with_bos = perplexity(models["llama"], tokens=tokens, ctx=CTX, device="cpu").ppl
    nll_overwrite = manual_nll(models["llama"], tokens, CTX, bos=1)
    nll_plain = manual_nll(models["llama"], tokens, CTX, bos=None)
    # rel 1e-7: the evaluator's float32 log-softmax vs float64 here (measured ~1e-9); the overwrite moves it ~1e-2
    assert with_bos == pytest.approx(math.exp(np.mean(nll_overwrite)), rel=1e-7)
    assert abs(with_bos / math.exp(np.mean(nll_plain)) - 1) > 1e-3  # the overwrite matters


def test_chunks_option_bounds_the_work(models: dict[str, Path]) -> None:
    result = perplexity(models["llama"], tokens=stream(5 * CTX), ctx=CTX, chunks=2, device="cpu")
    assert result.chunks == 2 and len(result.chunk_ppl) == 2


def test_fewer_than_two_contexts_of_tokens_is_a_clear_error(models: dict[str, Path]) -> None:
    with pytest.raises(EvaluationError, match=r"you need at least 128 tokens .* only 127 tokens"):
        perplexity(models["llama"], tokens=stream(2 * CTX - 1), ctx=CTX, device="cpu")


def test_batch_size_and_repetition_do_not_change_the_result(models: dict[str, Path]) -> None:
    tokens = stream(4 * CTX, seed=9)
    runs = [perplexity(models["qwen2"], tokens=tokens, ctx=CTX, batch=b, device="cpu") for b in (1, 3, 1)]
    assert runs[0].chunk_ppl == runs[2].chunk_ppl  # bit-identical on a rerun
    assert runs[1].ppl == pytest.approx(runs[0].ppl, rel=1e-6)


def test_text_is_tokenized_with_the_gguf_vocabulary(models: dict[str, Path]) -> None:
    text = sample_text()[:3000]
    from ggufkit.format import open_gguf
    from ggufkit.tokenizer.gguf_tokenizer import load_tokenizer

    with open_gguf(models["llama"]) as f:
        ids = load_tokenizer(f).encode(text)
    a = perplexity(models["llama"], text=text, ctx=CTX, chunks=2, device="cpu")
    b = perplexity(models["llama"], tokens=ids, ctx=CTX, chunks=2, device="cpu")
    assert a.n_tokens == len(ids) and ids[0] == 1
    assert a.ppl == b.ppl


def test_text_file_loses_exactly_one_trailing_newline(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_bytes(b"a\nb\n\n")
    assert read_text_file(tmp_path / "t.txt") == "a\nb\n"
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(EvaluationError, match="not valid UTF-8"):
        read_text_file(tmp_path / "bad.txt")


def test_tokens_file_accepts_json_or_separated_integers(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("[1, 2, 3]")
    (tmp_path / "b").write_text("1 2,3\n")
    assert read_tokens_file(tmp_path / "a") == read_tokens_file(tmp_path / "b") == [1, 2, 3]
    (tmp_path / "c").write_text("1 two 3")
    with pytest.raises(EvaluationError, match="not a list of token ids"):
        read_tokens_file(tmp_path / "c")


def test_text_and_tokens_together_are_a_usage_error(models: dict[str, Path]) -> None:
    with pytest.raises(UsageError, match=re.escape("either a text or tokens")):
        perplexity(models["llama"], text="x", tokens=[1, 2], device="cpu")


def test_running_stats_error_is_nan_when_undefined() -> None:
    s = RunningStats()
    s.add(np.array([1.0, 1.0, 1.0]))
    assert s.ppl == pytest.approx(math.e) and math.isnan(s.ppl_error)


def llama_cpp_ppl(path: Path, tokens: list[int], ctx: int, bos: int) -> tuple[float, int, int]:
    """llama.cpp (llama-cpp-python) evaluating llama-perplexity's chunks with all logits."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True, verbose=False,
                n_threads=2, seed=0)
    nll, n_chunk = [], len(tokens) // ctx
    for k in range(n_chunk):
        window = tokens[k * ctx:(k + 1) * ctx]
        window[0] = bos
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[:ctx], dtype=np.float64)
        for j in range(ctx // 2, ctx - 1):
            row = logits[j]
            nll.append(row.max() + np.log(np.exp(row - row.max()).sum()) - row[tokens[k * ctx + j + 1]])
    llm.close()
    return float(np.exp(np.mean(nll))), n_chunk, len(nll)


@pytest.mark.parametrize(("name", "tolerance"), [("llama", 3e-3), ("llama_f16", 3e-3), ("qwen2", 3e-3),
                                                 ("gptneox", 3e-3), ("llama_q8", 1e-2)])
def test_same_chunks_tokens_and_perplexity_as_llama_cpp(models: dict[str, Path], name: str,
                                                        tolerance: float) -> None:
    tokens = stream(3 * CTX + 5, seed=11)
    ours = perplexity(models[name], tokens=tokens, ctx=CTX, device="cpu")
    ppl, n_chunk, n_scored = llama_cpp_ppl(models[name], tokens, CTX, bos=1)
    assert (ours.chunks, ours.tokens_scored) == (n_chunk, n_scored)
    assert abs(ours.ppl / ppl - 1) < tolerance, (ours.ppl, ppl)
