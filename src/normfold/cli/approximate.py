"""``fold --approximate`` and ``verify`` of such a folder: the lab's approximate fold composed with hf's
folder fold (hf loads, tokenizes, proves the exact part and saves; it never imports the lab).

The promise of an approximate folder is a cosine bar: every output row (a token, or a sentence
embedding for sentence encoders) keeps a cosine ≥ ``min_cosine`` to the original's on the calibration
sentences. ``normfold verify --calibration FILE`` re-makes the folder from the same file and measures
it again, against the bar of the person verifying (``--min-cosine``, default 0.999).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..hf.inputs import calibration_batches, is_sentence_encoder, load_tokenizer
from ..fold.cosine_bar import DEFAULT_MIN_COSINE
from ..lab.approximate import ApproximateConfig, compare_outputs, mean_pooled, token_outputs

__all__ = ["DEFAULT_MIN_COSINE", "approximate_config", "measure_approximate"]


def approximate_config(min_cosine: float):
    """hf's ``ApproximateStep`` for a cosine bar: the ``normfold.lab.ApproximateConfig`` of the calibration
    batches, with sentence encoders compared on mean-pooled embeddings, every other model on its token outputs."""
    def config(batches: list, sentence_encoder: bool) -> ApproximateConfig:
        return ApproximateConfig(batches, min_cosine=min_cosine, output_fn=mean_pooled if sentence_encoder else None)
    return config


def measure_approximate(original: nn.Module, loaded: nn.Module, tokenizer_dir: Path, sentences: list[str],
                        bar: float, *, trust_remote_code: bool = False) -> dict[str, Any]:
    """An approximate folder's promise, measured: the lowest output cosine of ``loaded`` to ``original``
    on the calibration ``sentences`` (tokenized with the original's tokenizer), against ``bar`` (the
    verifying person's, never the folder's). ``ok`` when it is met."""
    batches = calibration_batches(original, load_tokenizer(tokenizer_dir, trust_remote_code=trust_remote_code), sentences)
    sentence_encoder = is_sentence_encoder(original)
    output_fn = mean_pooled if sentence_encoder else token_outputs
    with torch.no_grad():
        reference = torch.cat([output_fn(original.eval(), b) for b in batches])
        result = torch.cat([output_fn(loaded.eval(), b) for b in batches])
    change = compare_outputs(reference, result)
    ok = change.min_cosine >= bar
    why = None if ok else (f"the lowest output cosine {change.min_cosine!r} is below the bar {bar!r} on the "
                           f"{len(sentences)} calibration sentences")
    return {"ok": ok, "kind": "approximate", "min_cosine": change.min_cosine, "mean_cosine": change.mean_cosine,
            "max_abs_error": change.max_abs_error, "promised_min_cosine": bar, "num_inputs": len(sentences),
            "num_rows": int(reference.shape[0]),
            "compared": "mean-pooled sentence embeddings" if sentence_encoder else "token outputs", "why": why}
