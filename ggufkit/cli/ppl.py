"""``ggufkit ppl``: a thin shell over :func:`ggufkit.eval.perplexity.perplexity` and its quality gates."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import click

from ggufkit.cli._options import batch_option, common_options, device_option, kv_cache_option
from ggufkit.cli._output import Output


def _final_estimate(d: Mapping[str, Any]) -> str:
    return f"Final estimate: PPL = {d['ppl']:.4f} +/- {d['ppl_error']:.5f}"


def _render_quiet(d: Mapping[str, Any]) -> str:
    """``ppl -q``: the final figures only, the PPL and, with a baseline, the mean KLD (as the full report
    writes them)."""
    lines = [_final_estimate(d)]
    k = d.get("kld")
    if k:
        bound = f" (stored baseline: at most {k['mean_kld_upper']:.6f})" if k.get("store") else ""
        lines.append(f"Mean    KLD: {k['mean_kld']:10.6f} ± {k['mean_kld_error']:10.6f}{bound}")
    return "\n".join(lines)


def _render(d: Mapping[str, Any]) -> str:
    lines = [_final_estimate(d),
             f"{d['chunks']} chunks of {d['ctx']} tokens, {d['tokens_scored']} tokens scored, BOS "
             f"{'added' if d['add_bos'] else 'not added'}; {d['device']} {d['dtype']}, {d['seconds']:.2f} s, "
             f"{d['tokens_per_second']:.1f} tokens/s"]
    k = d.get("kld")
    if k:
        pct = 100.0
        lines += ["", "====== Perplexity statistics ======",
                  f"Mean PPL(Q)                   : {k['ppl']:10.6f} ± {k['ppl_error']:10.6f}",
                  f"Mean PPL(base)                : {k['ppl_base']:10.6f} ± {k['ppl_base_error']:10.6f}",
                  f"Cor(ln(PPL(Q)), ln(PPL(base))): {pct * k['ppl_correlation']:6.2f}%",
                  f"Mean ln(PPL(Q)/PPL(base))     : {k['ln_ppl_ratio']:10.6f} ± {k['ln_ppl_ratio_error']:10.6f}",
                  f"Mean PPL(Q)/PPL(base)         : {k['ppl_ratio']:10.6f} ± {k['ppl_ratio_error']:10.6f}",
                  f"Mean PPL(Q)-PPL(base)         : {k['ppl_diff']:10.6f} ± {k['ppl_diff_error']:10.6f}",
                  "", "====== KL divergence statistics ======",
                  f"Mean    KLD: {k['mean_kld']:10.6f} ± {k['mean_kld_error']:10.6f}"]
        st = k.get("store")
        if st:
            lines += [f"(stored baseline, top {st['top_k']}: {st['bytes_per_position']} bytes x {st['positions']} "
                      f"positions = {st['bytes']} bytes; llama-perplexity's file: {st['llama_perplexity_bytes']}. "
                      f"KLD exact over the top {st['top_k']}, tail bucketed: true mean KLD in "
                      f"[{k['mean_kld']:.6f}, {k['mean_kld_upper']:.6f}], percentiles are lower bounds)"]
        for name, v in k.get("kld_percentiles", {}).items():
            label = {"max": "Maximum", "min": "Minimum", "median": "Median "}.get(name, f"{name:>4}%  ")
            lines.append(f"{label} KLD: {v:10.6f}")
        lines += ["", "====== Token probability statistics ======",
                  f"Mean    Δp: {pct * k['mean_delta_p']:6.3f} ± {pct * k['mean_delta_p_error']:5.3f} %"]
        for name, v in k.get("delta_p_percentiles", {}).items():
            label = {"max": "Maximum", "min": "Minimum", "median": "Median "}.get(name, f"{name:>4}%  ")
            lines.append(f"{label} Δp: {pct * v:6.3f}%")
        lines += [f"RMS Δp    : {pct * k['rms_delta_p']:6.3f} ± {pct * k['rms_delta_p_error']:5.3f} %",
                  f"Same top p: {pct * k['same_top_p']:6.3f} ± {pct * k['same_top_p_error']:5.3f} %"]
    failures = d.get("gates", {}).get("failures")
    if failures:
        lines.append("quality gates FAILED: " + "; ".join(failures))
    return "\n".join(lines)


def _chunk_printer(out: Output, baseline: bool) -> Any:
    """llama-perplexity's running output: ``[1]x,[2]y,...`` or, with a baseline, one row per chunk."""
    if baseline:
        out.stream("chunk        PPL          ln(PPL(Q)/PPL(base))          KL Divergence              "
                   "Δp RMS            Same top p", "\n")

    def on_chunk(i: int, stats: Any) -> None:
        # Through out.stream: with a progress bar on the terminal each value gets its own line above it.
        if stats.kld is None:
            out.stream(f"[{i}]{stats.ppl:.4f}", ",")
            return
        r = stats.kld.running()
        out.stream(f"{i:4d}    {r['ppl']:9.4f} ± {r['ppl_error']:9.4f}    {r['ln_ppl_ratio']:10.5f} ± "
                   f"{r['ln_ppl_ratio_error']:10.5f}    {r['mean_kld']:10.5f} ± {r['mean_kld_error']:10.5f}    "
                   f"{100 * r['rms_delta_p']:6.3f} ± {100 * r['rms_delta_p_error']:6.3f} %    "
                   f"{100 * r['same_top_p']:6.3f} ± {100 * r['same_top_p_error']:6.3f} %", "\n")

    return on_chunk


