"""gpt-oss hooks: what registry.yaml cannot say (conversion/gpt_oss.py ``GptOssModel``, src/models/openai-moe.cpp).

- Tensors: ``self_attn.sinks`` written as ``attn_sinks.weight`` (GptOssModel.filter_tensors); the stacked experts
  split and renamed as GptOssModel.modify_tensors does: ``gate_up_proj`` ``[n_expert, n_embd, 2 * n_ff]``
  transposed, gate rows the even ones and up rows the odd ones (interleaved), ``down_proj`` transposed, the
  ``gate_up_proj_bias`` split the same way, ``down_proj_bias`` as ``ffn_down_exps.bias``.
- A checkpoint as released (``quant_method`` ``mxfp4``): ``*_blocks`` / ``*_scales`` repacked into GGUF MXFP4
  bytes (:func:`ggufkit.converters.mxfp4_source.repack_mxfp4`), gate and up from the even and odd rows, and, as
  llama.cpp's ``generate_extra_tensors`` writes them straight away, placed before every other tensor.
- ``reference_view``: the rows of those expert tensors where they lie in their checkpoint source, for
  ``convert --check`` to round a quantized one in the GGUF's own rows (eval/convert_check.py).
- Keys llama.cpp's converter reads through AutoConfig, which fills GptOssConfig's defaults where a config leaves
  a field out: the YaRN rope scaling (factor 32 over 4096 positions).
- Refused: what the openai-moe graph cannot compute (a layer schedule other than sliding/full alternating from a
  sliding first layer, the loader's fixed pattern; another SwiGLU clamp or gain; no attention biases).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ggufkit.converters.mxfp4_source import BLOCK_VALUES, repack_mxfp4
from ggufkit.errors import UnsupportedArchitectureError

Raw = tuple[str, str, str, tuple[int, ...], str, "str | None"]
Loader = Callable[[], np.ndarray]
SLIDING, FULL = "sliding_attention", "full_attention"
#: the constants of llama.cpp's LLM_FFN_SWIGLU_OAI_MOE (src/llama-graph.cpp build_moe_ffn), GptOssConfig's defaults
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
#: GptOssConfig's rope_parameters when a config has none (AutoConfig writes them for llama.cpp's converter)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "original_max_position_embeddings": 4096}


def layer_types(config: Mapping[str, Any]) -> list[str]:
    """Per layer ``sliding_attention`` / ``full_attention``: ``layer_types``, or GptOssConfig's default
    (sliding on even layers)."""
    n_layer = config.get("num_hidden_layers", 36)
    types = config.get("layer_types")
    if types is None:
        return [SLIDING if (i + 1) % 2 else FULL for i in range(n_layer)]
    if not isinstance(types, list) or len(types) != n_layer or any(t not in (SLIDING, FULL) for t in types):
        raise UnsupportedArchitectureError(
            f"config.json: layer_types must list {n_layer} entries, each {SLIDING!r} or {FULL!r}")
    return list(types)


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse checkpoints llama.cpp's openai-moe loader and graph would compute differently."""
    problems = []
    types = layer_types(config)
    if types != [SLIDING if (i + 1) % 2 else FULL for i in range(len(types))]:
        problems.append("a layer schedule other than sliding/full alternating from a sliding first layer (the "
                        "loader's fixed swa pattern 2)")
    for key, want in (("swiglu_alpha", SWIGLU_ALPHA), ("swiglu_limit", SWIGLU_LIMIT)):
        value = config.get(key, want)
        if value is None or float(value) != want:
            problems.append(f"{key} {value!r} (llama.cpp's graph computes {want})")
    if config.get("attention_bias", True) is False:
        problems.append("no attention biases (the loader requires them)")
    if config.get("sliding_window", 128) is None:
        problems.append("no sliding_window")
    if problems:
        raise UnsupportedArchitectureError("gpt_oss: llama.cpp would compute another model: " + "; ".join(problems))


def hparams(config: Mapping[str, Any], values: dict[str, Any], *_: Any) -> dict[str, Any]:
    """The YaRN keys GptOssConfig's default rope_parameters give when a config spells none."""
    from ggufkit.converters.hparams import rope_scaling, rope_scaling_keys

    if rope_scaling(config) is not None:
        return values
    return {**values, **rope_scaling_keys("gpt-oss", {"rope_parameters": DEFAULT_ROPE})}


# -- tensors ---------------------------------------------------------------------------------------------
def _transposed(load: Loader, rows: slice | None) -> Loader:
    """``[n_expert, in, out]`` -> ``[n_expert, out, in]``, then the rows ``rows`` (the gate or up half)."""
    def run() -> np.ndarray:
        arr = np.swapaxes(load(), -1, -2)
        return np.ascontiguousarray(arr if rows is None else arr[:, rows, :])

    return run


