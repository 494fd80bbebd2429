"""The ``ggufkit`` command: a click group whose subcommands are imported only when run.

Each command lives in its own module (``ggufkit/cli/<name>.py``) as a thin shell over the Python API.
``ggufkit --help`` imports none of them, so it loads neither numba nor torch.
"""

from __future__ import annotations

import importlib
import sys

import click

from ggufkit import __version__

#: name -> (module:attribute, one-line help shown by ``ggufkit --help``)
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("ggufkit.cli.info:info", "Show a GGUF file's header, metadata and tensors."),
    "verify": ("ggufkit.cli.verify:verify", "Validate a GGUF file's structure; optionally hash its tensors."),
    "set-meta": ("ggufkit.cli.set_meta:set_meta", "Set, delete or rename metadata keys, in place when possible."),
    "quantize": ("ggufkit.cli.quantize:quantize", "Quantize a GGUF file (byte-identical to llama-quantize)."),
    "convert": ("ggufkit.cli.convert:convert", "Convert a Hugging Face checkpoint to GGUF."),
    "ppl": ("ggufkit.cli.ppl:ppl", "Measure perplexity (and KL divergence against a baseline)."),
    "imatrix": ("ggufkit.cli.imatrix:imatrix", "Collect an importance matrix (as llama-imatrix), combine or convert."),
    "release": ("ggufkit.cli.release:release", "Make a model's whole GGUF release: quants, imatrix, quality table, card."),
    "demo": ("ggufkit.cli.demo:demo", "Build a tiny model and run the whole pipeline on it."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target[0].split(":")
        command: click.Command = getattr(importlib.import_module(module_name), attr)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, help_) for name, (_, help_) in COMMANDS.items()])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="ggufkit")
def cli() -> None:
    """Turn Hugging Face checkpoints into GGUF files for llama.cpp-family runtimes, quantize them
    byte-identically to llama.cpp, edit their metadata and measure their perplexity.

    Every command accepts --json (one JSON object on stdout), --quiet and --debug. Exit codes: 0 ok,
    1 a check or quality gate failed, 2 bad input or usage.

    \b
    Example:
      ggufkit convert ./my-hf-model -o model-f16.gguf
      ggufkit quantize model-f16.gguf model-q4_k_m.gguf --type q4_k_m
      ggufkit ppl model-q4_k_m.gguf --baseline model-f16.gguf --max-kld 0.05
    """


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the CLI and turn errors into one-line messages and exit codes."""
    from ggufkit.cli._errors import run_cli

    sys.exit(run_cli(cli, sys.argv[1:] if argv is None else argv))
