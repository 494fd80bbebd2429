"""``ggufkit convert``: a thin shell over :func:`ggufkit.converters.convert`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from ggufkit.cli._options import SizeParam, common_options, dry_run_option
from ggufkit.cli._output import Output, human_bytes, table
from ggufkit.converters import OUTTYPES
from ggufkit.errors import EXIT_CHECK_FAILED, did_you_mean
from ggufkit.outputs import TEMPLATE_HELP


class TypeChoice(click.Choice):
    """A case-insensitive choice of type names whose error names the near miss first: ``'q4km' is not a type;
    did you mean Q4_K_M? choose one of ...``."""

    def __init__(self, choices: tuple[str, ...]) -> None:
        super().__init__(choices, case_sensitive=False)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            names = [str(c) if c == "auto" else str(c).upper() for c in self.choices]  # type names as ggml writes them
            self.fail(f"{value!r} is not a type; {did_you_mean(str(value), names)}choose one of "
                      f"{', '.join(names)}", param, ctx)


def _render(d: Mapping[str, Any]) -> str:
    if "architectures" in d:
        return table([(a["hf_class"], a["arch"], ",".join(a["vocab"]), "yes" if a["powerinfer"] else "",
                       a.get("mmproj") or "") for a in d["architectures"]],
                     ["HF class", "GGUF arch", "vocab", "--predictor", "--mmproj"])
    size = (f"{human_bytes(d['nbytes'])} of tensor data" if d["dry_run"]
            else f"{human_bytes(d['file_size'])} on disk")
    summary = (f"{d['hf_class']} -> {d['architecture']} ({d['outtype']}, file_type {d['file_type']}"
               f"{', PowerInfer' if d['powerinfer'] else ''}): {d['n_tensors']} tensors, "
               f"{d['n_params']:,} parameters, {size}")
    pre = d.get("pre_tokenizer")
    if pre:
        how = {"hash": "llama.cpp's hash table", "behaviour": "behaviour: its regexes reproduce the tokenizer",
               "override": "--pre-tokenizer"}.get(pre["method"], pre["method"])
        summary += f"\npre-tokenizer: {pre['name']} (by {how})" + (f"; {pre['note']}" if pre["note"] else "")
    if d["dry_run"]:
        rows = [(t["source"], t["name"], "x".join(map(str, t["shape"])), f"{t['src_dtype']} -> {t['type']}",
                 t["transform"] or "", t["reason"]) for t in d["tensors"]]
        hp = "\n".join(f"  {k} = {v}" for k, v in d["metadata"].items() if not k.startswith(("tokenizer.",
                                                                                             "general.")))
        return "\n".join([table(rows, ["source", "gguf", "shape", "type", "transform", "reason"]), "",
                          "hparams:", hp, "", summary, f"would write {d['output']}; dry run: nothing written"])
    line = f"wrote {', '.join(d['outputs'])} in {d['seconds']:.1f} s: {summary}"
    if d.get("mmproj"):
        line += "\n" + _render_mmproj(d["mmproj"])
    c = d.get("check_details")
    if d["check"] == "skipped":
        line += f"\ncheck skipped: {d['check_reason']}"
    elif c and c["rel_diff"] is not None:
        line += (f"\ncheck {'passed' if d['check'] == 'passed' else 'FAILED'}: {c['tokens_compared']} tokens "
                 f"compared, logits within {c['rel_diff']:.3%} of the largest (allowed {c['tolerance'][0]:.2%}), "
                 f"top-1 agreement {c['top1_agreement']:.1%}")
    elif d["check"] == "failed":
        line += "\ncheck FAILED"
    return line


@click.command("convert")
@click.argument("model", required=False)
@click.option("-o", "--output", help="Output file, folder (a path ending in / names a folder, which must exist), "
              f"or template: {TEMPLATE_HELP}. Default: {{basename}}-{{size_label}}-{{FTYPE}}.gguf in the model "
              "directory. No output may be one of the files read.")
@click.option("--outtype", type=TypeChoice(OUTTYPES), default="auto", show_default=True,
              help="Weight type; auto follows the checkpoint (bf16 stays bf16, otherwise f16).")
@click.option("--predictor", type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="PowerInfer predictor directory (model_N.pt): write a PowerInfer GGUF.")
@click.option("--vocab-only", is_flag=True, help="Write metadata and vocabulary only.")
@click.option("--split-max-size", type=SizeParam(), help="Split into gguf-split shards of at most SIZE (500M, 5G).")
@click.option("--metadata", "metadata_file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="JSON file of general.* keys to set (name, author, license.name, ...).")
@click.option("--pre-tokenizer", help="Force tokenizer.ggml.pre (a name llama.cpp knows) for BPE vocabularies.")
@click.option("--check/--no-check", default=True, show_default=True,
              help="After writing, compare tokens and logits with transformers' model running the same rounded "
              "weights (exit 1 on disagreement; skipped, and said so, without PyTorch, when transformers or the "
              "evaluator cannot run the model, or when memory is short).")
@click.option("--base", "base", help="For a PEFT adapter MODEL: the base model (checkpoint directory, cached hub id, or "
              "its GGUF). Default: the adapter's base_model_name_or_path.")
@click.option("--merge", is_flag=True, help="For a PEFT adapter MODEL: write the base model with the adapter merged in "
              "(DoRA, lora_bias, modules_to_save included) instead of an adapter file.")
@click.option("--mmproj", is_flag=True, help="Write the vision projector (mmproj-{basename}-{FTYPE}.gguf: vision tower "
              "and projector, for libmtmd) of a vision-language checkpoint instead of its text model.")
@click.option("--with-mmproj", is_flag=True, help="Write the text model and then its vision projector beside it "
              "(the projector in --outtype where llama.cpp writes projectors in it: f32, f16, bf16, q8_0; else auto).")
@click.option("--mtp", "mtp_only", is_flag=True, help="Write only the multi-token-prediction (MTP / NextN) layers "
              "with the shared embeddings, output norm and head, as a speculative draft model (default name "
              "mtp-{basename}-{FTYPE}.gguf), as llama.cpp's converter --mtp.")
@click.option("--no-mtp", "--no-nextn", "no_mtp", is_flag=True, help="Leave the multi-token-prediction layers out. "
              "Default: kept as extra blocks after the model's (nextn_predict_layers), as llama.cpp's converter.")
@click.option("--fp8-as-q8", is_flag=True, help="For an FP8 checkpoint: write the weights stored in FP8 as Q8_0 "
              "and the rest in --outtype (f32, f16, bf16, q8_0), as llama.cpp's converter --fp8-as-q8.")
@click.option("--list", "list_archs", is_flag=True, help="List the supported Hugging Face model classes.")
@dry_run_option
@common_options
def convert(model: str | None, output: str | None, outtype: str, predictor: Path | None, vocab_only: bool,
            split_max_size: int | None, metadata_file: Path | None, pre_tokenizer: str | None, check: bool,
            base: str | None, merge: bool, mmproj: bool, with_mmproj: bool, mtp_only: bool, no_mtp: bool,
            fp8_as_q8: bool, list_archs: bool, dry_run: bool, out: Output) -> None:
    """Convert MODEL (a Hugging Face checkpoint directory, or a hub repo id found in the local cache) to
    GGUF. Tensors are streamed one at a time; the output is written atomically and re-read to check it.

    \b
    Example:
      ggufkit convert ./Llama-3.2-1B --outtype f16 -o llama-f16.gguf
      ggufkit convert ./Llama-3.2-1B --outtype q8_0 -o 'out/llama-{TYPE}.gguf'   # out/llama-Q8_0.gguf
      ggufkit convert ./Llama-3.2-1B -o out/      # out/ must exist: the default name inside it
      ggufkit convert ./ReluLLaMA-7B --predictor ./ReluLLaMA-7B-Predictor --outtype f16
      ggufkit convert ./model --dry-run --json | jq '.tensors[0]'
      ggufkit convert ./my-lora --base llama-f16.gguf --outtype f16      # PEFT adapter -> GGUF adapter
      ggufkit convert ./my-dora --base ./Llama-3.2-1B --merge --outtype q8_0
      ggufkit convert ./gemma-3-4b-it --mmproj --outtype f16   # mmproj-gemma-3-4b-it-F16.gguf
      ggufkit convert ./Qwen3.5-9B --mtp --outtype bf16       # mtp-Qwen3.5-9B-BF16.gguf, a draft model
      ggufkit convert --list
    """
    from ggufkit.converters import convert as run
    from ggufkit.converters import list_architectures

    if list_archs:
        out.result({"architectures": list_architectures()}, _render)
        return
    if model is None:
        raise click.UsageError("MODEL is required (or --list)")
    from ggufkit.converters import is_adapter_dir

    mtp = _mtp_choice(mtp_only, no_mtp, mmproj or vocab_only or merge or bool(predictor) or is_adapter_dir(model))
    if mmproj and with_mmproj:
        raise click.UsageError("--mmproj writes only the projector, --with-mmproj both files: choose one")
    if (mmproj or with_mmproj) and (predictor or vocab_only or merge or base or split_max_size):
        raise click.UsageError("--mmproj/--with-mmproj do not combine with --predictor, --vocab-only, --base, "
                               "--merge or --split-max-size")
    if mmproj:
        _convert_mmproj(model, output, outtype.lower(), dry_run, out)
        return
    if is_adapter_dir(model):
        if with_mmproj:
            raise click.UsageError("--with-mmproj applies to a vision-language checkpoint, not a PEFT adapter")
        if not merge:
            _convert_adapter(model, output, base, outtype.lower(), dry_run, out)
            return
    elif base or merge:
        raise click.UsageError("--base and --merge apply to a PEFT adapter directory (adapter_config.json)")
    if merge:
        from ggufkit.converters import merge_lora

        report = merge_lora(model, output, base=base, outtype=outtype.lower(), dry_run=dry_run,
                            progress=out.progress())
    else:
        report = run(model, output, outtype=outtype.lower(), predictor=predictor, vocab_only=vocab_only,
                     split_max_size=split_max_size, metadata_file=metadata_file, pre_tokenizer=pre_tokenizer,
                     dry_run=dry_run, progress=out.progress(), with_mmproj=with_mmproj, mtp=mtp,
                     fp8_as_q8=fp8_as_q8)
    for warning in report.warnings:
        out.warn(warning)
    if check and report.outputs:
        report.check = _check(report, merged=merge, draft=mtp is True)
    data = report.as_dict()
    # "check": passed, failed, skipped (with check_reason) or off; a skipped check is never a pass.
    data["check"] = report.check["status"] if report.check else "off"
    data["check_reason"] = report.check["reason"] if report.check else None
    data["check_details"] = report.check
    data["ok"] = data["check"] != "failed"
    out.result(data, _render)
    if not data["ok"]:
        # The output is kept; the check's verdict is the exit code.
        assert report.check is not None
        click.echo(f"ggufkit: error: check failed (output kept): {'; '.join(report.check['failures'])}", err=True)
        raise click.exceptions.Exit(EXIT_CHECK_FAILED)


def _mtp_choice(mtp_only: bool, no_mtp: bool, other_file: bool) -> bool | None:
    """``convert``'s ``mtp`` argument from --mtp / --no-mtp (None: the class's default)."""
    if mtp_only and no_mtp:
        raise click.UsageError("--mtp writes only the multi-token-prediction layers, --no-mtp leaves them out: "
                               "choose one")
    if (mtp_only or no_mtp) and other_file:
        raise click.UsageError("--mtp/--no-mtp do not combine with --mmproj, --vocab-only, --predictor or a PEFT "
                               "adapter")
    return True if mtp_only else False if no_mtp else None


def _mmproj_report(model: str, output: str | None, outtype: str, dry_run: bool, out: Output) -> dict[str, Any]:
    from ggufkit.converters import convert_mmproj

    report = convert_mmproj(model, output, outtype=outtype, dry_run=dry_run, progress=out.progress())
    data: dict[str, Any] = report.as_dict()
    return data


def _render_mmproj(d: Mapping[str, Any]) -> str:
    meta = d["metadata"]
    summary = (f"{d['hf_class']} projector ({meta.get('clip.projector_type')}, {d['outtype']}): {d['n_tensors']} "
               f"tensors, {d['n_params']:,} parameters, image {meta.get('clip.vision.image_size')} px, patch "
               f"{meta.get('clip.vision.patch_size')} px")
    if d["dry_run"]:
        rows = [(t["source"], t["name"], "x".join(map(str, t["shape"])), f"{t['src_dtype']} -> {t['type']}",
                 t["reason"]) for t in d["tensors"]]
        return "\n".join([table(rows, ["source", "gguf", "shape", "type", "reason"]), "", summary,
                          f"would write {d['output']}; dry run: nothing written"])
    return f"wrote {', '.join(d['outputs'])} in {d['seconds']:.1f} s: {summary}"


def _convert_mmproj(model: str, output: str | None, outtype: str, dry_run: bool, out: Output) -> None:
    data = _mmproj_report(model, output, outtype, dry_run, out)
    data["ok"] = True
    out.result(data, _render_mmproj)


def _check(report: Any, merged: bool = False, draft: bool = False) -> dict[str, Any]:
    from ggufkit.eval.convert_check import SKIPPED, CheckResult, check_conversion

    if draft:
        return CheckResult(SKIPPED, reason="a --mtp draft holds the multi-token-prediction layers without the model "
                           "they draft for; transformers does not run them").as_dict()
    if merged:
        return CheckResult(SKIPPED, reason="a merged adapter has no transformers checkpoint of its own to "
                           "compare with").as_dict()
    if not report.plan.entries:
        return CheckResult(SKIPPED, reason="a vocabulary-only file has no weights to compare").as_dict()
    return check_conversion(report.model_dir, report.outputs[0], report.plan).as_dict()


def _render_adapter(d: Mapping[str, Any]) -> str:
    summary = (f"LoRA adapter for {d['base']} ({d['architecture']}): {d['n_tensors']} tensors on "
               f"{len(d['targets'])} weights, rank {'/'.join(map(str, d['ranks']))}, alpha {d['alpha']:g}, "
               f"{human_bytes(d['nbytes'])}")
    if d["scaling_folded_into_lora_b"]:
        summary += (f"\nPEFT's per-module scaling (rslora / rank_pattern / alpha_pattern) folded into lora_b for "
                    f"{len(d['scaling_folded_into_lora_b'])} weights")
    if d["dry_run"]:
        rows = [(t["name"], "x".join(map(str, t["shape"])), t["type"]) for t in d["tensors"]]
        return "\n".join([table(rows, ["tensor", "shape", "type"]), "", summary,
                          f"would write {d['output']}; dry run: nothing written"])
    return f"wrote {d['output']} in {d['seconds']:.1f} s: {summary}"


def _convert_adapter(model: str, output: str | None, base: str | None, outtype: str, dry_run: bool,
                     out: Output) -> None:
    from ggufkit.converters import convert_lora

    report = convert_lora(model, output, base=base, outtype="f32" if outtype == "auto" else outtype,
                          dry_run=dry_run, progress=out.progress())
    data = report.as_dict()
    data["ok"] = True
    out.result(data, _render_adapter)
