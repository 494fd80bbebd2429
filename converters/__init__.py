"""Hugging Face checkpoints -> GGUF, driven by registry.yaml.

Public API:
    :func:`convert` converts a checkpoint directory or hub repo id (optionally merging PowerInfer predictors);
    :func:`list_architectures` lists the supported HF classes and their GGUF architectures.

Heavy modules (the pipeline, numpy, torch for .bin files) load on first use.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ggufkit.converters.outtypes import OUTTYPES

if TYPE_CHECKING:
    from ggufkit.converters.lora import LoraReport
    from ggufkit.converters.write import ConvertReport
    from ggufkit.format.writer import Progress

__all__ = ["OUTTYPES", "convert", "convert_lora", "convert_mmproj", "is_adapter_dir", "list_architectures",
           "merge_lora"]


def convert(model: str | Path, output: str | Path | None = None, *, outtype: str = "auto",
            predictor: Path | None = None, vocab_only: bool = False, split_max_size: int | None = None,
            metadata_file: Path | None = None, pre_tokenizer: str | None = None, dry_run: bool = False,
            progress: Progress | None = None, with_mmproj: bool = False, mtp: bool | None = None,
            fp8_as_q8: bool = False) -> ConvertReport:
    """Convert a Hugging Face checkpoint to GGUF; see :func:`ggufkit.converters.core.convert` (``mtp``: the
    multi-token-prediction layers as llama.cpp keeps them by default (None), alone as a draft model (True,
    ``--mtp``) or left out (False, ``--no-mtp``)).

    Example:
        >>> from ggufkit.converters import convert          # doctest: +SKIP
        >>> convert("./TinyLlama", "tiny-f16.gguf", outtype="f16").outputs
    """
    from ggufkit.converters.core import convert as _convert

    return _convert(model, output, outtype=outtype, predictor=predictor, vocab_only=vocab_only,
                    split_max_size=split_max_size, metadata_file=metadata_file, pre_tokenizer=pre_tokenizer,
                    dry_run=dry_run, progress=progress, with_mmproj=with_mmproj, mtp=mtp,
                    fp8_as_q8=fp8_as_q8)


def convert_mmproj(model: str | Path, output: str | Path | None = None, *, outtype: str = "auto",
                   dry_run: bool = False, progress: Progress | None = None) -> ConvertReport:
    """Write the vision projector file of a vision-language checkpoint; see
    :func:`ggufkit.converters.mmproj.convert_mmproj`.

    Example:
        >>> from ggufkit.converters import convert_mmproj          # doctest: +SKIP
        >>> convert_mmproj("./gemma-3-4b-it", outtype="f16").outputs   # [mmproj-gemma-3-4b-it-F16.gguf]
    """
    from ggufkit.converters.mmproj import convert_mmproj as _convert_mmproj

    report: ConvertReport = _convert_mmproj(model, output, outtype=outtype, dry_run=dry_run, progress=progress)
    return report


def list_architectures() -> list[dict[str, Any]]:
    """Supported HF classes: ``[{"hf_class", "arch", "vocab", "powerinfer", "mmproj"}]`` from registry.yaml
    (``mmproj``: the projector type ``--mmproj`` writes, or None)."""
    from ggufkit.converters.registry import load_registry

    return [{"hf_class": e.hf_class, "arch": e.arch, "vocab": list(e.vocab), "powerinfer": e.powerinfer,
             "mmproj": e.mmproj.projector_type if e.mmproj is not None else None}
            for e in load_registry().entries.values()]


def is_adapter_dir(path: str | Path) -> bool:
    """True when ``path`` is a PEFT adapter directory (it holds ``adapter_config.json``)."""
    return (Path(path) / "adapter_config.json").is_file()


def convert_lora(adapter: str | Path, output: str | Path | None = None, *, base: str | Path | None = None,
                 outtype: str = "f32", dry_run: bool = False, progress: Progress | None = None) -> LoraReport:
    """Convert a PEFT LoRA adapter to a GGUF adapter; see :func:`ggufkit.converters.lora.convert_lora`.

    Example:
        >>> from ggufkit.converters import convert_lora          # doctest: +SKIP
        >>> convert_lora("./my-adapter", base="llama-3.2-1b-f16.gguf", outtype="f16").output
    """
    from ggufkit.converters.lora import convert_lora as _convert_lora

    return _convert_lora(adapter, output, base=base, outtype=outtype, dry_run=dry_run, progress=progress)


def merge_lora(adapter: str | Path, output: str | Path | None = None, *, base: str | Path | None = None,
               outtype: str = "auto", dry_run: bool = False, progress: Progress | None = None) -> ConvertReport:
    """Write the base model with a PEFT LoRA merged in; see :func:`ggufkit.converters.lora.merge_lora`.

    Example:
        >>> from ggufkit.converters import merge_lora          # doctest: +SKIP
        >>> merge_lora("./dora-adapter", base="./Llama-3.2-1B", outtype="q8_0").outputs
    """
    from ggufkit.converters.lora import merge_lora as _merge_lora

    report: ConvertReport = _merge_lora(adapter, output, base=base, outtype=outtype, dry_run=dry_run,
                                        progress=progress)
    return report
