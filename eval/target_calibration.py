"""The calibration window of the size-budget search's KLD measurements (issue #16): what the group
sensitivity (:mod:`ggufkit.eval.target_sensitivity`) and the final check (:mod:`ggufkit.eval.target_check`)
both measure with.

:class:`Calibration` runs the unmodified model once on the calibration tokens, as
:meth:`GGUFCausalLM.logits` runs it (:meth:`~GGUFCausalLM.embed`, :meth:`~GGUFCausalLM.trunk_block` over the
trunk, :meth:`~GGUFCausalLM.head`: a family's own state and blocks included), keeps its logits and the state
entering every block, and measures the mean KL divergence of replacing some tensors by their
quantization (ggufkit's byte-exact kernels, the imatrix applied as llama-quantize applies it) over
llama-perplexity's scored positions; :class:`KLDCache` keeps the measured values between runs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

#: Bump when the measurement changes meaning: old cache files (the sensitivity's and the final
#: check's) are then ignored.
SENSITIVITY_VERSION = 3  # 2: second probes of on-grid groups; 3: every family's own forward pass and head,
#                           position embeddings measured from the embedding
_BLK = re.compile(r"blk\.(\d+)\.")


def first_layer(name: str, n_layer: int) -> int:
    """The first layer whose input a tensor changes: its block, ``n_layer`` for the output head and its norm, -1
    (the embedding: a whole forward pass) for anything else (the token and position embeddings, Gemma 3n's
    per-layer and AltUp projections)."""
    m = _BLK.match(name)
    if m is not None:
        return int(m.group(1))
    return n_layer if name.startswith("output") else -1


class KLDCache:
    """``group -> kld`` (and ``*all*``) for one identity of inputs, saved atomically after each group."""

    def __init__(self, directory: Path, key: str) -> None:
        self.path = directory / f"kld-{key}.json"
        self.data: dict[str, float] = {}
        try:
            loaded = json.loads(self.path.read_text())
            if isinstance(loaded, dict) and loaded.get("version") == SENSITIVITY_VERSION:
                self.data = {k: float(v) for k, v in loaded.get("kld", {}).items()}
        except (OSError, ValueError):
            pass

    def save(self) -> None:
        from ggufkit.quant.target.measure import save_json_cache

        save_json_cache(self.path, {"version": SENSITIVITY_VERSION, "kld": self.data})


def _has_family(model: Any) -> bool:
    """Whether the model's blocks are a family's own (:data:`ggufkit.eval.families.FORWARDS`)."""
    from ggufkit.eval.families import FORWARDS

    return model.hparams.arch in FORWARDS


def _fresh(state: Any) -> Any:
    """A stored state to restart from: its dicts and lists copied (a family's block may fill them, e.g. Gemma
    3n's shared K/V by layer), its tensors shared (blocks never write into their input)."""
    if isinstance(state, dict):
        return {k: _fresh(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_fresh(v) for v in state]
    return state


def _probe_tensor(qt: Any, t: GGMLQuantizationType, weights: np.ndarray | None, threads: int | None) -> Any:
    """``qt`` quantized to ``t`` in memory (rows as the model holds them; row order does not matter to a
    row-wise quantizer), as a new QTensor on the same device."""
    import torch

    from ggufkit.eval.qtensor import QTensor
    from ggufkit.quant import quantize

    x = qt.float(torch.float32).cpu().numpy()
    n_exp = x.shape[0] if x.ndim >= 3 else 1
    rows = x.reshape(n_exp, -1, x.shape[-1])
    raw = []
    for e in range(n_exp):
        w = None if weights is None else np.ascontiguousarray(weights[min(e, weights.shape[0] - 1)], np.float32)
        raw.append(quantize(np.ascontiguousarray(rows[e]), t, imatrix=w, threads=threads, name=qt.name))
    data = torch.from_numpy(np.concatenate(raw).reshape(-1)).to(qt.raw.device)
    return QTensor(qt.name, t, qt.shape, data)


class Calibration:
    """The model on the calibration window: its base logits and the stream state entering every block,
    to measure the mean KLD of replacing some tensors by their quantization (llama-perplexity's scored
    positions: the second half of each chunk, :class:`ggufkit.eval.kld.KLDAccumulator`).

    Args:
        model: a loaded :class:`ggufkit.eval.model.GGUFCausalLM` (its tensors are swapped and restored).
        ids, add_bos, bos_id: the tokenized text (:func:`ggufkit.eval.perplexity.tokenize_text`).
        ctx, chunks: the first ``ctx * chunks`` tokens are run.
    """

    def __init__(self, model: Any, ids: Sequence[int], add_bos: bool, bos_id: int | None, ctx: int,
                 chunks: int) -> None:
        import torch

        from ggufkit.eval.perplexity import chunk_windows

        self.model, self.chunks, self.start = model, chunks, ctx // 2
        stream = torch.tensor(list(ids[:ctx * chunks]), dtype=torch.int64).reshape(chunks, ctx)
        _, window, targets = next(chunk_windows(stream, chunks, add_bos, bos_id))
        self.window, self.targets = window.to(model.device), targets.to(model.device)
        with torch.inference_mode():
            self.xs = [model.embed(self.window)]
            for i in range(model.hparams.n_trunk):
                self.xs.append(model.trunk_block(_fresh(self.xs[-1]), i))
            self.base = model.head(_fresh(self.xs[-1]), self.start)[:, :-1]

    def kld(self, replace: Mapping[str, tuple[GGMLQuantizationType, np.ndarray | None]], first: int,
            threads: int | None = None, quantized: dict[tuple[str, GGMLQuantizationType], Any] | None = None
            ) -> float:
        """Mean KLD with each tensor of ``replace`` quantized to its type (with its imatrix weights), run from
        block ``first`` (-1: the embedding; at most ``n_trunk``: the head) on the stored state; a family's
        tensor outside the blocks and the head runs from the embedding (its ``embed`` hook may read it).
        ``quantized``: a memo of quantized tensors shared between calls."""
        import torch

        from ggufkit.eval.kld import KLDAccumulator

        model = self.model
        saved = {n: model.tensors[n] for n in replace}
        try:
            for n, (t, w) in replace.items():
                q = quantized.get((n, t)) if quantized is not None else None
                if q is None:
                    q = _probe_tensor(saved[n], t, w, threads)
                    if quantized is not None:
                        quantized[(n, t)] = q
                model.tensors[n] = q
            n_trunk = model.hparams.n_trunk
            first = min(first, n_trunk)
            if _has_family(model) and any(_BLK.match(n) is None and not n.startswith("output") for n in replace):
                first = -1  # a family's embed hook may read any tensor outside the blocks and the head
            with torch.inference_mode():
                x = model.embed(self.window) if first < 0 else _fresh(self.xs[first])
                for i in range(max(first, 0), n_trunk):
                    x = model.trunk_block(x, i)
                logits = model.head(x, self.start)[:, :-1]
                acc = KLDAccumulator()
                for c in range(self.chunks):
                    acc.add(logits[c], self.base[c], self.targets[c])
                return float(acc.summary()["mean_kld"])
        finally:
            model.tensors.update(saved)
