"""A Hugging Face folder whose model has Conv → BatchNorm → LayerNorm: the BatchNorm merges into the
conv (a plan step), the LayerNorm then folds, in memory and streamed shard by shard; stock
transformers and normfold.from_pretrained reload the result with the original's outputs."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import normfold
from normfold.hf import example_inputs_for, fold_folder, load_model
from normfold.hf.streaming import fold_checkpoint

import sealing

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


class ConvBatchNormConfig(transformers.PretrainedConfig):
    model_type = "normfold_test_conv_bn"

    def __init__(self, vocab_size=40, hidden_size=16, max_position_embeddings=32, conv_bias=True, **kwargs):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.max_position_embeddings, self.conv_bias = max_position_embeddings, conv_bias
        super().__init__(**kwargs)


class ConvBatchNormModel(transformers.PreTrainedModel):
    """Embedding → Conv1d over the sequence → BatchNorm1d → LayerNorm over the channels → head."""

    config_class = ConvBatchNormConfig
    base_model_prefix = "conv_bn"

    def __init__(self, config):
        super().__init__(config)
        d = config.hidden_size
        self.embed = nn.Embedding(config.vocab_size, d)
        self.conv = nn.Conv1d(d, d, 3, padding=1, bias=config.conv_bias)
        self.bn = nn.BatchNorm1d(d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, config.vocab_size)
        self.post_init()

    def _init_weights(self, module):
        pass  # the test sets every tensor itself

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return None  # the head is not tied to the embedding

    def forward(self, input_ids, **kwargs):  # (B, T) -> (B, T, V)
        h = self.bn(self.conv(self.embed(input_ids).transpose(1, 2)))  # (B, D, T)
        return self.head(self.ln(h.transpose(1, 2)))


@pytest.fixture(scope="module", autouse=True)
def _registered():
    try:
        transformers.AutoConfig.register(ConvBatchNormConfig.model_type, ConvBatchNormConfig)
        transformers.AutoModel.register(ConvBatchNormConfig, ConvBatchNormModel)
    except ValueError:  # already registered in this process
        pass


def _save(folder, *, conv_bias=True, max_shard_size=None):
    torch.manual_seed(0)
    model = ConvBatchNormModel(ConvBatchNormConfig(conv_bias=conv_bias))
    with torch.no_grad():  # trained-looking tensors: every step of the fold changes something
        for p in model.parameters():
            p.normal_()
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2.0)
        model.bn.num_batches_tracked.fill_(7)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.eval().save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


def _same_outputs(original_dir, folded):
    original = load_model(original_dir)
    inputs = example_inputs_for(original)
    with torch.no_grad():
        a, b = original(**inputs), folded.eval()(**inputs)
    return ((a - b).abs().max() / a.abs().max()).item()


def _reloaded(folder):
    stock = transformers.AutoModel.from_pretrained(folder)
    return stock, normfold.from_pretrained(folder)


def test_hf_folder_merges_the_batchnorm_then_folds_the_layernorm(tmp_path):
    source = _save(tmp_path / "convbn")
    report = fold_folder(source, tmp_path / "out")
    assert [(b["path"], b["folded"], b["producer"]) for b in report["batchnorms"]] == [("bn", True, "conv")]
    assert [s["norm_path"] for s in report["plan"]["batchnorm"]] == ["bn"]
    assert report["plan"]["batchnorm"][0]["keep_module"] is True  # stock loads bn.*: it stays, as an identity
    assert report["num_foldable"] == 1 and report["verification"]["ok"]
    assert report["verification"]["max_rel_error"] <= 1e-9
    for model in _reloaded(tmp_path / "out"):
        assert _same_outputs(source, model) < 1e-5
    stock, ours = _reloaded(tmp_path / "out")
    assert isinstance(ours.ln, normfold.RMSNorm) and isinstance(stock.bn, nn.BatchNorm1d)
    assert torch.equal(stock.bn.running_var + stock.bn.eps, torch.ones(16))  # exactly the identity
    verified = normfold.hf.verify_folders(source, tmp_path / "out")
    assert verified["ok"] and verified["files"]["weights"]["ok"] is True  # the BatchNorm merge is re-made too


def test_sharded_checkpoint_streams_the_batchnorm_merge_bitwise_as_in_memory(tmp_path, assert_bitwise_same_weights):
    source = _save(tmp_path / "sharded", max_shard_size="2KB")
    assert len(list(source.glob("*.safetensors"))) > 2
    streamed = fold_checkpoint(source, tmp_path / "streamed")
    assert streamed["verification"]["ok"] and streamed["num_foldable"] == 1
    assert [s["norm_path"] for s in streamed["plan"]["batchnorm"]] == ["bn"]
    fold_folder(source, tmp_path / "in_memory")
    assert_bitwise_same_weights(transformers.AutoModel, tmp_path / "streamed", tmp_path / "in_memory")
    for model in _reloaded(tmp_path / "streamed"):
        assert _same_outputs(source, model) < 1e-5


def test_a_conv_without_bias_keeps_its_batchnorm_in_a_stock_folder(tmp_path):
    source = _save(tmp_path / "nobias", conv_bias=False)
    report = fold_folder(source, tmp_path / "out", fold_affine=False)
    (entry,) = report["batchnorms"]
    assert not entry["folded"] and entry["reason"] == "the stock architecture has no conv.bias to absorb its shift"
    assert report["plan"]["batchnorm"] == [] and report["num_foldable"] == 0
    assert _same_outputs(source, transformers.AutoModel.from_pretrained(tmp_path / "out")) < 1e-5


def test_a_half_precision_folder_keeps_its_batchnorm_when_the_identity_cannot_be_exact(tmp_path):
    source = _save(tmp_path / "convbn")
    report = fold_folder(source, tmp_path / "out", dtype="bfloat16", fold_affine=False)
    (entry,) = report["batchnorms"]
    assert not entry["folded"] and "no stored running variance makes it an exact identity" in entry["reason"]
    assert report["plan"]["batchnorm"] == [] and report["verification"]["ok"]
    saved = json.loads((tmp_path / "out" / "normfold_report.json").read_text())
    assert saved["batchnorms"][0]["folded"] is False


def test_a_report_whose_plan_lacks_the_batchnorm_section_is_not_the_remade_one(tiny_dirs, tmp_path):
    """A plan lacking its batchnorm section, sealed again: the re-made report has one."""
    fold_folder(tiny_dirs["gpt2"], tmp_path / "out")
    sealing.reseal(tmp_path / "out", lambda report: report["plan"].pop("batchnorm"))
    verified = normfold.hf.verify_folders(tiny_dirs["gpt2"], tmp_path / "out")
    assert not verified["ok"] and "at plan.batchnorm (missing)" in verified["why"]
    assert verified["files"]["weights"]["ok"] is True  # the weights themselves are the re-made ones
