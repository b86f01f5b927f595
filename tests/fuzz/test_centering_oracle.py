"""The brute-force oracle judging many norms at once (``centering_oracle.judge_norms``, what the zoo table's
missed-fold column runs): the same verdict per norm as judging it alone, one run per input for every norm
no centering can make zero-mean, and zero-mean checks that stop the forward once the norm's input is seen."""
from __future__ import annotations


import pytest
import torch
from torch import nn

import centering_oracle
from centering_oracle import Recorders, brute_force, judge_norms
from fold_fuzz import FuzzModel, generate, make_inputs


@pytest.fixture
def runs(monkeypatch) -> list:
    """Every forward the oracle runs (its one entry point, ``call_model``), appended as it starts."""
    seen = []
    original = centering_oracle.call_model

    def counted(model, call, values=None):
        seen.append(call)
        return original(model, call, values)

    monkeypatch.setattr(centering_oracle, "call_model", counted)
    return seen


class NormsOnAStream(nn.Module):
    """``depth`` LayerNorms, each reading x plus a linear map of the previous norm's output: x is not
    zero-mean and no parameter shifts it, so no centering folds any of them; the last two linear maps also
    feed a centerable norm of their own (``side``), which centering them folds."""

    def __init__(self, depth: int = 6, width: int = 8):
        super().__init__()
        self.maps = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.side = nn.LayerNorm(width)
        self.head = nn.Linear(width, 4)

    def forward(self, x):  # x (B, T, C)
        h = x
        for linear, norm in zip(self.maps, self.norms):
            h = norm(x + linear(h))
        return self.head(h), self.head(self.side(self.maps[-1](h)))


def _inputs_and_reference(model, shape=(2, 5, 8)):
    inputs = [(torch.randn(*shape, generator=torch.Generator().manual_seed(s), dtype=torch.float64),) for s in (0, 1)]
    with torch.no_grad():
        return inputs, [model(*i) for i in inputs]


def _recipes(model) -> dict:
    return {name: (0, None) for name, p in model.named_parameters() if name.startswith(("maps", "head"))}


def test_one_run_per_input_confirms_every_norm_that_no_centering_makes_zero_mean(runs):
    torch.manual_seed(0)
    model = NormsOnAStream().double().eval()
    inputs, reference = _inputs_and_reference(model)
    paths = {f"norms.{i}": -1 for i in range(6)}
    verdicts = list(judge_norms(model, _recipes(model), paths, inputs, reference))
    assert [v.verdict for v in verdicts] == ["confirmed"] * 6
    # 2 whole runs, 1 recording what each norm's input depends on, 1 with all of that centered (every norm
    # fails on the first input: the second is not run); judged one by one, each norm took 5 runs (30 here)
    assert len(runs) == 4


def test_judging_norms_together_gives_each_the_verdict_it_gets_alone():
    """The shared runs (one base run, one centering of every norm's producers at once) change no verdict:
    on fuzz models and on a stream whose side norm is foldable, each norm's verdict and the centering it
    names are those of judging it on its own."""
    torch.manual_seed(0)
    stream = NormsOnAStream().double().eval()
    cases = [(stream, _recipes(stream), [f"norms.{i}" for i in range(6)] + ["side"], *_inputs_and_reference(stream))]
    for seed in range(12):
        spec = generate(seed)
        fuzz = FuzzModel(spec).double().eval()
        inputs = [make_inputs(spec, seed * 7919 + k + 1) for k in range(2)]
        with torch.no_grad():
            reference = [fuzz(*i) for i in inputs]
        norms = [name for name, m in fuzz.named_modules() if isinstance(m, nn.LayerNorm)]
        cases.append((fuzz, fuzz.recipes, norms, inputs, reference))
    judged = 0
    for model, recipes, norms, inputs, reference in cases:
        together = {v.path: (v.verdict, v.detail) for v in
                    judge_norms(model, recipes, dict.fromkeys(norms, -1), inputs, reference)}
        alone = {p: (v.verdict, v.detail) for p in norms
                 for v in [brute_force(model, recipes, p, inputs, reference)]}
        assert together == alone, (together, alone)
        judged += len(norms)
    assert judged >= 20 and together  # the comparison saw norms, not empty lists
    side = brute_force(stream, _recipes(stream), "side", *_inputs_and_reference(stream))
    assert side.verdict == "missed" and side.detail == "centering ['maps.5.bias', 'maps.5.weight'] (whole) folds it"


def test_a_zero_mean_check_stops_the_forward_once_the_norm_has_run():
    torch.manual_seed(0)
    model = NormsOnAStream().double().eval()
    head_runs = []
    model.head.register_forward_pre_hook(lambda module, args: head_runs.append(1))
    recorders = Recorders(model, ["norms.1", "norms.3"])
    try:
        x = torch.randn(2, 5, 8, dtype=torch.float64)
        out, values, calls = recorders.run(model, (x,), stop_after={"norms.1": 1, "norms.3": 1})
        assert out is None and not head_runs and set(values) == {"norms.1", "norms.3"}
        out, values, calls = recorders.run(model, (x,))
        assert out is not None and len(head_runs) == 2 and calls == {"norms.1": 1, "norms.3": 1}
    finally:
        recorders.remove()
    assert not model.norms[1]._forward_pre_hooks  # removed


