"""Quantize to a size budget: choose every tensor's type so that the file fits and the estimated error is least.

:func:`quantize_to_target` measures each candidate type's imatrix-weighted error on every quantizable
tensor (:mod:`ggufkit.quant.target.measure`, cached), keeps per tensor the lower convex hull of its
(bytes, error) points, and spends the budget greedily on the steepest error decrease per byte - the
Lagrangian solution of "least total error subject to total bytes <= budget" at the hull's vertices. The
mix is then an ordinary llama-quantize run: one ``--tensor-type ^name$=type`` rule per tensor over a base
preset (for ``general.file_type``), so the file is byte-identical to what ``llama-quantize
--tensor-type-file MIX`` writes, and its size, header included, is known exactly before writing
(:func:`ggufkit.quant.llama_quantize.pipeline.predict_file_size`).

The greedy alone can strand a large tensor: an upgrade that does not fit when its turn comes is dropped and
the rest of the budget goes to flatter steps. :func:`allocate_best` therefore also tries each tensor with a
step above 1 % of the budget at each of its hull points, the rest allocated again, and keeps the least total
error. With a ``final_check`` (the evaluator's, ``--sensitivity search``) the mix and the largest presets
that fit are measured before anything is written, and a preset that measures a lower KLD is returned
instead (:class:`FinalCheck`).

Only candidates whose block divides the tensor's rows are offered (llama-quantize would otherwise
substitute its fallback type, which is itself a candidate), and types that need an importance matrix
(``tensor_requires_imatrix``, src/llama-quant.cpp) only where the tensor has imatrix data.

Tensors that the input already holds quantized (a gpt-oss master keeps the checkpoint's MXFP4 experts) are
copy-only: one ``--tensor-type ^name$=TYPE`` rule of their own type each, which llama-quantize copies as they
are (llama_model_quantize_impl: ``quantize = tensor->type != new_type``), so no requantizing is needed. Their
bytes count in the budget as they are (the file size is predicted from the plan), and only the float tensors
are searched. The reference presets are planned as llama-quantize ``--allow-requantize`` writes them.
"""

from __future__ import annotations

import heapq
import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggufkit.errors import UsageError
from ggufkit.format.reader import align_up
from ggufkit.format.writer import NullProgress, Progress
from ggufkit.quant.imatrix.reader import Imatrix
from ggufkit.quant.llama_quantize.plan import QuantOptions, QuantPlan, plan_quantization
from ggufkit.quant.llama_quantize.presets import ALIASES, PRESETS, PresetChoice, get_preset, parse_type
from ggufkit.quant.registry import FLOAT_TYPES, REQUIRES_IMATRIX, TYPES
from ggufkit.quant.target.measure import (
    DEFAULT_SAMPLE_ROWS,
    MeasureCache,
    Measurement,
    cache_key,
    default_cache_dir,
    file_sha256,
    measure_all,
)

QT = GGMLQuantizationType

#: Candidates without an importance matrix (block types llama.cpp loads everywhere, plus F16).
DEFAULT_TYPES: tuple[GGMLQuantizationType, ...] = (
    QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.IQ4_NL,
    QT.IQ4_XS, QT.F16)
#: Added to :data:`DEFAULT_TYPES` when an importance matrix is given.
IMATRIX_TYPES: tuple[GGMLQuantizationType, ...] = (QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S)
#: Presets of a final check (:func:`quantize_to_target`'s ``final_check``): the largest that fit. A preset
#: family gains quality with size (Q3_K_S < Q3_K_M < Q3_K_L ...), so smaller ones rarely win; each costs a
#: quantization of the whole model in memory and a forward pass.
CHECK_PRESETS = 3
#: Presets a mix is compared with (the one nearest in size).
REFERENCE_PRESETS = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k", "q8_0")
_NEVER_REQUIRE = ("token_embd.weight", "per_layer_token_embd.weight", "output.weight")
#: ggml.c ggml_quantize_requires_imatrix: no quantizer at all without importance weights, on any tensor (an
#: imatrix from llama-imatrix has no token_embd entry)
_NO_QUANTIZER_WITHOUT = (QT.IQ2_XXS, QT.IQ2_XS, QT.IQ1_S)

