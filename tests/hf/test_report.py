"""The folder report's views say what happened: the markdown headline counts where γ/β went (not
the option asked for), and an approximately replaced norm's row gives its cosine and the number of
calibration inputs instead of what blocked the exact fold."""
from __future__ import annotations

from normfold.hf.card import model_card, render_markdown
from normfold.hf.folder_report import ApproximateNorms, FolderReport, FoldSection, Layout, ReportNorm
from normfold.hf.recipe import CalibrationRecord, Recipe
from normfold.hf.report import report_rows


def _norm(path: str, *, foldable: bool, affine_folded: bool, reason: str = "input zero-mean: centered 2 producers",
          **fields) -> ReportNorm:
    return ReportNorm(path, "LayerNorm", foldable, affine_folded, reason, **fields)


def _report(norms: list[ReportNorm], *, verification: dict | None = None, approximate: dict | None = None,
            approximate_norms: tuple[str, ...] = (), recipe: Recipe | None = None, stock_compatible: bool = True,
            fold_affine: bool | None = True) -> FolderReport:
    """A folder report holding only what the markdown and the card read."""
    return FolderReport(Layout((), stock_compatible=stock_compatible), "float32", recipe=recipe,
                        fold=FoldSection(tuple(norms), verification=verification,
                                         num_approximate=len(approximate_norms)),
                        sections={"approximate": approximate, "fuse": None},
                        approximate=ApproximateNorms(approximate_norms, 0.999) if approximate else None,
                        fold_affine=fold_affine)


def _headline(report: FolderReport) -> str:
    return next(line for line in render_markdown(report).splitlines() if line.startswith("**"))


def test_the_headline_counts_the_norms_whose_affine_moved_into_the_next_layer():
    report = _report([_norm("a", foldable=True, affine_folded=True), _norm("b", foldable=True, affine_folded=False),
                      _norm("c", foldable=False, affine_folded=True, reason="blocked: x")])
    assert _headline(report) == ("**2 of 3 LayerNorms folded into RMSNorm** "
                                 "(the affine γ/β of 2 folded into the next linear layers)")


def test_the_headline_says_every_norm_keeps_its_affine_when_none_moved_though_folding_was_asked_for():
    report = _report([_norm("a", foldable=True, affine_folded=False),
                      _norm("b", foldable=False, affine_folded=False, reason="blocked: x")])
    headline = _headline(report)
    assert headline == "**1 of 2 LayerNorms folded into RMSNorm** (every norm keeps its γ/β)"
    assert "folded into the next linear layers" not in headline


def test_the_headline_says_affine_folding_was_turned_off_when_it_was():
    report = _report([_norm("a", foldable=True, affine_folded=False)], fold_affine=False)
    assert _headline(report) == ("**1 of 1 LayerNorms folded into RMSNorm** "
                                 "(affine folding turned off: every norm keeps its γ/β)")


def _approximate_report(sentences: list[str] | None) -> FolderReport:
    """Two norms the exact fold kept, one of them replaced approximately, as `fold --approximate` writes it."""
    blocked = "blocked: aten.add at encoder.layer.0.output: a residual add whose inputs are not both zero-mean"
    approximate = {"min_cosine": 0.999, "entries": [
        {"path": "encoder.layer.0.LayerNorm", "status": "approximate", "cosine_alone": 0.99931,
         "correction": "γ/β folded into the next linear layers, mean shift into its bias"},
        {"path": "encoder.layer.1.LayerNorm", "status": "kept", "cosine_alone": 0.97, "correction": ""}]}
    calibration = (None if sentences is None
                   else CalibrationRecord("0" * 64, len(sentences), "/data/calibration.txt"))
    recipe = Recipe("fold", False, True, None, approximate_min_cosine=0.999, calibration=calibration)
    return _report([_norm("encoder.layer.0.LayerNorm", foldable=False, affine_folded=False, reason=blocked),
                    _norm("encoder.layer.1.LayerNorm", foldable=False, affine_folded=False, reason=blocked)],
                   approximate=approximate, approximate_norms=("encoder.layer.0.LayerNorm",), recipe=recipe)


def test_an_approximate_row_gives_its_cosine_on_the_number_of_calibration_inputs_and_no_blocker():
    replaced, kept = report_rows(_approximate_report(["one.", "two.", "three."]))
    assert replaced["reason"] == ("approximate: cosine 0.999310 on 3 calibration inputs; γ/β folded into the next "
                                  "linear layers, mean shift into its bias")
    assert replaced["approximate"] and not replaced["folded"] and replaced["blocker"] is None
    assert "blocked" not in replaced["reason"]
    assert kept["reason"].startswith("blocked: ") and kept["blocker"] == kept["reason"]  # not replaced: its blocker


def test_an_approximate_row_of_a_report_without_its_sentences_does_not_invent_a_count():
    replaced, _ = report_rows(_approximate_report(None))
    assert replaced["reason"].startswith("approximate: cosine 0.999310 on the calibration inputs; ")


def test_the_headline_counts_approximate_replacements():
    assert _headline(_approximate_report(["one."])).startswith(
        "**0 of 2 LayerNorms folded into RMSNorm, 1 replaced approximately**")


# ------------------------------------------------------------------------------- reports people read

