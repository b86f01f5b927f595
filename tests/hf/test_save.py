"""Saving folded models: ``normfold.save_pretrained`` round-trips exactly through
``normfold.from_pretrained`` (or warns when stock transformers would load another model),
and reloading refuses weights that lack a tensor the model needs."""
from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch

import normfold
from normfold.hf import CheckpointError, example_inputs_for, fold_folder, load_model
from normfold.hf.folder import fold_for_stock
from normfold.hf.output_dir import REPORT_JSON

import sealing
from tiny_models import nontrivial_layer_norms, tiny_bloom_config, tiny_gpt2

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _gpt2(seed: int = 0):
    """A tiny GPT-2 with trained-looking norms, eager attention (what from_pretrained loads)."""
    model = tiny_gpt2(seed, bos_token_id=0, eos_token_id=0, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def _inputs():
    return {"input_ids": torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1)), "use_cache": False}


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


@pytest.fixture(scope="module")
def folded_gpt2():
    """``normfold.fold``'s whole plan of GPT-2: ln_f's γ/β moved into a created ``lm_head.bias`` stock GPT-2 lacks."""
    model = _gpt2()
    folded, report = normfold.fold(model, _inputs(), stock_compatible=False)
    assert folded.lm_head.bias is not None
    return model, folded, report


def _stock_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, UserWarning) and "stock transformers" in str(w.message)]


# ------------------------------------------------------------------------------------ round trip

def test_save_pretrained_then_from_pretrained_rebuilds_exactly_the_folded_model(folded_gpt2, tmp_path):
    _, folded, report = folded_gpt2
    with pytest.warns(UserWarning, match="lm_head.bias"):
        record = normfold.save_pretrained(folded, tmp_path / "out", report=report)
    reloaded = normfold.from_pretrained(tmp_path / "out")
    inputs = _inputs()
    assert (_logits(folded, inputs) - _logits(reloaded, inputs)).abs().max().item() == 0.0
    assert torch.equal(reloaded.lm_head.bias, folded.lm_head.bias)
    rms = {n for n, m in reloaded.named_modules() if isinstance(m, normfold.RMSNorm)}
    assert rms == {n for n, m in folded.named_modules() if isinstance(m, normfold.RMSNorm)} and len(rms) == 5
    saved = json.loads((tmp_path / "out" / REPORT_JSON).read_text())
    assert saved["extra_parameters"] == [{"name": "lm_head.bias", "shape": [96]}] == record["extra_parameters"]
    assert saved["stock_compatible"] is False and saved["verification"]["ok"]


