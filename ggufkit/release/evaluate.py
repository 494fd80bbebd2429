"""The numbers of the card's table, from the scores of :mod:`ggufkit.eval.shared_baseline`."""

from __future__ import annotations

from typing import Any


def card_numbers(master: dict[str, Any], scores: dict[str, Any]) -> dict[str, Any]:
    """The numbers of one row of the card's table, from a type's scores."""
    kld = scores["kld"]
    return {"ppl": scores["ppl"], "ppl_error": scores["ppl_error"],
            # PPL(Q)/PPL(master) - 1 as `ggufkit ppl --baseline` reports it (its --max-delta-ppl gate)
            "delta_ppl": kld["ppl_ratio"] - 1.0,
            "mean_kld": kld["mean_kld"], "mean_kld_upper": kld.get("mean_kld_upper"),
            "p99_kld": kld["kld_percentiles"]["99.0"], "same_top_p": kld["same_top_p"]}