_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KB": 10**3, "MB": 10**6, "GB": 10**9,
          "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE_RE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*")


def parse_target_size(text: str | int) -> int:
    """Bytes from ``123456``, ``95M``, ``1.5G`` (decimal, as ``--split-max-size``) or ``90MiB``/``1GiB``.

    Raises:
        UsageError: not a positive size.
    """
    if isinstance(text, int):
        value, mult = float(text), 1
    else:
        m = _SIZE_RE.fullmatch(text)
        unit = m.group(2).upper() if m else ""
        if m is None or unit not in _UNITS:
            raise UsageError(f"target size {text!r} is not a size such as 95000000, 95M or 90MiB")
        value, mult = float(m.group(1)), _UNITS[unit]
    if value <= 0:
        raise UsageError(f"target size {text!r} must be positive")
    return int(value * mult)


@dataclass(frozen=True)
class Choice:
    """One quantizable tensor's chosen type, its bytes and its estimated error (proxy units)."""

    name: str
    type: GGMLQuantizationType
    nbytes: int
    error: float
    kld: float | None = None

    def to_dict(self, total_error: float) -> dict[str, Any]:
        return {"name": self.name, "type": self.type.name, "bytes": self.nbytes, "error": self.error,
                "error_share": self.error / total_error if total_error > 0 else 0.0, "estimated_kld": self.kld}


#: ``final_check(candidates)``: candidate (``mix`` or a preset name) -> {tensor: type} of every tensor the plan
#: changes; returns (candidate -> measured mean KLD, measurements made now, measurements from a cache).
FinalCheckFn = Callable[[Mapping[str, Mapping[str, GGMLQuantizationType]]], tuple[dict[str, float], int, int]]


@dataclass(frozen=True)
class FinalCheck:
    """The measured comparison of the chosen mix with the presets that fit the budget.

    Attributes:
        kld: ``mix`` and each preset checked -> its mean KLD measured on the calibration text.
        chosen: ``mix`` or the preset whose per-tensor plan was returned instead.
        reason: one sentence: why.
        measured, cached: candidates measured now and taken from the cache.
    """

    kld: dict[str, float]
    chosen: str
    reason: str
    measured: int
    cached: int

    def to_dict(self) -> dict[str, Any]:
        return {"measured_kld": self.kld, "chosen": self.chosen, "reason": self.reason, "measured": self.measured,
                "cached": self.cached}


@dataclass(frozen=True)
class TargetReport:
    """What :func:`quantize_to_target` chose and wrote.

    Attributes:
        budget: the byte budget (``budget_kind``: ``file`` bytes, or tensor ``data`` bytes for a bpw target).
        plan: the llama-quantize plan of the mix (base preset plus one rule per tensor).
        rules: the ``(pattern, type)`` rules, as written to ``--mix-out``.
        predicted_size: exact size of the file.
        choices: per quantizable tensor, in output order.
        error: the mix's total estimated error; ``reference_*``: the same for the preset nearest in size.
        measured, cached: (tensor, type) measurements made now and taken from the cache.
        estimated_kld, reference_estimated_kld: the mix's and the reference preset's estimated mean KLD
            (sum of proxy errors times ``kld_sensitivity``), None without one; ``sensitivity_use``: where
            the sensitivity went (``none``, ``estimate`` or ``search``).
        final_check: the measured comparison with the presets that fit (``final_check`` given), else None;
            where a preset won, ``plan``/``rules``/``choices`` are that preset's.
    """

    input: Path
    output: Path | None
    budget: int
    budget_kind: str
    feasible: tuple[int, int]
    plan: QuantPlan
    rules: tuple[tuple[str, GGMLQuantizationType], ...]
    predicted_size: int
    choices: tuple[Choice, ...]
    error: float
    reference_preset: str
    reference_size: int
    reference_error: float
    proxy: str
    measured: int
    cached: int
    seconds: float
    dry_run: bool
    imatrix: Path | None = None
    mix_out: Path | None = None
    estimated_kld: float | None = None
    reference_estimated_kld: float | None = None
    sensitivity_use: str = "none"
    final_check: FinalCheck | None = None

    def to_dict(self) -> dict[str, Any]:
        t = self.plan.to_dict()["totals"]
        return {"input": str(self.input), "output": str(self.output) if self.output else None,
                "dry_run": self.dry_run, "budget": self.budget, "budget_kind": self.budget_kind,
                "feasible": list(self.feasible), "predicted_size": self.predicted_size,
                "bits_per_weight": t["bits_per_weight"], "base_preset": self.plan.target, "proxy": self.proxy,
                "estimated_error": self.error, "reference": {
                    "preset": self.reference_preset, "size": self.reference_size, "estimated_error":
                    self.reference_error, "ratio": self.error / self.reference_error if self.reference_error else None,
                    "estimated_kld": self.reference_estimated_kld, "kld_ratio": self.estimated_kld
                    / self.reference_estimated_kld if self.estimated_kld is not None and
                    self.reference_estimated_kld else None},
                "estimated_kld": self.estimated_kld, "sensitivity": self.sensitivity_use,
                "measured": self.measured, "cached": self.cached, "seconds": round(self.seconds, 3),
                "imatrix": str(self.imatrix) if self.imatrix else None,
                "mix_out": str(self.mix_out) if self.mix_out else None, "types": t["types"],
                "final_check": self.final_check.to_dict() if self.final_check is not None else None,
                "tensors": [c.to_dict(self.error) for c in self.choices],
                "rules": [f"{p}={q.name.lower()}" for p, q in self.rules]}


