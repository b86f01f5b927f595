"""The zero-mean graph picture: its layout puts every name and reason in full, without overlap and
inside the figure (checked from the layout's text boxes, and that the drawn text stays in them),
and shows approximate replacements as their own kind."""
from __future__ import annotations

import itertools

import pytest

from normfold.hf.picture import TextBox, _APPROXIMATE, _FOLDED, _KEPT, draw_zero_mean_graph, layout_zero_mean_graph
from normfold.hf.folder_report import FolderReport, FoldSection, Layout, ReportNorm
from normfold.hf.report import norm_rows, report_rows, with_approximate

_LONG_WORD = "model.encoder.layers_with_a_very_long_unbreakable_name_of_many_characters_0123456789.out"


def _synthetic_report(n: int = 30) -> FolderReport:
    """``n`` norms over 14 blocks: long paths, long reasons (one with a word longer than a wrapped line),
    every third kept, every fifth replaced approximately."""
    from normfold.lab.approximate import ApproximateReport, ApproxEntry

    norms, entries = [], []
    for i in range(n):
        path = ("embeddings.LayerNorm" if i == 0 else "decoder.final_layer_norm" if i == n - 1
                else f"model.decoder.layers.{(i - 1) // 2}.{'self_attn' if i % 2 else 'encoder_attn'}_layer_norm")
        kept = i % 3 == 1
        reason = (f"blocked: aten.layer_norm at {path}: aten.layer_norm output with an affine transform is not "
                  f"zero-mean; affine kept: its output feeds aten.add at {_LONG_WORD}, not a linear layer"
                  if kept else "input zero-mean: centered 4 producers; affine kept: it feeds a residual add " * 2)
        norms.append(ReportNorm(path, "LayerNorm", not kept, i % 2 == 0, reason))
        if kept and i % 5 == 0:
            entries.append(ApproxEntry(path, "approximate", cosine_alone=0.99931,
                                       correction="γ/β folded into the next linear layers, mean shift into its bias"))
    # the report as `normfold fold --approximate` writes it
    return with_approximate(FolderReport(Layout(()), "float32", fold=FoldSection(tuple(norms))),
                            ApproximateReport(entries, min_cosine=0.999))


def _rows(report: FolderReport | dict) -> list[dict]:
    """The rows of a folder report, or of ``normfold analyze``'s analysis."""
    return report_rows(report) if isinstance(report, FolderReport) else norm_rows(FoldSection.from_json(report, "x"))


@pytest.fixture(scope="module")
def reports(tiny_dirs, minilm_dir):
    """name -> fold analysis of MiniLM (real), tiny BERT and GPT-2, the bundled model, a synthetic 30-norm model."""
    from normfold.hf import default_model_path
    from normfold.hf.folder import analyze_folder

    folders = {"minilm": minilm_dir, "bert": tiny_dirs["bert"], "gpt2": tiny_dirs["gpt2"],
               "bundled": default_model_path()}
    out = {name: analyze_folder(path) for name, path in folders.items()}
    out["synthetic30"] = _synthetic_report()
    return out


_MODELS = ["minilm", "bert", "gpt2", "bundled", "synthetic30"]


@pytest.mark.parametrize("name", _MODELS)
def test_no_two_text_boxes_overlap_and_every_box_is_inside_the_figure(reports, name):
    layout = layout_zero_mean_graph(_rows(reports[name]), title="SomeModelForSomething")
    outside = [t.text for t in layout.texts if not t.inside(layout.width, layout.height)]
    assert not outside
    overlapping = [(a.text, b.text) for a, b in itertools.combinations(layout.texts, 2) if a.overlaps(b)]
    assert not overlapping


@pytest.mark.parametrize("name", _MODELS)
def test_every_name_and_reason_is_shown_whole_wrapped_only_at_word_or_dot_boundaries(reports, name):
    rows = _rows(reports[name])
    texts = [t.text for t in layout_zero_mean_graph(rows).texts]
    for row in rows:  # a path wraps after its dots, a reason between words: joining the lines gives them back
        assert row["path"] in {t.replace("\n", "") for t in texts}
        assert " ".join(row["reason"].split()) in {" ".join(t.split()) for t in texts}


