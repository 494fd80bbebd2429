"""The evaluator's float cache (eval/model.py, GGUFKIT_EVAL_FLOAT_CACHE_MB) is filled only while another forward
pass over the same weights follows: ppl and imatrix tell the model how many passes they run, so a run whose
chunks all go in one batch keeps nothing (on a DeepSeek-V3-shaped model that cache was 3.3 GiB, never read), and a
run of several batches keeps the weights for the next ones. The figures are the same either way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from eval_models import make_hf_model, write_model_gguf
from gguf import GGMLQuantizationType as Q
from test_eval_model import stream

import ggufkit.eval.model as eval_model
from ggufkit.eval.model import FLOAT_CACHE_ENV, GGUFCausalLM

CTX, CHUNKS = 32, 4


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> list[GGUFCausalLM]:
    """Every model the drivers load (the real load_model, recorded), with a float cache of 1 GiB."""
    monkeypatch.setenv(FLOAT_CACHE_ENV, "1024")
    models: list[GGUFCausalLM] = []
    real = eval_model.load_model

    def recording(*args: Any, **kwargs: Any) -> GGUFCausalLM:
        models.append(real(*args, **kwargs))
        return models[-1]

    monkeypatch.setattr(eval_model, "load_model", recording)
    return models


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_gguf(make_hf_model("llama", seed=7), "llama", tmp_path_factory.mktemp("fc") / "m.gguf",
                            Q.Q8_0)


@pytest.mark.parametrize(("batch", "kept"), [(CHUNKS, False), (1, True)], ids=["one-pass", "four-passes"])
def test_ppl_keeps_floats_only_for_a_following_pass(loaded: list[GGUFCausalLM], model_file: Path, batch: int,
                                                    kept: bool) -> None:
    from ggufkit.eval.perplexity import perplexity

    held: list[int] = []
    result = perplexity(model_file, tokens=stream(CHUNKS * CTX, seed=2), ctx=CTX, chunks=CHUNKS, batch=batch,
                        device="cpu", on_chunk=lambda k, _: held.append(loaded[0].float_cache_held))
    assert result.chunks == CHUNKS and len(loaded) == 1
    assert (held[0] > 0) == kept and (max(held) > 0) == kept, held


@pytest.mark.parametrize(("batch", "kept"), [(CHUNKS, False), (2, True)], ids=["one-pass", "two-passes"])
def test_imatrix_keeps_floats_only_for_a_following_pass(loaded: list[GGUFCausalLM], model_file: Path,
                                                        tmp_path: Path, batch: int, kept: bool) -> None:
    from ggufkit.eval.imatrix import collect_imatrix

    held: list[int] = []
    collect_imatrix(model_file, tokens=stream(CHUNKS * CTX, seed=2), output=tmp_path / "i.gguf", ctx=CTX,
                    chunks=CHUNKS, batch=batch, device="cpu",
                    on_chunk=lambda k, _: held.append(loaded[0].float_cache_held))
    assert len(held) == CHUNKS and (held[0] > 0) == kept, held
