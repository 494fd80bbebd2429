"""Builders for the quantizer tests: tiny llama GGUF files, imatrix files in both formats, and the oracle,
``llama_cpp.llama_model_quantize`` (llama-cpp-python 0.3.36) called through its ctypes binding.

The models are written with ggufkit's own writer, with llama's real hparam keys and a real (truncated)
SentencePiece vocabulary copied from llama.cpp's ``models/ggml-vocab-llama-spm.gguf``, so llama.cpp loads
them; weights are seeded random normals, with a few deliberately awkward rows (all zero, constant, huge).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from llama_cpp_sources import vocab_dir

from ggufkit.format import Metadata, TensorSpec, open_gguf, write_gguf
from ggufkit.format.values import VT

QT = GGMLQuantizationType
_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
                   "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                   "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token")


def llama_tensor_shapes(n_embd: int, n_ff: int, n_layer: int, n_vocab: int, n_head_kv_dim: int,
                        tied: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy-order shape) of a llama model, in convert_hf_to_gguf's order."""
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (n_vocab, n_embd))]
    for i in range(n_layer):
        out += [(f"blk.{i}.attn_norm.weight", (n_embd,)),
                (f"blk.{i}.attn_q.weight", (n_embd, n_embd)),
                (f"blk.{i}.attn_k.weight", (n_head_kv_dim, n_embd)),
                (f"blk.{i}.attn_v.weight", (n_head_kv_dim, n_embd)),
                (f"blk.{i}.attn_output.weight", (n_embd, n_embd)),
                (f"blk.{i}.ffn_norm.weight", (n_embd,)),
                (f"blk.{i}.ffn_gate.weight", (n_ff, n_embd)),
                (f"blk.{i}.ffn_up.weight", (n_ff, n_embd)),
                (f"blk.{i}.ffn_down.weight", (n_embd, n_ff))]
    out.append(("output_norm.weight", (n_embd,)))
    if not tied:
        out.append(("output.weight", (n_vocab, n_embd)))
    return out


