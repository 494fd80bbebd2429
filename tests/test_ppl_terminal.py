"""``ggufkit ppl`` as a user sees it on a terminal, and its warning for a context beyond the trained one.

The terminal test runs the real console entry point in a pseudo-terminal (stdout and stderr on the same pty,
as in an interactive shell, so the progress bar is shown), records every byte written to it, and replays
them through a minimal terminal (carriage return, newline, cursor up, erase to end of line) to get the
screen a user is left with.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import invoke
from eval_models import N_VOCAB, make_hf_model, write_model_gguf

CTX = 32


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ppl_tty")
    tokens = np.random.default_rng(1).integers(3, N_VOCAB, 4 * CTX + 3).tolist()
    (d / "tokens.txt").write_text(" ".join(map(str, tokens)))
    model = write_model_gguf(make_hf_model("llama", seed=3), "llama", d / "f32.gguf")
    short = d / "ctx16.gguf"
    r = invoke("set-meta", str(model), "llama.context_length=16", "-o", str(short))
    assert r.exit_code == 0, r.output
    return {"model": model, "short_ctx": short, "tokens": d / "tokens.txt"}


def render(data: bytes, width: int = 100) -> list[str]:
    """The screen left by ``data`` on a terminal ``width`` columns wide (lines wrap at the edge)."""
    screen: list[list[str]] = [[]]
    row = col = 0
    text = data.decode("utf-8", errors="replace")
    i = 0
    while i < len(text):
        c = text[i]
        esc = re.match(r"\x1b\[(\??)(\d*)([A-Za-z])", text[i:])
        if esc:
            n = int(esc.group(2) or 1)
            if esc.group(3) == "A":
                row = max(0, row - n)
            elif esc.group(3) == "K":
                del screen[row][col:]
            i += len(esc.group(0))
            continue
        if c == "\r":
            col = 0
        elif c == "\n":
            row += 1
            col = 0
        else:
            if col >= width:
                row, col = row + 1, 0
            while len(screen) <= row:
                screen.append([])
            line = screen[row]
            line.extend(" " * (col + 1 - len(line)))
            line[col] = c
            col += 1
        while len(screen) <= row:
            screen.append([])
        i += 1
    return ["".join(line).rstrip() for line in screen]


def run_on_terminal(*args: str, width: int = 100) -> tuple[int, bytes]:
    """Run ``ggufkit ARGS`` with stdout and stderr on one pseudo-terminal; returns (exit code, bytes)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, width, 0, 0))
    env = {**os.environ, "COLUMNS": str(width), "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "ggufkit", *args], stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=600), b"".join(chunks)


def test_running_values_stay_readable_beside_the_progress_bar_on_a_terminal(files):
    code, data = run_on_terminal("ppl", str(files["model"]), "--tokens", str(files["tokens"]), "--ctx", str(CTX),
                                 "--device", "cpu")
    assert code == 0, data.decode(errors="replace")[-2000:]
    assert b"perplexity" in data and b"|" in data  # the bar was drawn on this terminal
    screen = [line for line in render(data) if line.strip()]
    values = [line for line in screen if line.startswith("[")]
    # Each running value is intact, on its own line, and nothing of the bar is left on the screen.
    assert [re.fullmatch(r"\[(\d+)\]\d+\.\d{4}", v) is not None for v in values] == [True] * 4, screen
    assert [int(v[1:v.index("]")]) for v in values] == [1, 2, 3, 4]
    last = float(values[-1].split("]")[1])
    assert any(line.startswith(f"Final estimate: PPL = {last:.4f} +/- ") for line in screen), screen
    assert not any("%|" in line for line in screen), screen


def test_without_a_terminal_the_values_share_one_line_as_in_llama_perplexity(files):
    r = invoke("ppl", str(files["model"]), "--tokens", str(files["tokens"]), "--ctx", str(CTX), "--device", "cpu")
    assert r.exit_code == 0, r.stderr
    assert re.fullmatch(r"(\[\d\]\d+\.\d{4},){4}", r.stdout.splitlines()[0])


def test_ctx_beyond_the_trained_context_warns_once_on_stderr_and_in_json(files):
    args = ["ppl", str(files["short_ctx"]), "--tokens", str(files["tokens"]), "--ctx", str(CTX), "--device", "cpu"]
    r = invoke(*args)
    assert r.exit_code == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "warning" in line]
    assert len(lines) == 1 and "--ctx 32" in lines[0] and "llama.context_length = 16" in lines[0]
    r = invoke(*args, "--json")
    d = json.loads(r.stdout)
    assert len(d["warnings"]) == 1 and "trained context" in d["warnings"][0]
    assert r.stderr.count("trained context") == 1
    ok = invoke("ppl", str(files["model"]), "--tokens", str(files["tokens"]), "--ctx", str(CTX), "--device",
                "cpu", "--json")
    assert json.loads(ok.stdout)["warnings"] == [] and "warning" not in ok.stderr
