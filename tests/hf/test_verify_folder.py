"""``normfold.verify_folder``: what ``normfold verify`` runs, as a Python call (``normfold/folders.py``
composes the steps hf cannot import: approximate folds and rotations)."""
from __future__ import annotations

import shutil

import pytest

import normfold
from normfold.hf import fold_folder

safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def folded_gpt2(tmp_path_factory, tiny_dirs):
    out = tmp_path_factory.mktemp("folders") / "gpt2-folded"
    fold_folder(tiny_dirs["gpt2"], out)
    return tiny_dirs["gpt2"], out


def test_verify_folder_passes_a_folder_normfold_made(folded_gpt2):
    orig, folded = folded_gpt2
    result = normfold.verify_folder(orig, folded)
    assert result["ok"], result["why"]
    assert result["files"]["num_files"] > 0 and result["outputs"]["ok"]


def test_verify_folder_fails_a_folder_whose_weights_changed(folded_gpt2, tmp_path):
    orig, folded = folded_gpt2
    copy = tmp_path / "changed"
    shutil.copytree(folded, copy)
    weights = safetensors_torch.load_file(copy / "model.safetensors")
    name = next(k for k in weights if k.endswith("mlp.c_proj.weight"))
    weights[name] = weights[name] * 1.5
    safetensors_torch.save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    result = normfold.verify_folder(orig, copy)
    assert not result["ok"] and result["problems"]


@pytest.mark.parametrize("kwargs, error", [
    ({"min_cosine": 1.5}, ValueError),
    ({"calibration_file": "no-such-calibration.txt"}, FileNotFoundError),
])
def test_verify_folder_refuses_bad_options_before_any_work(folded_gpt2, kwargs, error):
    orig, folded = folded_gpt2
    with pytest.raises(error):
        normfold.verify_folder(orig, folded, **kwargs)


def test_verify_folder_is_a_lazy_public_name():
    assert "verify_folder" in normfold.__all__ and normfold.verify_folder is normfold.folders.verify_folder


def test_a_folder_with_a_weight_normed_conv_folds_and_verifies(tmp_path):
    """Wav2Vec2's positional conv is weight-normed (a torch parametrization: a new class per module), so the
    folded model's conv and a stock model's were never the same class: every wav2vec2 / HuBERT / WavLM / SEW
    folder was refused ("encoder.pos_conv_embed.conv is a ParametrizedConv1d where Wav2Vec2Model has a
    ParametrizedConv1d"). Found by benchmarks/cli_zoo.py; fails on main 4eb063d."""
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, conv_dim=(32, 32), conv_stride=(5, 2),
                                         conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                                         do_stable_layer_norm=True)
    torch.manual_seed(0)
    model = transformers.Wav2Vec2Model(config)
    assert torch.nn.utils.parametrize.is_parametrized(model.encoder.pos_conv_embed.conv)
    orig, folded = tmp_path / "wav2vec2", tmp_path / "folded"
    model.save_pretrained(orig)
    fold_folder(orig, folded)
    result = normfold.verify_folder(orig, folded)
    assert result["ok"], result["why"]
