"""Plan a conversion from headers only: registry entry, tensor mapping, output types, metadata, file name.

Every source tensor is mapped (name, transform, output type) or explicitly ignored, else
:class:`~ggufkit.errors.TensorMappingError` names the leftovers. No tensor data is read here (except predictor
shapes); :attr:`ConvertPlan.loaders` read one tensor each when the stream asks for it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, Keys, LlamaFileType

from ggufkit.constants import GGUF_MAGIC, POWERINFER_MAGIC
from ggufkit.converters.checkpoint import Checkpoint, checkpoint_inputs, read_config, resolve_model
from ggufkit.converters.hooks import hooks_for
from ggufkit.converters.hparams import resolve_hparams
from ggufkit.converters.metadata import (
    build_metadata,
    default_name,
    model_file_name,
    output_path,
    size_label,
)
from ggufkit.converters.mtp import MtpLayers, mtp_layers
from ggufkit.converters.outtypes import OUTTYPES
from ggufkit.converters.plan_types import ConvertPlan, PlanEntry, Source
from ggufkit.converters.powerinfer import check_activation, load_predictor, read_predictor
from ggufkit.converters.quantized_source import open_checkpoint
from ggufkit.converters.registry import ArchEntry, TensorRule, load_registry
from ggufkit.converters.rewrite import stack_experts
from ggufkit.converters.shape_check import check_shapes
from ggufkit.converters.transforms import TRANSFORMS, Heads, transformed_dtype, transformed_shape
from ggufkit.errors import CheckpointError, TensorMappingError, UsageError
from ggufkit.format.tensor_shape import n_elements
from ggufkit.format.values import VT
from ggufkit.format.writer import TensorSpec
from ggufkit.quant.llama_quantize.presets import PRESETS

Q = GGMLQuantizationType
G = Keys.General
#: GGUF tensors llama.cpp's converter always keeps in F32 whatever the outtype (conversion/base.py:
#: ModelBase.prepare_tensors).
_F32_KINDS = frozenset({"POS_EMBD", "TOKEN_TYPES", "FFN_GATE_INP", "FFN_GATE_INP_SHEXP", "SSM_CONV1D",
                        "SHORTCONV_CONV", "ALTUP_CORRECT_COEF", "ALTUP_PREDICT_COEF"})


# -- mapping -------------------------------------------------------------------------------------------
def compile_rule(rule: TensorRule) -> re.Pattern[str]:
    """The regex matching an HF tensor name of ``rule`` (groups ``bid``, ``xid`` for experts, ``suffix``)."""
    body = re.escape(rule.hf_template).replace(re.escape("{bid}"), r"(?P<bid>\d+)")
    body = body.replace(re.escape("{xid}"), r"(?P<xid>\d+)")
    return re.compile(rf"^{body}(?P<suffix>\.weight|\.bias)?$")


def match_rules(rules: tuple[TensorRule, ...] | list[TensorRule], ignore: tuple[str, ...] | list[str],
                names: list[str], local_name: Callable[[str], str], n_block: int,
                block_key: str) -> tuple[list[tuple[str, str, TensorRule]], list[str], list[str]]:
    """Match checkpoint names against tensor rules (shared by the text and projector planners).

    ``local_name`` turns a checkpoint name into the name the rules and ignore patterns see; a block index at or
    beyond ``n_block`` is a leftover naming ``block_key``.

    Returns:
        ([(hf name, gguf name, rule)], [ignored hf names], [leftover descriptions]), in source order.
    """
    compiled = [(compile_rule(r), r) for r in rules]
    mapped, ignored, leftovers = [], [], []
    for name in names:
        local = local_name(name)
        stem = re.sub(r"\.(weight|bias)$", "", local)
        if any(fnmatch.fnmatchcase(local, p) or fnmatch.fnmatchcase(stem, p) for p in ignore):
            ignored.append(name)
            continue
        for pattern, rule in compiled:
            m = pattern.match(local)
            if m is None:
                continue
            bid = m.group("bid") if "{bid}" in rule.hf_template else None
            if bid is not None and int(bid) >= n_block:
                leftovers.append(f"{name} (block {bid} >= {block_key} {n_block})")
                break
            mapped.append((name, rule.gguf_template.format(bid=bid) + (m.group("suffix") or ""), rule))
            break
        else:
            leftovers.append(name)
    return mapped, ignored, leftovers


def map_tensors(entry: ArchEntry, names: list[str], n_layer: int, mtp: MtpLayers | None = None
                ) -> tuple[list[tuple[str, str, TensorRule]], list[str]]:
    """Map HF names to GGUF names (``mtp``: the multi-token-prediction layers written or left out).

    Returns:
        ([(hf name, gguf name, rule)], [ignored hf names]), in source order.

    Raises:
        TensorMappingError: names no rule consumes and no ignore pattern matches, or a block index out of range.
    """
    mtp = mtp or MtpLayers("keep", n_layer, strip_prefix=entry.strip_prefix)
    names, left_out = mtp.split(names)
    mapped, ignored, leftovers = match_rules(entry.tensors, entry.ignore, names, mtp.local_name, n_layer,
                                             "block_count")
    if leftovers:
        more = f" and {len(leftovers) - 10} more" if len(leftovers) > 10 else ""
        raise TensorMappingError(f"{entry.hf_class}: no rule for source tensors {', '.join(leftovers[:10])}{more}; "
                                 "add them to registry.yaml 'tensors' or 'ignore'")
    _check_complete(entry, [m for m in mapped if mtp.is_trunk(m[1])], mtp.n_trunk)
    return mapped, left_out + ignored


def _check_complete(entry: ArchEntry, mapped: list[tuple[str, str, TensorRule]], n_layer: int) -> None:
    produced = {g for _, g, _ in mapped}
    kinds = {r.tensor for _, _, r in mapped}
    if "TOKEN_EMBD" not in kinds:
        raise TensorMappingError(f"{entry.hf_class}: the checkpoint has no token embedding")
    # A per-block tensor present in one block must be present in all of them (a truncated shard set); a
    # hybrid model's blocks differ by kind (its hooks check the schedule).
    if entry.hybrid:
        return
    per_block: dict[str, set[str]] = {}
    for _, gguf, rule in mapped:
        if "{bid}" in rule.gguf_template:
            # ".weight" / ".bias", or nothing for a tensor named without one (Mamba2's A_log -> blk.N.ssm_a)
            suffix = "." + gguf.rsplit(".", 1)[-1] if gguf.endswith((".weight", ".bias")) else ""
            per_block.setdefault(f"{rule.gguf_template}{suffix}", set()).add(gguf)
    missing = []
    for template in per_block:
        for bid in range(n_layer):
            name = template.format(bid=bid)
            if name not in produced:
                missing.append(name)
    if missing:
        raise TensorMappingError(f"{entry.hf_class}: missing source tensors for {', '.join(missing[:10])}")


# -- types -------------------------------------------------------------------------------------------
def resolve_outtype(outtype: str, first_2d_dtypes: list[str]) -> str:
    """``auto``: the first 2-D bf16 or f16 tensor decides, f16 otherwise (llama.cpp's GUESSED rule)."""
    if outtype != "auto":
        return outtype
    for dtype in first_2d_dtypes:
        if dtype == "BF16":
            return "bf16"
        if dtype == "F16":
            return "f16"
    return "f16"


def float_type(name: str, kind: str, shape: tuple[int, ...], target: GGMLQuantizationType,
               powerinfer: bool) -> tuple[GGMLQuantizationType, str]:
    """Output type of one tensor for a float outtype, with the reason (convert_hf_to_gguf.py: ModelBase.prepare_tensors)."""
    if len(shape) <= 1:
        return Q.F32, "1-D: F32"
    if name.endswith("_norm.weight"):
        return Q.F32, "norm: F32"
    if not name.endswith(".weight"):
        return Q.F32, "bias: F32"
    if kind in _F32_KINDS:
        return Q.F32, f"{kind.lower()}: F32"
    if powerinfer and kind == "FFN_DOWN_T":
        return Q.F16, "PowerInfer's CPU axpy kernel reads ffn_down_t as F16"
    return target, "outtype"



# -- planning ------------------------------------------------------------------------------------------
def open_source(model: str | Path, vocab_only: bool) -> Source:
    """Resolve ``model``, read its config, find its registry entry and run its ``check_config`` hook."""
    model_dir, repo, revision = resolve_model(model)
    config = read_config(model_dir)
    text_config = config.get("text_config")
    if isinstance(text_config, dict):  # a multimodal checkpoint: its text model's fields win (llama.cpp's
        config = {**config, **text_config}  # ModelBase.load_hparams merges them the same way)
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise CheckpointError("config.json has no 'architectures' list naming the model class", path=model_dir)
    entry = load_registry().get(archs[0])
    pick = hooks_for(entry.hooks).get("architecture")
    if pick is not None:  # one HF class, several GGUF architectures (Nemotron-H with or without MoE)
        entry = dataclasses.replace(entry, arch=pick(config))
    check = hooks_for(entry.hooks).get("check_config")
    if check is not None:
        check(config)
    return Source(model_dir, repo, revision, config, entry, None if vocab_only else
                  open_checkpoint(model_dir, config, entry))


def _heads(hp: Mapping[str, tuple[VT, Any]], arch: str) -> Heads:
    n_head = int(hp.get(f"{arch}.attention.head_count", (VT.UINT32, 0))[1])
    kv = hp.get(f"{arch}.attention.head_count_kv", (VT.UINT32, n_head))[1]
    n_kv = max((int(v) for v in kv), default=0) if isinstance(kv, (list, tuple)) else int(kv)  # per layer: hybrid
    return Heads(n_head, n_kv)


def build_plan(src: Source, *, outtype: str, predictor: Path | None, vocab_only: bool,
               output: str | Path | None, metadata_file: Path | None, pre_tokenizer: str | None,
               mtp: bool | None = None) -> ConvertPlan:
    """Plan a conversion from headers only (no tensor data is read, except predictor shapes); ``mtp``: the
    multi-token-prediction layers as the class keeps them (None), alone (True, --mtp) or left out (False)."""
    entry, config = src.entry, src.config
    if outtype not in OUTTYPES:
        raise UsageError(f"unknown outtype {outtype!r} (choose from {', '.join(OUTTYPES)})")
    hp = resolve_hparams(entry, config)
    tensor_names = src.checkpoint.tensors if src.checkpoint is not None and not vocab_only else {}

    def mtp_plan(n_trunk: int) -> MtpLayers:
        return mtp_layers(entry.mtp, entry.hf_class, entry.strip_prefix, config, tensor_names, n_trunk, mtp)

    # MTP blocks count before the family's hooks see the keys (Qwen3-Next's recurrent_layers covers them); a
    # family whose hooks write the block count (Nemotron-H) has no MTP layers
    layers = mtp_plan(int(hp[f"{entry.arch}.block_count"][1])) if f"{entry.arch}.block_count" in hp else None
    if layers is not None:
        hp = layers.hparams(hp, entry.arch)
    more_hparams = hooks_for(entry.hooks).get("hparams")
    if more_hparams is not None:
        hp = more_hparams(config, hp, tuple(tensor_names))
    arch = entry.arch
    n_layer = int(hp[f"{arch}.block_count"][1])
    layers = layers or mtp_plan(n_layer)
    heads = _heads(hp, arch)
    powerinfer = predictor is not None
    if powerinfer and not entry.powerinfer:
        raise UsageError(f"--predictor: PowerInfer has no sparse loader for {entry.hf_class} ({arch})")
    if powerinfer:
        check_activation(config)

    entries: list[PlanEntry] = []
    loaders: dict[str, Callable[[], np.ndarray]] = {}
    ignored: list[str] = []
    rewritten: frozenset[str] = frozenset()  # tensors a family hook computes itself (ConvertPlan.rewritten)
    raw: list[tuple[str, str, str, tuple[int, ...], str, str | None]] = []  # gguf, source, kind, shape, dtype, tf
    extra = hooks_for(entry.hooks).get("extra_tensors")
    if not vocab_only:
        assert src.checkpoint is not None
        ckpt = src.checkpoint
        for gguf_name, arr in (extra(config) if extra is not None else []):
            if powerinfer:
                raise UsageError(f"--predictor: PowerInfer's loader does not accept {gguf_name}")
            raw.append((gguf_name, "generated", "", arr.shape, "F32", None))
            loaders[gguf_name] = _constant(arr)
        mapped, ignored = map_tensors(entry, list(ckpt.tensors), n_layer, layers)
        experts: dict[int, tuple[int, int, str]] = {}  # raw index -> (block, expert id, weight name)
        for hf, gguf_name, rule in mapped:
            st = ckpt.tensors[hf]
            if "{xid}" in rule.hf_template:
                experts[len(raw)] = _expert_of(rule, layers.local_name(hf))
            kind, transform = rule.tensor, rule.transform
            if powerinfer and kind == "FFN_DOWN":
                # PowerInfer stores the down projection transposed, one neuron per row (PowerInfer llama.cpp: llm_load_tensors, ffn_down_t).
                kind, transform = "FFN_DOWN_T", "transpose"
                gguf_name = gguf_name.replace(".ffn_down.", ".ffn_down_t.")
            raw.append((gguf_name, hf, kind, transformed_shape(transform, st.shape), transformed_dtype(transform, st.dtype),
                        transform))
        n_expert = hp.get(f"{arch}.expert_count")
        raw, stack_loaders = stack_experts(raw, experts, None if n_expert is None else int(n_expert[1]),
                                           lambda source, transform: _loader(ckpt, source, transform, heads)())
        loaders.update(stack_loaders)
        for r in raw:  # every planned tensor has its loader before a hook wraps or replaces it
            loaders.setdefault(r[0], _loader(ckpt, r[1], r[5], heads))
        rewrite = hooks_for(entry.hooks).get("rewrite_tensors")
        if rewrite is not None:
            plain = {id(load) for load in loaders.values()}
            raw = rewrite(raw, loaders, config)
            rewritten = frozenset(r[0] for r in raw if id(loaders[r[0]]) not in plain)
        kinds = {r[2] for r in raw}
        # A tied head where the loader needs output.weight (PowerInfer's llama loader too): write the embedding
        # again under that name.
        if "OUTPUT" not in kinds and (entry.output == "required" or (powerinfer and entry.output == "optional")):
            emb = next(r for r in raw if r[0] == "token_embd.weight")
            raw.append(("output.weight", emb[1], "OUTPUT", emb[3], emb[4], emb[5]))
        if powerinfer:
            pred = load_predictor(predictor, n_layer=n_layer, n_embd=int(hp[f"{arch}.embedding_length"][1]),
                                  n_ff=int(hp[f"{arch}.feed_forward_length"][1]))
            for gguf_name, shape, dtype, file, key in pred.tensors():
                raw.append((gguf_name, f"{file.name}:{key}", "FC1" if ".fc1." in gguf_name else "FC2", shape,
                            dtype, None))
                loaders[gguf_name] = _predictor_loader(pred.directory, key, file)
        check_shapes(arch, hp, [(r[0], r[1], r[2], r[3]) for r in raw])
        for gguf_name, source, _, _, _, transform in raw:
            if gguf_name not in loaders:
                loaders[gguf_name] = _loader(ckpt, source, transform, heads)

    resolved = resolve_outtype(outtype, [r[4] for r in raw if len(r[3]) >= 2 and r[1] != "generated"])
    preset = PRESETS[resolved]
    if not preset.is_quantized:
        target = preset.default_type
        for gguf_name, source, kind, shape, dtype, transform in raw:
            ggml_type, reason = float_type(gguf_name, kind, shape, target, powerinfer)
            if dtype == "MXFP4":  # repacked as released (converters/mxfp4_source.py)
                ggml_type, reason = Q.MXFP4, "MXFP4 source: kept"
            entries.append(PlanEntry(gguf_name, source, shape, dtype, ggml_type, transform, reason, kind))
        # llama.cpp's converter names a float file with MXFP4 experts MXFP4_MOE (ModelBase.prepare_metadata)
        mxfp4 = any(r[4] == "MXFP4" for r in raw)
        file_type = int(LlamaFileType.MOSTLY_MXFP4_MOE if mxfp4 else preset.file_type)
    else:
        entries, file_type, resolved = _quant_entries(raw, resolved, arch, powerinfer, hp)

    meta, pre_match = build_metadata(src, hp, entries, file_type, vocab_only, metadata_file, powerinfer, predictor,
                                     pre_tokenizer)
    fill = hooks_for(entry.hooks).get("special_tokens")  # tokenizer roles the family's converter names itself
    for key, token_id in (fill(src.model_dir, meta) if fill is not None else {}).items():
        meta.set(key, VT.UINT32, token_id)
    label = None if vocab_only else size_label(sum(n_elements(e.shape) for e in entries))
    name_value = meta.get(G.BASENAME) or meta.get(G.NAME)
    basename = str(getattr(name_value, "value", default_name(src.model_dir, src.repo)))
    ftype_name = LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    file_name = model_file_name(basename, None if layers.file_prefix() else label, ftype_name, vocab_only,
                                prefix=layers.file_prefix())
    out = output_path(output, src.model_dir, src.repo, file_name, ftype_name)
    inputs = checkpoint_inputs(src.model_dir, src.checkpoint.files if src.checkpoint is not None else None)
    if predictor is not None and Path(predictor).is_dir():
        inputs += sorted(p for p in Path(predictor).iterdir() if p.is_file())
    if metadata_file is not None:
        inputs.append(Path(metadata_file))
    return ConvertPlan(entry.hf_class, arch, resolved, file_type, POWERINFER_MAGIC if powerinfer else GGUF_MAGIC,
                       meta, entries, ignored, out, loaders, pre_match, inputs, rewritten)


def _expert_of(rule: TensorRule, local: str) -> tuple[int, int, str]:
    """(block, expert id, HF weight name after the expert id) of an expert tensor (``local``: its name as the
    rules see it)."""
    m = compile_rule(rule).match(local)
    assert m is not None
    return int(m.groupdict().get("bid") or 0), int(m.group("xid")), rule.hf_template.split("{xid}", 1)[1]


def _constant(arr: np.ndarray) -> Callable[[], np.ndarray]:
    return lambda: arr


def _predictor_loader(directory: Path, key: str, file: Path) -> Callable[[], np.ndarray]:
    return lambda: read_predictor(directory, key, file)


def _loader(ckpt: Checkpoint, source: str, transform: str | None, heads: Heads) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        arr = ckpt.read(source)
        return TRANSFORMS[transform](arr, heads) if transform else arr

    derived = ckpt.derived.get(source) if transform is None else None
    if derived is not None and hasattr(derived, "pieces"):  # FP8 / compressed-tensors: dequantized in row pieces
        return derived
    return load


def _quant_entries(raw: list[tuple[str, str, str, tuple[int, ...], str, str | None]], target: str, arch: str,
                   powerinfer: bool, hp: Mapping[str, tuple[VT, Any]]) -> tuple[list[PlanEntry], int, str]:
    """Per-tensor types for a quantized outtype, chosen by llama-quantize's rules (ggufkit.quant.llama_quantize.plan).

    Returns:
        (entries in llama-quantize's order, general.file_type, canonical target name such as ``q4_k_m``).
    """
    from ggufkit.quant.llama_quantize.plan import QuantOptions, plan_quantization

    # The planner sees what `ggufkit quantize` would see in the f32 conversion, so types (and tensor order)
    # match quantizing that file.
    sources = [TensorSpec(g, Q.F32, shape) for g, _, _, shape, _, _ in raw]
    meta = {k: v for k, (_, v) in hp.items()}
    meta[G.ARCHITECTURE] = arch
    qplan = plan_quantization(sources, target, arch=arch, metadata=meta, options=QuantOptions())
    by_name = {r[0]: r for r in raw}
    entries = []
    for qe in qplan.entries:
        gguf_name, source, kind, shape, dtype, transform = by_name[qe.name]
        ggml_type, reason = qe.dst_type, qe.reason
        if powerinfer and kind == "FFN_DOWN_T" and ggml_type != Q.Q4_0:
            ggml_type, reason = Q.F16, "PowerInfer's CPU axpy kernel reads ffn_down_t as F16 (or Q4_0)"
        if dtype == "MXFP4":  # kept whatever the outtype, as GptOssModel.generate_extra_tensors writes it
            ggml_type, reason = Q.MXFP4, "MXFP4 source: kept"
        entries.append(PlanEntry(gguf_name, source, shape, dtype, ggml_type, transform, reason, kind))
    return entries, int(qplan.file_type), qplan.target

