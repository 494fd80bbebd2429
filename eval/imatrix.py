"""Importance matrices collected by ggufkit's evaluator, as llama-imatrix collects them (tools/imatrix/imatrix.cpp).

For every weight matrix that multiplies an activation (``blk.*`` tensors; ``output.weight`` only with
``process_output``; a tied head is ``token_embd.weight`` there, which llama-imatrix never collects) the
float32 input activation of each token is squared and summed per column, and the tokens are counted. Per
expert weights of a MoE model (``ffn_*_exps``) are summed per expert over the tokens routed to it, each
(token, slot) pair counted once (``GGML_OP_MUL_MAT_ID`` in ``collect_imatrix``).

The text is tokenized and cut as llama-perplexity cuts it (``compute_imatrix``: whole-file tokenization with
BOS, ``--from-chunk`` drops leading chunks, at least ``2*ctx`` tokens, BOS overwrites each chunk's first
token), every position of every chunk is collected, and the running perplexity of the second halves is
reported per chunk unless ``compute_ppl`` is off.

Each chunk's sums are formed on their own and added to the float32 accumulators chunk by chunk, and chunks are
batched at fixed chunk numbers (multiples of the batch), so a run resumed from a GGUF snapshot
(``in_files=[snapshot], from_chunk=k``) gives the same bytes as one uninterrupted run.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ggufkit.errors import EvaluationError, QuantizationError, UsageError
from ggufkit.format.writer import NullProgress, Progress
from ggufkit.quant.imatrix.collector import ImatrixAccumulator

#: llama-imatrix skips matrix multiplications of fewer than 16 tokens ("why are small batches ignored").
MIN_CTX = 16
OUTPUT_FORMATS = ("gguf", "dat")

#: Called after each chunk with (1-based chunk number of this run, running perplexity or None).
ImatrixChunkCallback = Callable[[int, "float | None"], None]


@dataclass
class ImatrixResult:
    """What :func:`collect_imatrix` (or :func:`combine_imatrix`) did.

    Attributes:
        output: the file written (None when nothing was asked to be written).
        output_format: ``gguf`` or ``dat``; entries: number of weight names held.
        chunks: chunks evaluated by this run; chunk_count: chunks the matrix now covers (with ``in_files``).
        chunk_size: tokens per chunk; from_chunk: chunks skipped at the start of the text.
        ppl, ppl_error, chunk_ppl: perplexity of the evaluated chunks (None with ``compute_ppl=False``).
        snapshots: ``--save-frequency`` files written; datasets: dataset names recorded.
        seconds, tokens_per_second: evaluation time and chunks*ctx / seconds; load_seconds: model loading.
    """

    output: str | None
    output_format: str
    entries: int
    chunks: int
    chunk_count: int
    chunk_size: int
    from_chunk: int = 0
    n_tokens: int = 0
    ppl: float | None = None
    ppl_error: float | None = None
    chunk_ppl: list[float] = field(default_factory=list)
    snapshots: list[str] = field(default_factory=list)
    datasets: list[str] = field(default_factory=list)
    model: str | None = None
    model_sha256: str | None = None
    device: str | None = None
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    load_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ImatrixCollector:
    """The model's observer (``GGUFCausalLM.observer``): per-chunk sums added to float32 accumulators.

    Implements :class:`ggufkit.eval.model.ActivationObserver`: :meth:`dense` takes the input of dense matmuls,
    :meth:`routed` a MoE expert matmul's input and routing.

    Args:
        shapes: numpy-order shape of every tensor of the model (3-D: ``[n_expert, rows, n_per_row]``).
        device: where the activations arrive (the sums stay there).
        acc: the accumulator to fill (it may hold loaded files; they must match ``shapes``).
        process_output: also collect ``output.weight``.

    Raises:
        QuantizationError: an entry of ``acc`` is no weight collected here or has another size.
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: Any, acc: ImatrixAccumulator,
                 process_output: bool) -> None:
        import torch

        self.torch = torch
        self.acc = acc
        self.process_output = process_output
        self.sums: dict[str, Any] = {}  # name -> float32 [n_mat, n] on the device
        self.tokens: dict[str, int] = {}  # name -> tokens added by this run (dense)
        self.shapes = shapes
        self.device = device
        # Matrices, and the one vector llama.cpp multiplies with ggml_mul_mat (qwen2moe's shared-expert gate).
        self.wanted = {n for n, s in self.shapes.items()
                       if (len(s) >= 2 or n.endswith("ffn_gate_inp_shexp.weight")) and self._collects(n)}
        for name in list(acc.sums):  # loaded files: every entry must be a weight of this model, of its size
            if name not in self.wanted:
                raise QuantizationError(f"imatrix entry {name!r} matches no weight this model collects")
            self._entry(name)

    def _entry(self, name: str) -> Any:
        """The device sums of ``name``, created on first use (from the accumulator, which checks the size)."""
        s = self.sums.get(name)
        if s is None:
            shape = self.shapes[name]
            sums, _ = self.acc.entry(name, shape[-3] if len(shape) == 3 else 1, shape[-1])
            s = self.sums[name] = self.torch.from_numpy(sums.copy()).to(self.device)
            self.tokens[name] = 0
        return s

    def _collects(self, name: str) -> bool:
        return name.startswith("blk.") or (self.process_output and name == "output.weight")

    def dense(self, names: tuple[str, ...], x: Any) -> None:
        """Dense matmuls: ``x`` float32 ``[B, T, n]`` (B chunks of T tokens) times each weight in ``names``; or
        ``[B, T, n_mat, n]`` times a 3-D weight, one matrix each (MLA's attn_k_b / attn_v_b)."""
        names = tuple(n for n in names if n in self.wanted)
        if not names:
            return
        torch = self.torch
        if x.dim() == 4:
            self._per_matrix(names, x)
            return
        # [B, T, n]: one sum of squares per chunk (torch's float32 reduction, blocked, so no less accurate than
        # llama-imatrix's sequential float32 sum), added to the float32 sums in chunk order.
        sq = x.to(torch.float32).square().sum(dim=1)
        for name in names:
            acc = self._entry(name)
            if acc.shape[-1] != sq.shape[-1]:
                raise EvaluationError(f"{name}: activation width {sq.shape[-1]} != {acc.shape[-1]} columns")
            for b in range(sq.shape[0]):
                acc[0] += sq[b]
            self.tokens[name] += x.shape[0] * x.shape[1]

    def _per_matrix(self, names: tuple[str, ...], x: Any) -> None:
        """ggml_mul_mat with a 3-D weight (collect_imatrix's dense branch): matrix ``i`` adds its input's squares
        to its own row of sums; the tensor keeps one count, the tokens."""
        sq = x.to(self.torch.float32).square().sum(dim=1)  # [B, n_mat, n]
        for name in names:
            acc = self._entry(name)
            if tuple(acc.shape) != tuple(sq.shape[1:]):
                raise EvaluationError(f"{name}: activations {tuple(sq.shape[1:])} != {tuple(acc.shape)} sums")
            if self.acc.counts[name].size > 1 and not self.acc.counts[name].any():
                self.acc.counts[name] = np.zeros(1, np.int64)
            for b in range(sq.shape[0]):
                acc += sq[b]
            self.tokens[name] += x.shape[0] * x.shape[1]

    def routed(self, name: str, x: Any, ids: Any) -> None:
        """A MoE expert matmul: ``x`` float32 ``[B, T, k or 1, n]``, ``ids`` int ``[B, T, k]`` chosen experts.

        Each (token, slot) adds its input squared to its expert's sums and 1 to its expert's count.
        """
        if name not in self.wanted:
            return
        torch = self.torch
        acc = self._entry(name)
        n_exp = acc.shape[0]
        counts = self.acc.counts[name]
        for b in range(x.shape[0]):
            xb = x[b].to(torch.float64).square()  # [T, k|1, n]
            idx = ids[b].to(torch.int64)  # [T, k]
            xb = xb.expand(idx.shape[0], idx.shape[1], xb.shape[-1]).reshape(-1, xb.shape[-1])
            flat = idx.reshape(-1)
            s = torch.zeros((n_exp, xb.shape[-1]), dtype=torch.float64, device=xb.device).index_add_(0, flat, xb)
            acc += s.to(torch.float32)
            counts += torch.bincount(flat, minlength=n_exp).cpu().numpy().astype(np.int64)

    def check_finite(self) -> None:
        for name, s in self.sums.items():
            if not bool(self.torch.isfinite(s).all()):
                raise EvaluationError(f"non-finite activations in {name}")

    def store(self) -> None:
        """Copy the device sums and the counts into the accumulator (before every write)."""
        for name, s in self.sums.items():
            self.acc.sums[name] = s.cpu().numpy().copy()
            if self.tokens[name]:
                self.acc.counts[name] = self.acc.counts[name] + self.tokens[name]
                self.tokens[name] = 0


