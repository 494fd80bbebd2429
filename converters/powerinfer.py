"""PowerInfer predictors: validate a predictor directory and plan its ``blk.N.fc1/fc2`` tensors.

A predictor directory holds ``model_0.pt`` ... ``model_{L-1}.pt`` (``torch.save``d state dicts with exactly
``fc1.weight`` [r_N, n_embd] and ``fc2.weight`` [n_ff, r_N]) and optionally ``config.json`` with
``sparse_threshold`` (PowerInfer convert.py: the predictor merge). PowerInfer's loader checks almost none of this
(fc2 is requested with a wildcard first dimension, so nothing about it is checked), so every rule is
checked here, before any output exists.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ggufkit.converters.checkpoint import load_torch_state_dict, torch_to_numpy
from ggufkit.errors import CheckpointError

_MODEL_FILE = re.compile(r"^model_(\d+)\.pt$")
#: Activations of the ReLU-family models PowerInfer's sparse graphs assume.
RELU_ACTIVATIONS = frozenset({"relu"})


@dataclass(frozen=True)
class Predictor:
    """A validated predictor directory."""

    directory: Path
    files: tuple[Path, ...]  # one per layer, in layer order
    ranks: tuple[int, ...]
    n_embd: int
    n_ff: int
    sparse_threshold: float | None

    def tensors(self) -> list[tuple[str, tuple[int, ...], str, Path, str]]:
        """(gguf name, numpy shape, source dtype, file, key) for every fc1/fc2, layer by layer."""
        out: list[tuple[str, tuple[int, ...], str, Path, str]] = []
        for bid, (file, r) in enumerate(zip(self.files, self.ranks)):
            out.append((f"blk.{bid}.fc1.weight", (r, self.n_embd), "F32", file, "fc1.weight"))
            out.append((f"blk.{bid}.fc2.weight", (self.n_ff, r), "F32", file, "fc2.weight"))
        return out


def check_activation(config: Mapping[str, Any]) -> None:
    """Refuse a base model whose FFN activation is not ReLU: its predictors would be meaningless."""
    act = config.get("hidden_act", config.get("activation_function"))
    if act not in RELU_ACTIVATIONS:
        raise CheckpointError(f"--predictor needs a ReLU-family model (ReluLLaMA, ProSparse, Bamboo, OPT); "
                              f"config.json has activation {act!r}")


def read_predictor(directory: Path, key: str, file: Path) -> Any:
    """One predictor weight as float32 numpy."""
    import numpy as np

    state = load_torch_state_dict(file)
    arr = torch_to_numpy(state[key])
    if arr.dtype == np.uint16:  # bf16 bits
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32, copy=False)


def load_predictor(directory: Path, *, n_layer: int, n_embd: int, n_ff: int) -> Predictor:
    """Validate ``directory`` against the base model's shape.

    Raises:
        CheckpointError: a layer file is missing or extra, a state dict has other keys than fc1/fc2.weight,
            a shape disagrees with n_embd / n_ff, the ranks of fc1 and fc2 differ, or config.json is bad.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError("predictor directory not found", path=directory)
    found: dict[int, Path] = {}
    for p in directory.iterdir():
        if p.suffix in (".pt", ".pth", ".bin"):
            m = _MODEL_FILE.match(p.name)
            if m is None:
                raise CheckpointError(f"unexpected predictor file {p.name} (expected model_N.pt)", path=directory)
            found[int(m.group(1))] = p
    missing = [i for i in range(n_layer) if i not in found]
    extra = sorted(i for i in found if i >= n_layer)
    if missing:
        raise CheckpointError(f"predictor layers missing for blocks {missing[:10]} (the model has {n_layer})",
                              path=directory)
    if extra:
        raise CheckpointError(f"predictor has files for blocks {extra[:10]} but the model has only {n_layer}",
                              path=directory)
    ranks = []
    for i in range(n_layer):
        state = load_torch_state_dict(found[i])
        if set(state) != {"fc1.weight", "fc2.weight"}:
            raise CheckpointError(f"expected exactly fc1.weight and fc2.weight, found {sorted(state)}",
                                  path=found[i])
        fc1, fc2 = tuple(state["fc1.weight"].shape), tuple(state["fc2.weight"].shape)
        if len(fc1) != 2 or fc1[1] != n_embd:
            raise CheckpointError(f"fc1.weight has shape {list(fc1)}, expected [rank, n_embd={n_embd}]",
                                  path=found[i])
        if len(fc2) != 2 or fc2[0] != n_ff:
            raise CheckpointError(f"fc2.weight has shape {list(fc2)}, expected [n_ff={n_ff}, rank]", path=found[i])
        if fc2[1] != fc1[0]:
            raise CheckpointError(f"ranks disagree: fc1 has {fc1[0]} rows, fc2 {fc2[1]} columns", path=found[i])
        ranks.append(fc1[0])
    threshold = None
    config_path = directory / "config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"unreadable: {exc}", path=config_path) from None
        value = config.get("sparse_threshold") if isinstance(config, dict) else None
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise CheckpointError(f"sparse_threshold must be a number, got {value!r}", path=config_path)
            threshold = float(value)
    return Predictor(directory, tuple(found[i] for i in range(n_layer)), tuple(ranks), n_embd, n_ff, threshold)


def predictor_threshold(predictor: Path) -> float | None:
    """``sparse_threshold`` from the predictor directory's config.json, if any."""
    path = Path(predictor) / "config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text(encoding="utf-8")).get("sparse_threshold")
    return None if value is None else float(value)

