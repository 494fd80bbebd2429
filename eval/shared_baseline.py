"""Score a baseline once and several models against it (``ggufkit release``): llama-perplexity's numbers, the master's logits kept once.

The master scores each chunk once; its per-position record (top-K logits, log-sum-exp, tail mass, target
logit, argmax: :class:`ggufkit.eval.kld_store.BaselineStore`) goes to one temporary file, and every type is
then compared with that file. The computation is exactly that of ``ggufkit ppl TYPE --baseline MASTER
--kld-mode stored --kld-top-k K`` (eval/perplexity.py: perplexity, stored path) on the same chunks and batches,
so each number equals what that command reports for the file alone, while the master's forward passes run
once instead of once per type. The KLD is exact when K covers the vocabulary (``K >= n_vocab - 1``);
otherwise ``mean_kld`` and its percentiles are lower bounds and ``mean_kld_upper`` bounds it from above
(see eval/kld_store.py).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ggufkit.format.writer import NullProgress, Progress

#: The master's numbers and each model's, as ``ggufkit release`` records them in its manifest.
Scores = dict[str, Any]


def _clean(value: Any) -> Any:
    """JSON-safe: NaN and infinities become None; nested dicts too."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def evaluate(master: Path, models: Mapping[str, Path], *, text: str, ctx: int, chunks: int | None,
             kld_top_k: int, device: str = "auto", progress: Progress | None = None,
             on_stage: Callable[[str], None] | None = None) -> tuple[Scores, dict[str, Scores]]:
    """Perplexity of ``master`` and of each model, and each model's KL divergence from ``master``.

    Args:
        master: the float GGUF every type was quantized from (a shard path for split sets).
        models: type name -> its GGUF.
        text: the evaluation text; ctx, chunks: llama-perplexity's ``-c`` and ``--chunks``.
        kld_top_k: K of the stored baseline (clamped to the vocabulary).
        device: ``auto``, ``cpu`` or ``cuda``.
        progress: one bar per model (chunks).
        on_stage: called with a one-line description as each model starts.

    Returns:
        (the master's scores, type -> scores).

    Raises:
        EvaluationError: too few tokens, a model the evaluator cannot run, different vocabularies.
    """
    import torch

    from ggufkit.errors import EvaluationError
    from ggufkit.eval.kld import KLDAccumulator
    from ggufkit.eval.kld_store import BaselineStore
    from ggufkit.eval.model import load_model
    from ggufkit.eval.perplexity import (
        DEFAULT_BATCH_TOKENS,
        RunningStats,
        add_stored_kld,
        check_chunking,
        chunk_windows,
        fill_baseline_store,
        score_positions,
        tokenize_text,
    )

    progress = progress or NullProgress()
    stage = on_stage or (lambda _: None)
    batch = max(1, DEFAULT_BATCH_TOKENS // ctx)
    first = ctx // 2
    text_sha = hashlib.sha256(text.encode("utf-8")).hexdigest()

    stage(f"scoring the master {master.name}")
    base = load_model(master, device=device)
    try:
        ids, add_bos, bos_id = tokenize_text(base.file, text)
        assert ids is not None
        n_chunk = check_chunking(len(ids), ctx, chunks)
        stream = torch.tensor(ids[: n_chunk * ctx], dtype=torch.int64).reshape(n_chunk, ctx)

        def windows() -> Any:
            return chunk_windows(stream, batch, add_bos, bos_id)

        store = BaselineStore(base.n_vocab, kld_top_k) if models else None
        stats = RunningStats()
        progress.begin(n_chunk, "chunk", master.name)
        fill_baseline_store(base, windows(), store, progress, stats)
        progress.end()
        master_scores: Scores = {"ppl": stats.ppl, "ppl_error": stats.ppl_error, "chunks": n_chunk, "ctx": ctx,
                                 "tokens_scored": stats.count, "n_tokens": len(ids), "text_sha256": text_sha,
                                 "model_sha256": base.model_sha256}
        n_vocab = base.n_vocab
    finally:
        base.close()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    results: dict[str, Scores] = {}
    try:
        for name, path in models.items():
            assert store is not None
            stage(f"scoring {name} ({path.name}) against the master")
            model = load_model(path, device=device)
            try:
                if model.n_vocab != n_vocab:
                    raise EvaluationError(f"{path.name} has {model.n_vocab} tokens in its vocabulary, the "
                                          f"master {n_vocab}")
                store.rewind()
                st = RunningStats(kld=KLDAccumulator())
                progress.begin(n_chunk, "chunk", name)
                for group, window, targets in windows():
                    targets = targets.to(model.device)
                    logits = model.logits(window, start=first)[:, :-1]
                    for i in range(len(group)):
                        st.add(score_positions(logits[i], targets[i]))
                        add_stored_kld(st, logits[i], store, targets[i])
                        progress.advance(1)
                    del logits
                progress.end()
                kld = st.kld.summary()
                results[name] = _clean({"ppl": st.ppl, "ppl_error": st.ppl_error, "chunks": n_chunk, "ctx": ctx,
                                        "tokens_scored": st.count, "text_sha256": text_sha,
                                        "model_sha256": model.model_sha256, "kld_top_k": store.top_k,
                                        "kld_exact": store.top_k >= n_vocab - 1, "kld": kld})
            finally:
                model.close()
    finally:
        if store is not None:
            store.close()
    return _clean(master_scores), results