def _allowed(name: str, ne0: int, cands: Sequence[GGMLQuantizationType], has_im_entry: bool
             ) -> list[GGMLQuantizationType]:
    out = []
    for t in cands:
        if ne0 % GGML_QUANT_SIZES[t][0]:
            continue
        if t in REQUIRES_IMATRIX and not has_im_entry and (name not in _NEVER_REQUIRE or t in _NO_QUANTIZER_WITHOUT):
            continue
        out.append(t)
    return out


def _hull(points: Sequence[tuple[int, float, GGMLQuantizationType]]) -> list[tuple[int, float, GGMLQuantizationType]]:
    """Lower convex hull of (cost, error) points, cheapest first, error strictly decreasing."""
    pts = sorted(points, key=lambda p: (p[0], p[1]))
    front: list[tuple[int, float, GGMLQuantizationType]] = []
    for p in pts:
        if front and p[1] >= front[-1][1]:
            continue  # dominated: not cheaper and not better
        if front and p[0] == front[-1][0]:
            front.pop()
        front.append(p)
    hull: list[tuple[int, float, GGMLQuantizationType]] = []
    for p in front:
        while len(hull) >= 2:
            (c1, e1, _), (c2, e2, _) = hull[-2], hull[-1]
            # drop hull[-1] if it lies on or above the segment hull[-2] -> p
            if (e2 - e1) * (p[0] - c1) >= (p[1] - e1) * (c2 - c1):
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def allocate(options: Mapping[str, Sequence[tuple[int, float, GGMLQuantizationType]]], budget: int
             ) -> dict[str, int]:
    """Greedy over the convex hulls: start every tensor at its cheapest point, then take the upgrade with
    the largest error decrease per byte that still fits, until none fits.

    Args:
        options: tensor -> ``(cost, error, type)`` points.
        budget: bytes available to these tensors.

    Returns:
        tensor -> index into its hull (see :func:`_hull`); the caller re-derives the hulls.
    """
    hulls = {n: _hull(p) for n, p in options.items()}
    pos = dict.fromkeys(hulls, 0)
    spent = sum(h[0][0] for h in hulls.values())
    heap: list[tuple[float, str]] = []

    def push(n: str) -> None:
        h, i = hulls[n], pos[n]
        if i + 1 < len(h):
            dc, de = h[i + 1][0] - h[i][0], h[i][1] - h[i + 1][1]
            heapq.heappush(heap, (-de / dc, n))

    for n in hulls:
        push(n)
    while heap:
        _, n = heapq.heappop(heap)
        h, i = hulls[n], pos[n]
        dc = h[i + 1][0] - h[i][0]
        if spent + dc <= budget:
            spent += dc
            pos[n] = i + 1
            push(n)
    return pos


