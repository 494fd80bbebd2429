"""YaRN rope scaling as llama.cpp computes it, for every architecture the evaluator runs.

A file whose ``{arch}.rope.scaling.type`` is ``yarn`` gets llama_context's YaRN settings (src/llama-context.cpp,
the constructor): ``freq_scale = 1 / rope.scaling.factor``, ``ext_factor`` 1, ``beta_fast`` 32 / ``beta_slow`` 1
(llama_hparams' defaults: of the loaders the evaluator follows none reads the ``yarn_beta_*`` / ``yarn_ext_factor``
keys, only grok's and mistral3's do), ``n_ctx_orig`` from ``rope.scaling.original_context_length`` (else
``context_length``), and an attention factor that cancels the magnitude rope_yarn applies
(``get_mscale(factor, 1) / (1 + 0.1 ln factor)``, or DeepSeek 2's ``yarn_log_multiplier`` form), times
``rope.scaling.attn_factor``. Every graph passes these to ggml_rope_ext (or ggml_rope_multi), so one computation
serves NORM and NEOX rope alike: :func:`yarn_theta` gives each rotated pair's angle and the magnitude of cos and
sin, as ggml-cpu ops.cpp rope_yarn over ggml.c ggml_rope_yarn_corr_dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ggufkit.errors import MetadataValueError

if TYPE_CHECKING:
    from ggufkit.format.reader import GGUFModel


@dataclass(frozen=True)
class Yarn:
    """llama_context's YaRN settings for a file (module docstring).

    Attributes:
        factor: ``rope.scaling.factor``.
        freq_scale: ``1 / factor`` (the layers' frequency scale; a sliding-window layer's may be 1,
            llama_model::get_rope_freq_scale).
        ext_factor: the ramp's weight (1 for yarn: llama_context's default when the loader read no key).
        attn_factor: what ggml_rope_ext gets as ``attn_factor`` (llama_context's, after its cancellation).
        beta_fast, beta_slow: the ramp's ends in rotations (ggml_rope_yarn_corr_dims).
        n_ctx_orig: the context the model was trained with before scaling.
        log_mul: ``rope_yarn_log_mul`` as the loader holds it (DeepSeek 2: the file's value divided by 0.1; 0
            elsewhere).
    """

    factor: float
    freq_scale: float
    ext_factor: float
    attn_factor: float
    beta_fast: float
    beta_slow: float
    n_ctx_orig: float
    log_mul: float = 0.0


def _number(file: GGUFModel, name: str, default: float) -> float:
    field = file.kv.get(name)
    if field is None:
        return default
    if isinstance(field.value, bool) or not isinstance(field.value, (int, float)):
        raise MetadataValueError(f"expected a number, got {field.type_label}", key=name, path=file.path)
    return float(field.value)


def read_yarn(file: GGUFModel, arch: str, *, log_mul_key: bool = False) -> Yarn:
    """The YaRN settings llama_context derives for ``file`` (module docstring); ``log_mul_key``: the
    architecture's loader reads ``rope.scaling.yarn_log_multiplier`` and divides the converter's 0.1 out
    (llama_model_deepseek2::load_arch_hparams, [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX])."""
    # llama_model::load_hparams: rope.scaling.factor, else the old rope.scale_linear; 0 means 1
    factor = _number(file, f"{arch}.rope.scaling.factor", _number(file, f"{arch}.rope.scale_linear", 0.0)) or 1.0
    log_mul = _number(file, f"{arch}.rope.scaling.yarn_log_multiplier", 0.0) / 0.1 if log_mul_key else 0.0
    freq_scale = 1.0 / factor
    ext = 1.0

    def get_mscale(scale: float, mscale: float) -> float:
        return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0

    attn = 1.0
    if ext != 0.0:
        if log_mul != 0.0:
            mscale = log_mul if log_mul != 1.0 else 1.0
            attn = get_mscale(factor, mscale) / get_mscale(factor, log_mul)
        else:
            attn = get_mscale(factor, 1.0)
        attn *= 1.0 / (1.0 + 0.1 * math.log(factor))
    attn *= _number(file, f"{arch}.rope.scaling.attn_factor", 1.0)
    n_ctx_orig = _number(file, f"{arch}.rope.scaling.original_context_length", 0.0) or \
        _number(file, f"{arch}.context_length", 0.0)
    if n_ctx_orig <= 0:
        raise MetadataValueError("yarn rope scaling needs the original context length",
                                 key=f"{arch}.rope.scaling.original_context_length", path=file.path)
    return Yarn(factor=factor, freq_scale=freq_scale, ext_factor=ext, attn_factor=attn, beta_fast=32.0, beta_slow=1.0,
                n_ctx_orig=n_ctx_orig, log_mul=log_mul)


def rope_theta(t: int, n: int, base: float) -> torch.Tensor:
    """Each position's angle for each rotated pair, ``float32[t, n // 2]``: ``pos * base^(-2i/n)``."""
    i = torch.arange(n // 2, dtype=torch.float64)
    return torch.arange(t, dtype=torch.float32)[:, None] * ((base ** (-2.0 / n)) ** i).to(torch.float32)[None, :]


def yarn_theta(yarn: Yarn, t: int, n: int, base: float, freq_scale: float,
               freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """ggml's rope_yarn angles ``float32[t, n // 2]`` for ``n`` rotated dims and the magnitude of cos and sin.

    Pair ``i``'s angle (divided by its ``freq_factors`` entry, llama3's rope_freqs) is mixed between the
    interpolated ``freq_scale * theta`` and the extrapolated ``theta`` by the ramp over
    ggml_rope_yarn_corr_dims (1 below the fast end, 0 above the slow end), and the magnitude is
    ``attn_factor * (1 + 0.1 ln(1 / freq_scale))`` (ggml-cpu ops.cpp rope_yarn)."""
    theta = rope_theta(t, n, base)
    if freq_factors is not None:
        theta = theta / freq_factors.to(torch.float32).cpu()[None, :]
    interp = freq_scale * theta
    mscale = yarn.attn_factor
    if yarn.ext_factor == 0.0:
        return interp, mscale

    def corr_dim(n_rot: float) -> float:
        return n * math.log(yarn.n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    i = torch.arange(n // 2, dtype=torch.float64)
    low = max(0.0, math.floor(corr_dim(yarn.beta_fast)))
    high = min(n - 1.0, math.ceil(corr_dim(yarn.beta_slow)))
    mix = ((1 - ((i - low) / max(0.001, high - low)).clamp(0, 1)) * yarn.ext_factor).to(torch.float32)
    theta = interp * (1 - mix[None, :]) + theta * mix[None, :]
    return theta, mscale * (1.0 + 0.1 * math.log(1.0 / freq_scale))
