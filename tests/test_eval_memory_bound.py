"""``ggufkit ppl`` and ``imatrix`` hold about one block's weights dequantized at a time (issue 32, "Scale": a
model far larger than the memory runs with its weights kept quantized, dequantized per layer).

A tiny DeepSeek-V3 (MLA, 16 routed experts in 4 groups, top-2, a shared expert, one dense lead layer) converted
to Q8_0 by ggufkit is scored while a hook on :class:`ggufkit.eval.qtensor.QTensor` (every dequantization the
evaluator makes goes through its ``float``/``row_range``/``rows``) counts the bytes of dequantized block
weights alive, exactly: each result's storage is followed until torch frees it. With the float cache off, the
peak must stay within one block's worth (its dense tensors plus one expert of each stacked tensor), which is
less than one stacked expert tensor: code that dequantizes every weight up front, keeps dequantized layers
across blocks, or makes a whole ``ffn_*_exps`` float at once fails. With a float cache budget, the peak stays
within that budget plus one block.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cli_helpers import invoke

from ggufkit.eval.model import FLOAT_CACHE_ENV
from ggufkit.eval.qtensor import QTensor
from ggufkit.format import open_gguf
from ggufkit.format.tensor_shape import n_elements

N_EXPERT = 16
CTX = 64
WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars shine on quiet hills"


class DequantizedBytes:
    """Bytes of dequantized ``blk.*`` tensors alive, and their peak, counted at each dequantization."""

    def __init__(self) -> None:
        self.alive = 0
        self.peak = 0

    def _freed(self, nbytes: int) -> None:
        self.alive -= nbytes

    def track(self, t: QTensor, out: torch.Tensor) -> torch.Tensor:
        storage = out.untyped_storage()
        # F32 rows are a view of the file's bytes, not a copy: nothing was allocated
        if t.name.startswith("blk.") and storage.data_ptr() != t.raw.untyped_storage().data_ptr():
            self.alive += storage.nbytes()
            self.peak = max(self.peak, self.alive)
            weakref.finalize(storage, self._freed, storage.nbytes())
        return out


@pytest.fixture()
def counter(monkeypatch: pytest.MonkeyPatch) -> Iterator[DequantizedBytes]:
    count = DequantizedBytes()

    def hooked(method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(self: QTensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return count.track(self, method(self, *args, **kwargs))
        return run

    for name in ("float", "row_range", "rows"):
        monkeypatch.setattr(QTensor, name, hooked(getattr(QTensor, name)))
    yield count


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from fixtures_models import _write_tokenizer
    from test_family_deepseek2 import build_model

    from ggufkit.converters import convert

    d = tmp_path_factory.mktemp("memory-bound")
    ckpt = d / "ckpt"
    ckpt.mkdir()
    n_vocab = _write_tokenizer(ckpt, "gpt-2")  # a small BPE vocabulary: the head stays small
    build_model("v3", n_vocab, n_routed_experts=N_EXPERT, moe_intermediate_size=64).save_pretrained(ckpt)
    path = Path(convert(ckpt, d / "q8_0.gguf", outtype="q8_0").outputs[0])
    rng = np.random.default_rng(0)
    (d / "text.txt").write_text(" ".join(rng.choice(WORDS.split(), 3 * CTX)) + "\n")
    with open_gguf(path) as f:
        shapes = {t.name: t.shape for t in f.tensors}
    blocks: dict[str, int] = {}
    for name, shape in shapes.items():
        if name.startswith("blk."):
            b = name.split(".")[1]
            # a stacked [n_expert, rows, cols] tensor counts one expert
            per = n_elements(shape) // N_EXPERT if "_exps." in name else n_elements(shape)
            blocks[b] = blocks.get(b, 0) + 4 * per
    stacked = max(4 * n_elements(s) for n, s in shapes.items() if "_exps." in n)
    return {"path": path, "text": d / "text.txt", "dir": d, "block_bytes": max(blocks.values()),
            "stacked_bytes": stacked, "model_bytes": sum(4 * n_elements(s) for n, s in shapes.items()
                                                         if n.startswith("blk."))}


def run(model: dict[str, Any], command: str) -> None:
    out = model["dir"] / f"{command}-out.gguf"
    extra = ["-o", str(out)] if command == "imatrix" else []
    res = invoke(command, str(model["path"]), "-f", str(model["text"]), "-c", str(CTX), "--chunks", "2",
                 "--device", "cpu", *extra)
    assert res.exit_code == 0, res.stderr


@pytest.mark.parametrize("command", ["ppl", "imatrix"])
def test_peak_dequantized_bytes_is_one_block(model: dict[str, Any], counter: DequantizedBytes, command: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # the bound has teeth: one block's worth is less than one stacked expert tensor made float
    assert model["block_bytes"] < model["stacked_bytes"] < model["model_bytes"]
    monkeypatch.setenv(FLOAT_CACHE_ENV, "0")
    run(model, command)
    assert 0 < counter.peak <= model["block_bytes"], (counter.peak, model)


def test_float_cache_stays_within_its_budget(model: dict[str, Any], counter: DequantizedBytes,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    budget = model["block_bytes"]  # room for about one block: kept tensors plus the block in flight
    monkeypatch.setenv(FLOAT_CACHE_ENV, str(budget / 2**20))
    run(model, "ppl")
    assert counter.peak <= budget + model["block_bytes"], (counter.peak, model)
