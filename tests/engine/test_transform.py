"""engine.transform's module surgery: the one norm swap (norm_like / swap_norm) and the one config
untying (untie_config) that the fold, the Hugging Face reload, CBWC and the approximate fold share."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import normfold
from normfold.engine.plan import SwapStep
from normfold.engine.transform import norm_like, swap_norm, untie_config
from normfold.nn import RMSNorm
from normfold.train.model import GPT, GPTConfig


def _layer_norm(dtype=torch.float64) -> nn.LayerNorm:
    ln = nn.LayerNorm(8, dtype=dtype)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-1, 1)
    return ln


def test_norm_like_copies_gamma_beta_onto_the_old_dtype_and_keeps_its_eval_mode():
    old = _layer_norm().eval()
    new = norm_like(old, RMSNorm, 8, 1e-5, weight=old.weight.float(), bias=old.bias)
    assert isinstance(new, RMSNorm) and not new.training and new.eps == 1e-5
    assert new.weight.dtype == torch.float64 and torch.equal(new.bias, old.bias)
    assert new.weight is not old.weight and new.bias is not old.bias


def test_norm_like_sharing_holds_the_same_parameters():
    old = _layer_norm()
    new = norm_like(old, RMSNorm, 8, 1e-5, weight=old.weight, bias=old.bias, share_parameters=True)
    assert new.weight is old.weight and new.bias is old.bias and new.training


def test_norm_like_beta_without_gamma_has_unit_gamma_and_neither_has_no_affine():
    old = _layer_norm()
    beta_only = norm_like(old, RMSNorm, 8, 1e-5, weight=None, bias=old.bias)
    assert torch.equal(beta_only.weight, torch.ones(8, dtype=torch.float64))
    bare = norm_like(old, nn.LayerNorm, 8, 1e-5, weight=None, bias=None)
    assert bare.weight is None and bare.bias is None


@pytest.mark.parametrize("to, cls", [("RMSNorm", RMSNorm), ("LayerNorm", nn.LayerNorm), ("Identity", nn.Identity)])
def test_swap_norm_puts_the_planned_module_at_the_path(to, cls):
    model = nn.Sequential(nn.Linear(8, 8), _layer_norm(torch.float32)).eval()
    swap_norm(model, SwapStep("1", to, 8, 1e-6, True, True))
    assert type(model[1]) is cls and not model[1].training


def _gpt(tied: bool = True) -> GPT:
    return GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16, tie_embeddings=tied)).eval()


def test_untie_config_unties_only_embeddings_that_no_longer_share():
    model = _gpt()
    untie_config(model)  # still shared: the config must keep saying so
    assert model.config.tie_embeddings
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    untie_config(model)
    assert not model.config.tie_embeddings


class _WrappedEmbeddings(nn.Module):  # an input embedding without a weight of its own (CSM's holds its tables)
    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.table = table


def test_untie_config_reads_sharing_from_the_parameters_of_an_embedding_module_without_a_weight():
    """Failed on main 6958916 with AttributeError: 'CsmBackboneModelEmbeddings' object has no attribute 'weight'
    (normfold fold of a CSM folder, found by benchmarks/cli_zoo.py)."""
    model = _gpt()
    model.get_input_embeddings = lambda: _WrappedEmbeddings(model.transformer.wte)
    untie_config(model)  # the wrapped table is still the head's weight: tied
    assert model.config.tie_embeddings
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    untie_config(model)
    assert not model.config.tie_embeddings


def test_untie_config_leaves_a_model_without_embeddings_alone():
    model = nn.Linear(2, 2)
    model.config = SimpleNamespace(tie_word_embeddings=True)
    untie_config(model)
    assert model.config.tie_word_embeddings


def test_folding_a_tied_normfold_gpt_marks_its_config_untied():
    # The fold gives lm_head its own (uncentered) copy; a config still saying "tied" rebuilds a
    # model whose head is the centered table again. Only tie_word_embeddings was untied before.
    model = _gpt()
    folded, report = normfold.fold(model, (torch.randint(0, 32, (2, 8)),))
    assert report.untied and folded.lm_head.weight is not folded.transformer.wte.weight
    assert not folded.config.tie_embeddings
    assert model.config.tie_embeddings  # the original model keeps its own config
