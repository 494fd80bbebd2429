"""KL divergence of a model against a baseline, with llama-perplexity's statistics (tools/perplexity/perplexity.cpp: kl_divergence).

Both models score the same chunks side by side when they fit in memory together, so nothing is written to
disk (when they do not, eval/kld_store.py keeps a compact record per position of the baseline in a temporary
file; there only the KLD is approximate, reported as an interval, see that module). llama-perplexity instead
saves the baseline's log-probabilities to a file (~2 bytes x n_vocab per scored token, 11-37 GiB on
Wikitext-2) quantized to uint16. Working from the baseline's exact logits makes the statistics *exact*
where llama-perplexity's are approximate:

* the KL divergence ``sum_i p_base(i) * (log p_base(i) - log p_q(i))`` sums over the whole vocabulary in
  float64 (llama-perplexity skips tokens with base log-prob <= -16 and reads quantized log-probs, which is
  why it can print small negative KLDs and a floor of ~5e-4 when a model is compared with itself);
* ``nll`` and ``nll_base`` are float64 (float32 in llama-perplexity).

The formulas of every statistic (mean and uncertainty, covariance, percentiles with float32 interpolation,
median, RMS of Δp, "Same top p") are llama-perplexity's ``kl_divergence`` ones.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

#: Percentiles llama-perplexity prints, as (label, fraction); "max"/"min"/"median" are handled apart.
KLD_PERCENTILES = (("99.9", 0.999), ("99.0", 0.990), ("95.0", 0.950), ("90.0", 0.900), ("10.0", 0.100),
                   ("5.0", 0.050), ("1.0", 0.010), ("0.1", 0.001))
DELTA_P_PERCENTILES = (("99.9", 0.999), ("99.0", 0.990), ("95.0", 0.950), ("90.0", 0.900), ("75.0", 0.750),
                       ("25.0", 0.250), ("10.0", 0.100), ("5.0", 0.050), ("1.0", 0.010), ("0.1", 0.001))


def mean_and_uncertainty(s: float, s2: float, n: int) -> tuple[float, float]:
    """llama-perplexity's ``mean_and_uncertainty``: mean and standard error (0 when n <= 10 or var <= 0)."""
    if n == 0:
        return math.nan, math.nan
    f = s / n
    var = s2 / n - f * f
    return f, (math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0)


def covariance(sa: float, sb: float, sab: float, n: int) -> float:
    """llama-perplexity's ``covariance`` of the two means (0 when n < 10)."""
    if n < 10:
        return 0.0
    return (sab / n - (sa / n) * (sb / n)) / (n - 1)


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama-perplexity's percentile: linear interpolation at ``fraction * (n - 1)``, computed in float32."""
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    n = len(sorted_values)
    p = np.float32(fraction) * np.float32(n - 1)
    ip = int(p)
    p = np.float32(p - np.float32(ip))
    v = sorted_values.astype(np.float32)
    return float((np.float32(1) - p) * v[ip] + p * v[min(ip + 1, n - 1)])


