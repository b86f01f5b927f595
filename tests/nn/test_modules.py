"""normfold.nn modules: torch-compatible state dicts and outputs, FusedAddRMSNorm, and
torch.compile(fullgraph=True) / torch.export seeing one normfold op."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import normfold
from normfold.nn import FusedAddRMSNorm, LayerNorm, RMSNorm
from normfold.ops.reference import layer_norm_ref, rms_norm_ref


def test_rmsnorm_state_dict_matches_torch_and_loads_it():
    theirs = nn.RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(64))
    ours = RMSNorm(64, eps=1e-6)
    assert ours.state_dict().keys() == theirs.state_dict().keys() == {"weight"}
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 5, 64)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_layernorm_is_a_drop_in_for_torch_layernorm():
    theirs = nn.LayerNorm(96, eps=1e-12)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(96))
        theirs.bias.copy_(torch.randn(96))
    ours = LayerNorm(96, eps=1e-12)
    assert ours.state_dict().keys() == theirs.state_dict().keys() == {"weight", "bias"}
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(4, 7, 96) * 3 + 1
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    assert LayerNorm(8, bias=False).bias is None
    assert LayerNorm(8, elementwise_affine=False).weight is None


def test_rmsnorm_with_bias_and_offset_matches_reference():
    m = RMSNorm(32, bias=True, offset=1.0)
    assert m.state_dict().keys() == {"weight", "bias"}
    assert torch.equal(m.weight, torch.zeros(32))  # reset to 1 − offset: the module starts as identity scale
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    x = torch.randn(2, 32, dtype=torch.float64)
    m = m.double()
    torch.testing.assert_close(m(x), rms_norm_ref(x, m.weight, m.bias, m.eps, offset=1.0))


def test_weightless_rmsnorm_has_no_parameters():
    m = RMSNorm(16, elementwise_affine=False)
    assert list(m.parameters()) == []
    x = torch.randn(3, 16)
    torch.testing.assert_close(m(x), rms_norm_ref(x, eps=m.eps))


def test_fused_add_rmsnorm_returns_normed_and_residual_stream():
    m = FusedAddRMSNorm(48)
    x, residual = torch.randn(2, 6, 48), torch.randn(2, 6, 48)
    normed, stream = m(x, residual)
    torch.testing.assert_close(stream, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, rms_norm_ref(x + residual, m.weight, eps=m.eps), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", [RMSNorm, LayerNorm])
def test_a_norm_called_with_a_residual_adds_it_inside_and_returns_the_stream_with_every_gradient(cls):
    m = cls(40, bias=True).double()
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
        m.bias.normal_()
    x, residual = (torch.randn(3, 5, 40, dtype=torch.float64, requires_grad=True) for _ in range(2))
    dy, ds = torch.randn(3, 5, 40, dtype=torch.float64), torch.randn(3, 5, 40, dtype=torch.float64)
    normed, stream = m(x, residual=residual)
    fused = torch.autograd.grad((normed, stream), (x, residual, m.weight, m.bias), (dy, ds))
    s = x + residual
    unfused = torch.autograd.grad((m(s), s), (x, residual, m.weight, m.bias), (dy, ds))
    torch.testing.assert_close(stream, s, rtol=0, atol=0)
    torch.testing.assert_close(normed, m(s), rtol=1e-12, atol=1e-12)
    for a, b in zip(fused, unfused):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_extra_repr_names_the_options():
    assert repr(RMSNorm(8, bias=True, offset=1.0)) == "RMSNorm((8,), eps=1e-06, elementwise_affine=True, bias=True, offset=1.0)"
    assert repr(LayerNorm(8)) == "LayerNorm((8,), eps=1e-05, elementwise_affine=True)"


@pytest.mark.parametrize("cls", [RMSNorm, LayerNorm, FusedAddRMSNorm])
def test_multi_dimensional_normalized_shape_is_refused(cls):
    with pytest.raises(ValueError, match=r"normalized_shape must be an int or a 1-tuple, got \(4, 8\)"):
        cls((4, 8))


def test_module_follows_dtype_and_trains():
    m = RMSNorm(24, dtype=torch.bfloat16)
    assert m.weight.dtype == torch.bfloat16
    x = torch.randn(5, 24, dtype=torch.bfloat16)
    m(x).float().square().sum().backward()
    assert m.weight.grad is not None and m.weight.grad.dtype == torch.bfloat16


class _Block(nn.Module):
    """A pre-norm residual block using every normfold module."""

    def __init__(self, n: int = 32) -> None:
        super().__init__()
        self.norm1 = RMSNorm(n)
        self.proj = nn.Linear(n, n)
        self.norm2 = FusedAddRMSNorm(n, bias=True)
        self.final = LayerNorm(n)

    def forward(self, x):
        h = self.proj(self.norm1(x))
        normed, stream = self.norm2(h, x)
        return self.final(normed + stream)


def _block_and_input():
    torch.manual_seed(0)
    return _Block(), torch.randn(2, 3, 32)


def test_torch_compile_fullgraph_matches_eager_forward_and_backward():
    block, x = _block_and_input()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")  # no C++ codegen: fast on 2 cores
    x_eager, x_comp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_eager, y_comp = block(x_eager), compiled(x_comp)
    torch.testing.assert_close(y_comp, y_eager)
    y_eager.square().sum().backward()
    grads_eager = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    y_comp.square().sum().backward()
    torch.testing.assert_close(x_comp.grad, x_eager.grad)
    for got, want in zip((p.grad for p in block.parameters()), grads_eager):
        torch.testing.assert_close(got, want)


@pytest.mark.slow
def test_torch_compile_inductor_inlines_small_norms_and_calls_the_op_for_large_ones():
    """Small static shapes become plain math Inductor fuses (no ~17 µs op call per norm at decode);
    large ones call the fused kernel. Kept to two shapes: compiling is slow here."""
    from torch.profiler import profile

    norm = RMSNorm(256)
    with torch.no_grad():
        norm.weight.normal_()
    compiled = torch.compile(norm, fullgraph=True, dynamic=False)
    small, large = torch.randn(4, 256), torch.randn(2048, 256)  # 1,024 and 524,288 elements
    with torch.no_grad():
        compiled(small), compiled(large)  # compile both before profiling
        with profile() as prof_small:
            y_small = compiled(small)
        with profile() as prof_large:
            y_large = compiled(large)
    ops_called = [{e.name for e in p.events() if e.name.startswith("normfold::")} for p in (prof_small, prof_large)]
    assert ops_called == [set(), {"normfold::norm_fwd"}]
    torch.testing.assert_close(y_small, norm(small), rtol=1e-5, atol=1e-5)
    assert y_large.equal(norm(large))


def test_torch_export_shows_one_normfold_op_per_norm_and_matches_eager():
    block, x = _block_and_input()
    exported = torch.export.export(block, (x,))
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert targets.count("normfold.norm_fwd.default") == 3, targets
    assert not any("rsqrt" in t or "layer_norm" in t for t in targets), targets
    torch.testing.assert_close(exported.module()(x), block(x))


def test_public_names_are_reachable():
    assert normfold.nn.LayerNorm is LayerNorm
    assert callable(normfold.ops.cpu_kernel_available)
