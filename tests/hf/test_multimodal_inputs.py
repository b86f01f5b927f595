"""Example inputs a multimodal folder's model accepts, built from its config and its forward's signature:
text with pixels wherever the forward takes both, one image token per image feature for models that
merge image features into their text, boxes for document models, region features for LXMERT; and
`normfold fold DIR` over tiny folders of such types folds (exit 0, never a traceback)."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch

from normfold.cli import main
from normfold.hf.inputs import example_inputs_for

transformers = pytest.importorskip("transformers")

TINY_TEXT = dict(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=64)
TINY_VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=32,
                   patch_size=8)
IMAGE_TOKEN = 3


def _tiny(model_type: str):
    """A tiny config of ``model_type`` whose every id fits its vocabulary."""
    if model_type == "lxmert":
        return transformers.LxmertConfig(vocab_size=99, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                         l_layers=1, x_layers=1, r_layers=1, visual_feat_dim=16, visual_pos_dim=4)
    if model_type == "git":
        return transformers.GitConfig(vision_config=TINY_VISION, **TINY_TEXT)
    if model_type == "llava":
        return transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**TINY_VISION),
                                        text_config=transformers.LlamaConfig(**TINY_TEXT, num_key_value_heads=2),
                                        image_token_id=IMAGE_TOKEN, projector_hidden_act="gelu")
    raise KeyError(model_type)


def _model(model_type: str):
    config = _tiny(model_type)
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config).eval()


def test_a_model_merging_image_features_into_text_gets_one_image_token_per_feature():
    model = _model("llava")
    inputs = example_inputs_for(model)
    with torch.no_grad():
        features = model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
        model(**inputs)  # runs: the tokens and the features match
    per_row = (inputs["input_ids"] == IMAGE_TOKEN).sum(dim=1)
    assert per_row.tolist() == [f.shape[0] for f in features] and int(per_row[0]) > 0


def test_a_model_taking_text_and_pixels_gets_both():
    inputs = example_inputs_for(_model("git"))
    assert {"input_ids", "pixel_values"} <= set(inputs)


def test_document_models_get_ordered_boxes_within_their_2d_positions():
    config = transformers.LayoutLMConfig(**TINY_TEXT, max_2d_position_embeddings=100)
    boxes = example_inputs_for(config, seq=6)["bbox"]
    assert boxes.shape == (2, 6, 4) and boxes.dtype == torch.int64
    assert (boxes[..., 0] <= boxes[..., 2]).all() and (boxes[..., 1] <= boxes[..., 3]).all()
    assert 0 <= int(boxes.min()) and int(boxes.max()) <= 99


def test_lxmert_gets_region_features_and_normalized_positions():
    inputs = example_inputs_for(_tiny("lxmert"))
    assert inputs["visual_feats"].shape[-1] == 16 and inputs["visual_pos"].shape[-1] == 4
    assert 0 <= float(inputs["visual_pos"].min()) and float(inputs["visual_pos"].max()) <= 1


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["lxmert", "git", "llava"])
def test_fold_of_a_tiny_multimodal_folder_folds_with_valid_inputs(model_type, tmp_path, monkeypatch):
    folder, out = tmp_path / model_type, tmp_path / "folded"
    _model(model_type).save_pretrained(folder)
    monkeypatch.setenv("NORMFOLD_PROGRESS", "0")
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = main(["fold", str(folder), "-o", str(out)])
    assert "Traceback" not in stderr.getvalue()
    assert code == 0, stderr.getvalue()
    assert (out / "normfold_report.json").is_file()
