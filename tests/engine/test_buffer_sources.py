"""Buffers as zero-mean sources (issue 33): a constant table saved with the weights (a persistent
buffer the forward never writes, e.g. sinusoidal positions) is centered like a parameter; a buffer
the model rebuilds at load (non-persistent) or writes in its forward is refused with that reason."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import normfold
from normfold.engine import FoldError
from test_rules import B, C, T, _x, fold_checked, reason_of


def sinusoidal_table(length: int, width: int) -> torch.Tensor:
    """The transformer's fixed position table: sin/cos of position over geometric frequencies."""
    position = torch.arange(length).unsqueeze(1)
    frequency = torch.exp(torch.arange(0, width, 2) * (-math.log(10000.0) / width))
    table = torch.zeros(length, width)
    table[:, 0::2], table[:, 1::2] = torch.sin(position * frequency), torch.cos(position * frequency)
    return table


class SinusoidalPositions(nn.Module):
    def __init__(self, persistent: bool = True, written: bool = False):
        super().__init__()
        self.written = written
        self.fc = nn.Linear(C, C)
        self.register_buffer("positions", sinusoidal_table(T, C), persistent=persistent)
        self.norm = nn.LayerNorm(C)

    def forward(self, x):  # (B, T, C)
        out = self.norm(self.fc(x) + self.positions)
        if self.written:
            self.positions.mul_(1.0)  # a buffer the forward writes is state, whatever the value
        return out


def test_a_persistent_constant_buffer_is_centered_with_the_weights_and_the_norm_folds():
    folded, report = fold_checked(SinusoidalPositions(), (_x(B, T, C),), {"norm": True})
    assert report.norms[0].producers == ("fc.bias", "fc.weight", "positions")
    saved = folded.state_dict()["positions"]  # what save_pretrained / torch.save write: the centered table
    assert saved.double().mean(-1).abs().max() < 1e-6
    assert not torch.allclose(saved, sinusoidal_table(T, C))


@pytest.mark.parametrize("persistent, written, reason", [
    (False, False, "buffer positions is not saved with the weights (non-persistent: the model rebuilds it at load)"),
    (True, True, "buffer positions is written by the forward: state, not a constant"),
])
def test_a_buffer_rebuilt_at_load_or_written_by_the_forward_is_refused(persistent: bool, written: bool, reason: str):
    _, report = fold_checked(SinusoidalPositions(persistent, written), (_x(B, T, C),), {"norm": False})
    assert reason in reason_of(report, "norm")


class PositionsIntoAHead(nn.Module):
    """Token embeddings plus a persistent position table, a LayerNorm, a linear head."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(11, C)
        self.register_buffer("positions", sinusoidal_table(T, C))
        self.norm = nn.LayerNorm(C)
        self.head = nn.Linear(C, 3)

    def forward(self, ids):  # (B, T)
        return self.head(self.norm(self.tok(ids) + self.positions))


def test_rotation_refuses_a_stream_that_a_centered_buffer_writes():
    ids = torch.randint(0, 11, (B, T), generator=torch.Generator().manual_seed(0))
    folded, report = normfold.fold(PositionsIntoAHead().eval(), (ids,), precompute=False)
    assert report.norms[0].producers == ("positions", "tok.weight")
    with pytest.raises(FoldError, match="buffer positions writes the stream: only parameters are rotated"):
        normfold.rotate(folded, (ids,))
