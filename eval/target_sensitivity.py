"""Measured KL-divergence sensitivity of tensor groups, for ``quantize --target-size`` (issue #16).

The size-budget search (:mod:`ggufkit.quant.target.search`) ranks types by an imatrix-weighted weight-error proxy.
That proxy says how much noise a type adds to a tensor's output, not how much the model's predictions
suffer from it. This module measures the second directly, once per tensor group, with the evaluator:

1. tokenize ``chunks`` x ``ctx`` tokens of a calibration text (the bundled sample by default), run the
   unmodified model once and keep its logits and the residual stream entering every layer;
2. for each group (one tensor kind - ``attn_q``+``attn_k``, ``attn_v``, ``attn_output``, ``ffn_gate``+
   ``ffn_up``, ``ffn_down``, expert tensors alike - in one band of layers; ``token_embd`` and ``output``
   alone) replace the group's tensors, in memory, by their probe-type quantization (ggufkit's byte-exact
   kernels, the imatrix applied as llama-quantize applies it, then :mod:`ggufkit.eval.dequant`), run the
   model from the first layer of the group on the stored residual stream (the layers below it are
   unchanged), and take the mean KL divergence from the base logits over llama-perplexity's scored
   positions (second half of each chunk), with :class:`ggufkit.eval.kld.KLDAccumulator`;
3. divide by the group's proxy error at the probe type (the search's own measurement, same cache): the
   group's KLD per proxy unit, the tensors' ``sensitivity``. Where the weights already lie on the probe
   type's grid (an F16 made from a quantized file: Gemma 3 270M's attn_output from Q4_K measures a relative
   proxy error of 2e-7 and a KLD of 2e-8 at Q4_K), that ratio is one of two near-zeros; such a group (mean
   relative proxy error below :data:`TINY_RELATIVE`, or below :data:`ON_GRID_RATIO` times the second
   probe's) is probed once more at a type of another grid
   (:data:`ALT_PROBE_TYPES`: Q3_K where rows are whole 256-blocks, else IQ4_NL) and its factor is the least
   squares slope through the origin over both points, ``sum(kld * proxy) / sum(proxy^2)``, which the larger
   (the real) error dominates;
4. calibrate: a mix's linear estimate is the sum of its tensors' proxy errors times their factors, ``S``.
   Two more passes, every group at once at its probe type and then at a low probe type (Q2_K where the rows
   are whole 256-blocks, else Q4_0), give two points ``(S, KLD)``; the fitted ``KLD = c * S^gamma``
   (``gamma`` in [1, 2]: errors of many tensors compound at low bits) turns ``S`` into the estimated mean
   KLD (:meth:`SensitivityResult.estimate`).

What the estimate cannot see: llama.cpp's rounding of activations at run time (Q8_0/Q8_1/Q8_K inputs of
quantized matmuls), which stays when the weights are nearly lossless (benchmarks/bench_quantize_target.py).

Nothing is written but the cache: one JSON file per (model hash, imatrix hash, text hash, ctx, chunks,
bands, probe types), rewritten after every group, so a killed measurement resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggufkit.errors import UsageError
from ggufkit.eval.target_calibration import SENSITIVITY_VERSION, Calibration, KLDCache, first_layer
from ggufkit.format.writer import NullProgress, Progress
from ggufkit.quant.imatrix.reader import Imatrix
from ggufkit.quant.registry import REQUIRES_IMATRIX
from ggufkit.quant.target.measure import DEFAULT_SAMPLE_ROWS

Q = GGMLQuantizationType

#: Probe types: each tensor is probed with the first whose block divides its rows.
PROBE_TYPES: tuple[GGMLQuantizationType, ...] = (Q.Q4_K, Q.Q4_0)
#: Second probe types, for a group whose first probe finds its weights on the probe's grid: another grid
#: (Q3_K's 3-bit levels do not contain Q4_K's; IQ4_NL's non-uniform levels contain no uniform grid).
ALT_PROBE_TYPES: tuple[GGMLQuantizationType, ...] = (Q.Q3_K, Q.IQ4_NL)
#: A group is on its probe's grid, and probed again, where its first probe's relative proxy error (per
#: tensor, mean) is below ``TINY_RELATIVE`` or below ``ON_GRID_RATIO`` times the second probe's. A 4-bit type
#: adds 1e-3..1e-1 to weights that are not on its grid (Q8_0 1e-5..3e-4), and Q4_K about 0.25x of what Q3_K
#: adds, Q4_0 about what IQ4_NL adds; weights on the grid measure 1e-8..1e-7 (Gemma 3 270M from Q4_K_M:
#: 2e-6x Q3_K's) or, where requantizing with an imatrix lands on a slightly different scale, 4e-5..8e-5
#: (a tiny model's Q4_K ffn_down made F16: 3.5e-3x Q3_K's).
TINY_RELATIVE = 1e-5
ON_GRID_RATIO = 0.05
#: Low probe types of the calibration pass (:attr:`SensitivityResult.curve`).
LOW_PROBE_TYPES: tuple[GGMLQuantizationType, ...] = (Q.Q2_K, Q.Q4_0)
_LOW = f"*low:{','.join(t.name for t in LOW_PROBE_TYPES)}*"
_ALT = f"|alt:{','.join(t.name for t in ALT_PROBE_TYPES)}"
#: Calibration defaults: one 256-token chunk (127 scored positions) and 4 bands of layers.
DEFAULT_CTX = 256
DEFAULT_CHUNKS = 1
DEFAULT_BANDS = 4
#: Tensor kinds measured together (their errors meet in the same product: Q.K scores, gate*up).
_KIND_GROUP = {"attn_q": "attn_qk", "attn_k": "attn_qk", "ffn_gate": "ffn_gate_up", "ffn_up": "ffn_gate_up",
               "ffn_gate_exps": "ffn_gate_up_exps", "ffn_up_exps": "ffn_gate_up_exps"}
_BLK = re.compile(r"blk\.(\d+)\.(.+)\.weight")


@dataclass(frozen=True)
class GroupSensitivity:
    """One group's measurement: its tensors and probe types, mean KLD, summed proxy error, KLD per proxy.

    ``kld_alt``, ``proxy_alt``, ``probes_alt``: the second probe's, where the first found the weights on its
    grid (``tiny``), else None / empty.
    """

    group: str
    tensors: tuple[str, ...]
    probes: tuple[str, ...]
    first_layer: int
    kld: float
    proxy: float
    tiny: bool = False
    probes_alt: tuple[str, ...] = ()
    kld_alt: float | None = None
    proxy_alt: float | None = None

    @property
    def factor(self) -> float:
        """Least squares slope through the origin of KLD over proxy error, over the group's probes."""
        pts = [(self.proxy, self.kld)] + ([(self.proxy_alt, self.kld_alt)] if self.proxy_alt is not None
                                          and self.kld_alt is not None else [])
        den = sum(p * p for p, _ in pts)
        return sum(p * k for p, k in pts) / den if den > 0 else 0.0

    @property
    def reliable(self) -> bool:
        """The factor rests on a real (not on-grid) error: the first probe, or the second where measured."""
        if not self.tiny:
            return self.proxy > 0 and self.kld > 0
        return self.proxy_alt is not None and self.proxy_alt > 0 and (self.kld_alt or 0.0) > 0


