"""Options shared by several commands, defined once so a flag has one meaning and one help text."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import click

from ggufkit.cli._output import Output

F = TypeVar("F", bound=Callable[..., Any])


JSON_HELP = "Print exactly one JSON object on stdout instead of text."


def common_options(func: F) -> F:
    """--json, --quiet and --debug. The command body receives ``out: Output`` instead of them
    (--debug is read by the error handler, ``ggufkit.cli._errors``)."""

    @functools.wraps(func)
    def wrapper(*args: Any, json_mode: bool, quiet: bool, debug: bool, **kwargs: Any) -> Any:
        return func(*args, out=Output(json_mode=json_mode, quiet=quiet), **kwargs)

    wrapper = click.option("--debug", is_flag=True, help="Show the traceback of an error (also GGUFKIT_DEBUG=1).")(wrapper)
    wrapper = click.option("--quiet", "-q", is_flag=True, help="No progress bars or status lines.")(wrapper)
    wrapper = click.option("--json", "json_mode", is_flag=True, help=JSON_HELP)(wrapper)
    return wrapper  # type: ignore[return-value]


dry_run_option = click.option("--dry-run", is_flag=True, help="Show what would be done and write nothing.")

threads_option = click.option("--threads", "-t", type=click.IntRange(min=1), default=None,
                              help="CPU threads for kernels (default: all cores). Output bytes do not depend on it.")

device_option = click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
                             show_default=True, help="Where kernels run: CUDA when available with auto.")

batch_option = click.option("--batch", "-b", type=click.IntRange(min=1), default=None,
                            help="Chunks per forward pass (default: 2048 tokens' worth).")

IMATRIX_HELP = "Importance matrix from llama-imatrix or `ggufkit imatrix` (GGUF or legacy .dat){use}."


def imatrix_option(use: str = "") -> Callable[[F], F]:
    """--imatrix FILE (an existing file; the command receives ``imatrix: str | None``, None when absent).

    Args:
        use: what the command does with it, appended to the one help text (e.g. ", instead of collecting
            one"); empty for the plain meaning.
    """
    return click.option("--imatrix", "imatrix", type=click.Path(dir_okay=False, exists=True, path_type=str),
                        default=None, help=IMATRIX_HELP.format(use=use))


kv_cache_option = click.option(
    "--kv-cache", type=click.Choice(["f16", "f32"]), default="f16", show_default=True,
    help="With --ggml-rounding: f16 follows llama.cpp's default (F16 K/V cache, flash attention), f32 its "
         "-fa off -ctk f32 -ctv f32.")


def parse_size(text: str) -> int:
    """``5G``, ``500M``, ``4096``: decimal units as llama.cpp's --split-max-size (1G = 10^9 bytes)."""
    units = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    t = text.strip().upper().removesuffix("B")
    mult = 1
    if t and t[-1] in units:
        mult = units[t[-1]]
        t = t[:-1]
    try:
        value = float(t)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a size such as 500M or 5G") from None
    if value <= 0:
        raise click.BadParameter("size must be positive")
    return int(value * mult)


class SizeParam(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except click.BadParameter as exc:
            self.fail(str(exc.message), param, ctx)
