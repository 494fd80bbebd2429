"""What a target search (``--target-size``/``--target-bpw``/``--target-like``) does by default with a model:
whether ``--sensitivity auto`` measures the KLD sensitivity.

This module imports neither Numba nor PyTorch: the CLI builds ``--help`` from it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ggufkit.errors import UsageError

#: ``--sensitivity auto`` measures the KLD sensitivity only up to this many weights: the measurement runs the
#: model about 15 times on the CPU, and unattended runs stay bounded (a 70B model's passes would take hours).
AUTO_SENSITIVITY_MAX_WEIGHTS = 4_000_000_000

#: The ``--sensitivity`` choices: measured for the estimated KLD of the report only (estimate), also to weigh
#: the search (search), not measured (off), or :func:`resolve_sensitivity`'s choice (auto).
SENSITIVITY_CHOICES = ("auto", "off", "estimate", "search")


def resolve_sensitivity(model: str | Path, sensitivity: str, calibration_text: str | Path | None, *,
                        max_weights: int = AUTO_SENSITIVITY_MAX_WEIGHTS) -> tuple[str, list[str]]:
    """``sensitivity`` with ``auto`` made concrete, and the warnings to show.

    ``auto`` is ``search`` when PyTorch is installed and the model has at most ``max_weights`` weights or a
    calibration text is given, else ``off`` (with a warning when only the model's size decided it).

    Args:
        model: the GGUF model the search quantizes (opened only for ``auto`` with PyTorch installed).
        sensitivity: one of :data:`SENSITIVITY_CHOICES`.
        calibration_text: the text the sensitivity is measured on, or None for the bundled sample.
        max_weights: the largest model ``auto`` measures.

    Returns:
        ``(sensitivity, warnings)``: ``off``, ``estimate`` or ``search``, and one line per warning.

    Raises:
        UsageError: a calibration text without PyTorch (under ``auto``), or with ``off``.
    """
    warnings: list[str] = []
    if sensitivity == "auto":
        if importlib.util.find_spec("torch") is None:
            if calibration_text is not None:
                raise UsageError("--calibration-text needs PyTorch (pip install 'ggufkit[torch]')")
            sensitivity = "off"
        else:
            from ggufkit.format import open_gguf

            with open_gguf(model) as m:
                n_weights = sum(t.n_elements for t in m.tensors)
            small = n_weights <= max_weights
            sensitivity = "search" if small or calibration_text is not None else "off"
            if sensitivity == "off":
                warnings.append(f"{n_weights / 1e9:.1f}B weights: the KLD sensitivity is not measured by default "
                                f"above {max_weights / 1e9:.0f}B (--sensitivity search measures it)")
    if sensitivity == "off" and calibration_text is not None:
        raise UsageError("--calibration-text is read only by the KLD sensitivity (not with --sensitivity off)")
    return sensitivity, warnings
