"""Numba CPU and CUDA kernels, byte-identical to ggml's, one sub-package per type family.

The shared pieces sit here (:mod:`.fp` float32 primitives, :mod:`.worksharing`, :mod:`.numba_loading`).
Kernels import only each other (and ggufkit.format): never the registry, dispatch, llama_quantize,
target or imatrix layers above them. Callers reach them through :mod:`ggufkit.quant.registry`.
"""