def allocate_best(options: Mapping[str, Sequence[tuple[int, float, GGMLQuantizationType]]], budget: int,
                  big: float = 0.01) -> dict[str, int]:
    """:func:`allocate`, then each tensor with a hull step larger than ``big`` x ``budget`` tried at each of
    its hull points with the rest allocated again; the assignment of least total error is kept.

    The greedy drops an upgrade that does not fit when its turn comes and spends the rest on flatter steps:
    on Gemma 3 270M at Q4_K_M's size the tied 262144 x 640 token_embd's Q5_1 -> Q8_0 step (52 MB of a
    253 MB budget) came up after the layers had taken most of the bytes, so the mix kept it at Q5_1 (its own
    estimated KLD 0.0169) while the preset, token_embd at Q8_0, estimated 5e-6.
    """
    hulls = {n: _hull(p) for n, p in options.items()}

    def total(pos: Mapping[str, int]) -> tuple[float, int]:
        return (sum(hulls[n][i][1] for n, i in pos.items()), sum(hulls[n][i][0] for n, i in pos.items()))

    best = allocate(options, budget)
    best_err = total(best)[0]
    for n, h in hulls.items():
        if not any(h[i + 1][0] - h[i][0] > big * budget for i in range(len(h) - 1)):
            continue
        rest = {m: p for m, p in options.items() if m != n}
        for j, (c, _, _) in enumerate(h):
            if j == best[n] or c + sum(hulls[m][0][0] for m in rest) > budget:
                continue
            pos = {**allocate(rest, budget - c), n: j}
            err, spent = total(pos)
            if spent <= budget and err < best_err:
                best, best_err = pos, err
    return best


def kept_quantized(tensors: Sequence[Any]) -> dict[str, GGMLQuantizationType]:
    """The tensors a search copies as they are: those the input already holds in a block-quantized type
    (a gpt-oss master's MXFP4 experts), name -> type."""
    return {t.name: t.ggml_type for t in tensors
            if t.ggml_type not in FLOAT_TYPES and GGML_QUANT_SIZES[t.ggml_type][0] > 1}


def _base_preset(types: Mapping[GGMLQuantizationType, int], has_imatrix: bool) -> str:
    """The preset whose default type holds the most weights of the mix (q8_0 when none fits)."""
    for t, _ in sorted(types.items(), key=lambda kv: -kv[1]):
        for p in PRESETS.values():
            if p.default_type == t and p.is_quantized and p.name not in ALIASES and p.name not in (
                    "q2_k_s", "mxfp4_moe") and (has_imatrix or not p.needs_imatrix):
                return p.name
    return "q8_0"


