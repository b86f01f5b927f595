"""Calibration inputs: sentences tokenized into padded batches, with a bar over the batches."""
from __future__ import annotations

import pytest

from normfold.hf.inputs import calibration_batches, load_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("setting", ["1", "0"])
def test_calibration_batches_show_a_bar_over_the_batches_only_when_progress_is_on(minilm_dir, capsys, monkeypatch,
                                                                                 setting):
    pytest.importorskip("tqdm")
    monkeypatch.setenv("NORMFOLD_PROGRESS", setting)
    model = transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                           intermediate_size=64))
    sentences = [f"sentence number {i}." for i in range(5)]
    batches = calibration_batches(model, load_tokenizer(minilm_dir), sentences, batch_size=2)
    assert [len(b["input_ids"]) for b in batches] == [2, 2, 1]
    err = capsys.readouterr().err
    assert ("calibration" in err and "| 0/3 " in err) if setting == "1" else err == ""


# ------------------------------------------------------------- vision-language models without grids

import torch  # noqa: E402

from normfold.hf.inputs import example_inputs_for  # noqa: E402

VLM_TEXT = dict(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=128, num_key_value_heads=2)
VLM_VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=32,
                  patch_size=8)


def _vlm(model_type: str):
    """A tiny vision-language model of ``model_type`` whose images are laid out without a grid of patches."""
    if model_type == "llava_next":  # any resolution: each image cut into tiles of one of its layouts
        config = transformers.LlavaNextConfig(vision_config=transformers.CLIPVisionConfig(**VLM_VISION),
                                              text_config=transformers.LlamaConfig(**VLM_TEXT), image_token_index=98,
                                              image_grid_pinpoints=[[32, 64]], projector_hidden_act="gelu")
    elif model_type == "instructblip":  # a Q-Former reading an instruction of its own vocabulary
        config = transformers.InstructBlipConfig(
            vision_config=VLM_VISION, text_config=transformers.OPTConfig(vocab_size=99, hidden_size=32, ffn_dim=64,
                                                                         num_hidden_layers=1, num_attention_heads=4,
                                                                         word_embed_proj_dim=32).to_dict(),
            qformer_config=dict(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                intermediate_size=64, encoder_hidden_size=32), num_query_tokens=4,
            image_token_index=98)
    elif model_type == "kosmos-2":  # image embeddings placed where a position mask says
        config = transformers.Kosmos2Config(text_config=dict(vocab_size=99, embed_dim=32, layers=1, attention_heads=4,
                                                             ffn_dim=64), vision_config=VLM_VISION, latent_query_num=4)
    else:
        raise KeyError(model_type)
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config, attn_implementation="eager").eval()


def test_an_any_resolution_model_gets_image_sizes_and_each_image_cut_into_the_tiles_of_its_layout():
    model = _vlm("llava_next")
    inputs = example_inputs_for(model)
    assert inputs["image_sizes"].tolist() == [[32, 64]] * 2
    assert inputs["pixel_values"].shape == (2, 1 + 1 * 2, 3, 32, 32)  # the whole image and its 1 x 2 tiles
    with torch.no_grad():
        model(**inputs)


def test_a_q_former_model_gets_its_instruction_ids_within_the_q_former_vocabulary():
    model = _vlm("instructblip")
    inputs = example_inputs_for(model)
    ids = inputs["qformer_input_ids"]
    assert ids.shape[0] == 2 and int(ids.max()) < 50 and inputs["qformer_attention_mask"].shape == ids.shape
    with torch.no_grad():
        model(**inputs)


def test_a_model_placing_image_queries_by_a_position_mask_gets_one_slot_per_query():
    model = _vlm("kosmos-2")
    inputs = example_inputs_for(model)
    mask = inputs["image_embeds_position_mask"]
    assert mask.shape == inputs["input_ids"].shape and mask.sum(dim=1).tolist() == [4, 4]
    with torch.no_grad():
        model(**inputs)
