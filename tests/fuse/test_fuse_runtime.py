"""Fused models give the unfused folded model's outputs wherever it runs: inference mode, no_grad,
autocast, torch.compile (aot_eager, Inductor), a Hugging Face pipeline and ``generate()``.

Where the early norm output cannot be checked at run time (compiling, inference tensors have no
version counter), a pair inside one forward is fused only when its code proves the sum unmodified,
and an add handed to another module's norm runs unfused; these tests pin both down.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from normfold.fuse import fuse_residual_norms
from normfold.nn import RMSNorm
from test_fuse import PostNormBlock, PreNormStack, ResidualBlock, count_runs

FLOAT64_TOL = dict(rtol=1e-10, atol=1e-10)  # a stale norm is off by ~0.3; fused vs unfused float64 ~1e-15


# ------------------------------------------------------------------------------ toy modules

class InPlaceSum(nn.Module):
    """``h = x + f(x); h.mul_(g); ln(h)``: the sum changes in place between the add and the norm."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.f = nn.Linear(width, width)
        self.g = nn.Parameter(torch.randn(width))
        self.ln = RMSNorm(width)

    def forward(self, x):
        h = x + self.f(x)
        h.mul_(self.g)
        y = self.ln(h)
        return y


class WrittenView(InPlaceSum):
    """A view of the sum is written before the norm."""

    def forward(self, x):
        h = x + self.f(x)
        first = h[..., :1]
        first.mul_(3.0)
        y = self.ln(h)
        return y


class MutatingCaller(PreNormStack):
    """The caller scales each block's output in place before the next block's norm takes it."""

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            x.mul_(1.5)
        return self.norm_f(x)


def _toy(cls):
    torch.manual_seed(0)
    model = cls().double().eval()
    for m in model.modules():
        if isinstance(m, RMSNorm) and m.weight is not None:
            nn.init.normal_(m.weight)
    return model


def _x(seed: int = 0):
    return torch.randn(2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _compiled(model, backend):
    torch._dynamo.reset()
    return torch.compile(model, backend=backend)


# ------------------------------------------------------------------------------ in-place changes of the sum

@pytest.mark.parametrize("cls", [InPlaceSum, WrittenView])
def test_a_sum_changed_in_place_is_refused_statically_and_exact_under_compile_and_inference_mode(cls):
    model = _toy(cls)
    x = _x()
    fused, report = fuse_residual_norms(model, (x,))
    assert report.fused == [] and "changed in place" in report.skipped["ln"]
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(_compiled(fused, "aot_eager")(x), expected, **FLOAT64_TOL)
    with torch.inference_mode():
        torch.testing.assert_close(fused(x), model(x), **FLOAT64_TOL)


def test_a_caller_changing_a_handed_on_sum_stays_exact_eager_compiled_and_in_inference_mode():
    model = _toy(MutatingCaller)
    x = _x()
    fused, report = fuse_residual_norms(model, (x,))
    assert len(report.fused) == 3  # each block's add is handed to the next norm; checked at run time
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(fused(x), expected, **FLOAT64_TOL)
        torch.testing.assert_close(_compiled(fused, "aot_eager")(x), expected, **FLOAT64_TOL)
    with torch.inference_mode():
        torch.testing.assert_close(fused(x), model(x), **FLOAT64_TOL)


# ------------------------------------------------------------------------------ hooks added after fusing

def _hooked(model: nn.Module, paths: list[str]) -> list:
    """Hooks on the norms at ``paths``: a pre-hook doubling the input (so a skipped one changes the
    output) and a forward hook recording each call; returns the record."""
    seen = []
    for path in paths:
        norm = model.get_submodule(path)
        norm.register_forward_pre_hook(lambda module, args: (2 * args[0],))
        norm.register_forward_hook(lambda module, args, output, path=path: seen.append(path))
    return seen


RUNS = {"eager": lambda m, x: m(x), "compiled": lambda m, x: _compiled(m, "aot_eager")(x)}


@pytest.mark.parametrize("cls", [ResidualBlock, PostNormBlock, PreNormStack],
                         ids=["pair in one forward", "add inside the call", "add handed to the next module"])
@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("inference", [False, True], ids=["no_grad", "inference_mode"])
def test_hooks_registered_on_fused_norms_after_fusing_run_as_on_the_unfused_model(cls, run, inference):
    # before: a fused call bypassed the norm module, and with it every hook registered after fusing
    model, x = _toy(cls), _x()
    fused, report = fuse_residual_norms(model, (x,))
    paths = [pair.norm for pair in report.fused]
    assert paths
    seen, expected_seen = _hooked(fused, paths), _hooked(model, paths)
    with torch.inference_mode() if inference else torch.no_grad():
        expected = model(x)
        got = RUNS[run](fused, x)
    torch.testing.assert_close(got, expected, **FLOAT64_TOL)
    assert sorted(seen) == sorted(expected_seen) and set(seen) == set(paths)


def test_a_fused_norm_takes_the_fused_path_again_once_its_hook_is_removed():
    model, x = _toy(ResidualBlock), _x()
    fused, _ = fuse_residual_norms(model, (x,))
    runs = count_runs(fused.norm)
    handle = fused.norm.register_forward_hook(lambda *_: None)
    with torch.no_grad():
        fused(x)
        assert runs == [1]  # the hook's module ran
        handle.remove()
        torch.testing.assert_close(fused(x), model(x), **FLOAT64_TOL)
    assert runs == [1]  # fused again: the module did not run


def test_a_global_module_hook_runs_on_fused_norms():
    model, x = _toy(PreNormStack), _x()
    fused, report = fuse_residual_norms(model, (x,))
    seen = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, args, output: seen.append(module) if isinstance(module, RMSNorm) else None)
    try:
        with torch.no_grad():
            fused(x)
    finally:
        handle.remove()
    assert {id(fused.get_submodule(pair.norm)) for pair in report.fused} <= {id(m) for m in seen}


