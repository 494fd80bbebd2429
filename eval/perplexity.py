"""Perplexity by llama-perplexity's exact method (tools/perplexity/perplexity.cpp: perplexity).

The whole text is tokenized once (BOS prepended iff the vocabulary adds one, never EOS); it is cut into
``n_ctx``-token chunks, the tail shorter than a chunk is dropped, and at least ``2*n_ctx`` tokens are needed.
Each chunk runs from position 0 with an empty context; when the vocabulary adds BOS its first token is
*overwritten* by BOS. Only the second half is scored: logits at positions ``n_ctx/2 .. n_ctx-2`` predict the
tokens after them. Per token, ``nll = max + log(sum(exp(l - max))) - l[target]`` with float32 exponentials
summed in float64 (llama-perplexity's ``log_softmax``), and the NLL sums are float64. The result is
``exp(mean nll)`` with llama-perplexity's error ``PPL * sqrt(var(nll) / (N - 1))``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from ggufkit.errors import EvaluationError, TokenizerError, UsageError
from ggufkit.eval.kld_store import DEFAULT_TOP_K
from ggufkit.format.shards import open_gguf
from ggufkit.format.writer import NullProgress, Progress

#: llama-perplexity's default context (it sets ``params.n_ctx = 512`` before parsing arguments).
DEFAULT_CTX = 512
#: Tokens evaluated per forward pass by default, like llama-perplexity's ``n_batch`` of 2048.
DEFAULT_BATCH_TOKENS = 2048
#: The bundled sample text used when no text is given (eval/data/README).
SAMPLE_TEXT = "sample.txt"

#: Called after each chunk with (1-based chunk number, running statistics of all chunks so far).
ChunkCallback = Callable[[int, "RunningStats"], None]


@dataclass
class RunningStats:
    """Float64 accumulators of the per-token NLL, in scoring order (deterministic)."""

    nll_sum: float = 0.0
    nll2_sum: float = 0.0
    count: int = 0
    #: Filled by the KL-divergence run (:class:`ggufkit.eval.kld.KLDAccumulator`), None otherwise.
    kld: Any = None

    def add(self, nll: np.ndarray) -> None:
        for v in nll.tolist():  # sequential, so the sums do not depend on the batch size
            self.nll_sum += v
            self.nll2_sum += v * v
        self.count += len(nll)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / self.count) if self.count else math.nan

    @property
    def ppl_error(self) -> float:
        """llama-perplexity's estimate: PPL times the standard error of the mean NLL (NaN if undefined)."""
        n = self.count
        if n < 2:
            return math.nan
        mean = self.nll_sum / n
        var = self.nll2_sum / n - mean * mean
        if var <= 0:
            return math.nan
        return self.ppl * math.sqrt(var / (n - 1))


