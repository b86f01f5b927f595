"""Two CPU ranks under torchrun (gloo) take one process's steps: DDP and FSDP2 (``fully_shard``) against a single
process training on both ranks' batches together, with CBWC and gradient accumulation.

Tolerance: the curves are float32, and the ranks sum the same numbers in another order (each rank's mean,
then the average over ranks; FSDP2's reduce-scatter) than one process does: a few float32 ulps per step
(measured: 9e-8 relative in the loss, 2e-7 in the gradient norm over 8 steps). rtol 1e-5 leaves room
for that to grow with the steps; what goes wrong instead is far larger: FSDP2 with the centered weights
cached across micro-batches (the gradient through an earlier micro-batch's V arrives after the
reduce-scatter) is off by 1.3e-3 in the loss and 28% in the gradient norm. The gradient norms are compared
too, because AdamW and clipping hide a gradient off by a constant factor (a sum instead of a mean) from the loss.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import torch as safetensors_torch

from normfold.train import resolve_config, train
from normfold.train.cbwc import project_centering_
from normfold.train.trainer import build_model

HERE = Path(__file__).resolve().parent
OPTIONS = ["--n_layer=2", "--n_head=2", "--n_embd=16", "--block_size=16", "--max_steps=8", "--eval_interval=4",
           "--eval_iters=1", "--warmup_steps=1", "--device=cpu", "--precision=fp32", "--progress=false",
           "--save_checkpoint=false", "--save_rank_weights=true", "--norm=cbwc_rmsnorm", "--grad_accum_steps=2"]
RANKS, BATCH = 2, 2
RTOL = 1e-5


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """One process with the batch of both ranks together (batch_size · ranks per micro-batch)."""
    out = tmp_path_factory.mktemp("single")
    config = resolve_config(overrides=[*OPTIONS, f"--batch_size={BATCH * RANKS}", f"--out_dir={out}"])
    return train(config), torch.load(out / "weights_rank0.pt")


@pytest.mark.xdist_group("torchrun")  # two processes each: one such test at a time on 2 cores
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_ranks_follow_the_single_process_curves_to_float32_rounding(tmp_path, single_process, parallel):
    reference, reference_weights = single_process
    out = tmp_path / parallel
    checkpoint = ["--save_checkpoint=true"] if parallel == "fsdp2" else []  # written from the sharded weights
    _torchrun("-m", "normfold.train", *OPTIONS, *checkpoint, f"--batch_size={BATCH}", f"--parallel={parallel}",
              f"--out_dir={out}")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == RANKS and summary["parallel"] == parallel and summary["steps"] == 8
    assert summary["tokens"] == 8 * 2 * BATCH * RANKS * 16  # steps · micro-batches · batch · ranks · block
    for key in ("train_losses", "grad_norms"):
        torch.testing.assert_close(torch.tensor(summary[key]), torch.tensor(reference[key]), rtol=RTOL, atol=0,
                                   msg=key)
    assert [step for step, _ in summary["val_losses"]] == [4, 8]
    torch.testing.assert_close(torch.tensor(summary["val_losses"]), torch.tensor(reference["val_losses"]),
                               rtol=RTOL, atol=0)
    assert reference["train_losses"][-1] < reference["train_losses"][0]  # it trained: the curves are not flat
    rank0, rank1 = (torch.load(out / f"weights_rank{r}.pt") for r in range(RANKS))
    assert rank0.keys() == rank1.keys()
    for name, weight in rank0.items():
        assert torch.equal(weight, rank1[name]), name  # whole (gathered) weights, identical on both ranks
    ours, theirs = _what_the_model_reads(rank0), _what_the_model_reads(reference_weights)
    assert ours.keys() == theirs.keys()
    for name, weight in ours.items():
        torch.testing.assert_close(weight, theirs[name], rtol=1e-4, atol=1e-6, msg=name)
    if parallel == "fsdp2":  # the GPT-2 folder holds the gathered free weights (Conv1D: transposed)
        assert summary["checkpoint"] == "gpt2"
        saved = safetensors_torch.load_file(out / "checkpoint" / "model.safetensors")
        assert torch.equal(saved["transformer.h.1.mlp.c_proj.weight"],
                           rank0["transformer.h.1.mlp.c_proj.parametrizations.weight.original"].t())
        assert torch.equal(saved["transformer.wte.weight"], rank0["transformer.wte.parametrizations.weight.original"])


def _what_the_model_reads(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights under their plain names, each CBWC-centered tensor as V = P·W: one process and DDP train those
    by projection (plain Parameters holding V), FSDP2 through the parametrization (the free W, whose mean
    along the centered dim drifts unseen), so only V is comparable. The tied table stays free in both."""
    model = build_model(resolve_config(overrides=OPTIONS))
    project_centering_(model)
    centering = {f"{path}.{attr}": c for path, module in model.named_modules()
                 for attr, c in module.__dict__.get("_cbwc_projected", {}).items()}
    plain = {name.replace(".parametrizations.", ".").replace(".original", ""): w for name, w in weights.items()}
    return {name: centering[name].center(w) if name in centering else w for name, w in plain.items()}


@pytest.fixture(scope="module")
def fsdp2_checks(tmp_path_factory) -> str:
    """What tests/train/fsdp2_checks.py prints under torchrun (one launch for both checks)."""
    return _torchrun(str(HERE / "fsdp2_checks.py"), str(tmp_path_factory.mktemp("fsdp2_resume"))).stdout


@pytest.mark.xdist_group("torchrun")
def test_cbwc_centers_a_weight_sharded_by_fsdp2_along_the_sharded_dim(fsdp2_checks):
    assert "checked 10 sharded centered weights, 8 centered along the sharded dim" in fsdp2_checks


@pytest.mark.xdist_group("torchrun")
def test_an_fsdp2_run_resumed_gives_the_uninterrupted_curves_bitwise(fsdp2_checks):
    assert "resumed from step 4; bitwise equal: train_losses, grad_norms, val_losses" in fsdp2_checks


def test_parallel_must_name_a_strategy():
    with pytest.raises(ValueError, match=r"parallel must be one of \('ddp', 'fsdp2'\), got 'fsdp'"):
        resolve_config(parallel="fsdp")


def test_the_command_line_does_not_import_torch_distributeds_heavy_modules():
    # every normfold command imports normfold.train.parallel; FSDP, DTensor and checkpoint cost ~1.5 s
    code = ("import sys, normfold.cli; print(sorted(m for m in ('torch.distributed.fsdp', 'torch.distributed.tensor', "
            "'torch.distributed.checkpoint') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr
