"""A folder's example inputs come from its own processor (tokenizer, image processor, feature extractor)
applied to normfold's samples, else from its config with the reason; `normfold fold` and `normfold verify`
take the same route and the report and the CLI name it. The processors are built offline from their
classes' defaults (a WordLevel tokenizer made in code), saved beside tiny random models."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from normfold.cli import main
from normfold.hf.folder_inputs import CONFIG, PROCESSOR, folder_example_inputs
from normfold.hf.inputs import example_inputs_for
from normfold.hf.load import load_model
from normfold.hf.output_dir import REPORT_JSON
from normfold.hf.samples import SAMPLE_TEXTS, sample_audio, sample_images

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
TINY_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
                patch_size=8)


def word_tokenizer(pad: bool = True):
    """A WordLevel tokenizer over the sample texts' lower-cased words (ids below 40), with or without a pad token."""
    words = sorted({w for text in SAMPLE_TEXTS for w in text.lower().replace(".", " .").replace(",", " ,").split()})
    vocab = {token: i for i, token in enumerate(SPECIALS + words)}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.normalizer = tokenizers.normalizers.Lowercase()
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]",
                                                pad_token="[PAD]" if pad else None)


def _folder(tmp_path, name: str, model, *processors):
    folder = tmp_path / name
    model.save_pretrained(folder)
    for processor in processors:
        processor.save_pretrained(folder)
    return folder


def _vit(tmp_path, image_size: int = 32):
    torch.manual_seed(0)
    model = transformers.ViTModel(transformers.ViTConfig(**TINY_VIT))
    processor = transformers.ViTImageProcessor(size={"height": image_size, "width": image_size})
    return _folder(tmp_path, f"vit{image_size}", model, processor)