def combine_imatrix(in_files: Sequence[str | os.PathLike[str]], output: str | os.PathLike[str], *,
                    output_format: str = "gguf", ctx: int = 512) -> ImatrixResult:
    """Combine (or convert) imatrix files without a model, as ``llama-imatrix --in-file ... -o OUT``.

    Args:
        in_files: GGUF or legacy ``.dat`` imatrix files, added in order.
        output: the file to write (atomically).
        output_format: ``gguf`` or ``dat``.
        ctx: chunk size used to convert legacy entries (llama-imatrix's ``--ctx``, default 512).

    Raises:
        QuantizationError: an input is malformed or the entries do not match.
        UsageError: no input, unknown format.
    """
    if not in_files:
        raise UsageError("nothing to do: give a model and a text, or --in-file files to combine")
    _check_format(output_format)
    acc = ImatrixAccumulator(ctx)
    for f in in_files:
        acc.load(f)
    path = acc.write(output, output_format)
    return ImatrixResult(output=str(path), output_format=output_format, entries=len(acc.sums), chunks=0,
                         chunk_count=acc.chunk_count, chunk_size=ctx, datasets=list(acc.datasets))


def _check_format(fmt: str) -> None:
    if fmt not in OUTPUT_FORMATS:
        raise UsageError(f"unknown output format {fmt!r} (expected gguf or dat)")