@dataclass
class PerplexityResult:
    """What :func:`perplexity` measured.

    Attributes:
        ppl, ppl_error: final perplexity and llama-perplexity's error estimate.
        chunks, ctx: chunks evaluated and their length; ``tokens_scored`` = chunks * (ctx - 1 - ctx // 2).
        n_tokens: tokens in the whole tokenized text; ``add_bos``/``bos_id``: the BOS rule applied.
        chunk_ppl: running PPL after each chunk (the ``[1]x,[2]y`` values).
        text_sha256: SHA-256 of the UTF-8 text scored (of the int32 token ids when tokens were given).
        model_sha256: SHA-256 of the model's tensor data, in file order.
        device, dtype: where and in what precision the matmuls ran.
        seconds, tokens_per_second: evaluation time and chunks*ctx / seconds; ``load_seconds``: model loading.
        kld: KL-divergence statistics against a baseline (``--baseline``), else None.
        warnings: what a user should know about this measurement (``ctx`` beyond the trained context).
    """

    ppl: float
    ppl_error: float
    chunks: int
    ctx: int
    tokens_scored: int
    n_tokens: int
    add_bos: bool
    bos_id: int | None
    batch: int
    chunk_ppl: list[float]
    text_sha256: str
    model_sha256: str
    model: str
    device: str
    dtype: str
    seconds: float
    tokens_per_second: float
    load_seconds: float
    baseline: str | None = None
    baseline_sha256: str | None = None
    kld: dict[str, Any] | None = field(default=None)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (snake_case keys; KLD statistics under ``kld``)."""
        return asdict(self)


def trained_context_warning(file: Any, ctx: int) -> str | None:
    """A warning when ``ctx`` exceeds the model's trained context (``<arch>.context_length``), the case
    llama.cpp warns about ("n_ctx_per_seq > n_ctx_train -- possible training context overflow",
    src/llama-context.cpp); None otherwise (or when the file does not say)."""
    arch = file.get("general.architecture")
    n_ctx_train = file.get(f"{arch}.context_length") if isinstance(arch, str) else None
    if not isinstance(n_ctx_train, int) or not 0 < n_ctx_train < ctx:
        return None
    return (f"--ctx {ctx} is larger than the model's trained context ({arch}.context_length = {n_ctx_train}): "
            f"positions beyond it were never trained, so this perplexity is not comparable with --ctx {n_ctx_train}")


def read_text_file(path: str | os.PathLike[str]) -> str:
    """Read a text file as llama-perplexity's ``-f`` does: raw UTF-8, exactly one trailing ``\\n`` removed.

    Raises:
        EvaluationError: the file is not valid UTF-8.
    """
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EvaluationError(f"not valid UTF-8 at byte {exc.start}", path=Path(path)) from None
    return text[:-1] if text.endswith("\n") else text


def sample_text() -> str:
    """The bundled English sample (Python's help topics, PSF licence; see eval/data/README)."""
    data = resources.files("ggufkit.eval").joinpath("data").joinpath(SAMPLE_TEXT).read_bytes().decode("utf-8")
    return data[:-1] if data.endswith("\n") else data


def read_tokens_file(path: str | os.PathLike[str]) -> list[int]:
    """Token ids from a file: a JSON array, or integers separated by whitespace or commas.

    Raises:
        EvaluationError: the file holds anything else.
    """
    text = Path(path).read_text(encoding="utf-8", errors="replace").strip()
    try:
        values = json.loads(text) if text.startswith("[") else [int(t) for t in text.replace(",", " ").split()]
    except ValueError as exc:
        raise EvaluationError(f"not a list of token ids ({exc})", path=Path(path)) from None
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise EvaluationError("not a list of integer token ids", path=Path(path))
    return values


def tokenize_text(file: Any, text: str | None) -> tuple[list[int] | None, bool, int | None]:
    """Tokenize ``text`` as llama-perplexity does (``add_special=True, parse_special=False``).

    Args:
        file: the model's GGUF (its ``tokenizer.ggml.*`` keys).
        text: the text, or None to read only the BOS rule.

    Returns:
        (tokens or None, add_bos, bos_id).

    Raises:
        TokenizerError: the vocabulary cannot be rebuilt, or it appends EOS (llama-perplexity refuses that).
    """
    from ggufkit.tokenizer.gguf_tokenizer import load_tokenizer

    tok = load_tokenizer(file)
    if tok.add_eos:
        raise TokenizerError("the vocabulary appends EOS to every text; llama-perplexity refuses such models")
    ids = list(tok.encode(text, add_special=True, parse_special=False)) if text is not None else None
    return ids, bool(tok.add_bos), tok.bos_id


def check_chunking(n_tokens: int, ctx: int, chunks: int | None) -> int:
    """Number of chunks llama-perplexity evaluates, or EvaluationError when there are too few tokens."""
    if ctx < 4:
        raise UsageError(f"--ctx {ctx} is too small (at least 4, so that a chunk has tokens to score)")
    if chunks is not None and chunks < 1:
        raise UsageError(f"--chunks {chunks} must be at least 1")
    if n_tokens < 2 * ctx:
        raise EvaluationError(f"you need at least {2 * ctx} tokens to evaluate perplexity with a context of "
                              f"{ctx}; the text has only {n_tokens} tokens (use a longer text or a smaller --ctx)")
    n = n_tokens // ctx
    return n if chunks is None else min(n, chunks)


def score_positions(logits: Any, targets: Any) -> np.ndarray:
    """Per-token NLL of ``targets`` under ``logits`` (float32 ``[n, V]``), llama-perplexity's way."""
    import torch

    mx = logits.max(dim=-1, keepdim=True).values
    sum_exp = torch.exp(logits - mx).sum(dim=-1, dtype=torch.float64)  # float32 exponentials, float64 sum
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    nll = mx.squeeze(-1).to(torch.float64) + torch.log(sum_exp) - picked.to(torch.float64)
    return nll.cpu().numpy()


def chunk_windows(stream: Any, batch: int, add_bos: bool, bos_id: int | None) -> Iterator[tuple[range, Any, Any]]:
    """llama-perplexity's batches of ``stream``'s chunks (``[n_chunk, ctx]``): (chunk numbers, the window with
    BOS written over each chunk's first token, the targets of the scored second half)."""
    n_chunk, ctx = stream.shape
    for a in range(0, n_chunk, batch):
        group = range(a, min(a + batch, n_chunk))
        window = stream[group.start:group.stop].clone()
        if add_bos and bos_id is not None:
            window[:, 0] = bos_id  # replaces the first token; never scored (targets start at first+1)
        yield group, window, stream[group.start:group.stop, ctx // 2 + 1:]


def fill_baseline_store(base: Any, windows: Iterable[tuple[range, Any, Any]], store: Any | None,
                        progress: Progress, stats: RunningStats | None = None) -> None:
    """Score the baseline on every window into ``store`` (when given) and its own NLLs into ``stats`` (when
    given)."""
    for group, window, targets in windows:
        logits = base.logits(window, start=window.shape[1] // 2)[:, :-1]
        targets = targets.to(base.device)
        for i in range(len(group)):
            if stats is not None:
                stats.add(score_positions(logits[i], targets[i]))
            if store is not None:
                store.append(logits[i], targets[i])
            progress.advance(1)
        del logits


def add_stored_kld(stats: RunningStats, logits: Any, store: Any, targets: Any) -> None:
    """One chunk's KLD statistics against the stored baseline's next record."""
    from ggufkit.eval.kld_store import stored_statistics

    assert stats.kld is not None
    v = stored_statistics(logits, store.read(len(targets)), targets)
    stats.kld.add_values(v["kld"], v["nll"], v["nll_base"], v["p_diff"], int(v["same_top"].sum()),
                         kld_upper=v["kld_upper"])


def perplexity(model_path: str | os.PathLike[str], *, text: str | None = None, tokens: Sequence[int] | None = None,
               ctx: int = DEFAULT_CTX, chunks: int | None = None, batch: int | None = None, device: str = "auto",
               dtype: str = "auto", baseline: str | os.PathLike[str] | None = None,
               progress: Progress | None = None, on_chunk: ChunkCallback | None = None, kld_mode: str = "auto",
               kld_top_k: int = DEFAULT_TOP_K, kld_tmp_dir: str | os.PathLike[str] | None = None,
               on_warning: Callable[[str], None] | None = None, ggml_rounding: bool = False,
               kv_cache: str = "f16") -> PerplexityResult:
    """Measure a GGUF model's perplexity as llama-perplexity does; with ``baseline``, also the KL divergence.

    Args:
        model_path: the GGUF (or PWRI) file, or a shard of a split set.
        text: the text to score; the bundled sample when neither ``text`` nor ``tokens`` is given.
        tokens: an already tokenized stream (BOS included if the vocabulary adds one) instead of ``text``.
        ctx: chunk length (llama-perplexity's ``-c``, default 512).
        chunks: evaluate at most this many chunks (``--chunks``).
        batch: chunks per forward pass (default: 2048 tokens' worth, as llama-perplexity's ``-b``).
        device: ``auto``, ``cpu`` or ``cuda``; dtype: ``auto``/``f32``, or ``f16``/``bf16`` on a GPU.
        baseline: a reference GGUF of the same vocabulary, scored on the same chunks (see ``kld_mode``).
        progress: receives one step per chunk (per model and chunk in ``stored`` mode).
        on_chunk: called after each chunk with its number and the running statistics.
        kld_mode: with a baseline, ``side-by-side`` (both models resident, every statistic exact),
            ``stored`` (the baseline scores first into a compact temporary file of its top ``kld_top_k``
            tokens per position and is freed before the model loads; every statistic is exact except the
            KLD, a lower bound reported with an upper bound, see :mod:`ggufkit.eval.kld_store`), or ``auto``
            (side by side when both models and their working memory fit in the free device memory).
        kld_top_k: K, the baseline tokens kept exactly per position in ``stored`` mode (8K+32 bytes each).
        kld_tmp_dir: directory of the ``stored`` mode's temporary file (default: the system's).
        on_warning: called with each warning as soon as it is known (they are also in ``result.warnings``).
        ggml_rounding: compute as llama.cpp's CPU backend rounds (:mod:`ggufkit.eval.ggml_cpu`): every matmul
            input rounded through the weight's ``vec_dot_type`` (8-bit blocks for quantized weights) and,
            with ``kv_cache="f16"``, K and V rounded to F16; off: float32 throughout, as transformers.
        kv_cache: with ``ggml_rounding``, the llama.cpp K/V cache followed: ``f16`` (its default, read by
            flash attention) or ``f32`` (``-fa off -ctk f32 -ctv f32``).

    Returns:
        The :class:`PerplexityResult`.

    Raises:
        EvaluationError: too few tokens, unsupported model, token ids outside the vocabulary.
        TokenizerError: the text cannot be tokenized with the model's vocabulary.
        UsageError: both ``text`` and ``tokens``, or nonsensical ``ctx``/``chunks``/``batch``/``kld_*``.
    """
    import torch

    from ggufkit.eval.kld import KLDAccumulator
    from ggufkit.eval.kld_store import BaselineStore
    from ggufkit.eval.model import load_model, read_hparams

    if text is not None and tokens is not None:
        raise UsageError("give either a text or tokens, not both")
    if batch is not None and batch < 1:
        raise UsageError(f"--batch {batch} must be at least 1")
    if kv_cache not in ("f16", "f32"):
        raise UsageError(f"unknown --kv-cache {kv_cache!r} (expected f16 or f32)")
    numerics = {"ggml_rounding": ggml_rounding, "kv_f16": ggml_rounding and kv_cache == "f16"}
    progress = progress or NullProgress()
    t_load = time.perf_counter()
    mode = _resolve_kld_mode(kld_mode, model_path, baseline, device, ctx, batch)
    model = base = store = None
    base_sha = None
    scoring = 0.0  # seconds spent in forward passes and statistics, both models
    try:
        if mode == "stored":
            assert baseline is not None
            # Tokenize from the model's file without loading its weights: only the baseline is resident now.
            with open_gguf(model_path) as f:
                ids, add_bos, bos_id, text_sha = _tokens(f, text, tokens)
                n_vocab = read_hparams(f).n_vocab
                ctx_warning = trained_context_warning(f, ctx)
            base = load_model(baseline, device=device, dtype=dtype, **numerics)
            _check_vocab(base.n_vocab, n_vocab)
        else:
            model = load_model(model_path, device=device, dtype=dtype, **numerics)
            if baseline is not None:
                base = load_model(baseline, device=device, dtype=dtype, **numerics)
                _check_vocab(base.n_vocab, model.n_vocab)
            ids, add_bos, bos_id, text_sha = _tokens(model.file, text, tokens)
            ctx_warning = trained_context_warning(model.file, ctx)
        warnings = [ctx_warning] if ctx_warning else []
        from ggufkit.eval.ggml_cpu import FA_TILE_TOKENS  # imports torch: not at module level

        if numerics["kv_f16"] and ctx < FA_TILE_TOKENS:
            warnings.append(f"--ctx {ctx} is under {FA_TILE_TOKENS}: llama.cpp's flash attention then also rounds Q "
                            "and its sums to F16, which --ggml-rounding does not reproduce")
        if on_warning is not None:
            for w in warnings:
                on_warning(w)
        n_chunk = check_chunking(len(ids), ctx, chunks)
        batch = batch or max(1, DEFAULT_BATCH_TOKENS // ctx)
        n_pass = -(-n_chunk // batch)  # forward passes over each model: the last one fills no float cache
        for m in (model, base):
            if m is not None:
                m.passes_left = n_pass
        load_seconds = time.perf_counter() - t_load

        first = ctx // 2
        stream = torch.tensor(ids[: n_chunk * ctx], dtype=torch.int64).reshape(n_chunk, ctx)

        def windows() -> Iterator[tuple[range, Any, Any]]:
            return chunk_windows(stream, batch, add_bos, bos_id)

        if mode == "stored":
            assert base is not None
            store = BaselineStore(base.n_vocab, kld_top_k, kld_tmp_dir)
            progress.begin(n_chunk, "chunk", "baseline")
            t0 = time.perf_counter()
            fill_baseline_store(base, windows(), store, progress)
            scoring += time.perf_counter() - t0
            progress.end()
            base_sha = base.model_sha256
            base.close()
            base = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # give the baseline's blocks back before the model loads
            t1 = time.perf_counter()
            model = load_model(model_path, device=device, dtype=dtype, **numerics)
            model.passes_left = n_pass
            load_seconds += time.perf_counter() - t1
            store.rewind()

        assert model is not None
        stats = RunningStats(kld=KLDAccumulator() if baseline is not None else None)
        chunk_ppl: list[float] = []
        progress.begin(n_chunk, "chunk", "perplexity")
        t0 = time.perf_counter()
        for group, window, targets in windows():
            targets = targets.to(model.device)
            logits = model.logits(window, start=first)[:, :-1]  # the last position predicts nothing
            base_logits = base.logits(window, start=first)[:, :-1] if base is not None else None
            for i in range(len(group)):
                nll = score_positions(logits[i], targets[i])
                stats.add(nll)
                if base_logits is not None:
                    stats.kld.add(logits[i], base_logits[i], targets[i])
                elif store is not None:
                    add_stored_kld(stats, logits[i], store, targets[i])
                chunk_ppl.append(stats.ppl)
                progress.advance(1)
                if on_chunk is not None:
                    on_chunk(group.start + i + 1, stats)
            del logits, base_logits
        scoring += time.perf_counter() - t0
        progress.end()
        kld = stats.kld.summary() if stats.kld is not None else None
        if kld is not None:
            kld["mode"] = mode
            if store is not None:
                kld["store"] = store.describe()
        return PerplexityResult(
            ppl=stats.ppl, ppl_error=stats.ppl_error, chunks=n_chunk, ctx=ctx, tokens_scored=stats.count,
            n_tokens=len(ids), add_bos=add_bos, bos_id=bos_id, batch=batch, chunk_ppl=chunk_ppl,
            text_sha256=text_sha, model_sha256=model.model_sha256, model=str(model_path),
            device=str(model.device), dtype=model.dtype_name, seconds=scoring,
            tokens_per_second=n_chunk * ctx / scoring if scoring > 0 else math.inf,
            load_seconds=load_seconds, baseline=str(baseline) if baseline is not None else None,
            baseline_sha256=base.model_sha256 if base is not None else base_sha, kld=kld, warnings=warnings)
    finally:
        if model is not None:
            model.close()
        if base is not None:
            base.close()
        if store is not None:
            store.close()


def _tokens(file: Any, text: str | None, tokens: Sequence[int] | None) -> tuple[list[int], bool, int | None, str]:
    """The token stream to score, the BOS rule and the SHA-256 of the text (or of the int32 ids given)."""
    if tokens is None:
        text = sample_text() if text is None else text
    encoded, add_bos, bos_id = tokenize_text(file, text if tokens is None else None)
    if encoded is None:
        assert tokens is not None
        ids = [int(t) for t in tokens]
        return ids, add_bos, bos_id, hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()
    assert text is not None
    return encoded, add_bos, bos_id, hashlib.sha256(text.encode("utf-8")).hexdigest()


def _check_vocab(n_base: int, n_model: int) -> None:
    if n_base != n_model:
        raise EvaluationError(f"the baseline has {n_base} tokens in its vocabulary, the model {n_model}; "
                              f"KL divergence needs the same vocabulary")


def _resolve_kld_mode(kld_mode: str, model_path: str | os.PathLike[str],
                      baseline: str | os.PathLike[str] | None, device: str, ctx: int, batch: int | None
                      ) -> str | None:
    """None without a baseline; else ``side-by-side`` or ``stored`` (``auto`` weighs sizes vs free memory)."""
    from ggufkit.eval.kld_store import choose_kld_mode, free_memory
    from ggufkit.eval.model import read_hparams, resolve_device

    if baseline is None:
        if kld_mode not in ("auto", "side-by-side", "stored"):
            raise UsageError(f"unknown --kld-mode {kld_mode!r} (expected auto, side-by-side or stored)")
        return None
    if kld_mode != "auto":
        return choose_kld_mode(kld_mode, 0, 0, 0, 0)
    with open_gguf(model_path) as fm, open_gguf(baseline) as fb:
        model_bytes = sum(t.nbytes for t in fm.tensors)
        base_bytes = sum(t.nbytes for t in fb.tensors)
        n_vocab = read_hparams(fm).n_vocab
    rows = (batch or max(1, DEFAULT_BATCH_TOKENS // ctx)) * ctx
    # Per model: its float32 logits for a batch of chunks, plus the float64 log-softmax of one chunk's half.
    work = 2 * (rows * n_vocab * 4 + ctx * n_vocab * 8 * 2)
    return choose_kld_mode("auto", model_bytes, base_bytes, work, free_memory(resolve_device(device)))


def check_gates(result: PerplexityResult, *, max_ppl: float | None = None, max_delta_ppl: float | None = None,
                max_kld: float | None = None) -> list[str]:
    """The CI quality gates: one reason per exceeded threshold (an empty list means all passed).

    Args:
        result: a :func:`perplexity` result.
        max_ppl: highest acceptable PPL.
        max_delta_ppl: highest acceptable ``PPL / PPL(baseline) - 1`` (needs a baseline run).
        max_kld: highest acceptable mean KL divergence (needs a baseline run).

    Returns:
        Reasons such as ``"PPL 12.3456 > --max-ppl 12"``.

    Raises:
        UsageError: a baseline gate without a baseline result.
    """
    failures = []
    if max_ppl is not None and not result.ppl <= max_ppl:
        failures.append(f"PPL {result.ppl:.4f} > --max-ppl {max_ppl:g}")
    if (max_delta_ppl is not None or max_kld is not None) and result.kld is None:
        raise UsageError("--max-delta-ppl and --max-kld need a baseline")
    if max_delta_ppl is not None and result.kld is not None:
        delta = result.kld["ppl_ratio"] - 1.0
        if not delta <= max_delta_ppl:
            failures.append(f"PPL/PPL(base) - 1 = {delta:.6f} > --max-delta-ppl {max_delta_ppl:g}")
    if max_kld is not None and result.kld is not None:
        # A stored baseline only bounds the KLD; gate on the upper bound so that a pass is a guarantee.
        upper = result.kld.get("mean_kld_upper")
        kld = result.kld["mean_kld"] if upper is None else upper
        what = "mean KLD" if upper is None else "mean KLD upper bound (stored baseline)"
        if not kld <= max_kld:
            failures.append(f"{what} {kld:.6f} > --max-kld {max_kld:g}")
    return failures
