"""PEFT LoRA adapters -> GGUF adapter files (llama.cpp ``--lora``), or merged into the base model.

The adapter file holds, per adapted base tensor ``W`` (GGUF name ``N``), ``N.lora_a`` = A ``[r, in]`` and
``N.lora_b`` = B ``[out, r]`` (token embeddings: A transposed, ``[vocab, r]``), and one ``adapter.lora.alpha``.
llama.cpp adds ``alpha / r * B @ A`` with ``r`` read from each tensor (llama-adapter.cpp:
``llama_adapter_lora_init_impl``; llama-graph.cpp: ``build_lora_mm``). PEFT's per-module scaling (rslora's
``alpha / sqrt(r)``, ``rank_pattern``, ``alpha_pattern``) is folded into B so that llama.cpp's single alpha
gives PEFT's result for every module; where PEFT's scaling already equals ``alpha / r`` the tensors pass through
byte for byte, as llama.cpp's ``convert_lora_to_gguf.py`` writes them.

What such a file cannot express (DoRA magnitudes, ``lora_bias``, ``modules_to_save``, resized embeddings) is
refused, pointing to :func:`merge_lora`, which writes the whole merged model instead.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, Keys

from ggufkit.converters.checkpoint import Checkpoint, checkpoint_inputs, resolve_model
from ggufkit.converters.lora_source import (
    AdapterTensors,
    LoraBase,
    LoraSettings,
    open_base,
    read_settings,
    sort_adapter_tensors,
)
from ggufkit.converters.outtypes import LORA_OUTTYPES
from ggufkit.converters.plan import build_plan, open_source
from ggufkit.converters.plan_types import ConvertPlan
from ggufkit.converters.stream import encode, to_float32
from ggufkit.converters.transforms import TRANSFORMS
from ggufkit.converters.write import ConvertReport, write_plan
from ggufkit.errors import CheckpointError, TensorMappingError, UsageError
from ggufkit.format.values import VT, Metadata
from ggufkit.format.writer import NullProgress, Progress, TensorSpec, write_gguf
from ggufkit.outputs import refuse_overwriting_inputs, resolve_output
from ggufkit.quant.llama_quantize.presets import PRESETS

Q = GGMLQuantizationType
G = Keys.General
__all__ = ["LoraReport", "convert_lora", "merge_lora"]


@dataclass
class LoraTensor:
    """One output tensor of the adapter file."""

    name: str
    source: str
    shape: tuple[int, ...]  # numpy order
    ggml_type: GGMLQuantizationType
    load: Callable[[], np.ndarray] = field(repr=False)
    src_dtype: str = "F32"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "shape": list(self.shape), "type": self.ggml_type.name}


@dataclass
class LoraReport:
    """What :func:`convert_lora` wrote (or would write)."""

    output: Path
    arch: str
    base: str
    alpha: float
    ranks: list[int]
    targets: list[str]
    tensors: list[LoraTensor]
    folded: list[str]
    seconds: float
    dry_run: bool = False
    nbytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"kind": "lora", "output": str(self.output), "architecture": self.arch, "base": self.base,
                "alpha": self.alpha, "ranks": sorted(set(self.ranks)), "targets": self.targets,
                "n_tensors": len(self.tensors), "scaling_folded_into_lora_b": self.folded,
                "tensors": [t.as_dict() for t in self.tensors], "nbytes": self.nbytes,
                "seconds": round(self.seconds, 3), "dry_run": self.dry_run}


def _resolve_outtype(outtype: str, first_dtype: str) -> str:
    # llama.cpp's ModelBase with LlamaFileType.GUESSED: the first tensor's dtype decides, f32 otherwise.
    if outtype not in LORA_OUTTYPES:
        raise UsageError(f"--outtype {outtype!r} is not available for adapters (choose from {', '.join(LORA_OUTTYPES)})")
    if outtype != "auto":
        return outtype
    return {"F16": "f16", "BF16": "bf16"}.get(first_dtype, "f32")


def _tensor_type(shape: tuple[int, ...], target: GGMLQuantizationType) -> GGMLQuantizationType:
    # convert_hf_to_gguf.py ModelBase.prepare_tensors: 1-D stays F32; Q8_0 needs whole 32-element rows,
    # otherwise F16.
    if len(shape) <= 1:
        return Q.F32
    if target == Q.Q8_0 and shape[-1] % 32:
        return Q.F16
    return target


def _unexpressible(ckpt: Checkpoint, tensors: AdapterTensors, base: LoraBase, settings: LoraSettings) -> list[str]:
    reasons = []
    dora = [m.module for m in tensors.modules.values() if m.magnitude]
    if dora or settings.use_dora:
        reasons.append(f"DoRA magnitudes ({', '.join(dora[:3]) or 'use_dora'})")
    bias = [m.module for m in tensors.modules.values() if m.bias]
    if bias:
        reasons.append(f"lora_bias ({', '.join(bias[:3])})")
    if tensors.replaced:
        reasons.append(f"modules_to_save ({', '.join(list(tensors.replaced)[:3])})")
    if settings.fan_in_fan_out:
        reasons.append("fan_in_fan_out (Conv1D) modules")
    for hf_weight, name in tensors.base_copies.items():
        gguf_name = base.gguf_name(hf_weight)[0]
        if base.shapes is not None and gguf_name in base.shapes:
            # PEFT saves the embedding beside an embedding LoRA; a different shape means added tokens.
            want, copy = base.shapes[gguf_name], ckpt.tensors[name].shape
            if copy != want:
                reasons.append(f"resized embeddings ({hf_weight}: {copy} vs the base's {want})")
    return reasons


def _plan_tensors(ckpt: Checkpoint, tensors: AdapterTensors, base: LoraBase, settings: LoraSettings,
                  target: GGMLQuantizationType) -> tuple[list[LoraTensor], list[int], list[str], list[str]]:
    out: list[LoraTensor] = []
    ranks, targets, folded = [], [], []
    for m in tensors.modules.values():
        assert m.a is not None and m.b is not None
        gguf_name, rule = base.gguf_name(m.hf_weight)
        if rule.transform not in (None, "permute_q", "permute_k"):
            raise TensorMappingError(f"{m.module}: a LoRA on a tensor that is {rule.transform}-transformed cannot "
                                     "be written as an adapter; use --merge")
        if gguf_name == "output.weight" and base.tied_output:
            raise UsageError(f"the adapter targets {m.module} but the base ties it to the token embedding, which "
                             "a GGUF adapter cannot hold apart; use --merge")
        a_st, b_st = ckpt.tensors[m.a], ckpt.tensors[m.b]
        r = a_st.shape[0]
        if len(a_st.shape) != 2 or len(b_st.shape) != 2 or b_st.shape[1] != r:
            raise CheckpointError(f"{m.module}: lora_A {a_st.shape} and lora_B {b_st.shape} do not pair",
                                  path=ckpt.model_dir)
        out_dim, in_dim = (a_st.shape[1], b_st.shape[0]) if m.embedding else (b_st.shape[0], a_st.shape[1])
        if base.shapes is not None:
            want = base.shapes.get(gguf_name)
            if want is None:
                raise TensorMappingError(f"the adapter targets {m.module} but the base has no {gguf_name}")
            if want != (out_dim, in_dim):
                raise TensorMappingError(f"{m.module}: the adapter is for a {out_dim}x{in_dim} weight but the "
                                         f"base's {gguf_name} is {'x'.join(map(str, want))}")
        scale = settings.scaling(m.module, r)
        factor = scale * r / settings.alpha
        if factor != 1.0:
            folded.append(m.module)
        ranks.append(r)
        targets.append(gguf_name)
        a_shape = (a_st.shape[1], r) if m.embedding else a_st.shape
        a_dtype = "F32" if m.embedding else a_st.dtype
        b_dtype = "F32" if factor != 1.0 else b_st.dtype
        out.append(LoraTensor(f"{gguf_name}.lora_a", m.a, a_shape, _tensor_type(a_shape, target),
                              _load_a(ckpt, m.a, m.embedding), a_dtype))
        out.append(LoraTensor(f"{gguf_name}.lora_b", m.b, b_st.shape, _tensor_type(b_st.shape, target),
                              _load_b(ckpt, m.b, rule.transform, base, factor), b_dtype))
    return out, ranks, targets, folded


def _load_a(ckpt: Checkpoint, name: str, embedding: bool) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        arr = ckpt.read(name)
        # llama.cpp's llm_build_inp_embd reads token_embd's lora_a transposed ([vocab, r] in numpy order).
        return np.ascontiguousarray(to_float32(arr, ckpt.tensors[name].dtype).T) if embedding else arr
    return load


def _load_b(ckpt: Checkpoint, name: str, transform: str | None, base: LoraBase,
            factor: float) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        arr = ckpt.read(name)
        if factor != 1.0:
            arr = (to_float32(arr, ckpt.tensors[name].dtype) * np.float32(factor)).astype(np.float32)
        # B's rows are W's rows, so the Q/K rope permutation of W applies to B (and A is untouched).
        return TRANSFORMS[transform](arr, base.heads) if transform else arr
    return load


def _metadata(base: LoraBase, settings: LoraSettings, name: str, file_type: int) -> Metadata:
    meta = Metadata()
    meta.set(G.ARCHITECTURE, VT.STRING, base.entry.arch)
    meta.set(G.TYPE, VT.STRING, "adapter")
    meta.set(Keys.Adapter.TYPE, VT.STRING, "lora")
    meta.set(G.NAME, VT.STRING, name)
    meta.set(G.BASE_MODEL_COUNT, VT.UINT32, 1)
    meta.set(G.BASE_MODEL_NAME.format(id=0), VT.STRING, base.name)
    if base.repo:  # only a hub id has an address; a local path gets none (llama.cpp's converter makes one up)
        org = base.repo.split("/")[0] if "/" in base.repo else None
        if org:
            meta.set(G.BASE_MODEL_ORGANIZATION.format(id=0), VT.STRING, org)
        meta.set(G.BASE_MODEL_REPO_URL.format(id=0), VT.STRING, f"https://huggingface.co/{base.repo}")
    meta.set(G.FILE_TYPE, VT.UINT32, file_type)
    meta.set(Keys.Adapter.LORA_ALPHA, VT.FLOAT32, settings.alpha)
    meta.set(G.QUANTIZATION_VERSION, VT.UINT32, 2)
    return meta


def _output_path(output: str | Path | None, adapter_dir: Path, basename: str, label: str) -> Path:
    """``-o`` as every command reads it (:func:`ggufkit.outputs.resolve_output`), or
    ``{basename}-{FTYPE}-LoRA.gguf`` in the adapter directory."""
    return resolve_output(output, f"{basename}-{label}-LoRA.gguf", adapter_dir, type_name=label)


def convert_lora(adapter: str | Path, output: str | Path | None = None, *, base: str | Path | None = None,
                 outtype: str = "f32", dry_run: bool = False, progress: Progress | None = None) -> LoraReport:
    """Convert a PEFT LoRA adapter to a GGUF adapter that llama.cpp applies with ``--lora``.

    Args:
        adapter: the adapter directory (``adapter_config.json``) or a cached hub id.
        output: output file, directory or template with ``{ftype}``; None: ``{name}-{FTYPE}-LoRA.gguf`` in
            the adapter directory.
        base: base checkpoint directory, cached hub id or the base's GGUF; None: the adapter's
            ``base_model_name_or_path`` where it resolves locally.
        outtype: ``f32`` (default, as llama.cpp's converter), ``f16``, ``bf16``, ``q8_0`` or ``auto``.
        dry_run: plan only.
        progress: receives bytes written.

    Returns:
        A :class:`LoraReport`.

    Raises:
        UsageError: the adapter holds what a GGUF adapter cannot express (use :func:`merge_lora`), or the
            base cannot be found.
        TensorMappingError: the adapter targets tensors the base lacks or has in another shape.
        CheckpointError: the adapter is unreadable or malformed.
    """
    start = time.perf_counter()
    adapter_dir, _, _ = resolve_model(adapter)
    settings = read_settings(adapter_dir)
    ckpt = Checkpoint(adapter_dir)
    try:
        tensors = sort_adapter_tensors(ckpt)
        if not tensors.modules and not tensors.replaced:
            raise CheckpointError("the adapter holds no LoRA tensors", path=adapter_dir)
        lora_base = open_base(base, settings, adapter_dir)
        reasons = _unexpressible(ckpt, tensors, lora_base, settings)
        if reasons:
            raise UsageError(f"a GGUF LoRA adapter cannot express {'; '.join(reasons)}: use --merge to write "
                             "the merged model instead")
        first = ckpt.tensors[next(iter(tensors.modules.values())).a or ""].dtype
        resolved = _resolve_outtype(outtype, first)
        planned, ranks, targets, folded = _plan_tensors(ckpt, tensors, lora_base, settings,
                                                        PRESETS[resolved].default_type)
        file_type = int(PRESETS[resolved].file_type)
        out = _output_path(output, adapter_dir, adapter_dir.name, resolved.upper())
        refuse_overwriting_inputs([out], checkpoint_inputs(adapter_dir, ckpt.files) + _base_inputs(lora_base))
        specs = [TensorSpec(t.name, t.ggml_type, t.shape) for t in planned]
        report = LoraReport(out, lora_base.entry.arch, lora_base.name, settings.alpha, ranks, targets, planned,
                            folded, 0.0, dry_run, sum(s.nbytes for s in specs))
        if dry_run:
            report.seconds = time.perf_counter() - start
            return report
        if not out.parent.is_dir():
            raise UsageError(f"output directory {out.parent} does not exist")
        meta = _metadata(lora_base, settings, adapter_dir.name, file_type)
        write_gguf(out, meta, specs, _stream(planned), progress=progress or NullProgress())
        report.nbytes = out.stat().st_size
        report.seconds = time.perf_counter() - start
        return report
    finally:
        ckpt.close()


def _base_inputs(base: LoraBase) -> list[Path]:
    """The base's files the conversion reads: its GGUF, or its checkpoint's files."""
    if base.path.is_file():
        return [base.path]
    return checkpoint_inputs(base.path) if base.path.is_dir() else []


def _stream(planned: list[LoraTensor]) -> Iterator[np.ndarray]:
    for t in planned:
        yield encode(t.load(), t.src_dtype, t.ggml_type)


def merge_lora(adapter: str | Path, output: str | Path | None = None, *, base: str | Path | None = None,
               outtype: str = "auto", dry_run: bool = False, progress: Progress | None = None) -> ConvertReport:
    """Write the base model with the adapter merged in (any PEFT LoRA: plain, rslora, patterns, DoRA,
    ``modules_to_save``), at any outtype or quantization type, in one pass: what ``llama-export-lora``
    does for plain LoRA, for every kind.

    Args:
        adapter: the adapter directory or a cached hub id.
        output: as :func:`ggufkit.converters.convert`.
        base: the base checkpoint directory or cached hub id (its weights are needed); None: the adapter's
            ``base_model_name_or_path``.
        outtype: as :func:`ggufkit.converters.convert`.
        dry_run: plan only.
        progress: receives bytes written.

    Returns:
        The :class:`~ggufkit.converters.write.ConvertReport` of the merged model.

    Raises:
        UsageError: ``base`` is a GGUF file (merging needs the checkpoint's weights) or cannot be found.
    """
    adapter_dir, _, _ = resolve_model(adapter)
    settings = read_settings(adapter_dir)
    if base is not None and Path(base).is_file():
        raise UsageError("--merge needs the base checkpoint (its weights), not a GGUF file")
    lora_base = open_base(base, settings, adapter_dir)
    assert lora_base.config_dir is not None
    start = time.perf_counter()
    src = open_source(lora_base.config_dir, False)
    ckpt = Checkpoint(adapter_dir)
    try:
        tensors = sort_adapter_tensors(ckpt)
        if settings.fan_in_fan_out:
            raise UsageError("fan_in_fan_out (Conv1D) adapters are not supported")
        plan = build_plan(src, outtype=outtype, predictor=None, vocab_only=False, output=output,
                          metadata_file=None, pre_tokenizer=None)
        assert plan.output is not None
        refuse_overwriting_inputs([plan.output], plan.inputs + checkpoint_inputs(adapter_dir, ckpt.files))
        merged = _merge_loaders(plan, src.checkpoint, ckpt, tensors, settings, lora_base)
        plan.entries = [dataclasses.replace(e, src_dtype="F32") if e.source in merged else e
                        for e in plan.entries]
        if dry_run:
            return ConvertReport(plan, [], time.perf_counter() - start, dry_run=True, model_dir=src.model_dir)
        return write_plan(plan, src.model_dir, start, progress=progress)
    finally:
        ckpt.close()
        if src.checkpoint is not None:
            src.checkpoint.close()


def _merge_loaders(plan: ConvertPlan, base_ckpt: Checkpoint | None, ckpt: Checkpoint, tensors: AdapterTensors,
                   settings: LoraSettings, base: LoraBase) -> set[str]:
    """Replace the loaders of adapted tensors by base + delta (float32, HF layout, then the entry's transform)."""
    assert base_ckpt is not None
    by_source: dict[str, list[Any]] = {}
    for e in plan.entries:
        by_source.setdefault(e.source, []).append(e)
    merged: set[str] = set()
    for m in tensors.modules.values():
        bias_name = f"{m.module}.bias"
        for hf in ([m.hf_weight] if m.a else []) + ([bias_name] if m.bias else []):
            if hf not in by_source:
                raise TensorMappingError(f"the adapter changes {hf}, which the base checkpoint does not have")
        if m.a:
            _set_loaders(plan, by_source[m.hf_weight], base, _delta_weight(base_ckpt, ckpt, m, settings))
            merged.add(m.hf_weight)
        if m.bias:
            _set_loaders(plan, by_source[bias_name], base, _delta_bias(base_ckpt, ckpt, m, settings))
            merged.add(bias_name)
    for hf, name in tensors.replaced.items():
        if hf not in by_source:
            raise TensorMappingError(f"modules_to_save holds {hf}, which the base checkpoint does not have")
        if base_ckpt.tensors[hf].shape != ckpt.tensors[name].shape:
            raise TensorMappingError(f"modules_to_save {hf}: shape {ckpt.tensors[name].shape} differs from the "
                                     f"base's {base_ckpt.tensors[hf].shape} (resized embeddings are not supported)")
        _set_loaders(plan, by_source[hf], base, _replacement(ckpt, name))
        merged.add(hf)
    return merged


def _set_loaders(plan: Any, entries: list[Any], base: LoraBase, compute: Callable[[], np.ndarray]) -> None:
    for e in entries:
        transform = e.transform
        plan.loaders[e.name] = (lambda t=transform: TRANSFORMS[t](compute(), base.heads) if t else compute())


def _replacement(ckpt: Checkpoint, name: str) -> Callable[[], np.ndarray]:
    return lambda: _f32(ckpt, name)


def _f32(ckpt: Checkpoint, name: str) -> np.ndarray:
    return np.asarray(to_float32(ckpt.read(name), ckpt.tensors[name].dtype), dtype=np.float32)


def _delta_weight(base_ckpt: Checkpoint, ckpt: Checkpoint, m: Any, settings: LoraSettings) -> Callable[[], np.ndarray]:
    def compute() -> np.ndarray:
        w = _f32(base_ckpt, m.hf_weight)
        a, b = _f32(ckpt, m.a), _f32(ckpt, m.b)
        scale = settings.scaling(m.module, a.shape[0])
        delta = (b @ a).astype(np.float32) * np.float32(scale)
        merged = w + (delta.T if m.embedding else delta)
        if m.magnitude:
            # peft DoRA (tuners/lora/dora.py): W' = m / ||W + s*BA||_row * (W + s*BA)
            norm = np.linalg.norm(merged, axis=1).astype(np.float32)
            merged = merged * (_f32(ckpt, m.magnitude) / norm)[:, None]
        return np.ascontiguousarray(merged, dtype=np.float32)
    return compute


def _delta_bias(base_ckpt: Checkpoint, ckpt: Checkpoint, m: Any, settings: LoraSettings) -> Callable[[], np.ndarray]:
    def compute() -> np.ndarray:
        scale = settings.scaling(m.module, ckpt.tensors[m.a].shape[0])
        return (_f32(base_ckpt, f"{m.module}.bias") + _f32(ckpt, m.bias) * np.float32(scale)).astype(np.float32)
    return compute

