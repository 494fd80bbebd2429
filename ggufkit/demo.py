"""``ggufkit demo``: the whole pipeline on a tiny model built on the spot, with no download.

It trains a byte-level BPE tokenizer and a small LLaMA (transformers' real ``LlamaForCausalLM``) for a few
steps on the first part of the bundled English sample, saves them as a Hugging Face checkpoint, then runs
convert (F16) -> importance matrix (on the training text) -> quantize (every type of the quantizer's registry,
plus the Q4_K_M preset, all with the importance matrix, which the IQ1/IQ2 types require) -> set-meta -> ppl
with KL divergence against the F16 file on held-out text, and returns one row per file. Everything is
seeded, so two runs give the same table.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ggufkit.format.writer import Progress

#: The mixture preset shown beside the pure types (llama.cpp's most used one).
DEMO_PRESET = "q4_k_m"
#: Characters of the sample used for training; the rest is held out for scoring.
TRAIN_CHARS = 200_000
SCORE_CTX = 128
SCORE_CHUNKS = 16
IMATRIX_CHUNKS = 16
#: The tiny model (LlamaConfig fields) and its tokenizer's vocabulary size.
MODEL_SHAPE: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2}
VOCAB_SIZE = 512
#: The checkpoint folder inside the workdir; every file the demo writes is named after it.
CHECKPOINT = "tiny-llama"
#: What the checkpoint's README.md holds (every demo writes it), so a later run knows a demo's own workdir.
_MARK = "ggufkit tiny llama"


def demo_targets() -> list[tuple[str, bool]]:
    """``(quantize target, pure)`` for every file the demo makes from the F16 one: each type the quantizer's
    registry has (F32, BF16 and every kernel type, with ``--pure`` so the whole file is that type; see
    :data:`UNCOVERED` for the types that need an importance matrix), then the Q4_K_M preset. Read from :mod:`ggufkit.quant.registry`, so a type added there is demonstrated too."""
    from gguf import GGMLQuantizationType

    from ggufkit.quant.registry import KERNELS, SUPPORTED_TYPES

    floats = sorted((t for t in SUPPORTED_TYPES if t not in KERNELS and t != GGMLQuantizationType.F16), key=int)
    return [(t.name.lower(), True) for t in (*floats, *KERNELS)] + [(DEMO_PRESET, False)]


#: What the files of the types that need an importance matrix keep in Q8_0: no importance matrix covers the token
#: embedding (a lookup, not a matmul) or the output head (llama-imatrix skips it without --process-output), and
#: llama-quantize refuses those types without one.
UNCOVERED = "token_embd and output Q8_0"


@dataclass(frozen=True)
class DemoRow:
    """One file of the demo: its type (as ``quantize --type`` or ``--tensor-type`` names it: ``Q4_K_M``), size,
    bits per weight and quality against the F16 baseline."""

    type: str
    recipe: str
    path: str
    bytes: int
    bits_per_weight: float
    ppl: float
    ppl_error: float
    mean_kld: float | None
    same_top_p: float | None


def _build_checkpoint(directory: Path, text: str, train_steps: int, seed: int) -> None:
    """Tokenizer + tiny LLaMA trained for ``train_steps`` steps on ``text``, saved as a HF checkpoint."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress goes to stderr; transformers' bars would interleave

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    fast.save_pretrained(directory)

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), **MODEL_SHAPE, max_position_embeddings=512,
                         bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    ids = torch.tensor(tok.encode(text).ids, dtype=torch.long)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    seq, batch = 128, 8
    model.train()
    for _ in range(train_steps):
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=generator)
        x = torch.stack([ids[s:s + seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "README.md").write_text(json.dumps({"demo": _MARK, "seed": seed}))


def demo_outputs(workdir: Path, targets: Sequence[tuple[str, bool]]) -> list[Path]:
    """Every path :func:`run_demo` writes in ``workdir``: the checkpoint folder, the F16 file, the importance
    matrix, one file per target."""
    return [workdir / CHECKPOINT, workdir / f"{CHECKPOINT}-f16.gguf", workdir / f"{CHECKPOINT}-imatrix.gguf",
            *(workdir / f"{CHECKPOINT}-{target}.gguf" for target, _ in targets)]


def _made_by_a_demo(workdir: Path) -> bool:
    try:
        mark = json.loads((workdir / CHECKPOINT / "README.md").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(mark, dict) and mark.get("demo") == _MARK


def refuse_foreign_files(workdir: Path, targets: Sequence[tuple[str, bool]]) -> None:
    """Refuse a ``workdir`` that holds a file the demo would overwrite and did not make (a folder a previous
    demo wrote may be reused; other files in it are left alone).

    Raises:
        OutputExistsError: naming the first such file.
    """
    from ggufkit.errors import OutputExistsError

    if _made_by_a_demo(workdir):
        return
    for path in demo_outputs(workdir, targets):
        if path.exists() or path.is_symlink():
            raise OutputExistsError(f"{path} exists and was not made by ggufkit demo, which would overwrite it; "
                                    "give --workdir an empty or new folder")


def run_demo(workdir: Path, *, targets: Sequence[tuple[str, bool]] | None = None, train_steps: int = 60,
             seed: int = 0, progress: Progress | None = None,
             on_stage: Callable[[str], None] | None = None) -> list[DemoRow]:
    """Build, convert, quantize, edit and score a tiny model inside ``workdir``.

    Args:
        workdir: the directory that receives the checkpoint and the GGUF files; it may hold other files, but
            none the demo would overwrite unless a previous demo wrote them (:func:`refuse_foreign_files`).
        targets: ``(quantize target, pure)`` per file made from the F16 conversion (default:
            :func:`demo_targets`, every type the quantizer has plus the Q4_K_M preset).
        train_steps: optimisation steps of the tiny model (0: random weights).
        seed: seeds the model, the training batches and so the whole table.
        progress: progress of the long steps.
        on_stage: called with a one-line description as each stage starts.

    Returns:
        One :class:`DemoRow` per file, F16 first.

    Raises:
        OutputExistsError: ``workdir`` holds a file the demo would overwrite and did not make (before any work).
    """
    from ggufkit.converters import convert
    from ggufkit.eval import collect_imatrix, perplexity
    from ggufkit.eval.perplexity import sample_text
    from ggufkit.format import open_gguf
    from ggufkit.metadata_edit import edit_metadata
    from ggufkit.quant import quantize_file
    from ggufkit.quant.llama_quantize.presets import TENSOR_TYPES, TYPE_CHOICES, get_preset
    from ggufkit.quant.registry import KERNELS

    targets = demo_targets() if targets is None else targets
    refuse_foreign_files(workdir, targets)
    stage = on_stage or (lambda _: None)
    text = sample_text()
    train, held_out = text[:TRAIN_CHARS], text[TRAIN_CHARS:]
    checkpoint = workdir / CHECKPOINT
    checkpoint.mkdir(parents=True, exist_ok=True)
    stage(f"training a tiny LLaMA and its tokenizer ({train_steps} steps)")
    _build_checkpoint(checkpoint, train, train_steps, seed)

    stage("converting to F16")
    f16 = workdir / f"{CHECKPOINT}-f16.gguf"
    convert(checkpoint, f16, outtype="f16", progress=progress)
    files = [("F16", "converted from the checkpoint", f16)]
    stage(f"collecting an importance matrix on the training text ({IMATRIX_CHUNKS} chunks of {SCORE_CTX} tokens)")
    imatrix = workdir / f"{CHECKPOINT}-imatrix.gguf"
    collect_imatrix(f16, text=train, output=imatrix, ctx=SCORE_CTX, chunks=IMATRIX_CHUNKS, compute_ppl=False,
                    device="cpu", progress=progress)
    for target, pure in targets:
        qtype = TENSOR_TYPES.get(target)
        uncovered = qtype in KERNELS and KERNELS[qtype].needs_imatrix
        wide = "q8_0" if uncovered else None
        out = workdir / f"{CHECKPOINT}-{target}.gguf"
        stage(f"quantizing to {target.upper()}" + (" (--pure)" if pure else ""))
        if not pure:
            recipe = f"{target.upper()} preset mixture"
            quantize_file(f16, out, target, imatrix=imatrix, progress=progress)
        elif target in TYPE_CHOICES and get_preset(target).default_type == qtype:
            recipe = f"every quantizable tensor {target.upper()} (--pure)" + (f", {UNCOVERED}" if uncovered else "")
            quantize_file(f16, out, target, pure=True, imatrix=imatrix, token_embedding_type=wide,
                          output_tensor_type=wide, progress=progress)
        else:  # no llama-quantize TYPE starts from this type (MXFP4; IQ2_S's starts from IQ2_XS): --tensor-type
            recipe = f"every block tensor {target.upper()} (--tensor-type), token_embd and output Q8_0"
            quantize_file(f16, out, "q8_0", pure=True, imatrix=imatrix, tensor_types=[(r"blk\..*", target)],
                          progress=progress)
        files.append((target.upper(), recipe, out))

    stage("setting general.name on every file (in place)")
    for qtype, _, path in files:
        edit_metadata(path, set_text={"general.name": f"ggufkit demo tiny LLaMA {qtype}"})

    rows = []
    for qtype, recipe, path in files:
        stage(f"scoring {path.name}")
        result = perplexity(path, text=held_out, ctx=SCORE_CTX, chunks=SCORE_CHUNKS, device="cpu",
                            baseline=None if path == f16 else f16, progress=progress)
        with open_gguf(path) as model:
            n_bytes = sum(model[name].nbytes for name in model)
            n_weights = sum(model[name].n_elements for name in model)
        kld = result.kld or {}
        rows.append(DemoRow(type=qtype, recipe=recipe, path=str(path), bytes=path.stat().st_size,
                            bits_per_weight=8 * n_bytes / n_weights, ppl=result.ppl, ppl_error=result.ppl_error,
                            mean_kld=kld.get("mean_kld"), same_top_p=kld.get("same_top_p")))
    return rows


def rows_as_dicts(rows: Sequence[DemoRow]) -> list[dict[str, object]]:
    return [asdict(r) for r in rows]


#: What each column of the demo's table means (one line each; ``ggufkit demo`` prints them under it).
COLUMNS: dict[str, str] = {
    "type": "the file: F16 is the converted baseline; every other row is one quantization of it",
    "size": "the file's size on disk (tensor data, metadata and vocabulary)",
    "bits/weight": "bits of tensor data per model weight (F16 = 16; lower means a smaller model)",
    "ppl": "perplexity on held-out text, +/- its standard error (lower is better; llama-perplexity's method)",
    "mean KLD vs F16": "mean KL divergence of the next-token distribution from the F16 file's (0 = identical)",
    "same top": "share of positions where the most likely next token is the same as the F16 file's",
}


def describe(train_steps: int, rows: Sequence[DemoRow]) -> list[str]:
    """What :func:`run_demo` did, one line per stage, for the report under the table."""
    shape = MODEL_SHAPE
    n_pure = sum("(--pure)" in r.recipe or "(--tensor-type)" in r.recipe for r in rows)
    n_uncovered = sum(r.recipe.endswith(UNCOVERED) for r in rows)
    return [
        f"trained a tiny LLaMA ({shape['num_hidden_layers']} layers, hidden size {shape['hidden_size']}, "
        f"{VOCAB_SIZE}-token BPE vocabulary) for {train_steps} steps on {TRAIN_CHARS:,} characters of the "
        "bundled English sample",
        "converted the checkpoint to an F16 GGUF file (ggufkit convert)",
        f"collected an importance matrix of the F16 file on the training text ({IMATRIX_CHUNKS} chunks of "
        f"{SCORE_CTX} tokens; ggufkit imatrix), used by every quantization below",
        f"quantized the F16 file to each of the {n_pure} other types ggufkit's quantizer has, one file per type "
        f"with every quantizable tensor in that type (--pure; the {n_uncovered} types that need an importance "
        f"matrix keep {UNCOVERED}, which no importance matrix covers; a type no llama-quantize TYPE starts from "
        f"is set on every block tensor with --tensor-type), and to the {DEMO_PRESET.upper()} preset "
        "(llama.cpp's per-tensor mixture)",
        "set general.name in every file, in place (ggufkit set-meta)",
        f"scored every file on held-out text ({SCORE_CHUNKS} chunks of {SCORE_CTX} tokens): perplexity, and KL "
        "divergence against the F16 file (ggufkit ppl --baseline)",
    ]
