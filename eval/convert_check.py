"""``ggufkit convert --check``: does the converted GGUF behave like the Hugging Face checkpoint?

Two comparisons, each against transformers' own classes:

* tokens: the checkpoint's tokenizer (``AutoTokenizer``) and the GGUF's (ggufkit's llama.cpp-exact
  tokenizer) on a fixed test set (unicode, emoji, digits, whitespace runs, special-token text);
* logits: ``AutoModelForCausalLM`` in float32 and ggufkit's evaluator on a few short sequences. The
  reference model does not run the checkpoint's weights as they are: each weight is first rounded to the
  type the GGUF stores it in (F16/BF16 by numpy/torch, quantized types through ggufkit's quantizer and
  back), so both sides compute with the same numbers and only float32 arithmetic separates them. One
  tight tolerance then holds for every outtype, and a swapped tensor or a wrong Q/K permutation - which
  a quantization-sized tolerance would let through - fails.

A checkpoint released quantized is compared as it was converted: FP8 and compressed-tensors weights are read
through the conversion's dequantizing reader (converters/quantized_source.py) into transformers' unquantized
model of the class, one tensor as transformers loads it; gpt-oss's MXFP4 experts, which the GGUF keeps bit for
bit, are dequantized by transformers itself. Tensors a family hook computes are rounded in the GGUF's own rows
where the family says where those rows lie in their source (``reference_view``: gpt-oss's experts, DeepSeek's
and GLM-4.7-Flash's ``attn_k_b`` / ``attn_v_b`` in ``kv_b_proj``); elsewhere a block-quantized computed tensor
skips the check, saying why. A stacked expert tensor (``ffn_*_exps`` of
Mixtral, Qwen-MoE, DeepSeek, GLM, Ernie, ... built from per-expert checkpoint tensors) is rounded expert by expert
as transformers loads each one: its rows are the experts' rows, so rounding each expert is rounding the stack,
and transformers fuses the rounded experts however its class stores them.

The check is skipped, with the reason, when it cannot run: PyTorch is not installed, transformers has no
class for the checkpoint (it would need remote code), the evaluator does not run the architecture or one
of its features, the two models would not fit in available memory, or transformers cannot load the
checkpoint. A skip is never a pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ggufkit.sysmem import available_memory_bytes

if TYPE_CHECKING:
    from ggufkit.converters.plan_types import ConvertPlan

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
#: (max |difference| / max |reference logit|, minimum top-1 agreement), for every outtype: the reference
#: runs the GGUF's own weight values, so only float32 summation order separates the two (measured ~1e-6).
TOLERANCE = (1e-3, 0.95)
#: What a user runs to make the check possible.
TORCH_HINT = "PyTorch is not installed; to enable it: pip install 'ggufkit[torch]'"

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


@dataclass
class CheckResult:
    """Outcome of :func:`check_conversion`.

    Attributes:
        status: ``"passed"``, ``"failed"`` or ``"skipped"``.
        reason: why the check was skipped (None otherwise).
        failures: one line per disagreement (``status == "failed"``).
    """

    status: str
    reason: str | None = None
    failures: list[str] = field(default_factory=list)
    tokens_compared: int = 0
    max_abs_diff: float | None = None
    rel_diff: float | None = None
    top1_agreement: float | None = None
    tolerance: tuple[float, float] | None = None

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    @property
    def failed(self) -> bool:
        return self.status == FAILED

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason, "failures": self.failures,
                "tokens_compared": self.tokens_compared, "max_abs_diff": self.max_abs_diff,
                "rel_diff": self.rel_diff, "top1_agreement": self.top1_agreement,
                "tolerance": list(self.tolerance) if self.tolerance else None}


def _skipped(reason: str) -> CheckResult:
    return CheckResult(SKIPPED, reason=reason)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


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


def _widen(arr: np.ndarray, src_dtype: str) -> np.ndarray:
    """Checkpoint data as float32 (bf16 bit patterns widened exactly)."""
    if src_dtype == "BF16":
        return (np.asarray(arr).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(arr, dtype=np.float32)


def _as_stored(w: np.ndarray, ggml_type: Any, transform: str | None) -> np.ndarray:
    """``w`` (HF layout, float32) with the values the GGUF stores for it.

    Quantization works on rows, so it commutes with the row reorderings (Q/K permutation, NeoX QKV
    regroup): those are applied to neither side here. A transposed tensor is rounded in its GGUF layout.
    """
    import torch
    from gguf import GGMLQuantizationType as Q

    from ggufkit.quant import dequantize, quantize

    flip = transform == "transpose" and w.ndim == 2
    x = np.ascontiguousarray(w.T if flip else w)
    if ggml_type == Q.F16:
        with np.errstate(over="ignore"):
            x = x.astype(np.float16).astype(np.float32)
    elif ggml_type == Q.BF16:
        x = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    elif ggml_type != Q.F32:
        x = dequantize(quantize(x, ggml_type), ggml_type, x.shape)
    x = np.ascontiguousarray(x.T) if flip else x
    return x if x.flags.writeable else x.copy()  # torch shares the memory: never a read-only memmap


def _kept(ckpt: Any, e: Any) -> bool:
    """Whether GGUF tensor ``e`` holds its source's values unrounded: MXFP4 experts repacked bit for bit from a
    checkpoint released in MXFP4 (converters/mxfp4_source.py); the reference dequantizes the same codes."""
    return e.ggml_type.name == "MXFP4" and e.source + "_blocks" in ckpt.tensors


#: A family's ``reference_view(gguf, source, w, config)`` (converters/gpt_oss.py, converters/deepseek2.py): the
#: rows of GGUF tensor ``gguf``, which its hooks compute, as a writable view of ``w``, its checkpoint tensor
#: ``source`` (float32), or None where the family does not place that tensor.
ReferenceView = Callable[[str, str, np.ndarray, Mapping[str, Any]], "np.ndarray | None"]
#: A checkpoint tensor (float32) -> its values as the GGUF stores them.
Rounding = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class _Views:
    """The rounded tensors a family hook computes whose rows its ``reference_view`` places in their checkpoint
    source (``by_source``: checkpoint tensor -> those plan entries)."""

    view: ReferenceView | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    by_source: dict[str, list[Any]] = field(default_factory=dict)

    def placed(self, e: Any) -> bool:
        return e.name in {p.name for p in self.by_source.get(e.source, ())}

    def rounded(self, source: str, w: np.ndarray) -> np.ndarray:
        """``w`` (float32, read from ``source``) with the GGUF's rows rounded where they lie in it: each placed
        tensor's view quantized as its own rows, as the GGUF stores it, and written back through the view."""
        assert self.view is not None
        w = np.array(w, dtype=np.float32)  # a contiguous copy: every view of it writes it
        for e in self.by_source[source]:
            part = self.view(e.name, source, w, self.config)
            if part is None or not np.may_share_memory(part, w):
                raise ValueError(f"the reference_view of {e.name} is not a view of {source}")
            part[...] = _as_stored(np.ascontiguousarray(part), e.ggml_type, None)
        return w


