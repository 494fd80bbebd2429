"""Vision projector files (``mmproj-*.gguf``): the vision tower and projector of a vision-language checkpoint,
as llama.cpp's converter writes them with ``--mmproj`` (conversion/base.py ``MmprojModel``) and libmtmd reads
them (tools/mtmd/clip.cpp).

Driven by the ``mmproj:`` section of the class's registry.yaml entry (:mod:`ggufkit.converters.mmproj_registry`):
names are first brought to one layout (``rename``), then mapped, typed and streamed one tensor at a time
through the same writer as text conversions (:func:`ggufkit.converters.write.write_plan`).
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, Keys, LlamaFileType

from ggufkit.constants import GGUF_MAGIC, KEY_SOURCE_SHA256, KEY_TOOL_VERSION
from ggufkit.converters.checkpoint import Checkpoint, checkpoint_inputs, read_config, resolve_model
from ggufkit.converters.hooks import hooks_for
from ggufkit.converters.hparams import _MISSING, first_of
from ggufkit.converters.metadata import (
    default_name,
    model_card_metadata,
    model_file_name,
    output_path,
    size_label,
)
from ggufkit.converters.mmproj_registry import ARCH, ProjectorSpec
from ggufkit.converters.plan import match_rules, resolve_outtype
from ggufkit.converters.plan_types import ConvertPlan, PlanEntry
from ggufkit.converters.quantized_source import open_checkpoint
from ggufkit.converters.registry import ArchEntry, load_registry
from ggufkit.converters.transforms import TRANSFORMS, Heads, transformed_dtype
from ggufkit.converters.write import ConvertReport, write_plan
from ggufkit.errors import CheckpointError, TensorMappingError, UnsupportedArchitectureError, UsageError
from ggufkit.format.values import VT, Metadata
from ggufkit.format.writer import Progress
from ggufkit.outputs import refuse_overwriting_inputs
from ggufkit.quant.llama_quantize.presets import ADAPTER_OUTTYPES

Q = GGMLQuantizationType
G = Keys.General
#: --outtype choices for projectors (llama.cpp's converter: f32, f16, bf16, q8_0; auto follows the checkpoint).
MMPROJ_OUTTYPES: tuple[str, ...] = ("auto", *ADAPTER_OUTTYPES)
_TARGETS = {"f32": (Q.F32, LlamaFileType.ALL_F32), "f16": (Q.F16, LlamaFileType.MOSTLY_F16),
            "bf16": (Q.BF16, LlamaFileType.MOSTLY_BF16), "q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0)}
_VT = {"u32": VT.UINT32, "f32": VT.FLOAT32, "bool": VT.BOOL, "str": VT.STRING}
#: Kinds llama.cpp's converter keeps in F32 whatever the outtype (conversion/base.py ModelBase.prepare_tensors).
_F32_KINDS = frozenset({"V_ENC_EMBD_POS"})
Raw = tuple[str, str, str, tuple[int, ...], str, "str | None"]


def supported_projectors() -> list[str]:
    """HF classes with a projector entry."""
    return sorted(name for name, e in load_registry().entries.items() if e.mmproj is not None)


def _raw_config(model_dir: Path, config: Mapping[str, Any]) -> Mapping[str, Any]:
    """config.json as written (``config`` has text_config merged onto its root, and with it text_config's
    ``architectures``); ``config`` itself where there is no file to read (a plan built from a config alone)."""
    path = model_dir / "config.json"
    if not path.is_file():
        return config
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"config.json is unreadable: {exc}", path=path) from None
    return raw if isinstance(raw, dict) else config


def _first_class(config: Mapping[str, Any]) -> str | None:
    archs = config.get("architectures")
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None


def projector_entry(config: Mapping[str, Any], model_dir: Path) -> tuple[ArchEntry, ProjectorSpec]:
    """The registry entry of the checkpoint's class and its projector section.

    The class is the checkpoint's own (config.json's top-level ``architectures``), not the text model's that
    released configs name inside text_config (SmolVLM's ``VLlama3ForCausalLM``), which the merged ``config``
    carries at its root; then vision_config's, which llama.cpp's converter prefers when present
    (conversion/base.py ``get_model_architecture`` for ModelType.MMPROJ).

    Raises:
        UsageError: a text-only checkpoint (no vision_config).
        UnsupportedArchitectureError: a vision class without a projector entry (the supported ones named).
    """
    raw = _raw_config(model_dir, config)
    vision = raw.get("vision_config")
    candidates = [_first_class(raw), _first_class(vision) if isinstance(vision, dict) else None,
                  _first_class(config)]
    hf_class = next((c for c in candidates if c is not None), None)
    if hf_class is None:
        raise CheckpointError("config.json has no 'architectures' list naming the model class", path=model_dir)
    entries = load_registry().entries
    for name in candidates:
        entry = entries.get(name) if name is not None else None
        if entry is not None and entry.mmproj is not None:
            return entry, entry.mmproj
    if not isinstance(config.get("vision_config"), dict):
        raise UsageError(f"--mmproj: {hf_class} is a text-only checkpoint (config.json has no vision_config); "
                         "there is no projector to write")
    raise UnsupportedArchitectureError(f"--mmproj: no projector support for {hf_class}; supported: "
                                       f"{', '.join(supported_projectors())}")


def read_preprocessor(model_dir: Path) -> dict[str, Any]:
    """preprocessor_config.json, then processor_config.json (its image_processor lifted to the root) merged
    over it, as conversion/base.py ``MmprojModel.__init__`` reads them."""
    out: dict[str, Any] = {}
    for name, sub in (("preprocessor_config.json", "media_proc_cfg"), ("processor_config.json", "image_processor")):
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{name} is unreadable: {exc}", path=path) from None
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{name} is not a JSON object", path=path)
        if isinstance(cfg.get(sub), dict):
            cfg = {**cfg, **cfg[sub]}
        out = {**out, **cfg}
    return out


def _typed(key: str, vtype: str, value: Any) -> tuple[VT, Any, VT | None]:
    try:
        if vtype == "f32_list":
            if not isinstance(value, (list, tuple)):
                raise TypeError(value)
            return VT.ARRAY, [float(v) for v in value], VT.FLOAT32
        if vtype == "u32":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()) or int(value) < 0:
                raise ValueError(value)
            return VT.UINT32, int(value), None
        if vtype == "f32":
            return VT.FLOAT32, float(value), None
        if vtype == "bool":
            if not isinstance(value, bool):
                raise TypeError(value)
            return VT.BOOL, value, None
        return VT.STRING, str(value), None
    except (TypeError, ValueError):
        raise CheckpointError(f"{key} would be {value!r}, expected {vtype}") from None


def clip_keys(spec: ProjectorSpec, sources: Mapping[str, Any]) -> dict[str, tuple[VT, Any, VT | None]]:
    """The section's clip.* keys from ``sources`` (``config``, ``vision``, ``preprocessor``), in YAML order."""
    out: dict[str, tuple[VT, Any, VT | None]] = {}
    for k in spec.keys:
        value = first_of(sources, list(k.sources)) if k.sources else _MISSING
        if value is _MISSING and k.default is not None:
            value = k.default
        if value is _MISSING:
            if k.required:
                where = ", ".join(k.sources)
                raise CheckpointError(f"the checkpoint has none of {where} (needed for {k.key})")
            continue
        out[k.key] = _typed(k.key, k.value_type, value)
    return out


def _rename(spec: ProjectorSpec, name: str) -> str:
    for pattern, repl in spec.rename:
        name = re.sub(pattern, repl, name)
    return name


_BLOCK = re.compile(r"^(v\.blk\.)(\d+)(\..*)$")


def _vision_block(gguf: str) -> int | None:
    m = _BLOCK.match(gguf)
    return int(m.group(2)) if m else None


def map_projector(spec: ProjectorSpec, hf_class: str, names: list[str],
                  n_block: int) -> tuple[list[tuple[str, str, str, str | None]], list[str]]:
    """Map checkpoint names to projector tensors.

    Returns:
        ([(hf name, gguf name, MODEL_TENSOR kind, transform)], [ignored hf names]), in source order.

    Raises:
        TensorMappingError: names no rule consumes, a vision block (v.blk.N) beyond the config's block count, a GGUF name
            produced twice (two layouts mixed), or blocks with missing tensors.
    """
    # Unbounded here: only v.blk.{bid} numbers vision blocks. The merger's layers (mm.0, mm.2), Pixtral's
    # linear_1/linear_2 and the deepstack mergers are numbered otherwise, so a 2-block tower's mm.2 is no block
    # beyond the tower (llama.cpp's converter maps them by name, conversion/qwen3vl.py Qwen3VLVisionModel).
    matches, ignored, leftovers = match_rules(spec.tensors, spec.ignore, names, lambda n: _rename(spec, n),
                                              sys.maxsize, "clip.vision.block_count")
    beyond = {name: bid for name, gguf, _ in matches
              if (bid := _vision_block(gguf)) is not None and bid >= n_block}
    if beyond:
        matches = [m for m in matches if m[0] not in beyond]
        described = {name: f"{name} (block {bid} >= clip.vision.block_count {n_block})" for name, bid in beyond.items()}
        unmatched = set(leftovers)
        leftovers = [described.get(n, n) for n in names if n in described or n in unmatched]
    seen: dict[str, str] = {}
    for name, gguf, _ in matches:
        if gguf in seen:
            raise TensorMappingError(f"{hf_class}: {name} and {seen[gguf]} both give {gguf}")
        seen[gguf] = name
    mapped = [(name, gguf, rule.tensor, rule.transform) for name, gguf, rule in matches]
    if leftovers:
        more = f" and {len(leftovers) - 10} more" if len(leftovers) > 10 else ""
        raise TensorMappingError(f"{hf_class} projector: no rule for source tensors {', '.join(leftovers[:10])}"
                                 f"{more}")
    if not mapped:
        raise TensorMappingError(f"{hf_class}: the checkpoint holds no vision tower tensors")
    per_block: dict[str, set[int]] = {}
    for _, gguf, _, _ in mapped:
        m = _BLOCK.match(gguf)
        if m:
            per_block.setdefault(m.group(1) + "{}" + m.group(3), set()).add(int(m.group(2)))
    missing = [t.format(b) for t, got in per_block.items() for b in range(n_block) if b not in got]
    if missing:
        raise TensorMappingError(f"{hf_class}: missing vision tensors {', '.join(missing[:10])}")
    return mapped, ignored


def check_projector_shapes(spec: ProjectorSpec, hf_class: str, keys: Mapping[str, tuple[VT, Any, Any]],
                           raw: list[Raw]) -> None:
    """Weights whose shapes contradict the config's sizes (the section's ``shapes``) are refused."""
    want = dict(spec.shapes)
    for gguf, source, kind, shape, _, _ in raw:
        dims = want.get(kind)
        if dims is None or not gguf.endswith(".weight"):
            continue
        expect = [d if isinstance(d, int) or d == "*" else int(keys[d][1]) if d in keys else "*" for d in dims]
        ok = len(expect) == len(shape) and all(e == "*" or e == s for e, s in zip(expect, shape))
        if not ok:
            raise TensorMappingError(f"{hf_class}: {source} has shape {list(shape)}, the config says "
                                     f"{['?' if e == '*' else e for e in expect]}")


def projector_type(kind: str, name: str, shape: tuple[int, ...], forced: Mapping[str, str], outtype: str,
                   ) -> tuple[GGMLQuantizationType, str]:
    """One tensor's type, as conversion/base.py ``ModelBase.prepare_tensors`` picks it for a projector: the
    family's forced type, then F32 for 1-D tensors, norms, position embeddings and biases, else the outtype
    (Q8_0 falls back to F16 for rows not a multiple of 32, as gguf's quantizer refuses them)."""
    rule = forced.get(kind)
    chosen: GGMLQuantizationType | None = None
    reason = ""
    if rule == "f16":
        chosen, reason = Q.F16, "forced F16"
    elif rule == "f32":
        chosen, reason = Q.F32, "forced F32"
    elif rule == "wide":
        chosen, reason = (Q.F16, "kept F16") if outtype == "f16" else (Q.F32, "kept F32")
    if len(shape) <= 1 or name.endswith("_norm.weight"):
        return Q.F32, "1-D or norm: F32"
    if chosen is not None:
        return chosen, reason
    if kind in _F32_KINDS:
        return Q.F32, f"{kind.lower()}: F32"
    if not name.endswith(".weight"):
        return Q.F32, "bias: F32"
    target = _TARGETS[outtype][0]
    if target == Q.Q8_0 and shape[-1] % 32:
        return Q.F16, "row not a multiple of 32: F16"
    return target, "outtype"


def _read_row(ckpt: Checkpoint, source: str, row: int) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        return np.array(ckpt.read(source)[row])

    return load


def token_id(model_dir: Path, token: str) -> int | None:
    """``token``'s id from tokenizer_config.json's added_tokens_decoder, else tokenizer.json's added_tokens (the
    order of conversion/llava.py ``LlavaVisionModel.get_token_id``)."""
    for name, key in (("tokenizer_config.json", "added_tokens_decoder"), ("tokenizer.json", "added_tokens")):
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8")).get(key) or {}
        except (OSError, ValueError, AttributeError):
            raise CheckpointError(f"{name} is unreadable", path=path) from None
        items = data.items() if isinstance(data, dict) else ((t.get("id"), t) for t in data if isinstance(t, dict))
        for id_, info in items:
            if isinstance(info, dict) and info.get("content") == token and id_ is not None:
                try:
                    return int(id_)
                except (TypeError, ValueError):
                    raise CheckpointError(f"{name}: token {token!r} has id {id_!r}", path=path) from None
    return None


def _token_rows(spec: ProjectorSpec, hf_class: str, ckpt: Checkpoint, model_dir: Path,
                loaders: dict[str, Callable[[], np.ndarray]]) -> list[Raw]:
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    out: list[Raw] = []
    for row in spec.token_rows:
        # no .weight suffix: llama.cpp's name, which clip.cpp looks up (TN_TOK_IMG_BREAK "v.token_embd.img_break")
        name = TENSOR_NAMES[MODEL_TENSOR[row.tensor]]
        emb = next((n for n in (f"{e}.weight" for e in row.embedding) if n in ckpt.tensors), None)
        if emb is None:
            raise TensorMappingError(f"{hf_class}: no text embedding ({', '.join(row.embedding)}) to take {name} "
                                     f"({row.token}) from")
        token = token_id(model_dir, row.token)
        if token is None:
            raise CheckpointError(f"the tokenizer files have no added token {row.token!r} (its embedding row is "
                                  f"{name})", path=model_dir)
        st = ckpt.tensors[emb]
        if not 0 <= token < st.shape[0]:
            raise CheckpointError(f"token {row.token!r} (id {token}) lies outside the {st.shape[0]}-row {emb}")
        out.append((name, f"{emb}[{token}]", row.tensor, tuple(st.shape[1:]), st.dtype, None))
        loaders[name] = _read_row(ckpt, emb, token)
    return out


def build_mmproj_plan(model_dir: Path, repo: str | None, config: dict[str, Any], ckpt: Checkpoint, *,
                      outtype: str, output: str | Path | None) -> ConvertPlan:
    """Plan a projector file from headers only (token rows aside, no tensor data is read)."""
    from ggufkit import __version__

    if outtype not in MMPROJ_OUTTYPES:
        raise UsageError(f"--mmproj: outtype {outtype!r} is not one llama.cpp writes projectors in "
                         f"(choose from {', '.join(MMPROJ_OUTTYPES)})")
    entry, spec = projector_entry(config, model_dir)
    # the hooks tell families apart by the class (Qwen2.5-VL from Qwen3-VL), not by text_config's
    config = {**config, "architectures": [entry.hf_class]}
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise CheckpointError("config.json has no vision_config", path=model_dir)
    sources = {"config": config, "vision": vision, "preprocessor": read_preprocessor(model_dir)}
    keys = clip_keys(spec, sources)
    n_block = int(keys["clip.vision.block_count"][1]) if "clip.vision.block_count" in keys else 0
    mapped, ignored = map_projector(spec, entry.hf_class, list(ckpt.tensors), n_block)
    loaders: dict[str, Callable[[], np.ndarray]] = {}
    raw: list[Raw] = []
    n_head = int(keys["clip.vision.attention.head_count"][1]) if "clip.vision.attention.head_count" in keys else 0
    for hf, gguf, kind, transform in mapped:
        st = ckpt.tensors[hf]
        dtype = transformed_dtype(transform, st.dtype)
        raw.append((gguf, hf, kind, st.shape, dtype, transform))
        loaders[gguf] = _loader(ckpt, hf, transform, Heads(n_head, n_head))
    raw.extend(_token_rows(spec, entry.hf_class, ckpt, model_dir, loaders))
    rewrite = hooks_for(spec.hooks).get("mmproj_rewrite")
    if rewrite is not None:
        raw = rewrite(raw, loaders, config)
    check_projector_shapes(spec, entry.hf_class, keys, raw)
    hook = hooks_for(spec.hooks).get("mmproj_metadata")
    extra = hook(config, sources["preprocessor"]) if hook is not None else {}

    resolved = resolve_outtype(outtype, [r[4] for r in raw if len(r[3]) >= 2])
    forced = dict(spec.types)
    entries = []
    for gguf, source, kind, shape, dtype, transform in raw:
        ggml_type, reason = projector_type(kind, gguf, shape, forced, resolved)
        entries.append(PlanEntry(gguf, source, shape, dtype, ggml_type, transform, reason, kind))
    file_type = int(_TARGETS[resolved][1])

    meta = Metadata()
    meta.set(G.ARCHITECTURE, VT.STRING, ARCH)
    meta.set(G.TYPE, VT.STRING, "mmproj")
    name = default_name(model_dir, repo)
    meta.set(G.NAME, VT.STRING, name)
    n_params = sum(int(np.prod(e.shape, dtype=np.int64)) for e in entries)
    meta.set(G.SIZE_LABEL, VT.STRING, size_label(n_params))
    # the model card's keys, as for the text model (llama.cpp's MmprojModel inherits prepare_metadata)
    for key, value in model_card_metadata(model_dir, meta, n_params).items():
        meta.put(key, value)
    meta.set(G.FILE_TYPE, VT.UINT32, file_type)
    for key, (vtype, value, item) in keys.items():
        meta.set(key, vtype, value, item)
    meta.set(Keys.Clip.PROJECTOR_TYPE, VT.STRING, spec.projector_type)
    for key, (vtype, value, item) in extra.items():
        meta.set(key, vtype, value, item)
    meta.set(G.QUANTIZATION_VERSION, VT.UINT32, GGML_QUANT_VERSION)
    meta.set(KEY_TOOL_VERSION, VT.STRING, __version__)
    # Provenance of the weight files the projector was read from (not the whole checkpoint: a 27B model's text
    # shards would cost more to hash than the projector costs to convert).
    files = {ckpt.tensors[hf].file for hf, _, _, _ in mapped}
    files |= {ckpt.tensors[e.source.split("[")[0]].file for e in entries if e.kind.startswith("V_TOK_EMBD")}
    meta.put(KEY_SOURCE_SHA256, ckpt.sha256_value(files))
    ftype = LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    out = mmproj_output_path(output, model_dir, repo, name, ftype)
    return ConvertPlan(entry.hf_class, ARCH, resolved, file_type, GGUF_MAGIC, meta, entries, ignored, out, loaders,
                       inputs=checkpoint_inputs(model_dir, ckpt.files))


def mmproj_output_path(output: str | Path | None, model_dir: Path, repo: str | None, basename: str,
                       ftype: str) -> Path:
    """``-o`` as for the text model (:func:`ggufkit.converters.metadata.output_path`), or
    ``mmproj-{basename}-{FTYPE}.gguf`` (the hub's name) in the model directory (the current one for hub ids)."""
    return output_path(output, model_dir, repo, model_file_name(basename, None, ftype, prefix="mmproj-"), ftype)


def _loader(ckpt: Checkpoint, source: str, transform: str | None, heads: Heads) -> Callable[[], np.ndarray]:
    # permute_q / permute_k reorder the vision tower's Q/K rows by its head count (conversion/llava.py
    # LlavaVisionModel.modify_tensors: LlamaModel.permute with n_head for both).
    def load() -> np.ndarray:
        arr = ckpt.read(source)
        return TRANSFORMS[transform](arr, heads) if transform else arr

    return load


def convert_mmproj(model: str | Path, output: str | Path | None = None, *, outtype: str = "auto",
                   dry_run: bool = False, progress: Progress | None = None) -> ConvertReport:
    """Write the projector file (vision tower + projector) of a vision-language checkpoint.

    Args:
        model: checkpoint directory or hub repo id.
        output: file, directory or ``{ftype}`` template; None: ``mmproj-{basename}-{FTYPE}.gguf`` in the model
            directory.
        outtype: ``auto`` (follows the checkpoint), ``f32``, ``f16``, ``bf16`` or ``q8_0``; tensors llama.cpp
            keeps wide (norms, embeddings, the family's forced ones) are kept so.
        dry_run: plan only.
        progress: receives bytes written.

    Returns:
        A :class:`ggufkit.converters.write.ConvertReport`.

    Raises:
        UsageError: a text-only checkpoint, or an outtype projectors are not written in.
        UnsupportedArchitectureError: a vision class without projector support (the message names the
            supported ones).
        TensorMappingError: vision tensors that do not match the config or the registry.
    """
    start = time.perf_counter()
    model_dir, repo, _ = resolve_model(model)
    config = read_config(model_dir)
    entry, _ = projector_entry(config, model_dir)  # refuse before listing weights
    # a checkpoint released quantized (FP8, compressed-tensors) read dequantized, one tensor at a time, as the text
    # model is (converters/quantized_source.py); another quant_method is refused in one line
    ckpt = open_checkpoint(model_dir, config, entry)
    try:
        plan = build_mmproj_plan(model_dir, repo, config, ckpt, outtype=outtype, output=output)
        assert plan.output is not None
        refuse_overwriting_inputs([plan.output], plan.inputs)
        if dry_run:
            return ConvertReport(plan, [], time.perf_counter() - start, dry_run=True, model_dir=model_dir)
        return write_plan(plan, model_dir, start, progress=progress)
    finally:
        ckpt.close()


__all__ = ["MMPROJ_OUTTYPES", "build_mmproj_plan", "convert_mmproj", "supported_projectors"]