@dataclass
class SensitivityResult:
    """What :func:`measure_sensitivity` found.

    Attributes:
        sensitivity: tensor -> factor (its group's mean KLD per proxy unit); the search's ``sensitivity``.
        groups: the per-group measurements.
        kld_all: mean KLD with every group at its probe type at once, ``linear_all`` its linear estimate
            (sum of proxy errors times factors); ``additivity``: it over the sum of the groups' KLDs. ``kld_low``, ``linear_low``: measured and linear-estimated KLD with every group
            at its low probe type. ``curve``: ``(c, gamma)`` of the calibration ``KLD = c * S^gamma``.
        proxy: the proxy the factors belong to (``relative`` or ``absolute``).
        tokens: calibration tokens run (``chunks`` x ``ctx``); ``scored``: positions the KLD averages.
        measured, cached: groups (and the all-at-once pass) run now and taken from the cache.
    """

    sensitivity: dict[str, float]
    groups: list[GroupSensitivity]
    kld_all: float
    additivity: float
    kld_low: float
    linear_low: float
    curve: tuple[float, float]
    proxy: str
    ctx: int
    chunks: int
    tokens: int
    scored: int
    text_sha256: str
    measured: int
    cached: int
    seconds: float
    cache_path: str | None = None
    notes: list[str] = field(default_factory=list)
    linear_all: float = 0.0

    def estimate(self, linear: float) -> float:
        """The calibrated mean KLD of a mix whose summed sensitivity-scaled proxy error is ``linear``."""
        c, gamma = self.curve
        return c * linear ** gamma if linear > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["groups"] = [{**asdict(g), "factor": g.factor} for g in self.groups]
        return d