def _views(ckpt: Any, plan: ConvertPlan, view: ReferenceView | None, config: Mapping[str, Any]) -> _Views:
    """Which tensors ``view`` (the family's ``reference_view``) places: those stored rounded (not F32) whose view of
    their source, probed on an array of the source's shape that holds no data, has the GGUF tensor's shape."""
    from gguf import GGMLQuantizationType as Q

    by_source: dict[str, list[Any]] = {}
    if view is not None:
        for e in plan.entries:
            if e.name not in plan.rewritten or e.ggml_type == Q.F32 or _kept(ckpt, e) or e.source not in ckpt.tensors:
                continue
            shape = tuple(ckpt.tensors[e.source].shape)
            probe = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape, (0,) * len(shape))
            part = view(e.name, e.source, probe, config)
            if part is not None and tuple(part.shape) == tuple(e.shape):
                by_source.setdefault(e.source, []).append(e)
    return _Views(view, config, by_source)


def _stored_weights(ckpt: Any, plan: ConvertPlan, views: _Views = _Views(),
                    given: Any = ()) -> Iterator[tuple[str, bool, np.ndarray]]:
    """(HF name, whether it is the output projection, values as stored) for each checkpoint tensor the
    GGUF rounds. F32 tensors hold the checkpoint's values exactly, as transformers' float32 model does
    (however transformers renames them on load); generated and predictor tensors have no transformers
    counterpart. ``views`` places the rows of the tensors a family's hooks compute in their source, where those
    are rounded (each such source yielded once, every entry of it rounded). Checkpoint tensors in ``given`` were
    given to transformers rounded (:func:`_rounded_singles`): skipped."""
    from gguf import GGMLQuantizationType as Q

    for e in plan.entries:
        if _kept(ckpt, e) or e.source not in ckpt.tensors or views.placed(e):
            continue
        # the output projection always: a tied head must be untied when the embedding is rounded
        if e.kind == "OUTPUT" or (e.ggml_type != Q.F32 and e.source not in given):
            w = _widen(ckpt.read(e.source), ckpt.tensors[e.source].dtype)
            yield e.source, e.kind == "OUTPUT", _as_stored(w, e.ggml_type, e.transform)
    for source in views.by_source:
        if source not in given:
            yield source, False, views.rounded(source, _widen(ckpt.read(source), ckpt.tensors[source].dtype))


