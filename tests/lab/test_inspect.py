"""normfold.inspect: per-norm input statistics and the activation-scale trace."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import normfold
from normfold.lab import InspectResult


class _Block(nn.Module):
    """A tiny Post-LN block with every kind of norm the lab recognises."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(16)
        self.rms = normfold.nn.RMSNorm(16)
        self.torch_rms = nn.RMSNorm(16)
        self.conv = nn.Conv1d(16, 8, 1)
        self.bn = nn.BatchNorm1d(8)
        self.gn = nn.GroupNorm(2, 8)

    def forward(self, x):  # x: (B, T, 8)
        h = self.torch_rms(self.rms(self.ln(self.proj(x))))  # (B, T, 16)
        c = self.conv(h.transpose(1, 2))  # (B, 8, T)
        return self.gn(self.bn(c))


def test_norm_stats_match_direct_computation():
    torch.manual_seed(0)
    model = _Block().eval()
    batches = [torch.randn(3, 5, 8) + 2.0 for _ in range(2)]
    result = normfold.inspect(model, batches)
    assert [s.path for s in result.norms] == ["ln", "rms", "torch_rms", "bn", "gn"]
    assert [s.kind for s in result.norms] == ["LayerNorm", "RMSNorm", "RMSNorm", "BatchNorm", "GroupNorm"]
    with torch.no_grad():
        x = torch.cat([model.proj(b) for b in batches]).reshape(-1, 16).double()  # (30, 16)
    ln = result.norms[0]
    assert ln.num_rows == 30
    assert ln.mean == pytest.approx(x.mean().item(), rel=1e-9)
    assert ln.rms == pytest.approx(x.square().mean().sqrt().item(), rel=1e-9)
    ratio = x.mean(-1).abs() / x.square().mean(-1).sqrt()
    assert ln.mean_over_rms == pytest.approx(ratio.mean().item(), rel=1e-9)
    assert ln.max_mean_over_rms == pytest.approx(ratio.max().item(), rel=1e-9)
    assert ln.feature_mean == pytest.approx(x.mean(0).tolist(), rel=1e-9, abs=1e-12)
    # the LayerNorm's output is zero-mean per row: what the RMSNorm after it receives
    assert result.norms[1].max_mean_over_rms < 1e-5


def test_channel_norm_features_are_dim_one():
    torch.manual_seed(0)
    model = _Block().eval()
    result = normfold.inspect(model, torch.randn(3, 5, 8))
    bn = result.to_dict()["norms"][3]
    assert len(bn["feature_mean"]) == 8 and bn["num_rows"] == 15  # (B·T) positions of 8 channels


def test_padded_tokens_are_excluded_from_stats():
    class Tok(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.ln = nn.LayerNorm(4)

        def forward(self, input_ids, attention_mask):
            return self.ln(self.emb(input_ids))

    torch.manual_seed(0)
    model = Tok()
    with torch.no_grad():
        model.emb.weight[0] = 1000.0  # the padding token: would dominate every statistic
    ids = torch.tensor([[1, 2, 3], [4, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    stats = normfold.inspect(model, {"input_ids": ids, "attention_mask": mask}).norms[0]
    assert stats.num_rows == 4
    assert abs(stats.mean) < 10


def test_scale_trace_reproduces_the_relu_mlp_decay_in_execution_order():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
    x = torch.randn(64, 784)
    result = normfold.inspect(mlp, x)
    assert [p.path for p in result.scale] == ["0", "2", "4"]
    assert all(p.role == "linear output" for p in result.scale)
    with torch.no_grad():
        h1 = mlp[0](x)
    assert result.scale[0].rms == pytest.approx(h1.double().square().mean().sqrt().item(), rel=1e-9)
    rms = [p.rms for p in result.scale]
    assert rms[0] > rms[1] > rms[2]  # seed 001's decay, seen on the pre-activation scale


def test_table_to_dict_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    result = normfold.inspect(_Block().eval(), (torch.randn(2, 4, 8),))
    assert isinstance(result, InspectResult)
    text = result.table()
    assert "ln" in text and "|mean|/rms" in text
    d = result.to_dict()
    assert d["num_batches"] == 1 and len(d["norms"]) == 5 and d["scale"]
    png = result.plot(tmp_path / "inspect.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_leaves_model_and_mode_untouched():
    torch.manual_seed(0)
    model = _Block().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    normfold.inspect(model, torch.randn(2, 4, 8))
    assert model.training
    assert len(model.bn._forward_pre_hooks) == 0 and len(model.proj._forward_hooks) == 0
    # BatchNorm in train mode updates its running stats as the user's model would; parameters are untouched
    for k, v in model.state_dict().items():
        if "running" not in k and "num_batches" not in k:
            assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("bad", [None, 3, [], ["text"]])
def test_refuses_inputs_that_are_not_batches(bad):
    with pytest.raises((TypeError, ValueError)):
        normfold.inspect(nn.Linear(2, 2), bad)


def test_refuses_non_module():
    with pytest.raises(TypeError, match="nn.Module"):
        normfold.inspect(lambda x: x, torch.randn(2, 2))


def test_inspect_shows_a_bar_over_the_batches_on_stderr_only(monkeypatch, capsys):
    pytest.importorskip("tqdm")
    monkeypatch.setenv("NORMFOLD_PROGRESS", "1")
    normfold.inspect(_Block().eval(), [torch.randn(2, 3, 8) for _ in range(3)])
    out, err = capsys.readouterr()
    assert out == "" and "inspect: batches" in err


def test_inspect_is_silent_when_progress_is_off(monkeypatch, capsys):
    monkeypatch.setenv("NORMFOLD_PROGRESS", "0")
    normfold.inspect(_Block().eval(), [torch.randn(2, 3, 8) for _ in range(3)])
    assert capsys.readouterr() == ("", "")


def test_import_normfold_lab_needs_no_matplotlib_or_rich():
    code = ("import sys, normfold.lab\n"
            "heavy = [m for m in ('matplotlib', 'rich', 'transformers') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True)
