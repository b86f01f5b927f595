"""Folding Hugging Face folders: stock transformers reloads them with the same outputs, and
``normfold.from_pretrained`` puts the RMSNorms back."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import normfold
from normfold.hf import example_inputs_for, fold_folder, load_model, verify_folders
from normfold.hf.folder import PICTURE, REPORT_MD
from normfold.hf.output_dir import REPORT_JSON

from tiny_models import tiny_bloom_config

transformers = pytest.importorskip("transformers")


def _outputs(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / a.double().abs().max()).item()


@pytest.mark.parametrize("name", ["gpt2", "opt", "bert"])
def test_folded_folder_loads_in_stock_transformers_with_the_same_outputs(tiny_dirs, tmp_path, name):
    out = tmp_path / "folded"
    report = fold_folder(tiny_dirs[name], out)
    original = load_model(tiny_dirs[name])
    stock = transformers.AutoModel.from_pretrained(out) if name == "bert" else \
        transformers.AutoModelForCausalLM.from_pretrained(out)
    inputs = example_inputs_for(original)
    assert _rel_err(_outputs(original, inputs), _outputs(stock.eval(), inputs)) < 1e-5
    assert report["verification"]["ok"]
    assert {REPORT_JSON, REPORT_MD, PICTURE, "config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}


@pytest.mark.parametrize("name", ["gpt2", "opt"])
def test_pre_ln_decoders_fold_every_norm_and_untie_the_lm_head(tiny_dirs, tmp_path, name):
    out = tmp_path / "folded"
    report = fold_folder(tiny_dirs[name], out)
    assert report["num_foldable"] == report["num_norms"] == 5
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    # stock loading must see every key: the weightless norms got explicit ones/zeros
    _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"]


def test_from_pretrained_swaps_in_normfold_rmsnorms_and_keeps_outputs(tiny_dirs, tmp_path):
    out = tmp_path / "folded"
    report = fold_folder(tiny_dirs["gpt2"], out)
    folded = normfold.from_pretrained(out)
    swapped = {s["path"] for s in report["swapped"]}
    found = {n for n, m in folded.named_modules() if isinstance(m, normfold.RMSNorm)}
    assert found == swapped and len(found) == 5
    original = load_model(tiny_dirs["gpt2"])
    inputs = example_inputs_for(original)
    assert _rel_err(_outputs(original, inputs), _outputs(folded, inputs)) < 1e-5


def test_no_fold_affine_keeps_gamma_beta_on_the_rmsnorms(tiny_dirs, tmp_path):
    out = tmp_path / "folded"
    report = fold_folder(tiny_dirs["opt"], out, fold_affine=False)
    assert report["num_affine_folded"] == 0
    assert all(s["weight"] and s["bias"] for s in report["swapped"])
    folded = normfold.from_pretrained(out)
    ln = folded.model.decoder.layers[0].self_attn_layer_norm
    original = load_model(tiny_dirs["opt"]).model.decoder.layers[0].self_attn_layer_norm
    assert isinstance(ln, normfold.RMSNorm)
    torch.testing.assert_close(ln.weight, original.weight)


def test_fold_in_float16_saves_half_weights_that_verify_at_half_tolerance(tiny_dirs, tmp_path):
    out = tmp_path / "folded"
    fold_folder(tiny_dirs["gpt2"], out, dtype="float16")
    from safetensors import safe_open
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    result = verify_folders(tiny_dirs["gpt2"], out)
    assert result["ok"] and 1e-4 < result["outputs"]["tolerance"]


def test_verify_folders_detects_a_tampered_folded_model(tiny_dirs, tmp_path):
    out = tmp_path / "folded"
    fold_folder(tiny_dirs["gpt2"], out)
    from safetensors.torch import load_file, save_file
    state = load_file(out / "model.safetensors")
    state["transformer.h.1.mlp.c_proj.bias"] += 1.0  # breaks zero mean: the RMSNorm no longer equals the LN
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    assert not verify_folders(tiny_dirs["gpt2"], out)["ok"]


def test_minilm_folds_and_round_trips(minilm_dir, tmp_path):
    out = tmp_path / "folded"
    report = fold_folder(minilm_dir, out)
    assert report["num_norms"] == 13
    original = load_model(minilm_dir)
    stock = transformers.AutoModel.from_pretrained(out).eval()
    inputs = example_inputs_for(original)
    assert _rel_err(_outputs(original, inputs), _outputs(stock, inputs)) < 1e-5


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_analyze_and_fold_of_a_folder_agree_on_every_norm(tiny_dirs, tmp_path, name):
    """`normfold analyze` plans as `normfold fold` does (stock-loadable): GPT-2's ln_f keeps its γ/β in
    both, since the stock lm_head has no bias to take β (analyze said "folded into next layer" before)."""
    from normfold.hf import analyze_folder

    def columns(report):
        return [(e["path"], e["foldable"], e["affine_folded"], e["reason"]) for e in report["norms"]]

    analysed = analyze_folder(tiny_dirs[name])
    folded = fold_folder(tiny_dirs[name], tmp_path / "out")
    assert columns(analysed) == columns(folded)
    if name == "gpt2":
        ln_f = next(e for e in analysed["norms"] if e["path"].endswith("ln_f"))
        assert ln_f["foldable"] and not ln_f["affine_folded"] and "lm_head.bias" in ln_f["reason"]


def test_a_layernorm_kept_with_its_affine_moved_saves_as_gamma_one_beta_zero(tmp_path):
    """BLOOM without a precomputed embedding norm: its block LayerNorms stay LayerNorms but their γ/β
    move into the next layers. The folder stores those norms as γ = 1, β = 0 (exactly the same LN),
    so stock transformers and normfold both reload the folded model (refused as "cannot save" before)."""
    transformers = pytest.importorskip("transformers")
    original = transformers.BloomForCausalLM(tiny_bloom_config()).eval()
    original.save_pretrained(tmp_path / "src")
    report = fold_folder(tmp_path / "src", tmp_path / "out")
    kept_moved = [e["path"] for e in report["norms"] if not e["foldable"] and e["affine_folded"]]
    assert kept_moved and report["verification"]["ok"]
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    stock = transformers.BloomForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    for path in kept_moved:
        norm = stock.get_submodule(path)
        assert torch.equal(norm.weight, torch.ones_like(norm.weight)) and not norm.bias.any()
    with torch.no_grad():
        want = original(ids).logits
        assert _rel_err(want, stock(ids).logits) < 1e-5
        assert _rel_err(want, normfold.from_pretrained(tmp_path / "out")(ids).logits) < 1e-5
    checked = verify_folders(tmp_path / "src", tmp_path / "out")
    assert checked["ok"] and checked["files"]["weights"]["ok"]


@pytest.mark.parametrize("stream", [False, True], ids=["in memory", "streamed"])
def test_a_llama_folder_folds_the_gammas_of_its_recognised_rmsnorms(tmp_path, capsys, stream):
    """Llama's own RMSNorm class is recognised from its traced ops (issue 32): `normfold fold` moves each
    γ into the next layers and writes the folder, proved (it said "nothing to fold" before, exit 2)."""
    transformers = pytest.importorskip("transformers")
    from normfold.cli import EXIT_OK, main

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    capsys.readouterr()  # transformers' own progress bar while saving the original
    args = ["fold", str(tmp_path / "llama"), "-o", str(tmp_path / "out")] + (["--stream"] if stream else [])
    assert main(args) == EXIT_OK
    report = json.loads((tmp_path / "out" / "normfold_report.json").read_text())
    assert report["verification"]["ok"] and len(report["norms"]) == 3
    assert all(n["reason"].startswith("LlamaRMSNorm recognised as an RMSNorm") and n["affine_folded"]
               for n in report["norms"])


def test_a_trainer_checkpoint_folder_folds_its_bin_weights_and_never_reads_training_args_bin(tiny_dirs, tmp_path):
    """Fails on main (0a5ea51): every *.bin was read as weights, so a Trainer's training_args.bin (a
    pickled object) refused the whole folder as "not a weights-only torch checkpoint"."""
    from safetensors.torch import load_file

    src = tmp_path / "checkpoint-500"
    load_model(tiny_dirs["gpt2"]).save_pretrained(src)
    torch.save(load_file(src / "model.safetensors"), src / "pytorch_model.bin")  # an older checkpoint's weights
    (src / "model.safetensors").unlink()
    torch.save(_TrainingArguments(), src / "training_args.bin")  # what Trainer writes: not loadable weights-only
    report = fold_folder(src, tmp_path / "out")
    assert report["verification"]["ok"] and report["num_foldable"] > 0
    assert not (tmp_path / "out" / "training_args.bin").exists()  # a weight-suffixed file: not carried over


@dataclasses.dataclass
class _TrainingArguments:
    output_dir: str = "out"
    learning_rate: float = 5e-5
