"""``ggufkit demo``: a thin shell over :func:`ggufkit.demo.run_demo`."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from ggufkit.cli._options import common_options
from ggufkit.cli._output import Output, human_bytes, table

#: How long ``ggufkit demo`` takes on a 2-core machine (CI's): the first run compiles the Numba kernels. Measured
#: as CPU time (an upper bound of the wall time on an idle 2-core machine; the measuring one was shared):
#: 624 s with an empty NUMBA_CACHE_DIR, 167 s for the next run.
FIRST_RUN = "10 minutes"
LATER_RUNS = "3 minutes"


def _kld(value: float | None) -> str:
    """A mean KLD with three significant digits (``0.0123``, ``4.56e-05``): a fixed number of decimals would
    print a small nonzero KLD as 0.00000 beside a same-top share below 100 %."""
    return "-" if value is None else f"{value:.3g}"


def _share(value: float | None) -> str:
    """A share in per cent with one decimal, never rounded up to 100.0 % when it is not all."""
    if value is None:
        return "-"
    text = f"{100 * value:.1f}%"
    return f"{math.floor(1000 * value) / 10:.1f}%" if value < 1 and text == "100.0%" else text


def _render(d: Mapping[str, Any]) -> str:
    rows = [(r["type"], human_bytes(r["bytes"]), f"{r['bits_per_weight']:.3f}",
             f"{r['ppl']:.3f} +/- {r['ppl_error']:.3f}", _kld(r["mean_kld"]),
             _share(r["same_top_p"])) for r in d["rows"]]
    width = max(len(k) for k in d["columns"])
    lines = ["ggufkit demo:", *(f"  {i}. {step}" for i, step in enumerate(d["steps"], 1)), "",
             table(rows, list(d["columns"]), align="lrrrrr"), "",
             *(f"  {name.ljust(width)}  {meaning}" for name, meaning in d["columns"].items())]
    if d["kept"]:
        lines += ["", f"files kept in {d['workdir']}"]
    else:
        lines += ["", "the files were made in a temporary folder and removed; keep them with --workdir DIR"]
    return "\n".join(lines)


_HELP = f"""Build a tiny LLaMA checkpoint (tokenizer and model trained for a few seconds on the bundled text),
then run the whole pipeline on it: convert to F16, quantize to every type ggufkit's quantizer has (one
file per type, --pure) and to the Q4_K_M preset, set general.name in place, and score every file
(perplexity, KL divergence against F16). The report says what each step and each column means.

The first run compiles ggufkit's kernels (Numba; cached for later runs): about {FIRST_RUN} in all on
2 CPU cores, later runs about {LATER_RUNS}. The files are made in a temporary folder and removed at the
end; --workdir DIR keeps them.

Needs PyTorch (pip install torch==2.13.0). Nothing is downloaded.

\b
Example:
  ggufkit demo
  ggufkit demo --workdir ./demo-out --json
"""


@click.command("demo", help=_HELP)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the checkpoint and GGUF files here (default: a temporary directory, removed). It may "
                   "hold other files, never one the demo would overwrite (a previous demo's are reused).")
@click.option("--steps", type=click.IntRange(min=0), default=60, show_default=True,
              help="Training steps of the tiny model (0: random weights).")
@common_options
def demo(workdir: Path | None, steps: int, out: Output) -> None:
    """``ggufkit demo`` (its help is :data:`_HELP`)."""
    from ggufkit.demo import COLUMNS, demo_targets, describe, refuse_foreign_files, rows_as_dicts, run_demo

    if workdir is not None:
        refuse_foreign_files(workdir, demo_targets())  # before any work (run_demo checks again)
    out.info(f"ggufkit demo: the first run compiles ggufkit's kernels (Numba, cached for later runs), about "
             f"{FIRST_RUN} in all on 2 CPU cores; later runs about {LATER_RUNS}. "
             + (f"Files go to {workdir} (--workdir)." if workdir is not None else
                "Files go to a temporary folder, removed at the end; --workdir DIR keeps them."))
    with tempfile.TemporaryDirectory(prefix="ggufkit-demo-") as tmp:
        target = workdir or Path(tmp)
        target.mkdir(parents=True, exist_ok=True)
        rows = run_demo(target, train_steps=steps, progress=out.progress(), on_stage=out.info)
        out.result({"workdir": str(target), "kept": workdir is not None, "steps": describe(steps, rows),
                    "columns": COLUMNS, "rows": rows_as_dicts(rows)}, _render)