def tensor_groups(names: Sequence[str], n_layer: int, bands: int) -> dict[str, tuple[list[str], int]]:
    """Group tensor names: ``kind@a-b`` for block tensors (layers a..b, ``bands`` bands of about equal
    size), the name itself otherwise. Returns group -> (tensors, first layer; ``-1`` for the embedding and
    ``n_layer`` for tensors after the last block)."""
    bands = max(1, min(bands, n_layer))
    edges = [round(i * n_layer / bands) for i in range(bands + 1)]
    out: dict[str, tuple[list[str], int]] = {}
    for name in names:
        m = _BLK.fullmatch(name)
        if m is None:
            first = first_layer(name, n_layer)
            out.setdefault(name.removesuffix(".weight"), ([], first))[0].append(name)
            continue
        layer, kind = int(m.group(1)), m.group(2)
        b = max(i for i in range(bands) if edges[i] <= layer)
        key = f"{_KIND_GROUP.get(kind, kind)}@{edges[b]}-{edges[b + 1] - 1}"
        out.setdefault(key, ([], edges[b]))[0].append(name)
    return out


def probe_type(name: str, ne0: int, has_imatrix: bool,
               probes: Sequence[GGMLQuantizationType] = PROBE_TYPES) -> GGMLQuantizationType | None:
    """The first of ``probes`` whose block divides ``ne0`` (and that needs no imatrix where there is none)."""
    for t in probes:
        if ne0 % GGML_QUANT_SIZES[t][0] == 0 and (has_imatrix or t not in REQUIRES_IMATRIX):
            return t
    return None


