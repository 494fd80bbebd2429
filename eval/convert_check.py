"""``ggufkit convert --check``: does the converted GGUF behave like the Hugging Face checkpoint?

Two comparisons, each against transformers' own classes:

* tokens: the checkpoint's tokenizer (``AutoTokenizer``) and the GGUF's (ggufkit's llama.cpp-exact
  tokenizer) on a fixed test set (unicode, emoji, digits, whitespace runs, special-token text);
* logits: ``AutoModelForCausalLM`` in float32 and ggufkit's evaluator on a few short sequences. The
  tolerance depends on the outtype: the largest difference relative to the largest reference logit, and the
  share of positions whose top-1 token agrees.

Checkpoints transformers cannot load without remote code (Qwen 1), or that would not fit in memory twice,
are skipped with a reason rather than failed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The tokenizer test set: what tokenizers disagree on.
CHECK_TEXTS = (
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Ünïcödé: café, naïve, straße; Ελληνικά; русский; 日本語; 中文。",
    "Emoji 🦙🚀 👨‍👩‍👧 ❤️ and digits 0 12 123 1234 12345 3.14159",
    "   leading spaces,\ttabs,\n\nnewlines and  double  spaces   ",
    "I'M SHOUTING, you'RE not. DON'T stop 'til the end.",
    "Special text: <s> </s> <|endoftext|> <|im_start|>user",
)
#: Sequences scored for logits (the first ones of the test set).
LOGIT_TEXTS = CHECK_TEXTS[:3]
#: outtype -> (max |difference| / max |reference logit|, minimum top-1 agreement).
TOLERANCES: dict[str, tuple[float, float]] = {
    "f32": (1e-3, 0.99), "f16": (2e-2, 0.95), "bf16": (5e-2, 0.9), "q8_0": (0.1, 0.85),
    "q4_0": (0.5, 0.5), "q4_1": (0.5, 0.5), "q4_k": (0.5, 0.5), "q4_k_m": (0.5, 0.5),
}


@dataclass
class CheckResult:
    """Outcome of :func:`check_conversion`."""

    ok: bool
    skipped: str | None = None
    failures: list[str] = field(default_factory=list)
    tokens_compared: int = 0
    max_abs_diff: float | None = None
    rel_diff: float | None = None
    top1_agreement: float | None = None
    tolerance: tuple[float, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "skipped": self.skipped, "failures": self.failures,
                "tokens_compared": self.tokens_compared, "max_abs_diff": self.max_abs_diff,
                "rel_diff": self.rel_diff, "top1_agreement": self.top1_agreement,
                "tolerance": list(self.tolerance) if self.tolerance else None}


def _available_memory() -> int:
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def _reference_tokenizer(model_dir: Path, hf_tok: Any) -> tuple[Any, bool]:
    """(encode function, whether special-token text is parsed as special tokens).

    SPM vocabularies are compared with sentencepiece itself, the tokenizer llama.cpp's SPM reproduces
    (transformers' fast Llama tokenizer merges whitespace runs differently); it reads special-token text
    as plain text, so the GGUF side is asked not to parse it either.
    """
    spm_path = model_dir / "tokenizer.model"
    if spm_path.is_file():
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_path))
        bos = [sp.bos_id()] if sp.bos_id() >= 0 and getattr(hf_tok, "add_bos_token", True) else []
        return (lambda text: bos + list(sp.encode(text))), False
    return (lambda text: list(hf_tok(text)["input_ids"])), True


def check_conversion(model_dir: str | Path, gguf: str | Path, *, outtype: str, n_params: int,
                     device: str = "auto") -> CheckResult:
    """Compare a converted GGUF with its source checkpoint through transformers.

    Args:
        model_dir: the Hugging Face checkpoint directory.
        gguf: the converted file (first shard of a split set).
        outtype: the resolved outtype (selects the tolerance).
        n_params: parameters of the model (to decide whether both copies fit in memory).
        device: evaluator device (``auto``, ``cpu``, ``cuda``).

    Returns:
        A :class:`CheckResult`; ``ok`` is False when tokens differ or logits disagree beyond the tolerance.
    """
    import json

    model_dir = Path(model_dir)
    tolerance = TOLERANCES[outtype]
    arch = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("architectures", ["?"])[0]
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' own bars would interleave with ours on stderr

    if not hasattr(transformers, arch):
        return CheckResult(True, skipped=f"transformers has no class {arch} (it would need remote code)")
    from ggufkit.eval.arch import ARCH_TRAITS
    from ggufkit.format import open_gguf

    with open_gguf(gguf) as model:
        gguf_arch = model.architecture
    if gguf_arch not in ARCH_TRAITS:
        return CheckResult(True, skipped=f"cannot evaluate {gguf_arch!r}: the evaluator has no traits for it")
    # transformers' float32 copy plus the evaluator's, with room to spare.
    if 2 * 4 * n_params > 0.6 * _available_memory():
        return CheckResult(True, skipped="the model does not fit in memory twice (transformers and the GGUF)")
    import torch

    from ggufkit.eval.model import load_model
    from ggufkit.eval.tokenizer import load_tokenizer

    failures: list[str] = []
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    encode_ref, parse_special = _reference_tokenizer(model_dir, hf_tok)
    with open_gguf(gguf) as model:
        gguf_tok = load_tokenizer(model)
        compared = 0
        for text in CHECK_TEXTS:
            want = encode_ref(text)
            got = gguf_tok.encode(text, add_special=True, parse_special=parse_special)
            compared += len(want)
            if want != got:
                first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
                failures.append(f"tokens differ for {text[:30]!r} at position {first}")
    reference = getattr(transformers, arch).from_pretrained(model_dir, dtype=torch.float32).eval()
    max_abs = max_ref = 0.0
    agree = total = 0
    finite = True
    # The evaluator holds the GGUF open (a memory map and its weights): closed on every path out.
    with load_model(gguf, device=device) as converted:
        for text in LOGIT_TEXTS:
            ids = torch.tensor([list(hf_tok(text)["input_ids"])[:64]])
            with torch.no_grad():
                want_logits = reference(ids).logits[0].float()
            got_logits = converted.logits(ids.to(converted.device))[0].float().cpu()
            finite = finite and bool(torch.isfinite(got_logits).all())
            max_abs = max(max_abs, float((got_logits - want_logits).abs().max()))
            max_ref = max(max_ref, float(want_logits.abs().max()))
            agree += int((got_logits.argmax(-1) == want_logits.argmax(-1)).sum())
            total += ids.shape[1]
    del reference
    rel = max_abs / max(max_ref, 1e-12)
    top1 = agree / max(total, 1)
    if not finite:
        failures.append("the GGUF's logits are not finite (weights overflowing the outtype, e.g. f16?)")
    elif rel > tolerance[0]:
        failures.append(f"logits differ by {max_abs:.4g} ({rel:.2%} of the largest logit; {outtype} allows "
                        f"{tolerance[0]:.2%})")
    if top1 < tolerance[1]:
        failures.append(f"top-1 agrees at {top1:.1%} of positions ({outtype} needs {tolerance[1]:.0%})")
    return CheckResult(not failures, None, failures, compared, max_abs, rel, top1, tolerance)
