"""``fold --approximate`` and ``verify`` of such a folder: the lab's approximate fold composed with hf's
folder fold (hf loads, tokenizes, proves the exact part and saves; it never imports the lab).

The promise of an approximate folder is a cosine bar: every output row (a token, or a sentence
embedding for sentence encoders) keeps a cosine ≥ ``min_cosine`` to the original's on the calibration
sentences. ``normfold verify`` re-measures it on the sentences the report records.
"""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..convert import ApproximateConfig
from ..fold import FoldReport
from ..hf.folder import Step
from ..hf.inputs import calibration_batches, is_sentence_encoder, load_tokenizer
from ..hf.load import CheckpointError, load_model
from ..hf.output_dir import REPORT_JSON
from ..hf.saving import from_pretrained
from ..lab.approximate import approximate_fold, compare_outputs, mean_pooled, token_outputs

DEFAULT_MIN_COSINE = 0.999


def approximate_step(min_cosine: float):
    """hf's ``ApproximateFold`` for a cosine bar: ``normfold.lab.approximate_fold`` with sentence
    encoders compared on mean-pooled embeddings, every other model on its token outputs."""
    return partial(_approximate, min_cosine=min_cosine)


def _approximate(original: nn.Module, folded: nn.Module, report: FoldReport, batches: list, sentence_encoder: bool,
                 step: Step, *, min_cosine: float):
    config = ApproximateConfig(batches, min_cosine=min_cosine, output_fn=mean_pooled if sentence_encoder else None)
    step(f"approximate fold on {len(batches)} calibration batch(es)")  # approximate_fold draws its own bars
    return approximate_fold(original, folded, report, config.calibration, min_cosine=config.min_cosine,
                            output_fn=config.output_fn)


def is_approximate(report: dict[str, Any]) -> bool:
    """Whether a folder's report records an approximate fold (some norms replaced within a cosine bar)."""
    return bool(report.get("num_approximate"))


def read_report(folded_dir: str | Path) -> dict[str, Any]:
    """The folder's ``normfold_report.json``; CheckpointError when it is missing or not a JSON object."""
    path = Path(folded_dir) / REPORT_JSON
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"{path} not found: {folded_dir} is not a folder normfold wrote") from err
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not a readable JSON report: {err}") from err
    if not isinstance(report, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(report).__name__}")
    return report


def verify_approximate_folder(orig_dir, folded_dir, report: dict[str, Any], *, trust_remote_code: bool = False,
                              step: Step) -> dict[str, Any]:
    """Re-measure an approximate folder's promise: the lowest output cosine to the original on the
    calibration sentences its report records, against the bar it records. ``ok`` when it is met."""
    promised, sentences, compared = _promise(report, folded_dir)
    step("loading")
    original = load_model(orig_dir, trust_remote_code=trust_remote_code)
    folded = from_pretrained(folded_dir, trust_remote_code=trust_remote_code)
    batches = calibration_batches(original, load_tokenizer(folded_dir, trust_remote_code=trust_remote_code), sentences)
    output_fn = mean_pooled if is_sentence_encoder(original) else token_outputs
    step(f"measuring the cosine on {len(sentences)} calibration sentences")
    with torch.no_grad():
        reference = torch.cat([output_fn(original.eval(), b) for b in batches])
        result = torch.cat([output_fn(folded.eval(), b) for b in batches])
    change = compare_outputs(reference, result)
    ok = change.min_cosine >= promised
    why = None if ok else (f"the lowest output cosine {change.min_cosine!r} is below the promised {promised!r} "
                           f"on the {len(sentences)} calibration sentences")
    return {"ok": ok, "kind": "approximate", "min_cosine": change.min_cosine, "mean_cosine": change.mean_cosine,
            "max_abs_error": change.max_abs_error, "promised_min_cosine": promised, "num_inputs": len(sentences),
            "num_rows": int(reference.shape[0]), "compared": compared, "why": why}


def _promise(report: dict[str, Any], folded_dir) -> tuple[float, list[str], str]:
    """(the cosine bar, the calibration sentences, what was compared) a report records; CheckpointError
    when it lacks them (a folder from an older normfold): such a folder cannot be checked."""
    approx = report.get("approximate") or {}
    promised, sentences = approx.get("min_cosine"), approx.get("calibration_sentences")
    if not isinstance(promised, (int, float)) or not sentences or not all(isinstance(s, str) for s in sentences):
        raise CheckpointError(f"{Path(folded_dir) / REPORT_JSON} records an approximate fold without its cosine bar "
                              "and calibration sentences (written by an older normfold): its promise cannot be "
                              "re-measured; fold it again")
    return float(promised), sentences, approx.get("compared", "outputs")