@click.command("ppl")
@click.argument("model", type=click.Path(dir_okay=False, path_type=str))
@click.option("-f", "--file", "text_file", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="UTF-8 text to score (e.g. wikitext-2's wiki.test.raw); default: the bundled sample.")
@click.option("--tokens", "tokens_file", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Score pre-tokenized input: token ids as a JSON array or separated by spaces/commas.")
@click.option("--ctx", "-c", type=click.IntRange(min=4), default=512, show_default=True,
              help="Tokens per chunk (llama-perplexity's -c).")
@click.option("--chunks", type=click.IntRange(min=1), default=None, help="Evaluate at most N chunks.")
@batch_option
@device_option
@click.option("--dtype", type=click.Choice(["auto", "f32", "f16", "bf16"]), default="auto", show_default=True,
              help="Matmul precision; auto is f32 (reproduces the CPU result); f16/bf16 need a GPU.")
@click.option("--baseline", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Reference GGUF (same vocabulary): also report KL divergence against it.")
@click.option("--kld-mode", type=click.Choice(["auto", "side-by-side", "stored"]), default="auto",
              show_default=True,
              help="With --baseline: side-by-side keeps both models resident (all statistics exact); stored "
                   "scores the baseline first into a temporary file of 8K+32 bytes per scored token (top-K "
                   "logits, log-sum-exp, tail mass and sum p log p, target logit, argmax), frees it, then loads "
                   "MODEL. Stored: every statistic is exact except the KLD, whose tail beyond the top K is only "
                   "bounded: the mean KLD is a lower bound, reported with an upper bound, and --max-kld gates on the upper "
                   "bound; auto "
                   "picks side-by-side when both models fit in free device memory.")
@click.option("--kld-top-k", type=click.IntRange(min=1), default=128, show_default=True,
              help="K of --kld-mode stored: baseline tokens kept exactly per position.")
@click.option("--max-ppl", type=float, default=None, help="Gate: exit 1 if PPL exceeds this.")
@click.option("--max-delta-ppl", type=float, default=None,
              help="Gate: exit 1 if PPL/PPL(baseline) - 1 exceeds this (0.01 = 1%); needs --baseline.")
@click.option("--max-kld", type=float, default=None, help="Gate: exit 1 if the mean KLD exceeds this; needs --baseline.")
@click.option("--ggml-rounding", is_flag=True,
              help="Compute as llama.cpp's CPU backend rounds, to reproduce llama-perplexity's numbers: matmul "
                   "inputs rounded to the weight's vec_dot_type (8-bit blocks for quantized weights, F16/BF16) "
                   "and, with --kv-cache f16, K and V rounded to F16. Default: float32, as transformers.")
@kv_cache_option
@common_options
def ppl(model: str, text_file: str | None, tokens_file: str | None, ctx: int, chunks: int | None,
        batch: int | None, device: str, dtype: str, baseline: str | None, max_ppl: float | None,
        kld_mode: str, kld_top_k: int, max_delta_ppl: float | None, max_kld: float | None, ggml_rounding: bool,
        kv_cache: str, out: Output) -> None:
    """Measure MODEL's perplexity by llama-perplexity's method (same chunks, same scored tokens, same
    error formula), on a GPU when available; with --baseline also the KL divergence statistics.
    The quality gates exit 1 with a one-line reason when exceeded.

    \b
    Example:
      ggufkit ppl model-q4_k_m.gguf -f wiki.test.raw --chunks 20
      ggufkit ppl model-q4_k_m.gguf --baseline model-f16.gguf --max-kld 0.05 --json
    """
    from ggufkit.cli._malloc import keep_freed_memory
    from ggufkit.errors import CheckFailedError, UsageError
    from ggufkit.eval.perplexity import check_gates, perplexity, read_text_file, read_tokens_file

    keep_freed_memory()

    if text_file is not None and tokens_file is not None:
        raise UsageError("give either -f/--file or --tokens, not both")
    if baseline is None and (max_delta_ppl is not None or max_kld is not None):
        raise UsageError("--max-delta-ppl and --max-kld need --baseline")
    text = read_text_file(text_file) if text_file is not None else None
    tokens = read_tokens_file(tokens_file) if tokens_file is not None else None
    result = perplexity(model, text=text, tokens=tokens, ctx=ctx, chunks=chunks, batch=batch, device=device,
                        dtype=dtype, baseline=baseline, kld_mode=kld_mode, kld_top_k=kld_top_k,
                        progress=out.progress(), on_warning=out.warn,
                        on_chunk=_chunk_printer(out, baseline is not None), ggml_rounding=ggml_rounding,
                        kv_cache=kv_cache)
    out.end_stream()
    data = result.to_dict()
    failures = check_gates(result, max_ppl=max_ppl, max_delta_ppl=max_delta_ppl, max_kld=max_kld)
    data["ok"] = not failures
    data["gates"] = {"failures": failures}
    out.result(data, _render, brief=_render_quiet)
    if failures:
        message = "quality gate failed: " + "; ".join(failures)
        if out.json_mode:  # the result above is the one JSON document; the reason goes to stderr
            click.echo(f"ggufkit: error: {message}", err=True)
            raise click.exceptions.Exit(CheckFailedError.exit_code)
        raise CheckFailedError(message)
