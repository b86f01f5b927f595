"""The trainer: ``compile`` trains the same model through torch.compile; gradient accumulation takes the step of
the whole batch; CBWC's centered weights are computed once per optimizer step and once per evaluation."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from normfold.cli import main
from normfold.nn import RMSNorm
from normfold.train import resolve_config, train
from normfold.train.cbwc import Centered
from normfold.train.data import TokenSplits, encode, load_text
from normfold.train.trainer import build_model, estimate_val_loss, make_optimizer, train_step

TINY = dict(n_layer=2, n_head=2, n_embd=16, block_size=16)


def _losses(tmp_path, name, **values):
    config = resolve_config(**TINY, max_steps=3, batch_size=2, eval_interval=3, eval_iters=1, progress=False,
                            save_checkpoint=False, out_dir=str(tmp_path / name), **values)
    return train(config)["train_losses"]


@pytest.mark.parametrize("norm", ["cbwc_rmsnorm", "rmsnorm"])
def test_compile_trains_through_torch_compile_with_the_eager_losses(tmp_path, monkeypatch, norm):
    compiled = []
    real_compile = torch.compile

    def aot_eager_compile(model, **kwargs):  # Inductor's C++ build takes a minute; the graph is the same
        compiled.append(model)
        return real_compile(model, backend="aot_eager", **kwargs)

    monkeypatch.setattr(torch, "compile", aot_eager_compile)
    eager = _losses(tmp_path, "eager", norm=norm)
    assert not compiled  # off by default
    with_compile = _losses(tmp_path, "compiled", norm=norm, compile=True)
    assert len(compiled) == 1
    torch.testing.assert_close(with_compile, eager, rtol=1e-5, atol=0)


@pytest.mark.parametrize("argv, expected", [([], False), (["--compile"], True), (["--compile=false"], False),
                                            (["--compile", "true"], True)])
def test_compile_is_a_flag_on_the_command_line(capsys, argv, expected):
    assert main(["train", *argv, "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["compile"] is expected


def test_evaluation_centers_each_cbwc_weight_once_not_once_per_batch(monkeypatch):
    config = resolve_config(**TINY, norm="cbwc_rmsnorm", batch_size=2, eval_iters=3)
    model = build_model(config)
    centered = sum(isinstance(m, Centered) for m in model.modules())
    calls = []
    forward = Centered.forward
    monkeypatch.setattr(Centered, "forward", lambda self, w: calls.append(1) or forward(self, w))
    splits = TokenSplits(encode(load_text([])), config.model.block_size, config.val_fraction)
    loss = estimate_val_loss(model, splits, config, torch.device("cpu"))
    assert centered == 10 and len(calls) == centered  # 30 before: every batch recomputed every V
    assert loss > 0


@pytest.mark.parametrize("norm", ["layernorm", "cbwc_rmsnorm"])
def test_accumulating_equal_micro_batches_takes_the_step_of_their_concatenation(norm):
    # no clipping: it would hide a gradient off by a factor (and AdamW nearly does too), so gradients are compared
    config = resolve_config(**TINY, norm=norm, precision="fp64", weight_decay=0.1, grad_clip=0.0)
    whole, split = build_model(config), build_model(config)  # same seed: same weights
    x = torch.randint(256, (4, 16), generator=torch.Generator().manual_seed(1))
    loss_whole = train_step(whole, make_optimizer(whole, config), [(x, x)], config)
    loss_split = train_step(split, make_optimizer(split, config), [(x[:2], x[:2]), (x[2:], x[2:])], config)
    torch.testing.assert_close(loss_split, loss_whole, rtol=1e-12, atol=0)
    for (name, a), b in zip(whole.named_parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-15, msg=name)
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-15, msg=name)


def test_a_training_step_centers_each_cbwc_weight_once_for_all_micro_batches(monkeypatch):
    config = resolve_config(**TINY, norm="cbwc_rmsnorm", batch_size=2)
    model = build_model(config)
    centered = []  # what Centered.center was applied to: W (forward) or a gradient (backward, per micro-batch)
    center = Centered.center
    monkeypatch.setattr(Centered, "center", lambda self, t: centered.append(isinstance(t, nn.Parameter)) or center(self, t))
    x = torch.randint(256, (2, 16))
    train_step(model, make_optimizer(model, config), [(x, x)] * 3, config)
    assert sum(centered) == sum(isinstance(m, Centered) for m in model.modules()) == 10  # each W once, not 3×
    assert len(centered) - sum(centered) == 3 * 10  # each micro-batch's gradient through P
    assert all(p.grad is not None for p in model.parameters())


def test_grad_accum_steps_must_be_a_positive_int():
    with pytest.raises(ValueError, match="grad_accum_steps must be a positive int, got 0"):
        resolve_config(grad_accum_steps=0)


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich"])
def test_normfold_norms_take_the_residual_add_into_their_kernel_and_compute_the_same_function(placement, monkeypatch):
    from normfold.train import model as model_module

    config = resolve_config(n_layer=2, n_head=2, n_embd=16, block_size=8, norm="rmsnorm", placement=placement,
                            precision="fp64", seed=5, progress=False)
    gpt = build_model(config)
    x = torch.randint(256, (2, 8), generator=torch.Generator().manual_seed(0))
    fused = []  # which norm calls received the residual add (the fused route) in training mode
    for m in gpt.modules():
        if isinstance(m, RMSNorm):
            m.register_forward_pre_hook(lambda m, args, kwargs: fused.append("residual" in kwargs), with_kwargs=True)
    loss = gpt(x, x)[1]
    grads = torch.autograd.grad(loss, list(gpt.parameters()))
    # every add a norm reads: post 2 per block; pre/sandwich 2 per block, less block 0's ln_1 (no add), plus ln_f
    assert sum(fused) == 2 * config.model.n_layer
    gpt.eval()  # eval mode adds first: the fold and rotation engines trace plain adds and norms
    fused.clear()
    torch.testing.assert_close(gpt(x, x)[1], loss, rtol=1e-13, atol=0)
    assert fused and not any(fused)
    gpt.train()

    def unfused(norm, branch, stream):  # what any other norm gets: the add first
        s = stream if branch is None else stream + branch
        return s, norm(s)

    monkeypatch.setattr(model_module, "add_norm", unfused)
    plain_loss = gpt(x, x)[1]
    torch.testing.assert_close(loss, plain_loss, rtol=1e-13, atol=0)
    for a, b in zip(grads, torch.autograd.grad(plain_loss, list(gpt.parameters()))):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)


def test_the_fused_residual_add_stays_in_the_kernel_under_bf16_autocast(monkeypatch):
    """Under autocast a block's branch is bf16 and the stream float32: the norm must still take its kernel (the
    pure-PyTorch reference, which mixed dtypes would fall back to, costs several passes)."""
    from normfold.ops import _cpu, _reference_backend

    if _cpu.load() is None:
        pytest.skip("the C++ kernel is not built on this machine")
    config = resolve_config(n_layer=2, n_head=2, n_embd=16, block_size=8, norm="rmsnorm", seed=5, progress=False)
    gpt = build_model(config)
    x = torch.randint(256, (2, 8), generator=torch.Generator().manual_seed(0))
    reference_calls = []
    original = _reference_backend.norm_fwd
    monkeypatch.setattr(_reference_backend, "norm_fwd",
                        lambda *args, **kwargs: reference_calls.append(args[0].dtype) or original(*args, **kwargs))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = gpt(x, x)[1]
    loss.backward()
    assert reference_calls == []
    assert torch.isfinite(loss) and all(p.grad is not None for p in gpt.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the same loss as the add done first (to bf16 rounding)
        gpt.eval()
        torch.testing.assert_close(gpt(x, x)[1], loss.detach(), rtol=2e-2, atol=0)