def _columns(load: Loader, cols: slice) -> Loader:
    return lambda: np.ascontiguousarray(load()[..., cols])


def _mxfp4(blocks: Loader, scales: Loader, rows: slice | None) -> Loader:
    def run() -> np.ndarray:
        b, s = blocks(), scales()
        if rows is not None:
            b, s = b[:, rows], s[:, rows]
        return repack_mxfp4(b, s)

    return run


_EVEN, _ODD = slice(0, None, 2), slice(1, None, 2)


def rewrite_tensors(raw: list[Raw], loaders: dict[str, Loader], config: Mapping[str, Any]) -> list[Raw]:
    """The tensors as GptOssModel yields them (module docstring), in the same order; MXFP4 ones first."""
    first: list[Raw] = []
    out: list[Raw] = []
    pending: dict[str, tuple[Loader, Raw]] = {}  # a layer's *_blocks or *_scales, until the other arrives
    for gguf, source, kind, shape, dtype, transform in raw:
        load = loaders.pop(gguf)
        if kind == "ATTN_SINKS":
            gguf += ".weight"
        if not kind.startswith("GPT_OSS_"):
            out.append((gguf, source, kind, shape, dtype, transform))
            loaders[gguf] = load
            continue
        block = gguf.split(".")[1]
        gate_up = kind.startswith("GPT_OSS_GATE_UP_PROJ")
        tail = kind.removeprefix("GPT_OSS_GATE_UP_PROJ" if gate_up else "GPT_OSS_DOWN_PROJ")
        names = ([f"blk.{block}.ffn_gate_exps", f"blk.{block}.ffn_up_exps"] if gate_up
                 else [f"blk.{block}.ffn_down_exps"])
        kinds = ["FFN_GATE_EXP", "FFN_UP_EXP"] if gate_up else ["FFN_DOWN_EXP"]
        halves: list[slice | None] = [_EVEN, _ODD] if gate_up else [None]
        if tail in ("_BLOCKS", "_SCALES"):  # written once both halves of the pair are seen
            other = pending.pop(block + str(gate_up), None)
            if other is None:
                pending[block + str(gate_up)] = (load, (gguf, source, kind, shape, dtype, transform))
                continue
            (blocks, braw), scales = ((load, (gguf, source, kind, shape, dtype, transform)), other[0]) \
                if tail == "_BLOCKS" else (other, load)
        for name, k, half in zip(names, kinds, halves):
            if tail == "":  # a dequantized checkpoint: [n_expert, in, out] -> [n_expert, out, in]
                n_exp, n_in, n_out = shape
                rows = n_out // 2 if gate_up else n_out
                out.append((name + ".weight", source, k, (n_exp, rows, n_in), dtype, transform))
                loaders[name + ".weight"] = _transposed(load, half)
            elif tail == "_BIAS":
                n_exp, n_out = shape
                out.append((name + ".bias", source, k, (n_exp, n_out // 2 if gate_up else n_out), dtype, transform))
                loaders[name + ".bias"] = _columns(load, half) if half is not None else load
            else:  # MXFP4 blocks and scales
                n_exp, rows, n_block, _ = braw[3]
                rows = rows // 2 if gate_up else rows
                first.append((name + ".weight", braw[1].removesuffix("_blocks"), k,
                              (n_exp, rows, n_block * BLOCK_VALUES), "MXFP4", None))
                loaders[name + ".weight"] = _mxfp4(blocks, scales, half)
    if pending:
        lone = ", ".join(sorted(r[1] for _, r in pending.values()))
        raise UnsupportedArchitectureError(f"gpt_oss: MXFP4 blocks and scales must come in pairs: {lone} alone")
    return first + out


def reference_view(gguf: str, source: str, w: np.ndarray, config: Mapping[str, Any]) -> np.ndarray | None:
    """The rows of GGUF tensor ``gguf`` where they lie in ``w``, its checkpoint tensor ``source``, for
    ``convert --check``'s reference (eval/convert_check.py) to round a quantized expert tensor in the GGUF's own
    rows: a view of ``w`` (writing it writes ``w``) with the source's last two axes swapped, the gate's rows the
    even ones, the up's the odd ones, the down's all of them, as :func:`rewrite_tensors` computes them; None for
    every other tensor (biases are never block-quantized)."""
    if not gguf.endswith(".weight") or not source.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return None
    rows = {"ffn_gate_exps": _EVEN, "ffn_up_exps": _ODD, "ffn_down_exps": slice(None)}.get(gguf.split(".")[-2])
    return None if rows is None else np.swapaxes(w, -1, -2)[..., rows, :]


__all__ = ["check_config", "hparams", "layer_types", "reference_view", "rewrite_tensors"]
