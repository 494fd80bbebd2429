"""The conversion pipeline: plan from headers, then stream one tensor at a time into an atomic GGUF write.

1. ``config.json`` -> registry entry (by ``architectures[0]``) -> hyperparameter keys.
2. Safetensors headers / indexes -> a :class:`ConvertPlan`: every source tensor is mapped (name, transform,
   output type) or explicitly ignored, else :class:`~ggufkit.errors.TensorMappingError` names the leftovers.
3. Metadata (general.*, hparams, vocabulary, provenance), then :func:`ggufkit.format.write_gguf` pulls
   tensors from a generator: read (mmap), transform, convert, write, drop.
4. The output is reopened with ggufkit's reader and checked against the plan.
"""


from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ggufkit.converters.plan import OUTTYPES, ConvertPlan, build_plan, open_source
from ggufkit.converters.stream import tensor_stream
from ggufkit.errors import CheckFailedError, UsageError
from ggufkit.format.writer import NullProgress, Progress, TensorSpec, write_gguf

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

    @property
    def file_size(self) -> int:
        """Bytes on disk of everything written (headers, padding and tensor data; all shards)."""
        return sum(p.stat().st_size for p in self.outputs)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": True, "dry_run": self.dry_run, "outputs": [str(p) for p in self.outputs],
                "file_size": self.file_size, "seconds": round(self.seconds, 3), "check": self.check,
                "warnings": self.warnings, **self.plan.as_dict()}



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


def convert(model: str | Path, output: str | Path | None = None, *, outtype: str = "auto",
            predictor: Path | None = None, vocab_only: bool = False, split_max_size: int | None = None,
            metadata_file: Path | None = None, pre_tokenizer: str | None = None, dry_run: bool = False,
            progress: Progress | None = None) -> ConvertReport:
    """Convert a Hugging Face checkpoint to GGUF (or a PowerInfer GGUF with ``predictor``).

    Args:
        model: checkpoint directory or hub repo id (resolved through the local cache; ``HF_HUB_OFFLINE``).
        output: output file, directory, or template with ``{ftype}``; None: the hub naming convention
            ``{basename}-{size_label}-{FTYPE}.gguf`` in the model directory.
        outtype: one of :data:`OUTTYPES`; ``auto`` follows the checkpoint (bf16 -> bf16, else f16).
        predictor: PowerInfer predictor directory (``model_N.pt``), for ReLU LLaMA-family and OPT models.
        vocab_only: write metadata and vocabulary only.
        split_max_size: gguf-split shards of at most this many bytes.
        metadata_file: JSON of ``general.*`` keys overriding the derived ones.
        pre_tokenizer: force ``tokenizer.ggml.pre`` (BPE vocabularies).
        dry_run: plan only; nothing is written.
        progress: receives bytes written.

    Returns:
        A :class:`ConvertReport` with the plan and the written paths.

    Raises:
        UnsupportedArchitectureError: the HF class is not in registry.yaml.
        CheckpointError: config or weights missing, malformed or unsafe.
        TensorMappingError: source tensors no rule consumes, or required ones missing.
        TokenizerError: the vocabulary cannot be converted.
        CheckFailedError: the written file does not match the plan.
    """
    start = time.perf_counter()
    src = open_source(model, vocab_only)
    try:
        plan = build_plan(src, outtype=outtype, predictor=predictor, vocab_only=vocab_only, output=output,
                          metadata_file=metadata_file, pre_tokenizer=pre_tokenizer)
        if dry_run:
            return ConvertReport(plan, [], time.perf_counter() - start, dry_run=True, model_dir=src.model_dir)
        return write_plan(plan, src.model_dir, start, split_max_size=split_max_size, progress=progress)
    finally:
        if src.checkpoint is not None:
            src.checkpoint.close()


def write_plan(plan: ConvertPlan, model_dir: Path, start: float, *, split_max_size: int | None = None,
               progress: Progress | None = None) -> ConvertReport:
    """Stream a plan's tensors into its output (atomically) and re-read the result against the plan."""
    assert plan.output is not None
    if not plan.output.parent.is_dir():
        raise UsageError(f"output directory {plan.output.parent} does not exist")
    specs = [TensorSpec(e.name, e.ggml_type, e.shape) for e in plan.entries]
    warnings: list[str] = []
    paths = write_gguf(plan.output, plan.metadata, specs, tensor_stream(plan, warnings), magic=plan.magic,
                       split_max_size=split_max_size, progress=progress or NullProgress())
    verify_output(plan, paths)
    return ConvertReport(plan, paths, time.perf_counter() - start, model_dir=model_dir, warnings=warnings)
