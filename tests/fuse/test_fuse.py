"""fuse_residual_norms: residual adds fused into the norms they feed, behind the float64 verify gate."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from normfold.engine import FoldVerificationError
from normfold.fuse import fuse_residual_norms, rewrite
from normfold.fuse.runtime import norm_from, pending_output
from normfold.nn import RMSNorm


def count_runs(*modules: nn.Module) -> list:
    """A list that grows by one each time one of ``modules`` runs its forward (a fused call does not);
    not a hook, since a hook on a fused norm sends its calls down the unfused path."""
    calls = []
    for module in modules:
        def counted(*args, forward=module.forward, **kwargs):
            calls.append(1)
            return forward(*args, **kwargs)
        module.forward = counted
    return calls


# ------------------------------------------------------------------------------ toy modules

class ResidualBlock(nn.Module):
    """h = lin(x) + x feeds the norm, unless a branch rescales h first (the identity guard's case)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = RMSNorm(width, elementwise_affine=False)

    def forward(self, x, rescale: bool = False):
        h = self.lin(x) + x
        if rescale:
            h = h * 2
        return self.norm(h), h


class BiasAddBlock(nn.Module):
    """The add broadcasts a (N,) vector: not a residual add the fused op can take."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.randn(width))
        self.norm = RMSNorm(width)

    def forward(self, x):
        h = x + self.shift
        return self.norm(h)


class PostNormBlock(nn.Module):
    """Post-LN, the add written inside the call (BERT's ``self.LayerNorm(hidden_states + input_tensor)``)."""

    def __init__(self, width: int = 8, shift: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.shift = nn.Parameter(torch.randn(width)) if shift else None

    def forward(self, x):
        return self.norm(self.lin(x) + (x if self.shift is None else self.shift))


class PreNormBlock(nn.Module):
    """x + lin(norm(x)): the add ends the block, the next block's norm (or the final norm) takes it."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = RMSNorm(width)
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        out = x + self.lin(self.norm(x))
        return out


class PreNormStack(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PreNormBlock(width) for _ in range(depth))
        self.norm_f = RMSNorm(width)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm_f(x)


class AddOutput(nn.Module):
    """Holds no norm but ends with the residual add (ViT's ViTOutput)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h, x):
        out = self.lin(h) + x
        return out


class OutputBlock(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = RMSNorm(width)
        self.output = AddOutput(width)

    def forward(self, x):
        return self.output(self.norm(x), x)


class ReshapedResidualBlock(nn.Module):
    """OPT's layout: the sum is flattened to rows before the norm; a slice may follow."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = RMSNorm(width)

    def forward(self, x, first_row: bool = False):
        h = self.lin(x) + x
        h = h.reshape(-1, h.size(-1))  # (B*T, C)
        if first_row:
            h = h[:1]
        return self.norm(h)


class InPlaceReshapedBlock(ReshapedResidualBlock):
    """The same, but a branch scales the flattened sum in place before the norm."""

    def forward(self, x, scale_in_place: bool = False):
        h = self.lin(x) + x
        h = h.reshape(-1, h.size(-1))  # (B*T, C)
        if scale_in_place:
            h.mul_(2)
        return self.norm(h)


class ViewEndBlock(PreNormBlock):
    """Ends with OPT's ``(residual + h).view(shape)``: the next block's norm takes the view."""

    def forward(self, x):
        shape = x.shape
        rows = x.reshape(-1, x.size(-1))
        out = (rows + self.lin(self.norm(rows))).view(shape)
        return out


def _stack(seed: int = 0) -> PreNormStack:
    torch.manual_seed(seed)
    stack = PreNormStack().eval()
    for m in stack.modules():
        if isinstance(m, RMSNorm):
            nn.init.normal_(m.weight)
    return stack


class SuperBlock(ResidualBlock):
    def forward(self, x, rescale: bool = False):  # zero-argument super() makes a closure over __class__
        return super().forward(x, rescale)


def _x(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ------------------------------------------------------------------------------ the guard and fallbacks

def test_observed_add_is_fused_and_a_branch_that_reassigns_falls_back_to_the_plain_norm():
    torch.manual_seed(0)
    block = ResidualBlock().eval()
    x = _x(2, 3, 8)
    fused, report = fuse_residual_norms(block, (x,))
    assert [(p.parent, p.norm, p.add) for p in report.fused] == [("", "norm", "h = self.lin(x) + x")]
    assert report.verification.ok and report.verification.max_rel_error <= 1e-9
    calls = count_runs(fused.norm)  # counts only when the module itself runs
    with torch.no_grad():
        y, h = fused(x)
        assert calls == []  # fused call: the norm module was bypassed
        torch.testing.assert_close(y, block(x)[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(h, block(x)[1], rtol=0, atol=0)
        y2, _ = fused(x, rescale=True)
        assert calls == [1]  # h was reassigned: the guard routes to self.norm(h)
        torch.testing.assert_close(y2, block(x, rescale=True)[0], rtol=0, atol=0)


def test_original_model_is_untouched():
    block = ResidualBlock().eval()
    before = {k: v.clone() for k, v in block.state_dict().items()}
    fused, _ = fuse_residual_norms(block, (_x(2, 8),))
    assert "forward" not in vars(block) and "forward" in vars(fused)
    assert all(torch.equal(before[k], v) for k, v in block.state_dict().items())
    assert type(fused) is ResidualBlock and fused.state_dict().keys() == block.state_dict().keys()


def test_broadcasting_add_is_not_fused_but_stays_exact():
    block = BiasAddBlock().eval()
    x = _x(4, 8)
    fused, report = fuse_residual_norms(block, (x,))
    # the probe sees the add feed the norm, so it is rewritten; at run time the helper refuses the shapes
    with torch.no_grad():
        assert torch.equal(fused(x), block(x))
    assert report.verification.ok


@settings(max_examples=15, deadline=None)
@given(batch=st.integers(1, 5), seq=st.integers(1, 7), width=st.sampled_from([1, 3, 8, 33]))
def test_fused_equals_unfused_in_float64_for_any_shape(batch, seq, width):
    torch.manual_seed(width)
    block = ResidualBlock(width).double().eval()
    x = _x(batch, seq, width, dtype=torch.float64, seed=batch * 31 + seq)
    fused, report = fuse_residual_norms(block, (x,), verify=False)
    assert len(report.fused) == 1
    with torch.no_grad():
        torch.testing.assert_close(fused(x)[0], block(x)[0], rtol=1e-12, atol=1e-12)


class InputFirstBlock(ResidualBlock):
    def forward(self, x):
        h = x + self.lin(x)
        return self.norm(h), h


def test_non_contiguous_operands_run_unfused_so_the_sum_keeps_the_unfused_layout():
    torch.manual_seed(0)
    block = InputFirstBlock().eval()
    fused, report = fuse_residual_norms(block, (_x(2, 3, 8),))
    x = _x(3, 2, 8).transpose(0, 1)  # (2, 3, 8), not contiguous: x + lin(x) follows x's layout
    with torch.no_grad():
        (y, h), (y_ref, h_ref) = fused(x), block(x)
    assert len(report.fused) == 1 and h.stride() == h_ref.stride() and not h.is_contiguous()
    assert torch.equal(y, y_ref) and torch.equal(h, h_ref)


def test_inline_add_into_a_torch_layer_norm_is_fused_and_bypasses_the_module():
    torch.manual_seed(0)
    block = PostNormBlock().eval()
    nn.init.normal_(block.norm.weight)
    nn.init.normal_(block.norm.bias)
    x = _x(3, 5, 8)
    fused, report = fuse_residual_norms(block, (x,))
    assert [(p.norm, p.add) for p in report.fused] == [("norm", "self.norm(self.lin(x) + (x if self.shift is None else self.shift))")]
    assert report.skipped == {} and report.verification.max_rel_error <= 1e-9
    calls = count_runs(fused.norm)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), block(x), rtol=1e-5, atol=1e-5)
    assert calls == []


def test_inline_add_that_broadcasts_falls_back_to_the_module_exactly():
    block = PostNormBlock(shift=True).eval()
    x = _x(4, 8)
    fused, report = fuse_residual_norms(block, (x,))
    assert len(report.fused) == 1  # rewritten; the helper refuses the (N,) operand at run time
    with torch.no_grad():
        assert torch.equal(fused(x), block(x))


def test_layer_norms_false_considers_only_rms_norms():
    fused, report = fuse_residual_norms(PostNormBlock().eval(), (_x(2, 8),), layer_norms=False)
    assert report.fused == [] and report.skipped == {} and "forward" not in vars(fused)
    with pytest.raises(ValueError, match="normfold RMSNorm modules"):
        fuse_residual_norms(PostNormBlock().eval(), (_x(2, 8),), norm_paths=["norm"], layer_norms=False)


def test_a_sum_reshaped_to_rows_is_fused_and_a_slice_falls_back_exactly():
    torch.manual_seed(0)
    block = ReshapedResidualBlock().eval()
    nn.init.normal_(block.norm.weight)
    x = _x(2, 3, 8)
    fused, report = fuse_residual_norms(block, (x,))
    assert [p.norm for p in report.fused] == ["norm"] and report.verification.ok
    calls = count_runs(fused.norm)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), block(x), rtol=1e-6, atol=1e-6)
        assert calls == []  # the view of the sum took the fused output
        # a view of part of the rows is not the sum's rows
        assert torch.equal(fused(x, first_row=True), block(x, first_row=True))
    assert calls == [1]


def test_a_sum_changed_in_place_in_a_branch_is_not_fused_and_stays_exact():
    torch.manual_seed(0)
    block = InPlaceReshapedBlock().eval()
    x = _x(2, 3, 8)
    fused, report = fuse_residual_norms(block, (x,))
    assert report.fused == [] and "changed in place" in report.skipped["norm"]
    with torch.no_grad():
        assert torch.equal(fused(x, scale_in_place=True), block(x, scale_in_place=True))


def test_a_block_ending_with_a_view_of_the_sum_hands_it_to_the_next_norm():
    stack = _stack()
    stack.blocks = nn.ModuleList(ViewEndBlock() for _ in range(2))
    x = _x(2, 3, 8)
    fused, report = fuse_residual_norms(stack, (x,))
    assert {(p.parent, p.norm) for p in report.fused} == {("blocks.0", "blocks.1.norm"), ("blocks.1", "norm_f")}
    with torch.no_grad():
        torch.testing.assert_close(fused(x), stack(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make_x, taken", [
    (lambda h: h, True),
    (lambda h: h.view(-1, h.shape[-1]), True),
    (lambda h: h.view(-1, h.shape[-1])[1:], False),        # fewer rows
    (lambda h: h.view(-1)[: h.shape[-1]].view(1, -1), False),
    (lambda h: h.transpose(0, 1), False),                   # not contiguous
    (lambda h: h.view(h.shape[0], -1, 2), False),           # other row length
    (lambda h: h.clone(), False),                           # same values, other tensor
    (lambda h: h.add_(0), False),                           # modified in place
    (lambda h: None, False),                                # not a tensor
])
def test_the_early_output_is_taken_only_for_the_sum_or_a_view_of_all_its_rows(make_x, taken):
    norm = RMSNorm(4)
    h = _x(3, 2, 4)
    y = norm(h)
    pending = pending_output(h, y)
    sentinel = torch.zeros(())
    out = norm_from(pending, lambda x: sentinel, make_x(h))
    assert (out is not sentinel) == taken
    if taken:
        torch.testing.assert_close(out, norm(make_x(h)), rtol=0, atol=0)


def test_a_view_of_other_rows_of_the_same_memory_is_not_taken_for_the_sum():
    big = _x(4, 4)
    h, x = big[:3], big[1:]  # same base, same shape, rows shifted by one
    pending = pending_output(h, RMSNorm(4)(h))
    assert torch.equal(norm_from(pending, RMSNorm(4), x), RMSNorm(4)(x))


# ------------------------------------------------------------------------------ adds handed across modules

def test_the_add_ending_one_block_is_fused_into_the_norm_starting_the_next():
    stack = _stack()
    x = _x(2, 5, 8)
    fused, report = fuse_residual_norms(stack, (x,))
    assert {(p.parent, p.norm) for p in report.fused} == {
        ("blocks.0", "blocks.1.norm"), ("blocks.1", "blocks.2.norm"), ("blocks.2", "norm_f")}
    assert list(report.skipped) == ["blocks.0.norm"]  # its input is the model's input, no add
    calls = count_runs(fused.get_submodule("blocks.1.norm"), fused.norm_f)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), stack(x), rtol=1e-5, atol=1e-5)
    assert calls == []  # both norms got the output computed with the add


def test_an_add_in_a_module_that_holds_no_norm_is_fused_into_the_next_norm():
    stack = _stack()
    stack.blocks = nn.ModuleList(OutputBlock() for _ in range(2))
    x = _x(2, 3, 8)
    fused, report = fuse_residual_norms(stack, (x,))
    assert {(p.parent, p.norm) for p in report.fused} == {("blocks.0.output", "blocks.1.norm"),
                                                        ("blocks.1.output", "norm_f")}
    assert "forward" in vars(fused.blocks[0].output) and "forward" not in vars(fused.blocks[0].output.lin)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), stack(x), rtol=1e-5, atol=1e-5)


def test_a_block_called_on_its_own_falls_back_to_its_plain_norm_exactly():
    stack = _stack()
    fused, _ = fuse_residual_norms(stack, (_x(2, 8),))
    x, other = _x(3, 8, seed=1), _x(3, 8, seed=2)
    with torch.no_grad():
        fused.blocks[0](x)  # hands a norm output to blocks.1 that nobody takes
        assert torch.equal(fused.blocks[1](other), stack.blocks[1](other))  # a different input: plain norm
        torch.testing.assert_close(fused(x), stack(x), rtol=1e-5, atol=1e-5)


def test_a_deep_copy_of_a_fused_model_hands_adds_to_its_own_norms():
    stack = _stack()
    fused, _ = fuse_residual_norms(stack, (_x(2, 8),))
    twin = copy.deepcopy(fused)
    with torch.no_grad():
        twin.blocks[1].norm.weight.mul_(3.0)
        changed = copy.deepcopy(stack)
        changed.blocks[1].norm.weight.mul_(3.0)
        x = _x(4, 8, seed=3)
        torch.testing.assert_close(twin(x), changed(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused(x), stack(x), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ refusals

def test_norm_with_hooks_is_skipped_and_reported():
    block = ResidualBlock().eval()
    block.norm.register_forward_pre_hook(lambda *_: None)
    fused, report = fuse_residual_norms(block, (_x(2, 8),))
    assert report.fused == [] and "hooks" in report.skipped["norm"]
    assert "forward" not in vars(fused)


def test_parent_forward_with_a_closure_is_skipped_and_reported():
    _, report = fuse_residual_norms(SuperBlock().eval(), (_x(2, 8),))
    assert report.fused == [] and "closure" in report.skipped["norm"]


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        fuse_residual_norms(lambda x: x, (_x(2, 8),))
    with pytest.raises(ValueError, match="not found: \\['lin'\\]"):
        fuse_residual_norms(ResidualBlock(), (_x(2, 8),), norm_paths=["lin"])
    with pytest.raises(TypeError, match="example_inputs"):
        fuse_residual_norms(ResidualBlock(), [_x(2, 8)])


def test_a_wrong_fused_op_fails_the_verify_gate(monkeypatch):
    def wrong(norm, a, b):
        h = a + b
        return norm(h) * 1.001, h
    monkeypatch.setattr(rewrite, "add_norm", wrong)  # what the generated forward calls
    with pytest.raises(FoldVerificationError, match="fused model differs"):
        fuse_residual_norms(ResidualBlock().eval(), (_x(2, 8),))


class EmptyOutput(ResidualBlock):
    """Fusable, but returns no element to compare."""

    def forward(self, x):
        h = self.lin(x) + x
        return self.norm(h)[:0]


def test_a_fused_model_compared_on_nothing_is_refused_for_that_reason():
    # before: "float64 max relative error 0.000e+00 > 1e-09" (the reason was not read)
    with pytest.raises(FoldVerificationError, match="fused model differs from the unfused one: compared nothing"):
        fuse_residual_norms(EmptyOutput().eval(), (_x(2, 8),))


@pytest.mark.parametrize("wrong_in, judged", [
    (torch.float64, "float64 max relative error"),          # the float64 check runs the fused path, hook-free
    (torch.float32, "the returned model in float32: error"),  # the model as returned, in its own dtype
], ids=["float64", "float32"])
def test_a_fused_op_wrong_in_only_one_dtype_is_refused(monkeypatch, wrong_in, judged):
    # float64: a hook on a norm sends its calls down the unfused path, so a check that watched the norms
    # with hooks would compare the unfused model with itself. float32: before, only the float64 copy was
    # judged, and a fused model wrong in the dtype it is returned in came back
    real = rewrite.add_norm

    def rounded_in(norm, a, b):
        y, h = real(norm, a, b)
        return (y.to(torch.bfloat16).to(y.dtype) if y is not None and y.dtype == wrong_in else y), h

    monkeypatch.setattr(rewrite, "add_norm", rounded_in)
    torch.manual_seed(0)
    with pytest.raises(FoldVerificationError, match=f"fused model differs from the unfused one: .*{judged}"):
        fuse_residual_norms(ResidualBlock().eval(), (_x(2, 8),))


# ------------------------------------------------------------------------------ real models

def _fuse_zoo(zoo, name):
    folded = zoo.fold(name, torch.float32)
    fused, report = fuse_residual_norms(folded.folded, folded.example_inputs)
    return folded, fused, report


def test_gpt2_fuses_every_norm_across_blocks_and_passes_float64_verify(zoo):
    folded, fused, report = _fuse_zoo(zoo, "gpt2")
    pairs = {p.norm: p.parent for p in report.fused}
    # ln_2 inside its block; ln_1 and ln_f take the add that ends the module before them
    assert pairs == {"transformer.h.0.ln_2": "transformer.h.0", "transformer.h.1.ln_2": "transformer.h.1",
                     "transformer.h.0.ln_1": "transformer", "transformer.h.1.ln_1": "transformer.h.0",
                     "transformer.ln_f": "transformer.h.1"}
    assert report.skipped == {}
    assert report.verification.ok and report.verification.max_rel_error <= 1e-9
    assert [type(m) for m in fused.modules()] == [type(m) for m in folded.folded.modules()]
    with torch.no_grad():
        ref = folded.folded(**folded.fresh_inputs).logits
        torch.testing.assert_close(fused(**folded.fresh_inputs).logits, ref, rtol=1e-5, atol=1e-5)


def test_gpt2_fused_decode_with_kv_cache_matches_folded(zoo):
    folded, fused, _ = _fuse_zoo(zoo, "gpt2")
    ids = folded.example_inputs["input_ids"]
    with torch.no_grad():
        outs = []
        for m in (folded.folded, fused):
            cache = m(input_ids=ids, use_cache=True).cache
            outs.append(m(input_ids=ids[:, -1:], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["bloom", "falcon_sequential"])
def test_adds_inside_a_helper_function_are_inlined_and_fused(zoo, name):
    # BLOOM and Falcon add the residual in `dropout_add(x, residual, prob, training)`
    folded, fused, report = _fuse_zoo(zoo, name)
    rms = [path for path, m in folded.folded.named_modules() if isinstance(m, RMSNorm)]
    assert all("dropout_add(" in p.add and "out = residual + out" in p.add for p in report.fused)
    first = next(path for path in rms if ".h.0." in path and "input_layernorm" in path)
    assert sorted(p.norm for p in report.fused) == sorted(set(rms) - {first})  # the first takes no add
    assert "no `name = a + b` result reaches it" in report.skipped[first]
    assert report.verification.ok and report.verification.max_rel_error <= 1e-9
    with torch.no_grad():
        torch.testing.assert_close(fused(**folded.fresh_inputs).logits, folded.folded(**folded.fresh_inputs).logits,
                                   rtol=1e-5, atol=1e-5)


def test_opt_fuses_every_norm_through_its_reshapes(zoo):
    # OPTDecoderLayer flattens the sum before final_layer_norm and ends with `(residual + h).view(shape)`
    folded, fused, report = _fuse_zoo(zoo, "opt_pre_ln")
    pairs = {p.norm: p.parent for p in report.fused}
    layers = "model.decoder.layers"
    assert pairs == {f"{layers}.0.self_attn_layer_norm": "model.decoder", f"{layers}.0.final_layer_norm": f"{layers}.0",
                     f"{layers}.1.self_attn_layer_norm": f"{layers}.0", f"{layers}.1.final_layer_norm": f"{layers}.1",
                     "model.decoder.final_layer_norm": f"{layers}.1"}
    assert report.skipped == {} and report.verification.ok and report.verification.max_rel_error <= 1e-9
    with torch.no_grad():
        torch.testing.assert_close(fused(**folded.fresh_inputs).logits, folded.folded(**folded.fresh_inputs).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["bert", "minilm"])
def test_post_ln_encoders_fuse_every_layer_norm(zoo, name):
    model = zoo.model(name)
    inputs = zoo.inputs(name, seed=0)
    fused, report = fuse_residual_norms(model, inputs)
    norms = [path for path, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    assert sorted(p.norm for p in report.fused) == sorted(norms) and report.skipped == {}
    assert report.verification.ok
    fresh = zoo.inputs(name, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(fused(**fresh).last_hidden_state, model(**fresh).last_hidden_state,
                                   rtol=1e-5, atol=1e-5)


def test_bundled_model_fuses_and_passes_float64_verify():
    import normfold
    from normfold.hf.inputs import example_inputs_for
    from normfold.hf.load import default_model_path, load_model

    model = load_model(default_model_path())
    inputs = example_inputs_for(model, batch=2, seq=8)
    folded, _ = normfold.fold(model, inputs)
    fused, report = fuse_residual_norms(folded, inputs)
    layers = model.config.n_layer
    assert len(report.fused) == 2 * layers + 1 and report.skipped == {}  # ln_1, ln_2 per block, ln_f
    assert report.verification.ok and report.verification.max_rel_error <= 1e-9


@pytest.mark.parametrize("name", ["gpt2", "opt_pre_ln", "bloom"])
def test_fused_model_compiles_without_graph_breaks(zoo, name):
    folded, fused, _ = _fuse_zoo(zoo, name)
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(**folded.fresh_inputs).logits, fused(**folded.fresh_inputs).logits,
                                   rtol=1e-6, atol=1e-6)