def test_a_folder_stock_transformers_would_load_as_another_model_is_refused_by_stock_loading(folded_gpt2, tmp_path):
    """Fails on main (36efdc1): stock GPT2LMHeadModel.from_pretrained loaded it silently without lm_head.bias,
    11% off. Now the folder is written for normfold.from_pretrained only, and stock loading refuses it loudly."""
    _, folded, _ = folded_gpt2
    with pytest.warns(UserWarning, match=r"drop lm_head.bias .*normfold.from_pretrained only.*stock-compatible plan \(normfold.fold"):
        normfold.save_pretrained(folded, tmp_path / "out")
    with pytest.raises(ValueError, match="model type `normfold: load with normfold.from_pretrained`"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    with pytest.raises(OSError, match="no file named model.safetensors"):
        transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    inputs = _inputs()
    assert torch.equal(_logits(folded, inputs), _logits(normfold.from_pretrained(tmp_path / "out"), inputs))


def test_stock_compatible_fold_saves_without_warning_and_loads_in_stock_transformers(tmp_path):
    model = _gpt2()
    folded, _ = fold_for_stock(model, _inputs())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = normfold.save_pretrained(folded, tmp_path / "out")
    assert not _stock_warnings(caught) and record["stock_compatible"] and not record["extra_parameters"]
    stock, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out", attn_implementation="eager",
                                                              output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    inputs = _inputs()
    a, b = _logits(model, inputs), _logits(stock.eval(), inputs)
    assert ((a - b).abs().max() / a.abs().max()).item() < 1e-5
    reloaded = normfold.from_pretrained(tmp_path / "out")
    assert (_logits(folded, inputs) - _logits(reloaded, inputs)).abs().max().item() == 0.0


def test_save_pretrained_in_float16_stores_half_weights_and_leaves_the_model_alone(folded_gpt2, tmp_path):
    _, folded, _ = folded_gpt2
    dtype_before = folded.config.dtype
    with pytest.warns(UserWarning):
        record = normfold.save_pretrained(folded, tmp_path / "out", dtype="float16")
    state = safetensors_torch.load_file(sealing.weights_file(tmp_path / "out"))
    assert {t.dtype for t in state.values()} == {torch.float16} and "lm_head.bias" in state
    assert record["saved_dtype"] == "float16" and folded.config.dtype == dtype_before
    reloaded = normfold.from_pretrained(tmp_path / "out", dtype=torch.float16)
    assert reloaded.lm_head.bias.dtype == torch.float16


def test_a_norm_precomputed_into_the_table_round_trips_as_identity(tmp_path):
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(tiny_bloom_config(attn_implementation="eager")).eval()
    inputs = {"input_ids": torch.randint(0, 96, (2, 12)), "use_cache": False}
    folded, report = normfold.fold(model, inputs, stock_compatible=False)
    assert isinstance(folded.transformer.word_embeddings_layernorm, torch.nn.Identity)
    with pytest.warns(UserWarning, match="word_embeddings_layernorm as norms"):
        record = normfold.save_pretrained(folded, tmp_path / "out", report=report)
    assert record["identity"] == ["transformer.word_embeddings_layernorm"]
    reloaded = normfold.from_pretrained(tmp_path / "out")
    assert isinstance(reloaded.transformer.word_embeddings_layernorm, torch.nn.Identity)
    assert (_logits(folded, inputs) - _logits(reloaded, inputs)).abs().max().item() == 0.0


# ---------------------------------------------------------------------------------- refusals

def test_save_pretrained_refuses_what_from_pretrained_could_not_rebuild_and_writes_nothing(folded_gpt2, tmp_path):
    _, folded, _ = folded_gpt2
    import copy

    changed = copy.deepcopy(folded)
    changed.transformer.h[0].mlp.act = torch.nn.ReLU()  # not a fold's change: a stock GPT-2 cannot be made into it
    with pytest.raises(ValueError, match=r"transformer.h.0.mlp.act is a ReLU"):
        normfold.save_pretrained(changed, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad, error", [(torch.nn.Linear(2, 2), TypeError), ({"w": torch.ones(1)}, TypeError)])
def test_save_pretrained_refuses_a_model_that_is_not_a_hugging_face_model(bad, error, tmp_path):
    with pytest.raises(error, match="Hugging Face model"):
        normfold.save_pretrained(bad, tmp_path / "out")


def test_save_pretrained_refuses_a_storage_dtype_it_cannot_write(folded_gpt2, tmp_path):
    _, folded, _ = folded_gpt2
    with pytest.raises(ValueError, match="dtype must be one of float32, float16, bfloat16.*int8"):
        normfold.save_pretrained(folded, tmp_path / "out", dtype="int8")
    with pytest.raises(TypeError, match="FoldReport"):
        normfold.save_pretrained(folded, tmp_path / "out", report={"swapped": []})
    assert not (tmp_path / "out").exists()


def _resave(folder, edit, *, reseal: bool = True):
    """Load the folder's weights, ``edit(state)``, save them back; ``reseal``: seal the report again over
    them (as someone who means it would), so that the checks behind the seal are the ones tested."""
    file = sealing.weights_file(folder)
    state = safetensors_torch.load_file(file)
    edit(state)
    safetensors_torch.save_file(state, file, metadata={"format": "pt"})
    if reseal:
        _edit_report(folder, lambda report: None)


def _edit_report(folder, edit, *, reseal: bool = True):
    if reseal:
        sealing.reseal(folder, edit)
        return
    report = json.loads((folder / REPORT_JSON).read_text())
    edit(report)
    (folder / REPORT_JSON).write_text(json.dumps(report))


def test_from_pretrained_refuses_weights_without_a_parameter_the_report_lists(folded_gpt2, tmp_path):
    _, folded, _ = folded_gpt2
    with pytest.warns(UserWarning):
        normfold.save_pretrained(folded, tmp_path / "out")
    _resave(tmp_path / "out", lambda state: state.pop("lm_head.bias"))
    with pytest.raises(CheckpointError, match="lm_head.bias"):
        normfold.from_pretrained(tmp_path / "out")


def test_from_pretrained_refuses_weights_missing_a_stock_tensor(tiny_dirs, tmp_path):
    out = tmp_path / "folded"
    fold_folder(tiny_dirs["gpt2"], out)
    # stock transformers would initialise it at random, and say so in a log
    _resave(out, lambda state: state.pop("transformer.h.1.mlp.c_fc.weight"))
    with pytest.raises(CheckpointError, match=r"lack 1 tensor.*transformer.h.1.mlp.c_fc.weight"):
        normfold.from_pretrained(out)


def test_from_pretrained_refuses_a_report_naming_a_module_the_model_lacks(tiny_dirs, tmp_path):
    out = tmp_path / "folded"
    fold_folder(tiny_dirs["gpt2"], out)
    _edit_report(out, lambda report: report["swapped"][0].update(path="transformer.h.7.ln_1"))
    with pytest.raises(CheckpointError, match="names a module"):
        normfold.from_pretrained(out)


# ------------------------------------------------------------ the report is believed only about its own weights

def test_from_pretrained_refuses_a_stock_fine_tune_saved_over_the_folder(tiny_dirs, tmp_path):
    """Fails on main (0a5ea51): normfold.from_pretrained kept the report's weightless RMSNorms and
    silently dropped the γ/β the fine-tune trained."""
    out = tmp_path / "folded"
    fold_folder(tiny_dirs["gpt2"], out)
    stock = transformers.GPT2LMHeadModel.from_pretrained(out)  # the README allows stock loading
    optimizer = torch.optim.SGD(stock.parameters(), lr=0.05)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        stock(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    stock.save_pretrained(out)  # over the folder: the report stays
    assert not torch.equal(stock.transformer.ln_f.weight.detach(), torch.ones(32))  # trained γ
    with pytest.raises(CheckpointError, match="model.safetensors was changed after normfold wrote it"):
        normfold.from_pretrained(out)


def test_from_pretrained_refuses_an_edited_report(tiny_dirs, tmp_path):
    """A γ stored as 3.0 while the report says the norm keeps none: the edit shows in the seal."""
    out = tmp_path / "folded"
    fold_folder(tiny_dirs["gpt2"], out)
    _resave(out, lambda state: state["transformer.h.0.ln_1.weight"].fill_(3.0), reseal=False)
    with pytest.raises(CheckpointError, match="is not as normfold wrote it"):
        normfold.from_pretrained(out)
    _edit_report(out, lambda report: report.pop("plan"), reseal=False)
    with pytest.raises(CheckpointError, match="normfold_report.json was changed after normfold wrote it"):
        normfold.from_pretrained(out)


def test_from_pretrained_refuses_a_tensor_of_another_shape_than_the_report_records(tiny_dirs, tmp_path):
    """Fails on main (0a5ea51): any "resized" entry loaded the folder with mismatched sizes allowed, so
    a wrong-shape tensor elsewhere was re-initialised at random without a word."""
    out = tmp_path / "folded"
    fold_folder(tiny_dirs["gpt2"], out)
    bias = "transformer.h.0.mlp.c_fc.bias"

    def shrink(state):
        state[bias] = state[bias][:100].clone()
    _resave(out, shrink, reseal=False)
    _edit_report(out, lambda report: report.update(resized=[{"name": "transformer.wpe.weight", "shape": [32, 32]}]))
    with pytest.raises(CheckpointError, match=f"other shapes than the model built from its report: {bias}"):
        normfold.from_pretrained(out)


@pytest.mark.parametrize("edit, what", [
    (lambda r: r.update(swapped={"path": "x"}), '"swapped" must be a list'),
    (lambda r: r["swapped"][0].pop("eps"), r"swapped\[0\] must be an object with path"),
    (lambda r: r["swapped"][0].update(eps="1e-5"), r"swapped\[0\].eps and .offset must be finite numbers"),
    (lambda r: r["swapped"][0].update(normalized_shape=[]), "non-empty list of sizes"),
    (lambda r: r["swapped"][0].update(weight="no"), "must be true or false"),
    (lambda r: r.update(identity=[3]), '"identity" must list module paths'),
    (lambda r: r.update(extra_parameters=[{"name": "lm_head.bias", "shape": [-1]}]), r"extra_parameters\[0\] must"),
    (lambda r: r.update(resized=[{"name": 5, "shape": [3]}]), r"resized\[0\] must"),
], ids=["swapped not a list", "no eps", "eps a string", "empty shape", "weight a string", "identity", "extra shape",
        "resized name"])
def test_from_pretrained_refuses_every_malformed_entry_as_a_checkpoint_error(tiny_dirs, tmp_path, edit, what):
    """Fails on main (0a5ea51): some of these raised raw ValueError/TypeError from deep inside."""
    out = tmp_path / "folded"
    fold_folder(tiny_dirs["gpt2"], out)
    _edit_report(out, edit)
    with pytest.raises(CheckpointError, match=what):
        normfold.from_pretrained(out)


def test_save_pretrained_copies_side_files_from_source_dir_and_warns_about_links(tiny_dirs, tmp_path):
    source = tmp_path / "model"
    shutil.copytree(tiny_dirs["gpt2"], source)
    (source / "1_Pooling").mkdir()
    (source / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (tmp_path / "secret.txt").write_text("TOKEN=hunter2")
    os.symlink("../secret.txt", source / "LICENSE")
    folded, _ = fold_for_stock(load_model(source), example_inputs_for(load_model(source)))
    with pytest.warns(UserWarning, match=r"not copied from .*: LICENSE \(symbolic link, not followed\)"):
        record = normfold.save_pretrained(folded, tmp_path / "out", source_dir=source)
    assert (tmp_path / "out" / "1_Pooling" / "config.json").read_text() == '{"pooling_mode_mean_tokens": true}'
    assert not os.path.lexists(tmp_path / "out" / "LICENSE")
    assert record["skipped_files"] == [{"path": "LICENSE", "reason": "symbolic link, not followed"}]


# ------------------------------------------------------- folders whose keys transformers renames on load

@pytest.fixture(scope="module")
def neox_dir(tmp_path_factory):
    """A tiny GPT-NeoX: its head is stored as ``embed_out.*`` and loaded as ``lm_head.*``."""
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, max_position_embeddings=32)
    model = nontrivial_layer_norms(transformers.GPTNeoXForCausalLM(config))
    path = tmp_path_factory.mktemp("neox") / "neox"
    model.save_pretrained(path)
    assert "embed_out.weight" in safetensors_torch.load_file(path / "model.safetensors")
    return path


def test_a_gpt_neox_fold_reloads_and_verifies_through_transformers_key_renaming(neox_dir, tmp_path):
    """Fails on main (0a5ea51): normfold compared raw keys, so from_pretrained and verify said the
    weights lack lm_head.weight, which transformers loads from embed_out.weight."""
    fold_folder(neox_dir, tmp_path / "out")
    original = load_model(neox_dir)
    inputs = example_inputs_for(original)
    assert torch.allclose(_logits(original, inputs), _logits(normfold.from_pretrained(tmp_path / "out"), inputs),
                          atol=1e-5)
    assert normfold.hf.verify_folders(neox_dir, tmp_path / "out")["ok"]


def test_a_created_head_bias_of_a_gpt_neox_is_restored_from_the_name_it_is_stored_under(neox_dir, tmp_path):
    """normfold.fold moves the final norm's β into a new lm_head.bias, which transformers stores as
    embed_out.bias: from_pretrained must read it there (fails on main: "lists parameters the weights
    do not hold: lm_head.bias")."""
    original = load_model(neox_dir)
    inputs = example_inputs_for(original)
    folded, report = normfold.fold(original, inputs, stock_compatible=False)
    with pytest.warns(UserWarning, match="stock transformers would drop lm_head.bias"):
        normfold.save_pretrained(folded, tmp_path / "out", report=report, source_dir=neox_dir)
    assert "embed_out.bias" in safetensors_torch.load_file(sealing.weights_file(tmp_path / "out"))
    reloaded = normfold.from_pretrained(tmp_path / "out")
    assert torch.equal(reloaded.lm_head.bias, folded.lm_head.bias)
    assert torch.allclose(_logits(original, inputs), _logits(reloaded, inputs), atol=1e-5)
    assert normfold.hf.verify_folders(neox_dir, tmp_path / "out")["ok"]


def test_a_bert_folder_with_legacy_gamma_beta_keys_folds_reloads_and_verifies(tiny_dirs, tmp_path):
    """Older BERT checkpoints store LayerNorm.gamma / .beta, which transformers renames to weight / bias on load."""
    src = tmp_path / "legacy"
    shutil.copytree(tiny_dirs["bert"], src)
    state = safetensors_torch.load_file(src / "model.safetensors")
    renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in state.items()}
    assert renamed.keys() != state.keys()
    safetensors_torch.save_file(renamed, src / "model.safetensors", metadata={"format": "pt"})
    fold_folder(src, tmp_path / "out")
    original = load_model(src)
    inputs = example_inputs_for(original)
    reloaded = normfold.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        assert torch.allclose(original(**inputs).last_hidden_state, reloaded(**inputs).last_hidden_state, atol=1e-5)
    assert normfold.hf.verify_folders(src, tmp_path / "out")["ok"]