@pytest.mark.parametrize("name", ["minilm", "synthetic30"])
def test_drawn_text_stays_inside_its_layout_box(reports, name):
    """The layout's boxes are where matplotlib puts the text (to a pixel), so checking them checks the picture."""
    pytest.importorskip("matplotlib")
    from normfold.hf.picture import rendered

    layout = layout_zero_mean_graph(_rows(reports[name]), title="BertModel")
    dpi = 110
    with rendered(layout, dpi=dpi) as fig:
        renderer = fig.canvas.get_renderer()
        drawn = [t for t in fig.texts]
        assert len(drawn) == len(layout.texts)
        for box, artist in zip(layout.texts, drawn):
            extent = artist.get_window_extent(renderer)
            assert box.x * dpi - 1 <= extent.x0 and extent.x1 <= (box.x + box.width) * dpi + 1, box.text
            assert box.y * dpi - 1 <= extent.y0 and extent.y1 <= (box.y + box.height) * dpi + 1, box.text


def test_the_overlap_check_sees_overlapping_and_outside_boxes():
    a = TextBox("a", 0.0, 0.0, 1.0, 0.2, 7.0)
    assert a.overlaps(TextBox("b", 0.5, 0.1, 1.0, 0.2, 7.0))
    assert not a.overlaps(TextBox("c", 1.0, 0.0, 1.0, 0.2, 7.0))  # touching edges only
    assert not a.overlaps(TextBox("d", 0.0, 0.3, 1.0, 0.2, 7.0))
    assert a.inside(1.0, 0.2) and not a.inside(0.99, 1.0) and not TextBox("e", -0.01, 0, 1, 1, 7).inside(5, 5)


def test_approximate_replacements_have_their_own_colour_kind_legend_and_reason():
    report = _synthetic_report()
    rows = _rows(report)
    approx = [r for r in rows if r["approximate"]]
    assert sorted(r["path"] for r in approx) == list(report.approximate.norms) and approx
    assert all(not r["folded"] and r["blocker"] is None and r["reason"].startswith("approximate: ") and
               "0.999310" in r["reason"] for r in approx)
    layout = layout_zero_mean_graph(rows, title="T")
    chip_colours = [r.color for r in layout.rects if r.rounded]
    assert chip_colours == [_APPROXIMATE if r["approximate"] else _FOLDED if r["folded"] else _KEPT for r in rows]
    texts = [t.text for t in layout.texts]
    assert texts.count("≈RMSNorm") == len(approx)
    assert any(t.startswith("approximate: a corrected RMSNorm") for t in texts)  # the legend entry
    assert texts[0] == f"T: 20 of 30 LayerNorms folded into RMSNorm, {len(approx)} replaced approximately"


def test_an_exact_fold_shows_no_approximate_kind(reports):
    rows = _rows(reports["gpt2"])
    assert not any(r["approximate"] for r in rows)
    layout = layout_zero_mean_graph(rows)
    assert _APPROXIMATE not in {r.color for r in layout.rects}
    assert not any("approximate" in t.text or "≈" in t.text for t in layout.texts)


def test_a_kept_rmsnorm_is_shown_as_an_rmsnorm_kept_not_a_layernorm():
    """Fails on main f840f32: every kept norm was drawn and listed as "LayerNorm kept"."""
    rows = norm_rows(FoldSection((
        ReportNorm("model.layers.0.input_layernorm", "RMSNorm", False, False, "kept: its input is not a linear layer's"),
        ReportNorm("model.norm", "LayerNorm", False, False, "blocked: x"))))
    texts = [t.text for t in layout_zero_mean_graph(rows).texts]
    assert "RMSNorm kept" in texts and "LayerNorm kept" in texts and texts.count("LayerNorm kept") == 1


def test_no_norms_is_refused_before_drawing(tmp_path):
    with pytest.raises(ValueError, match="at least one norm"):
        draw_zero_mean_graph([], tmp_path / "graph.png")
    assert not (tmp_path / "graph.png").exists()


def test_the_picture_is_written(tmp_path, reports):
    pytest.importorskip("matplotlib")
    out = draw_zero_mean_graph(_rows(reports["synthetic30"]), tmp_path / "graph.png", title="Synthetic")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
