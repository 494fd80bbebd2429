"""What the evaluator knows about each GGUF architecture: one traits table, and the hyperparameters of a file.

An architecture runs when :data:`ARCH_TRAITS` has a row for its ``general.architecture``; the forward pass
(:mod:`ggufkit.eval.model`) reads only :class:`HParams`, never the architecture's name. A row states what
llama.cpp's graph for that architecture does (src/models/<arch>.cpp in llama.cpp) and transformers' class
agrees with; a file's keys fill in the numbers. An architecture without a row is "cannot evaluate ARCH".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggufkit.converters import cohere2, gemma, smollm3
from ggufkit.errors import EvaluationError, MetadataKeyNotFoundError, MetadataValueError
from ggufkit.eval import shapes
from ggufkit.eval.families import FORWARDS
from ggufkit.eval.rope import Yarn, read_yarn
from ggufkit.format.reader import GGUFModel


@dataclass(frozen=True)
class ArchTraits:
    """How one GGUF architecture computes (llama.cpp's graph for it).

    Attributes:
        norm: ``rms`` (RMSNorm) or ``layer`` (LayerNorm with bias).
        norm_bias: a ``layer`` norm has a bias (False: Cohere's LayerNorm without one).
        shared_norm: with ``parallel_residual``, the FFN reads the attention's input norm (no ``ffn_norm``;
            Cohere 2).
        rope_swa_only: only the sliding-window layers apply RoPE, the global ones none (Cohere 2).
        logit_scale: the logits are multiplied by the file's ``{arch}.logit_scale`` (a required key).
        rope: ``norm`` (adjacent pairs; the converter permuted Q/K rows), ``neox`` (split halves), ``none``.
        ffn: ``silu`` (SiLU-gated), ``silu_fused`` (``ffn_up`` holds [gate; up], Phi-3), ``gelu_tanh``
            (GELU-tanh-gated), ``gelu`` (exact erf GELU, ungated), ``relu`` (``relu(gate)*up``, or
            ``relu(up)`` when ungated), ``relu_sym`` (``relu(gate)*relu(up)``).
        powerinfer_ffn: the FFN PowerInfer's sparse graph computes for a PWRI file of this arch (None: same).
        post_norm: no norm before attention and the FFN: an RMSNorm of each one's output
            (``post_attention_norm``, ``post_ffw_norm``) before it joins the residual (OLMo 2).
        qk_norm_whole: ``attn_q_norm`` / ``attn_k_norm`` normalise the whole q and k projections
            (``[n_head * head_dim]``, ``[n_head_kv * head_dim]``) before they are split into heads (OLMo 2),
            not each head (Qwen 3).
        parallel_residual: default of ``{arch}.use_parallel_residual`` (None: never parallel, key ignored).
        eps_default: RMS epsilon when the file has no key (None: the key is required).
        eps_fallback_key: another epsilon key older converters wrote instead (Qwen 1's LayerNorm key).
        learned_positions: ``position_embd`` read at ``pos + 2`` (OPT), and the head always tied to the
            embedding.
        moe_norm_topk: a MoE file's top-k expert weights are renormalised to sum to one (llama.cpp's
            ``norm_w`` argument of build_moe_ffn for this arch).
        embd_scale: embeddings multiplied by ``sqrt(n_embd)`` (Gemma).
        gemma_27b_layers: when set, queries are scaled by ``1/sqrt(head_dim)``, or by ``1/sqrt(n_embd/n_head)``
            with this many layers (llama.cpp's Gemma "27B" type), whatever query_pre_attn_scalar said.
        swa_pattern: with a ``{arch}.attention.sliding_window`` key, layer ``il`` uses the window when
            ``il % swa_pattern < swa_pattern - 1`` (0: no sliding-window layers).
        swa_default: the window when the file has no key (gemma2's loader default).
        swa_rope_base: rope base of the sliding-window layers when the file has no ``rope.freq_base_swa``
            key (None: the file's ``rope.freq_base``, as gemma2's loader copies it; gemma3's keeps
            llama_hparams' default 10000).
        swa_rope_unscaled: the sliding-window layers ignore the file's rope scaling (gemma3's loader leaves
            ``rope_freq_scale_train_swa`` at 1; gemma2's copies the global scale).
        softcap_keys: read ``{arch}.attn_logit_softcapping`` / ``final_logit_softcapping``.
        no_rope_step: layer ``il`` skips RoPE when ``(il + 1) % no_rope_step == 0`` (llama.cpp's
            ``n_no_rope_layer_step``, which its loader fixes per architecture; 0: every layer ropes).
        granite: Granite's multipliers: the optional ``{arch}.attention.scale`` scales the queries, the
            optional ``{arch}.logit_scale`` divides the logits, and RoPE only when the optional
            ``{arch}.rope.scaling.finetuned`` is true (granite-hybrid.cpp load_arch_hparams and graph).
        yarn: the evaluator's rope for this architecture takes YaRN scaling (False: its M-RoPE in
            eval/family_qwen35.py does not carry it yet; such a file is refused in one line).
        yarn_log_mul: the loader reads ``rope.scaling.yarn_log_multiplier`` (deepseek2.cpp load_arch_hparams).
    """

    norm: str = "rms"
    norm_bias: bool = True
    shared_norm: bool = False
    rope_swa_only: bool = False
    logit_scale: bool = False
    rope: str = "neox"
    ffn: str = "silu"
    powerinfer_ffn: str | None = None
    post_norm: bool = False
    qk_norm_whole: bool = False
    parallel_residual: bool | None = None
    eps_default: float | None = None
    eps_fallback_key: str | None = None
    learned_positions: bool = False
    moe_norm_topk: bool = False
    embd_scale: bool = False
    gemma_27b_layers: int = 0
    swa_pattern: int = 0
    swa_default: int = 0
    swa_rope_base: float | None = None
    swa_rope_unscaled: bool = False
    softcap_keys: bool = False
    no_rope_step: int = 0
    granite: bool = False
    yarn: bool = True
    yarn_log_mul: bool = False


#: src/models/gemma2.cpp / gemma3.cpp (load_arch_hparams and the graph): GELU-tanh gated FFN, sandwich norms,
#: scaled embeddings; the "27B" layer counts and the sliding-window period are converters/gemma.py's.
_GEMMA = {"ffn": "gelu_tanh", "embd_scale": True, "softcap_keys": True}

#: GGUF architecture -> traits. A new LLaMA-like architecture is a row here (and none if it writes ``llama``).
ARCH_TRAITS: dict[str, ArchTraits] = {
    # src/models/qwen35.cpp: gated delta-net and gated full-attention layers (eval/family_qwen35.py), RMSNorm,
    # NEOX-style (interleaved M-RoPE) rope, dense SiLU-gated FFN.
    "qwen35": ArchTraits(yarn=False),
    # src/models/qwen3next.cpp / qwen35moe.cpp: Qwen3.5's layers (qwen35moe) or Qwen3-Next's (grouped value heads,
    # fused beta/alpha, NEOX rope; eval/family_qwen3next.py) with a softmax MoE, renormalised top-k weights and a
    # sigmoid-gated shared expert.
    "qwen35moe": ArchTraits(moe_norm_topk=True, yarn=False),
    "qwen3next": ArchTraits(moe_norm_topk=True, yarn=False),
    # src/models/llama.cpp: RMSNorm, NORM rope, SiLU-gated FFN; Mixtral's experts renormalised.
    "llama": ArchTraits(rope="norm", powerinfer_ffn="relu", moe_norm_topk=True),
    # PowerInfer's bamboo graph: relu(gate) * relu(up); no eps key in its files.
    "bamboo": ArchTraits(rope="norm", ffn="relu_sym", eps_default=1e-5),
    "qwen2": ArchTraits(),
    "qwen3": ArchTraits(),
    "qwen": ArchTraits(eps_fallback_key="attention.layer_norm_epsilon"),
    "gptneox": ArchTraits(norm="layer", ffn="gelu", parallel_residual=True),
    "opt": ArchTraits(norm="layer", rope="none", ffn="relu", learned_positions=True),
    # src/models/qwen2moe.cpp: top-k weights as they are, plus a sigmoid-gated shared expert.
    "qwen2moe": ArchTraits(),
    # src/models/qwen3moe.cpp: top-k weights always renormalised; per-head q/k norms as qwen3.
    "qwen3moe": ArchTraits(moe_norm_topk=True),
    # src/models/phi3.cpp: fused attn_qkv, ffn_up = [gate; up] (LLM_FFN_SWIGLU), NEOX rope.
    "phi3": ArchTraits(ffn="silu_fused"),
    # src/models/olmo2.cpp: post-norm blocks, RMS q/k norms over the whole projections, NEOX rope, SiLU-gated
    # FFN (llama_model_rope_type: LLM_ARCH_OLMO2 is NEOX; its sliding-window form is Olmo 3's).
    "olmo2": ArchTraits(post_norm=True, qk_norm_whole=True),
    "gemma2": ArchTraits(**_GEMMA, gemma_27b_layers=gemma.LAYERS_27B["gemma2"],  # type: ignore[arg-type]
                         swa_pattern=gemma.SWA_PATTERN["gemma2"], swa_default=4096),
    "gemma3": ArchTraits(**_GEMMA, gemma_27b_layers=gemma.LAYERS_27B["gemma3"],  # type: ignore[arg-type]
                         swa_pattern=gemma.SWA_PATTERN["gemma3"], swa_rope_base=10000.0, swa_rope_unscaled=True),
    # src/models/gemma3n.cpp: AltUp streams, LAuReL, per-layer inputs, KV sharing, sparse FFNs
    # (eval/family_gemma3n.py); tanh-GELU FFN, scaled embeddings, the per-layer sliding-window array, the final
    # soft-cap key (30, which the converter enforces), NEOX rope.
    "gemma3n": ArchTraits(ffn="gelu_tanh", embd_scale=True, softcap_keys=True, swa_pattern=5,
                          swa_rope_base=10000.0, swa_rope_unscaled=True),
    # src/models/smollm3.cpp: llama's graph (NORM rope, the converter permuted Q/K), but no RoPE on every 4th
    # layer, a step its loader fixes (converters/smollm3.py NO_ROPE_STEP, which the converter enforces).
    "smollm3": ArchTraits(rope="norm", no_rope_step=smollm3.NO_ROPE_STEP),
    # src/models/cohere2.cpp: one LayerNorm without bias feeds attention and the SiLU-gated FFN in parallel,
    # NORM rope on the sliding-window layers only (every 4th layer global, converters/cohere2.py), the
    # sliding layers' rope base the global one's (load_arch_hparams), logits times f_logit_scale.
    "cohere2": ArchTraits(norm="layer", norm_bias=False, shared_norm=True, rope_swa_only=True, logit_scale=True,
                          rope="norm", parallel_residual=True, swa_pattern=cohere2.SWA_PATTERN),
    # src/models/granite-hybrid.cpp: Mamba2 and attention layers by the per-layer KV head count (0: Mamba2),
    # the Mamba2 mixer, embedding and residual multipliers in eval/family_granite_hybrid.py; softmax MoE with
    # renormalised top-k and an ungated shared expert, or a dense SiLU FFN.
    "granitehybrid": ArchTraits(rope="norm", moe_norm_topk=True, granite=True),
    # src/models/nemotron-h.cpp / nemotron-h-moe.cpp: Mamba2, attention (no RoPE) or squared-ReLU FFN / sigmoid-routed
    # MoE layers (eval/family_nemotron_h.py); RMS epsilon falls back to layer_norm_epsilon (load_arch_hparams).
    "nemotron_h": ArchTraits(rope="none", ffn="relu", eps_fallback_key="attention.layer_norm_epsilon"),
    "nemotron_h_moe": ArchTraits(rope="none", ffn="relu", eps_fallback_key="attention.layer_norm_epsilon"),
    # src/models/lfm2.cpp / lfm2moe.cpp: short-convolution and attention layers by the per-layer KV head count
    # (0: short convolution), per-head q/k RMS norms, NEOX rope, SiLU-gated FFN; LFM2-MoE's sigmoid router with
    # its selection bias and renormalised top-k, and token_embd_norm as the output norm (eval/family_lfm2.py).
    "lfm2": ArchTraits(),
    "lfm2moe": ArchTraits(moe_norm_topk=True),
    # src/models/falcon-h1.cpp: attention (NEOX rope) and a Mamba2 mixer side by side in every block, then a
    # SiLU-gated FFN (eval/family_falcon_h1.py); the muP multipliers are folded into the weights by the converter.
    "falcon-h1": ArchTraits(),
    # src/models/ernie4-5.cpp / ernie4-5-moe.cpp: LLaMA's block with NORM rope (transformers' Ernie rotates adjacent
    # pairs; Q/K as stored), an optional attn_output bias; the MoE's dense lead layers, softmax router with the
    # selection bias, renormalised top-k and ungated shared expert in eval/family_ernie.py.
    "ernie4_5": ArchTraits(rope="norm"),
    "ernie4_5-moe": ArchTraits(rope="norm", moe_norm_topk=True),
    # src/models/openai-moe.cpp: biased attention with sinks and YaRN NEOX rope, sliding window on even layers,
    # biased softmax-weighted router and clamped-SwiGLU experts with biases (eval/family_gpt_oss.py).
    "gpt-oss": ArchTraits(),
    # src/models/llama4.cpp: NORM rope (transformers' complex RoPE, no converter permutation) with llama3 rope_freqs,
    # NoPE every 4th layer with temperature-tuned queries, L2 q/k norms and chunked attention on the others, dense
    # SiLU FFN or sigmoid-routed experts weighted at their input plus a shared expert (eval/family_llama4.py).
    "llama4": ArchTraits(rope="norm", no_rope_step=4),
    # src/models/glm4-moe.cpp: q/k/v biases, per-head q/k RMS norms, NEOX rope over part of each head, the
    # post-attention norm before a dense SiLU FFN or the grouped, biased router's experts plus an ungated shared
    # expert; the NextN blocks are not run (eval/family_glm4moe.py).
    "glm4moe": ArchTraits(),
    # src/models/deepseek2.cpp: MLA in the absorbed form with its own NORM rope on the rope dims (eval/layers_mla.py;
    # Q/K rows as stored, no permutation), dense lead layers, softmax/sigmoid grouped router with the correction
    # bias, routed scaling and ungated shared experts (eval/family_deepseek2.py).
    "deepseek2": ArchTraits(yarn_log_mul=True),
}
#: Architectures the evaluator runs.
SUPPORTED_ARCHS = tuple(ARCH_TRAITS)


@dataclass(frozen=True)
class HParams:
    """What the forward pass needs, read from ``<arch>.*`` keys and tensor shapes."""

    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    #: the rope factor (``rope.scaling.factor``): frequencies divided by it, linearly or through YaRN
    rope_scale: float
    rope_mode: str  # "norm" (adjacent pairs), "neox" (split halves) or "none"
    norm: str  # "rms" or "layer"
    eps: float
    parallel_residual: bool
    ffn: str  # "silu", "gelu", "relu" (relu(gate)*up or relu(up) when ungated), "relu_sym"
    powerinfer: bool
    learned_positions: bool = False
    post_norm: bool = False
    qk_norm_whole: bool = False
    n_expert: int = 0
    n_expert_used: int = 0
    moe_norm_topk: bool = False
    embd_scale: bool = False
    attn_scale: float | None = None
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    n_swa: int = 0
    swa_layers: tuple[bool, ...] = ()
    rope_base_swa: float = 10000.0
    rope_scale_swa: float = 1.0
    no_rope_step: int = 0
    norm_bias: bool = True
    shared_norm: bool = False
    rope_swa_only: bool = False
    logit_scale: float = 0.0
    #: multi-token-prediction (NextN) blocks after the trunk (``nextn_predict_layers``): loaded by llama.cpp as
    #: extra blocks, never run by the main pass (llama_hparams::n_layer() = n_layer_all - n_layer_nextn)
    n_nextn: int = 0
    #: YaRN rope scaling (``rope.scaling.type`` yarn; :mod:`ggufkit.eval.rope`), None without it
    yarn: Yarn | None = None
    #: A recurrent or hybrid family's own hyperparameters (its FamilyForward's ``read``; empty otherwise).
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def n_trunk(self) -> int:
        """The blocks the forward pass runs: all but the MTP blocks (the graphs' ``n_layer`` loops)."""
        return self.n_layer - self.n_nextn

    def is_swa(self, il: int) -> bool:
        """Layer ``il`` attends through the sliding window (llama_hparams::is_swa)."""
        return self.n_swa > 0 and il < len(self.swa_layers) and self.swa_layers[il]

    def uses_rope(self, il: int) -> bool:
        """Layer ``il`` rotates Q and K (``use_rope`` of llama.cpp's smollm3 / llama4 graphs)."""
        if self.rope_swa_only and not self.is_swa(il):  # cohere2: the global layers have no RoPE
            return False
        return self.no_rope_step == 0 or (il + 1) % self.no_rope_step != 0


def traits_for(arch: str, path: Any = None) -> ArchTraits:
    """The traits of ``arch``.

    Raises:
        EvaluationError: "cannot evaluate ARCH" when the table has no row for it.
    """
    traits = ARCH_TRAITS.get(arch)
    if traits is None:
        raise EvaluationError(f"cannot evaluate {arch!r}: the evaluator has no traits for this architecture "
                              f"(it runs: {', '.join(SUPPORTED_ARCHS)})", path=path)
    return traits


def key(model: GGUFModel, name: str, kind: type, default: Any = None) -> Any:
    """A numeric key of ``kind`` (positive when int), or ``default`` when absent (None: required)."""
    field = model.kv.get(name)
    if field is None:
        if default is None:
            raise MetadataKeyNotFoundError(name, path=model.path, hint="the evaluator needs it")
        return default
    value = field.value
    if (kind is int and isinstance(value, bool)) or not isinstance(value, (int, float, bool)):
        raise MetadataValueError(f"expected a {kind.__name__}, got {field.type_label}", key=name, path=model.path)
    if kind is int and (not float(value).is_integer() or value <= 0):
        raise MetadataValueError(f"expected a positive integer, got {value}", key=name, path=model.path)
    return kind(value)


def read_hparams(model: GGUFModel) -> HParams:
    """Hyperparameters from the GGUF keys (and the vocabulary size from ``token_embd``).

    Raises:
        EvaluationError: unsupported architecture or rope scaling.
        MetadataKeyNotFoundError, MetadataValueError: a needed key is missing or malformed.
    """
    a = model.architecture or ""
    tr = traits_for(a, model.path)
    embd = model["token_embd.weight"]
    if embd.n_dims != 2:
        raise EvaluationError(f"token_embd.weight has {embd.n_dims} dimensions, expected 2", path=model.path)
    n_embd = key(model, f"{a}.embedding_length", int, embd.ne[0])
    n_head = key(model, f"{a}.attention.head_count", int)
    if n_embd % n_head and f"{a}.attention.key_length" not in model.kv:  # GLM-4.5: 5120 over 96 heads of 128
        raise EvaluationError(f"embedding length {n_embd} is not a multiple of the head count {n_head}",
                              path=model.path)
    head_dim = key(model, f"{a}.attention.key_length", int, n_embd // n_head)
    n_head_kv = _largest_per_layer(model, f"{a}.attention.head_count_kv", n_head)
    if n_head % n_head_kv:
        raise EvaluationError(f"head count {n_head} is not a multiple of the KV head count {n_head_kv}",
                              path=model.path)
    n_rot = key(model, f"{a}.rope.dimension_count", int, head_dim)
    if n_rot > head_dim or n_rot % 2:
        raise EvaluationError(f"rope dimension count {n_rot} does not fit the head size {head_dim}", path=model.path)
    scaling = model.get(f"{a}.rope.scaling.type", "none")
    rope_scale = 1.0
    yarn = None
    if scaling == "linear":
        rope_scale = key(model, f"{a}.rope.scaling.factor", float, 1.0)
    elif scaling == "yarn":
        if not tr.yarn:
            raise EvaluationError(f"rope scaling 'yarn' is not supported by the evaluator for {a} (its M-RoPE)",
                                  path=model.path)
        yarn = read_yarn(model, a, log_mul_key=tr.yarn_log_mul)
        rope_scale = yarn.factor
    elif f"{a}.rope.scale_linear" in model.kv:
        rope_scale = key(model, f"{a}.rope.scale_linear", float)
    elif scaling not in ("none", ""):
        raise EvaluationError(f"rope scaling {scaling!r} is not supported by the evaluator", path=model.path)
    if tr.norm == "layer":
        eps = key(model, f"{a}.attention.layer_norm_epsilon", float, 1e-5)
    elif tr.eps_fallback_key is not None and f"{a}.attention.layer_norm_rms_epsilon" not in model.kv:
        eps = key(model, f"{a}.{tr.eps_fallback_key}", float)
    else:
        eps = key(model, f"{a}.attention.layer_norm_rms_epsilon", float, tr.eps_default)
    ffn = tr.powerinfer_ffn if model.is_powerinfer and tr.powerinfer_ffn else tr.ffn
    parallel = False if tr.parallel_residual is None else \
        bool(model.get(f"{a}.use_parallel_residual", tr.parallel_residual))
    # Granite 4 Micro: expert_count 0 (dense; llama_model_loader reads it as no experts)
    dense = tr.granite and model.get(f"{a}.expert_count") == 0
    n_expert = key(model, f"{a}.expert_count", int, 0) if f"{a}.expert_count" in model.kv and not dense else 0
    n_expert_used = key(model, f"{a}.expert_used_count", int) if n_expert else 0
    if n_expert_used > n_expert:
        raise EvaluationError(f"{n_expert_used} experts used of {n_expert}", path=model.path)
    n_layer = key(model, f"{a}.block_count", int)
    n_nextn = key(model, f"{a}.nextn_predict_layers", int, 0)
    if not 0 <= n_nextn < n_layer:
        raise MetadataValueError(f"{n_nextn} MTP layers of {n_layer} blocks", key=f"{a}.nextn_predict_layers",
                                 path=model.path)
    attn_scale = None
    if tr.gemma_27b_layers:
        attn_scale = 1.0 / math.sqrt(gemma.query_scale_dim(n_layer, tr.gemma_27b_layers, n_embd, n_head, head_dim))
    n_swa = 0
    swa_layers: tuple[bool, ...] = ()
    if tr.swa_pattern:
        n_swa = int(model.get(f"{a}.attention.sliding_window", tr.swa_default) or 0)
        swa_layers = _swa_layers(model, a, n_layer, tr.swa_pattern)
    rope_base = key(model, f"{a}.rope.freq_base", float, 10000.0)
    rope_base_swa = key(model, f"{a}.rope.freq_base_swa", float,
                        rope_base if tr.swa_rope_base is None else tr.swa_rope_base)
    logit_scale = key(model, f"{a}.logit_scale", float) if tr.logit_scale else 0.0
    rope_mode = tr.rope
    if tr.granite:  # ggml_scale(logits, 1.0f / f_logit_scale), in float32; 0 (absent): no scaling
        attn_scale = key(model, f"{a}.attention.scale", float, 0.0) or None
        divisor = np.float32(key(model, f"{a}.logit_scale", float, 0.0))
        logit_scale = float(np.float32(1.0) / divisor) if divisor else 0.0
        if not model.get(f"{a}.rope.scaling.finetuned", True):
            rope_mode = "none"
    softcap = (key(model, f"{a}.attn_logit_softcapping", float, 0.0) if tr.softcap_keys else 0.0,
               key(model, f"{a}.final_logit_softcapping", float, 0.0) if tr.softcap_keys else 0.0)
    return HParams(arch=a, n_vocab=embd.ne[1], n_embd=n_embd, n_layer=n_layer,
                   n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_rot=n_rot,
                   rope_base=rope_base, rope_scale=rope_scale,
                   rope_mode=rope_mode, norm=tr.norm, eps=eps, parallel_residual=parallel, ffn=ffn,
                   powerinfer=model.is_powerinfer, learned_positions=tr.learned_positions,
                   post_norm=tr.post_norm, qk_norm_whole=tr.qk_norm_whole, n_expert=n_expert,
                   n_expert_used=n_expert_used, moe_norm_topk=tr.moe_norm_topk, embd_scale=tr.embd_scale,
                   attn_scale=attn_scale, attn_softcap=softcap[0], final_softcap=softcap[1], n_swa=n_swa,
                   swa_layers=swa_layers, rope_base_swa=rope_base_swa,
                   rope_scale_swa=1.0 if tr.swa_rope_unscaled else rope_scale, no_rope_step=tr.no_rope_step,
                   norm_bias=tr.norm_bias, shared_norm=tr.shared_norm, rope_swa_only=tr.rope_swa_only,
                   logit_scale=logit_scale, n_nextn=n_nextn, yarn=yarn,
                   extra=FORWARDS[a].read(model, a, n_layer) if a in FORWARDS else {})


def _largest_per_layer(model: GGUFModel, name: str, default: int) -> int:
    """An integer key that hybrid models write per layer (``head_count_kv``: 0 on recurrent layers): its
    largest entry when it is an array, else :func:`key`'s value."""
    field = model.kv.get(name)
    if field is not None and isinstance(field.value, (list, tuple, np.ndarray)):
        values = [int(v) for v in field.value]
        if not values or max(values) <= 0 or min(values) < 0:
            raise MetadataValueError(f"expected non-negative integers, one above 0, got {values}", key=name,
                                     path=model.path)
        return max(values)
    return int(key(model, name, int, default))


def _swa_layers(model: GGUFModel, a: str, n_layer: int, default_pattern: int) -> tuple[bool, ...]:
    """Which layers use the sliding window: ``{arch}.attention.sliding_window_pattern`` as a per-layer bool
    array or a period, else the architecture's period (llama_model_base::load_swa_pattern; with a period,
    :func:`ggufkit.converters.gemma.is_sliding`, llama_hparams::set_swa_pattern)."""
    field = model.kv.get(f"{a}.attention.sliding_window_pattern")
    if field is not None and isinstance(field.value, (list, tuple, np.ndarray)):
        flags = [bool(x) for x in field.value]
        if len(flags) != n_layer:
            raise MetadataValueError(f"{len(flags)} entries for {n_layer} layers",
                                     key=f"{a}.attention.sliding_window_pattern", path=model.path)
        return tuple(flags)
    n = key(model, f"{a}.attention.sliding_window_pattern", int, default_pattern)
    return tuple(gemma.is_sliding(il, n) for il in range(n_layer))


def expected_shapes(hp: HParams, names: set[str]) -> dict[str, tuple[int, ...]]:
    """numpy-order shape of every tensor the forward pass reads (optional ones only when present): the
    family's own table when it has a :class:`ggufkit.eval.family_forward.FamilyForward`, else the
    transformer's (:mod:`ggufkit.eval.shapes`)."""
    family = FORWARDS.get(hp.arch)
    if family is not None:
        return family.shapes(hp, names)
    return shapes.transformer_shapes(hp, names)
