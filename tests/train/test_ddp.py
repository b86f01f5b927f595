"""The training entry point under torchrun: two CPU processes (gloo) stay in lockstep."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch


def test_two_process_ddp_run_ends_with_identical_weights_on_both_ranks(tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "normfold.train", "--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=2",
           "--max_steps=4", "--eval_interval=2", "--eval_iters=1", "--warmup_steps=1", "--device=cpu",
           "--progress=false", "--save_checkpoint=false", "--save_rank_weights=true", f"--out_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    rank0, rank1 = (torch.load(out / f"weights_rank{r}.pt") for r in (0, 1))
    assert rank0.keys() == rank1.keys()
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert summary["tokens"] == 4 * 2 * 2 * 16  # steps · batch · ranks · block
    # the ranks drew different batches, so the weights moved: identical because gradients were averaged
    torch.manual_seed(0)
    from normfold.train import GPT, GPTConfig

    init = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16)).state_dict()
    assert not torch.equal(init["transformer.h.0.mlp.c_fc.weight"], rank0["transformer.h.0.mlp.c_fc.weight"])
