"""The registry of steps (normfold.engine.steps): one handler per config type, one runner that checks
before any work, runs the handlers in order and proves every exact step through one prove_or_raise."""
import dataclasses

import pytest
import torch
from torch import nn

import normfold
from normfold import FoldConfig, FoldVerificationError, FuseConfig, RotateConfig, convert
from normfold.engine import steps
from normfold.engine.graph import module_path
from engine.test_batchnorm_plan import _model as linear_batchnorm_model
from normfold.engine.steps import StepContext, register_step, run_steps
from normfold.fuse import rewrite
from normfold.lab import BatchNormConfig


class PreLN(nn.Module):
    """emb → ln1 → fc with a residual add → ln2 → head: both norms fold, the add feeds ln2."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.ln1, self.ln2 = nn.LayerNorm(16), nn.LayerNorm(16)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.fc(self.ln1(h))
        return self.head(self.ln2(h))


class MustNotRun(PreLN):
    def forward(self, x):
        raise AssertionError("a step ran before every config was checked")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return PreLN().eval()


def _x():
    return (torch.randn(2, 5, 8),)


@dataclasses.dataclass(frozen=True)
class Scale:
    """A step a test registers: the model's output times ``factor``."""

    factor: float = 2.0


@dataclasses.dataclass
class ScaleSection:
    seen_calls: int
    previous: list

    def to_dict(self) -> dict:
        return {"seen_calls": self.seen_calls}


class _Scaled(nn.Module):
    def __init__(self, inner: nn.Module, factor: float):
        super().__init__()
        self.inner, self.factor = inner, factor

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs) * self.factor


def _scale_step(model, calls, config: Scale, context: StepContext):
    return _Scaled(model, config.factor), ScaleSection(len(calls), list(context.sections))


@pytest.fixture
def registry(monkeypatch):
    """The registry as it is, restored after the test (a test's registrations do not leak)."""
    monkeypatch.setattr(steps, "_STEPS", dict(steps._STEPS))
    return steps


# ------------------------------------------------------------------------------------ the registry

def test_a_registered_config_runs_its_handler_after_the_steps_before_it(registry):
    register_step(Scale, _scale_step, section="scale", section_type=ScaleSection, proof=None)
    model, x = _model(), _x()
    converted, report = convert(model, [x, _x()], Scale(3.0))
    assert report.sections["scale"] == ScaleSection(2, [FoldConfig])  # both calls, after the fold
    assert report.to_dict()["scale"] == {"seen_calls": 2}
    assert torch.allclose(converted(*x), 3.0 * model(*x), atol=1e-5)


@dataclasses.dataclass(frozen=True)
class SeeGraph:
    """A step a test registers: it records the graphs the runner handed it."""


@dataclasses.dataclass(frozen=True)
class SeeGraphAgain(SeeGraph):
    pass


@dataclasses.dataclass
class GraphSection:
    captured: object

    def to_dict(self) -> dict:
        return {}


def _see_graph_step(model, calls, config, context: StepContext):
    return model, GraphSection(context.captured)


def test_the_fold_hands_its_graph_to_the_next_step_only(registry):
    # fusion reads the add -> norm pairs from the fold's torch.export graph instead of capturing it again
    for config_type in (SeeGraph, SeeGraphAgain):
        register_step(config_type, _see_graph_step, section=config_type.__name__, section_type=GraphSection, proof=None)
    model = _model()
    _, sections = run_steps(model, _x(), [FoldConfig(), SeeGraph(), SeeGraphAgain()])
    handed = sections[SeeGraph].captured
    paths = {module_path(node) for node in handed.graphs[0].graph.nodes}
    assert {"ln1", "ln2"} <= paths and handed.submodules == ()   # the whole model's graph, its norms in it
    assert sections[SeeGraphAgain].captured is None   # a step that captured nothing hands nothing on
    _, sections = run_steps(model, _x(), [SeeGraph()])
    assert sections[SeeGraph].captured is None        # no fold before it: no graph


def test_the_fold_hands_no_graph_where_an_identity_batchnorm_stays_that_the_graph_lacks(registry):
    # the graph the fold planned from has the BatchNorm merged away; a model that keeps it would not match it
    register_step(SeeGraph, _see_graph_step, section="SeeGraph", section_type=GraphSection, proof=None)
    model, x = linear_batchnorm_model(), (torch.randn(4, 6),)
    folded, sections = run_steps(model, x, [FoldConfig(keep_modules_in=torch.float32), SeeGraph()])
    assert isinstance(folded.bn, nn.BatchNorm1d) and sections[SeeGraph].captured is None
    folded, sections = run_steps(model, x, [FoldConfig(), SeeGraph()])
    assert isinstance(folded.bn, nn.Identity) and sections[SeeGraph].captured is not None


