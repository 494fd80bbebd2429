"""Value types that llama.cpp's loader expects for well-known metadata keys.

llama.cpp reads these keys with a type check (``llama_model_loader::get_key`` throws "key has wrong type"),
so a file whose ``{arch}.context_length`` is an i32 instead of a u32 does not load. ``ggufkit verify``
reports such keys, and ``ggufkit set-meta`` uses this table to type a new key that has no ``--type``.
Key names come from ``gguf.Keys``; the types are those gguf-py's ``GGUFWriter.add_*`` methods write.
"""

from __future__ import annotations

from gguf import Keys

from ggufkit.format.values import VT, type_label

#: (value type, array item type or None)
TypeSpec = tuple[VT, "VT | None"]

_U32: TypeSpec = (VT.UINT32, None)
_I32: TypeSpec = (VT.INT32, None)
_F32: TypeSpec = (VT.FLOAT32, None)
_BOOL: TypeSpec = (VT.BOOL, None)
_STR: TypeSpec = (VT.STRING, None)
_U16: TypeSpec = (VT.UINT16, None)

# Per-layer hparams may be one u32 or an array with one value per layer (llama.cpp get_key_or_arr).
_U32_OR_ARRAY: tuple[TypeSpec, ...] = (_U32, (VT.ARRAY, VT.UINT32), (VT.ARRAY, VT.INT32))

_FIXED: dict[str, tuple[TypeSpec, ...]] = {
    Keys.General.ARCHITECTURE: (_STR,),
    Keys.General.ALIGNMENT: (_U32,),
    Keys.General.QUANTIZATION_VERSION: (_U32,),
    Keys.General.FILE_TYPE: (_U32,),
    Keys.General.NAME: (_STR,),
    Keys.General.TYPE: (_STR,),
    Keys.Tokenizer.MODEL: (_STR,),
    Keys.Tokenizer.PRE: (_STR,),
    Keys.Tokenizer.LIST: ((VT.ARRAY, VT.STRING),),
    Keys.Tokenizer.TOKEN_TYPE: ((VT.ARRAY, VT.INT32),),
    Keys.Tokenizer.SCORES: ((VT.ARRAY, VT.FLOAT32),),
    Keys.Tokenizer.MERGES: ((VT.ARRAY, VT.STRING),),
    Keys.Tokenizer.BOS_ID: (_U32,),
    Keys.Tokenizer.EOS_ID: (_U32,),
    Keys.Tokenizer.EOT_ID: (_U32,),
    Keys.Tokenizer.EOM_ID: (_U32,),
    Keys.Tokenizer.UNK_ID: (_U32,),
    Keys.Tokenizer.SEP_ID: (_U32,),
    Keys.Tokenizer.PAD_ID: (_U32,),
    Keys.Tokenizer.MASK_ID: (_U32,),
    Keys.Tokenizer.ADD_BOS: (_BOOL,),
    Keys.Tokenizer.ADD_EOS: (_BOOL,),
    Keys.Tokenizer.ADD_PREFIX: (_BOOL,),
    Keys.Tokenizer.CHAT_TEMPLATE: (_STR,),
    Keys.Split.LLM_KV_SPLIT_NO: (_U16,),
    Keys.Split.LLM_KV_SPLIT_COUNT: (_U16,),
    Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT: (_I32,),
}

#: Architecture-specific keys, as ``gguf.Keys`` templates containing ``{arch}``.
_PER_ARCH: dict[str, tuple[TypeSpec, ...]] = {
    Keys.LLM.VOCAB_SIZE: (_U32,),
    Keys.LLM.CONTEXT_LENGTH: (_U32,),
    Keys.LLM.EMBEDDING_LENGTH: (_U32,),
    Keys.LLM.BLOCK_COUNT: (_U32,),
    Keys.LLM.FEED_FORWARD_LENGTH: _U32_OR_ARRAY,
    Keys.LLM.USE_PARALLEL_RESIDUAL: (_BOOL,),
    Keys.LLM.EXPERT_COUNT: (_U32,),
    Keys.LLM.EXPERT_USED_COUNT: (_U32,),
    Keys.Attention.HEAD_COUNT: _U32_OR_ARRAY,
    Keys.Attention.HEAD_COUNT_KV: _U32_OR_ARRAY,
    Keys.Attention.KEY_LENGTH: (_U32,),
    Keys.Attention.VALUE_LENGTH: (_U32,),
    Keys.Attention.LAYERNORM_EPS: (_F32,),
    Keys.Attention.LAYERNORM_RMS_EPS: (_F32,),
    Keys.Attention.CLAMP_KQV: (_F32,),
    Keys.Attention.CAUSAL: (_BOOL,),
    Keys.Rope.DIMENSION_COUNT: (_U32,),
    Keys.Rope.FREQ_BASE: (_F32,),
    Keys.Rope.SCALING_TYPE: (_STR,),
    Keys.Rope.SCALING_FACTOR: (_F32,),
    Keys.Rope.SCALING_ORIG_CTX_LEN: (_U32,),
}


def expected_types(key: str, arch: str | None) -> tuple[TypeSpec, ...] | None:
    """The value types llama.cpp accepts for ``key`` (None: not a well-known key).

    Args:
        key: the metadata key.
        arch: the file's ``general.architecture`` (for ``{arch}.*`` keys), or None.
    """
    fixed = _FIXED.get(key)
    if fixed is not None:
        return fixed
    if arch:
        for template, types in _PER_ARCH.items():
            if template.format(arch=arch) == key:
                return types
    return None


def types_label(types: tuple[TypeSpec, ...]) -> str:
    """``u32 or array[u32]``: the accepted types in words."""
    return " or ".join(type_label(t, i) for t, i in types)
