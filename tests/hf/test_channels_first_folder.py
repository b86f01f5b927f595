"""A ConvNeXt folder folds its channels-first LayerNorm (permute → layer_norm → permute) through the
CLI (issue 33): ``normfold fold`` swaps in an RMSNorm between the same permutes, records the permute
in the report, ``normfold verify`` passes, and both loads (normfold's and stock transformers') give
the original's outputs."""
from __future__ import annotations

import json

import pytest
import torch

import normfold
from normfold.cli import EXIT_OK, main
from normfold.hf.output_dir import REPORT_JSON
from normfold.nn import PermutedRMSNorm
from tiny_models import nontrivial_layer_norms

transformers = pytest.importorskip("transformers")

STEM_NORM = "embeddings.layernorm"  # channels-first, right after the patchifying conv: its producer centers


@pytest.fixture(scope="module")
def convnext_dir(tmp_path_factory):
    config = transformers.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2,
                                         patch_size=2, image_size=16)
    torch.manual_seed(0)
    model = nontrivial_layer_norms(transformers.ConvNextModel(config))
    folder = tmp_path_factory.mktemp("convnext") / "tiny"
    model.save_pretrained(folder)
    return folder


def test_a_convnext_folder_folds_its_channels_first_norm_and_verifies(convnext_dir, tmp_path, capsys):
    out = tmp_path / "folded"
    assert main(["fold", str(convnext_dir), "-o", str(out), "--json"]) == EXIT_OK, capsys.readouterr().err
    report = json.loads((out / REPORT_JSON).read_text())
    swapped = {entry["path"]: entry for entry in report["swapped"]}
    assert swapped[STEM_NORM]["permute"] == [0, 2, 3, 1]
    capsys.readouterr()
    assert main(["verify", str(convnext_dir), str(out)]) == EXIT_OK, capsys.readouterr()

    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    original = transformers.ConvNextModel.from_pretrained(convnext_dir).eval()
    reloaded = normfold.from_pretrained(out).eval()
    stock = transformers.ConvNextModel.from_pretrained(out).eval()
    assert isinstance(reloaded.get_submodule(STEM_NORM), PermutedRMSNorm)
    assert isinstance(stock.get_submodule(STEM_NORM), transformers.models.convnext.modeling_convnext.ConvNextLayerNorm)
    with torch.no_grad():
        expected = original(pixel_values=pixels).last_hidden_state
        for model in (reloaded, stock):
            torch.testing.assert_close(model(pixel_values=pixels).last_hidden_state, expected, rtol=1e-4, atol=1e-5)
