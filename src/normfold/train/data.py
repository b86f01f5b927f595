"""Training text as byte tokens: any text files, or a corpus that ships with CPython.

Byte-level tokenization (token = byte value, vocabulary 256) needs no download and no tokenizer
training, and is the same on every machine, so results are reproducible offline.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

VOCAB_SIZE = 256


def default_corpus() -> str:
    """The pydoc topic help texts of this CPython (~465 kB of English technical prose)."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[key] for key in sorted(topics.topics))


def encode(text: str) -> Tensor:
    """UTF-8 bytes as int64 token ids in [0, 256)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.long)


def decode(tokens: Tensor) -> str:
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def load_text(paths: Sequence[str | Path] = ()) -> str:
    """The concatenated files (sorted order as given), or the default corpus when none are given."""
    if not paths:
        return default_corpus()
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"data files not found: {missing}")
    return "\n\n".join(Path(p).read_text(encoding="utf-8", errors="replace") for p in paths)


class TokenSplits:
    """A deterministic train/validation split of one token stream: the last ``val_fraction`` is
    validation, so no window of validation text is ever seen in training."""

    def __init__(self, tokens: Tensor, block_size: int, val_fraction: float = 0.1) -> None:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        n_val = int(len(tokens) * val_fraction)
        self.train, self.val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]
        for name, split in (("train", self.train), ("val", self.val)):
            if len(split) <= block_size + 1:
                raise ValueError(f"the {name} split has {len(split)} tokens, fewer than block_size + 2 = "
                                 f"{block_size + 2}: give more text or a smaller block_size")
        self.block_size = block_size

    def batch(self, split: str, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Random windows: inputs (B, T) and next-token targets (B, T)."""
        data = self.train if split == "train" else self.val
        starts = torch.randint(len(data) - self.block_size - 1, (batch_size,), generator=generator)
        x = torch.stack([data[s: s + self.block_size] for s in starts.tolist()])
        y = torch.stack([data[s + 1: s + 1 + self.block_size] for s in starts.tolist()])
        return x, y
