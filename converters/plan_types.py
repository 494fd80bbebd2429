"""What a conversion plan is made of: the opened checkpoint (:class:`Source`), one :class:`PlanEntry` per output
tensor and the whole :class:`ConvertPlan`.

The planners (:mod:`ggufkit.converters.plan`, :mod:`ggufkit.converters.mmproj`) build these from headers only;
metadata, the tensor stream and the writer read them. Data only: this module imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from ggufkit.constants import KEY_SLACK, POWERINFER_MAGIC
from ggufkit.converters.checkpoint import Checkpoint
from ggufkit.converters.pretokenizer import PreTokenizerMatch
from ggufkit.converters.registry import ArchEntry
from ggufkit.format.tensor_shape import n_elements
from ggufkit.format.values import VT, Metadata
from ggufkit.format.writer import TensorSpec


@dataclass
class Source:
    """An opened checkpoint: where it is, its config and registry entry, its tensors (None: vocab only)."""

    model_dir: Path
    repo: str | None
    revision: str | None
    config: dict[str, Any]
    entry: ArchEntry
    checkpoint: Checkpoint | None


@dataclass(frozen=True)
class PlanEntry:
    """One output tensor: where it comes from and what it becomes.

    Attributes:
        name: GGUF name.
        source: HF tensor name (or ``model_N.pt:fc1.weight`` for predictors, ``generated`` for computed ones).
        shape: output shape, numpy order.
        src_dtype: source dtype (``F32``, ``F16``, ``BF16``, ...).
        ggml_type: output type.
        transform: transform name, or None.
        reason: why this output type.
        kind: MODEL_TENSOR name (``ATTN_Q``) or ``""``.
    """

    name: str
    source: str
    shape: tuple[int, ...]
    src_dtype: str
    ggml_type: GGMLQuantizationType
    transform: str | None
    reason: str
    kind: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "shape": list(self.shape), "src_dtype": self.src_dtype,
                "type": self.ggml_type.name, "transform": self.transform, "reason": self.reason}


@dataclass
class ConvertPlan:
    """Everything that will be written, known before any tensor data is read."""

    hf_class: str
    arch: str
    outtype: str
    file_type: int
    magic: bytes
    metadata: Metadata
    entries: list[PlanEntry]
    ignored: list[str]
    output: Path | None
    loaders: dict[str, Callable[[], np.ndarray]] = field(default_factory=dict, repr=False)
    #: how tokenizer.ggml.pre was chosen (None for sentencepiece vocabularies)
    pre_tokenizer: PreTokenizerMatch | None = None
    #: every file the conversion reads (checkpoint, predictor, --metadata): no output may be one of them
    inputs: list[Path] = field(default_factory=list)
    #: GGUF tensors whose values a family hook computes from its source (split, fused, transposed, repacked),
    #: not the source read as it is with the entry's transform
    rewritten: frozenset[str] = frozenset()

    @property
    def n_params(self) -> int:
        return sum(n_elements(e.shape) for e in self.entries)

    @property
    def nbytes(self) -> int:
        return sum(TensorSpec(e.name, e.ggml_type, e.shape).nbytes for e in self.entries)

    def as_dict(self) -> dict[str, Any]:
        meta = {}
        for k, v in self.metadata.items():
            if k == KEY_SLACK:
                continue
            value = getattr(v, "value", None)
            if v.type == VT.ARRAY:
                value = {"array_length": len(value) if value is not None else None}
            meta[k] = value
        return {"hf_class": self.hf_class, "architecture": self.arch, "outtype": self.outtype,
                "file_type": self.file_type, "powerinfer": self.magic == POWERINFER_MAGIC,
                "output": str(self.output) if self.output else None, "n_tensors": len(self.entries),
                "n_params": self.n_params, "nbytes": self.nbytes, "metadata": meta,
                "tensors": [e.as_dict() for e in self.entries], "ignored": self.ignored,
                "pre_tokenizer": self.pre_tokenizer.as_dict() if self.pre_tokenizer else None}


__all__ = ["ConvertPlan", "PlanEntry", "Source"]