def _rounded_stacks(plan: ConvertPlan) -> tuple[set[str], dict[str, Rounding]]:
    """(GGUF names, per-expert checkpoint tensor -> how it is rounded) of the stacked expert tensors the GGUF
    stores rounded (not F32) and no family hook rewrites (converters/rewrite.py ``StackLoader``: the stack is the
    experts' rows one after another, so each expert is rounded on its own)."""
    from gguf import GGMLQuantizationType as Q

    from ggufkit.converters.rewrite import StackLoader

    names: set[str] = set()
    members: dict[str, Rounding] = {}
    for e in plan.entries:
        load = plan.loaders.get(e.name)
        if isinstance(load, StackLoader) and e.name not in plan.rewritten and e.ggml_type != Q.F32:
            names.add(e.name)
            members.update((source, partial(_as_stored, ggml_type=e.ggml_type, transform=load.transform))
                           for source in load.sources)
    return names, members


def _rounded_singles(ckpt: Any, plan: ConvertPlan, views: _Views = _Views()) -> dict[str, Rounding]:
    """Checkpoint tensor -> how it is rounded, for each tensor the GGUF stores rounded from that one checkpoint
    tensor but the output projection (which :func:`_stored_weights` always sets after loading): as the GGUF stores
    it, or, a source whose rows ``views`` places, in each placed tensor's rows. What a reference loaded from the
    checkpoint's tensors is given rounded, so that transformers renames them, or drops those its class has no
    parameter for (NextN layers: GLM-4.7-Flash's attn_k_b / attn_v_b too), as it loads them."""
    from gguf import GGMLQuantizationType as Q

    singles: dict[str, Rounding] = {}
    for e in plan.entries:
        if _kept(ckpt, e) or e.source not in ckpt.tensors or e.kind == "OUTPUT" or e.ggml_type == Q.F32:
            continue
        singles[e.source] = partial(views.rounded, e.source) if views.placed(e) else \
            partial(_as_stored, ggml_type=e.ggml_type, transform=e.transform)
    return singles


def _unroundable(ckpt: Any, plan: ConvertPlan, views: _Views = _Views(), stacks: Any = ()) -> str | None:
    """Why the reference cannot hold the GGUF's values (a rounded tensor built from several checkpoint
    tensors, other than the stacked experts of ``stacks``: GGUF names), or None."""
    from gguf import GGMLQuantizationType as Q

    for e in plan.entries:
        if _kept(ckpt, e) or e.name in stacks:
            continue
        if e.source not in ckpt.tensors and e.source != "generated" and e.kind not in ("FC1", "FC2") \
                and e.ggml_type != Q.F32:
            return (f"{e.name} is built from several checkpoint tensors ({e.source}) and stored as "
                    f"{e.ggml_type.name}; the reference cannot round it (check an f32 conversion instead)")
        if e.name in plan.rewritten and e.ggml_type not in (Q.F32, Q.F16, Q.BF16) \
                and not views.placed(e):  # blocks span a row
            return (f"{e.name} is computed from {e.source} by the {plan.arch} converter's hooks and stored as "
                    f"{e.ggml_type.name}; the reference cannot round it (check an f32 conversion instead)")
    return None


