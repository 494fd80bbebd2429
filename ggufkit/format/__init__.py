"""GGUF file format I/O: the hardened lazy reader, the streaming atomic writer, typed metadata values."""

from ggufkit.format.atomic import atomic_write
from ggufkit.format.reader import GGUFFile, GGUFModel, KVField, TensorInfo
from ggufkit.format.shards import open_gguf
from ggufkit.format.values import Metadata, TypedValue
from ggufkit.format.writer import NullProgress, Progress, TensorSpec, write_gguf

__all__ = [
    "GGUFFile",
    "GGUFModel",
    "KVField",
    "Metadata",
    "NullProgress",
    "Progress",
    "TensorInfo",
    "TensorSpec",
    "TypedValue",
    "atomic_write",
    "open_gguf",
    "write_gguf",
]
