"""KL divergence against a baseline that does not fit in memory beside the model: a compact stored baseline.

When the model and the baseline cannot be resident together (``kld_mode="stored"``, or ``"auto"`` when
their weights plus working memory exceed the free device memory), the baseline scores every chunk first and
keeps, per scored position, one fixed-size record in an anonymous temporary file; then it is freed, the model
is loaded, and the statistics stream from that file. llama-perplexity's ``--kl-divergence-base`` file keeps
all ``n_vocab`` log-probs as uint16 (~2 bytes x n_vocab per position: 11-37 GiB on Wikitext-2); a record here
is ``8*K + 32`` bytes (288 bytes for the default K = 32, ~41 MB for Wikitext-2 at ctx 512):

==================  ===========  ==============================================================
field               type         use
==================  ===========  ==============================================================
``ids``             int32[K]     the baseline's K most likely tokens (``torch.topk``)
``logits``          float32[K]   their raw logits (the baseline computes in float32, so no loss)
``lse``             float64      ``logsumexp`` of the whole row, in float64
``target_logit``    float32      the logit of the token that follows
``log_tail``        float64      ``log P_T``, the probability mass outside the top K (-inf if none)
``tail_plogp``      float64      ``H_T = sum_T p_i log p_i`` over the tail (0 if none)
``argmax``          int32        first index of the maximal logit
==================  ===========  ==============================================================

What is exact (equal to the side-by-side run up to float64 rounding, because every base log-prob used is
``float64(logit) - lse`` as in the side-by-side ``log_softmax``): PPL(base) and its error, the NLL
correlation, the ln/ratio/difference of the PPLs, Δp of the target token (all its statistics), RMS Δp and
"Same top p"; PPL(Q) never depends on the baseline.

What is approximate: only the per-position KL divergence, which is reported as a guaranteed interval. Split
the vocabulary into the stored top-K set S and the tail T (base mass ``P_T``; the model's whole distribution q
is known when comparing, so ``Q_T = sum_T q_i`` too). ``KLD = sum_S p_i log(p_i/q_i) + H_T - sum_T p_i log q_i``:
everything is exact except the cross term ``C = sum_T p_i log q_i``, whose base weights are not stored. Each
tail ``p_i`` lies in ``[0, p_K]`` (p_K: the K-th largest) and they sum to ``P_T``; C is linear in them, so its
extremes put ``p_K`` on the model's ``floor(P_T/p_K)`` least (most) likely tail tokens and the remainder on the
next one. That gives an upper bound (``mean_kld_upper``) and a lower bound; the lower bound is also raised to
the bucketed-tail value ``P_T log(P_T/Q_T)`` (log-sum inequality). ``mean_kld`` and the KLD percentiles are
the lower bound: the true KLD is never below it, and it is exact when the tail has at most one token
(K >= n_vocab - 1) and tight when the tail is flat. The error of ``mean_kld`` is at most
``mean_kld_upper - mean_kld``, both printed.

The file is ``tempfile.TemporaryFile``: on Linux it has no name at all (``O_TMPFILE``), so the operating
system removes it when it is closed, on error, or when the process dies.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np

from ggufkit.errors import EvaluationError, UsageError
from ggufkit.sysmem import available_memory_bytes

#: Stored top-K size by default: 1056 bytes per scored position (~160 MB for wikitext-2 at ctx 512).
DEFAULT_TOP_K = 128
#: Elements of one float64 temporary in :func:`stored_statistics` (rows are processed in blocks).
_BLOCK_ELEMENTS = 1 << 23
#: Values of ``kld_mode`` (``--kld-mode``).
KLD_MODES = ("auto", "side-by-side", "stored")


def record_dtype(k: int) -> np.dtype:
    """The numpy structured dtype of one stored position for a top-``k`` store (``8*k + 32`` bytes)."""
    return np.dtype([("ids", "<i4", (k,)), ("logits", "<f4", (k,)), ("lse", "<f8"), ("target_logit", "<f4"),
                     ("log_tail", "<f8"), ("tail_plogp", "<f8"), ("argmax", "<i4")])


def llama_perplexity_row_bytes(n_vocab: int) -> int:
    """Bytes llama-perplexity's ``--kl-divergence-base`` file spends per scored position (tools/perplexity/perplexity.cpp: kl_divergence)."""
    return 2 * (2 * ((n_vocab + 1) // 2) + 4)


def choose_kld_mode(requested: str, model_bytes: int, base_bytes: int, work_bytes: int, free_bytes: int) -> str:
    """Resolve ``auto``: side by side when both models plus working memory fit in the free memory.

    Args:
        requested: ``auto``, ``side-by-side`` or ``stored``.
        model_bytes, base_bytes: tensor data of the two GGUF files (weights stay in their GGUF types).
        work_bytes: activations and logits of one forward pass of each model (an estimate).
        free_bytes: free device memory (CUDA: ``mem_get_info``; CPU: the available RAM, ggufkit.sysmem).

    Returns:
        ``side-by-side`` or ``stored``.

    Raises:
        UsageError: an unknown mode.
    """
    if requested not in KLD_MODES:
        raise UsageError(f"unknown --kld-mode {requested!r} (expected {', '.join(KLD_MODES)})")
    if requested != "auto":
        return requested
    # A tenth of the larger model covers one dequantized layer and allocator slack.
    need = model_bytes + base_bytes + max(model_bytes, base_bytes) // 10 + work_bytes
    return "side-by-side" if need <= free_bytes else "stored"


def free_memory(device: Any) -> int:
    """Free bytes where the weights will live: the GPU's free memory, or the available RAM on CPU."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    return available_memory_bytes()


class BaselineStore:
    """Append-then-read file of baseline records, one per scored position, in scoring order.

    Args:
        n_vocab: vocabulary size (K is clamped to it).
        top_k: K, the number of most likely tokens kept exactly.
        tmp_dir: directory of the temporary file (default: the system's temporary directory).

    Raises:
        UsageError: ``top_k < 1``.
    """

    def __init__(self, n_vocab: int, top_k: int = DEFAULT_TOP_K, tmp_dir: str | os.PathLike[str] | None = None
                 ) -> None:
        if top_k < 1:
            raise UsageError(f"--kld-top-k {top_k} must be at least 1")
        self.n_vocab = n_vocab
        self.top_k = min(top_k, n_vocab)
        self.dtype = record_dtype(self.top_k)
        self.positions = 0
        # Not a context manager: the store outlives this call; close()/__exit__ close it.
        self._file = tempfile.TemporaryFile(prefix="ggufkit-kld-", dir=tmp_dir)  # noqa: SIM115

    @property
    def bytes_per_position(self) -> int:
        return self.dtype.itemsize

    def append(self, base_logits: Any, targets: Any) -> None:
        """Store the records of ``n`` positions.

        Args:
            base_logits: the baseline's float32 ``[n, n_vocab]`` torch logits.
            targets: int64 ``[n]`` tokens that follow each position.
        """
        import torch

        row = base_logits.to(torch.float64)
        lse = torch.logsumexp(row, dim=-1)
        top = torch.topk(base_logits, self.top_k, dim=-1)
        rec = np.zeros(len(targets), dtype=self.dtype)
        if self.top_k < self.n_vocab:
            tail = row.scatter(-1, top.indices, -torch.inf)
            rec["log_tail"] = (torch.logsumexp(tail, dim=-1) - lse).cpu().numpy()
            logp = row - lse[:, None]
            plogp = torch.where(torch.isfinite(logp), logp.exp() * logp, 0.0)  # p log p -> 0 as p -> 0
            plogp = plogp.scatter(-1, top.indices, 0.0)
            rec["tail_plogp"] = plogp.sum(dim=-1).cpu().numpy()
        else:
            rec["log_tail"] = -np.inf
        rec["ids"] = top.indices.cpu().numpy()
        rec["logits"] = top.values.cpu().numpy()
        rec["lse"] = lse.cpu().numpy()
        rec["target_logit"] = base_logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1).cpu().numpy()
        rec["argmax"] = base_logits.argmax(dim=-1).cpu().numpy()
        self._file.write(rec.tobytes())
        self.positions += len(rec)

    def rewind(self) -> None:
        """Start reading from the first record."""
        self._file.flush()
        self._file.seek(0)

    def read(self, n: int) -> np.ndarray:
        """The next ``n`` records.

        Raises:
            EvaluationError: the file holds fewer (it was truncated under us).
        """
        data = self._file.read(n * self.dtype.itemsize)
        if len(data) != n * self.dtype.itemsize:
            raise EvaluationError("the temporary baseline store is shorter than expected")
        return np.frombuffer(data, dtype=self.dtype)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> BaselineStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> dict[str, int]:
        """Sizes for the report: K, bytes per position, positions, total, and llama-perplexity's total."""
        return {"top_k": self.top_k, "bytes_per_position": self.bytes_per_position, "positions": self.positions,
                "bytes": self.bytes_per_position * self.positions,
                "llama_perplexity_bytes": llama_perplexity_row_bytes(self.n_vocab) * self.positions}


def stored_statistics(logits: Any, records: np.ndarray, targets: Any) -> dict[str, np.ndarray]:
    """Per-position statistics of the model against stored baseline records.

    Args:
        logits: the model's float32 ``[n, n_vocab]`` torch logits.
        records: ``n`` records of :class:`BaselineStore`.
        targets: int64 ``[n]`` tokens that follow each position.

    Returns:
        float64 arrays ``kld`` (bucketed-tail lower bound), ``kld_upper``, ``nll``, ``nll_base``, ``p_diff``
        and bool ``same_top``.
    """
    # A few float64 [rows, n_vocab] temporaries live at once: bound them (~64 MiB each) so that the
    # comparison fits beside a model that fills the GPU, whatever the vocabulary.
    rows = max(1, _BLOCK_ELEMENTS // logits.shape[1])
    parts = [_stored_block(logits[a:a + rows], records[a:a + rows], targets[a:a + rows])
             for a in range(0, len(records), rows)]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def _stored_block(logits: Any, records: np.ndarray, targets: Any) -> dict[str, np.ndarray]:
    import torch

    dev = logits.device
    n_vocab = logits.shape[1]
    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    ids = torch.from_numpy(records["ids"].astype(np.int64)).to(dev)
    k = ids.shape[1]
    lse = torch.from_numpy(records["lse"].copy()).to(dev)
    logp_b = torch.from_numpy(records["logits"].astype(np.float64)).to(dev) - lse[:, None]
    head = (logp_b.exp() * (logp_b - logp.gather(-1, ids))).sum(dim=-1)
    lower, upper = head.clone(), head.clone()
    if k < n_vocab:
        log_pt = torch.from_numpy(records["log_tail"].copy()).to(dev)
        tail_logq = logp.scatter(-1, ids, torch.inf)  # the top-K slots sort last and are cut off below
        log_qt = torch.logsumexp(tail_logq.scatter(-1, ids, -torch.inf), dim=-1)
        pt = log_pt.exp()
        # sum_T p_i log p_i is stored; sum_T p_i log q_i is a linear function of the unknown tail p over
        # {0 <= p_i <= p_K, sum_T p_i = P_T}, so its extremes put p_K on the model's m most (least) likely
        # tail tokens and the remainder r on the next one.
        n_tail = n_vocab - k
        asc = torch.sort(tail_logq, dim=-1).values[:, :n_tail]
        pk = logp_b.min(dim=-1).values.exp()
        m = torch.clamp(torch.floor(pt / pk), 0, n_tail).to(torch.int64)
        r = torch.where(m < n_tail, torch.clamp(pt - m * pk, min=0.0), 0.0)
        h_t = torch.from_numpy(records["tail_plogp"].copy()).to(dev)
        cross_min, cross_max = (_greedy_fill(q, m, pk, r) for q in (asc, asc.flip(-1)))
        lower = head + torch.maximum(torch.where(pt > 0, pt * (log_pt - log_qt), 0.0), h_t - cross_max)
        upper = head + h_t - cross_min
    t = targets.unsqueeze(-1)
    nll = -logp.gather(-1, t).squeeze(-1)
    nll_base = lse - torch.from_numpy(records["target_logit"].astype(np.float64)).to(dev)
    same = logits.argmax(dim=-1) == torch.from_numpy(records["argmax"].astype(np.int64)).to(dev)
    out = {"kld": lower, "kld_upper": upper, "nll": nll, "nll_base": nll_base,
           "p_diff": torch.exp(-nll) - torch.exp(-nll_base), "same_top": same}
    return {name: v.cpu().numpy() for name, v in out.items()}


def _greedy_fill(logq: Any, m: Any, pk: Any, r: Any) -> Any:
    """``sum_j p_j logq_j`` with ``p = (p_K)*m, r, 0...`` over each row of ``logq`` in its given order."""
    import torch

    n, n_tail = logq.shape
    cum = torch.cat([torch.zeros(n, 1, dtype=logq.dtype, device=logq.device), logq.cumsum(dim=-1)], dim=-1)
    nxt = logq.gather(-1, torch.clamp(m, max=n_tail - 1)[:, None]).squeeze(-1)
    return pk * cum.gather(-1, m[:, None]).squeeze(-1) + torch.where(r > 0, r * nxt, 0.0)
