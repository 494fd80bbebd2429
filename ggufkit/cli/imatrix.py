"""``ggufkit imatrix``: a thin shell over :mod:`ggufkit.eval.imatrix` (collect, combine, convert, statistics)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from ggufkit.cli._options import batch_option, common_options, device_option, kv_cache_option
from ggufkit.cli._output import Output


def _render(d: Mapping[str, Any]) -> str:
    lines = []
    if d.get("ppl") is not None:
        lines.append(f"Final estimate: PPL = {d['ppl']:.4f} +/- {d['ppl_error']:.5f}")
    if d.get("chunks"):
        lines.append(f"{d['chunks']} chunks of {d['chunk_size']} tokens on {d['device']}, {d['seconds']:.2f} s, "
                     f"{d['tokens_per_second']:.1f} tokens/s")
    for snap in d.get("snapshots", []):
        lines.append(f"snapshot: {snap}")
    lines.append(f"wrote {d['output']} ({d['output_format']}, {d['entries']} entries, {d['chunk_count']} chunks "
                 f"of {d['chunk_size']})")
    return "\n".join(lines)


def _checked_output(output: str, output_format: str, inputs: list[str | None]) -> Path:
    """The file ``-o`` names (a folder gets llama-imatrix's default name inside it), refused before any work when
    it is one of the inputs (the model, the text, an --in-file), a folder, or in a folder that does not exist."""
    from ggufkit.errors import OutputExistsError, UsageError
    from ggufkit.outputs import refuse_overwriting_inputs, resolve_output

    target = resolve_output(output, f"imatrix.{output_format}", Path("."))
    refuse_overwriting_inputs([target], inputs)
    if target.is_dir():
        raise OutputExistsError(f"{target} is a folder; name the imatrix file to write")
    if not target.parent.is_dir():
        raise UsageError(f"cannot write {target}: the folder {target.parent} does not exist (create it first)")
    return target


def _render_statistics(d: Mapping[str, Any]) -> str:
    """llama-imatrix's --show-statistics tables (tab-separated, its column formats)."""
    lines = [f"Computing statistics for {d['file']} ({len(d['tensors'])} tensors)", "",
             "\t".join([" Layer", "       Tensor", "          Σ(Act²)", "  Min", "            Max", "           μ",
                        "   σ", " % Active", "N", "   Entropy", "E (norm)", "ZD", "  CosSim"]), "=" * 170]
    for t in d["tensors"]:
        lines.append(f"{t['layer']:>5}\t{t['tensor']:<20}\t{t['sum']:10.2f}\t{t['min']:8.4f}\t{t['max']:11.4f}\t"
                     f"{t['mean']:6.2f}\t{t['stddev']:6.2f}\t{100 * t['active']:8.2f}%\t{t['elements']:6d}\t"
                     f"{t['entropy']:10.4f}\t{t['entropy_norm']:6.2f}%\t{100 * t['zd']:10.2f}%\t{t['cossim']:8.4f}")
    lines += ["", f"Computing weighted average statistics per layer ({len(d['layers'])} layers)", "",
              "\t".join(["  Layer", "     μΣ(Act²)", "      μZD", "μCosSim"]), "=" * 48]
    for r in d["layers"]:
        lines.append(f"{r['layer']:5d}\t{r['sum']:14.2f}\t{100 * r['zd']:10.4f}%\t{r['cossim']:6.4f}")
    return "\n".join(lines)


@click.command("imatrix")
@click.argument("model", required=False, type=click.Path(dir_okay=False, path_type=str))
@click.option("-f", "--file", "text_file", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Calibration text (UTF-8).")
@click.option("-o", "--output", default="imatrix.gguf", show_default=True, type=click.Path(path_type=str),
              help="The imatrix file to write (atomically); a folder (or a path ending in /) gets imatrix.gguf "
                   "(imatrix.dat with --output-format dat) inside it. Never one of the inputs.")
@click.option("--output-format", type=click.Choice(["gguf", "dat"]), default="gguf", show_default=True,
              help="llama-imatrix's GGUF format or the legacy .dat.")
@click.option("--ctx", "-c", type=click.IntRange(min=1), default=512, show_default=True, help="Tokens per chunk.")
@click.option("--chunks", type=click.IntRange(min=1), default=None, help="Process at most N chunks.")
@click.option("--from-chunk", "--chunk", "from_chunk", type=click.IntRange(min=0), default=0, show_default=True,
              help="Skip the first N chunks of the text (resume after a snapshot of N chunks).")
@click.option("--process-output", is_flag=True, help="Also collect output.weight (an untied LM head).")
@click.option("--parse-special", is_flag=True, help="Tokenize special-token text as special tokens.")
@click.option("--in-file", "in_files", multiple=True, type=click.Path(dir_okay=False, path_type=str),
              help="Imatrix file (GGUF or .dat) to add first; repeat to combine. Without a model: combine/convert.")
@click.option("--show-statistics", is_flag=True, help="Print the per-tensor statistics of one --in-file and exit.")
@click.option("--no-ppl", is_flag=True, help="Do not compute the perplexity of each chunk (faster).")
@click.option("--save-frequency", type=click.IntRange(min=0), default=0, show_default=True,
              help="Every N chunks also write a snapshot OUTPUT.at_<chunks> (0: never).")
@click.option("--output-frequency", type=click.IntRange(min=0), default=10, show_default=True,
              help="Every N chunks rewrite OUTPUT with the data so far (0: only at the end).")
@batch_option
@click.option("--ggml-rounding", is_flag=True,
              help="Round the input of every matmul to the weight's vec_dot_type first (F16/BF16, or 8-bit "
                   "blocks for quantized weights), as llama.cpp's plain CPU kernels do (its AMX build "
                   "multiplies F16 weights by float32 inputs, like the default); with --kv-cache f16, K and V "
                   "rounded to F16.")
@kv_cache_option
@device_option
@common_options
def imatrix(model: str | None, text_file: str | None, output: str, output_format: str, ctx: int,
            chunks: int | None, from_chunk: int, process_output: bool, parse_special: bool, in_files: tuple[str, ...],
            show_statistics: bool, no_ppl: bool, save_frequency: int, output_frequency: int, batch: int | None,
            ggml_rounding: bool, kv_cache: str, device: str, out: Output) -> None:
    """Collect MODEL's importance matrix on a text as llama-imatrix does (same tensors, sums, counts and
    files), for `ggufkit quantize --imatrix` or llama-quantize. Without MODEL, combine or convert --in-file
    files; with --show-statistics, describe one.

    \b
    Example:
      ggufkit imatrix model-f16.gguf -f calibration.txt -o imatrix.gguf
      ggufkit imatrix --in-file a.gguf --in-file b.dat -o combined.gguf
      ggufkit imatrix --in-file imatrix.gguf --show-statistics
    """
    from ggufkit.errors import UsageError

    if show_statistics:
        from ggufkit.quant.imatrix.collector import ImatrixAccumulator, tensor_statistics

        if len(in_files) != 1:
            raise UsageError("--show-statistics needs exactly one --in-file")
        acc = ImatrixAccumulator(ctx)
        acc.load(in_files[0])
        out.result({"file": in_files[0], **tensor_statistics(acc)}, _render_statistics)
        return
    output = str(_checked_output(output, output_format, [model, text_file, *in_files]))
    if model is None:
        if text_file is not None:
            raise UsageError("-f needs a MODEL")
        from ggufkit.eval.imatrix import combine_imatrix

        result = combine_imatrix(in_files, output, output_format=output_format, ctx=ctx)
        out.result(result.to_dict(), _render)
        return
    if text_file is None:
        raise UsageError("give the calibration text with -f/--file")
    from ggufkit.cli._malloc import keep_freed_memory
    from ggufkit.eval.imatrix import collect_imatrix
    from ggufkit.eval.perplexity import read_text_file

    keep_freed_memory()

    def on_chunk(i: int, ppl: float | None) -> None:
        if ppl is not None:
            out.echo(f"[{i}]{ppl:.4f},")

    result = collect_imatrix(model, text=read_text_file(text_file), output=output, output_format=output_format,
                             dataset=text_file, ctx=ctx, chunks=chunks, from_chunk=from_chunk,
                             process_output=process_output, parse_special=parse_special, compute_ppl=not no_ppl,
                             in_files=in_files, save_frequency=save_frequency, output_frequency=output_frequency,
                             batch=batch, device=device, ggml_rounding=ggml_rounding, kv_cache=kv_cache,
                             progress=out.progress(),
                             on_chunk=on_chunk)
    out.echo("\n")
    out.result(result.to_dict(), _render)