def _audio(tmp_path, model_type: str = "wav2vec2"):
    """A tiny waveform model (Wav2Vec2; Data2VecAudio, whose position convolution has no weight norm, so its
    folder folds) with a Wav2Vec2 feature extractor."""
    torch.manual_seed(0)
    config = transformers.CONFIG_MAPPING[model_type](
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(32,) * 7,
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
    model = transformers.AutoModel.from_config(config)
    return _folder(tmp_path, model_type, model, transformers.Wav2Vec2FeatureExtractor())


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------------------- the processor route

def test_a_tokenizer_makes_a_text_folders_inputs_from_the_sample_texts(tiny_dirs, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_dirs["gpt2"], folder)
    tokenizer = word_tokenizer(pad=False)  # GPT-2's own has no pad token either: rows cut to the shorter text
    tokenizer.save_pretrained(folder)
    made = folder_example_inputs(load_model(folder), folder)
    assert (made.route, made.processor, made.why) == (PROCESSOR, "TokenizersBackend", None)
    rows = [tokenizer(text)["input_ids"] for text in SAMPLE_TEXTS]
    length = min(map(len, rows))
    assert made.inputs["input_ids"].tolist() == [row[:length] for row in rows]
    assert made.inputs["use_cache"] is False  # the config route's call options are kept


def test_a_padding_tokenizer_gives_padded_rows_and_their_mask(tiny_dirs, tmp_path):
    folder = tmp_path / "bert"
    shutil.copytree(tiny_dirs["bert"], folder)
    word_tokenizer(pad=True).save_pretrained(folder)
    inputs = folder_example_inputs(load_model(folder), folder).inputs
    mask = inputs["attention_mask"]
    assert mask.shape == inputs["input_ids"].shape and mask[1].sum() < mask[0].sum()  # the second text is shorter
    assert (inputs["input_ids"][mask == 0] == 0).all()  # [PAD] where the mask is 0


def test_an_image_processor_makes_a_vision_folders_pixels_from_the_sample_images(tmp_path):
    folder = _vit(tmp_path)
    made = folder_example_inputs(load_model(folder), folder)
    assert made.route == PROCESSOR and made.processor.startswith("ViTImageProcessor")
    expected = transformers.ViTImageProcessor(size={"height": 32, "width": 32})(images=sample_images(), return_tensors="pt")
    torch.testing.assert_close(made.inputs["pixel_values"], expected["pixel_values"], rtol=0, atol=0)


def test_a_feature_extractor_makes_an_audio_folders_waveforms_from_the_sample_clips(tmp_path):
    folder = _audio(tmp_path)
    made = folder_example_inputs(load_model(folder), folder)
    assert (made.route, made.processor) == (PROCESSOR, "Wav2Vec2FeatureExtractor")
    assert made.inputs["input_values"].shape == (2, len(sample_audio(16000)[0]))


@pytest.mark.parametrize("build", ["text", "vision", "audio"])
def test_fold_then_verify_over_a_folder_with_a_processor_pass_on_the_processor_route(capsys, tiny_dirs, tmp_path,
                                                                                     build):
    if build == "text":
        folder = tmp_path / "gpt2"
        shutil.copytree(tiny_dirs["gpt2"], folder)
        word_tokenizer(pad=False).save_pretrained(folder)
    else:
        folder = _vit(tmp_path) if build == "vision" else _audio(tmp_path, "data2vec-audio")
    code, out, err = _cli(capsys, "fold", folder, "-o", tmp_path / "folded")
    assert code == 0, err
    report = json.loads((tmp_path / "folded" / REPORT_JSON).read_text())
    assert report["example_inputs"]["route"] == PROCESSOR
    assert f"example inputs: processor ({report['example_inputs']['processor']})" in out
    code, out, err = _cli(capsys, "verify", folder, tmp_path / "folded")
    assert code == 0, out + err


# ------------------------------------------------------------------------------- the config route, and why

def test_a_folder_without_a_processor_takes_the_config_route_and_says_so(tiny_dirs):
    made = folder_example_inputs(load_model(tiny_dirs["opt"]), tiny_dirs["opt"])
    assert made.route == CONFIG and made.why.startswith("no processor in the folder")
    assert made.inputs.keys() == example_inputs_for(load_model(tiny_dirs["opt"])).keys()


def test_a_broken_processor_config_falls_back_to_the_config_route_with_the_reason(capsys, tmp_path):
    folder = _vit(tmp_path)
    (folder / "preprocessor_config.json").write_text('{"image_processor_type": "NoSuchImageProcessor"}')
    made = folder_example_inputs(load_model(folder), folder)
    assert made.route == CONFIG and made.why.startswith("the folder's processor does not load: "), made.why
    code, out, err = _cli(capsys, "fold", folder, "-o", tmp_path / "folded")
    assert code == 0, err
    assert f"example inputs: config ({made.why})" in out
    assert json.loads((tmp_path / "folded" / REPORT_JSON).read_text())["example_inputs"]["why"] == made.why
    assert str(folder) in made.why  # transformers names the folder: the original, moved, still verifies
    moved = tmp_path / "moved"
    shutil.move(folder, moved)
    code, out, err = _cli(capsys, "verify", moved, tmp_path / "folded")
    assert code == 0, out + err


def test_inputs_the_model_refuses_fall_back_to_the_config_route_with_the_models_words(tmp_path):
    folder = _vit(tmp_path, image_size=48)  # the processor resizes to 48 x 48; the model takes 32 x 32
    made = folder_example_inputs(load_model(folder), folder)
    assert made.route == CONFIG
    assert made.why.startswith("the model refuses ViTImageProcessor") and "32" in made.why, made.why
    assert made.inputs["pixel_values"].shape[-2:] == (32, 32)


def test_a_processor_that_returns_a_bare_tensor_falls_back_with_that_reason(tmp_path, monkeypatch):
    """Fails on main af93d81: IdeficsImageProcessor returns its pixel tensor, not a dict, and `normfold fold`
    ended in "fold cannot handle this model: AttributeError: 'Tensor' object has no attribute 'items'"."""
    folder = _vit(tmp_path)
    original = transformers.ViTImageProcessor.__call__
    monkeypatch.setattr(transformers.ViTImageProcessor, "__call__",
                        lambda self, *a, **k: original(self, *a, **k)["pixel_values"])  # as Idefics' does
    made = folder_example_inputs(load_model(folder), folder)
    assert made.route == CONFIG and made.why.endswith("returns a Tensor, not named inputs"), made.why


def test_a_processor_that_makes_no_main_input_the_model_takes_falls_back(tiny_dirs, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_dirs["gpt2"], folder)
    transformers.ViTImageProcessor().save_pretrained(folder)  # pixels for a text model
    made = folder_example_inputs(load_model(folder), folder)
    assert made.route == CONFIG and "makes no input_ids" in made.why, made.why


def test_a_tokenizer_whose_ids_pass_the_vocabulary_falls_back(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=8, n_embd=32, n_layer=1, n_head=4, n_positions=32)
    folder = _folder(tmp_path, "small-vocab", transformers.GPT2LMHeadModel(config), word_tokenizer())
    made = folder_example_inputs(load_model(folder), folder)
    assert made.route == CONFIG and made.why.startswith("the model refuses TokenizersBackend's inputs"), made.why


def test_a_processor_whose_tokenizer_transformers_built_empty_is_not_taken(tmp_path):
    """A CLIP folder with only an image processor: AutoProcessor builds CLIPProcessor around an empty
    tokenizer made from config.json; the image processor alone is taken, and it makes no token ids."""
    torch.manual_seed(0)
    config = transformers.CLIPConfig(text_config={**TINY_VIT, "vocab_size": 99, "max_position_embeddings": 16},
                                     vision_config=TINY_VIT, projection_dim=32)
    folder = _folder(tmp_path, "clip", transformers.CLIPModel(config),
                     transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}))
    made = folder_example_inputs(load_model(folder), folder)
    assert made.route == CONFIG and made.why.startswith("CLIPImageProcessor") and "makes no input_ids" in made.why, made.why


