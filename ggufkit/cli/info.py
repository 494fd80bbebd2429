"""``ggufkit info``: a thin shell over :func:`ggufkit.summary.describe`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import click

from ggufkit.cli._options import common_options
from ggufkit.cli._output import Output, human_bytes, table


def _render(d: Mapping[str, Any]) -> str:
    lines = [
        f"file:         {d['path']}" + (f" (+{len(d['shards']) - 1} shards)" if len(d["shards"]) > 1 else ""),
        f"format:       {d['magic']} v{d['version']}, alignment {d['alignment']}"
        + (" (PowerInfer sparse model)" if d["powerinfer"] else ""),
        f"architecture: {d['architecture']}",
    ]
    if d["file_type"]:
        lines.append(f"file type:    {d['file_type']['value']} ({d['file_type']['name']})")
    if d.get("adapter"):
        a = d["adapter"]
        lines.append(f"adapter:      {a['type']}, alpha {a['alpha']}, rank {'/'.join(map(str, a['ranks']))}, "
                     f"{len(a['targets'])} adapted tensors, base {a['base'] or 'unknown'}"
                     + (f" ({a['base_url']})" if a["base_url"] else "")
                     + (f"; UNPAIRED: {', '.join(a['unpaired'][:3])}" if a["unpaired"] else ""))
    if d.get("projector"):
        p = d["projector"]
        tokens = p["tokens_per_image"] if p["tokens_per_image"] is not None else "?"
        lines.append(f"projector:    {p['projector_type']} ({'+'.join(p['modalities']) or 'no encoder'}), image "
                     f"{p['image_size']} px, patch {p['patch_size']} px ({p['patches_per_image']} patches, {tokens} "
                     f"tokens per image), {p['block_count']} blocks of {p['embedding_length']}, projects to "
                     f"{p['projection_dim']}")
    t = d["totals"]
    bpw = f"{t['bits_per_weight']:.4f}" if t["bits_per_weight"] else "-"
    lines.append(f"tensors:      {t['tensors']}, {t['parameters']:,} parameters, {human_bytes(t['bytes'])}, "
                 f"{bpw} bits/weight")
    lines.append("")
    lines.append(table([(k, v["type"], _short(v["value"])) for k, v in d["metadata"].items()],
                       ["key", "type", "value"]))
    lines.append("")
    lines.append(table([(s["name"], s["type"], "x".join(map(str, s["shape"])), s["bytes"], s["offset"])
                        for s in d["tensors"]], ["tensor", "type", "shape", "bytes", "offset"], align="lllrr"))
    lines.append("")
    lines.append(table([(name, s["tensors"], f"{s['parameters']:,}", human_bytes(s["bytes"]),
                         f"{s['bits_per_weight']:.4f}" if s["bits_per_weight"] else "-")
                        for name, s in d["by_type"].items()],
                       ["type", "tensors", "parameters", "size", "bits/weight"], align="lrrrr"))
    return "\n".join(lines)


def _short(value: Any, limit: int = 80) -> str:
    if isinstance(value, dict) and "length" in value:
        text = f"[{value['length']} items] " + ", ".join(repr(x) for x in value["first"])
    else:
        text = repr(value) if isinstance(value, str) else str(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


@click.command("info")
@click.argument("file", type=click.Path(dir_okay=False, path_type=str))
@common_options
def info(file: str, out: Output) -> None:
    """Show FILE's format version, architecture, metadata (arrays summarised), tensors (name, type,
    shape, bytes, offset), totals and bits per weight overall and per type.

    A shard of a gguf-split set is shown with the whole set.

    \b
    Example:
      ggufkit info model.gguf
      ggufkit info model.gguf --json | jq '.totals'
    """
    from ggufkit.format import open_gguf
    from ggufkit.summary import describe

    with open_gguf(file) as model:
        out.result(describe(model), _render)
