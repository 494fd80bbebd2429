"""Ernie 4.5 hooks (``Ernie4_5ForCausalLM`` -> ``ernie4_5``, ``Ernie4_5_MoeForCausalLM`` -> ``ernie4_5-moe``):
the keys a release config.json leaves to transformers' defaults, and refusals of what llama.cpp's ernie4_5 graphs
would compute differently (conversion/ernie.py; src/models/ernie4-5.cpp, ernie4-5-moe.cpp).

llama.cpp's converter reads the config through AutoConfig (conversion/base.py ModelBase.load_hparams), so a key a
release config.json leaves out reaches it as Ernie4_5Config's / Ernie4_5_MoeConfig's default: the dense
class's ``head_dim`` 128 (not ``hidden_size / num_attention_heads``: __post_init__ derives that only from an
explicit null; the MoE class has no such field and its attention takes hidden / heads unless the config.json names
one), rope theta 500000 and the MoE fields below. ggufkit parses config.json itself and fills the same defaults.

The shared expert: transformers builds it ``moe_intermediate_size * moe_num_shared_experts`` wide
(Ernie4_5_MoeSparseMoeBlock); llama.cpp's converter writes ``intermediate_size // num_key_value_heads``
(Ernie4_5MoeModel.set_gguf_parameters), the same number for every released model (12288 // 4 = 2 * 1536; 29568 //
8 = 3 * 1232) and a width its loader rejects otherwise. ggufkit writes the width of the tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ggufkit.errors import UnsupportedArchitectureError
from ggufkit.format.values import VT

#: Ernie4_5Config / Ernie4_5_MoeConfig defaults of the keys release configs may leave out.
HEAD_DIM = 128
ROPE_THETA = 500000.0
MOE_DEFAULTS = {"moe_num_experts": 64, "moe_k": 6, "moe_layer_start_index": 1, "moe_layer_end_index": -1,
                "moe_layer_interval": 1, "moe_num_shared_experts": 2, "moe_intermediate_size": 1536}


def _moe(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") == "ernie4_5_moe" or "Ernie4_5_MoeForCausalLM" in (
        config.get("architectures") or [])


def _get(config: Mapping[str, Any], key: str) -> Any:
    value = config.get(key)
    return MOE_DEFAULTS[key] if value is None else value


def head_dim(config: Mapping[str, Any]) -> int:
    """The head size transformers builds: ``head_dim``; without the key 128 (Ernie4_5Config) or hidden / heads
    (Ernie4_5_MoeAttention's getattr default); null: hidden / heads (Ernie4_5Config.__post_init__)."""
    if "head_dim" not in config and not _moe(config):
        return HEAD_DIM
    if config.get("head_dim") is None:
        return int(config["hidden_size"]) // int(config["num_attention_heads"])
    return int(config["head_dim"])


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse what llama.cpp's ernie4_5 loaders and graphs cannot represent: projection biases (they load only
    ``attn_output.bias`` and run the FFN without biases), another activation than SiLU, and MoE layers other than
    every layer from ``moe_layer_start_index`` on (llama_model_ernie4_5::load_arch_tensors gives each of those
    layers experts, whatever the interval and end index say)."""
    arch = "ernie4_5-moe" if _moe(config) else "ernie4_5"
    problems = []
    if config.get("use_bias") is True:
        problems.append("use_bias true (llama.cpp's ernie4_5 graphs have no q/k/v or FFN biases)")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.get('hidden_act')} (llama.cpp's graphs use SiLU)")
    if _moe(config):
        n_layer = int(config["num_hidden_layers"])
        interval, start = int(_get(config, "moe_layer_interval")), int(_get(config, "moe_layer_start_index"))
        end = int(_get(config, "moe_layer_end_index"))
        if interval != 1:
            problems.append(f"moe_layer_interval {interval} (llama.cpp's loader gives every layer from "
                            "moe_layer_start_index experts)")
        if end not in (-1, n_layer - 1):
            problems.append(f"moe_layer_end_index {end} of {n_layer} layers (llama.cpp's loader gives every layer "
                            "from moe_layer_start_index experts)")
        if not 0 <= start < n_layer:
            problems.append(f"moe_layer_start_index {start} of {n_layer} layers")
    if problems:
        raise UnsupportedArchitectureError(f"{arch}: llama.cpp would compute another model: " + "; ".join(problems))


def hparams(config: Mapping[str, Any], values: dict[str, tuple[VT, Any]],
            tensor_names: tuple[str, ...]) -> dict[str, tuple[VT, Any]]:
    """Key and value lengths (``head_dim`` as transformers reads it), rope theta when the config has none, and
    (MoE) the shared expert's width (module docstring).

    Raises:
        UnsupportedArchitectureError: a PaddlePaddle-layout checkpoint (:func:`check_paddle_layout`).
    """
    arch = "ernie4_5-moe" if _moe(config) else "ernie4_5"
    check_paddle_layout(arch, tensor_names)
    out = dict(values)
    if out and "num_attention_heads" in config:  # empty for --vocab-only
        if not _moe(config) or config.get("head_dim") is not None:  # the MoE loader's default is hidden / heads
            out[f"{arch}.attention.key_length"] = (VT.UINT32, head_dim(config))
            out[f"{arch}.attention.value_length"] = (VT.UINT32, head_dim(config))
        out.setdefault(f"{arch}.rope.freq_base", (VT.FLOAT32, ROPE_THETA))
        if _moe(config) and int(_get(config, "moe_num_shared_experts")) > 0:
            width = int(_get(config, "moe_num_shared_experts")) * int(_get(config, "moe_intermediate_size"))
            out[f"{arch}.expert_shared_feed_forward_length"] = (VT.UINT32, width)
    return out


def check_paddle_layout(arch: str, tensor_names: tuple[str, ...]) -> None:
    """Refuse Baidu's ``-Paddle`` releases: PaddlePaddle's layout, tensors under ``ernie.`` with q/k/v fused into
    ``qkv_proj`` and gate/up into ``up_gate_proj``, every linear weight stored [in, out] (``nn.Linear``'s layout
    in Paddle; the ``-PT`` releases hold the same weights as transformers lays them out). llama.cpp's converter
    renames ``ernie.`` to ``model.`` but splits the fused weights along their first axis as transformers'
    [out, in] (conversion/ernie.py Ernie4_5Model.filter_tensors, modify_tensors), so on these files it stops with
    a torch error; there is no llama.cpp file to match, and the ``-PT`` release converts."""
    paddle = sorted(n for n in tensor_names if n.startswith("ernie."))
    if paddle:
        raise UnsupportedArchitectureError(
            f"{arch}: a PaddlePaddle-layout checkpoint ({paddle[0]} and {len(paddle) - 1} more tensors under "
            "'ernie.', fused qkv_proj/up_gate_proj, weights stored [in, out]), as Baidu's -Paddle releases ship "
            "it; llama.cpp's converter cannot read it either: convert the PyTorch release of the same model, the "
            "-PT repository (e.g. baidu/ERNIE-4.5-0.3B-PT for baidu/ERNIE-4.5-0.3B-Paddle)")


Raw = tuple[str, str, str, tuple[int, ...], str, "str | None"]
#: Ernie4_5MoeModel.modify_tensors yields a block's stacked experts in this order.
_EXPERT_ORDER = {"FFN_GATE_EXP": 0, "FFN_UP_EXP": 1, "FFN_DOWN_EXP": 2}


def rewrite_tensors(raw: list[Raw], loaders: dict[str, Callable[[], Any]], config: Mapping[str, Any]) -> list[Raw]:
    """Each block's stacked experts in llama.cpp's order (gate, up, down: Ernie4_5MoeModel.modify_tensors), and the
    correction bias, a parameter without ``.weight``/``.bias``, as ``exp_probs_b.bias`` (gguf-py's tensor map
    reads the ``_bias`` suffix as ``.bias``)."""
    out = []
    for r in raw:
        name, source, kind, shape, dtype, transform = r
        if kind == "FFN_EXP_PROBS_B" and not name.endswith((".weight", ".bias")):
            if name in loaders:
                loaders[name + ".bias"] = loaders.pop(name)
            r = (name + ".bias", source, kind, shape, dtype, transform)
        out.append(r)
    i = 0
    while i < len(out):  # runs of stacked experts, sorted within the run
        j = i
        while j < len(out) and out[j][2] in _EXPERT_ORDER:
            j += 1
        out[i:j] = sorted(out[i:j], key=lambda r: _EXPERT_ORDER[r[2]])
        i = j + 1 if j == i else j
    return out
