"""The plan executor's contract with its stores: each step's kernel reads, changes and creates only the
tensors the step declares (``reads()``, ``writes()``, ``creates()``), which is all a checkpoint store
knows when it groups keys and sizes the tensors it creates before computing them."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import normfold
from normfold.engine.executor import run
from normfold.engine.graph import parameter_aliases
from normfold.engine.plan import FoldPlan
from normfold.engine.transform import ModuleStore

from test_batchnorm_plan import _model as linear_batchnorm_model
from test_layer_scale import LayerScaleBlocks
from test_partial_centering import _model as fused_qkv_model


class RecordingStore(ModuleStore):
    """The module store, noting every name read and every name written, created or filled."""

    def __init__(self, model):
        super().__init__(model)
        self.read_names, self.written_names = set(), set()

    def read(self, name):
        self.read_names.add(name)
        return super().read(name)

    def write(self, name, value):
        self.written_names.add(name)
        super().write(name, value)

    def create(self, name, value, like):
        self.written_names.add(name)
        super().create(name, value, like)

    def fill(self, name, value):
        self.written_names.add(name)
        super().fill(name, value)


def _tensors(model):
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {name: t.detach().clone() for name, t in named}


def _planned(name, zoo):
    """(model, plan) with every kind of step between them: untie, center, affine fold (Conv1D) and swap
    (GPT-2), a BatchNorm merge creating a bias, removed or kept as an identity, layer scales, and the
    q/k rows of a fused QKV weight centered per head."""
    if name == "fused_qkv":
        model, inputs = fused_qkv_model()
        return model, normfold.analyze(model, inputs).plan
    if name == "gpt2":
        model = zoo.model("gpt2")
        return model, normfold.analyze(model, zoo.inputs("gpt2", 0)).plan
    if name == "layer_scale":
        torch.manual_seed(0)
        model = LayerScaleBlocks().eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
        return model, normfold.analyze(model, (torch.randint(0, 16, (2, 5)),)).plan
    model = linear_batchnorm_model()
    plan = normfold.analyze(model, (torch.randn(4, 6),)).plan
    if name == "batchnorm_kept":
        plan = FoldPlan(batchnorm=[dataclasses.replace(s, keep_module=True) for s in plan.batchnorm])
    return model, plan


@pytest.mark.parametrize("name, kinds", [("gpt2", {"UntieStep", "CenterStep", "AffineFoldStep", "SwapStep"}),
                                         ("layer_scale", {"LayerScaleStep", "CenterStep"}),
                                         ("batchnorm_removed", {"BatchNormFoldStep", "CenterStep"}),
                                         ("batchnorm_kept", {"BatchNormFoldStep"}),
                                         ("fused_qkv", {"CenterGroupsStep", "SwapStep"})])
def test_each_step_touches_only_the_tensors_it_declares(zoo, name, kinds):
    model, plan = _planned(name, zoo)
    model = copy.deepcopy(model)
    assert kinds <= {type(s).__name__ for s in plan.steps()}, plan.to_dict()
    for step in plan.steps():
        aliases = parameter_aliases(model)
        declared = {a for n in step.writes() for a in (n, *aliases.get(n, ()))}
        before = _tensors(model)
        store = RecordingStore(model)
        run([step], store)
        after = _tensors(model)
        assert store.read_names <= set(step.reads()) | set(step.writes()), step
        assert store.written_names <= set(step.writes()), step
        changed = {n for n in before.keys() & after.keys() if not torch.equal(before[n], after[n])}
        assert changed <= declared, (step, changed - declared)
        assert after.keys() - before.keys() <= set(step.creates()), step
        assert set(step.creates()) <= after.keys(), step  # what it declares created, it created
