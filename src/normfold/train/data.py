"""Training text as byte tokens: any text files, or a corpus that ships with CPython.

Byte-level tokenization (token = byte value, vocabulary 256) needs no download and no tokenizer
training, and is the same on every machine, so results are reproducible offline.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

VOCAB_SIZE = 256
DOCUMENT_SEPARATOR = "\n\n"
SPLIT_SEED = 0  # which documents are validation: the same for every run, seed and variant


def default_documents() -> list[str]:
    """The pydoc topic help texts of this CPython, one document per topic (79 in CPython 3.12, ~465 kB)."""
    from pydoc_data import topics  # not at the top: a CPython data module, loaded only when the corpus is used

    return [topics.topics[key] for key in sorted(topics.topics)]


def default_corpus() -> str:
    """The pydoc topics as one text (English technical prose)."""
    return DOCUMENT_SEPARATOR.join(default_documents())


def corpus_sha256(documents: Sequence[str]) -> str:
    """SHA-256 of the corpus's UTF-8 bytes as the trainer reads them (documents joined): it changes with the
    CPython version that ships the default corpus, so reports record it."""
    return hashlib.sha256(DOCUMENT_SEPARATOR.join(documents).encode("utf-8")).hexdigest()


def encode(text: str) -> Tensor:
    """UTF-8 bytes as int64 token ids in [0, 256)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.long)


def decode(tokens: Tensor) -> str:
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def load_documents(paths: Sequence[str | Path] = ()) -> list[str]:
    """One document per file (in the order given), or the default corpus's topics when none are given."""
    if not paths:
        return default_documents()
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"data files not found: {missing}")
    return [Path(p).read_text(encoding="utf-8", errors="replace") for p in paths]


def load_text(paths: Sequence[str | Path] = ()) -> str:
    """The documents of :func:`load_documents` as one text."""
    return DOCUMENT_SEPARATOR.join(load_documents(paths))


def split_documents(documents: Sequence[str], val_fraction: float,
                    seed: int = SPLIT_SEED) -> tuple[list[str], list[str]]:
    """``(train, validation)`` documents: whole documents go to validation, taken in a seeded random order
    (each one that still fits) until they hold up to ``val_fraction`` of the bytes; both keep the corpus order.

    Whole documents keep every validation window out of training; a random draw keeps validation from
    being one corner of the corpus (the alphabetically last topics are a shifted domain).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    if len(documents) < 2:
        raise ValueError(f"a document-level split needs at least 2 documents, got {len(documents)}")
    sizes = [len(d.encode("utf-8")) for d in documents]
    budget = val_fraction * sum(sizes)
    order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(seed)).tolist()
    chosen, held = set(), 0
    for i in order:
        if held + sizes[i] <= budget:
            chosen.add(i)
            held += sizes[i]
    if not chosen:
        raise ValueError(f"no whole document fits in val_fraction={val_fraction} of {sum(sizes)} bytes (the "
                         f"smallest has {min(sizes)} bytes): raise val_fraction or give more documents")
    train = [d for i, d in enumerate(documents) if i not in chosen]
    return train, [d for i, d in enumerate(documents) if i in chosen]


class TokenSplits:
    """A deterministic train/validation split of token ids. ``TokenSplits(tokens, ...)`` splits one stream
    (the last ``val_fraction`` is validation); :meth:`from_documents` splits whole documents. Either way no
    window of validation text is ever seen in training. ``description`` says which split was made."""

    def __init__(self, tokens: Tensor, block_size: int, val_fraction: float = 0.1) -> None:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        n_val = int(len(tokens) * val_fraction)
        self._set(tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:], block_size,
                  f"the last {val_fraction:.0%} of one token stream")

    @classmethod
    def from_documents(cls, documents: Sequence[str], block_size: int, val_fraction: float = 0.1,
                       seed: int = SPLIT_SEED) -> "TokenSplits":
        """Whole documents to validation (:func:`split_documents`). One document, or documents each larger than
        ``val_fraction`` of the text (two equal files at 10%), are split at the tail, and ``description`` says so."""
        sizes = [len(d.encode("utf-8")) for d in documents]
        if len(documents) < 2 or min(sizes) > val_fraction * sum(sizes):
            splits = cls(encode(DOCUMENT_SEPARATOR.join(documents)), block_size, val_fraction)
            splits.description += (f" ({len(documents)} document{'s' * (len(documents) != 1)}, none small enough "
                                   "to hold out whole)")
            return splits
        train, val = split_documents(documents, val_fraction, seed)
        splits = cls.__new__(cls)
        splits._set(encode(DOCUMENT_SEPARATOR.join(train)), encode(DOCUMENT_SEPARATOR.join(val)), block_size,
                    f"{len(val)} of {len(documents)} whole documents (seed {seed})")
        return splits

    def _set(self, train: Tensor, val: Tensor, block_size: int, description: str) -> None:
        for name, split in (("train", train), ("val", val)):
            if len(split) <= block_size + 1:
                raise ValueError(f"the {name} split has {len(split)} tokens, fewer than block_size + 2 = "
                                 f"{block_size + 2}: give more text or a smaller block_size")
        self.train, self.val, self.block_size, self.description = train, val, block_size, description

    def batch(self, split: str, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Random windows: inputs (B, T) and next-token targets (B, T)."""
        data = self.train if split == "train" else self.val
        starts = torch.randint(len(data) - self.block_size - 1, (batch_size,), generator=generator)
        x = torch.stack([data[s: s + self.block_size] for s in starts.tolist()])
        y = torch.stack([data[s + 1: s + 1 + self.block_size] for s in starts.tolist()])
        return x, y