def make_llama_gguf(path: Path, *, n_embd: int = 256, n_ff: int = 512, n_layer: int = 2, n_head: int = 4,
                    n_head_kv: int = 2, n_vocab: int = 512, tied: bool = False, dtype: QT = QT.F16,
                    seed: int = 0) -> Path:
    """Write a tiny llama GGUF (F32 or F16 matrices, F32 norms) and return its path."""
    rng = np.random.default_rng(seed)
    vocab = open_gguf(vocab_dir() / "ggml-vocab-llama-spm.gguf")
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, "llama")
    meta.set("general.name", VT.STRING, "tiny-llama")
    meta.set("llama.block_count", VT.UINT32, n_layer)
    meta.set("llama.context_length", VT.UINT32, 256)
    meta.set("llama.embedding_length", VT.UINT32, n_embd)
    meta.set("llama.feed_forward_length", VT.UINT32, n_ff)
    meta.set("llama.attention.head_count", VT.UINT32, n_head)
    meta.set("llama.attention.head_count_kv", VT.UINT32, n_head_kv)
    meta.set("llama.attention.layer_norm_rms_epsilon", VT.FLOAT32, 1e-5)
    meta.set("llama.rope.dimension_count", VT.UINT32, n_embd // n_head)
    meta.set("general.file_type", VT.UINT32, 1 if dtype == QT.F16 else 0)
    meta.set("llama.vocab_size", VT.UINT32, n_vocab)
    for key in _TOKENIZER_KEYS:
        meta.put(key, vocab.kv[key])
    # The first n_vocab pieces of LLaMA's vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then merges.
    meta.set("tokenizer.ggml.tokens", VT.ARRAY, vocab.get("tokenizer.ggml.tokens")[:n_vocab], VT.STRING)
    meta.set("tokenizer.ggml.scores", VT.ARRAY, np.array(vocab.get("tokenizer.ggml.scores")[:n_vocab]), VT.FLOAT32)
    meta.set("tokenizer.ggml.token_type", VT.ARRAY, np.array(vocab.get("tokenizer.ggml.token_type")[:n_vocab]),
             VT.INT32)
    vocab.close()
    head_dim = n_embd // n_head
    specs, arrays = [], []
    for name, shape in llama_tensor_shapes(n_embd, n_ff, n_layer, n_vocab, head_dim * n_head_kv, tied):
        if len(shape) == 1:
            arr = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            specs.append(TensorSpec(name, QT.F32, shape))
        else:
            arr = (0.02 * rng.standard_t(5, size=shape)).astype(np.float32)
            arr[0, :64] = 0.0                      # an all-zero block (Q4_0 stores d = -0.0)
            arr[1, :32] = 0.125                     # a constant block
            arr[2, 5] = -3.0                        # a block whose max |x| is negative
            arr[-1, :] *= 1e-4                      # a row of tiny weights
            specs.append(TensorSpec(name, dtype, shape))
            arr = arr.astype(np.float16) if dtype == QT.F16 else arr
        arrays.append(arr)
    write_gguf(path, meta, specs, arrays, slack_bytes=0)
    return path


def make_gguf(path: Path, arch: str, hparams: Mapping[str, bool | int | float], tensors: list[tuple[str, tuple[int, ...]]],
              *, seed: int = 0) -> Path:
    """A GGUF of any architecture: ``<arch>.<key>`` hparams (bool, ints as u32, floats as f32), F16 matrices
    (experts as 3-D), F32 vectors, seeded random data. Enough for llama_model_quantize, which reads only
    the hparams."""
    rng = np.random.default_rng(seed)
    meta = Metadata()
    meta.set("general.architecture", VT.STRING, arch)
    for key, value in hparams.items():
        vtype = VT.BOOL if isinstance(value, bool) else VT.FLOAT32 if isinstance(value, float) else VT.UINT32
        meta.set(f"{arch}.{key}", vtype, value)
    specs, arrays = [], []
    for name, shape in tensors:
        arr = (0.02 * rng.standard_normal(shape)).astype(np.float32)
        dtype = QT.F32 if len(shape) == 1 else QT.F16
        specs.append(TensorSpec(name, dtype, shape))
        arrays.append(arr if dtype == QT.F32 else arr.astype(np.float16))
    write_gguf(path, meta, specs, arrays, slack_bytes=0)
    return path


def arch_case(arch: str, n_layer: int = 8, d: int = 256, ff: int = 256, n_exp: int = 8
              ) -> tuple[str, dict[str, bool | int | float], list[tuple[str, tuple[int, ...]]]]:
    """(GGUF arch, hparams, tensors) of a tiny ``gptneox``, ``qwen2``, ``smollm3``, ``cohere2`` or ``mixtral``
    (llama with experts) model, with the tensor names convert_hf_to_gguf writes for it."""
    base = {"context_length": 256, "embedding_length": d, "block_count": n_layer, "feed_forward_length": ff,
            "attention.head_count": 4}
    vec, mat = (d,), (d, d)
    top = [("token_embd.weight", (256, d)), ("output_norm.weight", vec), ("output.weight", (256, d))]
    if arch == "gptneox":  # fused QKV, biases, LayerNorm
        hp = {**base, "rope.dimension_count": 16, "attention.layer_norm_epsilon": 1e-5,
              "use_parallel_residual": True}
        top.append(("output_norm.bias", vec))
        per = [("attn_norm.weight", vec), ("attn_norm.bias", vec), ("attn_qkv.weight", (3 * d, d)),
               ("attn_qkv.bias", (3 * d,)), ("attn_output.weight", mat), ("attn_output.bias", vec),
               ("ffn_norm.weight", vec), ("ffn_norm.bias", vec), ("ffn_up.weight", (ff, d)), ("ffn_up.bias", (ff,)),
               ("ffn_down.weight", (d, ff)), ("ffn_down.bias", vec)]
    elif arch == "qwen2":  # biases on q/k/v, tied embeddings
        hp = {**base, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-6}
        top = top[:2]
        per = [("attn_norm.weight", vec), ("attn_q.weight", mat), ("attn_q.bias", vec),
               ("attn_k.weight", (d // 2, d)), ("attn_k.bias", (d // 2,)), ("attn_v.weight", (d // 2, d)),
               ("attn_v.bias", (d // 2,)), ("attn_output.weight", mat), ("ffn_norm.weight", vec),
               ("ffn_gate.weight", (ff, d)), ("ffn_up.weight", (ff, d)), ("ffn_down.weight", (d, ff))]
    elif arch == "smollm3":  # llama's layout under its own architecture, tied embeddings (as released)
        hp = {**base, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-6,
              "rope.dimension_count": 64}
        top = top[:2]
        per = [("attn_norm.weight", vec), ("attn_q.weight", mat), ("attn_k.weight", (d // 2, d)),
               ("attn_v.weight", (d // 2, d)), ("attn_output.weight", mat), ("ffn_norm.weight", vec),
               ("ffn_gate.weight", (ff, d)), ("ffn_up.weight", (ff, d)), ("ffn_down.weight", (d, ff))]
    elif arch == "cohere2":  # one bias-free LayerNorm per block (no ffn_norm), tied embeddings; the keys its
        # loader requires (src/models/cohere2.cpp load_arch_hparams)
        hp = {**base, "attention.head_count_kv": 2, "attention.layer_norm_epsilon": 1e-5,
              "rope.dimension_count": 64, "attention.sliding_window": 8, "logit_scale": 0.25}
        top = top[:2]
        per = [("attn_norm.weight", vec), ("attn_q.weight", mat), ("attn_k.weight", (d // 2, d)),
               ("attn_v.weight", (d // 2, d)), ("attn_output.weight", mat), ("ffn_gate.weight", (ff, d)),
               ("ffn_up.weight", (ff, d)), ("ffn_down.weight", (d, ff))]
    else:  # llama with 8 experts (Mixtral layout): 3-D expert tensors, an unquantized router
        hp = {**base, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-5,
              "rope.dimension_count": 64, "expert_count": n_exp, "expert_used_count": 2}
        per = [("attn_norm.weight", vec), ("attn_q.weight", mat), ("attn_k.weight", (d // 2, d)),
               ("attn_v.weight", (d // 2, d)), ("attn_output.weight", mat), ("ffn_norm.weight", vec),
               ("ffn_gate_inp.weight", (n_exp, d)), ("ffn_gate_exps.weight", (n_exp, ff, d)),
               ("ffn_up_exps.weight", (n_exp, ff, d)), ("ffn_down_exps.weight", (n_exp, d, ff))]
    tensors = top + [(f"blk.{i}.{n}", s) for i in range(n_layer) for n, s in per]
    return ("llama" if arch == "mixtral" else arch), hp, tensors


def write_imatrix_gguf(path: Path, entries: Mapping[str, tuple[np.ndarray, np.ndarray]], *,
                       datasets: tuple[str, ...] = ("calibration.txt",), chunk_count: int = 10,
                       chunk_size: int = 512) -> Path:
    """A GGUF imatrix laid out as llama-imatrix's ``save_imatrix`` writes it.

    ``entries``: name -> (sums f32[n_mat, ne0], counts f32[n_mat]); tensors ``<name>.in_sum2`` (ne = [ne0,
    n_mat]) and ``<name>.counts`` (ne = [1, n_mat]), names sorted.
    """
    meta = Metadata()
    meta.set("general.type", VT.STRING, "imatrix")
    meta.set("imatrix.datasets", VT.ARRAY, list(datasets), VT.STRING)
    meta.set("imatrix.chunk_count", VT.UINT32, chunk_count)
    meta.set("imatrix.chunk_size", VT.UINT32, chunk_size)
    specs, arrays = [], []
    for name in sorted(entries):
        sums, counts = entries[name]
        sums = np.asarray(sums, dtype=np.float32).reshape(len(counts), -1)
        specs.append(TensorSpec(f"{name}.in_sum2", QT.F32, sums.shape))
        arrays.append(sums)
        specs.append(TensorSpec(f"{name}.counts", QT.F32, (len(counts), 1)))
        arrays.append(np.asarray(counts, dtype=np.float32).reshape(-1, 1))
    write_gguf(path, meta, specs, arrays, slack_bytes=0)
    return path


def write_imatrix_dat(path: Path, entries: Mapping[str, tuple[int, np.ndarray]], *, chunk_count: int = 10,
                      dataset: str = "calibration.txt") -> Path:
    """A legacy ``.dat`` imatrix as ``save_imatrix_legacy`` writes it: name -> (ncall, values)."""
    parts = [struct.pack("<i", len(entries))]
    for name in sorted(entries):
        ncall, values = entries[name]
        raw = name.encode()
        values = np.asarray(values, dtype="<f4")
        parts += [struct.pack("<i", len(raw)), raw, struct.pack("<ii", ncall, values.size), values.tobytes()]
    parts += [struct.pack("<i", chunk_count), struct.pack("<i", len(dataset.encode())), dataset.encode()]
    path.write_bytes(b"".join(parts))
    return path


def imatrix_values(path: Path, *, seed: int = 1) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Random positive sums and counts for every 2-D/3-D weight of the model at ``path`` (output.weight
    too); one row of sums and one count per expert for 3-D tensors."""
    rng = np.random.default_rng(seed)
    out = {}
    with open_gguf(path) as m:
        for t in m.tensors:
            if len(t.ne) >= 2:
                n_mat = t.ne[2] if len(t.ne) >= 3 else 1
                counts = rng.integers(1, 4000, size=n_mat).astype(np.float32)
                sums = (rng.gamma(0.5, 2.0, size=(n_mat, t.ne[0])) * counts[:, None]).astype(np.float32)
                out[t.name] = (sums, counts)
    return out


_FTYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q4_k_s": 14, "q4_k_m": 15, "q4_k": 15,
           "q5_k_s": 16, "q5_k_m": 17, "q5_k": 17, "q6_k": 18, "f16": 1, "bf16": 32, "f32": 0}


def llama_quantize(inp: Path, out: Path, target: str, *, pure: bool = False, nthread: int = 2,
                   imatrix: Mapping[str, np.ndarray] | None = None, kv: Mapping[str, str | int] | None = None,
                   allow_requantize: bool = False, leave_output_tensor: bool = False,
                   tensor_types: tuple[tuple[str, QT], ...] = (), output_tensor_type: QT | None = None,
                   token_embedding_type: QT | None = None) -> None:
    """The oracle: ``llama_model_quantize`` with the same options llama-quantize would pass.

    ``imatrix`` holds the already-normalised per-column values (what quantize.cpp's load_imatrix produces);
    ``kv`` the KV overrides quantize.cpp adds for an imatrix (str or int values).
    """
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = _FTYPES[target]
    params.nthread = nthread
    params.pure = pure
    params.allow_requantize = allow_requantize
    params.quantize_output_tensor = not leave_output_tensor
    if output_tensor_type is not None:
        params.output_tensor_type = int(output_tensor_type)
    if token_embedding_type is not None:
        params.token_embedding_type = int(token_embedding_type)
    keep: list[object] = []
    if imatrix:
        arr = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, values) in enumerate(imatrix.items()):
            v = np.ascontiguousarray(values, dtype=np.float32)
            keep += [v, name.encode()]
            arr[i].name = keep[-1]
            arr[i].data = v.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            arr[i].size = v.size
        arr[len(imatrix)].name = None
        keep.append(arr)
        params.imatrix = arr
    if kv:
        kvs = (llama_cpp.llama_model_kv_override * (len(kv) + 1))()
        for i, (key, value) in enumerate(kv.items()):
            kvs[i].key = key.encode()
            if isinstance(value, str):
                kvs[i].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR
                kvs[i].value.val_str = value.encode()[:127]
            else:
                kvs[i].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT
                kvs[i].value.val_i64 = value
        kvs[len(kv)].key = b""
        keep.append(kvs)
        params.kv_overrides = kvs
    if tensor_types:
        tts = (llama_cpp.llama_model_tensor_override * (len(tensor_types) + 1))()
        for i, (pattern, qtype) in enumerate(tensor_types):
            keep.append(pattern.encode())
            tts[i].pattern = keep[-1]
            tts[i].type = int(qtype)
        tts[len(tensor_types)].pattern = None
        keep.append(tts)
        params.tt_overrides = tts
    rc = llama_cpp.llama_model_quantize(str(inp).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed with {rc} for {inp} -> {target}")


def assert_same_quantized(ref: Path, ours: Path) -> None:
    """llama-quantize's ``ref`` and ggufkit's ``ours`` hold the same tensors (order, names, types, bytes) and the
    same metadata in the same order, ``ggufkit.*`` keys aside on both sides (ggufkit's converter writes them into
    the input, llama-quantize copies them, ggufkit's quantizer writes its own)."""
    with open_gguf(ref) as a, open_gguf(ours) as b:
        assert [(t.name, t.ggml_type, t.ne) for t in a.tensors] == [(t.name, t.ggml_type, t.ne) for t in b.tensors]
        for ta, tb in zip(a.tensors, b.tensors):
            assert bytes(a.raw(ta)) == bytes(b.raw(tb)), f"bytes differ in {ta.name} ({ta.ggml_type.name})"
        keys = [k for k in a.kv if not k.startswith("ggufkit.")]
        assert keys == [k for k in b.kv if not k.startswith("ggufkit.")]
        for key in keys:
            assert a.kv[key].type == b.kv[key].type, key
            if not key.startswith("tokenizer."):  # arrays (hybrid schedules, M-RoPE sections) item by item
                assert np.array_equal(np.asarray(a.get(key)), np.asarray(b.get(key))), key