def measure_sensitivity(input: str | os.PathLike[str], *, tensors: Sequence[str] | None = None,
                        imatrix: str | os.PathLike[str] | Imatrix | None = None, text: str | None = None,
                        ctx: int = DEFAULT_CTX, chunks: int = DEFAULT_CHUNKS, bands: int = DEFAULT_BANDS,
                        probes: Sequence[GGMLQuantizationType] = PROBE_TYPES, proxy: str = "relative",
                        cache_dir: str | os.PathLike[str] | None = None, sample_rows: int = DEFAULT_SAMPLE_ROWS,
                        threads: int | None = None, device: str = "cpu",
                        progress: Progress | None = None) -> SensitivityResult:
    """Measure each tensor group's KL divergence per proxy unit (see the module docstring).

    Args:
        input: the F32/F16/BF16 GGUF the search quantizes.
        tensors: the tensors to measure (default: every weight of two or more dimensions whose rows are
            whole 32-blocks).
        imatrix: the search's importance matrix (used to quantize the probes and to weight the proxy).
        text: calibration text (default: the bundled sample, ``ggufkit.eval.perplexity.sample_text``).
        ctx, chunks: ``chunks`` chunks of ``ctx`` tokens are run; the text must hold that many tokens.
        bands: layer bands per tensor kind.
        probes: probe types (per tensor the first whose block divides its rows).
        proxy: the search's proxy, ``relative`` or ``absolute``.
        cache_dir: cache directory (default: the search's, ``~/.cache/ggufkit/target``).
        sample_rows: the search's rows per tensor for the proxy (shares its cache).
        threads: quantization threads; device: the evaluator's device.
        progress: one step per group.

    Returns:
        A :class:`SensitivityResult`; its ``sensitivity`` is ``quantize_to_target``'s argument.

    Raises:
        UsageError: the text holds fewer than ``ctx * chunks`` tokens, bad ``ctx``/``chunks``/``proxy``.
        EvaluationError: the model cannot be evaluated.
    """
    from ggufkit.eval.model import load_model
    from ggufkit.eval.perplexity import sample_text, tokenize_text
    from ggufkit.quant.imatrix.reader import load_imatrix
    from ggufkit.quant.target.measure import (
        MeasureCache,
        cache_key,
        default_cache_dir,
        file_sha256,
        measure_all,
    )

    t_start = time.perf_counter()
    if ctx < 8 or chunks < 1:
        raise UsageError(f"calibration ctx {ctx} and chunks {chunks} must be at least 8 and 1")
    if proxy not in ("relative", "absolute"):
        raise UsageError(f"unknown error proxy {proxy!r}; choose relative or absolute")
    progress = progress or NullProgress()
    im = load_imatrix(imatrix) if isinstance(imatrix, (str, os.PathLike)) else imatrix
    has_im = im is not None and bool(im.entries)
    text = sample_text() if text is None else text
    text_sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    model = load_model(input, device=device)
    try:
        ids, add_bos, bos_id = tokenize_text(model.file, text)
        assert ids is not None
        need = ctx * chunks
        if len(ids) < need:
            raise UsageError(f"the calibration text has {len(ids)} tokens; the KLD sensitivity needs at least "
                             f"{need} ({chunks} chunks of {ctx}): give a longer --calibration-text")
        hp = model.hparams
        infos = {t.name: t for t in model.file.tensors}
        names = list(tensors) if tensors is not None else [
            t.name for t in model.file.tensors if len(t.shape) >= 2 and t.shape[-1] % 32 == 0
            and t.name in model.tensors]
        w_of = {n: (im.for_tensor(n, infos[n].shape) if has_im and im is not None else None) for n in names}
        probe: dict[str, GGMLQuantizationType] = {}
        for n in names:
            t = probe_type(n, infos[n].shape[-1], w_of[n] is not None, probes)
            if t is not None:
                probe[n] = t
        low = {n: probe_type(n, infos[n].shape[-1], w_of[n] is not None, LOW_PROBE_TYPES) or t
               for n, t in probe.items()}
        alt = {n: a for n in probe if (a := probe_type(n, infos[n].shape[-1], w_of[n] is not None,
                                                       ALT_PROBE_TYPES)) is not None and a != probe[n]}
        groups = tensor_groups(list(probe), hp.n_layer, bands)
        model_sha = file_sha256([f.path for f in model.file.files])
        im_sha = im.sha256 if has_im and im is not None else None
        ident = (f"{model_sha}|{im_sha or '-'}|{text_sha}|{ctx}|{chunks}|{bands}|"
                 f"{','.join(t.name for t in probes)}|v{SENSITIVITY_VERSION}")
        cdir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        cache = KLDCache(cdir, hashlib.sha256(ident.encode()).hexdigest()[:32])

        # the proxy at the probe types: the search's own measurement and cache
        pcache = MeasureCache(cdir, cache_key(model_sha, im_sha, sample_rows))
        wanted = {n: list(dict.fromkeys([probe[n], low[n], *([alt[n]] if n in alt else [])])) for n in probe}
        meas, _, _ = measure_all(model.file, wanted, im if has_im else None,
                                 {n: w_of[n] is not None for n in wanted}, pcache, sample_rows, threads)

        def proxy_of(n: str, at: Mapping[str, GGMLQuantizationType] = probe) -> float:
            m = meas[n][at[n]]
            return m.relative if proxy == "relative" else m.sse

        def rel(ns: Sequence[str], at: Mapping[str, GGMLQuantizationType]) -> float:
            return sum(meas[n][at[n]].relative for n in ns)

        def tiny(ns: Sequence[str]) -> bool:
            has_alt = all(n in alt for n in ns)
            return rel(ns, probe) < TINY_RELATIVE * len(ns) or (has_alt and rel(ns, probe) < ON_GRID_RATIO * rel(ns, alt))

        # groups on (or near) their probe's grid, probed again where every tensor has a second type whose
        # error is real
        tiny_groups = {g for g, (ns, _) in groups.items() if tiny(ns)}
        second = [g for g in groups if g in tiny_groups and all(n in alt for n in groups[g][0])
                  and rel(groups[g][0], alt) >= TINY_RELATIVE * len(groups[g][0])]
        passes = [*groups, *(f"{g}{_ALT}" for g in second), "*all*", _LOW]
        todo = [g for g in passes if g not in cache.data]
        n_measured, n_cached = len(todo), len(passes) - len(todo)
        if todo:
            cal = Calibration(model, ids, add_bos, bos_id, ctx, chunks)
            progress.begin(len(todo), "group", "KLD sensitivity")
            for g in todo:
                every = g.startswith("*")
                key = g.removesuffix(_ALT)
                members = [n for gg in groups.values() for n in gg[0]] if every else groups[key][0]
                first = min(gg[1] for gg in groups.values()) if every else groups[key][1]
                at = low if g == _LOW else alt if g.endswith(_ALT) else probe
                cache.data[g] = cal.kld({n: (at[n], w_of[n]) for n in members}, first, threads)
                cache.save()
                progress.advance(1)
            progress.end()
    finally:
        model.close()

    out_groups = []
    for g, (ns, first) in groups.items():
        has_alt = g in second
        out_groups.append(GroupSensitivity(
            g, tuple(ns), tuple(probe[n].name for n in ns), first, cache.data[g], sum(proxy_of(n) for n in ns),
            g in tiny_groups, tuple(alt[n].name for n in ns) if has_alt else (),
            cache.data[f"{g}{_ALT}"] if has_alt else None, sum(proxy_of(n, alt) for n in ns) if has_alt else None))
    total = sum(gs.kld for gs in out_groups)
    kld_all, kld_low = cache.data["*all*"], cache.data[_LOW]
    additivity = kld_all / total if total > 0 else 1.0
    factors = [gs.factor for gs in out_groups if gs.reliable and gs.factor > 0]
    fallback = float(np.median(factors)) if factors else 0.0
    notes = []
    sens: dict[str, float] = {}
    for gs in out_groups:
        ok = gs.reliable and gs.factor > 0
        f = gs.factor if ok else fallback
        if not ok:
            notes.append(f"{gs.group}: KLD {gs.kld:.3g}, proxy {gs.proxy:.3g}"
                         + (" (weights on the probe's grid, no second probe)" if gs.tiny else "")
                         + "; the median factor is used")
        elif gs.tiny:
            notes.append(f"{gs.group}: on the grid of {'/'.join(sorted(set(gs.probes)))} (KLD {gs.kld:.3g}, proxy "
                         f"{gs.proxy:.3g}); second probe {'/'.join(sorted(set(gs.probes_alt)))}: KLD "
                         f"{gs.kld_alt:.3g}, proxy {gs.proxy_alt:.3g}; factor {f:.3g}")
        for n in gs.tensors:
            sens[n] = f
    for n in names:
        sens.setdefault(n, fallback)
    # the linear estimates of the two calibration passes, with the factors the search uses
    linear_all = sum(sens[n] * proxy_of(n) for gs in out_groups for n in gs.tensors)
    linear_low = sum(sens[n] * proxy_of(n, low) for gs in out_groups for n in gs.tensors)
    curve = _fit_curve(linear_all, kld_all, linear_low, kld_low)
    return SensitivityResult(sens, out_groups, kld_all, additivity, kld_low, linear_low, curve, proxy, ctx, chunks,
                             need,
                             chunks * (ctx - 1 - ctx // 2), text_sha, n_measured, n_cached,
                             time.perf_counter() - t_start, str(cache.path), notes, linear_all)


def _fit_curve(s1: float, k1: float, s2: float, k2: float) -> tuple[float, float]:
    """``(c, gamma)`` of ``k = c * s^gamma`` through two points; ``gamma`` 1 when they are too close to tell,
    clamped to [1, 2] otherwise."""
    if s1 <= 0 or k1 <= 0:
        return 1.0, 1.0
    gamma = 1.0
    if s2 > 1.5 * s1 and k2 > 0:
        gamma = min(2.0, max(1.0, float(np.log(k2 / k1) / np.log(s2 / s1))))
    return k1 / s1 ** gamma, gamma


#: ``sensitivity`` choices of :func:`quantize_to_target_kld`: where the measured factors go.
SENSITIVITY_USES = ("off", "estimate", "search")


def quantize_to_target_kld(input: str | os.PathLike[str], output: str | os.PathLike[str] | None, *,
                           calibration_text: str | os.PathLike[str] | None = None, sensitivity: str = "search",
                           ctx: int = DEFAULT_CTX, chunks: int = DEFAULT_CHUNKS, bands: int = DEFAULT_BANDS,
                           imatrix: str | os.PathLike[str] | Imatrix | None = None, proxy: str = "relative",
                           cache_dir: str | os.PathLike[str] | None = None, sample_rows: int = DEFAULT_SAMPLE_ROWS,
                           threads: int | None = None, device: str = "auto", progress: Progress | None = None,
                           **kwargs: Any) -> tuple[Any, SensitivityResult | None]:
    """:func:`ggufkit.quant.target.search.quantize_to_target` with the KLD sensitivity measured first.

    Args:
        input, output: as ``quantize_to_target``.
        calibration_text: text file the sensitivity is measured on (default: the bundled sample).
        sensitivity: ``search`` (the default: the search weighs each tensor's error by its factor; on
            SmolLM2-135M this lowered llama-perplexity's mean KLD by 13 %, 1 % and 7 % at the Q2_K, Q3_K_M
            and Q4_K_M sizes, benchmarks/bench_quantize_target.py; then the final check,
            :mod:`ggufkit.eval.target_check`: the mix and the largest presets that fit are measured on the
            calibration text and a preset that measures lower is returned instead), ``estimate`` (the
            report's estimated KLD only; the search ranks by the proxy) or ``off`` (no measurement).
        ctx, chunks, bands: as :func:`measure_sensitivity`.
        imatrix, proxy, cache_dir, sample_rows, threads, progress: shared by the measurement and the search.
        device: the quantizer's (``auto``: CUDA when available); the evaluator runs where torch finds CUDA,
            else on the CPU.
        **kwargs: the other arguments of ``quantize_to_target`` (target, types, dry_run, mix_out...).

    Returns:
        ``(TargetReport, SensitivityResult or None)``.

    Raises:
        UsageError: unknown ``sensitivity``, a calibration text that is too short or not UTF-8, and every
            error of ``quantize_to_target``.
    """
    from ggufkit.errors import EvaluationError
    from ggufkit.eval.perplexity import read_text_file
    from ggufkit.quant.imatrix.reader import load_imatrix
    from ggufkit.quant.target.search import quantize_to_target

    if sensitivity not in SENSITIVITY_USES:
        raise UsageError(f"unknown sensitivity use {sensitivity!r}; choose {', '.join(SENSITIVITY_USES)}")
    im = load_imatrix(imatrix) if isinstance(imatrix, (str, os.PathLike)) else imatrix
    result = None
    text = None
    if sensitivity != "off":
        try:
            text = read_text_file(calibration_text) if calibration_text is not None else None
        except EvaluationError as exc:
            raise UsageError(f"--calibration-text: {exc}") from None
        result = measure_sensitivity(input, imatrix=im, text=text, ctx=ctx, chunks=chunks, bands=bands,
                                     proxy=proxy, cache_dir=cache_dir, sample_rows=sample_rows, threads=threads,
                                     device="cuda" if device == "cuda" else "auto" if device == "auto" else "cpu",
                                     progress=progress)
    check = None
    if result is not None and sensitivity == "search":
        from ggufkit.eval.perplexity import sample_text
        from ggufkit.eval.target_check import measured_check

        check = measured_check(input, imatrix=im, text=sample_text() if text is None else text, ctx=ctx,
                               chunks=chunks, cache_dir=cache_dir, threads=threads,
                               device="cuda" if device == "cuda" else "auto" if device == "auto" else "cpu",
                               progress=progress)
    report = quantize_to_target(input, output, imatrix=im, proxy=proxy, cache_dir=cache_dir, sample_rows=sample_rows,
                                threads=threads, device=device, progress=progress, final_check=check,
                                sensitivity=result.sensitivity if result is not None and sensitivity == "search"
                                else None, kld_sensitivity=result.sensitivity if result is not None else None,
                                **kwargs)
    if result is not None and report.estimated_kld is not None:
        # the report's sums are the linear estimates: calibrate them, each tensor keeping its share
        est = result.estimate(report.estimated_kld)
        scale = est / report.estimated_kld if report.estimated_kld > 0 else 0.0
        report = dataclasses.replace(
            report, estimated_kld=est, reference_estimated_kld=result.estimate(report.reference_estimated_kld or 0.0),
            choices=tuple(dataclasses.replace(c, kld=(c.kld or 0.0) * scale) for c in report.choices))
    return report, result