def _as_llama_cpp_computes(config: Any) -> Any:
    """``config`` with the switches transformers honours and llama.cpp's graph has no form for set as llama.cpp
    computes: YaRN's ``truncate: false`` (gpt-oss; transformers then leaves the correction range unrounded, as
    OpenAI's reference does), where ggml always rounds it (ggml-cpu/ops.cpp ggml_rope_yarn_corr_dims: floor/ceil).
    The check compares the file's meaning in llama.cpp, so the reference follows it."""
    rope = getattr(config.get_text_config(), "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("truncate") is False:
        config.get_text_config().rope_parameters = {**rope, "truncate": True}
    return config


class _Deferred:
    """One checkpoint tensor as transformers' loader takes a safetensors slice (``tensor[...]`` reads it): read
    through ggufkit's reader, a quantized source's weight dequantized, only when transformers loads it, so the
    dequantized model is never held beside transformers' copy of it; ``rounding``: the tensor (float32) rounded as
    the GGUF stores it (:func:`_rounded_stacks`, :func:`_rounded_singles`)."""

    def __init__(self, ckpt: Any, name: str, rounding: Rounding | None = None) -> None:
        self.ckpt, self.name, self.rounding = ckpt, name, rounding

    def __getitem__(self, index: Any) -> Any:
        import torch

        t = self.ckpt.tensors[self.name]
        arr = self.ckpt.read(self.name)
        arr = _widen(arr, t.dtype) if t.dtype in ("BF16", "F16", "F32", "F64") else np.asarray(arr)
        if self.rounding is not None:
            arr = self.rounding(np.asarray(arr, dtype=np.float32))
        return torch.from_numpy(np.array(arr))[index]  # a copy: never a read-only memmap


def _open_source(model_dir: Path, plan: ConvertPlan) -> tuple[Any, str | None]:
    """(checkpoint reader, quant_method): a quantized source's reader dequantizes as the conversion does
    (converters/quantized_source.py), an unquantized one reads the files as they are."""
    from ggufkit.converters.checkpoint import Checkpoint, read_config
    from ggufkit.converters.quantized_source import open_checkpoint, quantization_method
    from ggufkit.converters.registry import load_registry

    config = read_config(model_dir)
    method, _ = quantization_method(config, model_dir)
    if method is None:
        return Checkpoint(model_dir), None
    return open_checkpoint(model_dir, config, load_registry().get(plan.hf_class)), method


def _reference_view(plan: ConvertPlan) -> ReferenceView | None:
    """The family's ``reference_view`` (converters/gpt_oss.py, converters/deepseek2.py): the rows of the tensors its
    hooks compute where they lie in their checkpoint source, so the reference rounds them in the GGUF's own rows;
    None when it has none."""
    from ggufkit.converters.hooks import hooks_module
    from ggufkit.converters.registry import load_registry

    family = load_registry().get(plan.hf_class).hooks
    return getattr(hooks_module(family), "reference_view", None) if family else None


def _load_reference(model_dir: Path, arch: str, plan: ConvertPlan) -> Any:
    """transformers' float32 model with the GGUF's weight values, or a str saying why it cannot be built.

    A source released quantized: FP8 and compressed-tensors weights come from ggufkit's dequantizing reader (the
    one the conversion reads: llama.cpp's ``dequant_model``), each read when transformers loads it, into the
    unquantized model of the class; gpt-oss's MXFP4 experts are dequantized by transformers itself
    (``Mxfp4Config(dequantize=True)``), as the GGUF keeps their codes. The experts of a stack the GGUF rounds are
    given to transformers rounded, read the same way, whatever the source (:func:`_rounded_stacks`); so is every
    tensor a reference read that way holds rounded (:func:`_rounded_singles`), the rows a family's
    ``reference_view`` places rounded in its source (:class:`_Views`)."""
    import torch
    import transformers

    from ggufkit.converters.checkpoint import read_config
    from ggufkit.converters.quantized_source import QUANT_METHODS

    ckpt, method = _open_source(model_dir, plan)
    try:
        views = _views(ckpt, plan, _reference_view(plan), read_config(model_dir))
        # an MXFP4 source is loaded by transformers from its files: no stack of it can be given rounded
        stacks, members = _rounded_stacks(plan) if method != "mxfp4" else (set(), {})
        why = _unroundable(ckpt, plan, views, stacks)
        if why is not None:
            return why
        config = _as_llama_cpp_computes(transformers.AutoConfig.from_pretrained(model_dir))
        kwargs: dict[str, Any] = {}
        given: dict[str, Rounding] = {}
        if method in QUANT_METHODS or members:
            for c in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
                if hasattr(c, "quantization_config"):
                    delattr(c, "quantization_config")
            given = {**_rounded_singles(ckpt, plan, views), **members}
            kwargs["state_dict"] = {name: _Deferred(ckpt, name, given.get(name)) for name in ckpt.tensors}
        elif method == "mxfp4":
            from transformers import Mxfp4Config  # type: ignore[attr-defined]

            kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
        where = None if "state_dict" in kwargs else model_dir  # transformers takes the files or the tensors
        reference = getattr(transformers, arch).from_pretrained(where, config=config, dtype=torch.float32,
                                                                **kwargs).eval()
        params = dict(reference.named_parameters(remove_duplicate=False))
        outputs: list[np.ndarray] = []
        with torch.no_grad():
            for name, is_output, values in _stored_weights(ckpt, plan, views, given):
                if is_output:
                    outputs.append(values)  # after the others: a tied head must not overwrite the embedding
                    continue
                if name not in params or tuple(params[name].shape) != values.shape:
                    return f"transformers' {arch} has no parameter {name} of shape {list(values.shape)}"
                params[name].data = torch.from_numpy(values)
            head = reference.get_output_embeddings()
            for values in outputs:
                if head is None or tuple(head.weight.shape) != values.shape:
                    return f"transformers' {arch} has no output projection of shape {list(values.shape)}"
                head.weight = torch.nn.Parameter(torch.from_numpy(values))  # unties a tied head
        return reference
    finally:
        ckpt.close()


def check_conversion(model_dir: str | Path, gguf: str | Path, plan: ConvertPlan, *,
                     device: str = "auto") -> CheckResult:
    """Compare a converted GGUF with its source checkpoint through transformers.

    Args:
        model_dir: the Hugging Face checkpoint directory.
        gguf: the converted file (first shard of a split set).
        plan: the conversion's plan (which checkpoint tensor became which GGUF tensor, at which type).
        device: evaluator device (``auto``, ``cpu``, ``cuda``).

    Returns:
        A :class:`CheckResult`: ``failed`` when tokens differ or logits disagree beyond :data:`TOLERANCE`,
        ``skipped`` with a reason when the comparison cannot run.
    """
    import json

    try:
        import torch  # noqa: F401  (the reference and the evaluator both need it)
        import transformers
    except ImportError:
        return _skipped(TORCH_HINT)
    from transformers.utils import logging as hf_logging

    from ggufkit.errors import EvaluationError

    model_dir = Path(model_dir)
    arch = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("architectures", ["?"])[0]
    hf_logging.disable_progress_bar()  # transformers' own bars would interleave with ours on stderr
    if not hasattr(transformers, arch):
        return _skipped(f"transformers has no class {arch} (it would need remote code)")
    # transformers' float32 copy plus the evaluator's, with room to spare.
    available = available_memory_bytes() or None  # 0: unknown, then no gate
    if available is not None and 2 * 4 * plan.n_params > 0.6 * available:
        return _skipped(f"the model does not fit in available memory twice (transformers and the GGUF: "
                        f"{2 * 4 * plan.n_params / 2**30:.1f} GiB of {available / 2**30:.1f} GiB available)")
    from ggufkit.eval.model import load_model

    try:
        converted = load_model(gguf, device=device)
    except EvaluationError as exc:
        return _skipped(f"the evaluator cannot run this file: {exc.message}")
    # The evaluator holds the GGUF open (a memory map and its weights): closed on every path out.
    with converted:
        try:
            hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
            reference = _load_reference(model_dir, arch, plan)
        except Exception as exc:  # transformers' and torch's errors have no common base
            return _skipped(f"transformers cannot load the checkpoint ({_one_line(exc)})")
        if isinstance(reference, str):
            return _skipped(reference)
        try:
            return _compare(model_dir, hf_tok, reference, converted, gguf)
        except EvaluationError as exc:
            return _skipped(f"the evaluator cannot run this file: {exc.message}")
        except Exception as exc:  # a torch error on either side: the models cannot be compared
            return CheckResult(FAILED, failures=[f"the comparison could not run ({_one_line(exc)})"])


def _token(tid: int, pieces: list[str]) -> str:
    """``1234 '▁the'``: a token id and its text in the GGUF's vocabulary."""
    return f"{tid} {pieces[tid]!r}" if 0 <= tid < len(pieces) else f"{tid} (not in the vocabulary)"


def token_difference(text: str, want: list[int], got: list[int], pieces: list[str], context: int = 3) -> str:
    """One line naming where two tokenizations of ``text`` part and the tokens each side has there.

    Example: ``tokens differ for 'Emoji 🦙🚀 …' at token 4: transformers [12 '▁a', 40 'b'], GGUF [77 '▁ab']``.
    """
    first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))

    def window(ids: list[int]) -> str:
        shown = ", ".join(_token(t, pieces) for t in ids[first:first + context])
        more = ", ..." if len(ids) > first + context else ""
        return f"[{shown}{more}]" if shown else "[] (ends here)"

    return (f"tokens differ for {text[:30]!r} at token {first} ({len(want)} vs {len(got)} tokens): "
            f"transformers {window(want)}, GGUF {window(got)}")


