"""Seed 001's phenomena: each example in examples/seed001_phenomena.py asserts its claim and runs."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "seed001_phenomena.py"


@pytest.fixture(scope="module")
def seed001():
    spec = importlib.util.spec_from_file_location("seed001_phenomena", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_relu_mlp_std_decays_as_the_seed_prints(seed001):
    stds = seed001.demo_activation_decay(seed=0)
    assert [round(s, 2) for s in stds] == [0.34, 0.14, 0.06]


@pytest.mark.parametrize("seed", [1, 2])
def test_relu_mlp_decay_rate_holds_for_other_seeds(seed001, seed):
    stds = seed001.demo_activation_decay(seed=seed)
    assert stds[0] > stds[1] > stds[2]


def test_batch_mean_spread_is_one_over_sqrt_batch(seed001):
    spread = seed001.demo_batch_mean_noise()
    assert [round(s, 2) for s in spread.values()] == [0.71, 0.35, 0.18, 0.09]
    for b, s in spread.items():
        assert s == pytest.approx(1 / math.sqrt(b), rel=0.05)


def test_batchnorm_collapses_at_batch_one_in_train_mode_and_eval_mode_fixes_it(seed001):
    r = seed001.demo_batchnorm_batch_of_one()
    assert r["train_offset_effect"] < 1e-5 < 0.1 < r["eval_offset_effect"]


def test_group_layer_rms_norm_ignore_the_batch_and_batchnorm_does_not(seed001):
    r = seed001.demo_batch_independence()
    assert max(r["GroupNorm"], r["LayerNorm"], r["RMSNorm"]) < 1e-5
    assert r["BatchNorm2d (train)"] > 0.1


def test_rmsnorm_is_scale_but_not_shift_invariant(seed001):
    r = seed001.demo_rmsnorm_invariances()
    assert r["rms_scale"] < 1e-12 and r["rms_shift"] > 0.1


def test_example_main_runs_every_demo(seed001, capsys):
    seed001.main()
    out = capsys.readouterr().out
    assert out.count(" ok ") == len(seed001.DEMOS)
