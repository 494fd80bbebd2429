"""What a family whose blocks are not the standard transformer's gives the evaluator.

Recurrent and hybrid architectures (Mamba2, gated delta-net, short-convolution layers, AltUp streams) keep
their forward pass in one module each, ``eval/family_<name>.py``, which builds a :class:`FamilyForward` from
the model's public layer interface (:class:`ggufkit.eval.model.GGUFCausalLM`) and shared layer modules
(``eval/layers_*.py``), and registers it in :data:`ggufkit.eval.families.FORWARDS` under the GGUF
architecture name. The architecture still has its :data:`ggufkit.eval.arch.ARCH_TRAITS` row (norm, rope,
FFN kind), so the standard pieces it reuses (attention, FFN, MoE) run as they do for a transformer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ggufkit.errors import MetadataKeyNotFoundError, MetadataValueError

if TYPE_CHECKING:
    import torch

    from ggufkit.eval.arch import HParams
    from ggufkit.eval.model import GGUFCausalLM
    from ggufkit.format.reader import GGUFModel


@dataclass(frozen=True)
class FamilyForward:
    """One family's forward pass.

    Attributes:
        read: the family's own hyperparameters from the file's keys, ``read(file, arch, n_layer)``; they
            land in :attr:`ggufkit.eval.arch.HParams.extra` (raise MetadataKeyNotFoundError /
            MetadataValueError / EvaluationError for a missing or malformed key).
        shapes: numpy-order shape of every tensor the forward pass reads, ``shapes(hparams, names)``
            (compose it from :mod:`ggufkit.eval.shapes`).
        block: block ``p`` (``blk.{i}.``) on the stream state, ``block(model, state, p) -> state``; without
            ``embed`` the state is the residual stream ``float32[B, T, n_embd]``.
        embed: turns the token embeddings ``float32[B, T, n_embd]`` into the stream state,
            ``embed(model, tokens, x)`` (None: the embeddings are the state).
        finish: turns the state after the last block into ``float32[B, T, n_embd]`` for the output norm,
            ``finish(model, state)`` (None: the state is that tensor).
    """

    read: Callable[[GGUFModel, str, int], Mapping[str, Any]]
    shapes: Callable[[HParams, set[str]], dict[str, tuple[int, ...]]]
    block: Callable[[GGUFCausalLM, Any, str], Any]
    embed: Callable[[GGUFCausalLM, torch.Tensor, torch.Tensor], Any] | None = None
    finish: Callable[[GGUFCausalLM, Any], torch.Tensor] | None = None


def uint_key(file: GGUFModel, name: str, default: int | None = None) -> int:
    """A family's non-negative integer key, ``default`` when the file has none (required when None), as the
    loaders' ``get_key(..., required)`` read them.

    Raises:
        MetadataKeyNotFoundError: a required key is missing.
        MetadataValueError: the value is not a non-negative integer.
    """
    field = file.kv.get(name)
    if field is None:
        if default is None:
            raise MetadataKeyNotFoundError(name, path=file.path, hint="the evaluator needs it")
        return default
    value = field.value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MetadataValueError(f"expected a non-negative integer, got {value!r}", key=name, path=file.path)
    return int(value)
