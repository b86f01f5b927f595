"""A folded sentence-transformers folder keeps its pipeline: ``SentenceTransformer(out)`` gives the
original's embeddings (the real all-MiniLM-L6-v2, folded by the ``normfold fold`` command)."""
from __future__ import annotations

import pytest
import torch

import normfold
from normfold.cli import main

st = pytest.importorskip("sentence_transformers")

SENTENCES = ["A man is eating food.", "normfold turns LayerNorms into RMSNorms without changing outputs.",
             "The quick brown fox jumps over the lazy dog", "Ünïcödé and numbers 12345 too"]
PIPELINE_FILES = ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json",
                  "1_Pooling/config.json", "tokenizer.json", "vocab.txt", "README.md")


@pytest.fixture(scope="module")
def folded_minilm(minilm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("st") / "folded"
    assert main(["fold", str(minilm_dir), "-o", str(out), "--json"]) == 0
    return out


def _embed(folder) -> torch.Tensor:
    return st.SentenceTransformer(str(folder), device="cpu").encode(SENTENCES, convert_to_tensor=True)


def test_folded_folder_keeps_the_sentence_transformers_files(minilm_dir, folded_minilm):
    for name in PIPELINE_FILES:
        original = (minilm_dir / name).read_bytes()
        if name == "README.md":  # the model card: the original's, then normfold's section
            assert (folded_minilm / name).read_bytes().startswith(original.rstrip(b"\n") + b"\n\n## Folded by normfold")
        else:
            assert (folded_minilm / name).read_bytes() == original, name


def test_sentence_transformer_on_the_folded_folder_gives_the_original_embeddings(minilm_dir, folded_minilm):
    original, folded = _embed(minilm_dir), _embed(folded_minilm)
    torch.testing.assert_close(folded.norm(dim=-1), torch.ones(len(SENTENCES)), rtol=0, atol=1e-5)  # 2_Normalize ran
    assert torch.nn.functional.cosine_similarity(original, folded).min().item() >= 0.99999
    assert (original - folded).abs().max().item() < 1e-5


def test_the_fast_pipeline_runs_normfold_kernels_and_gives_the_original_embeddings(minilm_dir, folded_minilm):
    from normfold.hf import sentence_transformer
    from normfold.nn import RMSNorm

    fast = sentence_transformer(folded_minilm, normfold.FuseConfig(), device="cpu")
    kinds = {type(m).__name__ for m in fast[0].auto_model.modules()}
    assert any(isinstance(m, RMSNorm) for m in fast[0].auto_model.modules()), kinds  # stock loads a LayerNorm there
    stock = st.SentenceTransformer(str(folded_minilm), device="cpu")
    assert not any(isinstance(m, RMSNorm) for m in stock[0].auto_model.modules())
    original = _embed(minilm_dir)
    embeddings = fast.encode(SENTENCES, convert_to_tensor=True)
    assert torch.nn.functional.cosine_similarity(original, embeddings).min().item() >= 0.99999
    assert (original - embeddings).abs().max().item() < 1e-5


def test_the_fast_pipeline_refuses_a_folder_that_is_not_a_sentence_transformers_one(tiny_dirs):
    from normfold.hf import CheckpointError, sentence_transformer

    with pytest.raises(CheckpointError, match="not a sentence-transformers folder"):
        sentence_transformer(tiny_dirs["gpt2"])
    with pytest.raises(CheckpointError, match="not a sentence-transformers folder"):
        sentence_transformer(tiny_dirs["gpt2"], normfold.FuseConfig())
