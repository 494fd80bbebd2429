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
    width = max(len(k) for k in d["columns"])
    lines = ["ggufkit demo:", *(f"  {i}. {step}" for i, step in enumerate(d["steps"], 1)), "",
             table(rows, list(d["columns"]), align="lrrrrr"), "",
             *(f"  {name.ljust(width)}  {meaning}" for name, meaning in d["columns"].items())]
    if d["kept"]:
        lines += ["", f"files kept in {d['workdir']}"]
    return "\n".join(lines)


@click.command("demo")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the checkpoint and GGUF files here (default: a temporary directory, removed).")
@click.option("--steps", type=click.IntRange(min=0), default=60, show_default=True,
              help="Training steps of the tiny model (0: random weights).")
@common_options
def demo(workdir: Path | None, steps: int, out: Output) -> None:
    """Build a tiny LLaMA checkpoint (tokenizer and model trained for a few seconds on the bundled text),
    then run the whole pipeline on it: convert to F16, quantize to every type ggufkit's quantizer has (one
    file per type, --pure) and to the Q4_K_M preset, set general.name in place, and score every file
    (perplexity, KL divergence against F16). The report says what each step and each column means.

    Needs PyTorch (pip install torch==2.13.0). Nothing is downloaded.

    \b
    Example:
      ggufkit demo
      ggufkit demo --workdir ./demo-out --json
    """
    from ggufkit.demo import COLUMNS, describe, rows_as_dicts, run_demo

    with tempfile.TemporaryDirectory(prefix="ggufkit-demo-") as tmp:
        target = workdir or Path(tmp)
        target.mkdir(parents=True, exist_ok=True)
        rows = run_demo(target, train_steps=steps, progress=out.progress(), on_stage=out.info)
        out.result({"workdir": str(target), "kept": workdir is not None, "steps": describe(steps, rows),
                    "columns": COLUMNS, "rows": rows_as_dicts(rows)}, _render)
