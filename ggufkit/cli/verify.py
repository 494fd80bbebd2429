"""``ggufkit verify``: a thin shell over :func:`ggufkit.verify.verify`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import click

from ggufkit.cli._options import common_options
from ggufkit.cli._output import Output
from ggufkit.errors import EXIT_BAD_INPUT


def _render(d: Mapping[str, Any]) -> str:
    lines = [f"{d['path']}: {'valid' if d['ok'] else 'INVALID'} ({d['tensors']} tensors, {d['kv']} keys"
             + (f", {len(d['shards'])} shards)" if len(d["shards"]) > 1 else ")")]
    if d.get("projector"):
        pr = d["projector"]
        lines.append(f"  projector: {pr['projector_type']} ({'+'.join(pr['modalities']) or 'no encoder'}), image "
                     f"{pr['image_size']} px, patch {pr['patch_size']} px, "
                     f"{pr['tokens_per_image'] if pr['tokens_per_image'] is not None else '?'} tokens per image")
    for p in d["problems"]:
        where = f" at byte {p['offset']}" if p["offset"] is not None else ""
        lines.append(f"  problem ({p['kind']}){where}: {p['message']}")
    lines.extend(f"  warning: {w}" for w in d["warnings"])
    if "digest" in d:
        lines.extend(f"  {h}  {name}" for name, h in d["tensor_sha256"].items())
        lines.append(f"digest (sha256 of all tensor data): {d['digest']}")
    return "\n".join(lines)


@click.command("verify")
@click.argument("file", type=click.Path(dir_okay=False, path_type=str))
@click.option("--hash", "hash_tensors", is_flag=True,
              help="Add each tensor's sha256 and a digest of all tensor data (unchanged by metadata edits).")
@common_options
def verify(file: str, hash_tensors: bool, out: Output) -> None:
    """Check FILE's structure: bounds, counts, types, alignment, tensor layout as llama.cpp requires,
    UTF-8 of every string, types of well-known keys, tokenizer array lengths, split.tensors.count.

    Exit 0 when valid, 2 when a problem is found (the problems are listed, also with --json).

    \b
    Example:
      ggufkit verify model.gguf --hash --json | jq .digest
    """
    from ggufkit.verify import verify as run_verify

    report = run_verify(file, hash_tensors=hash_tensors, progress=out.progress())
    out.result(report.to_dict(), _render)
    if not report.ok:
        raise click.exceptions.Exit(EXIT_BAD_INPUT)