def snapshot_path(output: str | os.PathLike[str], chunk: int) -> Path:
    """llama-imatrix's snapshot name: ``<output>.at_<chunk>``."""
    return Path(f"{os.fspath(output)}.at_{chunk}")


def collect_imatrix(model_path: str | os.PathLike[str], *, text: str | None = None,
                    tokens: Sequence[int] | None = None, output: str | os.PathLike[str] | None = "imatrix.gguf",
                    output_format: str = "gguf", dataset: str | None = None, ctx: int = 512,
                    chunks: int | None = None, from_chunk: int = 0, process_output: bool = False,
                    parse_special: bool = False, compute_ppl: bool = True,
                    in_files: Sequence[str | os.PathLike[str]] = (), save_frequency: int = 0,
                    output_frequency: int = 10, batch: int | None = None, device: str = "auto",
                    ggml_rounding: bool = False, kv_cache: str = "f16", progress: Progress | None = None,
                    on_chunk: ImatrixChunkCallback | None = None) -> ImatrixResult:
    """Collect a GGUF model's importance matrix on a text, as llama-imatrix does, and write it.

    Args:
        model_path: the GGUF model (any type the evaluator runs; weights stay in their type).
        text: calibration text; or ``tokens``: an already tokenized stream (BOS included when added).
        output: the imatrix file to write (atomically), or None to write nothing (the result still counts).
        output_format: ``gguf`` (llama-imatrix's default) or ``dat`` (legacy).
        dataset: the dataset name recorded in the file (llama-imatrix records the ``-f`` path).
        ctx: tokens per chunk; chunks: at most this many chunks; from_chunk: skip this many chunks first.
        process_output: also collect ``output.weight``.
        parse_special: tokenize special-token text as the special tokens.
        compute_ppl: report the perplexity of each chunk (costs the output projection).
        in_files: imatrix files added before the run (e.g. a snapshot to resume from).
        save_frequency: every N chunks also write a snapshot ``<output>.at_<chunk>`` (0: never).
        output_frequency: every N chunks rewrite ``output`` with what is collected so far (0: only at the end).
        batch: chunks per forward pass (default: 2048 tokens' worth, llama-imatrix's ``n_batch``).
        device: ``auto``, ``cpu`` or ``cuda``.
        ggml_rounding: round the input of every weight matmul through the weight's ``vec_dot_type`` (F16/BF16,
            or 8-bit blocks for quantized weights) as llama.cpp's plain CPU kernels do
            (:func:`ggufkit.eval.model.load_model`). Off: float32 inputs, as llama.cpp's AMX kernels (an
            Intel Xeon with AMX) multiply F16 weights; on an F16 model the two differ by ~4e-4 relative.
        kv_cache: with ``ggml_rounding``, the llama.cpp K/V cache followed, as in
            :func:`ggufkit.eval.perplexity.perplexity`: ``f16`` (llama-imatrix's default: K and V rounded to
            F16, read by its flash attention in float32) or ``f32`` (its ``-fa off -ctk f32 -ctv f32``).
        progress, on_chunk: per-chunk progress and callback (chunk number, running PPL).

    Returns:
        The :class:`ImatrixResult`.

    Raises:
        EvaluationError: too few tokens, a model the evaluator cannot run, non-finite activations.
        QuantizationError: an ``in_files`` file is malformed or its entries do not match the model.
        UsageError: nonsensical options.
    """
    import torch

    from ggufkit.eval.model import load_model
    from ggufkit.eval.perplexity import RunningStats, check_chunking, score_positions

    _check_format(output_format)
    if text is not None and tokens is not None:
        raise UsageError("give either a text or tokens, not both")
    if text is None and tokens is None:
        raise UsageError("collecting an imatrix needs a text (-f) or tokens")
    if ctx < MIN_CTX:
        raise UsageError(f"--ctx {ctx} is too small: llama-imatrix ignores matmuls of fewer than {MIN_CTX} tokens")
    for name, v in (("--from-chunk", from_chunk), ("--save-frequency", save_frequency),
                    ("--output-frequency", output_frequency)):
        if v < 0:
            raise UsageError(f"{name} {v} must not be negative")
    if batch is not None and batch < 1:
        raise UsageError(f"--batch {batch} must be at least 1")
    if kv_cache not in ("f16", "f32"):
        raise UsageError(f"unknown --kv-cache {kv_cache!r} (expected f16 or f32)")
    progress = progress or NullProgress()
    t_load = time.perf_counter()
    acc = ImatrixAccumulator(ctx)
    for f in in_files:
        acc.load(f)
    with load_model(model_path, device=device, ggml_rounding=ggml_rounding,
                    kv_f16=ggml_rounding and kv_cache == "f16") as model:
        ids, add_bos, bos_id = _tokenize(model.file, text, tokens, parse_special)
        if from_chunk > 0:
            if (from_chunk + 2) * ctx >= len(ids):
                raise EvaluationError(f"there will be not enough tokens left after removing {from_chunk} chunks "
                                      f"(the text has {len(ids)} tokens)")
            ids = ids[from_chunk * ctx:]
        if len(ids) < 2 * ctx:
            raise EvaluationError(f"you need at least {2 * ctx} tokens for a context of {ctx}; the text has only "
                                  f"{len(ids)} tokens (use a longer text or a smaller --ctx)")
        n_chunk = check_chunking(len(ids), ctx, chunks)
        batch = batch or max(1, 2048 // ctx)
        collector = ImatrixCollector({n: t.shape for n, t in model.tensors.items()}, model.device, acc,
                                     process_output)
        head_collected = process_output and "output.weight" in collector.wanted
        model.observer = collector
        load_seconds = time.perf_counter() - t_load
        first = ctx // 2
        stream = torch.tensor(ids[: n_chunk * ctx], dtype=torch.int64).reshape(n_chunk, ctx)
        stats = RunningStats()
        chunk_ppl: list[float] = []
        snapshots: list[str] = []
        # Logits: all positions when output.weight is collected, the scored half for the PPL, else none.
        start = 0 if head_collected else (first if compute_ppl else ctx)
        progress.begin(n_chunk, "chunk", "imatrix")
        t0 = time.perf_counter()
        # Batches start at fixed chunk numbers of the whole text, so a resumed run forms the same batches.
        # Snapshot points are batch edges too, so a snapshot holds exactly a multiple of --save-frequency.
        edges = sorted({0, n_chunk} | {k for k in range(n_chunk) if (k + from_chunk) % batch == 0
                                       or (save_frequency and (k + from_chunk) % save_frequency == 0)})
        model.passes_left = len(edges) - 1  # the last forward pass fills no float cache
        for a, b in itertools.pairwise(edges):
            window = stream[a:b].clone()
            if add_bos and bos_id is not None:
                window[:, 0] = bos_id
            logits = model.logits(window, start=start)
            if compute_ppl:
                targets = stream[a:b, first + 1:].to(model.device)
                scored = logits[:, first - start:-1]
                for i in range(b - a):
                    stats.add(score_positions(scored[i], targets[i]))
                    chunk_ppl.append(stats.ppl)
            del logits
            collector.check_finite()
            for k in range(a, b):
                progress.advance(1)
                if on_chunk is not None:
                    on_chunk(k + 1, chunk_ppl[k] if compute_ppl else None)
            collector.store()
            last = acc.chunk_count
            if output is not None and save_frequency and any(
                    c % save_frequency == 0 for c in range(last - (b - a) + 1, last + 1)):
                snap = snapshot_path(output, last)  # named after the chunks it holds: resume --from-chunk last
                acc.write(snap, output_format, dataset)
                snapshots.append(str(snap))
            if output is not None and output_frequency and b < n_chunk and any(
                    c % output_frequency == 0 for c in range(last - (b - a) + 1, last + 1)):
                acc.write(output, output_format, dataset)
        seconds = time.perf_counter() - t0
        progress.end()
        model.observer = None
        written = acc.write(output, output_format, dataset) if output is not None else None
        return ImatrixResult(
            output=str(written) if written is not None else None, output_format=output_format,
            entries=len(acc.sums), chunks=n_chunk, chunk_count=acc.chunk_count, chunk_size=ctx,
            from_chunk=from_chunk, n_tokens=len(ids) + from_chunk * ctx,
            ppl=stats.ppl if compute_ppl else None, ppl_error=stats.ppl_error if compute_ppl else None,
            chunk_ppl=chunk_ppl, snapshots=snapshots, datasets=acc.dataset_list(dataset), model=str(model_path),
            model_sha256=model.model_sha256, device=str(model.device), seconds=seconds,
            tokens_per_second=n_chunk * ctx / seconds if seconds > 0 else 0.0, load_seconds=load_seconds)


def _tokenize(file: Any, text: str | None, tokens: Sequence[int] | None,
              parse_special: bool) -> tuple[list[int], bool, int | None]:
    """llama-imatrix's ``common_tokenize(ctx, prompt, true, parse_special)``, or the given token ids."""
    from ggufkit.errors import TokenizerError
    from ggufkit.tokenizer.gguf_tokenizer import load_tokenizer

    tok = load_tokenizer(file)
    if tok.add_eos:
        raise TokenizerError("the vocabulary appends EOS to every text; llama-imatrix refuses such models")
    if tokens is not None:
        return list(tokens), bool(tok.add_bos), tok.bos_id
    assert text is not None
    return list(tok.encode(text, add_special=True, parse_special=parse_special)), bool(tok.add_bos), tok.bos_id
