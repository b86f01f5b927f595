"""Fusion reads its add -> norm pairs from a torch.export graph (the fold's, when the fold ran just before;
else captured for it), probes eagerly only where export cannot capture the model, and says which; norms
that do not normalise the sum's last dim (channels first) are skipped with a reason."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import normfold
from normfold import FoldConfig, FuseConfig
from normfold.fuse import fuse_residual_norms
from normfold.nn import PermutedRMSNorm
from test_fuse import PreNormStack, ResidualBlock, _stack, _x
from test_fuse_source import _edit as edit
from test_fuse_source import _import as import_module_file


def count_eager_runs(model: nn.Module) -> list:
    """A list that grows by one each time ``model`` (or a deep copy of it) runs its forward on real tensors;
    a trace's run on fake tensors (torch.export) is not counted."""
    runs = []

    def hook(module, args, output):
        if not any(isinstance(a, FakeTensor) for a in args):
            runs.append(1)
    model.register_forward_hook(hook)
    return runs


# ------------------------------------------------------------------------------ where the pairs come from

def test_fusion_alone_reads_its_pairs_from_a_graph_and_runs_the_model_only_to_verify():
    stack = _stack()
    runs = count_eager_runs(stack)
    _, report = fuse_residual_norms(stack, (_x(2, 5, 8),), verify=False)
    assert runs == []   # before: one eager probe run
    assert report.pairs_from == "graph" and "torch.export" in report.pairs_why
    assert {(p.parent, p.norm) for p in report.fused} == {
        ("blocks.0", "blocks.1.norm"), ("blocks.1", "blocks.2.norm"), ("blocks.2", "norm_f")}


class PreLN(nn.Module):
    """A LayerNorm the fold turns into an RMSNorm, fed by a residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Linear(8, 16), nn.Linear(16, 16)
        self.ln1, self.ln2 = nn.LayerNorm(16), nn.LayerNorm(16)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.fc(self.ln1(h))
        return self.ln2(h)


def test_after_the_fold_fusion_reads_the_fold_graph_and_captures_nothing(monkeypatch):
    def captured_again(*args, **kwargs):
        raise AssertionError("fusion captured the model again")
    monkeypatch.setattr(normfold.fuse, "capture", captured_again)
    torch.manual_seed(0)
    _, report = normfold.convert(PreLN().eval(), (_x(2, 5, 8),), FoldConfig(), FuseConfig())
    assert report.fuse.pairs_from == "graph" and report.fuse.pairs_why == "the fold's torch.export capture"
    assert [(p.parent, p.norm, p.add) for p in report.fuse.fused] == [("", "ln2", "h = h + self.fc(self.ln1(h))")]


class DataDependent(ResidualBlock):
    """Python control flow on a tensor's value: torch.export cannot capture it."""

    def forward(self, x):
        h = self.lin(x) + x
        if float(h.abs().sum()) < 0:
            h = h * 2
        return self.norm(h)


def test_where_export_cannot_capture_the_model_fusion_probes_it_and_says_why():
    block = DataDependent().eval()
    runs = count_eager_runs(block)
    x = _x(2, 3, 8)
    fused, report = fuse_residual_norms(block, (x,), verify=False)
    assert report.pairs_from == "probe" and report.pairs_why.startswith("torch.export could not capture the model: ")
    assert runs == [1] and [p.norm for p in report.fused] == ["norm"]
    with torch.no_grad():
        torch.testing.assert_close(fused(x), block(x), rtol=1e-6, atol=1e-6)


class AddInsideACall(ResidualBlock):
    """The sum reaches the norm through eval dropout, but is written inside the call: no `name = a + b`."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = self.drop(self.lin(x) + x)
        return self.norm(h)


def test_an_add_feeding_a_norm_that_is_no_source_statement_is_skipped_saying_where_it_is():
    block = AddInsideACall().eval()
    x = _x(2, 3, 8)
    fused, report = fuse_residual_norms(block, (x,))
    line = AddInsideACall.forward.__code__.co_firstlineno + 1
    assert report.fused == [] and report.skipped["norm"].startswith(
        f"its input is the add at test_fuse_graph.py:{line} in the model's forward, which is no `name = a + b` "
        "statement fusion can rewrite")
    with torch.no_grad():
        assert torch.equal(fused(x), block(x))


@pytest.mark.parametrize("old, new", [
    ("EDITED = []\n", "EDITED = []\n\n\n\n"),                                          # the whole class moved
    ("        h = self.lin(x) + x\n", "\n\n        h = self.lin(x) + x\n"),                # lines inside the forward
], ids=["class", "forward"])
def test_source_lines_moved_since_import_are_matched_to_the_lines_that_run(tmp_path, old, new):
    # the graph's stack traces name the lines of the code that runs; the file on disk may have moved them
    module, path = import_module_file(tmp_path, f"nf_moved_{len(new)}")
    edit(path, old, new)
    torch.manual_seed(0)
    _, report = fuse_residual_norms(module.Block().eval(), (_x(2, 3, 8),))
    assert report.pairs_from == "graph" and [(p.norm, p.add) for p in report.fused] == [("norm", "h = self.lin(x) + x")]


# ------------------------------------------------------------------------------ channels-first norms

class LayerNorm2d(nn.LayerNorm):
    """timm's channels-first LayerNorm: normalises dim 1 of (N, C, H, W) by permuting around layer_norm."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, norm: nn.Module, channels: int = 8) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
        self.norm = norm

    def forward(self, x):
        h = self.dwconv(x) + x
        return self.norm(h)


def _convnext(norm: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    block = ConvNeXtBlock(norm).eval()
    nn.init.normal_(block.norm.weight)
    return block


@pytest.mark.parametrize("norm", [LayerNorm2d(8), PermutedRMSNorm(8, order=(0, 2, 3, 1))],
                         ids=["LayerNorm subclass", "PermutedRMSNorm"])
def test_a_channels_first_norm_is_skipped_with_a_reason_and_the_model_stays_exact(norm):
    # before: the LayerNorm subclass was "fused" on a (2, 8, 5, 5) input (the kernel declined the shape), and a
    # later input of width 8 = C got the norm of its last dim; on that input fusing failed its proof instead
    # of skipping; a PermutedRMSNorm was left out of the report
    block = _convnext(norm)
    fused, report = fuse_residual_norms(block, (_x(2, 8, 5, 5),))
    assert report.fused == [] and "has its own forward" in report.skipped["norm"]
    square = _x(2, 8, 4, 8, seed=1)   # last dim = channels
    with torch.no_grad():
        assert torch.equal(fused(square), block(square))
    _, report = fuse_residual_norms(block, (square,))
    assert report.fused == [] and "channels-first" in report.skipped["norm"]


class PlainLayerNormSubclass(nn.LayerNorm):
    """A subclass that keeps nn.LayerNorm's forward: still the last dim's norm."""


def test_a_norm_subclass_keeping_the_last_dim_forward_is_still_fused():
    torch.manual_seed(0)
    stack = PreNormStack()
    stack.norm_f = PlainLayerNormSubclass(8)
    _, report = fuse_residual_norms(stack.eval(), (_x(2, 3, 8),))
    assert ("blocks.2", "norm_f") in {(p.parent, p.norm) for p in report.fused} and "norm_f" not in report.skipped

