"""Errors to exit codes and one-line messages, in one table.

Known errors (the ggufkit hierarchy, OS errors on input files, click usage errors) become one line on
stderr ``ggufkit: error: ...`` (click's usage message for usage errors) and exit 2 (bad input or usage) or 1
(a check failed); with ``--json`` the error object ``{"ok": false, "error": {...}}`` is also printed on stdout. ``--debug`` or ``GGUFKIT_DEBUG=1`` shows the traceback. Any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Sequence

import click

from ggufkit.errors import EXIT_BAD_INPUT, EXIT_OK, GGUFKitError

EXIT_INTERRUPTED = 130

#: (exception type, exit code, hint appended to the message); first match wins, subclasses first.
ERROR_TABLE: list[tuple[type[BaseException], int | None, str]] = [
    (GGUFKitError, None, ""),  # exit code from the class
    (FileNotFoundError, EXIT_BAD_INPUT, ""),
    (IsADirectoryError, EXIT_BAD_INPUT, ""),
    (PermissionError, EXIT_BAD_INPUT, ""),
    (MemoryError, EXIT_BAD_INPUT, "the input asks for more memory than this machine has"),
    (OSError, EXIT_BAD_INPUT, ""),
]


def _debug_requested(argv: Sequence[str]) -> bool:
    args = list(argv)
    if "--" in args:
        args = args[: args.index("--")]
    return "--debug" in args or os.environ.get("GGUFKIT_DEBUG", "") not in ("", "0")


def _json_requested(argv: Sequence[str]) -> bool:
    args = list(argv)
    if "--" in args:
        args = args[: args.index("--")]
    return "--json" in args


def describe_error(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, one-line message) for a known error, None for a bug."""
    for etype, code, hint in ERROR_TABLE:
        if isinstance(exc, etype):
            if isinstance(exc, GGUFKitError):
                return exc.exit_code, str(exc)
            if isinstance(exc, OSError) and exc.filename is not None:
                message = f"{exc.filename}: {exc.strerror or exc}"
            else:
                message = str(exc) or type(exc).__name__
            if hint:
                message += f" ({hint})"
            assert code is not None
            return code, message
    return None


def run_cli(group: click.Group, argv: list[str]) -> int:
    """Invoke ``group`` with ``argv``; return the process exit code."""
    debug = _debug_requested(argv)
    try:
        # Without standalone mode click returns a command's ctx.exit(code) / Exit(code) as the value.
        code = group.main(args=argv, prog_name="ggufkit", standalone_mode=False)
        return code if isinstance(code, int) else EXIT_OK
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.ClickException as exc:  # usage errors: unknown option, missing argument, bad value
        exc.show()
        if _json_requested(argv):
            _json_error(type(exc).__name__, " ".join(exc.format_message().split()), int(exc.exit_code))
        return int(exc.exit_code)
    except click.Abort:
        click.echo("ggufkit: aborted", err=True)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        click.echo("ggufkit: interrupted", err=True)
        return EXIT_INTERRUPTED
    except BaseException as exc:
        described = describe_error(exc) if isinstance(exc, Exception) else None
        if described is None:
            raise
        code, message = described
        if debug:
            traceback.print_exc()
        message = " ".join(message.split("\n"))
        click.echo(f"ggufkit: error: {message}", err=True)
        if _json_requested(argv):
            _json_error(type(exc).__name__, message, code)
        return code


def _json_error(type_name: str, message: str, code: int) -> None:
    """The one JSON document of a failed command: ``ok`` false (as in every command's result) and the error."""
    sys.stdout.write(json.dumps({"ok": False, "error": {"type": type_name, "message": message,
                                                        "exit_code": code}}) + "\n")
