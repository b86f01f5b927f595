"""Pure tensor math of folding: no modules, usable on checkpoint tensors one at a time.

Each computes in ``weight_math_dtype(t)`` and casts back to the input dtype.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..ops import centering
from ..ops.centering import check_centering


def weight_math_dtype(t: Tensor) -> torch.dtype:
    """The dtype the fold's weight math runs in: float64 for float32/float64 storage (results
    correctly rounded to float32); float32 for 16-bit storage, whose rounding (≥ 2⁻¹¹ relative)
    dwarfs float32's 2⁻²⁴, at half the memory traffic and a fraction of the time on checkpoints of
    billions of half-precision weights. (The norm ops' "compute dtype", ``normfold.ops.reference``,
    is another thing: float32 for 16-bit and float32 inputs.)"""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else torch.float64


def center(t: Tensor, dim: int, group: int | None = None) -> Tensor:
    """t − mean(t) along ``dim``, the mean taken per contiguous ``group`` elements (None: whole dim).

    For a linear weight W (out, in) and dim=0 this is W ← (I − 11ᵀ/m)·W: every output is then
    zero-mean over the outputs, whatever the input. Detached, in ``weight_math_dtype(t)``
    (``normfold.ops.centering.center`` is the differentiable one in t's dtype).
    """
    dim = check_centering(t, dim, group)
    return centering.center(t.detach().to(weight_math_dtype(t)), dim, group).to(t.dtype)


def center_groups(t: Tensor, dim: int, group: int, groups) -> Tensor:
    """``t`` with the groups numbered ``groups`` (of ``group`` contiguous elements along ``dim``)
    centered as :func:`center` centers them, and every other element as it was.

    For a fused QKV weight (3·H·D, in) viewed as (H, 3, D) per output, the q and k rows of each head
    are the groups h·3 + 0 and h·3 + 1 of D rows: centering them makes q and k zero-mean per head and
    leaves v untouched.
    """
    dim = check_centering(t, dim, group)
    count = t.shape[dim] // group if group else 0
    picked = sorted(set(groups))
    if group is None or not picked or picked[0] < 0 or picked[-1] >= count:
        raise ValueError(f"groups must be numbers in [0, {count}) of groups of {group!r} elements along dim {dim}, "
                         f"got {list(groups)!r:.80}")
    rows = (torch.tensor(picked, device=t.device)[:, None] * group + torch.arange(group, device=t.device)).reshape(-1)
    out = t.detach().clone()
    out.index_copy_(dim, rows, center(t.detach().index_select(dim, rows), dim, group))
    return out


def fold_affine_into_consumer(weight: Tensor, bias: Tensor | None, gamma: Tensor | None, beta: Tensor | None,
                              in_dim: int, *, gamma_offset: float = 0.0) -> tuple[Tensor, Tensor | None]:
    """Move a norm's affine (γ, β) into the linear map that reads the norm's output.

    y = W·(γ⊙x̂ + β) + b = (W·diag(γ))·x̂ + (b + W·β). ``in_dim`` is the axis of the 2-D ``weight``
    that meets the norm's features: 1 for ``nn.Linear`` (out, in), 0 for (in, out) layouts such as
    Hugging Face's Conv1D. Returns (W', b'); b' is None only when bias and β are both None.
    ``gamma_offset``: the norm scales by (gamma_offset + γ) (Gemma's 1 + w), added in the math dtype.
    """
    if weight.dim() != 2 or in_dim not in (0, 1):
        raise ValueError(f"weight must be 2-D and in_dim 0 or 1, got {weight.dim()}-D and in_dim={in_dim}")
    n_in, n_out = weight.shape[in_dim], weight.shape[1 - in_dim]
    for name, v in (("gamma", gamma), ("beta", beta)):
        if v is not None and v.shape != (n_in,):
            raise ValueError(f"{name} must have shape ({n_in},) to match the weight's input dim, got {tuple(v.shape)}")
    if bias is not None and bias.shape != (n_out,):
        raise ValueError(f"bias must have shape ({n_out},), got {tuple(bias.shape)}")
    dtype = weight_math_dtype(weight)
    w = weight.detach().to(dtype)
    w_io = w if in_dim == 0 else w.t()  # (in, out)
    new_b = None if bias is None else bias.detach().to(dtype)
    if beta is not None:
        shift = beta.detach().to(dtype) @ w_io  # βᵀW: (out,)
        new_b = shift if new_b is None else new_b + shift
    if gamma is not None:
        w_io = w_io * (gamma.detach().to(dtype) + gamma_offset)[:, None]  # diag(c + γ)·W in (in, out) layout
    new_w = w_io if in_dim == 0 else w_io.t()
    out_dtype = bias.dtype if bias is not None else weight.dtype
    return new_w.to(weight.dtype).contiguous(), None if new_b is None else new_b.to(out_dtype)


def layer_norm_rows(table: Tensor, gamma: Tensor | None, beta: Tensor | None, eps: float) -> Tensor:
    """LayerNorm of every row of an embedding table: LN(W)[idx] = LN(W[idx]), so a norm applied
    right after a lookup can be precomputed into the table."""
    dtype = weight_math_dtype(table)
    x = table.detach().to(dtype)
    centered = x - x.mean(-1, keepdim=True)
    y = centered * torch.rsqrt(centered.square().mean(-1, keepdim=True) + eps)
    if gamma is not None:
        y = y * gamma.detach().to(dtype)
    if beta is not None:
        y = y + beta.detach().to(dtype)
    return y.to(table.dtype)


def fold_batchnorm_into_producer(weight: Tensor, bias: Tensor | None, running_mean: Tensor, running_var: Tensor,
                                 gamma: Tensor | None, beta: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """(W', b') with W'x + b' = BN_eval(Wx + b), output channels on dim 0 of ``weight``.

    BN_eval(y) = γ·(y − μ)/sqrt(σ² + ε) + β = s·y + (β − s·μ) with s = γ/sqrt(σ² + ε), so
    W' = diag(s)·W and b' = s·(b − μ) + β (b = 0 when the producer has none).
    """
    n_out = weight.shape[0]
    for name, v in (("running_mean", running_mean), ("running_var", running_var), ("gamma", gamma),
                    ("beta", beta), ("bias", bias)):
        if v is not None and v.shape != (n_out,):
            raise ValueError(f"{name} must have shape ({n_out},) to match the weight's output channels, "
                             f"got {tuple(v.shape)}")
    dtype = weight_math_dtype(weight)
    scale = torch.rsqrt(running_var.detach().to(dtype) + eps)
    if gamma is not None:
        scale = scale * gamma.detach().to(dtype)
    b = torch.zeros(n_out, dtype=dtype, device=weight.device) if bias is None else bias.detach().to(dtype)
    new_bias = (b - running_mean.detach().to(dtype)) * scale
    if beta is not None:
        new_bias = new_bias + beta.detach().to(dtype)
    new_weight = weight.detach().to(dtype) * scale.reshape(-1, *([1] * (weight.dim() - 1)))
    out_dtype = bias.dtype if bias is not None else weight.dtype
    return new_weight.to(weight.dtype), new_bias.to(out_dtype)


def scale_output_channels(weight: Tensor, bias: Tensor | None, scale: Tensor) -> tuple[Tensor, Tensor | None]:
    """(W', b') with W'x + b' = γ ⊙ (Wx + b): a layer scale γ merged into the Linear/Conv before it.

    Output channels are on dim 0 of ``weight``, so W' = diag(γ)·W (each output row or filter
    scaled) and b' = γ ⊙ b; ``scale`` holds one value per output channel, in any shape that
    broadcasts over them ((C,) after a Linear, (C, 1, 1) after a Conv2d).
    """
    n_out = weight.shape[0]
    if scale.numel() != n_out:
        raise ValueError(f"scale must hold one value per output channel ({n_out}), got shape {tuple(scale.shape)}")
    if bias is not None and bias.shape != (n_out,):
        raise ValueError(f"bias must have shape ({n_out},), got {tuple(bias.shape)}")
    dtype = weight_math_dtype(weight)
    gamma = scale.detach().to(dtype).reshape(n_out)
    new_weight = weight.detach().to(dtype) * gamma.reshape(-1, *([1] * (weight.dim() - 1)))
    new_bias = None if bias is None else (bias.detach().to(dtype) * gamma).to(bias.dtype)
    return new_weight.to(weight.dtype), new_bias


def identity_batchnorm_variance(eps: float, dtype: torch.dtype) -> float | None:
    """The running variance σ² = 1 − eps that makes an eval BatchNorm (γ=1, β=0, μ=0) exactly the
    identity when stored in ``dtype``, or None when it cannot be exact there.

    BN(x) = x / sqrt(σ² + eps) is x only if σ² + eps rounds to exactly 1 in the precision the
    kernel adds in (float32 for 32- and 16-bit storage, float64 for float64); 1 − eps rounded to
    float16/bfloat16 is 1 for common eps, so the sum is 1 + eps there and such folders are refused.
    """
    add_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    stored = torch.tensor(1.0 - eps, dtype=dtype).to(add_dtype)
    return 1.0 - eps if bool(stored + torch.tensor(eps, dtype=add_dtype) == 1) else None


def mean_over_rms(rows: Tensor) -> Tensor:
    """|μ| / RMS of every row (last dim), in float64: 0 where a LayerNorm and an RMSNorm agree.

    RMS(x)² = σ² + μ², so LN(x) = RMSNorm(x) exactly when μ = 0; the ratio measures how far an
    RMSNorm's input is from that. All-zero rows count as 0 (RMS clamped to the smallest normal).
    """
    x = rows.detach().double()
    rms = x.square().mean(-1).sqrt().clamp_min(torch.finfo(torch.float64).tiny)
    return x.mean(-1).abs() / rms
