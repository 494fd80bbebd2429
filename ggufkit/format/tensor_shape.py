"""Tensor shapes: the one definition of a shape's element count."""

from __future__ import annotations

import math
from collections.abc import Iterable


def n_elements(dims: Iterable[int]) -> int:
    """Elements in a tensor of these dimensions (any order: ggml's ``ne`` or numpy's shape), as an exact
    Python int; 1 for a scalar shape ``()``."""
    return math.prod(int(d) for d in dims)
