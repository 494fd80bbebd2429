"""Writing a conversion plan: its tensors streamed one at a time into an atomic GGUF write, the result re-read
and checked against the plan.

Text models (:func:`ggufkit.converters.core.convert`), vision projectors
(:func:`ggufkit.converters.mmproj.convert_mmproj`) and merged LoRAs (:func:`ggufkit.converters.lora.merge_lora`)
all end here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggufkit.converters.plan_types import ConvertPlan
from ggufkit.converters.stream import tensor_stream
from ggufkit.errors import CheckFailedError, UsageError
from ggufkit.format.shards import shard_path
from ggufkit.format.values import PendingString
from ggufkit.format.writer import NullProgress, Progress, TensorSpec, alignment_of, plan_shards, write_gguf

__all__ = ["ConvertReport", "output_files", "verify_output", "write_plan"]


@dataclass
class ConvertReport:
    """What a conversion did (:func:`ggufkit.converters.core.convert`, ``convert_mmproj``, ``merge_lora``)."""

    plan: ConvertPlan
    outputs: list[Path]
    seconds: float
    dry_run: bool = False
    check: dict[str, Any] | None = None
    model_dir: Path | None = None
    warnings: list[str] = field(default_factory=list)
    #: the vision projector written beside the text model (``with_mmproj``)
    mmproj: ConvertReport | None = None

    @property
    def file_size(self) -> int:
        """Bytes on disk of everything written (headers, padding and tensor data; all shards)."""
        return sum(p.stat().st_size for p in self.outputs)

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "ok": True, "dry_run": self.dry_run, "outputs": [str(p) for p in self.outputs],
            "file_size": self.file_size, "seconds": round(self.seconds, 3), "check": self.check,
            "warnings": self.warnings, **self.plan.as_dict()}
        if self.mmproj is not None:
            data["mmproj"] = self.mmproj.as_dict()
        return data


def verify_output(plan: ConvertPlan, paths: list[Path]) -> None:
    """Reopen the written file(s) with ggufkit's reader and compare with the plan.

    Raises:
        CheckFailedError: a tensor or key differs from the plan.
    """
    from ggufkit.format import open_gguf

    with open_gguf(paths[0]) as model:
        if model.magic != plan.magic:
            raise CheckFailedError(f"written magic {model.magic!r}, planned {plan.magic!r}", path=paths[0])
        got = [(t.name, t.ggml_type, t.shape) for t in model.tensors]
        want = [(e.name, e.ggml_type, e.shape) for e in plan.entries]
        if got != want:
            diff = next((w, g) for w, g in zip(want + [None] * len(got), got + [None] * len(want)) if w != g)
            raise CheckFailedError(f"written tensors differ from the plan: planned {diff[0]}, found {diff[1]}",
                                   path=paths[0])
        missing = [k for k in plan.metadata if k not in model.kv]
        if missing:
            raise CheckFailedError(f"metadata keys missing from the output: {missing[:5]}", path=paths[0])
        for key, value in plan.metadata.items():
            # a value computed while the tensors were written (the weight files' sha256) must be in the file,
            # not its placeholder
            if isinstance(value, PendingString) and model.get(key) != value.value:
                raise CheckFailedError(f"{key} was written as {str(model.get(key))[:20]!r}..., not its computed "
                                       "value", path=paths[0])


def output_files(path: Path, plan: ConvertPlan, split_max_size: int | None = None) -> list[Path]:
    """The files :func:`write_plan` will write for ``plan``: ``path``, or its gguf-split shards (the writer's own
    grouping, :func:`ggufkit.format.writer.plan_shards`)."""
    specs = [TensorSpec(e.name, e.ggml_type, e.shape) for e in plan.entries]
    groups = plan_shards(specs, alignment_of(plan.metadata), split_max_size, None)
    if len(groups) == 1:
        return [path]
    return [shard_path(path, i, len(groups)) for i in range(len(groups))]


def write_plan(plan: ConvertPlan, model_dir: Path, start: float, *, split_max_size: int | None = None,
               progress: Progress | None = None) -> ConvertReport:
    """Stream a plan's tensors into its output (atomically) and re-read the result against the plan."""
    assert plan.output is not None
    if not plan.output.parent.is_dir():
        raise UsageError(f"output directory {plan.output.parent} does not exist")
    specs = [TensorSpec(e.name, e.ggml_type, e.shape) for e in plan.entries]
    warnings: list[str] = []
    data = _then_computed_values(tensor_stream(plan, warnings), plan.metadata)
    paths = write_gguf(plan.output, plan.metadata, specs, data, magic=plan.magic,
                       split_max_size=split_max_size, progress=progress or NullProgress())
    verify_output(plan, paths)
    return ConvertReport(plan, paths, time.perf_counter() - start, model_dir=model_dir, warnings=warnings)


def _then_computed_values(tensors: Iterator[Any], metadata: Mapping[str, Any]) -> Iterator[Any]:
    """The tensors, then a wait for every value still being computed (:class:`PendingString`: the weight
    files' sha256, hashed in background threads while the tensors are written).

    ``write_gguf`` asks its data for one item past the last tensor, then rewrites the headers that hold a
    placeholder with the values known by then. A hash still running at that moment left its placeholder, 64
    zeros, in ``ggufkit.source.sha256`` (a bf16 -> bf16 copy writes faster than the files hash). Waiting here
    keeps the hash overlapping the writes and makes the rewrite see every value; a failed hash raises here,
    inside the atomic write, which then leaves nothing behind.
    """
    yield from tensors
    for value in metadata.values():
        if isinstance(value, PendingString):
            _ = value.value  # blocks until known; re-raises the hash's error
