"""Streaming folds of sharded masked-LM checkpoints round-trip exactly, as the in-memory fold does.

Tiny masked LMs (BERT, RoBERTa, ALBERT, ELECTRA) with non-zero biases and γ ≠ 1, saved in ~20 KB
shards. Two things made the streamed fold refuse them on main f48c68f: once the plan unties the word
embeddings from the decoder (``tie_word_embeddings=False``), transformers also stops tying the
decoder's bias to the head's (``cls.predictions.bias``), which the checkpoint stores once (BERT,
RoBERTa, ALBERT); and the last encoder block's output LayerNorm hands its γ/β to the head's dense
layer, outside the block, so the block check compared it with the original block γ/β included
(BERT, RoBERTa, ELECTRA).
"""
from __future__ import annotations

import copy
import json
import shutil
import warnings

import pytest
import torch
import transformers

import normfold
from normfold.cli import main
from normfold.hf.folder_report import FolderReport
from normfold.hf.inputs import example_inputs_for
from normfold.hf.output_dir import REPORT_JSON
from normfold.hf.streaming import Checkpoint, fold_checkpoint, verify_by_blocks

safetensors_torch = pytest.importorskip("safetensors.torch")

SIZES = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
FAMILIES = {  # family -> (class, config, (the head's bias, the decoder's bias tied to it) or None)
    "bert": (transformers.BertForMaskedLM, transformers.BertConfig(**SIZES, max_position_embeddings=32),
             ("cls.predictions.bias", "cls.predictions.decoder.bias")),
    "roberta": (transformers.RobertaForMaskedLM, transformers.RobertaConfig(**SIZES, max_position_embeddings=40),
                ("lm_head.bias", "lm_head.decoder.bias")),
    "albert": (transformers.AlbertForMaskedLM,
               transformers.AlbertConfig(**SIZES, embedding_size=16, max_position_embeddings=32),
               ("predictions.bias", "predictions.decoder.bias")),
    "electra": (transformers.ElectraForMaskedLM,
                transformers.ElectraConfig(**SIZES, embedding_size=16, max_position_embeddings=32), None),
}


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """family -> (the original model, its sharded folder, the streamed fold), made on first use."""
    root, cache = tmp_path_factory.mktemp("streaming_heads"), {}

    def get(family: str):
        if family not in cache:
            cls, config, *_ = FAMILIES[family]
            torch.manual_seed(0)
            model = cls(config).eval()
            with torch.no_grad():  # non-zero biases and γ ≠ 1: a tensor loaded at random or moved wrongly shows
                for name, p in model.named_parameters():
                    if name.endswith("bias"):
                        p.normal_(0, 0.1)
                    elif name.endswith("LayerNorm.weight"):
                        p.uniform_(0.5, 1.5)
            src, out = root / family, root / f"{family}-folded"
            model.save_pretrained(src, max_shard_size="20KB")
            assert len(list(src.glob("*.safetensors"))) > 2
            fold_checkpoint(src, out)
            cache[family] = model, src, out
        return cache[family]

    return get


def _logits(model: torch.nn.Module, reference: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    x = example_inputs_for(reference)
    with torch.no_grad():
        return model(**x).logits, reference(**x).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_a_streamed_masked_lm_fold_verifies_and_reloads_stock_and_normfold_equal_to_the_original(streamed, family):
    original, src, out = streamed(family)
    cls, _, tied_biases = FAMILIES[family]
    assert main(["verify", str(src), str(out)]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stock = cls.from_pretrained(out).eval()
    for reloaded in (stock, normfold.from_pretrained(out)):
        folded, reference = _logits(reloaded, original)
        torch.testing.assert_close(folded, reference, rtol=1e-4, atol=1e-5)
    if tied_biases:  # the decoder's bias, tied to the head's in the original, is stored under its own name too
        head_bias, decoder_bias = tied_biases
        stored = Checkpoint(out)
        assert decoder_bias not in Checkpoint(src).meta
        assert torch.equal(stored.read(decoder_bias), stored.read(head_bias))
        assert torch.equal(stored.read(decoder_bias), original.state_dict()[decoder_bias])


def test_the_last_block_whose_norm_handed_its_affine_to_the_head_is_run_and_compared(streamed):
    _, src, out = streamed("bert")
    ver = verify_by_blocks(src, out)
    assert ver["ok"], ver["why"]
    last = {c["block"]: c for c in ver["blocks"]}["bert.encoder.layer.1"]
    assert last["max_rel_error"] <= last["tolerance"]
    assert ver["shell"]["outputs"] == 1 and ver["shell"]["max_rel_error"] <= ver["shell"]["tolerance"]


def _corrupt(folded, to, key: str, value: torch.Tensor):
    """A copy of the folded folder at ``to`` with tensor ``key`` replaced by ``value`` in its shard."""
    shutil.copytree(folded, to)
    shard = to / Checkpoint(to).file_of[key]
    state = safetensors_torch.load_file(shard)
    state[key] = value.to(state[key].dtype)
    safetensors_torch.save_file(state, shard, metadata={"format": "pt"})
    return to


@pytest.mark.parametrize("key, change, failing", [
    # γ left in the last norm although the head's dense holds it: applied twice, the block must fail
    ("bert.encoder.layer.1.output.LayerNorm.weight", "original", "bert.encoder.layer.1"),
    ("bert.encoder.layer.1.output.LayerNorm.bias", "original", "bert.encoder.layer.1"),
    # the head's dense without the moved γ/β (or scaled): the model cut to the last block must fail
    ("cls.predictions.transform.dense.weight", "original", "model cut to its last block"),
    ("cls.predictions.transform.dense.bias", "original", "model cut to its last block"),
    ("cls.predictions.transform.dense.weight", 1.1, "model cut to its last block"),
    ("bert.encoder.layer.1.output.dense.weight", 1.5, "bert.encoder.layer.1"),
])
def test_a_wrong_last_block_or_head_is_refused_by_the_float64_pieces(streamed, tmp_path, key, change, failing):
    original, src, out = streamed("bert")
    folded = Checkpoint(out).read(key)
    value = original.state_dict()[key] if change == "original" else folded.double() * change
    assert not torch.equal(value.to(folded.dtype), folded)
    ver = verify_by_blocks(src, _corrupt(out, tmp_path / "corrupted", key, value))
    assert not ver["ok"]
    pieces = {c["block"]: c for c in [ver["shell"], *ver["blocks"]]}
    assert not pieces[failing]["ok"], ver["why"]
    assert failing in ver["why"]


def test_gamma_beta_said_to_leave_the_stack_from_a_block_other_than_its_last_is_refused(streamed):
    """The argument (the last block's output without γ/β, the head reading it) holds for the last
    block only: any other block's output is the stream the next one reads."""
    _, src, out = streamed("bert")
    report = json.loads((out / REPORT_JSON).read_text())
    moved = copy.deepcopy(report)
    for step in moved["plan"]["affine_fold"]:
        for field in ("norm_path", "gamma_fqn", "beta_fqn"):
            step[field] = step[field].replace("layer.1.", "layer.0.")
    ver = verify_by_blocks(src, out, FolderReport.from_json(moved))
    assert not ver["ok"]
    assert ver["why"].startswith("float64 check failed: bert.encoder.layer.0.output.LayerNorm.bias: the fold moved")
