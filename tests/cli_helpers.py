"""Run the real console entry point (``ggufkit.cli.main``: error table, exit codes) under click's CliRunner.

``CliRunner().invoke(cli, ...)`` would call the click group directly, bypassing ``run_cli``, so errors
would surface as exceptions instead of one-line messages and exit codes.
"""

from __future__ import annotations

from typing import Any

from click.testing import CliRunner, Result

from ggufkit.cli import main


class _ConsoleScript:
    """What CliRunner needs of a command: a name and ``main(args=..., prog_name=...)``."""

    name = "ggufkit"

    def main(self, args: Any = (), prog_name: str | None = None, **extra: Any) -> None:
        main(list(args))


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    """Run ``ggufkit ARGS...`` as the console script would; stdout and stderr are kept apart."""
    return CliRunner().invoke(_ConsoleScript(), list(args), env=env)  # type: ignore[arg-type]
