"""The Mamba2 mixer as llama.cpp computes it for one sequence from an empty state, in float32: Granite 4
(``granitehybrid``), Nemotron-H and Falcon-H1 share it (``llm_build_mamba_base::build_mamba2_layer``,
src/models/mamba-base.cpp).

The layer, on the normed stream ``h`` ``[B, T, n_embd]``:

1. ``zxBCdt = ssm_in · h`` (a matmul llama-imatrix collects), split into the gate ``z`` ``[d_inner]``, the
   convolved part ``xBC`` ``[d_inner + 2 * n_group * d_state]`` and ``dt`` ``[n_head]``, in that order;
2. ``xBC = silu(ssm_conv(xBC) + conv bias)`` (``ggml_ssm_conv``: :func:`ggufkit.eval.layers_conv.causal_conv1d`),
   then split into ``x`` ``[n_head, head_dim]``, ``B`` and ``C`` ``[n_group, d_state]``;
3. the selective scan (``ggml_ssm_scan``, ggml/src/ggml-cpu/ops.cpp ggml_compute_forward_ssm_scan_f32, the
   Mamba-2 branch: one scalar decay per head): ``dt' = softplus(dt + dt_bias)``,
   ``s_t = s_{t-1} * exp(dt'_t * A) + B_t x_t dt'_t`` and ``y_t = s_t · C_t``, head ``h`` reading group
   ``h // (n_head / n_group)``; :func:`ssm_scan` computes the same sums chunked over time (the state-space
   duality form: quadratic inside a chunk, the state carried between chunks), which sums in another order
   than ggml's token loop (float32 differences of a few ulp per step, not a different model);
4. ``y = (y + x * D) * silu(z)`` (``ggml_swiglu_split``), RMS-normed per group with ``ssm_norm`` (when the file
   has it), and ``ssm_out · y`` (a matmul llama-imatrix collects).

``A`` is stored as ``-exp(A_log)`` by llama.cpp's converter (Mamba2Model.modify_tensors), ``ssm_a`` and
``ssm_d`` as ``{1, n_head}`` (numpy ``[n_head, 1]``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ggufkit.errors import EvaluationError, MetadataKeyNotFoundError, MetadataValueError
from ggufkit.eval.layers_conv import causal_conv1d

if TYPE_CHECKING:
    from ggufkit.eval.model import GGUFCausalLM
    from ggufkit.format.reader import GGUFModel

#: Tokens per chunk of :func:`ssm_scan` (the quadratic part's side; longer sequences carry the state).
SCAN_CHUNK = 128


@dataclass(frozen=True)
class Mamba2Dims:
    """A Mamba2 mixer's sizes (llama_hparams ``ssm_*``; the ``{arch}.ssm.*`` keys)."""

    d_conv: int  #: ``ssm.conv_kernel``
    d_inner: int  #: ``ssm.inner_size``
    d_state: int  #: ``ssm.state_size``
    n_head: int  #: ``ssm.time_step_rank`` (Mamba2's head count)
    n_group: int  #: ``ssm.group_count``

    @property
    def head_dim(self) -> int:
        return self.d_inner // self.n_head

    @property
    def conv_channels(self) -> int:
        """Channels of ``xBC``, the convolved part: ``d_inner + 2 * n_group * d_state``."""
        return self.d_inner + 2 * self.n_group * self.d_state

    @property
    def d_in_proj(self) -> int:
        """Rows of ``ssm_in``: ``z``, ``xBC`` and ``dt``."""
        return self.d_inner + self.conv_channels + self.n_head


def read_mamba2(file: GGUFModel, arch: str) -> Mamba2Dims:
    """The ``{arch}.ssm.*`` keys of a file (all required, as the loaders of granitehybrid / nemotron_h /
    falcon-h1 read them).

    Raises:
        MetadataKeyNotFoundError, MetadataValueError: a key is missing or not a positive integer.
        EvaluationError: sizes llama.cpp's graph cannot split (``d_inner`` not a multiple of the heads or groups,
            heads not a multiple of the groups).
    """
    d = Mamba2Dims(*(positive_int(file, f"{arch}.ssm.{k}") for k in
                     ("conv_kernel", "inner_size", "state_size", "time_step_rank", "group_count")))
    if d.d_inner % d.n_head or d.d_inner % d.n_group or d.n_head % d.n_group:
        raise EvaluationError(f"SSM inner size {d.d_inner}, {d.n_head} heads and {d.n_group} groups do not divide "
                              f"evenly", path=file.path)
    return d