def test_a_folder_whose_model_reads_none_of_the_main_inputs_folds_on_its_default_call(capsys, tmp_path):
    """A Q-Former reads learned queries (``query_embeds``), none of input_ids / pixel_values / input_values /
    input_features: its default call is still the call to fold for, with the image encoder states its
    cross-attention layers require. Failed on main 14f1704 with "example_inputs as a list must hold at least one
    call ... (not a known refusal)", found by benchmarks/cli_zoo.py."""
    config = transformers.Blip2QFormerConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=64, encoder_hidden_size=32, vocab_size=99)
    torch.manual_seed(0)
    folder = tmp_path / "qformer"
    transformers.Blip2QFormerModel(config).save_pretrained(folder)
    assert main(["fold", str(folder), "-o", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    names = json.loads((tmp_path / "out" / REPORT_JSON).read_text())["example_inputs"]["names"]
    assert names == ["encoder_hidden_states", "query_embeds"]  # the image states its cross-attention reads


# BigBird with 4-token blocks and 1 random block: block-sparse attention needs more than (5 + 2) * 4 = 28 tokens
TINY_BLOCK_SPARSE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         attention_type="block_sparse", block_size=4, num_random_blocks=1,
                         max_position_embeddings=128)


def test_a_block_sparse_folder_folds_with_enough_tokens_to_stay_block_sparse(capsys, tmp_path):
    """BigBird swaps its block-sparse attention for full attention, for good, on a call of at most
    (5 + 2 r) b tokens; the samples' 16 tokens did that, and `normfold fold` then refused every BigBird and
    BigBird-Pegasus folder with "cannot save BigBirdModel so that normfold.from_pretrained rebuilds it" (found by
    benchmarks/cli_zoo.py). The tokenizer's samples are too short: the config route, with the reason."""
    torch.manual_seed(0)
    vocab = len(word_tokenizer().get_vocab())
    model = transformers.BigBirdModel(transformers.BigBirdConfig(vocab_size=vocab, **TINY_BLOCK_SPARSE))
    folder = _folder(tmp_path, "bigbird", model, word_tokenizer())
    made = folder_example_inputs(load_model(folder), folder)
    assert made.route == CONFIG and "block-sparse attention runs on more than" in made.why, made.why
    assert made.inputs["input_ids"].shape[-1] > 28
    code, out, err = _cli(capsys, "fold", folder, "-o", tmp_path / "out")
    assert code == 0, out + err
    reloaded = transformers.AutoModel.from_pretrained(tmp_path / "out")
    assert reloaded.config.attention_type == "block_sparse"
    assert type(reloaded.encoder.layer[0].attention.self).__name__ == "BigBirdBlockSparseAttention"
    code, out, err = _cli(capsys, "verify", folder, tmp_path / "out")
    assert code == 0, out + err