_CAUSE = "aten.layer_norm output with an affine transform is not zero-mean"


def _blocked(path: str, where: str) -> ReportNorm:
    """A norm blocked at ``where``, as the engine reports it: the reason, and its parts as fields."""
    return _norm(path, foldable=False, affine_folded=False, reason=f"blocked: {where}: {_CAUSE}",
                 blocking_path=("aten.add", where), blocker=_CAUSE)


def _residual_report(**options) -> FolderReport:
    """A post-LN stack as the engine reports it: the first norm folds, each later one is blocked by
    the norm before it, and folded norms along a residual stream share producers."""
    why = "its output feeds aten.add at h.0, not a linear layer"
    norms = [_norm("emb.ln", foldable=True, affine_folded=False,
                   reason=f"input zero-mean: centered 2 producers; affine kept: {why}", affine_kept=why,
                   producers=("wte.weight", "wpe.weight")),
             _norm("h.0.ln", foldable=True, affine_folded=True, reason="input zero-mean: centered 3 producers",
                   producers=("wte.weight", "wpe.weight", "h.0.proj.bias"))]
    norms += [_blocked(f"h.{i}.ln2", f"aten.layer_norm at h.{i}.ln") for i in range(3)]
    norms.append(_norm("pool.ln", foldable=False, affine_folded=False,
                       reason="kept whole: normalizes over several dims together, (4, 8) (only the last dim alone folds)"))
    verification = {"ok": True, "max_rel_error": 1.5e-14, "max_abs_error": 5e-15, "tolerance": 1e-9,
                    "tolerance_rule": "fixed", "num_runs": 3, "why": None, "fallback": None, "compared_in": "float64",
                    "max_input_mean_ratio": 3.8e-17, "model_dtype_max_rel_error": None, "stored_dtype_own_error": None,
                    "worst": {"output": "out['logits']", "index": [0, 1], "original": 0.5, "folded": 0.5,
                              "error": 1e-14, "input": 2}}
    return _report(norms, verification=verification, **options)


def test_kept_norms_are_grouped_by_cause_one_sentence_each_with_where_each_input_stops_being_zero_mean():
    markdown = render_markdown(_residual_report())
    cause = "aten.layer_norm output with an affine transform is not zero-mean"
    assert markdown.count(cause) == 1  # once, not once per norm
    assert f"**3 norms**: {cause}." in markdown
    assert "| `h.1.ln2` | aten.layer_norm at h.1.ln |" in markdown
    assert "**1 norm**: kept whole: normalizes over several dims together" in markdown
    assert "## Kept as LayerNorm (4)" in markdown


def test_the_kept_heading_names_each_kind_kept_and_calls_no_rmsnorm_a_layernorm():
    report = _residual_report()
    rms = ReportNorm("final.rms", "RMSNorm", False, False, "blocked: aten.add at h.2: " + _CAUSE, blocker=_CAUSE,
                     blocking_path=("aten.add", "h.2"))
    mixed = _report([*report.fold.norms, rms], verification=report.fold.verification)
    assert "## Kept as they were: 4 LayerNorm, 1 RMSNorm (5)" in render_markdown(mixed)
    assert "Kept as LayerNorm" not in render_markdown(mixed)


def test_each_folded_norm_counts_the_producers_centered_for_it_that_no_earlier_norm_had():
    markdown = render_markdown(_residual_report())
    assert "| `emb.ln` | 2 | kept in the RMSNorm: its output feeds aten.add at h.0, not a linear layer |" in markdown
    assert "| `h.0.ln` | 1 new (3 in all) | folded into the next linear layers |" in markdown


def test_the_proof_is_in_words_without_field_names_or_none():
    markdown = render_markdown(_residual_report())
    assert "## Proof: passed" in markdown
    assert "max relative error 1.5e-14 ≤ tolerance 1e-09" in markdown
    assert "out['logits'][0, 1] on input 2" in markdown
    for field in ("max_rel_error", "max_input_mean_ratio", "tolerance_rule", "why", "None", "| figure |"):
        assert field not in markdown, field


def test_a_comparison_of_nothing_says_why_instead_of_figures():
    report = _residual_report()
    report = report.with_verification({**report.verification, "ok": False, "why": "no floating output to compare"})
    markdown = render_markdown(report)
    assert "## Proof: FAILED" in markdown and "could not be compared on 3 inputs" in markdown
    assert "no floating output to compare" in markdown and "max relative error" not in markdown


def test_the_model_card_keeps_the_original_and_adds_one_normfold_section():
    original = "---\nlicense: apache-2.0\n---\n\n# My model\n\nTrained on things.\n"
    card = model_card(_residual_report(), original)
    assert card.startswith(original.rstrip("\n"))
    assert card.count("## Folded by normfold") == 1
    assert "**2 of 6 LayerNorms folded into RMSNorm**" in card and "normfold.from_pretrained(folder)" in card
    again = model_card(_residual_report(), card)  # a folded folder folded again: one section, the new one
    assert again == card


def test_the_model_card_of_a_folder_stock_transformers_refuses_says_so():
    report = _residual_report(stock_compatible=False)
    assert "stock transformers refuses this folder" in model_card(report, "")
    assert "stock transformers loads it too" in model_card(_residual_report(), "")
