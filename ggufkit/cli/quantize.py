"""``ggufkit quantize``: a thin shell over :func:`ggufkit.quant.llama_quantize.pipeline.quantize_file`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from ggufkit.cli._options import common_options, device_option, dry_run_option, imatrix_option, threads_option
from ggufkit.cli._output import Output, human_bytes, table
from ggufkit.outputs import (
    TEMPLATE_HELP,
    ends_with_separator,
    is_template,
    refuse_overwriting_inputs,
    resolve_output,
)
from ggufkit.quant.llama_quantize.presets import (
    TYPE_CHOICES,
    PresetChoice,
    default_output_name,
    find_preset,
    parse_preset,
    preset_help_header,
    preset_help_lines,
    type_help_lines,
)
from ggufkit.quant.target.defaults import (
    AUTO_SENSITIVITY_MAX_WEIGHTS,
    SENSITIVITY_CHOICES,
    resolve_sensitivity,
)


class _TargetType(click.ParamType):
    """A llama-quantize TYPE: a QUANT_OPTIONS name (case-insensitive) or a numeric file type id, parsed once
    into a :class:`PresetChoice` (a tuple of them where a comma-separated list is accepted)."""

    name = "TYPE"

    def __init__(self, several: bool = False) -> None:
        self.several = several  # a comma-separated list is accepted

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None
                ) -> PresetChoice | tuple[PresetChoice, ...]:
        from ggufkit.errors import UsageError

        if isinstance(value, (PresetChoice, tuple)):
            return value
        words = str(value).split(",") if self.several else [str(value)]
        try:
            choices = tuple(parse_preset(word) for word in words)
        except UsageError as exc:
            self.fail(str(exc), param, ctx)
        names = [c.name for c in choices]
        if len(set(names)) < len(names):
            self.fail(f"a type is named twice in {value!r}", param, ctx)
        return choices if self.several else choices[0]


_EPILOG = "\n".join([
    f"OUT.gguf templates: {TEMPLATE_HELP}; e.g. model-{{type}}.gguf. An unknown placeholder is an error.", "",
    "TYPE, llama-quantize's QUANT_OPTIONS: id, name, bits per weight of its default tensor type, size, KLD, "
    "PPL, 'needs imatrix', 'plan only' (no kernel in this build yet; --dry-run works). "
    f"{preset_help_header()}.", "",
    "\b", *(f"  {line}" for line in preset_help_lines()),
    "", "\b", "Tensor types for --tensor-type, --output-tensor-type, --token-embedding-type:",
    *(f"  {line}" for line in type_help_lines())])


def _plan_table(d: Mapping[str, Any]) -> str:
    rows = [(t["name"], t["src_type"], t["dst_type"], "x".join(map(str, t["shape"])), t["bytes"],
             f"{t['bits_per_weight']:.2f}", t["reason"]) for t in d["tensors"]]
    return table(rows, ["tensor", "from", "to", "shape", "bytes", "bpw", "reason"], align="llllrrl")


def _render(d: Mapping[str, Any], device: str = "auto") -> str:
    t = d["totals"]
    types = ", ".join(f"{n} {k}" for k, n in t["types"].items())
    summary = (f"{d['target'].upper()} (file_type {d['file_type']}): {t['tensors']} tensors, "
               f"{human_bytes(t['src_bytes'])} -> {human_bytes(t['bytes'])}, {t['bits_per_weight']:.4f} bits/weight "
               f"[{types}]")
    notes = []
    if d["cpu_only_types"] and device == "cuda":  # only news where CUDA was asked for
        notes.append(f"CPU only (no CUDA kernel; on the CPU under --device cuda): {', '.join(d['cpu_only_types'])}")
    if d["missing_kernels"]:
        notes.append(f"plan only: no kernel in this build for {', '.join(d['missing_kernels'])}")
    if d["imatrix_required"]:
        notes.append(f"needs an importance matrix (a real run refuses): {len(d['imatrix_required'])} tensors, "
                     f"first {d['imatrix_required'][0]}")
    if d["dry_run"]:
        return "\n".join([_plan_table(d), "", summary, d["fallback_summary"], *notes, "dry run: nothing written"])
    written = ", ".join(d["outputs"]) if len(d["outputs"]) > 1 else d["output"]
    return "\n".join([f"wrote {written} in {d['seconds']:.1f} s: {summary}", d["fallback_summary"], *notes])


def _render_target(d: Mapping[str, Any]) -> str:
    rows = [(t["name"], t["type"], t["bytes"], f"{t['error']:.3g}", f"{t['error_share']:.1%}") for t in d["tensors"]]
    types = ", ".join(f"{n} {k}" for k, n in d["types"].items())
    ref = d["reference"]
    ratio = f"{ref['ratio']:.3f}" if ref["ratio"] is not None else "-"
    lines = [f"budget {d['budget']} bytes ({d['budget_kind']}; reachable {d['feasible'][0]}..{d['feasible'][1]}): "
             f"{d['predicted_size']} bytes, {d['bits_per_weight']:.4f} bits/weight, base {d['base_preset'].upper()} "
             f"[{types}]",
             f"estimated error ({d['proxy']} proxy) {d['estimated_error']:.4g}; {ref['preset'].upper()} "
             f"({ref['size']} bytes) {ref['estimated_error']:.4g}: ratio {ratio}",
             *([f"estimated mean KLD {d['estimated_kld']:.4g}; {ref['preset'].upper()} {ref['estimated_kld']:.4g}: "
                f"ratio {ref['kld_ratio']:.3f} (sensitivity measured on {d['calibration']['tokens']} tokens, "
                f"used for the {d['sensitivity']}; {d['calibration']['seconds']:.1f} s)"]
               if d.get("estimated_kld") is not None and ref.get("kld_ratio") is not None else []),
             *([f"final check (mean KLD measured on the calibration text): "
                f"{', '.join(f'{k} {v:.4g}' for k, v in d['final_check']['measured_kld'].items())}; chosen "
                f"{d['final_check']['chosen']}: {d['final_check']['reason']}"] if d.get("final_check") else []),
             f"measurements: {d['measured']} new, {d['cached']} from the cache; {d['seconds']:.1f} s"]
    if d["mix_out"]:
        lines.append(f"mix written to {d['mix_out']} (llama-quantize --tensor-type-file)")
    lines.append("dry run: nothing written" if d["dry_run"] else f"wrote {d['output']}")
    return "\n".join([table(rows, ["tensor", "type", "bytes", "error", "share"], align="llrrr"), "", *lines])


@click.command("quantize", epilog=_EPILOG)
@click.argument("input_file", metavar="IN.gguf", type=click.Path(dir_okay=False, path_type=str))
@click.argument("positional", metavar="[OUT.gguf] [TYPE [NTHREADS]]", nargs=-1)
@click.option("--type", "target", type=_TargetType(several=True),
              help=f"Preset or type as llama-quantize names them, or its numeric id ({len(TYPE_CHOICES)} names, "
                   "listed below; q4_k = q4_k_m). Several, comma-separated, make one file each in one run "
                   "(OUT then is a folder or holds {type}; without OUT: ggml-model-TYPE.gguf beside IN). Or "
                   "one of --target-size/--target-bpw/--target-like.")
@click.option("--target-size", metavar="SIZE",
              help="Best mix whose whole file is at most SIZE bytes (K/M/G decimal, KiB/MiB/GiB binary).")
@click.option("--target-bpw", type=float, metavar="X", help="Best mix of at most X bits per weight (tensor data).")
@click.option("--target-like", type=_TargetType(), metavar="PRESET",
              help="Best mix of the size llama-quantize's PRESET would have (with the same --imatrix).")
@click.option("--types", "cand_types", metavar="LIST",
              help="Candidate tensor types of a target search, comma-separated (default: k-quants, legacy, "
                   "IQ4, F16; with --imatrix also IQ2/IQ3).")
@click.option("--mix-out", type=click.Path(dir_okay=False, path_type=str),
              help="Write the chosen mix as a llama-quantize --tensor-type-file.")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=str),
              help="Where a target search caches its measurements (default ~/.cache/ggufkit/target).")
@click.option("--calibration-text", type=click.Path(dir_okay=False, exists=True, path_type=str),
              help="Text the target search measures each tensor group's KLD on (default: the bundled sample).")
@click.option("--sensitivity", type=click.Choice(SENSITIVITY_CHOICES), default="auto",
              show_default=True,
              help="Measured KLD sensitivity of a target search: for the estimated KLD of the report only "
                   "(estimate), also to weigh the search (search), or not measured (off); auto = search "
                   f"when PyTorch is installed and the model has at most {AUTO_SENSITIVITY_MAX_WEIGHTS / 1e9:.0f}B "
                   "weights (the measurement runs the model about 15 times on the CPU), else off.")
@click.option("--pure", is_flag=True, help="No k-quant mixture: every quantizable tensor gets the default type.")
@imatrix_option()
@click.option("--tensor-type", "tensor_types", multiple=True, metavar="PATTERN=TYPE",
              help="Override the type of tensors whose name matches the regular expression (first match wins).")
@click.option("--tensor-type-file", type=click.Path(dir_okay=False, exists=True, path_type=str),
              help="More PATTERN=TYPE rules, separated by spaces or newlines (after --tensor-type).")
@click.option("--include-weights", multiple=True, metavar="NAME",
              help="Use the imatrix only for tensors whose name contains NAME (repeatable).")
@click.option("--exclude-weights", multiple=True, metavar="NAME",
              help="Do not use the imatrix for tensors whose name contains NAME (repeatable).")
@click.option("--prune-layers", metavar="L0,L1,...", help="Drop these layers; later layers are renumbered.")
@click.option("--keep-split", is_flag=True, help="Write the output in the same shards as the input.")
@click.option("--override-kv", multiple=True, metavar="KEY=TYPE:VALUE",
              help="Set a metadata key in the output (TYPE: int, float, bool, str); repeatable.")
@click.option("--output-tensor-type", metavar="TYPE", help="Type of output.weight, e.g. q8_0.")
@click.option("--token-embedding-type", metavar="TYPE", help="Type of token_embd.weight, e.g. q8_0.")
@click.option("--leave-output-tensor", is_flag=True, help="Copy output.weight unchanged.")
@click.option("--allow-requantize", is_flag=True, help="Accept already-quantized input (dequantized, then quantized).")
@click.option("--no-fallback", is_flag=True,
              help="Fail instead of using a fallback type for rows that are not whole blocks.")
@threads_option
@device_option
@dry_run_option
@common_options
def quantize(input_file: str, positional: tuple[str, ...], target: tuple[PresetChoice, ...] | None,
             target_size: str | None, target_bpw: float | None, target_like: PresetChoice | None, cand_types: str | None, mix_out: str | None,
             cache_dir: str | None, calibration_text: str | None, sensitivity: str, pure: bool, imatrix: str | None,
             tensor_types: tuple[str, ...], output_tensor_type: str | None, token_embedding_type: str | None,
             tensor_type_file: str | None, include_weights: tuple[str, ...], exclude_weights: tuple[str, ...],
             prune_layers: str | None, keep_split: bool, override_kv: tuple[str, ...],
             leave_output_tensor: bool, allow_requantize: bool, no_fallback: bool, threads: int | None,
             device: str, dry_run: bool, out: Output) -> None:
    """Quantize IN.gguf (F32/F16/BF16) into OUT.gguf exactly as llama-quantize would: same tensor order,
    same per-tensor types, same bytes, same general.file_type. The plan (each tensor's type and why) is
    computed first; --dry-run prints it and writes nothing. PowerInfer (PWRI) files follow PowerInfer's
    own quantize rules instead.

    \b
    Example:
      ggufkit quantize model-f16.gguf model-q4_k_m.gguf --type q4_k_m
      ggufkit quantize model-f16.gguf --type q4_k_m --dry-run --json | jq '.totals'
      ggufkit quantize model-f16.gguf out.gguf --type q4_0 --pure --imatrix imatrix.gguf

    llama-quantize's positional form works too: IN.gguf [OUT.gguf] TYPE [NTHREADS]. Without OUT.gguf the
    output is ggml-model-TYPE.gguf beside IN.gguf, as llama-quantize names it; OUT.gguf may be a folder
    (an existing one, or a path ending in /) to put that name in, or a template (below).
    No output may be one of the inputs (the model or its shards, --imatrix, --tensor-type-file).
    """
    from ggufkit.errors import UsageError
    from ggufkit.quant.llama_quantize.pipeline import quantize_file

    output_file, positional_type, positional_threads = split_positional(input_file, positional, dry_run)
    searching = target_size is not None or target_bpw is not None or target_like is not None
    if target is None and positional_type is None and output_file is not None and not searching:
        _refuse_a_mistyped_type(output_file)  # no type anywhere: the only word may be a mistyped one
    if positional_type is not None:
        if target is not None:
            raise UsageError(f"the type is given twice: {_words(positional_type)} and --type {_words(target)}")
        target = positional_type
    if positional_threads is not None:
        if threads is not None:
            raise UsageError(f"the thread count is given twice: {positional_threads} and --threads {threads}")
        threads = positional_threads or None
    if output_file is None and not dry_run and not (target and len(target) > 1):
        raise click.UsageError("OUT.gguf is required unless --dry-run is given")
    if (target is None) == (not searching):
        raise UsageError("give --type, or one of --target-size, --target-bpw, --target-like")
    if searching:
        others = {"--pure": pure, "--tensor-type": tensor_types, "--tensor-type-file": tensor_type_file,
                  "--output-tensor-type": output_tensor_type, "--token-embedding-type": token_embedding_type,
                  "--include-weights": include_weights, "--exclude-weights": exclude_weights,
                  "--prune-layers": prune_layers, "--keep-split": keep_split, "--override-kv": override_kv,
                  "--leave-output-tensor": leave_output_tensor, "--no-fallback": no_fallback}
        used = [k for k, v in others.items() if v]
        if used:
            raise UsageError(f"{', '.join(used)} cannot be combined with a target search")
        if output_file is not None:
            name = target_like.word.upper() if target_like is not None else "MIX"
            output_file = str(resolve_output(output_file, default_output_name(name),
                                             Path(os.path.dirname(input_file))))
            refuse_overwriting_inputs([output_file, *([mix_out] if mix_out else [])],
                                      [input_file, imatrix, calibration_text])
        _target(out, input_file, output_file, sensitivity, calibration_text, target_size=target_size,
                target_bpw=target_bpw, target_like=target_like, imatrix=imatrix,
                types=[t for t in cand_types.split(",") if t.strip()] if cand_types else None, dry_run=dry_run,
                mix_out=mix_out, cache_dir=cache_dir, threads=threads, device=device)
        return
    if cand_types or mix_out or cache_dir or calibration_text or sensitivity != "auto":
        raise UsageError("--types, --mix-out, --cache-dir, --calibration-text and --sensitivity belong to a target "
                         "search (--target-size ...)")
    assert target is not None
    options: dict[str, Any] = dict(
        pure=pure, imatrix=imatrix, tensor_types=tensor_types, output_tensor_type=output_tensor_type,
        token_embedding_type=token_embedding_type, leave_output_tensor=leave_output_tensor,
        allow_requantize=allow_requantize, no_fallback=no_fallback, threads=threads, device=device,
        tensor_type_file=tensor_type_file, include_weights=include_weights, exclude_weights=exclude_weights,
        prune_layers=prune_layers or (), keep_split=keep_split, override_kv=override_kv)
    targets = list(target)
    outputs = several_outputs(input_file, output_file, targets)
    if not dry_run:  # before any work; quantize_file checks the input's shards too
        refuse_overwriting_inputs(outputs, [input_file, imatrix, tensor_type_file])
    if len(targets) > 1:
        _several(out, input_file, outputs, targets, dry_run, options)
        return
    report = quantize_file(input_file, outputs[0] if output_file is not None else None, targets[0],
                           dry_run=dry_run, progress=out.progress(), **options)
    for warning in report.warnings:
        out.warn(warning)
    out.result(report.to_dict(), lambda d: _render(d, device))


def _words(choices: tuple[PresetChoice, ...]) -> str:
    """The TYPE words as given (comma-separated)."""
    return ",".join(c.word for c in choices)


def default_output(input_file: str, name: str) -> str:
    """llama-quantize's output path when none is given: ``ggml-model-NAME.gguf`` in IN's folder."""
    return os.path.join(os.path.dirname(input_file), default_output_name(name))


def several_outputs(input_file: str, output_file: str | None, targets: list[PresetChoice]) -> list[str]:
    """One output per type, through :func:`ggufkit.outputs.resolve_output`: OUT as a file, a template
    (``{type}`` the type's QUANT_OPTIONS name in lower case, ``{TYPE}`` in upper case), or a folder (an existing
    one, or a path ending in a separator) holding ``ggml-model-NAME.gguf``; without OUT ``ggml-model-NAME.gguf``
    beside IN (llama-quantize's name for a run without an output path).

    Raises:
        UsageError: OUT names one file for several types; a bad template; a path ending in a separator
            whose folder does not exist.
    """
    from ggufkit.errors import UsageError

    names = [t.name for t in targets]
    if output_file is None:
        return [default_output(input_file, n) for n in names]
    if len(names) > 1 and not (is_template(output_file) or ends_with_separator(output_file)
                               or os.path.isdir(output_file)):
        raise UsageError(f"several types need an output name with {{type}} in it (got {output_file!r}), "
                         "e.g. model-{type}.gguf, or a folder")
    return [str(resolve_output(output_file, default_output_name(n), Path(os.path.dirname(input_file)), n))
            for n in names]


def _refuse_a_mistyped_type(word: str) -> None:
    """``quantize IN.gguf q4km``: the only word after IN is read as OUT (no type parses from it); with no
    type given anywhere the run is refused anyway, and a word near a type was meant as one.

    Raises:
        UsageError: with "did you mean ...?".
    """
    from ggufkit.errors import UsageError, did_you_mean

    hint = did_you_mean(word, [t.upper() for t in TYPE_CHOICES])
    if hint and not word.lower().endswith(".gguf"):
        raise UsageError(f"invalid type {word!r}; {hint}choose one of {', '.join(TYPE_CHOICES)} "
                         "or a numeric file type id")


def _several(out: Output, input_file: str, outputs: list[str], targets: list[PresetChoice], dry_run: bool,
             options: dict[str, Any]) -> None:
    """Every type's plan first (a refused one stops the run before anything is written), then one file per
    type in this process: imports, kernel loading and the input's pages in the page cache are shared."""
    from ggufkit.quant.llama_quantize.pipeline import quantize_file, refuse_unrunnable

    reports = [quantize_file(input_file, o, t, dry_run=True, **options) for t, o in zip(targets, outputs)]
    if not dry_run:
        for report in reports:
            refuse_unrunnable(report.plan)
        reports = []
        for t, o in zip(targets, outputs):
            reports.append(quantize_file(input_file, o, t, progress=out.progress(), **options))
    results = [r.to_dict() for r in reports]
    # a warning every type gets (an imatrix without token_embd) is said once; others name their types
    said: dict[str, list[str]] = {}
    for d in results:
        for warning in d["warnings"]:
            said.setdefault(warning, []).append(d["target"].upper())
    for warning, names in said.items():
        out.warn(warning if len(names) == len(results) else f"{', '.join(names)}: {warning}")
    device = str(options.get("device", "auto"))
    out.result({"results": results}, lambda d: "\n\n".join(_render(r, device) for r in d["results"]))


def split_positional(input_file: str, args: tuple[str, ...], dry_run: bool
                     ) -> tuple[str | None, tuple[PresetChoice, ...] | None, int | None]:
    """(OUT, TYPE, NTHREADS) from the words after IN.gguf, read as llama-quantize reads them
    (tools/quantize/quantize.cpp, ``main``): a first word that parses as a type is the type and the output
    is ``ggml-model-NAME.gguf`` in IN's folder; otherwise it is the output and the type may follow; a last
    word is the thread count (0 or less: all cores, returned as 0). A TYPE word that parses is then read as
    ``--type`` reads its value: comma-separated, each part parsed once.

    Raises:
        UsageError: a word that is not a type where a type must be, a thread count that is not an integer,
            or more words than the form takes.
    """
    from ggufkit.errors import UsageError, did_you_mean

    if not args:
        return None, None, None
    rest = list(args)
    out: str | None = None
    choice = find_preset(rest[0])
    word: str | None = None
    if choice is not None:  # IN TYPE [NTHREADS]
        if not dry_run:
            out = default_output(input_file, choice.name)
        word = rest.pop(0)
    else:  # IN OUT [TYPE [NTHREADS]]
        out = rest.pop(0)
        word = rest.pop(0) if rest else None
        choice = None if word is None else find_preset(word)
        if word is not None and choice is None:
            raise UsageError(f"invalid type {word!r} after OUT.gguf; "
                             f"{did_you_mean(word, [t.upper() for t in TYPE_CHOICES])}choose one of "
                             f"{', '.join(TYPE_CHOICES)} or a numeric file type id")
    target: tuple[PresetChoice, ...] | None = None
    if word is not None and choice is not None:  # a list is read as --type reads it
        target = (choice,) if "," not in word else tuple(parse_preset(w) for w in word.split(","))
    threads: int | None = None
    if rest:
        count = rest.pop(0)
        try:
            threads = max(int(count), 0)
        except ValueError:
            raise UsageError(f"invalid thread count {count!r}") from None
    if rest:
        raise UsageError(f"unexpected extra argument {rest[0]!r}; the form is IN.gguf [OUT.gguf] [TYPE [NTHREADS]]")
    return out, target, threads


def _target(out: Output, input_file: str, output_file: str | None, sensitivity: str, calibration_text: str | None,
            **kwargs: Any) -> None:
    """A target search; with the KLD sensitivity through the evaluator unless ``off`` (or auto without torch)."""
    sensitivity, warnings = resolve_sensitivity(input_file, sensitivity, calibration_text)
    for warning in warnings:
        out.warn(warning)
    if sensitivity == "off":
        from ggufkit.quant.target.search import quantize_to_target

        out.result(quantize_to_target(input_file, output_file, progress=out.progress(), **kwargs).to_dict(),
                   _render_target)
        return
    from ggufkit.eval.target_sensitivity import quantize_to_target_kld

    report, sens = quantize_to_target_kld(input_file, output_file, calibration_text=calibration_text,
                                          sensitivity=sensitivity, progress=out.progress(), **kwargs)
    d = report.to_dict()
    if sens is not None:
        d["calibration"] = {k: v for k, v in sens.to_dict().items() if k != "sensitivity"}
    out.result(d, _render_target)
