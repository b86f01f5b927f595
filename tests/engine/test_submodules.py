"""Folds past export's limits: when torch.export cannot capture the whole model, the largest submodules it
can capture are analysed with the inputs the whole call gave them, and the fold is proved on the whole
model eagerly (normfold.engine.submodules)."""
from __future__ import annotations

import logging
import sys

import pytest
import torch
from torch import nn

import normfold
from normfold.engine import ExampleInputsError, FoldError

from tiny_models import nontrivial_layer_norms

C = 8


@pytest.fixture(autouse=True)
def _quiet_export():
    """torch.export logs the graph it failed on (logging.ERROR); the tests read what the fold says."""
    logging.disable(logging.ERROR)
    yield
    logging.disable(logging.NOTSET)


class Block(nn.Module):
    """Linear -> LayerNorm -> Linear: the norm folds when the block is captured (its input is the Linear's)."""

    def __init__(self):
        super().__init__()
        self.fc, self.ln, self.out = nn.Linear(C, C), nn.LayerNorm(C), nn.Linear(C, C)

    def forward(self, x):
        return self.out(self.ln(self.fc(x)))


class NormFirst(nn.Module):
    """LayerNorm on the block's own input: its producer lies outside the block."""

    def __init__(self):
        super().__init__()
        self.ln, self.out = nn.LayerNorm(C), nn.Linear(C, C)

    def forward(self, x):
        return self.out(self.ln(x))


class Branching(nn.Module):
    """Python control flow on a tensor value at the top: export cannot capture the whole model."""

    def __init__(self, branch: bool = True):
        super().__init__()
        self.a, self.b, self.branch = Block(), Block(), branch

    def forward(self, x):
        h = self.a(x)
        if self.branch and h.sum() > 0:
            h = h * 2
        return self.b(h)


