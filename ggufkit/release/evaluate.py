"""The numbers of the card's table, from the scores of :mod:`ggufkit.eval.shared_baseline`."""

from __future__ import annotations

from typing import Any


def card_numbers(master: dict[str, Any], scores: dict[str, Any]) -> dict[str, Any]:
    """The numbers of one row of the card's table, from a type's scores.

    ``mean_kld`` is the file's one KLD, which the gate, the table, the card, ``--json`` and the manifest all
    show: exact when the master's stored top-K covered the vocabulary (``kld_exact``), else the upper bound of
    eval/kld_store.py (the stored lower bound can be far below the true value, so a gate on it would pass
    files it should fail). ``p99_kld`` is exact, or a lower bound, likewise.
    """
    kld = scores["kld"]
    upper = kld.get("mean_kld_upper")
    exact = bool(scores.get("kld_exact")) or upper is None
    return {"ppl": scores["ppl"], "ppl_error": scores["ppl_error"],
            # PPL(Q)/PPL(master) - 1 as `ggufkit ppl --baseline` reports it (its --max-delta-ppl gate)
            "delta_ppl": kld["ppl_ratio"] - 1.0,
            "mean_kld": kld["mean_kld"] if exact else upper, "kld_exact": exact,
            "p99_kld": kld["kld_percentiles"]["99.0"], "same_top_p": kld["same_top_p"]}
