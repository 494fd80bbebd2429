"""CLI conventions: errors are one line on stderr with the class's exit code, --json gives one object,
--debug brings the traceback back, and anything outside the error hierarchy keeps its traceback."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
from cli_helpers import invoke
from gguf_builders import valid_raw

import ggufkit.errors as errors_module
from ggufkit.cli import COMMANDS
from ggufkit.cli._errors import ERROR_TABLE
from ggufkit.errors import GGUFKitError

REPO = Path(__file__).resolve().parents[1]


def _all_error_classes() -> list[type[GGUFKitError]]:
    seen: list[type[GGUFKitError]] = []
    todo: list[type[GGUFKitError]] = [GGUFKitError]
    while todo:
        cls = todo.pop()
        if cls.__module__ == errors_module.__name__ and cls not in seen:
            seen.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(seen, key=lambda c: c.__name__)


def _make(name: str) -> BaseException:
    builtins = {"FileNotFoundError": FileNotFoundError(errno.ENOENT, "No such file or directory", "x.gguf"),
                "PermissionError": PermissionError(errno.EACCES, "Permission denied", "x.gguf"),
                "IsADirectoryError": IsADirectoryError(errno.EISDIR, "Is a directory", "x.gguf"),
                "OSError": OSError(errno.EIO, "Input/output error", "x.gguf"),
                "MemoryError": MemoryError(), "RuntimeError": RuntimeError("a bug")}
    if name in builtins:
        return builtins[name]
    return getattr(errors_module, name)("what went wrong")


@click.command("raise-error")
@click.argument("name")
@click.option("--json", "json_mode", is_flag=True)
@click.option("--debug", is_flag=True)
def raise_error(name: str, json_mode: bool, debug: bool) -> None:
    """Test-only command: raise the exception class NAME."""
    raise _make(name)


@pytest.fixture(autouse=True)
def _raise_command(monkeypatch: pytest.MonkeyPatch) -> None:
    # Registered for the test only, the way a real command is: by module path in COMMANDS.
    monkeypatch.setitem(COMMANDS, "raise-error", (f"{__name__}:raise_error", "test only"))


@pytest.mark.parametrize("cls", _all_error_classes(), ids=lambda c: c.__name__)
def test_every_error_class_gives_its_exit_code_and_one_line(cls: type[GGUFKitError]) -> None:
    result = invoke("raise-error", cls.__name__)
    expected = str(_make(cls.__name__))
    assert result.exit_code == cls.exit_code
    assert result.stderr == f"ggufkit: error: {expected}\n"
    assert result.stdout == ""


def test_exit_codes_are_2_for_bad_input_and_1_for_failed_checks() -> None:
    codes = {c.__name__: c.exit_code for c in _all_error_classes()}
    assert codes.pop("CheckFailedError") == 1
    assert set(codes.values()) == {2}


@pytest.mark.parametrize("name, message", [
    ("FileNotFoundError", "x.gguf: No such file or directory"),
    ("PermissionError", "x.gguf: Permission denied"),
    ("IsADirectoryError", "x.gguf: Is a directory"),
    ("OSError", "x.gguf: Input/output error"),
    ("MemoryError", "MemoryError (the input asks for more memory than this machine has)"),
])
def test_every_builtin_entry_of_the_error_table_exits_2(name: str, message: str) -> None:
    assert any(etype.__name__ == name for etype, _, _ in ERROR_TABLE)
    result = invoke("raise-error", name)
    assert result.exit_code == 2 and result.stderr == f"ggufkit: error: {message}\n"


def test_json_mode_error_prints_exactly_one_json_object() -> None:
    result = invoke("raise-error", "UsageError", "--json")
    assert result.exit_code == 2
    assert json.loads(result.stdout) == {"ok": False, "error": {"type": "UsageError", "message": "what went wrong",
                                                                "exit_code": 2}}
    assert len(result.stdout.strip().splitlines()) == 1


def test_debug_flag_and_env_show_the_traceback() -> None:
    for result in (invoke("raise-error", "UsageError", "--debug"),
                   invoke("raise-error", "UsageError", env={"GGUFKIT_DEBUG": "1"})):
        assert result.exit_code == 2 and "Traceback" in result.stderr
        assert result.stderr.rstrip().endswith("ggufkit: error: what went wrong")


def test_an_exception_outside_the_hierarchy_is_a_bug_and_keeps_its_traceback() -> None:
    result = invoke("raise-error", "RuntimeError")
    assert isinstance(result.exception, RuntimeError) and result.exit_code == 1


def test_usage_errors_exit_2() -> None:
    assert invoke("info").exit_code == 2
    assert invoke("set-meta", "--no-such-option", "x.gguf").exit_code == 2
    assert invoke("set-meta", "x.gguf", "no-equals-sign").exit_code == 2


@pytest.fixture
def malformed(tmp_path: Path) -> Path:
    path = tmp_path / "bad.gguf"
    path.write_bytes(valid_raw().build()[:30])
    return path


@pytest.mark.parametrize("command", [["info"], ["set-meta"], ["set-meta", "general.name=x"]])
def test_malformed_file_exits_2_with_one_line_and_no_traceback(malformed: Path, command: list[str]) -> None:
    result = invoke(command[0], str(malformed), *command[1:])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"ggufkit: error: {malformed}: at byte ")
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["info", "verify", "set-meta"])
def test_json_mode_on_a_malformed_file_prints_one_json_object(malformed: Path, command: str) -> None:
    result = invoke(command, str(malformed), "--json")
    assert result.exit_code == 2
    data = json.loads(result.stdout)
    assert data["ok"] is False
    assert len(result.stdout.strip().splitlines()) == 1


def test_verify_of_a_malformed_file_lists_the_problem_and_exits_2(malformed: Path) -> None:
    result = invoke("verify", str(malformed))
    assert result.exit_code == 2 and "INVALID" in result.stdout and "Traceback" not in result.stderr


def test_missing_file_exits_2_with_one_line(tmp_path: Path) -> None:
    result = invoke("info", str(tmp_path / "nope.gguf"))
    assert result.exit_code == 2
    assert result.stderr == f"ggufkit: error: {tmp_path / 'nope.gguf'}: No such file or directory\n"


def test_real_console_script_reports_a_malformed_file_in_one_line(malformed: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "ggufkit", "info", str(malformed)], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("ggufkit: error: ") and proc.stdout == ""
