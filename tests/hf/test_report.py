"""The folder report's views say what happened: the markdown headline counts where γ/β went (not
the option asked for), and an approximately replaced norm's row gives its cosine and the number of
calibration inputs instead of what blocked the exact fold."""
from __future__ import annotations

from normfold.hf.report import norm_rows, render_markdown


def _norm(path: str, *, foldable: bool, affine_folded: bool, reason: str = "input zero-mean: centered 2 producers"):
    return {"path": path, "foldable": foldable, "affine_folded": affine_folded, "reason": reason}


def _headline(report: dict) -> str:
    return next(line for line in render_markdown(report).splitlines() if line.startswith("**"))


def test_the_headline_counts_the_norms_whose_affine_moved_into_the_next_layer():
    report = {"fold_affine": True, "norms": [_norm("a", foldable=True, affine_folded=True),
                                             _norm("b", foldable=True, affine_folded=False),
                                             _norm("c", foldable=False, affine_folded=True, reason="blocked: x")]}
    assert _headline(report) == ("**2 of 3 LayerNorms folded into RMSNorm** "
                                 "(the affine γ/β of 2 folded into the next linear layers)")


def test_the_headline_says_every_norm_keeps_its_affine_when_none_moved_though_folding_was_asked_for():
    report = {"fold_affine": True, "norms": [_norm("a", foldable=True, affine_folded=False),
                                             _norm("b", foldable=False, affine_folded=False, reason="blocked: x")]}
    headline = _headline(report)
    assert headline == "**1 of 2 LayerNorms folded into RMSNorm** (every norm keeps its γ/β)"
    assert "folded into the next linear layers" not in headline


def test_the_headline_says_affine_folding_was_turned_off_when_it_was():
    report = {"fold_affine": False, "norms": [_norm("a", foldable=True, affine_folded=False)]}
    assert _headline(report) == ("**1 of 1 LayerNorms folded into RMSNorm** "
                                 "(affine folding turned off: every norm keeps its γ/β)")


def _approximate_report(sentences: list[str] | None) -> dict:
    """Two norms the exact fold kept, one of them replaced approximately, as `fold --approximate` writes it."""
    blocked = "blocked: aten.add at encoder.layer.0.output: a residual add whose inputs are not both zero-mean"
    approximate = {"min_cosine": 0.999, "entries": [
        {"path": "encoder.layer.0.LayerNorm", "status": "approximate", "cosine_alone": 0.99931,
         "correction": "γ/β folded into the next linear layers, mean shift into its bias"},
        {"path": "encoder.layer.1.LayerNorm", "status": "kept", "cosine_alone": 0.97, "correction": ""}]}
    recipe = {"calibration": None if sentences is None else {"sha256": "0" * 64, "num_sentences": len(sentences),
                                                             "path": "/data/calibration.txt"}}
    return {"fold_affine": True, "approximate": approximate, "recipe": recipe, "approximate_norms": ["encoder.layer.0.LayerNorm"],
            "norms": [_norm("encoder.layer.0.LayerNorm", foldable=False, affine_folded=False, reason=blocked),
                      _norm("encoder.layer.1.LayerNorm", foldable=False, affine_folded=False, reason=blocked)]}


def test_an_approximate_row_gives_its_cosine_on_the_number_of_calibration_inputs_and_no_blocker():
    replaced, kept = norm_rows(_approximate_report(["one.", "two.", "three."]))
    assert replaced["reason"] == ("approximate: cosine 0.999310 on 3 calibration inputs; γ/β folded into the next "
                                  "linear layers, mean shift into its bias")
    assert replaced["approximate"] and not replaced["folded"] and replaced["blocker"] is None
    assert "blocked" not in replaced["reason"]
    assert kept["reason"].startswith("blocked: ") and kept["blocker"] == kept["reason"]  # not replaced: its blocker


def test_an_approximate_row_of_a_report_without_its_sentences_does_not_invent_a_count():
    replaced, _ = norm_rows(_approximate_report(None))
    assert replaced["reason"].startswith("approximate: cosine 0.999310 on the calibration inputs; ")


def test_the_headline_counts_approximate_replacements():
    assert _headline(_approximate_report(["one."])).startswith(
        "**0 of 2 LayerNorms folded into RMSNorm, 1 replaced approximately**")