def _non_trivial(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nontrivial_layer_norms(model).eval()


def _x() -> torch.Tensor:
    return torch.randn(2, 5, C, generator=torch.Generator().manual_seed(1))


def test_a_model_with_a_data_dependent_branch_at_the_top_folds_its_blocks_exactly():
    model = _non_trivial(Branching())
    folded, report = normfold.fold(model, (_x(),))
    assert report.captured_through == ["a", "b"]
    assert "data-dependent" in report.whole_model_capture_error
    assert {e.path: e.foldable for e in report.norms} == {"a.ln": True, "b.ln": True}
    assert report.verification.ok and report.verification.max_rel_error < 1e-12
    assert isinstance(folded.a.ln, normfold.RMSNorm) and isinstance(folded.b.ln, normfold.RMSNorm)
    assert "captured through submodules: a, b" in str(report)
    assert report.to_dict()["captured_through"] == ["a", "b"]


def test_a_failed_whole_model_capture_writes_nothing_to_stderr(capsys):
    """Fails on main af93d81: torch.export printed the partial graph of the failed capture to stderr (pages
    of `def forward(self, arg0_1: ...)` before the fold's own report)."""
    logging.disable(logging.NOTSET)  # torch's own warnings too, as a user sees them
    normfold.fold(_non_trivial(Branching()), (_x(),))
    assert capsys.readouterr().err == ""


def test_a_successful_capture_still_writes_what_the_model_itself_warns(capsys):
    class Warns(Block):
        def forward(self, x):
            print("the model's own warning", file=sys.stderr)
            return super().forward(x)

    normfold.analyze(Warns(), (_x(),))
    assert "the model's own warning" in capsys.readouterr().err


def test_a_norm_reading_a_submodules_input_is_kept_although_the_whole_graph_would_fold_it():
    class Boundary(Branching):
        def __init__(self, branch: bool):
            super().__init__(branch)
            self.b = NormFirst()  # b.ln reads a's output, a Linear: zero-mean once a.out is centered

    _, whole = normfold.fold(_non_trivial(Boundary(branch=False)), (_x(),))
    assert whole.captured_through == [] and next(e for e in whole.norms if e.path == "b.ln").foldable
    _, through = normfold.fold(_non_trivial(Boundary(branch=True)), (_x(),))
    assert through.captured_through == ["a", "b"]
    entry = next(e for e in through.norms if e.path == "b.ln")
    assert not entry.foldable
    # b reads h * 2 (or h): the code between a and b, followed eagerly, wires it to a.out, but the branch
    # reads h.sum() into Python, so centering a.out could change which way it goes
    assert "its centering shift reaches aten.sum" in entry.reason, entry.reason
    assert next(e for e in through.norms if e.path == "a.ln").foldable and through.verification.ok


class Handover(nn.Module):
    """a's output goes to b as it is, while a branch on the input keeps export from the whole model:
    ``after`` is what else the root does with a's output (nothing, return it too, write into it)."""

    def __init__(self, after: str = "nothing"):
        super().__init__()
        self.a, self.b, self.after = Block(), NormFirst(), after

    def forward(self, x):
        h = self.a(x)
        if x.sum() > 0:
            x = x * 2
        if self.after == "writes":
            h.mul_(2)
        out = self.b(h)
        return (out, h) if self.after == "returns" else out


def test_a_norm_reading_another_submodules_output_folds_when_the_root_hands_it_over_unchanged():
    """Fails on main 4a5dfa8: b.ln was kept ("an input of b, computed outside the submodules torch.export
    captured") although its input is a's output, a Linear."""
    folded, report = normfold.fold(_non_trivial(Handover()), (_x(),))
    assert report.captured_through == ["a", "b"]
    assert {e.path: e.foldable for e in report.norms} == {"a.ln": True, "b.ln": True}
    assert report.verification.ok and report.verification.max_rel_error < 1e-12
    assert isinstance(folded.b.ln, normfold.RMSNorm)


@pytest.mark.parametrize("after, reason", [
    ("returns", "model output"),  # the root returns a's output too: centering a.out would change it
    ("writes", "an input of b, computed outside"),  # written in place in between: not the tensor a returned
])
def test_a_handed_over_output_the_root_also_reads_or_writes_keeps_the_norm_behind_it(after, reason):
    _, report = normfold.fold(_non_trivial(Handover(after)), (_x(),))
    entry = next(e for e in report.norms if e.path == "b.ln")
    assert not entry.foldable and reason in entry.reason, entry.reason
    assert report.verification.ok


class Glue(nn.Module):
    """The root's own code between two captured blocks: a class token and a position table joined to a's
    output (MiniCPM-V's and LED's embeddings add their parts in uncaptured code), or a nonlinearity."""

    def __init__(self, nonlinear: bool = False):
        super().__init__()
        self.a, self.b, self.nonlinear = Block(), NormFirst(), nonlinear
        self.cls = nn.Parameter(torch.randn(1, 1, C))
        self.pos = nn.Parameter(torch.randn(6, C))

    def forward(self, x):  # x (B, T, C)
        h = self.a(x)
        if x.sum() > 0:  # export stops here; the eager run does not care
            x = x * 2
        pos = self.pos.t().contiguous().t()  # a view of a copy of a view: glue ops on a weight
        h = torch.cat([self.cls.expand(h.shape[0], 1, C), h], dim=1) + pos  # (B, T + 1, C)
        return self.b(torch.relu(h) if self.nonlinear else h)


def test_the_ops_between_captured_submodules_are_followed_so_the_norm_behind_them_folds():
    """Fails on main 1e17f6d: b.ln was kept, its input computed outside the submodules export captured. The
    weights were written in place before (their version counters are not 0), as a loaded model's are: a
    view made of one gets that counter on its way out of the dispatch, not inside it."""
    model = _non_trivial(Glue())
    with torch.no_grad():
        model.pos.mul_(1.0)
    assert model.pos._version > 0
    folded, report = normfold.fold(model, (_x(),))
    entry = next(e for e in report.norms if e.path == "b.ln")
    assert entry.foldable, entry.reason
    assert {"cls", "pos", "a.out.weight", "a.out.bias"} <= set(entry.producers), entry.producers
    assert report.verification.ok and report.verification.max_rel_error < 1e-12


def test_a_nonlinear_op_between_captured_submodules_keeps_the_norm_behind_it_with_its_name():
    _, report = normfold.fold(_non_trivial(Glue(nonlinear=True)), (_x(),))
    entry = next(e for e in report.norms if e.path == "b.ln")
    assert not entry.foldable and "relu" in entry.reason, entry.reason
    assert report.verification.ok


def test_a_submodule_whose_layers_the_root_also_calls_is_not_captured_as_one():
    class Entangled(Branching):
        def forward(self, x):
            h = self.a(x) + self.a.out(x)  # a.out runs outside a's own call: a's graph would miss that use
            if h.sum() > 0:
                h = h * 2
            return self.b(h)

    _, report = normfold.fold(_non_trivial(Entangled()), (_x(),))
    assert "a" not in report.captured_through and "b" in report.captured_through
    # a's layers are captured one by one instead, a.ln's input wired to a.fc's output: it folds, and the
    # second call of a.out (on x) is left as it was
    assert report.captured_through[:3] == ["a.fc", "a.ln", "a.out"]
    assert {e.path: e.foldable for e in report.norms} == {"a.ln": True, "b.ln": True}
    assert report.verification.ok and report.verification.max_rel_error < 1e-12


def test_a_model_without_a_capturable_submodule_still_raises_exports_error():
    class NoBlocks(nn.Module):  # its weights its own: no child module to capture instead
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(C, C))

        def forward(self, x):
            h = x @ self.weight
            return nn.functional.layer_norm(h * 2 if h.sum() > 0 else h, (C,))

    with pytest.raises(FoldError, match="torch.export could not capture NoBlocks"):
        normfold.analyze(NoBlocks(), (_x(),))


def test_inputs_the_original_itself_rejects_are_an_example_inputs_error_not_an_export_limit():
    model = nn.Sequential(Block(), Block())  # takes (B, T, C): an input of width C + 1 fails eagerly too
    with pytest.raises(ExampleInputsError, match=r"not valid for Sequential: the original model itself raises "
                       r"RuntimeError: .*shapes cannot be multiplied") as info:
        normfold.analyze(model, (torch.randn(2, 3, C + 1),))
    assert isinstance(info.value, ValueError) and isinstance(info.value, FoldError)  # the caller's argument


@pytest.mark.slow
def test_longformer_which_export_cannot_capture_folds_its_embedding_norm_through_submodules():
    transformers = pytest.importorskip("transformers")
    config = transformers.LongformerConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                           intermediate_size=64, attention_window=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = _non_trivial(transformers.LongformerModel(config))
    ids = torch.randint(3, 99, (2, 8), generator=torch.Generator().manual_seed(0))
    folded, report = normfold.fold(model, {"input_ids": ids})
    assert "embeddings" in report.captured_through and "Could not guard" in report.whole_model_capture_error
    assert next(e for e in report.norms if e.path == "embeddings.LayerNorm").foldable
    assert report.verification.ok and report.verification.max_rel_error < 1e-12
    assert isinstance(folded.embeddings.LayerNorm, normfold.RMSNorm)


def test_several_example_calls_fold_through_submodules_what_every_call_proves():
    model = _non_trivial(Branching())
    folded, report = normfold.fold(model, [(_x(),), (-_x(),)])  # one merged graph per call, analysed together
    assert report.captured_through == ["a", "b"] and len(report.traced_calls) == 2
    assert all(e.foldable for e in report.norms) and report.verification.ok
