"""normfold.rotate on real architectures: exact in float64 on fresh inputs of another shape, really
rotated, and refused with the first blocker where the residual stream is not closed under rotation."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import normfold
from normfold import FoldError

from tiny_models import tiny_gpt2

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")]

BOUND = 1e-9  # the fold's float64 bound: rotation changes no function
# every zoo family whose stream norms all fold (tests/engine/test_models.py)
ROTATABLE_ZOO = ["gpt2", "opt_pre_ln", "bloom", "falcon_new_arch", "falcon_parallel", "falcon_sequential", "phi"]


def _fresh_decoder_call(batch: int = 3, seq: int = 5, vocab: int = 100) -> dict:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids, "use_cache": False}


def _assert_exact_on_another_shape(original: nn.Module, rotated: nn.Module, call: dict) -> None:
    result = normfold.verify(original, rotated, call, rms_norm_paths=[])
    assert result.why is None and result.max_rel_error <= BOUND, result


@pytest.mark.parametrize("name", ROTATABLE_ZOO)
def test_rotated_zoo_model_equals_the_original_in_float64_on_inputs_of_another_shape(zoo, name: str):
    model = zoo.model(name, torch.float64)
    rotated, report = normfold.rotate(model, zoo.inputs(name, 0))
    assert report.verification.ok and report.exact
    assert report.streams[0].stream.width == 32 and len(report.streams) == 1
    _assert_exact_on_another_shape(model, rotated, _fresh_decoder_call())


def _tiny(kind: str) -> nn.Module:
    t = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gptneox":
        config = t.GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                 vocab_size=100, max_position_embeddings=64, attn_implementation="eager")
        return t.GPTNeoXForCausalLM(config).eval()
    config = t.GPTJConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64, rotary_dim=8,
                          attn_implementation="eager")
    return t.GPTJForCausalLM(config).eval()


@pytest.mark.parametrize("kind", ["gptneox", "gptj"])
def test_rotated_gptneox_and_gptj_equal_the_original_in_float64(kind: str):
    model = _tiny(kind).double()
    rotated, report = normfold.rotate(model, _fresh_decoder_call(2, 8), method="random", seed=3)
    assert report.verification.ok
    _assert_exact_on_another_shape(model, rotated, _fresh_decoder_call())


def test_bundled_model_rotates_exactly_with_a_sylvester_hadamard():
    t = pytest.importorskip("transformers")
    from normfold.hf.load import default_model_path

    model = t.GPT2LMHeadModel.from_pretrained(default_model_path()).eval().double()
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    rotated, report = normfold.rotate(model, {"input_ids": ids, "use_cache": False})
    stream = report.streams[0]
    assert stream.stream.width == 128 and "Sylvester 128" in stream.how
    assert len(stream.stream.norms) == 9  # 4 blocks x 2 + ln_f
    _assert_exact_on_another_shape(model, rotated, _fresh_decoder_call(2, 24, vocab=256))


def _llama(torch_norms: bool) -> nn.Module:
    t = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = t.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                           intermediate_size=64, vocab_size=100, max_position_embeddings=64, attn_implementation="eager")
    model = t.LlamaForCausalLM(config).eval().double()
    if torch_norms:  # LlamaRMSNorm written as torch.nn.RMSNorm (same math), with γ ≠ 1
        for path, module in list(model.named_modules()):
            if type(module).__name__ == "LlamaRMSNorm":
                norm = nn.RMSNorm(module.weight.shape[0], eps=module.variance_epsilon, dtype=torch.float64)
                with torch.no_grad():
                    norm.weight.copy_(1 + 0.2 * torch.randn(module.weight.shape, dtype=torch.float64))
                model.set_submodule(path, norm)
    return model


def test_llama_with_torch_rmsnorms_rotates_exactly_its_gammas_moved_into_the_readers():
    model = _llama(torch_norms=True)
    rotated, report = normfold.rotate(model, _fresh_decoder_call(2, 8))
    assert len(report.streams[0].stream.norms) == 5 and report.verification.ok
    _assert_exact_on_another_shape(model, rotated, _fresh_decoder_call())


def test_llama_with_its_own_rmsnorm_class_rotates_once_the_fold_recognises_the_class():
    rotated, report = normfold.rotate(_llama(torch_norms=False), _fresh_decoder_call(2, 8))
    assert len(report.streams[0].stream.norms) == 5 and report.verification.ok
    assert all("LlamaRMSNorm recognised as an RMSNorm" in e.reason for e in report.fold.norms)


def test_rotated_bundled_model_generates_the_same_greedy_bytes_with_its_kv_cache():
    t = pytest.importorskip("transformers")
    from normfold.hf.load import default_model_path

    model = t.GPT2LMHeadModel.from_pretrained(default_model_path()).eval()
    prompt = torch.tensor([list(b"def fold(model):")])
    rotated, _ = normfold.rotate(model, {"input_ids": prompt, "use_cache": False}, method="random")
    expected = model.generate(prompt, max_new_tokens=16, do_sample=False)
    assert torch.equal(rotated.generate(prompt, max_new_tokens=16, do_sample=False), expected)


@pytest.mark.parametrize("method", ["hadamard", "random"])
def test_q_is_orthogonal_not_the_identity_and_the_weights_are_the_fold_times_q(zoo, method: str):
    model = zoo.model("gpt2", torch.float64)
    example = zoo.inputs("gpt2", 0)
    folded, _ = normfold.fold(model, example, verify=False, stock_compatible=False)  # rotate's fold: the whole plan
    rotated, report = normfold.rotate(model, example, method=method)
    q = report.streams[0].basis
    assert report.streams[0].orthogonality_error <= 1e-12
    assert (q.T @ q - torch.eye(32, dtype=torch.float64)).abs().max() <= 1e-12
    assert report.streams[0].identity_distance > 0.1
    wte_folded, wte_rotated = folded.transformer.wte.weight, rotated.transformer.wte.weight
    assert torch.allclose(wte_rotated, wte_folded @ q, rtol=0, atol=1e-12)          # writer: rows · Q
    assert torch.allclose(rotated.lm_head.weight, folded.lm_head.weight @ q, rtol=0, atol=1e-12)  # reader: W · Q
    assert (wte_rotated - wte_folded).abs().max() > 0.1 * wte_folded.abs().max()     # really changed
    assert rotated.transformer.wte.weight is not model.transformer.wte.weight


def test_the_report_says_what_was_done_in_text_and_json(zoo):
    _, report = normfold.rotate(zoo.model("gpt2", torch.float64), zoo.inputs("gpt2", 0), seed=5)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["method"] == "hadamard" and data["seed"] == 5 and data["exact"] and data["verification"]["ok"]
    stream = data["streams"][0]
    assert stream["stream"]["width"] == 32 and len(stream["stream"]["norms"]) == 5
    assert {"fqn": "transformer.wte.weight", "dim": 1, "role": "writer"} in stream["stream"]["tensors"]
    assert {"fqn": "lm_head.weight", "dim": 1, "role": "reader"} in stream["stream"]["tensors"]
    text = str(report)
    assert "rotate (hadamard, seed 5)" in text and "verify: OK" in text and "15 tensors rotated" in text


def test_the_users_model_is_untouched(zoo):
    model = zoo.model("opt_pre_ln", torch.float64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    normfold.rotate(model, zoo.inputs("opt_pre_ln", 0))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def _gpt2_of_width(width: int, heads: int) -> nn.Module:
    return tiny_gpt2(n_layer=1, n_embd=width, n_head=heads, vocab_size=100, n_positions=64,
                     attn_implementation="eager").eval().double()


def test_a_width_of_four_times_twelve_gets_a_kronecker_hadamard():
    rotated, report = normfold.rotate(_gpt2_of_width(48, 4), _fresh_decoder_call(2, 6))
    assert report.streams[0].how.startswith("randomised Hadamard (Sylvester 4 ⊗ Paley 12)")
    assert report.verification.ok


def test_a_width_without_a_hadamard_matrix_falls_back_to_haar_and_says_so():
    model = _gpt2_of_width(52, 4)  # 52 = 4·13: no construction here reaches it
    rotated, report = normfold.rotate(model, _fresh_decoder_call(2, 6))
    assert "fallback" in report.streams[0].how and "52" in report.streams[0].how
    assert report.verification.ok and report.streams[0].orthogonality_error <= 1e-12
    assert "fallback" in str(report)


def test_a_float32_model_comes_back_in_float32_proved_in_float64(zoo):
    model = zoo.model("gpt2", torch.float32)
    rotated, report = normfold.rotate(model, zoo.inputs("gpt2", 0))
    assert rotated.transformer.wte.weight.dtype == torch.float32
    assert report.verification.max_rel_error <= BOUND
    assert report.verification.model_dtype_max_rel_error < 1e-4


def test_a_rotation_wrong_only_in_the_models_dtype_is_refused(zoo, monkeypatch):
    # the float64 proof judges the rotation built in float64, exact here; the model returned is rotated
    # in float32 and rounded to bfloat16 on the way: before, that model came back, "proved"
    from normfold.rotate import apply

    exact = apply.rotate_along

    def rounded_unless_float64(t, dim, q, scale=1.0):
        out = exact(t, dim, q, scale)
        return out if out.dtype == torch.float64 else out.to(torch.bfloat16).to(out.dtype)

    monkeypatch.setattr(apply, "rotate_along", rounded_unless_float64)
    with pytest.raises(normfold.FoldVerificationError,
                       match="rotated model differs from the original: the returned model in float32: error"):
        normfold.rotate(zoo.model("gpt2", torch.float32), zoo.inputs("gpt2", 0))


# ------------------------------------------------------------------------------ refusals

@pytest.mark.parametrize("name, blocker", [
    ("bert", "embeddings.LayerNorm kept its γ/β"),                               # partially foldable: 1 of 5 LNs
    ("opt_post_ln", "model.decoder.layers.0.self_attn_layer_norm is still a LayerNorm"),
    ("minilm", "embeddings.LayerNorm kept its γ/β"),
])
def test_post_ln_models_are_refused_naming_the_first_blocker(zoo, name: str, blocker: str):
    with pytest.raises(FoldError, match="not closed under rotation") as caught:
        normfold.rotate(zoo.model(name), zoo.inputs(name, 0))
    assert blocker in str(caught.value)


def test_vit_whose_final_norm_output_is_the_model_output_is_refused(zoo):
    with pytest.raises(FoldError, match="layernorm kept its γ/β"):
        normfold.rotate(zoo.model("vit"), zoo.inputs("vit", 0))


def test_hidden_states_as_outputs_are_refused(zoo):
    call = {**zoo.inputs("gpt2", 0), "output_hidden_states": True}
    with pytest.raises(FoldError, match="still a LayerNorm"):
        normfold.rotate(zoo.model("gpt2"), call)


# ------------------------------------------------------------------------------ bad inputs, before any work

class _MustNotRun(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        raise AssertionError("rotate ran the model before checking its arguments")


@pytest.mark.parametrize("kwargs, error, match", [
    ({"slice_fraction": -0.1}, ValueError, r"slice_fraction must be in \[0, 1\)"),
    ({"slice_fraction": 1.0, "method": "pca", "calibration": ((torch.zeros(1, 4),),)}, ValueError, r"\[0, 1\)"),
    ({"slice_fraction": float("nan"), "method": "pca"}, ValueError, r"\[0, 1\)"),
    ({"slice_fraction": "0.2"}, TypeError, "slice_fraction must be a number"),
    ({"slice_fraction": True}, TypeError, "slice_fraction must be a number"),
    ({"slice_fraction": 0.2}, ValueError, "needs method='pca'"),
    ({"method": "pca"}, ValueError, "method='pca' needs calibration"),
    ({"calibration": ((torch.zeros(1, 4),),)}, ValueError, "calibration is used only by method='pca'"),
    ({"method": "quarot"}, ValueError, r"method must be one of \('hadamard', 'random', 'pca', 'learned'\), got 'quarot'"),
    ({"seed": 1.5}, TypeError, "seed must be an int"),
    ({"method": "pca", "calibration": "text"}, TypeError, "tuple of positional arguments"),
])
def test_bad_arguments_raise_before_any_work(kwargs, error, match):
    with pytest.raises(error, match=match):
        normfold.rotate(_MustNotRun(), (torch.zeros(1, 4),), **kwargs)


def test_a_model_that_is_not_a_module_is_a_type_error():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        normfold.rotate(lambda x: x, (torch.zeros(1, 4),))
