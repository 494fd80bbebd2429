"""The evaluator: perplexity and KL divergence of GGUF models by llama-perplexity's method, in PyTorch.

Public API (torch is imported only when one of these is called)::

    from ggufkit.eval import load_model, perplexity, kl_divergence

    result = perplexity("model-q4_k_m.gguf", ctx=512)            # bundled sample text
    print(result.ppl, result.ppl_error, result.chunks)
    result = kl_divergence("model-q4_k_m.gguf", "model-f16.gguf")
    print(result.kld["mean_kld"])
    result = collect_imatrix("model-f16.gguf", text=open("calib.txt").read(), output="imatrix.gguf")
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# Imported eagerly (numpy only; torch loads inside the call): a lazy wrapper named ``perplexity`` would be
# replaced by the submodule ``ggufkit.eval.perplexity`` as soon as anything imported that submodule.
from ggufkit.eval.imatrix import ImatrixResult, collect_imatrix, combine_imatrix
from ggufkit.eval.perplexity import PerplexityResult, perplexity

if TYPE_CHECKING:
    from ggufkit.eval.model import GGUFCausalLM

__all__ = ["ImatrixResult", "PerplexityResult", "collect_imatrix", "combine_imatrix", "kl_divergence", "load_model",
           "perplexity"]


def load_model(path: str | os.PathLike[str], *, device: str = "auto", dtype: str = "auto") -> GGUFCausalLM:
    """Open a GGUF model for scoring; see :func:`ggufkit.eval.model.load_model`.

    Args:
        path: GGUF/PWRI file or a shard of a split set.
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
        dtype: ``auto``/``f32``, or ``f16``/``bf16`` (GPU only).

    Returns:
        A :class:`~ggufkit.eval.model.GGUFCausalLM` whose ``logits(tokens)`` gives float32 ``[B, T, n_vocab]``.

    Raises:
        EvaluationError: unsupported architecture, tensor type or shape.
        DeviceUnavailableError: CUDA asked for and absent.
    """
    from ggufkit.eval.model import load_model as _load

    return _load(path, device=device, dtype=dtype)


def kl_divergence(model_path: str | os.PathLike[str], baseline: str | os.PathLike[str],
                  **kwargs: Any) -> PerplexityResult:
    """Perplexity of ``model_path`` plus its KL divergence from ``baseline`` on the same chunks.

    Args:
        model_path: the model under test (e.g. a quantized file).
        baseline: the reference model (e.g. the F16 file) with the same vocabulary.
        **kwargs: as :func:`perplexity`.

    Returns:
        A :class:`~ggufkit.eval.perplexity.PerplexityResult` whose ``kld`` holds the statistics.

    Raises:
        EvaluationError: the vocabularies differ, too few tokens, or an unsupported model.
    """
    return perplexity(model_path, baseline=baseline, **kwargs)
