"""``ggufkit set-meta``: a thin shell over :func:`ggufkit.metadata_edit.edit_metadata`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import click

from ggufkit.cli._options import common_options, dry_run_option
from ggufkit.cli._output import Output


def _pairs(values: tuple[str, ...], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not {what}")
        out[key] = value
    return out


def _render(d: Mapping[str, Any]) -> str:
    lines = []
    for c in d["changes"]:
        if c["op"] == "delete":
            lines.append(f"- {c['key']} ({c['old_type']}) = {json.dumps(c['old'], ensure_ascii=False)}")
        elif c["op"] == "rename":
            lines.append(f"~ {c['key']} -> {c['new_key']}")
        else:
            old = "(new)" if c["op"] == "add" else f"{json.dumps(c['old'], ensure_ascii=False)} ({c['old_type']})"
            lines.append(f"{'+' if c['op'] == 'add' else '~'} {c['key']}: {old} -> "
                         f"{json.dumps(c['new'], ensure_ascii=False)} ({c['new_type']})")
    verb = {"in_place": "edited in place", "rewrite": f"rewrote {d['output']}", "unchanged": "unchanged"}[d["mode"]]
    lines.append(("dry run, would be: " if d["dry_run"] else "") + verb + (f" ({d['reason']})" if d["reason"] else ""))
    return "\n".join(lines)


@click.command("set-meta")
@click.argument("file", type=click.Path(dir_okay=False, path_type=str))
@click.argument("assignments", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--type", "types", multiple=True, metavar="KEY=TYPE",
              help="Type of a set key: u8 i8 u16 i16 u32 i32 u64 i64 f32 f64 bool str, or array[TYPE].")
@click.option("--delete", multiple=True, metavar="KEY", help="Remove KEY.")
@click.option("--rename", multiple=True, metavar="OLD=NEW", help="Rename OLD to NEW, keeping type and value.")
@click.option("--from-json", "from_json", type=click.Path(exists=True, dir_okay=False), default=None,
              help='Set keys from a JSON object: {"key": value} or {"key": {"type": "u64", "value": 5}}.')
@click.option("--chat-template-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Set tokenizer.chat_template from a file (parsed in a jinja2 sandbox, never rendered).")
@click.option("-o", "--output", "output", type=click.Path(path_type=str), default=None,
              help="Write the edited copy here and leave FILE untouched (a folder, or a path ending in /, keeps "
                   "FILE's name inside it; FILE itself means in place). Never --from-json's or "
                   "--chat-template-file's file.")
@dry_run_option
@common_options
def set_meta(file: str, assignments: tuple[str, ...], types: tuple[str, ...], delete: tuple[str, ...],
             rename: tuple[str, ...], from_json: str | None, chat_template_file: str | None, output: str | None,
             dry_run: bool, out: Output) -> None:
    """Set, delete or rename FILE's metadata keys: in place when the header still fits (ggufkit
    reserves slack for this), otherwise by an atomic streaming rewrite. Tensor bytes never change.

    A new key's type comes from --type, else llama.cpp's type for well-known keys, else the value:
    true/false -> bool, integer -> u32 (i32 if negative), decimal -> f32, JSON array -> array, else str.
    Bools accept true/false/1/0 only. Never prompts; --dry-run shows the diff and writes nothing.

    \b
    Example:
      ggufkit set-meta model.gguf general.name="My Model" llama.context_length=8192
      ggufkit set-meta model.gguf --chat-template-file chat.jinja --dry-run
      ggufkit set-meta model.gguf my.ids='[1, 2]' --type my.ids='array[u32]' --delete general.url
    """
    from pathlib import Path

    from ggufkit.metadata_edit import edit_metadata, load_json_edits
    from ggufkit.outputs import refuse_overwriting_inputs, resolve_output

    # -o FOLDER (or FOLDER/) keeps FILE's name inside it; -o FILE itself is the in-place edit. Neither may be
    # the --from-json or --chat-template-file it reads.
    if output is not None:
        output = str(resolve_output(output, Path(file).name, Path(".")))
    refuse_overwriting_inputs([output or file], [from_json, chat_template_file])
    set_values: dict[str, Any] = load_json_edits(from_json) if from_json else {}
    if chat_template_file:
        from gguf import Keys

        from ggufkit.errors import UsageError

        if Keys.Tokenizer.CHAT_TEMPLATE in set_values:
            raise UsageError(f"{Keys.Tokenizer.CHAT_TEMPLATE} is given by both --from-json and --chat-template-file")
        try:
            with open(chat_template_file, encoding="utf-8") as fh:
                set_values[Keys.Tokenizer.CHAT_TEMPLATE] = fh.read()
        except UnicodeDecodeError:
            raise UsageError(f"{chat_template_file}: not UTF-8 text") from None
    report = edit_metadata(file, set_text=_pairs(assignments, "KEY=VALUE"), set_values=set_values,
                           types=_pairs(types, "KEY=TYPE"), delete=delete, rename=_pairs(rename, "OLD=NEW"),
                           output=output, dry_run=dry_run, progress=out.progress())
    out.result(report.to_dict(), _render)