def test_a_config_type_takes_one_handler(registry):
    register_step(Scale, _scale_step, section="scale", section_type=ScaleSection, proof=None)
    register_step(Scale, _scale_step, section="scale", section_type=ScaleSection, proof=None)  # a reload: the same
    with pytest.raises(ValueError, match="Scale already runs .*_scale_step, got a second handler"):
        register_step(Scale, lambda model, calls, config, context: (model, None), section="scale",
                      section_type=ScaleSection, proof=None)


def test_an_unknown_config_is_a_type_error_naming_the_registered_configs_before_any_work():
    with pytest.raises(TypeError, match=r"registered configs \(FoldConfig, FuseConfig, ApproximateConfig, "
                                        r"BatchNormConfig, QuantizeConfig, RotateConfig\), got Scale"):
        convert(MustNotRun().eval(), _x(), FuseConfig(), Scale())
    with pytest.raises(TypeError, match="got dict"):
        run_steps(MustNotRun().eval(), _x(), [{"fold_affine": True}])


@pytest.mark.parametrize("configs, match", [
    ((FuseConfig(), FuseConfig()), "each step runs at most once, got FuseConfig more than once"),
    ((FuseConfig(), FoldConfig()), "the exact fold runs first, once: .* another FoldConfig at step 2"),
])
def test_a_step_twice_or_a_late_fold_is_refused_before_any_work(configs, match):
    with pytest.raises(ValueError, match=match):
        convert(MustNotRun().eval(), _x(), *configs)


def test_configs_are_checked_when_built_before_any_step_runs():
    with pytest.raises(ValueError, match=r"method must be one of \('hadamard', 'random', 'pca', 'learned'\), got 'quarot'"):
        RotateConfig(method="quarot")
    with pytest.raises(TypeError, match="BatchNormConfig.verify must be a bool, got int"):
        BatchNormConfig(verify=1)
    with pytest.raises(ValueError, match="BatchNormConfig.tolerance must be a finite number > 0, got nan"):
        BatchNormConfig(tolerance=float("nan"))


# ------------------------------------------------------------------------------------ the fold's options

def test_the_fold_options_are_one_definition_that_stock_planning_keeps():
    from normfold.engine.plan import PlanConstraints
    assert PlanConstraints is FoldConfig
    stock = FoldConfig(fold_affine=False, verify=False).for_stock_checkpoint(["lm_head.weight"], torch.float16)
    assert (stock.fold_affine, stock.verify, stock.precompute, stock.stock_compatible) == (False, False, False, True)
    assert stock.loadable_keys == frozenset({"lm_head.weight"}) and stock.keep_modules_in == torch.float16
    assert not stock.may_create("lm_head.bias")


# ------------------------------------------------------------------------------------ one proof

def _wrong_fused_op(monkeypatch):
    def wrong(norm, a, b):
        h = a + b
        return norm(h) * 1.001, h
    monkeypatch.setattr(rewrite, "add_norm", wrong)  # what the generated forward calls


def test_convert_proves_the_fused_model_against_the_unfused_one(monkeypatch):
    """Before, convert fused the folded model in place and then compared it with itself (error 0)."""
    _wrong_fused_op(monkeypatch)
    with pytest.raises(FoldVerificationError, match="fused model differs from the unfused one: float64 max relative "
                                                    "error 8.*> 1.0e-09"):
        convert(_model(), _x(), FuseConfig())


def test_a_step_whose_config_says_verify_false_is_not_proved(monkeypatch):
    _wrong_fused_op(monkeypatch)
    _, report = convert(_model(), _x(), FuseConfig(verify=False))
    assert [p.norm for p in report.fuse.fused] == ["ln2"] and report.fuse.verification is None


class EmptyOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), normfold.RMSNorm(8)

    def forward(self, x):
        return self.norm(self.lin(x) + x)[:0]


def test_a_fusion_that_compared_nothing_fails_saying_why():
    with pytest.raises(FoldVerificationError, match="fused model differs from the unfused one: compared nothing"):
        normfold.fuse_residual_norms(EmptyOutput().eval(), (torch.randn(2, 8),))


class Bottleneck(PreLN):
    """PreLN whose residual branch reads and writes the stream through two linears (rotatable)."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.out(torch.relu(self.fc(self.ln1(h))))
        return self.head(self.ln2(h))


def test_rotation_is_a_step_of_convert_after_the_fold():
    torch.manual_seed(0)
    model, x = Bottleneck().eval(), _x()
    rotated, report = convert(model, x, RotateConfig(method="random", seed=1))
    rotation = report.sections["rotation"]
    assert report.verification.ok and rotation.verification.ok and rotation.method == "random"
    assert report.to_dict()["rotation"]["seed"] == 1
    torch.testing.assert_close(rotated(*x), model(*x), atol=1e-5, rtol=1e-5)
