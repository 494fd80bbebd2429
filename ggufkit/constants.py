"""What the ``gguf`` package does not define: PowerInfer's additions and ggufkit's own keys.

Everything else (value types, tensor types, block sizes, ``Keys``, ``MODEL_ARCH``, tensor-name tables)
is imported from ``gguf`` where it is used, never copied.
"""

from __future__ import annotations

from typing import Final

#: Magic of a standard GGUF file (bytes 0..3).
GGUF_MAGIC: Final = b"GGUF"
#: PowerInfer's magic: the same layout as GGUF v3; the loader switches to sparse inference on it alone
#: (PowerInfer ggml.c: gguf_init_from_file).
POWERINFER_MAGIC: Final = b"PWRI"
KNOWN_MAGICS: Final = (GGUF_MAGIC, POWERINFER_MAGIC)

#: GGUF versions this reader accepts. Version 1 used 32-bit counts and is obsolete.
SUPPORTED_VERSIONS: Final = (2, 3)
#: Default data alignment when ``general.alignment`` is absent (ggml GGUF_DEFAULT_ALIGNMENT).
DEFAULT_ALIGNMENT: Final = 32
#: ggml's GGML_MAX_DIMS.
MAX_DIMS: Final = 4
#: ggml's GGML_MAX_NAME: a tensor name must be shorter than this many bytes.
MAX_TENSOR_NAME_BYTES: Final = 64

# --- PowerInfer (its llama.cpp: LLM_ARCH_NAMES, LLM_KV_NAMES, LLM_TENSOR_NAMES) --------------------
#: Architecture strings that exist only in PowerInfer's loader.
POWERINFER_ARCH_OPT: Final = "opt"
POWERINFER_ARCH_BAMBOO: Final = "bamboo"
#: FLOAT32; the predictor score threshold below which a neuron is skipped.
KEY_POWERINFER_SPARSE_THRESHOLD: Final = "powerinfer.sparse_threshold"
#: Per-layer tensors PowerInfer adds: predictor fc1/fc2 and the transposed down projection.
TENSOR_POWERINFER_FC1: Final = "blk.{bid}.fc1"
TENSOR_POWERINFER_FC2: Final = "blk.{bid}.fc2"
TENSOR_POWERINFER_FFN_DOWN_T: Final = "blk.{bid}.ffn_down_t"

# --- ggufkit's own keys -------------------------------------------------------------------------
#: STRING of spaces, reserved so later header edits can happen in place (see docs in README "Slack").
KEY_SLACK: Final = "ggufkit.slack"
#: Default size of the slack string in bytes.
DEFAULT_SLACK_BYTES: Final = 4096
#: Provenance keys written by ggufkit (all STRING).
KEY_TOOL_VERSION: Final = "ggufkit.version"
KEY_SOURCE_SHA256: Final = "ggufkit.source.sha256"
KEY_SOURCE_REPO: Final = "ggufkit.source.repo"
KEY_SOURCE_REVISION: Final = "ggufkit.source.revision"
KEY_QUANT_RECIPE: Final = "ggufkit.quantize.recipe"
KEY_IMATRIX_SHA256: Final = "ggufkit.quantize.imatrix_sha256"
