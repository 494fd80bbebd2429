"""libmtmd through llama-cpp-python's bindings (``llama_cpp.mtmd_cpp``): encode one RGB image with a text GGUF and
a projector GGUF, as llama-mtmd-cli does before decoding (tools/mtmd/mtmd.cpp: mtmd_tokenize, mtmd_encode_chunk)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

#: llama_flash_attn_type (llama.h): -1 auto, 0 disabled, 1 enabled.
FLASH_ATTN_TYPE = -1


def mtmd_image_embeddings(text_gguf: Path, mmproj_gguf: Path, rgb: np.ndarray) -> list[np.ndarray]:
    """The embeddings of each image chunk libmtmd makes of ``rgb`` (uint8 ``[height, width, 3]``): one
    ``[n_tokens, n_embd]`` float32 array per chunk (several where the model cuts images into tiles)."""
    import llama_cpp
    from llama_cpp import mtmd_cpp as m

    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(text_gguf).encode(), mparams)
    assert model, f"llama.cpp could not load {text_gguf}"
    try:
        # the input width: Qwen3-VL appends its deepstack features to each image embedding (llama.h)
        n_embd = llama_cpp.llama_model_n_embd_inp(model)
        params = m.mtmd_context_params_default()
        params.use_gpu = False
        params.n_threads = 1
        params.print_timings = False
        params.warmup = False
        params.flash_attn_type = FLASH_ATTN_TYPE
        ctx = m.mtmd_init_from_file(str(mmproj_gguf).encode(), model, params)
        assert ctx, f"libmtmd could not load {mmproj_gguf}"
        try:
            h, w, _ = rgb.shape
            data = np.ascontiguousarray(rgb, dtype=np.uint8)
            buf = (ctypes.c_uint8 * data.size).from_buffer_copy(data.tobytes())
            bitmap = m.mtmd_bitmap_init(w, h, buf)
            chunks = m.mtmd_input_chunks_init()
            text = m.mtmd_input_text()
            marker = m.mtmd_default_marker()
            text.text = marker
            text.text_len = len(marker)
            text.add_special = False
            text.parse_special = True
            bitmaps = (m.mtmd_bitmap_p_ctypes * 1)(bitmap)
            rc = m.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1)
            assert rc == 0, f"mtmd_tokenize returned {rc}"
            out: list[np.ndarray] = []
            for i in range(m.mtmd_input_chunks_size(chunks)):
                chunk = m.mtmd_input_chunks_get(chunks, i)
                if m.mtmd_input_chunk_get_type(chunk) != m.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    continue
                n_tokens = m.mtmd_input_chunk_get_n_tokens(chunk)
                assert m.mtmd_encode_chunk(ctx, chunk) == 0
                embd = m.mtmd_get_output_embd(ctx)
                out.append(np.ctypeslib.as_array(embd, shape=(n_tokens * n_embd,)).copy().reshape(n_tokens, n_embd))
            m.mtmd_input_chunks_free(chunks)
            m.mtmd_bitmap_free(bitmap)
            assert out, "no image chunk"
            return out
        finally:
            m.mtmd_free(ctx)
    finally:
        llama_cpp.llama_model_free(model)
