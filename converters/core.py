"""The conversion pipeline: plan from headers, then stream one tensor at a time into an atomic GGUF write.

1. ``config.json`` -> registry entry (by ``architectures[0]``) -> hyperparameter keys.
2. Safetensors headers / indexes -> a :class:`ConvertPlan`: every source tensor is mapped (name, transform,
   output type) or explicitly ignored, else :class:`~ggufkit.errors.TensorMappingError` names the leftovers.
3. Metadata (general.*, hparams, vocabulary, provenance), then :func:`ggufkit.format.write_gguf` pulls
   tensors from a generator: read (mmap), transform, convert, write, drop.
4. The output is reopened with ggufkit's reader and checked against the plan.
"""


from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggufkit.converters.plan import OUTTYPES, ConvertPlan, Source, build_plan, open_source
from ggufkit.converters.stream import tensor_stream
from ggufkit.errors import CheckFailedError, UsageError
from ggufkit.format.shards import shard_path
from ggufkit.format.values import PendingString
from ggufkit.format.writer import NullProgress, Progress, TensorSpec, alignment_of, plan_shards, write_gguf
from ggufkit.outputs import refuse_overwriting_inputs

__all__ = ["OUTTYPES", "ConvertPlan", "ConvertReport", "build_plan", "convert", "verify_output"]


@dataclass
class ConvertReport:
    """What :func:`convert` did."""

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


def convert(model: str | Path, output: str | Path | None = None, *, outtype: str = "auto",
            predictor: Path | None = None, vocab_only: bool = False, split_max_size: int | None = None,
            metadata_file: Path | None = None, pre_tokenizer: str | None = None, dry_run: bool = False,
            progress: Progress | None = None, with_mmproj: bool = False) -> ConvertReport:
    """Convert a Hugging Face checkpoint to GGUF (or a PowerInfer GGUF with ``predictor``).

    Args:
        model: checkpoint directory or hub repo id (resolved through the local cache; ``HF_HUB_OFFLINE``).
        output: output file, folder (a path ending in a separator names a folder, which must exist), or
            template (``{type}``, ``{TYPE}``, ``{ftype}``, ``{outtype}``: :mod:`ggufkit.outputs`); None: the
            hub naming convention ``{basename}-{size_label}-{FTYPE}.gguf`` in the model directory.
        outtype: one of :data:`OUTTYPES`; ``auto`` follows the checkpoint (bf16 -> bf16, else f16).
        predictor: PowerInfer predictor directory (``model_N.pt``), for ReLU LLaMA-family and OPT models.
        vocab_only: write metadata and vocabulary only.
        split_max_size: gguf-split shards of at most this many bytes.
        metadata_file: JSON of ``general.*`` keys overriding the derived ones.
        pre_tokenizer: force ``tokenizer.ggml.pre`` (BPE vocabularies).
        dry_run: plan only; nothing is written.
        progress: receives bytes written.
        with_mmproj: also write the vision projector beside the text model (``report.mmproj``), in
            ``outtype`` where llama.cpp writes projectors in it (f32, f16, bf16, q8_0), else ``auto``.

    Returns:
        A :class:`ConvertReport` with the plan and the written paths.

    Raises:
        UnsupportedArchitectureError: the HF class is not in registry.yaml.
        CheckpointError: config or weights missing, malformed or unsafe.
        TensorMappingError: source tensors no rule consumes, or required ones missing.
        TokenizerError: the vocabulary cannot be converted.
        UsageError: an output folder that does not exist, or an unknown placeholder in ``output``.
        OutputExistsError: an output is one of the files read (before anything is written).
        CheckFailedError: the written file does not match the plan.
    """
    start = time.perf_counter()
    src = open_source(model, vocab_only)
    try:
        plan = build_plan(src, outtype=outtype, predictor=predictor, vocab_only=vocab_only, output=output,
                          metadata_file=metadata_file, pre_tokenizer=pre_tokenizer)
        mm_plan = _mmproj_plan(src, plan, outtype) if with_mmproj else None
        assert plan.output is not None
        outputs = output_files(plan.output, plan, split_max_size)
        inputs = list(plan.inputs)
        if mm_plan is not None:
            assert mm_plan.output is not None
            outputs.append(mm_plan.output)
            inputs += mm_plan.inputs
        refuse_overwriting_inputs(outputs, inputs)
        if dry_run:
            report = ConvertReport(plan, [], time.perf_counter() - start, dry_run=True, model_dir=src.model_dir)
            if mm_plan is not None:
                report.mmproj = ConvertReport(mm_plan, [], 0.0, dry_run=True, model_dir=src.model_dir)
            return report
        report = write_plan(plan, src.model_dir, start, split_max_size=split_max_size, progress=progress)
        if mm_plan is not None:
            report.mmproj = write_plan(mm_plan, src.model_dir, time.perf_counter(), progress=progress)
        return report
    finally:
        if src.checkpoint is not None:
            src.checkpoint.close()


def _mmproj_plan(src: Source, plan: ConvertPlan, outtype: str) -> ConvertPlan:
    """The projector's plan for ``--with-mmproj``: beside the text model, in its outtype where llama.cpp writes
    projectors in it (a quantized text outtype leaves the projector at the checkpoint's precision)."""
    from ggufkit.converters.checkpoint import read_config
    from ggufkit.converters.mmproj import MMPROJ_OUTTYPES, build_mmproj_plan, projector_entry

    config = read_config(src.model_dir)
    projector_entry(config, src.model_dir)  # a checkpoint without a projector is refused before any write
    if src.checkpoint is None:
        raise UsageError("--with-mmproj does not combine with --vocab-only")
    assert plan.output is not None
    return build_mmproj_plan(src.model_dir, src.repo, config, src.checkpoint,
                             outtype=outtype if outtype in MMPROJ_OUTTYPES else "auto",
                             output=str(plan.output.parent) + os.sep)


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
