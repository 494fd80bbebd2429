"""Every planned tensor's shape against what llama.cpp's loader will expect from the hyperparameters.

llama.cpp's loader (src/llama-model.cpp, ``llama_model::load_tensors``: ``create_tensor(tn(LLM_TENSOR_...),
{n_embd, n_embd_head_k * n_head}, ...)``) derives every tensor's shape from the GGUF keys, and refuses a
file whose tensors disagree. A checkpoint whose config.json disagrees with its tensors (``hidden_size`` 96,
64-wide weights) would otherwise convert into such a file. The rules here are per ``MODEL_TENSOR`` kind,
not per architecture, and read only the keys the plan will write; a tensor kind without a rule is left to
the loader.

Shapes are numpy order (rows first), the order of the checkpoint's own tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gguf import Keys

from ggufkit.errors import CheckpointError

#: A dimension: (value, how it follows from the hyperparameters); value None matches anything.
_Dim = tuple[int | None, str]
#: Loaders whose FFN widths are not feed_forward_length itself: (numerator, denominator) per kind.
#: Qwen 1 halves it (src/models/qwen.cpp: ffn_gate/ffn_up ``{n_embd, n_ff/2}``); Phi-3's fused gate+up is
#: twice as wide (src/models/phi3.cpp: ffn_up ``{n_embd, 2 * n_ff}``).
_FFN_SCALE: dict[str, dict[str, tuple[int, int]]] = {
    "qwen": {"FFN_UP": (1, 2), "FFN_GATE": (1, 2), "FFN_DOWN": (1, 2)},
    "phi3": {"FFN_UP": (2, 1)},
}
#: Loaders whose q/k norms span the whole q/k projection instead of one head (src/models/olmo2.cpp:
#: attn_q_norm ``{n_embd}``, attn_k_norm ``{n_head_kv * n_embd_head}``).
_WHOLE_QK_NORM = frozenset({"olmo2"})
#: Weights stored transposed (input dimension first), whose bias follows their last dimension.
_TRANSPOSED = frozenset({"FFN_DOWN_T"})

#: Architectures whose full-attention ``attn_q`` holds the query and its sigmoid output gate (rows
#: ``2 * head_count * head_dim``) and whose ``attn_qkv`` is the delta-net's fused q/k/v, not attention's
#: (llama.cpp src/models/qwen3next.cpp, qwen35.cpp: load_arch_tensors create_tensor_qkv(n_embd_head_k * n_head * 2)).
_GATED_Q = frozenset({"qwen3next", "qwen35", "qwen35moe"})


def _value(hp: Mapping[str, tuple[Any, Any]], key: str) -> int | None:
    """A key's integer; a per-layer array's largest entry (hybrid models write head_count_kv and
    feed_forward_length per layer, 0 on layers without attention or FFN)."""
    entry = hp.get(key)
    if entry is None:
        return None
    value = entry[1]
    return max((int(v) for v in value), default=0) if isinstance(value, (list, tuple)) else int(value)


def _rules(arch: str, hp: Mapping[str, tuple[Any, Any]], n_vocab: int | None) -> dict[str, tuple[_Dim, ...]]:
    """MODEL_TENSOR name -> expected weight shape (numpy order), from the keys the plan writes."""
    n_embd = _value(hp, Keys.LLM.EMBEDDING_LENGTH.format(arch=arch))
    n_ff = _value(hp, Keys.LLM.FEED_FORWARD_LENGTH.format(arch=arch))
    n_head = _value(hp, Keys.Attention.HEAD_COUNT.format(arch=arch))
    n_head_kv = _value(hp, Keys.Attention.HEAD_COUNT_KV.format(arch=arch))
    if n_head_kv is None:
        n_head_kv = n_head  # llama.cpp's default
    head_k = _value(hp, Keys.Attention.KEY_LENGTH.format(arch=arch))
    head_v = _value(hp, Keys.Attention.VALUE_LENGTH.format(arch=arch))
    if n_embd is not None and n_head:
        head_k = head_k if head_k is not None else n_embd // n_head  # llama.cpp's n_embd_head_k default
        head_v = head_v if head_v is not None else n_embd // n_head
    # MLA (src/models/deepseek2.cpp): q, o and the decompressed heads are key/value_length_mla wide
    head_k = _value(hp, Keys.Attention.KEY_LENGTH_MLA.format(arch=arch)) or head_k
    head_v = _value(hp, Keys.Attention.VALUE_LENGTH_MLA.format(arch=arch)) or head_v
    n_rot = _value(hp, Keys.Rope.DIMENSION_COUNT.format(arch=arch))

    def product(a: int | None, b: int | None) -> int | None:
        return None if a is None or b is None else a * b

    embd: _Dim = (n_embd, f"embedding_length={n_embd}")

    def ff(kind: str) -> _Dim:
        num, den = _FFN_SCALE.get(arch, {}).get(kind, (1, 1))
        label = f"feed_forward_length={n_ff}" + (f"*{num}" if num > 1 else "") + (f"/{den}" if den > 1 else "")
        return (None if n_ff is None else n_ff * num // den, label)

    vocab: _Dim = (n_vocab, f"n_vocab={n_vocab} (token_embd rows)")
    q: _Dim = (product(n_head, head_k), f"head_count*head_dim={n_head}*{head_k}")
    if arch in _GATED_Q:  # the query and its output gate in one projection
        q = (None if q[0] is None else 2 * q[0], f"2*head_count*head_dim=2*{n_head}*{head_k}")
    k: _Dim = (product(n_head_kv, head_k), f"head_count_kv*head_dim={n_head_kv}*{head_k}")
    v: _Dim = (product(n_head_kv, head_v), f"head_count_kv*head_dim={n_head_kv}*{head_v}")
    o: _Dim = (product(n_head, head_v), f"head_count*head_dim={n_head}*{head_v}")
    qkv_rows = None if q[0] is None or k[0] is None or v[0] is None else q[0] + k[0] + v[0]
    qkv: _Dim = (qkv_rows, f"q+k+v={q[0]}+{k[0]}+{v[0]}") if arch not in _GATED_Q else (None, "")
    head: _Dim = (head_k, f"head_dim={head_k}")
    any_rows: _Dim = (None, "")
    qk_norms = ((q,), (k,)) if arch in _WHOLE_QK_NORM else ((head,), (head,))
    return {
        "TOKEN_EMBD": (vocab, embd), "OUTPUT": (vocab, embd), "POS_EMBD": (any_rows, embd),
        "OUTPUT_NORM": (embd,), "ATTN_NORM": (embd,), "ATTN_NORM_2": (embd,), "FFN_NORM": (embd,),
        "ATTN_Q": (q, embd), "ATTN_K": (k, embd), "ATTN_V": (v, embd), "ATTN_QKV": (qkv, embd),
        "ATTN_OUT": (embd, o), "ATTN_Q_NORM": qk_norms[0], "ATTN_K_NORM": qk_norms[1],
        "FFN_UP": (ff("FFN_UP"), embd), "FFN_GATE": (ff("FFN_GATE"), embd), "FFN_DOWN": (embd, ff("FFN_DOWN")),
        "FFN_DOWN_T": (ff("FFN_DOWN"), embd),  # PowerInfer: ffn_down transposed, one FFN neuron per row
        "ROPE_FREQS": ((None if n_rot is None else n_rot // 2, f"rope.dimension_count/2={n_rot}/2"),),
    }


def check_shapes(arch: str, hp: Mapping[str, tuple[Any, Any]],
                 tensors: Sequence[tuple[str, str, str, tuple[int, ...]]]) -> None:
    """Refuse a plan whose tensors disagree with its hyperparameters.

    Args:
        arch: the GGUF architecture (key prefix).
        hp: the hyperparameter keys the plan writes: full key -> (type, value).
        tensors: (GGUF name, source name, MODEL_TENSOR kind, planned numpy-order shape) of every tensor.

    Raises:
        CheckpointError: the first tensor whose shape differs from the expected one, naming the tensor,
            the expected shape (and the keys it follows from) and the one found.
    """
    emb = next((shape for name, _, kind, shape in tensors if kind == "TOKEN_EMBD" and name.endswith(".weight")),
               None)
    rules = _rules(arch, hp, emb[0] if emb else None)
    for name, source, kind, shape in tensors:
        dims = rules.get(kind)
        if dims is None:
            continue
        if name.endswith(".bias"):
            # one value per output of the weight (its rows; a transposed weight's columns); a norm's, per element
            dims = dims[-1:] if kind in _TRANSPOSED else dims[:1]
        if len(shape) == len(dims) and all(want is None or want == got for (want, _), got in zip(dims, shape)):
            continue
        expected = [want if want is not None else "*" for want, _ in dims]
        why = ", ".join(dict.fromkeys(label for want, label in dims if want is not None))
        raise CheckpointError(f"config.json disagrees with the weights: {source} ({name}) has shape {list(shape)}, "
                              f"llama.cpp expects {expected} from {why}")
