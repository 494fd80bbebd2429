"""The card's plot: file size against mean KLD and against ΔPPL, one point per type (matplotlib, PNG).

Drawn with matplotlib's object API on the Agg canvas (no pyplot, no display, no global state). The PNG
carries no ``Software`` or date chunk, so the same numbers give the same bytes.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any


def render_plot(rows: Sequence[dict[str, Any]], title: str) -> bytes:
    """PNG bytes of the two panels.

    Args:
        rows: one per type: ``type``, ``size`` (bytes), ``mean_kld`` (an upper bound unless ``kld_exact``),
            ``delta_ppl`` (fraction).
        title: the figure's title (the model's name).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = sorted(rows, key=lambda r: (r["size"], r["type"]))  # the line runs from the smallest file up
    fig = Figure(figsize=(10, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    fig.suptitle(title)
    exact = all(r.get("kld_exact", True) for r in rows)
    panels = [("mean_kld", "mean KL divergence vs master (log)" if exact else
               "mean KL divergence vs master, upper bound (log)", True),
              ("delta_ppl", "ΔPPL vs master (%)", False)]
    big = max((r["size"] for r in rows), default=0) >= 2**30
    unit, scale = ("GiB", 2**30) if big else ("MiB", 2**20)
    for i, (key, label, log) in enumerate(panels):
        ax = fig.add_subplot(1, 2, i + 1)
        xs = [r["size"] / scale for r in rows]
        ys = [max(r[key], 1e-6) if log else 100 * r[key] for r in rows]
        ax.plot(xs, ys, "o-", color="tab:blue")
        for r, x, y in zip(rows, xs, ys):
            ax.annotate(r["type"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel(f"file size ({unit})")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()
