"""A flag shared by several commands has one definition (``ggufkit/cli/_options.py``): one type, one
default and one help text (at most a per-command ending), as huggingface_hub's CLI shares its option aliases."""

from __future__ import annotations

import click
import pytest

from ggufkit.cli import cli
from ggufkit.cli._options import IMATRIX_HELP, JSON_HELP

COMMANDS = cli.list_commands(click.Context(cli))


def _params(name: str) -> list[tuple[str, click.Option]]:
    found = []
    for command_name in COMMANDS:
        command = cli.get_command(click.Context(cli), command_name)
        assert command is not None
        found += [(command_name, p) for p in command.params if isinstance(p, click.Option) and p.name == name]
    return found


def _same_definition(params: list[tuple[str, click.Option]]) -> None:
    """Flags, type, accepted values and default agree (the help may end per command)."""
    def definition(p: click.Option) -> dict[str, object]:
        return {k: v for k, v in p.to_info_dict().items() if k != "help"}

    (_, first), *rest = params
    for command_name, p in rest:
        assert definition(p) == definition(first), command_name


def test_every_imatrix_option_is_the_shared_one_with_its_help_text() -> None:
    params = _params("imatrix")
    assert {name for name, _ in params} >= {"quantize", "release"}
    _same_definition(params)
    head, tail = IMATRIX_HELP.split("{use}")
    for command_name, p in params:
        assert p.help is not None and p.help.startswith(head) and p.help.endswith(tail), command_name


@pytest.mark.parametrize("name", ["threads", "device", "batch"])
def test_every_threads_device_and_batch_option_is_the_shared_one(name: str) -> None:
    params = _params(name)
    assert params
    _same_definition(params)
    assert len({p.help for _, p in params}) == 1


def test_every_command_has_the_one_json_help() -> None:
    params = _params("json_mode")
    assert {name for name, _ in params} == set(COMMANDS)
    assert {p.help for _, p in params} == {JSON_HELP}