def test_a_norm_a_call_does_not_reach_is_not_judged():
    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(self.proj(x)) if x.shape[0] > 1 else self.proj(x)

    model = Skips().double().eval()
    inputs = [(torch.randn(2, 3, 8, dtype=torch.float64),), (torch.randn(1, 3, 8, dtype=torch.float64),)]
    with torch.no_grad():
        reference = [model(*i) for i in inputs]
    (verdict,) = judge_norms(model, {"proj.weight": (0, None), "proj.bias": (0, None)}, {"norm": -1}, inputs, reference)
    assert verdict.verdict == "not judged" and "does not run on every input" in verdict.detail


def test_a_model_without_parameters_is_judged_in_the_default_dtype():
    """No parameter to center (a norm without γ/β right on the input): confirmed, where the dtype lookup used to
    raise StopIteration (the all-at-once oracle in make fuzz, seed 115)."""
    model = nn.Sequential(nn.LayerNorm(8, elementwise_affine=False)).double().eval()
    inputs, reference = _inputs_and_reference(model)
    (verdict,) = judge_norms(model, {}, {"0": -1}, inputs, reference)
    assert verdict.verdict == "confirmed"


class ArgmaxBetween(nn.Module):
    """A norm whose producer reaches the outputs only through an argmax (CLVP's speech decoder: only the ids it
    picks reach its outputs): centering the producer keeps every output whatever it does to the states."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm, self.table = nn.Linear(8, 8), nn.LayerNorm(8), nn.Embedding(8, 4)

    def forward(self, x):  # x (B, T, 8)
        h = self.proj(x)
        return self.table(h.argmax(-1)), self.table(self.norm(h).argmax(-1))  # (B, T, 4) twice


def test_outputs_reached_only_through_a_discrete_step_judge_nothing():
    """Centering proj keeps both outputs (an argmax ignores a shift shared by a row), so the oracle used to call
    the norm a missed fold (CLVP's speech decoder: 5 such norms). No centered parameter reaches an output
    through differentiable ops, so the unchanged outputs prove nothing: not judged, and said why."""
    torch.manual_seed(0)
    model = ArgmaxBetween().double().eval()
    inputs, reference = _inputs_and_reference(model)
    (verdict,) = judge_norms(model, {"proj.weight": (0, None), "proj.bias": (0, None)}, {"norm": -1}, inputs, reference)
    assert verdict.verdict == "not judged" and "differentiable" in verdict.detail


class DeadHead(nn.Module):
    """A norm whose producer also feeds the output outside the norm, both through a ReLU that is zero
    everywhere (DPT's depth head in a tiny random model predicts zeros): centering proj keeps the outputs only
    because nothing moves them."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm, self.head, self.side = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x):  # x (B, T, 8)
        h = self.proj(x)
        return torch.relu(self.head(self.norm(h)) + self.side(h) - 1e3)  # (B, T, 4), all zeros


@pytest.mark.parametrize("dead", [True, False])
def test_outputs_no_change_of_the_centered_parameters_moves_judge_nothing(dead):
    """With the ReLU dead, centering proj keeps the (zero) outputs, and the oracle called that a missed fold;
    jittering proj moves no output either, so the unchanged outputs prove nothing: not judged, and said why.
    With the ReLU alive, the same centering changes the outputs through ``side``: confirmed, not a missed fold."""
    torch.manual_seed(0)
    model = DeadHead().double().eval()
    if not dead:
        with torch.no_grad():
            model.side.bias += 1e3 + 10.0
    inputs, reference = _inputs_and_reference(model)
    recipes = {"proj.weight": (0, None), "proj.bias": (0, None)}
    (verdict,) = judge_norms(model, recipes, {"norm": -1}, inputs, reference)
    if dead:
        assert verdict.verdict == "not judged" and "jittered" in verdict.detail
    else:
        assert verdict.verdict == "confirmed"


class OneNormTwoStreams(nn.Module):
    """One LayerNorm module applied to two streams (PEGASUS-X's layer norms read its local and its global
    tokens): a global stream that centering ``global_proj`` makes zero-mean, read last, and a local stream
    plus a fixed position table no parameter shifts, read first. A fold replaces the module for both calls,
    so no centering folds it."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.local_proj, self.global_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 4)

    def forward(self, x):  # x (B, T, C)
        positions = torch.arange(x.shape[-1], dtype=x.dtype).expand_as(x)  # (B, T, C), not zero-mean along C
        local = self.norm(self.local_proj(x) + positions)
        global_ = self.norm(self.global_proj(x[:, :1]))  # (B, 1, C)
        return self.head(local), self.head(global_)


def test_a_norm_module_run_twice_is_judged_on_every_call_not_the_last():
    """The oracle kept only the last call's input: it reported this norm as a missed fold (the global call
    zero-mean once global_proj is centered), while the local call can never be: PEGASUS-X's 6 'missed folds'."""
    torch.manual_seed(0)
    model = OneNormTwoStreams().double().eval()
    recipes = {n: (0, None) for n, _ in model.named_parameters() if n.startswith(("local_proj", "global_proj"))}
    verdict = brute_force(model, recipes, "norm", *_inputs_and_reference(model))
    assert verdict.verdict == "confirmed", verdict
