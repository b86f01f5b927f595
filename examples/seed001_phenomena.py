"""Seed 001's normalization phenomena, measured on the CPU, each asserting its claim.

    python examples/seed001_phenomena.py

Every ``demo_*`` function measures one phenomenon, asserts what the seed claims about it and
returns the numbers it measured; ``tests/lab/test_seed001_phenomena.py`` runs each one.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from normfold.nn import RMSNorm
from normfold.ops.reference import layer_norm_ref, rms_norm_ref


def demo_activation_decay(seed: int = 0) -> list[float]:
    """Std of the activations after each ReLU of a default-initialised 784→256→256→256 MLP.

    Setup that reproduces the seed's 0.34 → 0.14 → 0.06 exactly: ``torch.manual_seed(seed)``,
    then build the model (default ``nn.Linear`` init, W ~ U(−1/√n, 1/√n)), then draw the
    input x ~ N(0, 1) of shape (64, 784). The order matters: the model consumes the generator
    first. Each layer keeps E[h²] at about 1/3 of its input's (the U(−1/√n, 1/√n) variance is
    1/(3n)) and ReLU halves it again, so the std falls by roughly √6 ≈ 2.4 per layer.
    """
    torch.manual_seed(seed)
    mlp = nn.Sequential(
        nn.Linear(784, 256), nn.ReLU(),
        nn.Linear(256, 256), nn.ReLU(),
        nn.Linear(256, 256), nn.ReLU(),
    )
    h = torch.randn(64, 784)  # (B, 784)
    stds = []
    with torch.no_grad():
        for layer in mlp:
            h = layer(h)
            if isinstance(layer, nn.ReLU):
                stds.append(h.std().item())
    if seed == 0:  # the seed's printed numbers, to two decimals
        assert [round(s, 2) for s in stds] == [0.34, 0.14, 0.06], stds
    ratios = [a / b for a, b in zip(stds, stds[1:])]
    assert all(2.0 < r < 3.0 for r in ratios), f"expected a decay of ~2.4x per layer, got {ratios}"
    return stds


def demo_batch_mean_noise(batch_sizes=(2, 8, 32, 128), trials: int = 200, features: int = 256,
                          seed: int = 0) -> dict[int, float]:
    """Spread of a per-feature batch mean across fresh N(0, 1) batches: σ/√B (seed: 0.71 … 0.09).

    This is the noise in BatchNorm's normalization point; the normalized *output* always has
    std ≈ 1 by construction, so measuring it would show nothing.
    """
    torch.manual_seed(seed)
    spread = {}
    for b in batch_sizes:
        means = torch.stack([torch.randn(b, features).mean(0) for _ in range(trials)])  # (trials, F)
        spread[b] = means.std(0).mean().item()
    for b, s in spread.items():
        assert abs(s - 1 / math.sqrt(b)) < 0.1 / math.sqrt(b), f"B={b}: {s:.3f} vs 1/√B={1 / math.sqrt(b):.3f}"
    if tuple(batch_sizes) == (2, 8, 32, 128) and seed == 0:
        assert [round(s, 2) for s in spread.values()] == [0.71, 0.35, 0.18, 0.09], spread
    return spread


def demo_batchnorm_batch_of_one(seed: int = 0) -> dict[str, float]:
    """BatchNorm in train mode at batch 1 normalizes with statistics of that one sample; eval mode
    uses the running statistics and fixes it.

    With one value per channel the batch variance is 0 and the numerator x − μ_B is 0, so the
    output is β whatever the input. PyTorch refuses exactly that shape in train mode
    (``ValueError``), so the collapse is shown on a batch holding one sample twice (same
    statistics, no guard). BatchNorm2d at batch 1 with H·W > 1 runs silently: it turns into an
    InstanceNorm and erases each channel's mean, so two images that differ by a per-channel
    offset give the same output.
    """
    torch.manual_seed(seed)
    bn = nn.BatchNorm2d(16)
    with torch.no_grad():
        bn.bias.uniform_(-1, 1)
        for _ in range(20):  # fill the running statistics from ordinary batches
            bn(torch.randn(32, 16, 4, 4) * 2 + 0.5)
        x = torch.randn(1, 16, 1, 1)  # (1, C, 1, 1): one value per channel
        x_other = torch.randn(1, 16, 1, 1)
        collapsed = bn(torch.cat([x, x]))[0].flatten()  # one sample's statistics
        collapsed_other = bn(torch.cat([x_other, x_other]))[0].flatten()
        gap_to_beta = max((collapsed - bn.bias).abs().max().item(), (collapsed_other - bn.bias).abs().max().item())

        image = torch.randn(1, 16, 4, 4)
        shifted = image + torch.randn(1, 16, 1, 1)  # per-channel brightness offset
        train_spread = (bn(image) - bn(shifted)).abs().max().item()
        bn.eval()
        eval_spread = (bn(image) - bn(shifted)).abs().max().item()
        eval_one_value = (bn(x) - bn(x_other)).abs().max().item()
    assert gap_to_beta < 1e-4, f"one sample's statistics must collapse the output to beta: {gap_to_beta}"
    assert train_spread < 1e-5, f"train mode at batch 1 must erase per-channel offsets: {train_spread}"
    assert eval_spread > 0.1 and eval_one_value > 0.1, "eval mode must depend on the input"
    bn.train()
    for one_value_per_channel in (torch.randn(1, 16), torch.randn(1, 16, 1, 1)):
        refused = False
        try:
            (nn.BatchNorm1d(16) if one_value_per_channel.dim() == 2 else bn)(one_value_per_channel)
        except ValueError:
            refused = True
        assert refused, "PyTorch must refuse one value per channel in train mode"
    return {"train_gap_to_beta": gap_to_beta, "train_offset_effect": train_spread, "eval_offset_effect": eval_spread}


def _batch_dependence(norm: nn.Module, sample: torch.Tensor, others: torch.Tensor) -> float:
    """max |norm(sample alone) − norm(sample inside a batch)| over the sample's outputs."""
    with torch.no_grad():
        alone = norm(sample)
        together = norm(torch.cat([sample, others]))[: sample.shape[0]]
    return (alone - together).abs().max().item()


