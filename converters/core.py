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
from pathlib import Path

from ggufkit.converters.checkpoint import read_config
from ggufkit.converters.mmproj import MMPROJ_OUTTYPES, build_mmproj_plan, projector_entry
from ggufkit.converters.plan import build_plan, open_source
from ggufkit.converters.plan_types import ConvertPlan, Source
from ggufkit.converters.quantized_source import fp8_as_q8 as fp8_q8_entries
from ggufkit.converters.write import ConvertReport, output_files, write_plan
from ggufkit.errors import UsageError
from ggufkit.format.writer import Progress
from ggufkit.outputs import refuse_overwriting_inputs

__all__ = ["convert"]


def convert(model: str | Path, output: str | Path | None = None, *, outtype: str = "auto",
            predictor: Path | None = None, vocab_only: bool = False, split_max_size: int | None = None,
            metadata_file: Path | None = None, pre_tokenizer: str | None = None, dry_run: bool = False,
            progress: Progress | None = None, with_mmproj: bool = False, mtp: bool | None = None,
            fp8_as_q8: bool = False) -> ConvertReport:
    """Convert a Hugging Face checkpoint to GGUF (or a PowerInfer GGUF with ``predictor``).

    Args:
        model: checkpoint directory or hub repo id (resolved through the local cache; ``HF_HUB_OFFLINE``).
        output: output file, folder (a path ending in a separator names a folder, which must exist), or
            template (``{type}``, ``{TYPE}``, ``{ftype}``, ``{outtype}``: :mod:`ggufkit.outputs`); None: the
            hub naming convention ``{basename}-{size_label}-{FTYPE}.gguf`` in the model directory.
        outtype: one of :data:`ggufkit.converters.outtypes.OUTTYPES`; ``auto`` follows the checkpoint (bf16 -> bf16, else f16).
        predictor: PowerInfer predictor directory (``model_N.pt``), for ReLU LLaMA-family and OPT models.
        vocab_only: write metadata and vocabulary only.
        split_max_size: gguf-split shards of at most this many bytes.
        metadata_file: JSON of ``general.*`` keys overriding the derived ones.
        pre_tokenizer: force ``tokenizer.ggml.pre`` (BPE vocabularies).
        dry_run: plan only; nothing is written.
        progress: receives bytes written.
        with_mmproj: also write the vision projector beside the text model (``report.mmproj``), in
            ``outtype`` where llama.cpp writes projectors in it (f32, f16, bf16, q8_0), else ``auto``.
        mtp: multi-token-prediction layers (:mod:`ggufkit.converters.mtp`): None keeps them where llama.cpp's
            converter does (extra blocks, ``nextn_predict_layers``); True writes only them and the shared
            embeddings / output norm / head (``--mtp``: a draft model, ``mtp-`` before the default name);
            False leaves them out (``--no-mtp``).
        fp8_as_q8: write the weights of an FP8 source as Q8_0, the rest in ``outtype`` (f32, f16, bf16,
            q8_0), as llama.cpp's converter ``--fp8-as-q8``.

    Returns:
        A :class:`ConvertReport` with the plan and the written paths.

    Raises:
        UnsupportedArchitectureError: the HF class is not in registry.yaml.
        CheckpointError: config or weights missing, malformed or unsafe.
        TensorMappingError: source tensors no rule consumes, or required ones missing.
        TokenizerError: the vocabulary cannot be converted.
        UsageError: an output folder that does not exist, or an unknown placeholder in ``output``; ``mtp``
            not None for a class without multi-token-prediction layers, True for a checkpoint without them.
        OutputExistsError: an output is one of the files read (before anything is written).
        CheckFailedError: the written file does not match the plan.
    """
    start = time.perf_counter()
    src = open_source(model, vocab_only)
    try:
        plan = build_plan(src, outtype=outtype, predictor=predictor, vocab_only=vocab_only, output=output,
                          metadata_file=metadata_file, pre_tokenizer=pre_tokenizer, mtp=mtp)
        if fp8_as_q8:
            plan.entries = fp8_q8_entries(plan.entries, src.checkpoint, plan.outtype)
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
    config = read_config(src.model_dir)
    projector_entry(config, src.model_dir)  # a checkpoint without a projector is refused before any write
    if src.checkpoint is None:
        raise UsageError("--with-mmproj does not combine with --vocab-only")
    assert plan.output is not None
    return build_mmproj_plan(src.model_dir, src.repo, config, src.checkpoint,
                             outtype=outtype if outtype in MMPROJ_OUTTYPES else "auto",
                             output=str(plan.output.parent) + os.sep)


