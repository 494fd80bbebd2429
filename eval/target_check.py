"""The final, measured check of a size-budget search (issue #16): "proxies to prune, measurements to decide".

:func:`ggufkit.quant.target.search.quantize_to_target` ranks types by an imatrix-weighted proxy scaled by the
measured group sensitivities (:mod:`ggufkit.eval.target_sensitivity`); both are estimates. Before the mix
is written, :func:`measured_check` quantizes the mix and the largest llama-quantize presets that fit the
budget in memory (ggufkit's byte-exact kernels, the imatrix applied as llama-quantize applies it), runs the
whole model on the calibration text with the sensitivity's own machinery
(:class:`ggufkit.eval.target_calibration.Calibration`: same tokens, same scored positions, same base
logits) and measures each one's mean KL divergence. The search never returns a plan that measures worse than
a fitting preset: that preset's per-tensor plan is written instead, and the report says so.

Cached like the sensitivity: one JSON file per (model hash, imatrix hash, text hash, ctx, chunks, version),
one entry per plan (the hash of its ``tensor=type`` list), so a second target on the same inputs, or the same
preset checked for another budget, measures nothing again.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

from gguf import GGMLQuantizationType

from ggufkit.eval.target_calibration import Calibration, KLDCache, first_layer
from ggufkit.format.writer import NullProgress, Progress
from ggufkit.quant.imatrix.reader import Imatrix
from ggufkit.quant.registry import FLOAT_TYPES
from ggufkit.quant.target.search import FinalCheckFn

#: Bump when the measurement changes meaning: old cache files are then ignored.
CHECK_VERSION = 1


def plan_key(types: Mapping[str, GGMLQuantizationType]) -> str:
    """The cache key of a plan: a hash of its sorted ``tensor=type`` list (the tensors it changes)."""
    text = ";".join(f"{n}={t.name}" for n, t in sorted(types.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def measured_check(input: str | os.PathLike[str], *, imatrix: Imatrix | None, text: str, ctx: int, chunks: int,
                   cache_dir: str | os.PathLike[str] | None = None, threads: int | None = None,
                   device: str = "cpu", progress: Progress | None = None) -> FinalCheckFn:
    """The ``final_check`` of :func:`ggufkit.quant.target.search.quantize_to_target`, measured by the evaluator.

    Args:
        input: the F32/F16/BF16 GGUF the search quantizes (also the KLD's base).
        imatrix: the search's importance matrix (quantizes the candidates as llama-quantize would).
        text, ctx, chunks: the calibration text and how much of it runs (as the sensitivity's).
        cache_dir: cache directory (default: the search's).
        threads: quantization threads; device: the evaluator's.
        progress: one step per plan measured.

    Returns:
        A function: candidate -> {tensor: type} -> (candidate -> mean KLD, measured now, from the cache).
    """
    from ggufkit.quant.target.measure import default_cache_dir, file_sha256

    def check(cands: Mapping[str, Mapping[str, GGMLQuantizationType]]) -> tuple[dict[str, float], int, int]:
        from ggufkit.eval.model import load_model
        from ggufkit.eval.perplexity import tokenize_text

        has_im = imatrix is not None and bool(imatrix.entries)
        ident = (f"{file_sha256([Path(input)])}|{imatrix.sha256 if has_im and imatrix is not None else '-'}|"
                 f"{hashlib.sha256(text.encode('utf-8')).hexdigest()}|{ctx}|{chunks}|v{CHECK_VERSION}")
        cdir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        cache = KLDCache(cdir, "check-" + hashlib.sha256(ident.encode()).hexdigest()[:32])
        keys = {label: plan_key(types) for label, types in cands.items()}
        todo = {k: label for label, k in keys.items() if k not in cache.data}
        if todo:
            bar = progress or NullProgress()
            model = load_model(input, device=device)
            try:
                ids, add_bos, bos_id = tokenize_text(model.file, text)
                assert ids is not None
                cal = Calibration(model, ids, add_bos, bos_id, ctx, chunks)
                shapes = {t.name: t.shape for t in model.file.tensors}
                memo: dict[tuple[str, GGMLQuantizationType], object] = {}
                bar.begin(len(todo), "plan", "final check")
                for k, label in todo.items():
                    types = {n: t for n, t in cands[label].items() if n in model.tensors}
                    replace = {n: (t, None if t in FLOAT_TYPES or not has_im or imatrix is None
                                   else imatrix.for_tensor(n, shapes[n])) for n, t in types.items()}
                    first = min((first_layer(n, model.hparams.n_layer) for n in types),
                                default=model.hparams.n_layer)
                    cache.data[k] = cal.kld(replace, first, threads, memo)
                    cache.save()
                    bar.advance(1)
                bar.end()
            finally:
                model.close()
        return {label: cache.data[k] for label, k in keys.items()}, len(todo), len(set(keys.values())) - len(todo)

    return check
