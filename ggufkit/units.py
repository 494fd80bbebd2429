"""How sizes and small figures are printed, in one place for the CLI, the model card and the demo."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """Bytes in binary units, the one size unit of every command and card: ``4.86 MiB``, ``512 B``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
