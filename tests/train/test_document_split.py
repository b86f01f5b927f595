"""The training data's document-level validation split and the corpus hash (issue 18 item 4)."""
from __future__ import annotations

import hashlib

import pytest
import torch

from normfold.train import resolve_config, train
from normfold.train import trainer as trainer_module
from normfold.train.data import (DOCUMENT_SEPARATOR, TokenSplits, corpus_sha256, decode, default_documents,
                                 load_documents, split_documents)

DOCS = [f"document {i}: " + chr(65 + i % 26) * (40 + 7 * i) for i in range(30)]


def test_validation_holds_whole_documents_up_to_the_fraction_and_training_the_rest():
    train_docs, val_docs = split_documents(DOCS, 0.2)
    assert val_docs and set(train_docs).isdisjoint(val_docs)
    assert sorted(train_docs + val_docs) == sorted(DOCS)
    assert [d for d in DOCS if d in val_docs] == val_docs  # corpus order kept
    size = lambda docs: sum(len(d.encode()) for d in docs)  # noqa: E731
    assert size(val_docs) <= 0.2 * size(DOCS)


def test_the_split_is_seeded_not_the_last_documents():
    assert split_documents(DOCS, 0.2) == split_documents(DOCS, 0.2)
    assert split_documents(DOCS, 0.2, seed=1) != split_documents(DOCS, 0.2, seed=0)
    _, val_docs = split_documents(DOCS, 0.2)
    assert val_docs != DOCS[-len(val_docs):]
    _, default_val = split_documents(default_documents(), 0.1)
    assert default_val != default_documents()[-len(default_val):]


def test_token_splits_from_documents_keep_validation_text_out_of_training():
    splits = TokenSplits.from_documents(DOCS, block_size=8, val_fraction=0.2)
    train_text, val_text = decode(splits.train), decode(splits.val)
    val_docs = val_text.split(DOCUMENT_SEPARATOR)
    assert all(d in DOCS and d not in train_text for d in val_docs)
    assert "whole documents" in splits.description


@pytest.mark.parametrize("documents", [["x" * 200], ["x" * 100, "y" * 100]])
def test_documents_too_large_to_hold_out_whole_fall_back_to_the_tail_and_say_so(documents):
    splits = TokenSplits.from_documents(documents, block_size=8, val_fraction=0.1)
    assert len(splits.val) == int(len(DOCUMENT_SEPARATOR.join(documents)) * 0.1)
    assert "one token stream" in splits.description and "none small enough to hold out whole" in splits.description


@pytest.mark.parametrize("documents, fraction, message", [
    (DOCS, 0.0, "val_fraction must be in"),
    (DOCS, 1.0, "val_fraction must be in"),
    (DOCS[:1], 0.1, "at least 2 documents"),
    (["a" * 100, "b" * 100], 0.1, "no whole document fits"),
])
def test_impossible_splits_are_refused(documents, fraction, message):
    with pytest.raises(ValueError, match=message):
        split_documents(documents, fraction)


def test_corpus_hash_is_sha256_of_the_joined_bytes_and_sees_one_byte():
    assert corpus_sha256(DOCS) == hashlib.sha256(DOCUMENT_SEPARATOR.join(DOCS).encode()).hexdigest()
    assert corpus_sha256(DOCS) != corpus_sha256(DOCS[:-1] + [DOCS[-1] + "."])


def test_load_documents_reads_one_document_per_file(tmp_path):
    paths = []
    for i, text in enumerate(("first file", "second\n\nfile")):
        paths.append(tmp_path / f"{i}.txt")
        paths[-1].write_text(text)
    assert load_documents(paths) == ["first file", "second\n\nfile"]
    with pytest.raises(FileNotFoundError, match="not found"):
        load_documents([tmp_path / "missing.txt"])


def test_the_trainer_validates_on_the_document_split(tmp_path, monkeypatch):
    made = []
    original = TokenSplits.from_documents.__func__

    def spy(cls, documents, *args, **kwargs):
        made.append(original(cls, documents, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(trainer_module.TokenSplits, "from_documents", classmethod(spy))
    config = resolve_config(out_dir=str(tmp_path), progress=False, save_checkpoint=False, n_layer=1, n_head=1,
                            n_embd=8, block_size=8, batch_size=2, max_steps=1, eval_iters=1)
    train(config)
    assert len(made) == 1 and "whole documents" in made[0].description
    expected = TokenSplits.from_documents(default_documents(), 8, 0.1)
    assert torch.equal(made[0].val, expected.val)