def demo_batch_independence(seed: int = 0) -> dict[str, float]:
    """GroupNorm, LayerNorm and RMSNorm give a sample the same output whatever batch it is in;
    BatchNorm (train mode) does not."""
    torch.manual_seed(seed)
    images, other_images = torch.randn(2, 32, 8, 8), torch.randn(30, 32, 8, 8) * 3 + 1  # (B, C, H, W)
    tokens, other_tokens = torch.randn(2, 10, 64), torch.randn(30, 10, 64) * 3 + 1  # (B, T, C)
    dependence = {
        "GroupNorm": _batch_dependence(nn.GroupNorm(8, 32), images, other_images),
        "LayerNorm": _batch_dependence(nn.LayerNorm(64), tokens, other_tokens),
        "RMSNorm": _batch_dependence(RMSNorm(64), tokens, other_tokens),
        "BatchNorm2d (train)": _batch_dependence(nn.BatchNorm2d(32).train(), images, other_images),
    }
    for name in ("GroupNorm", "LayerNorm", "RMSNorm"):
        assert dependence[name] < 1e-5, f"{name} depends on the batch: {dependence[name]}"
    assert dependence["BatchNorm2d (train)"] > 0.1, "BatchNorm in train mode must depend on the batch"
    return dependence


def demo_rmsnorm_invariances(seed: int = 0) -> dict[str, float]:
    """RMSNorm(a·x) = RMSNorm(x) for a > 0 (re-scaling invariance) but RMSNorm(x + c) ≠ RMSNorm(x)
    (no re-centering invariance); LayerNorm has both.

    Checked in float64 with eps = 1e-30, so eps does not blur the identities.
    """
    torch.manual_seed(seed)
    eps = 1e-30
    x = torch.randn(8, 64, dtype=torch.float64)  # (B, C)
    rms = RMSNorm(64, eps=eps, dtype=torch.float64)
    with torch.no_grad():
        rms.weight.uniform_(0.5, 1.5)
        ln_weight = rms.weight.detach().clone()
    scale, shift = 7.5, 2.0
    with torch.no_grad():
        err = {
            "rms_scale": (rms(scale * x) - rms(x)).abs().max().item(),
            "rms_shift": (rms(x + shift) - rms(x)).abs().max().item(),
            "ln_scale": (layer_norm_ref(scale * x, ln_weight, eps=eps) - layer_norm_ref(x, ln_weight, eps=eps)).abs().max().item(),
            "ln_shift": (layer_norm_ref(x + shift, ln_weight, eps=eps) - layer_norm_ref(x, ln_weight, eps=eps)).abs().max().item(),
        }
        same_function = torch.equal(rms(x), rms_norm_ref(x, rms.weight, eps=eps))
    assert same_function, "normfold.nn.RMSNorm must compute rms_norm_ref"
    assert max(err["rms_scale"], err["ln_scale"], err["ln_shift"]) < 1e-12, err
    assert err["rms_shift"] > 0.1, f"RMSNorm must not be shift invariant: {err['rms_shift']}"
    return err


DEMOS = (demo_activation_decay, demo_batch_mean_noise, demo_batchnorm_batch_of_one,
         demo_batch_independence, demo_rmsnorm_invariances)


def main() -> None:
    for demo in DEMOS:
        result = demo()
        shown = [f"{v:.3g}" for v in result] if isinstance(result, list) else {k: f"{v:.3g}" for k, v in result.items()}
        print(f"{demo.__name__:30s} ok  {shown}")


if __name__ == "__main__":
    main()