#: What to try when the logits disagree.
LOGITS_HINT = ("try --outtype f32: if it passes, a tensor is rounded wrongly; if not, a tensor is mapped or "
               "permuted wrongly (report it with config.json and `ggufkit convert --dry-run --json`)")


def _token_hint(vocab_kind: Any, pre: Any, model_dir: Path) -> str:
    """What to try when the tokens differ, for the vocabulary's kind (tokenizer.ggml.model)."""
    if vocab_kind == "gpt2":
        return (f"the pre-tokenizer splits text differently: try --pre-tokenizer NAME with the name llama.cpp "
                f"gives this model family (tokenizer.ggml.pre is {pre!r})")
    if vocab_kind == "llama" and not (model_dir / "tokenizer.model").is_file():
        return ("llama.cpp reads a Llama tokenizer.json without tokenizer.model with scores that merge in "
                "another order: try adding the model's tokenizer.model (sentencepiece) beside it")
    return ("try the model's own tokenizer files: tokenizer.model, tokenizer.json, added_tokens.json and "
            "tokenizer_config.json must agree")


def _compare(model_dir: Path, hf_tok: Any, reference: Any, converted: Any, gguf: str | Path) -> CheckResult:
    import torch

    from ggufkit.format import open_gguf
    from ggufkit.tokenizer.gguf_tokenizer import load_tokenizer

    failures: list[str] = []
    encode_ref, parse_special = _reference_tokenizer(model_dir, hf_tok)
    compared = 0
    with open_gguf(gguf) as model:
        gguf_tok = load_tokenizer(model)
        pieces = [str(t) for t in (model.get("tokenizer.ggml.tokens") or [])]
        vocab_kind, pre = model.get("tokenizer.ggml.model"), model.get("tokenizer.ggml.pre")
        for text in CHECK_TEXTS:
            want = encode_ref(text)
            got = gguf_tok.encode(text, add_special=True, parse_special=parse_special)
            compared += len(want)
            if want != got:
                failures.append(token_difference(text, want, got, pieces) + "; "
                                + _token_hint(vocab_kind, pre, model_dir))
    max_abs = max_ref = 0.0
    agree = total = 0
    finite = True
    first_top1_miss = ""
    for text in LOGIT_TEXTS:
        ids = torch.tensor([list(hf_tok(text)["input_ids"])[:64]])
        with torch.no_grad():
            want_logits = reference(ids).logits[0].float()
        got_logits = converted.logits(ids.to(converted.device))[0].float().cpu()
        if not (bool(torch.isfinite(got_logits).all()) and bool(torch.isfinite(want_logits).all())):
            finite = False
            continue
        max_abs = max(max_abs, float((got_logits - want_logits).abs().max()))
        max_ref = max(max_ref, float(want_logits.abs().max()))
        same = got_logits.argmax(-1) == want_logits.argmax(-1)
        agree += int(same.sum())
        if not first_top1_miss and not bool(same.all()):
            pos = int((~same).nonzero()[0, 0])
            first_top1_miss = (f"first at token {pos} of {text[:30]!r}, transformers predicts "
                               f"{_token(int(want_logits[pos].argmax()), pieces)}, the GGUF "
                               f"{_token(int(got_logits[pos].argmax()), pieces)}")
        total += ids.shape[1]
    rel = max_abs / max(max_ref, 1e-12)
    top1 = agree / max(total, 1)
    if not finite:
        failures.append("the GGUF's logits are not finite (weights overflowing the outtype, e.g. f16?); "
                        "try --outtype bf16 or f32")
    elif rel > TOLERANCE[0]:
        failures.append(f"logits differ by {max_abs:.4g} ({rel:.2%} of the largest logit; the check allows "
                        f"{TOLERANCE[0]:.2%} against transformers running the same rounded weights); {LOGITS_HINT}")
    if finite and top1 < TOLERANCE[1]:
        failures.append(f"top-1 agrees at {top1:.1%} of positions (the check needs {TOLERANCE[1]:.0%}): "
                        f"{first_top1_miss or 'no position compared'}; {LOGITS_HINT}")
    return CheckResult(FAILED if failures else PASSED, None, failures, compared, max_abs, rel, top1, TOLERANCE)