def positive_int(file: GGUFModel, name: str) -> int:
    """A required positive integer key (as :func:`ggufkit.eval.arch.key`, which a family module cannot import:
    arch imports the families)."""
    field = file.kv.get(name)
    if field is None:
        raise MetadataKeyNotFoundError(name, path=file.path, hint="the evaluator needs it")
    value = field.value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer() or value <= 0:
        raise MetadataValueError(f"expected a positive integer, got {value!r}", key=name, path=file.path)
    return int(value)


def mamba2_shapes(d: Mamba2Dims, n_embd: int, b: str, names: set[str]) -> dict[str, tuple[int, ...]]:
    """numpy-order shapes of block ``b``'s mixer tensors (``ssm_conv1d.bias`` and ``ssm_norm`` when present,
    as the loaders' TENSOR_NOT_REQUIRED)."""
    out: dict[str, tuple[int, ...]] = {
        b + "ssm_in.weight": (d.d_in_proj, n_embd),
        b + "ssm_conv1d.weight": (d.conv_channels, d.d_conv),
        b + "ssm_dt.bias": (d.n_head,),
        b + "ssm_a": (d.n_head, 1),
        b + "ssm_d": (d.n_head, 1),
        b + "ssm_out.weight": (n_embd, d.d_inner),
    }
    if b + "ssm_conv1d.bias" in names:
        out[b + "ssm_conv1d.bias"] = (d.conv_channels,)
    if b + "ssm_norm.weight" in names:
        out[b + "ssm_norm.weight"] = (d.n_group, d.d_inner // d.n_group)
    return out


def softplus(x: torch.Tensor) -> torch.Tensor:
    """ggml_compute_softplus_f32 (ggml/src/ggml-impl.h): ``x`` above 20, else ``log(1 + exp(x))`` (torch's
    fused softplus: ``log1p(exp(x))``, the same value within a float32 ulp)."""
    return F.softplus(x, beta=1.0, threshold=20.0)


@functools.cache
def _masks(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[s, l]`` masks of a chunk (made once per size and device): ``l > s`` (bool), ``l >= s`` (float32), and
    the float32 1 that :func:`ssm_scan` fills the rest of its decay matrix with."""
    upper = torch.ones(size, size, dtype=torch.bool, device=device).triu()
    return upper.triu(1), upper.to(torch.float32), torch.ones((), device=device)


def ssm_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             chunk: int = SCAN_CHUNK, d: torch.Tensor | None = None) -> torch.Tensor:
    """The Mamba-2 selective scan of ``ggml_ssm_scan`` from a zero state, chunked over time.

    Args:
        x: ``float32[B, T, n_head, head_dim]`` (any strides).
        dt: ``float32[B, T, n_head]``, the time step with its bias added, before the softplus.
        a: ``float32[n_head]`` (``ssm_a``: ``-exp(A_log)``).
        b, c: ``float32[B, T, n_group, d_state]``; head ``h`` reads group ``h // (n_head / n_group)``.
        chunk: tokens per chunk.
        d: ``float32[n_head]`` (``ssm_d``): when given, ``x * D`` is added to the result (the graph's
            ``ggml_add(y, ggml_mul(x, ssm_d))``).

    Returns:
        ``float32[B, T, n_head, head_dim]``:
        ``y_t = sum_{s <= t} (prod_{s < k <= t} exp(dt'_k A)) (C_t · B_s) dt'_s x_s`` (``+ D x_t``).

    The decays are products of the steps' ``exp(dt' A)``, as ggml's loop multiplies the state by each step's
    decay (a running product per chunk: no exp of long sums, and no slow exp of the sums that underflow).
    Inside a chunk the sums are one batched matmul per head of the decay-weighted ``C_l · B_s`` with
    ``dt' x``; between chunks the state at each chunk's end (heads as columns: one matmul per chunk and
    group) is carried, and read by the next chunk's ``C``.
    """
    bsz, t, nh, hd = x.shape
    ng, ns = b.shape[2], b.shape[3]
    r = nh // ng
    size = max(1, min(chunk, t))
    pad = (-t) % size  # zero steps at the end: no input, decay 1; their outputs are dropped
    nc = (t + pad) // size
    dts = softplus(dt)  # [B, T, H]
    # dt' x with the heads before the time axis ([B, H, T', P]: the intra-chunk matmul's batches)
    xdt = (x.new_zeros if pad else x.new_empty)(bsz, nh, t + pad, hd)
    torch.mul(x.transpose(1, 2), dts.transpose(1, 2).unsqueeze(-1), out=xdt[:, :, :t])
    step = torch.exp(dts * a.reshape(1, 1, nh)).transpose(1, 2)  # [B, H, T]: each step's decay
    if pad:
        step = F.pad(step, (0, pad), value=1.0)
        b = F.pad(b, (0, 0, 0, 0, 0, pad))
        c = F.pad(c, (0, 0, 0, 0, 0, pad))
    step = step.reshape(bsz, nh, nc, size)
    strict, upper, one = _masks(size, x.device)
    # decay[..., s, l] = prod_{s < k <= l} step_k, 1 where l <= s: [B, H, c, L, L], made and used in place
    decay = x.new_empty(bsz, nh, nc, size, size)
    torch.where(strict, step.unsqueeze(-2), one, out=decay).cumprod_(-1)
    # C_l · B_s of each chunk and group, 0 where l < s: [B, c, G, S, L]
    bm = b.reshape(bsz, nc, size, ng, ns).transpose(2, 3)
    cm = c.reshape(bsz, nc, size, ng, ns).transpose(2, 3)
    cb = torch.matmul(bm, cm.transpose(-1, -2)).mul_(upper)
    to_end = decay[:, :, :-1, :, -1].clone() if nc > 1 else None  # [B, H, c-1, S]: decay from s to the end
    decay.view(bsz, ng, r, nc, size, size).mul_(cb.permute(0, 2, 1, 3, 4).unsqueeze(2))
    y = torch.bmm(decay.view(-1, size, size).transpose(1, 2), xdt.view(-1, size, hd)).view(bsz, nh, nc * size, hd)
    del decay
    out = x.new_empty(bsz, nc * size, nh, hd)
    if nc == 1:
        out.copy_(y.transpose(1, 2))
    else:
        assert to_end is not None
        # the state each chunk but the last leaves at its end, heads as columns: [B, c-1, G, R * P, N]
        xs = xdt.view(bsz, nh, nc, size, hd)[:, :, :-1] * to_end.unsqueeze(-1)  # [B, H, c-1, L, P]
        xs = xs.view(bsz, ng, r, nc - 1, size, hd).permute(0, 3, 1, 4, 2, 5).reshape(bsz, nc - 1, ng, size, r * hd)
        states = torch.matmul(xs.transpose(-1, -2), bm[:, :-1])
        from_start = torch.cumprod(step, dim=-1)  # [B, H, c, L]: decay from the chunk's start to l
        total = from_start[:, :, :-1, -1].reshape(bsz, ng, r, nc - 1).permute(0, 3, 1, 2)  # [B, c-1, G, R]
        carried = states.view(bsz, nc - 1, ng, r, hd, ns)
        for i in range(1, nc - 1):  # the state entering chunk i + 1: its own plus the one carried in, decayed
            carried[:, i].add_(carried[:, i - 1] * total[:, i, :, :, None, None])
        # chunks 1 .. c-1 read the state carried in (C_l · state), decayed from the chunk's start to l
        yi = torch.matmul(cm[:, 1:], states.transpose(-1, -2))  # [B, c-1, G, L, R * P]
        yi = yi.view(bsz, nc - 1, ng, size, r, hd).transpose(2, 3).reshape(bsz, (nc - 1) * size, nh, hd)
        decayed = from_start[:, :, 1:].reshape(bsz, nh, (nc - 1) * size).transpose(1, 2).unsqueeze(-1)
        out[:, :size].copy_(y[:, :, :size].transpose(1, 2))
        torch.addcmul(y[:, :, size:].transpose(1, 2), yi, decayed, out=out[:, size:])
    out = out[:, :t]
    if d is not None:
        out.addcmul_(x, d.reshape(1, 1, nh, 1))
    return out


def gated_group_norm(y: torch.Tensor, z: torch.Tensor, w: torch.Tensor | None, n_group: int,
                     eps: float) -> torch.Tensor:
    """``y * silu(z)`` (``ggml_swiglu_split(z, y)``), then RMS-normed over each group's ``d_inner / n_group``
    channels and times ``w`` (numpy ``[n_group, d_inner / n_group]``) when given; ``[B, T, d_inner]``."""
    g = F.silu(z).mul_(y)  # silu(z) * y, the same product
    if w is None:
        return g
    shape = g.shape
    g = F.rms_norm(g.reshape(*shape[:-1], n_group, shape[-1] // n_group), (shape[-1] // n_group,), None, eps)
    return g.mul_(w.reshape(n_group, -1)).view(shape)  # x / sqrt(mean(x^2) + eps), then * w, as ggml_rms_norm


def mamba2_mixer(model: GGUFCausalLM, h: torch.Tensor, p: str, d: Mamba2Dims) -> torch.Tensor:
    """Block ``p``'s Mamba2 mixer on the normed stream ``h`` ``float32[B, T, n_embd]`` from an empty state,
    ``ssm_out`` included: ``float32[B, T, n_embd]``. The observer sees the inputs of ``ssm_in`` and
    ``ssm_out`` (llama-imatrix's two matmuls of the layer; ``ssm_conv1d`` is no matmul)."""
    bsz, t, _ = h.shape
    model.observe(h, p + "ssm_in.weight")
    zxbcdt = model.linear(h, model.weight(p + "ssm_in.weight"))
    z, xbc, dt = zxbcdt.split([d.d_inner, d.conv_channels, d.n_head], dim=-1)
    xbc = F.silu(causal_conv1d(xbc, model.weight(p + "ssm_conv1d.weight"), model.optional_weight(p + "ssm_conv1d.bias")))
    x, bm, cm = xbc.split([d.d_inner, d.n_group * d.d_state, d.n_group * d.d_state], dim=-1)
    x = x.reshape(bsz, t, d.n_head, d.head_dim)
    y = ssm_scan(x, dt + model.weight(p + "ssm_dt.bias"), model.weight(p + "ssm_a").reshape(-1),
                 bm.reshape(bsz, t, d.n_group, d.d_state), cm.reshape(bsz, t, d.n_group, d.d_state),
                 d=model.weight(p + "ssm_d").reshape(-1))
    y = gated_group_norm(y.reshape(bsz, t, d.d_inner), z, model.optional_weight(p + "ssm_norm.weight"),
                         d.n_group, model.hparams.eps)
    model.observe(y, p + "ssm_out.weight")
    return model.linear(y, model.weight(p + "ssm_out.weight"))


def ssm_scan_reference(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       c: torch.Tensor) -> torch.Tensor:
    """:func:`ssm_scan` token by token, as ggml's loop computes it (for tests; slow)."""
    bsz, t, nh, hd = x.shape
    ng, ns = b.shape[2], b.shape[3]
    grp = torch.arange(nh, device=x.device) // (nh // ng)
    s = x.new_zeros(bsz, nh, hd, ns)
    out = []
    for i in range(t):
        dts = softplus(dt[:, i])  # [B, H]
        da = torch.exp(dts * a)
        bt, ct = b[:, i, grp], c[:, i, grp]  # [B, H, N]
        s = s * da[..., None, None] + bt[:, :, None, :] * (x[:, i] * dts[..., None])[..., None]
        out.append((s * ct[:, :, None, :]).sum(-1))
    return torch.stack(out, dim=1)