def _write_rules(path: Path, rules: Sequence[tuple[str, GGMLQuantizationType]]) -> None:
    """A llama-quantize ``--tensor-type-file``: one ``PATTERN=TYPE`` per line (quantize.cpp
    ``parse_tensor_type_file`` reads white-space separated words, so no comments)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.writelines(f"{p}={t.name.lower()}\n" for p, t in rules)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _final_check(fn: FinalCheckFn, plan: QuantPlan, rules: list[tuple[str, GGMLQuantizationType]],
                 ref_plans: Mapping[str, QuantPlan], ref_sizes: Mapping[str, int], points: Mapping[str, Any],
                 cands: Sequence[GGMLQuantizationType], budget: int, kind: str, n_presets: int | None,
                 make_plan: Callable[[str, Sequence[tuple[str, GGMLQuantizationType]]], QuantPlan],
                 size_of: Callable[[QuantPlan], int], keep_rules: Sequence[tuple[str, GGMLQuantizationType]] = ()
                 ) -> tuple[QuantPlan, list[tuple[str, GGMLQuantizationType]], FinalCheck]:
    """Measure the mix and the largest presets that fit; return the plan of least measured KLD (a preset's
    own plan, with no rules but ``keep_rules``, the copy-only tensors'), the mix on a tie."""
    fitting: dict[str, tuple[QuantPlan, list[tuple[str, GGMLQuantizationType]]]] = {}
    for name in sorted(ref_plans, key=lambda n: -ref_sizes[n]):
        if n_presets is not None and len(fitting) >= n_presets:
            break
        ents = [e for e in ref_plans[name].entries if e.name in points]
        # ref_sizes are the presets as llama-quantize --allow-requantize writes them: with copy-only tensors
        # the preset's own size here is the one with them kept, known only from its plan below
        if (kind == "file" and not keep_rules and ref_sizes[name] > budget) or any(
                e.dst_type not in cands for e in ents):
            continue
        # the preset itself, no rules: one rule per tensor would add the rules to the header (and a file of
        # the preset's own size would no longer fit); --mix-out then holds no rule and llama-quantize's PRESET
        # alone writes the same file (the copy-only tensors' rules apart)
        pplan = make_plan(name, list(keep_rules))
        if size_of(pplan) <= budget:
            fitting[name] = (pplan, list(keep_rules))

    def changed(p: QuantPlan) -> dict[str, GGMLQuantizationType]:
        return {e.name: e.dst_type for e in p.entries if e.dst_type != e.src_type}

    kld, n_new, n_old = fn({"mix": changed(plan), **{n: changed(p) for n, (p, _) in fitting.items()}})
    best = min(fitting, key=lambda n: kld[n]) if fitting else None
    if best is None:
        return plan, rules, FinalCheck(kld, "mix", "no preset fits the budget with the candidate types", n_new,
                                       n_old)
    if kld[best] < kld["mix"]:
        return *fitting[best], FinalCheck(
            kld, best, f"{best.upper()} fits the budget and measures a lower mean KLD on the calibration text "
            f"({kld[best]:.4g}) than the mix ({kld['mix']:.4g}): its per-tensor plan is used", n_new, n_old)
    return plan, rules, FinalCheck(kld, "mix", f"the mix measures a mean KLD of {kld['mix']:.4g} on the "
                                   f"calibration text, no more than any preset that fits (best {best.upper()} "
                                   f"{kld[best]:.4g})", n_new, n_old)


class _Renamed:
    """A progress bar whose phase is named ``quantizing`` (the writer's bar says ``writing NAME``)."""

    def __init__(self, inner: Progress, name: str) -> None:
        self.inner, self.name = inner, name

    def begin(self, total: int, unit: str, desc: str) -> None:
        self.inner.begin(total, unit, f"{self.name} ({desc})")

    def advance(self, n: int) -> None:
        self.inner.advance(n)

    def end(self) -> None:
        self.inner.end()


def quantize_to_target(input: str | Path, output: str | Path | None, *, target_size: int | str | None = None,
                       target_bpw: float | None = None, target_like: str | PresetChoice | None = None,
                       imatrix: str | Path | Imatrix | None = None,
                       types: Sequence[str | GGMLQuantizationType] | None = None, dry_run: bool = False,
                       mix_out: str | Path | None = None, cache_dir: str | Path | None = None,
                       sample_rows: int = DEFAULT_SAMPLE_ROWS, proxy: str = "relative",
                       sensitivity: Mapping[str, float] | None = None,
                       kld_sensitivity: Mapping[str, float] | None = None, threads: int | None = None,
                       device: str = "auto", progress: Progress | None = None, final_check: FinalCheckFn | None = None,
                       check_presets: int | None = CHECK_PRESETS) -> TargetReport:
    """Quantize ``input`` to the least estimated error within a size budget.

    Args:
        input: F32/F16/BF16 GGUF model; tensors it already holds quantized (a gpt-oss master's MXFP4 experts)
            are kept as they are, their bytes counted in the budget (module docstring).
        output: the file to write (atomically); may be None with ``dry_run``.
        target_size: bytes of the whole output file (int or ``95M``, ``90MiB``...).
        target_bpw: bits per weight over all tensors (tensor data only, as ``info`` reports it).
        target_like: a preset name (or one parsed, :class:`~ggufkit.quant.llama_quantize.presets.PresetChoice`):
            the size of the file llama-quantize would write for it (same imatrix).
        imatrix: llama-imatrix file (or loaded :class:`Imatrix`), used to quantize and to weight the error.
        types: candidate types (default :data:`DEFAULT_TYPES`, plus :data:`IMATRIX_TYPES` with an imatrix).
        dry_run: plan and measure only, write no model.
        mix_out: also write the rules as a llama-quantize ``--tensor-type-file``.
        cache_dir: measurement cache (default ``~/.cache/ggufkit/target``).
        sample_rows: rows measured per tensor (per expert).
        proxy: ``relative`` (imatrix-weighted squared error over the tensor's weighted energy, the default) or
            ``absolute`` (the weighted squared error). llama-perplexity's mean KLD on SmolLM2-135M
            (benchmarks/bench_quantize_target.py): at Q2_K's size 0.0230 relative, 0.0170 absolute (preset
            0.2597); at Q3_K_M's 0.0146 relative, 0.0327 absolute (preset 0.0765: absolute spends 9 MB on
            token_embd at Q8_0).
        sensitivity: optional tensor name -> factor multiplying its error in the search (e.g. from a KLD
            measurement, :func:`ggufkit.eval.target_sensitivity.measure_sensitivity`).
        kld_sensitivity: tensor name -> mean KLD per proxy unit (same measurement): the report then
            estimates the mix's and the reference preset's mean KLD (``estimated_kld``).
        threads, device: as :func:`ggufkit.quant.llama_quantize.pipeline.quantize_file`.
        progress: one bar per phase: ``planning presets``, ``measuring``, ``allocating``, ``quantizing``.
        final_check: measures the mix and the presets that fit (see :data:`FinalCheckFn`; the evaluator's,
            :func:`ggufkit.eval.target_sensitivity.quantize_to_target_kld`): where a preset measures a lower
            KLD than the mix, that preset's per-tensor plan is returned and written instead (``final_check``
            in the report says so).
        check_presets: how many of the largest presets that fit the budget (and use only candidate types) the
            final check measures (None: all).

    Returns:
        A :class:`TargetReport`.

    Raises:
        UsageError: not exactly one target; a budget outside the reachable range (named in the message);
            an imatrix-only type in ``types`` without an imatrix; an unknown type or preset.
    """
    from ggufkit.format import open_gguf
    from ggufkit.quant.imatrix.reader import load_imatrix
    from ggufkit.quant.llama_quantize.pipeline import predict_file_size, quantize_file

    start = time.perf_counter()
    input = Path(input)
    phase = progress or NullProgress()
    if sum(x is not None for x in (target_size, target_bpw, target_like)) != 1:
        raise UsageError("give exactly one of --target-size, --target-bpw, --target-like")
    if proxy not in ("relative", "absolute"):
        raise UsageError(f"unknown error proxy {proxy!r}; choose relative or absolute")
    if output is None and not dry_run:
        raise UsageError("an output path is required (or use --dry-run)")
    out_path = Path(output) if output is not None else None
    if out_path is not None and out_path.exists() and out_path.resolve() == input.resolve():
        raise UsageError(f"input and output are the same file: {input}")
    im = load_imatrix(imatrix) if isinstance(imatrix, (str, Path)) else imatrix
    has_im = im is not None and bool(im.entries)
    if types:
        cands = tuple(dict.fromkeys(parse_type(t, "--types type") for t in types))
        need = [t.name for t in cands if t in REQUIRES_IMATRIX]
        if need and not has_im:
            raise UsageError(f"--types {', '.join(need)} need an importance matrix: pass --imatrix")
        missing = [t.name for t in cands if t not in TYPES]
        if missing:
            raise UsageError(f"no kernel for {', '.join(missing)} in this ggufkit build")
    else:
        cands = DEFAULT_TYPES + (IMATRIX_TYPES if has_im else ())
    preset_for_like = get_preset(target_like) if target_like is not None else None
    if preset_for_like is not None and preset_for_like.needs_imatrix and not has_im:
        raise UsageError(f"--target-like {preset_for_like.name.upper()} needs an importance matrix: pass --imatrix")
    sizes = im.sizes() if im is not None and has_im else None

    def make_plan(model: Any, base: str, rules: Sequence[tuple[str, GGMLQuantizationType]]) -> QuantPlan:
        return plan_quantization(model.tensors, base, arch=model.architecture or "", metadata=model.kv,
                                 options=QuantOptions(tensor_types=tuple(rules), imatrix_sizes=sizes))

    with open_gguf(input) as model:
        keep = kept_quantized(model.tensors)
        scan = make_plan(model, "q8_0", [(f"^{re.escape(n)}$", t) for n, t in keep.items()])
        keep_rules = [(f"^{re.escape(e.name)}$", keep[e.name]) for e in scan.entries if e.name in keep]
        # a tensor is quantizable when q8_0 changes it (a row that is not whole 32-blocks falls back to F16)
        quantizable = [e for e in scan.entries if e.name not in keep and (e.dst_type != e.src_type or e.fallback)]
        im_entry = {e.name: im is not None and has_im and im.for_tensor(e.src_name or e.name, e.shape) is not None
                    for e in quantizable}
        allowed = {e.name: _allowed(e.name, e.shape[-1], cands, im_entry[e.name]) for e in quantizable}
        allowed = {n: a for n, a in allowed.items() if a}
        # the presets' types are measured too (every target on these inputs then finds them in the cache),
        # to compare the mix's estimated error with the nearest preset's (or --target-like's)
        ref_plans = {}
        ref_names = [n for n in dict.fromkeys([*([preset_for_like.name] if preset_for_like else []),
                                               *REFERENCE_PRESETS]) if has_im or not PRESETS[n].needs_imatrix]
        phase.begin(len(ref_names), "preset", "planning presets")
        for name in ref_names:
            ref_plans[name] = plan_quantization(model.tensors, name, arch=model.architecture or "", metadata=model.kv,
                                                options=QuantOptions(imatrix_sizes=sizes, allow_requantize=bool(keep)))
            phase.advance(1)
        ref_sizes = {n: predict_file_size(model, p, im) for n, p in ref_plans.items()}
        phase.end()
        n_total = scan.n_elements
        if target_like is not None:
            budget, kind = ref_sizes[next(iter(ref_plans))], "file"
        elif target_bpw is not None:
            if not target_bpw > 0:
                raise UsageError(f"target bits per weight {target_bpw} must be positive")
            budget, kind = int(target_bpw * n_total / 8), "data"
        else:
            budget, kind = parse_target_size(target_size if target_size is not None else 0), "file"
        wanted: dict[str, list[GGMLQuantizationType]] = {n: list(a) for n, a in allowed.items()}
        for p in ref_plans.values():
            for e in p.entries:
                if e.name in wanted and e.dst_type not in wanted[e.name]:
                    wanted[e.name].append(e.dst_type)
        cache = MeasureCache(Path(cache_dir) if cache_dir is not None else default_cache_dir(), cache_key(
            file_sha256([f.path for f in model.files]), im.sha256 if im is not None and has_im else None,
            sample_rows))
        if progress is not None:
            progress.begin(len(wanted), "tensor", "measuring")
        meas, n_measured, n_cached = measure_all(
            model, wanted, im if has_im else None, im_entry, cache, sample_rows, threads,
            on_tensor=(lambda _n: progress.advance(1)) if progress is not None else None)
        if progress is not None:
            progress.end()

        def raw(m: Measurement) -> float:
            return m.relative if proxy == "relative" else m.sse

        def err(name: str, m: Measurement) -> float:
            return raw(m) * (sensitivity.get(name, 1.0) if sensitivity else 1.0)

        def kld(name: str, m: Measurement) -> float | None:
            return raw(m) * kld_sensitivity.get(name, 0.0) if kld_sensitivity is not None else None

        shape = {e.name: e.shape for e in scan.entries}

        def cost(name: str, t: GGMLQuantizationType) -> int:
            from ggufkit.quant.llama_quantize.plan import tensor_nbytes

            nb = tensor_nbytes(t, shape[name])
            return align_up(nb, 32) if kind == "file" else nb

        points = {n: [(cost(n, t), err(n, meas[n][t]), t) for t in a] for n, a in allowed.items()}

        def build(pos: Mapping[str, int]) -> tuple[QuantPlan, list[tuple[str, GGMLQuantizationType]], int]:
            chosen = {n: _hull(points[n])[pos[n]][2] for n in points}
            weight: dict[GGMLQuantizationType, int] = {}
            for n, t in chosen.items():
                k = 1
                for d in shape[n]:
                    k *= d
                weight[t] = weight.get(t, 0) + k
            rules = [(f"^{re.escape(n)}$", t) for n, t in chosen.items()]
            if keep:  # the copy-only tensors' rules among them, in the file's order
                rules = [(f"^{re.escape(e.name)}$", keep[e.name] if e.name in keep else chosen[e.name])
                         for e in scan.entries if e.name in keep or e.name in chosen]
            plan = make_plan(model, _base_preset(weight, has_im), rules)
            size = predict_file_size(model, plan, im) if kind == "file" else plan.nbytes
            phase.advance(1)
            return plan, rules, size

        phase.begin(3, "plan", "allocating")  # the two bounds and (nearly always) one allocation
        _, _, lo = build(dict.fromkeys(points, 0))
        _, _, hi = build({n: len(_hull(p)) - 1 for n, p in points.items()})
        what = "target size" if kind == "file" else "tensor data of the bpw target"
        if not lo <= budget <= hi:
            unit = "bytes" if kind == "file" else f"bytes ({lo * 8 / n_total:.4f}..{hi * 8 / n_total:.4f} bpw)"
            kept = ""
            if keep:
                k_types = ", ".join(sorted({t.name for t in keep.values()}))
                k_bytes = sum(e.nbytes for e in scan.entries if e.name in keep)
                kept = f"; {len(keep)} {k_types} tensors of the input are kept as they are ({k_bytes} bytes)"
            raise UsageError(f"{what} {budget} bytes is outside the reachable range {lo}..{hi} {unit} "
                             f"with candidates {', '.join(t.name for t in cands)}{kept}")
        overhead = lo - sum(_hull(p)[0][0] for p in points.values())
        room = budget - overhead
        for _ in range(16):  # the header (the recipe's type names) changes with the mix: shrink until it fits
            plan, rules, size = build(allocate_best(points, room))
            if size <= budget:
                break
            room -= size - budget
        else:  # pragma: no cover - each pass lowers the room by the overshoot
            raise UsageError(f"could not fit {what} {budget} bytes")
        phase.end()
        check = None
        if final_check is not None:
            plan, rules, check = _final_check(final_check, plan, rules, ref_plans, ref_sizes, points, cands, budget,
                                              kind, check_presets, lambda b, r: make_plan(model, b, r),
                                              lambda p: predict_file_size(model, p, im) if kind == "file" else p.nbytes,
                                              keep_rules)
        by_name = {e.name: e for e in plan.entries}
        choices = tuple(Choice(n, by_name[n].dst_type, by_name[n].nbytes, err(n, meas[n][by_name[n].dst_type]),
                               kld(n, meas[n][by_name[n].dst_type]))
                        for n in (e.name for e in plan.entries) if n in points)
        total = sum(c.error for c in choices)
        file_size = predict_file_size(model, plan, im)
        ref_name = preset_for_like.name if preset_for_like else min(
            ref_sizes, key=lambda n: abs(ref_sizes[n] - (file_size if kind == "file" else budget * 1.0)))
        ref_in = [(e.name, meas[e.name][e.dst_type]) for e in ref_plans[ref_name].entries
                  if e.name in points and e.dst_type in meas[e.name]]
        ref_err = sum(err(n, m) for n, m in ref_in)
        est_kld = ref_kld = None
        if kld_sensitivity is not None:
            est_kld = sum(c.kld or 0.0 for c in choices)
            ref_kld = sum(kld(n, m) or 0.0 for n, m in ref_in)
    if mix_out is not None:
        _write_rules(Path(mix_out), rules)
    written = None
    if not dry_run and out_path is not None:
        quantize_file(input, out_path, plan.target, imatrix=im if has_im else None, tensor_types=rules,
                      threads=threads, device=device, progress=_Renamed(phase, "quantizing"))
        actual = out_path.stat().st_size
        if actual != file_size or (kind == "file" and actual > budget):  # never leave a file over budget
            out_path.unlink()
            raise UsageError(f"internal error: wrote {actual} bytes, predicted {file_size} (budget {budget})")
        written = out_path
    return TargetReport(input, written, budget, kind, (lo, hi), plan, tuple(rules), file_size, choices, total,
                        ref_name, ref_sizes[ref_name], ref_err, proxy, n_measured, n_cached,
                        time.perf_counter() - start, dry_run, im.path if im is not None else None,
                        Path(mix_out) if mix_out is not None else None, est_kld, ref_kld,
                        "search" if sensitivity else "estimate" if kld_sensitivity is not None else "none", check)
