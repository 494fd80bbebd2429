"""The one output sink of every command.

Human text by default, exactly one JSON document on stdout with ``--json``. Logs, warnings and progress
bars go to stderr; progress bars only when stdout and stderr are terminals and ``--quiet`` is not set.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import click
import numpy as np

from ggufkit.units import human_bytes  # noqa: F401 - re-exported for the commands


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return [_jsonable(v) for v in obj.tolist()]
    if isinstance(obj, np.generic):
        return _jsonable(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, bytes):
        return obj.decode("latin-1")
    if hasattr(obj, "__fspath__"):
        return str(obj)
    return obj


class TqdmProgress:
    """A tqdm bar on stderr implementing :class:`ggufkit.format.Progress`."""

    def __init__(self) -> None:
        self._bar: Any = None

    def begin(self, total: int, unit: str, desc: str) -> None:
        from tqdm import tqdm

        self.end()
        scale = unit == "B"
        self._bar = tqdm(total=total, unit=unit, unit_scale=scale, unit_divisor=1024 if scale else 1000,
                         desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def end(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def write(self, line: str) -> None:
        """Print ``line`` on stdout above the bar: tqdm clears the bar, writes the line, then redraws it."""
        from tqdm import tqdm

        tqdm.write(line, file=sys.stdout)


class Output:
    """Renders a command's result as human text or JSON, and owns its progress bars and warnings."""

    def __init__(self, json_mode: bool = False, quiet: bool = False) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        self._bar: TqdmProgress | None = None  # the bar progress() handed out, if any
        self._partial = False  # stream() left a line unfinished

    def result(self, data: Mapping[str, Any], human: str | Callable[[Mapping[str, Any]], str] | None = None,
               brief: Callable[[Mapping[str, Any]], str] | None = None) -> None:
        """Print the command's result: ``data`` as JSON, or ``human`` (text or a renderer of ``data``).

        With ``--quiet`` only ``brief``'s text is printed (a command's final figure, e.g. ``ppl``'s final
        estimate: quiet, not mute), or nothing without it.

        The JSON document of every command starts with ``"ok"``: true when the command exits 0, false when
        it exits non-zero (a failed gate or check, an invalid file, an error); ``data`` sets it to false.
        """
        if self.json_mode:
            click.echo(json.dumps(_jsonable({"ok": True, **data}), ensure_ascii=False))
            return
        if self.quiet:
            human = brief
        text = human(data) if callable(human) else human
        if text:
            click.echo(text.rstrip("\n"))

    def echo(self, text: str) -> None:
        """Streaming human output on stdout (suppressed with --json and --quiet)."""
        if not (self.json_mode or self.quiet):
            click.echo(text, nl=False)

    def stream(self, value: str, sep: str = ",") -> None:
        """A streamed value on stdout (suppressed with --json and --quiet), e.g. llama-perplexity's ``[1]x,``.

        Without a progress bar the values share a line, each followed by ``sep``; with a bar on the
        terminal each value gets its own line printed above the bar, because the bar's redraws (``\r`` on
        the same terminal) would overwrite a partial line.
        """
        if self.json_mode or self.quiet:
            return
        if self._bar is not None:
            self._bar.write(value)
        else:
            click.echo(value + sep, nl=False)
            self._partial = not sep.endswith("\n")

    def end_stream(self) -> None:
        """Finish the line :meth:`stream` left open, if any."""
        if self._partial and not (self.json_mode or self.quiet):
            click.echo("")
        self._partial = False

    def info(self, message: str) -> None:
        """A status line on stderr (suppressed with --quiet)."""
        if not self.quiet:
            click.echo(message, err=True)

    def warn(self, message: str) -> None:
        """A warning on stderr (always shown)."""
        click.echo(f"ggufkit: warning: {message}", err=True)

    def progress(self) -> Any:
        """A progress reporter: a bar on interactive terminals, otherwise one that does nothing."""
        from ggufkit.format.writer import NullProgress

        if self.quiet or self.json_mode or not (sys.stdout.isatty() and sys.stderr.isatty()):
            return NullProgress()
        self._bar = TqdmProgress()
        return self._bar


def table(rows: Iterable[Sequence[Any]], headers: Sequence[str], align: str = "") -> str:
    """A plain-text table; ``align`` has one char per column, 'r' for right-aligned."""
    body = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in body:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))

    def fmt(cells: Sequence[str]) -> str:
        out = []
        for i, c in enumerate(cells):
            right = i < len(align) and align[i] == "r"
            out.append(c.rjust(widths[i]) if right else c.ljust(widths[i]))
        return "  ".join(out).rstrip()

    lines = [fmt(headers), fmt(["-" * w for w in widths])]
    lines.extend(fmt(r) for r in body)
    return "\n".join(lines)