def median(sorted_values: np.ndarray) -> float:
    n = len(sorted_values)
    if n % 2 == 0:
        return float(np.float32(0.5) * (np.float32(sorted_values[n // 2]) + np.float32(sorted_values[n // 2 - 1])))
    return float(sorted_values[n // 2])


class KLDAccumulator:
    """Running sums of llama-perplexity's ``kl_divergence_result`` plus every token's KLD and Δp."""

    def __init__(self) -> None:
        self.sum_nll = self.sum_nll2 = self.sum_nll_base = self.sum_nll_base2 = self.sum_nll_nll_base = 0.0
        self.sum_kld = self.sum_kld2 = 0.0
        self.sum_p_diff = self.sum_p_diff2 = self.sum_p_diff4 = 0.0
        self.n_same_top = 0
        self.count = 0
        #: Sum of the per-position KLD upper bounds; None when the KLD is exact (side by side).
        self.sum_kld_upper: float | None = None
        self._kld: list[np.ndarray] = []
        self._p_diff: list[np.ndarray] = []

    def add(self, logits: Any, base_logits: Any, targets: Any) -> None:
        """Accumulate one chunk's scored positions.

        Args:
            logits, base_logits: float32 ``[n, n_vocab]`` torch tensors of the model and the baseline.
            targets: int64 ``[n]`` the tokens that follow each position.
        """
        import torch

        logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
        logp_base = torch.log_softmax(base_logits.to(torch.float64), dim=-1)
        kld = (logp_base.exp() * (logp_base - logp)).sum(dim=-1)
        idx = targets.unsqueeze(-1)
        nll = -logp.gather(-1, idx).squeeze(-1)
        nll_base = -logp_base.gather(-1, idx).squeeze(-1)
        # argmax returns the first maximal index, as llama-perplexity's strict '>' scan does.
        same = int((logits.argmax(dim=-1) == base_logits.argmax(dim=-1)).sum())
        p_diff = torch.exp(-nll) - torch.exp(-nll_base)
        del logp, logp_base
        kld_np, nll_np, nll_base_np, p_diff_np = (t.cpu().numpy() for t in (kld, nll, nll_base, p_diff))
        self.add_values(kld_np, nll_np, nll_base_np, p_diff_np, same)

    def add_values(self, kld: np.ndarray, nll: np.ndarray, nll_base: np.ndarray, p_diff: np.ndarray,
                   n_same_top: int, kld_upper: np.ndarray | None = None) -> None:
        """Accumulate per-position values computed elsewhere (the stored-baseline path, eval/kld_store.py).

        Args:
            kld, nll, nll_base, p_diff: float64 ``[n]`` per-position KLD, NLLs of model and baseline, and Δp.
            n_same_top: positions whose top token agrees.
            kld_upper: per-position upper bounds when ``kld`` is only a lower bound (stored mode), else None.
        """
        for k, a, b, d in zip(kld.tolist(), nll.tolist(), nll_base.tolist(), p_diff.tolist()):
            self.sum_nll += a
            self.sum_nll2 += a * a
            self.sum_nll_base += b
            self.sum_nll_base2 += b * b
            self.sum_nll_nll_base += a * b
            self.sum_kld += k
            self.sum_kld2 += k * k
            self.sum_p_diff += d
            d2 = d * d
            self.sum_p_diff2 += d2
            self.sum_p_diff4 += d2 * d2
        if kld_upper is not None:
            self.sum_kld_upper = (self.sum_kld_upper or 0.0) + sum(kld_upper.tolist())
        self.n_same_top += int(n_same_top)
        self.count += len(kld)
        self._kld.append(kld.astype(np.float32))
        self._p_diff.append(p_diff.astype(np.float32))

    def running(self) -> dict[str, float]:
        """The per-chunk line of llama-perplexity: PPL(Q), ln ratio, KLD, RMS Δp, same top (with errors)."""
        n = self.count
        m, dm = mean_and_uncertainty(self.sum_nll, self.sum_nll2, n)
        mb, dmb = mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, n)
        cov = covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, n)
        kld, dkld = mean_and_uncertainty(self.sum_kld, self.sum_kld2, n)
        mse, dmse = mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, n)
        rms = math.sqrt(mse) if mse >= 0 else math.nan
        top = self.n_same_top / n if n else math.nan
        return {
            "ppl": math.exp(m), "ppl_error": math.exp(m) * dm,
            "ln_ppl_ratio": m - mb, "ln_ppl_ratio_error": _sqrt(dm * dm + dmb * dmb - 2 * cov),
            "mean_kld": kld, "mean_kld_error": dkld,
            "rms_delta_p": rms, "rms_delta_p_error": 0.5 / rms * dmse if rms > 0 else 0.0,
            "same_top_p": top, "same_top_p_error": _sqrt(top * (1 - top) / (n - 1)) if n > 1 else math.nan,
        }

    def summary(self) -> dict[str, Any]:
        """All of llama-perplexity's final KL-divergence statistics (Δp as fractions, not percent)."""
        n = self.count
        out: dict[str, Any] = {"tokens": n}
        m, dm = mean_and_uncertainty(self.sum_nll, self.sum_nll2, n)
        mb, dmb = mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, n)
        cov = covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, n)
        ppl, ppl_b = math.exp(m), math.exp(mb)
        out.update(ppl=ppl, ppl_error=ppl * dm, ppl_base=ppl_b, ppl_base_error=ppl_b * dmb,
                   ppl_correlation=cov / (dm * dmb) if dm > 0 and dmb > 0 else math.nan)
        ln_ratio, ln_err = m - mb, _sqrt(dm * dm + dmb * dmb - 2 * cov)
        ratio = math.exp(ln_ratio)
        out.update(ln_ppl_ratio=ln_ratio, ln_ppl_ratio_error=ln_err, ppl_ratio=ratio, ppl_ratio_error=ratio * ln_err,
                   ppl_diff=ppl - ppl_b,
                   ppl_diff_error=_sqrt((ppl * dm) ** 2 + (ppl_b * dmb) ** 2 - 2 * ppl * ppl_b * cov))
        kld_mean, kld_err = mean_and_uncertainty(self.sum_kld, self.sum_kld2, n)
        out.update(mean_kld=kld_mean, mean_kld_error=kld_err)
        if self.sum_kld_upper is not None and n:
            out["mean_kld_upper"] = self.sum_kld_upper / n
        kld = np.sort(np.concatenate(self._kld)) if self._kld else np.zeros(0, np.float32)
        pd = np.sort(np.concatenate(self._p_diff)) if self._p_diff else np.zeros(0, np.float32)
        if n:
            out["kld_percentiles"] = {"max": float(kld[-1]),
                                      **{k: percentile(kld, f) for k, f in KLD_PERCENTILES[:4]},
                                      "median": median(kld),
                                      **{k: percentile(kld, f) for k, f in KLD_PERCENTILES[4:]},
                                      "min": float(kld[0])}
            out["delta_p_percentiles"] = {"max": float(pd[-1]),
                                          **{k: percentile(pd, f) for k, f in DELTA_P_PERCENTILES[:5]},
                                          "median": median(pd),
                                          **{k: percentile(pd, f) for k, f in DELTA_P_PERCENTILES[5:]},
                                          "min": float(pd[0])}
        dp, ddp = mean_and_uncertainty(self.sum_p_diff, self.sum_p_diff2, n)
        out.update(mean_delta_p=dp, mean_delta_p_error=ddp)
        run = self.running()
        out.update({k: run[k] for k in ("rms_delta_p", "rms_delta_p_error", "same_top_p", "same_top_p_error")})
        return out


def _sqrt(v: float) -> float:
    return math.sqrt(v) if v >= 0 else math.nan