@pytest.mark.slow
def test_inductor_compiles_the_fused_gpt2_and_the_in_place_toy_exactly(fused_gpt2):
    folded, fused, inputs = fused_gpt2
    model, x = _toy(InPlaceSum), _x()
    toy, _ = fuse_residual_norms(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(_compiled(toy, "inductor")(x), model(x), **FLOAT64_TOL)
        torch.testing.assert_close(_compiled(fused, "inductor")(**inputs).logits, folded(**inputs).logits,
                                   **FLOAT64_TOL)


# ------------------------------------------------------------------------------ a tiny GPT-2 everywhere

@pytest.fixture(scope="module")
def fused_gpt2(zoo):
    """(folded float64 GPT-2, its fused copy, fresh inputs): ln_2 fused in the block, ln_1 / ln_f handed on."""
    folded = zoo.fold("gpt2", torch.float64)
    fused, report = fuse_residual_norms(folded.folded, folded.example_inputs)
    assert len(report.fused) == 5 and report.skipped == {}
    return folded.folded, fused, folded.fresh_inputs


def test_fused_gpt2_matches_the_folded_model_in_inference_mode_and_no_grad_eager_and_compiled(fused_gpt2):
    folded, fused, inputs = fused_gpt2
    compiled = _compiled(fused, "aot_eager")
    for context in (torch.inference_mode, torch.no_grad):
        with context():
            expected = folded(**inputs).logits
            torch.testing.assert_close(fused(**inputs).logits, expected, **FLOAT64_TOL)
            torch.testing.assert_close(compiled(**inputs).logits, expected, **FLOAT64_TOL)


class TwoLinearSum(nn.Module):
    """Both operands of the add come from linear layers: bfloat16 under CPU autocast, so the fused op runs."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.ln = RMSNorm(width)

    def forward(self, x):
        h = self.a(x) + self.b(x)
        return self.ln(h), h


def test_fused_models_match_the_unfused_ones_under_bf16_autocast_in_inference_mode(fused_gpt2):
    model = _toy(TwoLinearSum).float()
    x = _x().float().repeat(1, 1, 2)  # (2, 3, 16)
    fused, report = fuse_residual_norms(model, (x,))
    assert len(report.fused) == 1
    calls = count_runs(fused.ln)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        (y, h), (y_ref, h_ref) = fused(x), model(x)
    assert y.dtype == torch.bfloat16 and calls == []  # the fused op ran, on bfloat16 operands
    assert torch.equal(y, y_ref) and torch.equal(h, h_ref)
    # GPT-2: bfloat16 sublayer outputs meet the float32 residual stream, so its adds run unfused: still exact
    folded, gpt2, inputs = (m.float() if isinstance(m, nn.Module) else m for m in copy.deepcopy(fused_gpt2))
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(gpt2(**inputs).logits, folded(**inputs).logits)


def test_fused_gpt2_generates_what_the_folded_model_generates_in_inference_mode(fused_gpt2):
    folded, fused, inputs = fused_gpt2
    ids = inputs["input_ids"]
    outs = []
    with torch.inference_mode():
        for model in (folded, fused):
            outs.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                       output_scores=True, return_dict_in_generate=True, pad_token_id=0))
    assert torch.equal(outs[1].sequences, outs[0].sequences) and outs[0].sequences.shape[1] == ids.shape[1] + 4
    for got, expected in zip(outs[1].scores, outs[0].scores, strict=True):
        torch.testing.assert_close(got, expected, **FLOAT64_TOL)


def _word_tokenizer(vocab: int):
    """A whitespace word-level tokenizer over the words w0 .. w{vocab-1}: enough for a text pipeline."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.decoder = tokenizers.decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", pad_token="w0", eos_token="w0")


def test_fused_gpt2_in_a_text_generation_pipeline_matches_the_folded_model(fused_gpt2):
    from transformers import pipeline

    folded, fused, _ = fused_gpt2
    tokenizer = _word_tokenizer(folded.config.vocab_size)
    prompt = "w5 w17 w3 w42 w9"
    texts = []
    with torch.inference_mode():  # as serving stacks call it
        for model in (folded, fused):
            generate = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
            out = generate(prompt, max_new_tokens=4, do_sample=False, return_tensors=True)
            texts.append(out[0]["generated_token_ids"])
    assert texts[1] == texts[0] and len(texts[0]) == 5 + 4
