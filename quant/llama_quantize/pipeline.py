"""``quantize_file``: a GGUF file in, a quantized GGUF file out, byte-identical to ``llama_model_quantize``.

The plan is computed first (:func:`ggufkit.quant.llama_quantize.plan.plan_quantization`), so every refusal (a quantized
input without ``allow_requantize``, a fallback with ``no_fallback``, an imatrix of the wrong size) happens
before anything is written. Tensors then stream one at a time from the input (read with ``pread``, slab by
slab, into one reused buffer), through the kernels, into :func:`ggufkit.format.write_gguf` (atomic).
Peak memory is the largest output tensor plus one input slab and its f32 copy, not the model: a
104M-weight model adds about 25 MiB to the process.

Metadata is what llama-quantize writes: the input's KV pairs in order (``split.*`` removed), then
``general.quantization_version`` and ``general.file_type`` re-appended at the end, then (with an imatrix)
the ``quantize.imatrix.*`` keys, followed by ggufkit's provenance keys and the writer's slack.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, Keys

from ggufkit import __version__
from ggufkit.constants import KEY_IMATRIX_SHA256, KEY_QUANT_RECIPE, KEY_TOOL_VERSION
from ggufkit.errors import GGUFKitError, QuantizationError, UsageError
from ggufkit.format.reader import GGUFModel, TensorInfo
from ggufkit.format.shards import SPLIT_KEYS
from ggufkit.format.values import VT, Metadata
from ggufkit.format.writer import Progress, TensorSpec
from ggufkit.outputs import refuse_overwriting_inputs
from ggufkit.quant.dispatch import SLAB_ELEMENTS
from ggufkit.quant.imatrix.reader import (
    KEY_QUANTIZE_IMATRIX_DATASET,
    KEY_QUANTIZE_IMATRIX_FILE,
    KEY_QUANTIZE_IMATRIX_N_CHUNKS,
    KEY_QUANTIZE_IMATRIX_N_ENTRIES,
    Imatrix,
)
from ggufkit.quant.llama_quantize.options import (
    KVOverride,
    filter_imatrix,
    parse_kv_override,
    parse_prune_layers,
    parse_tensor_type_option,
    read_tensor_type_file,
)
from ggufkit.quant.llama_quantize.plan import (
    QUANTIZATION_VERSION,
    PlanEntry,
    QuantOptions,
    QuantPlan,
    plan_quantization,
    refuse_missing_imatrix,
)
from ggufkit.quant.llama_quantize.plan_powerinfer import plan_powerinfer, sparse_ffn_warnings
from ggufkit.quant.llama_quantize.presets import PresetChoice, parse_type
from ggufkit.quant.registry import FLOAT_TYPES, TYPES

QT = GGMLQuantizationType

#: llama-quantize truncates string KV overrides to 127 characters (llama_model_kv_override::val_str).
_MAX_KV_STR = 127


@dataclass(frozen=True)
class QuantReport:
    """What :func:`quantize_file` did (or, with ``dry_run``, would do).

    Attributes:
        input: the input path.
        output: the path written, or None for a dry run.
        plan: the per-tensor plan, in output order.
        dry_run: nothing was written.
        seconds: wall time of the whole call.
        warnings: things a user should know (imatrix entries missing for quantized tensors, ...).
        imatrix: the imatrix file used, if any.
        outputs: every file written (one, or the shards with ``keep_split``).
    """

    input: Path
    output: Path | None
    plan: QuantPlan
    dry_run: bool
    seconds: float
    warnings: tuple[str, ...] = field(default_factory=tuple)
    imatrix: Path | None = None
    outputs: tuple[Path, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"input": str(self.input), "output": str(self.output) if self.output else None,
                "outputs": [str(p) for p in self.outputs],
                "dry_run": self.dry_run, "seconds": round(self.seconds, 3), "warnings": list(self.warnings),
                "imatrix": str(self.imatrix) if self.imatrix else None,
                "fallback_summary": self.plan.fallback_summary(), **self.plan.to_dict()}


def quantize_file(input: str | Path, output: str | Path | None, target: str | PresetChoice, *, pure: bool = False,
                  imatrix: str | Path | Imatrix | None = None,
                  tensor_types: Sequence[str | tuple[str, str | GGMLQuantizationType]] = (),
                  output_tensor_type: str | GGMLQuantizationType | None = None,
                  token_embedding_type: str | GGMLQuantizationType | None = None,
                  leave_output_tensor: bool = False, allow_requantize: bool = False, no_fallback: bool = False,
                  threads: int | None = None, device: str = "auto", dry_run: bool = False,
                  progress: Progress | None = None, include_weights: Sequence[str] = (),
                  exclude_weights: Sequence[str] = (), tensor_type_file: str | Path | None = None,
                  prune_layers: str | Sequence[int] = (), keep_split: bool = False,
                  override_kv: Sequence[str] = ()) -> QuantReport:
    """Quantize a GGUF model file as ``llama-quantize [options] INPUT OUTPUT TARGET`` would.

    Args:
        input: F32/F16/BF16 GGUF file (or any shard of a gguf-split set).
        output: the file to write (atomically); may be None with ``dry_run``.
        target: a ``QUANT_OPTIONS`` name of llama-quantize (``ggufkit.quant.llama_quantize.presets.TYPE_CHOICES``,
            case-insensitive; ``q4_k`` = ``q4_k_m``) or a numeric file type id, or one already parsed
            (:class:`~ggufkit.quant.llama_quantize.presets.PresetChoice`). A PowerInfer (PWRI) input is planned
            by PowerInfer's ``quantize`` rules and names (:mod:`~ggufkit.quant.llama_quantize.plan_powerinfer`).
        pure: no mixture rules: every quantizable tensor gets the default type (fallbacks still apply).
        imatrix: a llama-imatrix file (GGUF or legacy ``.dat``) or an already loaded :class:`Imatrix`.
        tensor_types: ``PATTERN=TYPE`` overrides; the first regular expression found in a name wins.
        output_tensor_type: type for ``output.weight``.
        token_embedding_type: type for ``token_embd.weight``.
        leave_output_tensor: copy ``output.weight`` unchanged.
        allow_requantize: accept quantized input tensors (dequantized exactly, then quantized again).
        no_fallback: make any divisibility fallback an error instead of a reported substitution.
        threads: CPU threads for the kernels (default: all). Output bytes do not depend on it.
        device: ``auto``, ``cpu`` or ``cuda``. Output bytes do not depend on it.
        dry_run: compute and return the plan, write nothing.
        progress: receives the bytes written.
        include_weights: use imatrix entries only for tensors whose name contains one of these.
        exclude_weights: drop imatrix entries for tensors whose name contains one of these.
        tensor_type_file: more ``PATTERN=TYPE`` overrides, separated by white space, after ``tensor_types``.
        prune_layers: layers to drop (``"0,3"`` or ints); later layers are renumbered.
        keep_split: write one output shard per input shard, tensors in the input's order.
        override_kv: ``KEY=TYPE:VALUE`` (TYPE int, float, bool or str) written into the output.

    Returns:
        A :class:`QuantReport` with the plan, totals and warnings.

    Raises:
        UsageError: unknown target or type, bad ``--tensor-type``, no output, output == input.
        QuantizationError: see :func:`~ggufkit.quant.llama_quantize.plan.plan_quantization`; NaN/inf data (naming the tensor).
        GGUFFormatError: the input (or a GGUF imatrix) is malformed.
    """
    from ggufkit.format import open_gguf, write_gguf
    from ggufkit.quant.imatrix.reader import load_imatrix

    start = time.perf_counter()
    input = Path(input)
    out_path = Path(output) if output is not None else None
    if out_path is None and not dry_run:
        raise UsageError("an output path is required (or use --dry-run)")
    imatrix_path = imatrix if isinstance(imatrix, (str, Path)) else None
    if out_path is not None and not dry_run:  # before any work: the input's shards are checked once open
        refuse_overwriting_inputs([out_path], [input, imatrix_path, tensor_type_file])
    if include_weights and exclude_weights:
        raise UsageError("--include-weights and --exclude-weights cannot be used together")
    overrides = tuple(parse_kv_override(o) for o in override_kv)
    tt_all = [*tensor_types, *(read_tensor_type_file(tensor_type_file) if tensor_type_file is not None else ())]
    tt = tuple(parse_tensor_type_option(o) for o in tt_all)
    prune = parse_prune_layers(prune_layers) if prune_layers else ()
    im = load_imatrix(imatrix) if isinstance(imatrix, (str, Path)) else imatrix
    if im is not None and (include_weights or exclude_weights):
        im = filter_imatrix(im, include_weights, exclude_weights)
    options = QuantOptions(
        pure=pure,
        tensor_types=tt,
        output_tensor_type=None if output_tensor_type is None else parse_type(output_tensor_type,
                                                                               "--output-tensor-type"),
        token_embedding_type=None if token_embedding_type is None else parse_type(token_embedding_type,
                                                                                   "--token-embedding-type"),
        leave_output_tensor=leave_output_tensor, allow_requantize=allow_requantize, no_fallback=no_fallback,
        # llama-quantize passes no imatrix at all when the file has no entries left.
        imatrix_sizes=im.sizes() if im is not None and im.entries else None,
        prune_layers=prune, keep_split=keep_split, dry_run=dry_run,
    )
    with open_gguf(input) as model:
        if out_path is not None and not dry_run:
            refuse_overwriting_inputs(_output_paths(out_path, len(model.files), keep_split),
                                      [*(f.path for f in model.files), imatrix_path, tensor_type_file])
        arch = model.architecture or ""
        # llama_model_loader reads the hparams the rules use (all integers) through the overrides; an override
        # of another kind only warns there and the file's value stays.
        hparams = {**model.kv, **{o.key: o.value for o in overrides if o.vtype == VT.UINT32}}
        if model.is_powerinfer:  # PowerInfer's own quantize rules and type names, tensors in file order
            word = target.word if isinstance(target, PresetChoice) else target
            plan = plan_powerinfer(model.tensors, word, arch=arch, metadata=hparams, options=options)
        else:
            plan = plan_quantization(model.tensors, target, arch=arch, metadata=hparams, options=options)
        warnings = missing_imatrix_warnings(plan)
        need = plan.imatrix_required()
        if need:  # one line: a dry run of IQ2_XXS would otherwise print one per tensor
            warnings.append(f"{len(need)} tensors need an importance matrix, first {need[0].name!r} "
                            f"({need[0].dst_type.name}): a real run refuses them")
        if model.is_powerinfer:
            warnings += sparse_ffn_warnings(plan)
        dev = _device_or_none(device, dry_run)
        if plan.cpu_only_types() and device == "cuda":  # asked for: under auto it is no news
            warnings.append(f"{', '.join(t.name for t in plan.cpu_only_types())} have no CUDA kernel: "
                            "quantized on the CPU")
        if dry_run:
            return QuantReport(input, None, plan, True, time.perf_counter() - start, tuple(warnings),
                               im.path if im is not None else None)
        refuse_unrunnable(plan)
        if out_path is None or dev is None:  # unreachable: checked above; keeps the type checker informed
            raise UsageError("an output path is required (or use --dry-run)")
        metadata = _output_metadata(model, plan, im if options.imatrix_sizes is not None else None, options,
                                    overrides)
        specs = [TensorSpec(e.name, e.dst_type, e.shape) for e in plan.entries]
        data = _stream(model, plan, im if options.imatrix_sizes is not None else None, threads, dev)
        shard_of = None
        if keep_split:
            shard_of = [e.shard for e in plan.entries]
            if len(model.files) == 1:  # llama-quantize still names the single output as shard 1 of 1
                from ggufkit.format.shards import shard_path

                out_path = shard_path(out_path, 0, 1)
        outputs = write_gguf(out_path, metadata, specs, data, magic=model.magic, progress=progress,
                             shard_of=shard_of)
    return QuantReport(input, out_path, plan, False, time.perf_counter() - start, tuple(warnings),
                       im.path if im is not None else None, tuple(outputs))


def missing_imatrix_warnings(plan: QuantPlan) -> list[str]:
    """One line for the tensors quantized without imatrix data because the imatrix has no entry for them
    (llama-imatrix collects no token_embd; llama-quantize goes on without one), or none. Tensors that
    cannot be written without one are left out: the run refuses them instead."""
    names = [e.name for e in plan.entries if e.imatrix == "missing" and not e.aborts_without_imatrix]
    if not names:
        return []
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return [f"no imatrix entry for tensor{'s' if len(names) > 1 else ''} {shown}: quantized without one "
            "(as llama-quantize does)"]


def _output_paths(out_path: Path, n_files: int, keep_split: bool) -> list[Path]:
    """Every file a real run writes: ``out_path``, or under ``keep_split`` one shard per input file."""
    if not keep_split:
        return [out_path]
    from ggufkit.format.shards import shard_path

    return [shard_path(out_path, i, n_files) for i in range(n_files)]


def predict_file_size(model: GGUFModel, plan: QuantPlan, im: Imatrix | None) -> int:
    """Exact size in bytes of the single file :func:`quantize_file` writes for ``plan`` (header, KV pairs
    with ggufkit's provenance keys and slack, tensor infos, alignment padding and tensor data).

    ``im`` is the imatrix as :func:`quantize_file` passes it on (None when the plan has no imatrix sizes).
    """
    from ggufkit.constants import DEFAULT_SLACK_BYTES
    from ggufkit.format.reader import align_up
    from ggufkit.format.writer import alignment_of, encode_header, tensor_offsets, with_slack

    meta = with_slack(_output_metadata(model, plan, im if plan.options.imatrix_sizes is not None else None,
                                       plan.options), DEFAULT_SLACK_BYTES)
    specs = [TensorSpec(e.name, e.dst_type, e.shape) for e in plan.entries]
    alignment = alignment_of(meta)
    offsets = tensor_offsets(specs, alignment)
    header = encode_header(model.magic, meta, specs, offsets)
    return align_up(len(header), alignment) + sum(align_up(s.nbytes, alignment) for s in specs)


def _device_or_none(device: str, dry_run: bool) -> str | None:
    from ggufkit.quant import resolve_device

    try:
        return resolve_device(device)
    except GGUFKitError:
        if dry_run:
            return None
        raise


def _output_metadata(model: GGUFModel, plan: QuantPlan, im: Imatrix | None, options: QuantOptions,
                     overrides: Sequence[KVOverride] = ()) -> Metadata:
    meta = Metadata()
    for key, kv in model.kv.items():
        if key not in SPLIT_KEYS:
            meta.put(key, kv)
    # PowerInfer's fork sets both keys in place (gguf_set_val_u32); today's llama-quantize re-appends them.
    put = meta.set if model.is_powerinfer else meta.append
    put(Keys.General.QUANTIZATION_VERSION, VT.UINT32, QUANTIZATION_VERSION)
    put(Keys.General.FILE_TYPE, VT.UINT32, int(plan.file_type))
    for o in overrides:  # llama_model_quantize_impl: gguf_set_val_* removes the key and appends it
        meta.append(o.key, o.vtype, o.value)
    if im is not None:
        # quantize.cpp passes these as KV overrides: strings cut to 127 chars, ints as u32(|N|).
        meta.append(KEY_QUANTIZE_IMATRIX_FILE, VT.STRING, str(im.path)[:_MAX_KV_STR])
        if im.datasets:
            meta.append(KEY_QUANTIZE_IMATRIX_DATASET, VT.STRING, im.datasets[0][:_MAX_KV_STR])
        meta.append(KEY_QUANTIZE_IMATRIX_N_ENTRIES, VT.UINT32, len(im.entries))
        if im.chunk_count > 0:
            meta.append(KEY_QUANTIZE_IMATRIX_N_CHUNKS, VT.UINT32, im.chunk_count)
    if plan.block_count is not None:
        meta.append(f"{model.architecture}.block_count", VT.UINT32, plan.block_count)
    meta.append(KEY_TOOL_VERSION, VT.STRING, __version__)
    meta.append(KEY_QUANT_RECIPE, VT.STRING, _recipe(plan, options))
    if im is not None:
        meta.append(KEY_IMATRIX_SHA256, VT.STRING, im.sha256)
    return meta


def _recipe(plan: QuantPlan, options: QuantOptions) -> str:
    parts = [plan.target]
    if options.pure:
        parts.append("--pure")
    if options.leave_output_tensor:
        parts.append("--leave-output-tensor")
    if options.output_tensor_type is not None:
        parts.append(f"--output-tensor-type {options.output_tensor_type.name.lower()}")
    if options.token_embedding_type is not None:
        parts.append(f"--token-embedding-type {options.token_embedding_type.name.lower()}")
    parts.extend(f"--tensor-type {p}={t.name.lower()}" for p, t in options.tensor_types)
    if options.imatrix_sizes is not None:
        parts.append("--imatrix")
    if options.prune_layers:
        parts.append(f"--prune-layers {','.join(map(str, options.prune_layers))}")
    if options.keep_split:
        parts.append("--keep-split")
    return " ".join(parts)


class _Source:
    """Reads tensor rows with ``pread`` into private buffers.

    The reader's mmap would do, but every page it touches stays in this process's RSS until the file is
    closed (a 140 GB model would show 140 GB); pread'd buffers are freed after each slab, so peak memory
    stays a small multiple of the largest tensor. Page-cache reuse is left to the kernel.
    """

    def __init__(self, model: GGUFModel) -> None:
        self.model = model
        self.fds = [os.open(f.path, os.O_RDONLY) for f in model.files]
        self._scratch = np.empty(0, dtype=np.uint8)

    def rows(self, info: TensorInfo, r0: int, r1: int, *, scratch: bool = False) -> np.ndarray:
        """Raw bytes of rows ``[r0, r1)``: ``uint8[r1 - r0, row_bytes]``.

        With ``scratch`` the bytes land in a buffer reused by the next ``scratch`` call (for data that
        is consumed at once): a fresh buffer per tensor costs a page fault per 4 KiB, about a fifth of
        the time of a legacy-type kernel.
        """
        n_rows = max(info.n_elements // max(info.ne[0], 1), 1)
        row_bytes = info.nbytes // n_rows
        f = self.model.files[info.shard]
        n = (r1 - r0) * row_bytes
        if scratch:
            if self._scratch.size < n:
                self._scratch = np.empty(n, dtype=np.uint8)
            out = self._scratch[:n].reshape(r1 - r0, row_bytes)
        else:
            out = np.empty((r1 - r0, row_bytes), dtype=np.uint8)
        view = out.data.cast("B")
        pos, offset = 0, f.data_offset + info.offset + r0 * row_bytes
        while pos < view.nbytes:
            n = os.preadv(self.fds[info.shard], [view[pos:]], offset + pos)
            if n <= 0:
                raise QuantizationError("input file ended inside this tensor (was it truncated?)",
                                        tensor=info.name, path=f.path)
            pos += n
        return out

    @property
    def scratch(self) -> np.ndarray:
        """The buffer ``rows(..., scratch=True)`` reuses."""
        return self._scratch

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def refuse_unrunnable(plan: QuantPlan) -> None:
    """What a real run refuses once the plan is made, before anything is written: a tensor that needs an
    importance matrix and has none, a type without a kernel in this build. A dry run reports both instead.

    Raises:
        QuantizationError: a missing importance matrix (naming the tensor).
        UsageError: a type without a kernel.
    """
    refuse_missing_imatrix(plan)
    missing = plan.missing_kernels()
    if missing:
        raise UsageError(f"no kernel for {', '.join(t.name for t in missing)} in this ggufkit build yet "
                         "(--dry-run shows the plan)")


def _stream(model: GGUFModel, plan: QuantPlan, im: Imatrix | None, threads: int | None,
            device: str) -> Iterator[Any]:
    src = _Source(model)
    try:
        for entry in plan.entries:
            info = model[entry.src_name or entry.name]
            n_rows = max(info.n_elements // max(info.ne[0], 1), 1)
            if entry.action == "copy":
                raw = src.rows(info, 0, n_rows)
                if info.ggml_type in FLOAT_TYPES:
                    _check_finite(raw, info)
                yield raw
                del raw
                continue
            out = _convert(src, info, entry, im, threads, device)
            # The writer holds each yielded tensor while the next one is read and quantized (writer.py,
            # write_gguf): it must never live in the reused read buffer.
            if np.may_share_memory(out, src.scratch):
                raise QuantizationError("internal error: output aliases the read buffer", tensor=entry.name)
            yield out
            del out
    finally:
        src.close()


def _kernel_rows(src: _Source, info: TensorInfo, r0: int, r1: int) -> np.ndarray:
    """Rows ``[r0, r1)`` as the kernels take them: float16 as stored (the dispatcher widens it exactly,
    in parallel, while checking for inf/NaN), everything else as float32. The result may live in the
    source's scratch buffer: it is valid until the next call."""
    raw = src.rows(info, r0, r1, scratch=True)
    if info.ggml_type == QT.F16:
        return raw.view(np.float16).reshape(-1, info.ne[0])
    return _widen(raw, info)


def _widen(raw: np.ndarray, info: TensorInfo) -> np.ndarray:
    n_per_row = info.ne[0]
    if info.ggml_type == QT.F32:
        return raw.view(np.float32).reshape(-1, n_per_row)
    if info.ggml_type == QT.F16:
        return raw.view(np.float16).reshape(-1, n_per_row).astype(np.float32)
    if info.ggml_type == QT.BF16:
        return (raw.view(np.uint16).reshape(-1, n_per_row).astype(np.uint32) << 16).view(np.float32)
    from ggufkit.quant import dequantize

    return dequantize(raw, info.ggml_type, (raw.shape[0], n_per_row))


#: Each float type's (unsigned, signed) element types and the bits of +inf: a value is inf or NaN when its
#: bits without the sign are at least these.
_INF_BITS = {QT.F32: (np.uint32, np.int32, 0x7F800000), QT.F16: (np.uint16, np.int16, 0x7C00),
             QT.BF16: (np.uint16, np.int16, 0x7F80)}


def _check_finite(raw: np.ndarray, info: TensorInfo) -> None:
    """llama-quantize's loader rejects NaN/inf in any float tensor, copied ones included. Tested on the bits
    with two maxima (no widening, no temporaries): read as signed integers, a positive inf/NaN is at least
    +inf's bits; read as unsigned, a negative one is at least -inf's."""
    unsigned, signed, inf = _INF_BITS[info.ggml_type]
    bits = raw.reshape(-1).view(unsigned)
    sign = 1 << (8 * bits.itemsize - 1)
    if bits.size and (bits.view(signed).max() >= inf or bits.max() >= (inf | sign)):
        raise QuantizationError("tensor has invalid data (NaN or inf)", tensor=info.name)


def _convert(src: _Source, info: TensorInfo, entry: PlanEntry, im: Imatrix | None, threads: int | None,
             device: str) -> np.ndarray:
    from ggufkit.quant import quantize

    n_per_row = info.ne[0]
    n_rows = info.n_elements // n_per_row
    rows_per_expert = info.ne[1] if len(info.ne) >= 2 else 1
    weights = im.for_tensor(entry.src_name or entry.name, entry.shape) if im is not None else None
    row_bytes = entry.nbytes // n_rows
    # Slabs never cross an expert boundary, because each expert has its own imatrix slice.
    step = max(1, min(rows_per_expert, SLAB_ELEMENTS // n_per_row))
    out = np.empty((n_rows, row_bytes) if step < n_rows else (0, row_bytes), dtype=np.uint8)
    r = 0
    while r < n_rows:
        expert = r // rows_per_expert
        end = min(r + step, (expert + 1) * rows_per_expert, n_rows)
        x = _kernel_rows(src, info, r, end)
        qw = None if weights is None else np.ascontiguousarray(weights[expert])
        res = quantize(x, entry.dst_type, imatrix=qw, device=device, threads=threads, name=entry.name)
        # Bytes, never values: the result may be typed f16/u16 for float targets.
        res = np.ascontiguousarray(res).view(np.uint8).reshape(end - r, row_bytes)
        if r == 0 and end == n_rows:
            out = res  # the whole tensor in one slab (the common case): no copy
        else:
            out[r:end] = res
        r = end
    _validate_scales(out, entry)
    return out


def _validate_scales(out: np.ndarray, entry: PlanEntry) -> None:
    """llama-quantize validates its output: a block scale that overflowed f16 (inf/NaN) aborts the run."""
    type_size = GGML_QUANT_SIZES[entry.dst_type][1]
    if entry.dst_type in (QT.F16, QT.BF16):
        halves = out.view(np.uint16)
        exp_mask = 0x7C00 if entry.dst_type == QT.F16 else 0x7F80
        bad = bool(((halves & exp_mask) == exp_mask).any())
    elif TYPES[entry.dst_type].scale_offsets:
        blocks = out.reshape(-1, type_size)
        bad = False
        for off in TYPES[entry.dst_type].scale_offsets:
            # f16 inf/NaN: all five exponent bits set, which all sit in the high byte (little-endian), 0x7C
            # there; one strided byte column instead of widening and joining two (4x less time)
            bad = bad or bool(((blocks[:, off + 1] & 0x7C) == 0x7C).any())
    else:
        return
    if bad:
        raise QuantizationError(f"quantized data validation failed: a {entry.dst_type.name} scale is not finite "
                                "in f16 (weights too large for this type)", tensor=entry.name)
