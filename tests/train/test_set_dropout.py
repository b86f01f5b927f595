"""normfold.train.model.set_dropout: every dropout rate of the experiment GPT, changed after building it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from normfold.train import GPT, GPTConfig
from normfold.train.model import set_dropout


def test_set_dropout_reaches_every_dropout_and_the_config():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=8, dropout=0.0))
    set_dropout(model, 0.25)
    assert {m.p for m in model.modules() if isinstance(m, nn.Dropout)} == {0.25}
    assert all(block.attn.attn_dropout == 0.25 for block in model.transformer.h)
    assert model.config.dropout == 0.25


def test_a_model_given_dropout_later_trains_like_one_built_with_it():
    x = torch.randint(256, (2, 8))
    torch.manual_seed(0)
    built = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, dropout=0.5))
    torch.manual_seed(0)
    later = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, dropout=0.0))
    set_dropout(later, 0.5)
    torch.manual_seed(1)
    a = built(x)[0]
    torch.manual_seed(1)
    b = later(x)[0]
    torch.testing.assert_close(a, b)
    torch.manual_seed(1)
    assert not torch.equal(later.eval()(x)[0], a)  # dropout was on in training mode


@pytest.mark.parametrize("model, rate, error", [
    ("gpt", 1.0, ValueError), ("gpt", -0.1, ValueError), ("linear", 0.1, TypeError)])
def test_set_dropout_refuses_bad_rates_and_other_models(model, rate, error):
    target = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8)) if model == "gpt" else nn.Linear(2, 2)
    with pytest.raises(error):
        set_dropout(target, rate)
