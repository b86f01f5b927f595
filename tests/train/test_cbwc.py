"""CBWC: a LayerNorm model and its centered-RMSNorm twin compute and train identically."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.utils import parametrize

import normfold
from normfold.cli import EXIT_OK, EXIT_USAGE, main
from normfold.engine.math import center
from normfold.engine.plan import AffineFoldStep, CenterStep, FoldPlan, SwapStep
from normfold.engine.report import FoldReport
from normfold.nn import RMSNorm
from normfold.train import GPT, GPTConfig, resolve_config, train
from normfold.train.cbwc import Centered, PartialCBWCError, bake_, cbwc_, project_centering_
from normfold.train.trainer import build_model, make_optimizer, train_step

from tiny_models import tiny_gpt2

TINY = dict(n_layer=2, n_head=2, n_embd=16, block_size=16)


def _pair(dtype=torch.float64, **config):
    """A LayerNorm GPT and its CBWC twin from the same weights."""
    torch.manual_seed(0)
    ln = GPT(GPTConfig(**{**TINY, **config})).to(dtype)
    twin = copy.deepcopy(ln)
    report = cbwc_(twin, (torch.zeros(1, 8, dtype=torch.long),))
    return ln, twin, report


def _rel_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), data=st.data())
def test_centered_parametrization_matches_fold_math_center(shape, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    size = shape[dim]
    group = data.draw(st.sampled_from([None] + [g for g in range(1, size + 1) if size % g == 0]))
    w = torch.randn(*shape, dtype=torch.float64)
    torch.testing.assert_close(Centered(dim, group)(w), center(w, dim, group), rtol=0, atol=1e-12)


def test_gradient_flows_through_the_centering_projection():
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 3, dtype=torch.float64)
    (Centered(0)(w) * g).sum().backward()
    torch.testing.assert_close(w.grad, g - g.mean(0, keepdim=True))  # Pᵀg = Pg: P is symmetric


def test_cbwc_swaps_foldable_layernorms_and_keeps_the_function():
    ln, twin, report = _pair()
    assert report.num_foldable == 5
    norms = [twin.transformer.h[0].ln_1, twin.transformer.h[1].ln_2, twin.transformer.ln_f]
    assert all(isinstance(n, RMSNorm) and n.bias is not None for n in norms)
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in twin.modules())
    idx = torch.randint(256, (3, 16))
    torch.testing.assert_close(twin(idx)[0], ln(idx)[0], rtol=1e-12, atol=1e-12)


def test_centered_producers_write_a_zero_mean_residual_stream():
    _, twin, _ = _pair()
    seen = []  # the final norm adds the last block's branch to the stream inside its kernel: its input is the sum
    twin.transformer.ln_f.register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[0] + kwargs["residual"]),
                                                    with_kwargs=True)
    twin(torch.randint(256, (2, 16)))
    stream = seen[0]
    assert stream.mean(-1).abs().max() < 1e-15 * stream.abs().max() * 100


def test_tied_head_keeps_the_uncentered_table_through_one_parameter():
    ln, twin, _ = _pair()
    table = twin.transformer.wte.parametrizations.weight.original
    assert twin.lm_head.weight is table  # still tied: one Parameter, both gradients
    torch.testing.assert_close(table, ln.transformer.wte.weight, rtol=0, atol=0)
    torch.testing.assert_close(twin.transformer.wte.weight, center(table, 1), rtol=0, atol=1e-15)


def test_gradients_equal_the_layernorm_models_and_are_zero_mean_along_the_centered_dim():
    ln, twin, _ = _pair()
    idx = torch.randint(256, (2, 16))
    ln(idx, idx)[1].backward()
    twin(idx, idx)[1].backward()
    free = dict(twin.named_parameters())
    for name, p in ln.named_parameters():
        twin_name = name.replace("c_proj.weight", "c_proj.parametrizations.weight.original").replace(
            "c_proj.bias", "c_proj.parametrizations.bias.original").replace(
            "wte.weight", "wte.parametrizations.weight.original").replace(
            "wpe.weight", "wpe.parametrizations.weight.original")
        torch.testing.assert_close(free[twin_name].grad, p.grad, rtol=1e-10, atol=1e-14)
    proj = twin.transformer.h[0].mlp.c_proj.parametrizations.weight.original
    assert proj.grad.mean(0).abs().max() < 1e-15  # ∂L/∂W = P·(∂L/∂V): no component along 1


# float64: measured 5.6e-16 over 100 steps, so 1e-10 leaves room for reordering yet catches a 1e-8 bug
@pytest.mark.parametrize("precision, steps, bound, accum", [("fp64", 100, 1e-10, 1), ("fp32", 50, 1e-3, 1),
                                                            ("fp64", 100, 1e-10, 2)])
def test_training_losses_match_the_layernorm_model_at_every_step_with_adamw_weight_decay_and_clipping(
        tmp_path, precision, steps, bound, accum):
    runs = {}
    for norm in ("layernorm", "cbwc_rmsnorm"):
        config = resolve_config(**TINY, norm=norm, precision=precision, max_steps=steps, batch_size=2, lr=3e-3,
                                grad_accum_steps=accum,
                                min_lr=3e-4, warmup_steps=5, weight_decay=0.1, grad_clip=0.1, eval_interval=steps,
                                eval_iters=1, out_dir=str(tmp_path / norm), progress=False, save_checkpoint=False)
        runs[norm] = train(config)["train_losses"]
    assert runs["layernorm"][-1] < runs["layernorm"][0] - 0.5  # it trained, so the comparison is not vacuous
    assert _rel_gap(runs["layernorm"], runs["cbwc_rmsnorm"]) <= bound


@pytest.mark.parametrize("tie", [True, False])
def test_training_by_projection_follows_the_parametrized_trajectory_in_float64(tie):
    # the trainer's route (project_centering_: plain centered Parameters, g ↦ P·g before clipping, W ↦ P·W
    # after AdamW) against V = P·W through the parametrization, weight decay, clipping and 2 micro-batches
    config = resolve_config(**TINY, norm="cbwc_rmsnorm", precision="fp64", batch_size=2, lr=3e-3, weight_decay=0.1,
                            grad_clip=0.1, tie_embeddings=tie)
    parametrized, projected = build_model(config), build_model(config)
    assert project_centering_(projected) == 9 + (not tie)  # the tied table keeps its parametrization
    assert parametrize.is_parametrized(projected.transformer.wte) == tie
    optimizers = [make_optimizer(m, config) for m in (parametrized, projected)]
    generator = torch.Generator().manual_seed(0)
    losses = {"parametrized": [], "projected": []}
    for _ in range(60):
        batches = [(x, x) for x in torch.randint(256, (2, 2, 16), generator=generator)]
        for name, model, optimizer in zip(losses, (parametrized, projected), optimizers):
            losses[name].append(train_step(model, optimizer, batches, config).item())
    assert losses["projected"][-1] < losses["projected"][0] - 0.5  # it trained
    assert _rel_gap(losses["parametrized"], losses["projected"]) <= 1e-12
    proj = projected.transformer.h[1].mlp.c_proj.weight
    assert not parametrize.is_parametrized(projected.transformer.h[1].mlp.c_proj)
    assert proj.mean(0).abs().max() < 1e-15  # kept centered after every AdamW step
    torch.testing.assert_close(proj, parametrized.transformer.h[1].mlp.c_proj.weight, rtol=1e-10, atol=1e-13)
    assert parametrized.transformer.h[1].mlp.c_proj.parametrizations.weight.original.mean(0).abs().max() > 1e-6


def test_bake_after_training_by_projection_leaves_plain_centered_weights_and_the_same_function():
    config = resolve_config(**TINY, norm="cbwc_rmsnorm", precision="fp64", tie_embeddings=False)
    model = build_model(config)
    project_centering_(model)
    idx = torch.randint(256, (2, 16))
    before = model(idx)[0]
    bake_(model)
    assert not any("_cbwc_projected" in m.__dict__ for m in model.modules())
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    torch.testing.assert_close(model(idx)[0], before, rtol=0, atol=0)
    with pytest.raises(ValueError, match="bake_ found no CBWC parametrizations"):
        bake_(model)


@pytest.mark.parametrize("convert", [project_centering_, bake_])
def test_converting_a_deep_copy_leaves_the_original_cbwc_model_working(convert):
    # copy.deepcopy shares the generated Parametrized… class; removing a property from it broke the original
    model = build_model(resolve_config(**TINY, norm="cbwc_rmsnorm", precision="fp64"))
    idx = torch.randint(256, (2, 16))
    before = model(idx)[0]
    twin = copy.deepcopy(model)
    convert(twin)
    torch.testing.assert_close(model(idx)[0], before, rtol=0, atol=0)
    torch.testing.assert_close(twin(idx)[0], before, rtol=1e-12, atol=1e-12)


def test_a_deep_copy_of_a_projected_model_keeps_training_centered():
    config = resolve_config(**TINY, norm="cbwc_rmsnorm", batch_size=2)
    model = build_model(config)
    project_centering_(model)
    twin = copy.deepcopy(model)  # a Parameter's attributes do not survive deepcopy; the module's mark does
    x = torch.randint(256, (2, 16))
    train_step(twin, make_optimizer(twin, config), [(x, x)], config)
    assert twin.transformer.h[0].mlp.c_proj.weight.mean(0).abs().max() < 1e-7


def test_free_weight_mean_drifts_under_adamw_identically_in_both_models():
    ln, twin, _ = _pair()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ln, twin)]
    for _ in range(5):
        idx = torch.randint(256, (2, 16))
        for model, opt in zip((ln, twin), opts):
            opt.zero_grad()
            model(idx, idx)[1].backward()
            opt.step()
    w_ln = ln.transformer.h[0].attn.c_proj.weight
    w_free = twin.transformer.h[0].attn.c_proj.parametrizations.weight.original
    torch.testing.assert_close(w_free, w_ln, rtol=1e-9, atol=1e-12)
    assert w_free.mean(0).abs().max() > 1e-6  # the free W is not centered; only V = P·W is


def test_residual_dropout_breaks_the_equivalence_in_training(tmp_path):
    losses = {}
    for norm in ("layernorm", "cbwc_rmsnorm"):
        config = resolve_config(**TINY, norm=norm, precision="fp64", dropout=0.2, max_steps=3, batch_size=2,
                                eval_interval=3, eval_iters=1, out_dir=str(tmp_path / norm), progress=False,
                                save_checkpoint=False)
        losses[norm] = train(config)["train_losses"]
    assert _rel_gap(losses["layernorm"], losses["cbwc_rmsnorm"]) > 1e-6


def test_an_optimizer_built_before_cbwc_still_drives_the_model():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cbwc_(model, (torch.zeros(1, 8, dtype=torch.long),))
    before = model.transformer.wte.weight.detach().clone()
    idx = torch.randint(256, (2, 16))
    model(idx, idx)[1].backward()
    opt.step()
    assert not torch.equal(before, model.transformer.wte.weight)


def test_bake_leaves_plain_centered_weights_an_untied_head_and_the_same_function():
    ln, twin, _ = _pair()
    bake_(twin)
    assert not any(parametrize.is_parametrized(m) for m in twin.modules())
    assert twin.lm_head.weight is not twin.transformer.wte.weight and not twin.config.tie_embeddings
    torch.testing.assert_close(twin.lm_head.weight, ln.transformer.wte.weight, rtol=0, atol=0)
    assert twin.transformer.wte.weight.mean(1).abs().max() < 1e-15
    assert twin.transformer.h[1].mlp.c_proj.weight.mean(0).abs().max() < 1e-15
    idx = torch.randint(256, (2, 16))
    torch.testing.assert_close(twin(idx)[0], ln(idx)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("config, kept, reason", [
    (dict(placement="post"), 4, "transformer.h.0.ln_1: not closed: aten.dropout at transformer.drop also feeds "
                                "aten.linear at transformer.h.0.attn.c_attn"),
    (dict(placement="sandwich"), 4, "transformer.ln_f: blocked: aten.layer_norm at transformer.h.0.ln_1_post"),
    (dict(qk_norm=True), 4, "transformer.h.1.attn.k_norm: kept for CBWC: centered only in part (some groups of a "
                            "fused projection)"),
])
def test_cbwc_refuses_a_model_that_would_keep_layernorms_naming_each_with_the_engines_reason(config, kept, reason):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, **config))
    with pytest.raises(PartialCBWCError, match=f"{kept} of .* LayerNorms would stay LayerNorms") as refusal:
        cbwc_(model, (torch.zeros(1, 8, dtype=torch.long),))
    assert reason in str(refusal.value) and "allow_partial=True" in str(refusal.value)
    assert str(refusal.value).count("transformer.") >= kept  # every kept norm is named
    assert not any(parametrize.is_parametrized(m) for m in model.modules())  # refused before changing anything
    assert not any(isinstance(m, RMSNorm) for m in model.modules())


def test_post_ln_with_allow_partial_is_left_unchanged_with_a_warning():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, placement="post"))
    with pytest.warns(UserWarning, match="4 of 4 LayerNorms would stay LayerNorms"):
        report = cbwc_(model, (torch.zeros(1, 8, dtype=torch.long),), allow_partial=True)
    assert report.num_foldable == 0
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    assert sum(isinstance(m, torch.nn.LayerNorm) for m in model.modules()) == 4


def test_sandwich_with_allow_partial_converts_every_norm_the_engine_proves_foldable():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, placement="sandwich"))
    with pytest.warns(UserWarning, match="4 of 9 LayerNorms"):
        report = cbwc_(model, (torch.zeros(1, 8, dtype=torch.long),), allow_partial=True)
    foldable = {n.path for n in report.norms if n.foldable}
    # the first pre-norm reads the centered embeddings; the later ones read a post-norm's affine output
    assert foldable == {f"transformer.h.{i}.{n}" for i in range(2) for n in ("ln_1_post", "ln_2_post")} | {
        "transformer.h.0.ln_1"}
    assert {path for path, m in model.named_modules() if isinstance(m, RMSNorm)} == foldable
    assert isinstance(model.transformer.ln_f, torch.nn.LayerNorm)


def test_a_complete_cbwc_model_converts_without_a_warning(recwarn):
    _, twin, report = _pair()
    assert report.num_foldable == 5 and not recwarn.list


@pytest.mark.parametrize("allow", [False, True])
def test_normfold_train_refuses_cbwc_with_post_placement_before_training_unless_allowed(tmp_path, capsys, allow):
    out = tmp_path / "run"
    argv = ["train", "--norm=cbwc_rmsnorm", "--placement=post", "--n_layer=1", "--n_head=2", "--n_embd=16",
            "--block_size=16", "--batch_size=2", "--max_steps=1", "--eval_interval=1", "--eval_iters=1",
            "--progress=false", "--save_checkpoint=false", f"--out_dir={out}"] + (["--allow-partial-cbwc"] if allow else [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(argv)
    err = capsys.readouterr().err
    if allow:
        assert code == EXIT_OK and (out / "summary.json").is_file()
        assert any("2 of 2 LayerNorms would stay LayerNorms" in str(w.message) for w in caught)
    else:
        assert code == EXIT_USAGE and not out.exists()  # refused before anything was written
        assert err.startswith("normfold: error: cbwc_: 2 of 2 LayerNorms would stay LayerNorms")
        assert "transformer.h.0.ln_2: blocked" in err and "--allow-partial-cbwc" in err


def test_cbwc_works_on_a_hugging_face_gpt2():
    hf = tiny_gpt2(vocab_size=64, n_positions=16, n_embd=16, attn_implementation="eager").double().eval()
    twin = copy.deepcopy(hf)
    ids = torch.randint(64, (2, 12))
    report = normfold.cbwc_(twin, {"input_ids": ids, "use_cache": False})
    assert report.num_foldable == 5
    assert twin.lm_head.weight is twin.transformer.wte.parametrizations.weight.original
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, hf(ids).logits, rtol=1e-10, atol=1e-10)


def test_cbwc_refuses_a_second_application_and_bake_refuses_a_plain_model():
    _, twin, _ = _pair()
    with pytest.raises(ValueError, match="already applied"):
        cbwc_(twin, (torch.zeros(1, 8, dtype=torch.long),))
    with pytest.raises(ValueError, match="no CBWC parametrizations"):
        bake_(GPT(GPTConfig(**TINY)))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        cbwc_("model", ())


@pytest.mark.parametrize("plan, match", [
    (FoldPlan(affine_fold=[AffineFoldStep("transformer.ln_f", None, None, "lm_head.weight", 1, "lm_head.bias")]),
     "without affine folding"),
    (FoldPlan(swap=[SwapStep("transformer.ln_f", "LayerNorm", 16, 1e-5, False, False)]), "swaps to 'LayerNorm'"),
    (FoldPlan(center=[CenterStep("transformer.wpe.weight", 1, 5)]), "group must be a positive divisor"),
    (FoldPlan(center=[CenterStep("transformer.wpe.weight", 2)]), "dim must be in"),
])
def test_cbwc_refuses_plans_it_cannot_train_before_changing_anything(plan, match):
    model = GPT(GPTConfig(**TINY))
    with pytest.raises(ValueError, match=match):
        cbwc_(model, None, report=FoldReport([], plan))
    assert not any(parametrize.is_parametrized(m) for m in model.modules())


def test_cbwc_rmsnorm_checkpoint_is_the_layernorm_twin_in_gpt2_format(tmp_path):
    transformers = pytest.importorskip("transformers")
    from normfold.train.checkpoint import save_checkpoint

    ln, twin, _ = _pair(dtype=torch.float32, norm="cbwc_rmsnorm")
    assert save_checkpoint(twin, tmp_path) == "gpt2"
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    idx = torch.randint(256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, twin.eval()(idx)[0], rtol=1e-4, atol=1e-4)
