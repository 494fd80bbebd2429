"""``ggufkit demo``: a thin shell over :func:`ggufkit.demo.run_demo`."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from ggufkit.cli._options import common_options
from ggufkit.cli._output import Output, human_bytes, table


def _render(d: Mapping[str, Any]) -> str:
    rows = [(r["type"].upper(), human_bytes(r["bytes"]), f"{r['bits_per_weight']:.3f}",
             f"{r['ppl']:.3f} +/- {r['ppl_error']:.3f}",
             "-" if r["mean_kld"] is None else f"{r['mean_kld']:.5f}",
             "-" if r["same_top_p"] is None else f"{100 * r['same_top_p']:.1f}%") for r in d["rows"]]
    note = f"\nfiles kept in {d['workdir']}" if d["kept"] else ""
    return table(rows, ["type", "size", "bits/weight", "ppl", "mean KLD vs F16", "same top"],
                 align="lrrrrr") + note


@click.command("demo")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the checkpoint and GGUF files here (default: a temporary directory, removed).")
@click.option("--steps", type=click.IntRange(min=0), default=60, show_default=True,
              help="Training steps of the tiny model (0: random weights).")
@common_options
def demo(workdir: Path | None, steps: int, out: Output) -> None:
    """Build a tiny LLaMA checkpoint (tokenizer and model trained for a few seconds on the bundled text),
    then run the whole pipeline on it: convert to F16, quantize to Q8_0, Q4_0, Q4_1, Q4_K_S and Q4_K_M,
    set general.name in place, and score every file (perplexity, KL divergence against F16).

    Needs PyTorch (pip install torch==2.13.0). Nothing is downloaded.

    \b
    Example:
      ggufkit demo
      ggufkit demo --workdir ./demo-out --json
    """
    from ggufkit.demo import rows_as_dicts, run_demo

    with tempfile.TemporaryDirectory(prefix="ggufkit-demo-") as tmp:
        target = workdir or Path(tmp)
        target.mkdir(parents=True, exist_ok=True)
        rows = run_demo(target, train_steps=steps, progress=out.progress(), on_stage=out.info)
        out.result({"workdir": str(target), "kept": workdir is not None, "rows": rows_as_dicts(rows)}, _render)
