"""What people read about a folded folder: ``normfold_report.md`` and the normfold section of its
model card (``README.md``), both in words built from the folder report (``normfold_report.json``).

The report's field names stay in the JSON; here every figure is a sentence with its bound and its
rule, kept norms are grouped by what stopped them (one sentence, then the list), and each folded
norm says how many producers were centered for it that no earlier norm had centered already.
"""
from __future__ import annotations

import collections

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .folder_report import FolderReport, ReportNorm
from .report import report_rows

MODEL_CARD = "README.md"
CARD_SECTION = "## Folded by normfold"  # the heading of normfold's section of the model card


def number(value: float) -> str:
    """A number for people: 4 significant digits (``0.9990``, ``3.142e-07``); the JSON keeps them whole."""
    return f"{value:.4g}"


# --------------------------------------------------------------------------------- the markdown report

def render_markdown(report: FolderReport, *, picture: str | None = None) -> str:
    """``normfold_report.md``: what was folded, what was kept and why, what the fold is exact for,
    and the proof, in words."""
    fold, model = report.fold, report.model
    rows = report_rows(report)
    lines = [f"# normfold report: {'model' if model is None else model.architecture}", ""]
    if model is not None:
        lines += [f"Folded from `{model.source}` ({model.parameters:,} parameters), saved in {report.saved_dtype}.", ""]
    lines += [headline(report, rows), ""]
    if picture:
        lines += [f"![zero-mean graph]({picture})", ""]
    lines += _folded_lines(fold.norms, rows) + _approximate_lines(rows) + _kept_lines(fold.norms, rows)
    if fold.untied:
        lines += ["", "Untied so that each copy could change on its own: " + "; ".join(fold.untied) + "."]
    lines += _scope_lines(report)
    ver = fold.verification
    if ver:
        lines += ["", f"## Proof: {'passed' if ver['ok'] else 'FAILED'}", ""] + proof_lines(ver)
        for key, (title, render) in _CHECKS.items():
            if isinstance(ver.get(key), dict):
                lines += ["", f"### {title}", "", render(ver[key])]
    lines += _approximate_warning_lines(report)
    return "\n".join(lines) + "\n"


def headline(report: FolderReport, rows: list[dict[str, Any]]) -> str:
    """What the fold did, in one bold line: the norms folded (and replaced approximately), and where
    γ/β went, counted from the rows rather than from the option asked for."""
    folded, approximate = sum(r["folded"] for r in rows), sum(r["approximate"] for r in rows)
    moved = sum(r["affine_folded"] for r in rows)
    text = f"**{folded} of {len(rows)} LayerNorms folded into RMSNorm" + (
        f", {approximate} replaced approximately**" if approximate else "**")
    if moved:
        return f"{text} (the affine γ/β of {moved} folded into the next linear layers)"
    off = report.fold_affine is False
    return f"{text} ({'affine folding turned off: ' if off else ''}every norm keeps its γ/β)"


def _folded_lines(norms: tuple[ReportNorm, ...], rows: list[dict[str, Any]]) -> list[str]:
    """The folded norms: producers centered for each (new ones, and all when earlier norms had
    centered some of them already: along a residual stream every norm reads what the earlier ones read),
    and where its γ/β went."""
    by_path = {n.path: n for n in norms}
    folded = [by_path[r["path"]] for r in rows if r["folded"]]
    if not folded:
        return []
    lines = [f"## Folded into RMSNorm ({len(folded)})", "",
             "Each input is zero-mean for every input once the layers that write it (its producers) are "
             "centered.", "", "| norm | producers centered | γ/β |", "|---|---|---|"]
    seen: set[str] = set()
    for norm in folded:
        new = [p for p in norm.producers if p not in seen]
        seen.update(norm.producers)
        mine = len(norm.producers)
        count = f"{len(new)}" if len(new) == mine else f"{len(new)} new ({mine} in all)"
        lines.append(f"| `{norm.path}` | {count} | {_affine_text(norm)} |")
    return lines


def _affine_text(norm: ReportNorm) -> str:
    if norm.affine_folded:
        return "folded into the next linear layers"
    return f"kept in the RMSNorm: {norm.affine_kept}" if norm.affine_kept else "kept in the RMSNorm"


def _approximate_lines(rows: list[dict[str, Any]]) -> list[str]:
    replaced = [r for r in rows if r["approximate"]]
    if not replaced:
        return []
    lines = ["", f"## Replaced approximately ({len(replaced)}): NOT exact", "", "| norm | how close |", "|---|---|"]
    return lines + [f"| `{r['path']}` | {r['reason'].removeprefix('approximate: ')} |" for r in replaced]


def _kept_lines(norms: tuple[ReportNorm, ...], rows: list[dict[str, Any]]) -> list[str]:
    """The norms kept as they were (LayerNorms, or the model's own RMSNorms), grouped by cause: one sentence for each cause, then its norms with
    where their input stops being zero-mean."""
    by_path = {n.path: n for n in norms}
    kept = [by_path[r["path"]] for r in rows if not r["folded"] and not r["approximate"]]
    if not kept:
        return []
    groups: dict[str, list[tuple[str, str]]] = {}
    for norm in kept:
        cause, where = blocking_cause(norm)
        groups.setdefault(cause, []).append((norm.path, where))
    kinds = collections.Counter(norm.kind for norm in kept)  # RMSNorms the fold kept are no LayerNorms
    title = f"Kept as {kept[0].kind}" if len(kinds) == 1 else "Kept as they were: " + ", ".join(
        f"{n} {kind}" for kind, n in kinds.items())
    lines = ["", f"## {title} ({len(kept)})"]
    for cause, norms in groups.items():
        count = f"{len(norms)} norm{'s' * (len(norms) != 1)}"
        lines += ["", f"**{count}**: {cause}.", ""]
        if any(where for _, where in norms):
            lines += ["| norm | where its input stops being zero-mean |", "|---|---|"]
            lines += [f"| `{path}` | {where or '-'} |" for path, where in norms]
        else:
            lines += [", ".join(f"`{path}`" for path, _ in norms)]
    return lines


def blocking_cause(norm: ReportNorm) -> tuple[str, str]:
    """``(cause, where)`` of a kept norm: what breaks its input's zero mean and the op where it does
    (``("a residual add whose inputs are not both zero-mean", "aten.add at h.0")``), from the engine's
    fields; a norm kept for another reason has that reason as its cause (without why its γ/β stayed,
    said apart), with no place."""
    if norm.blocker is not None and norm.blocking_path:
        return norm.blocker, norm.blocking_path[-1]
    kept_affine = f"; affine kept: {norm.affine_kept}"
    return (norm.reason.removesuffix(kept_affine) if norm.affine_kept else norm.reason), ""


def _scope_lines(report: FolderReport) -> list[str]:
    """What the fold was traced on and what it is therefore exact for."""
    fold = report.fold
    if not fold.traced_calls:
        return []
    lines = ["", "## What the fold is exact for", ""]
    lines += [f"- traced call {i}: " + ", ".join(f"`{name}` = {what}" for name, what in call.items())
              for i, call in enumerate(fold.traced_calls)]
    for text in (fold.exactness_scope, fold.capture_line):  # what it is exact for; the submodules analysed, if not the whole
        if text:
            lines += ["", _sentence(text)]
    return lines


def _sentence(text: str) -> str:
    return text[0].upper() + text[1:] + "."


def _approximate_warning_lines(report: FolderReport) -> list[str]:
    """The approximate fold's table of every norm it considered (replaced or kept, with its cosines)."""
    approx = report.sections.get("approximate")
    if not report.num_approximate or not approx:
        return []
    lines = ["", "## Approximate replacements: NOT exact", "", f"**Warning: {approximate_warning(report)}.**", "",
             "| norm | status | min cosine alone (corrected) | min cosine alone (plain) | correction |",
             "|---|---|---|---|---|"]
    return lines + [f"| `{e['path']}` | {e['status']} | {_cosine(e.get('cosine_alone'))} | "
                    f"{_cosine(e.get('cosine_alone_naive'))} | {e.get('correction') or e.get('reason', '')} |"
                    for e in approx["entries"]]


def approximate_warning(report: FolderReport) -> str | None:
    """The one-line warning for a folder with approximately replaced norms (None when there are none)."""
    n = report.num_approximate
    if not n:
        return None
    cos = None if report.approximate is None else report.approximate.calibration_min_cosine
    cos_text = "n/a" if cos is None else number(cos)
    return (f"{n} norm{'s' if n != 1 else ''} replaced approximately; min cosine {cos_text} on the calibration set; "
            "load with normfold.from_pretrained (stock transformers would rebuild them as LayerNorms)")


def _cosine(value: float | None) -> str:
    return "-" if value is None else f"{value:.6f}"


# ------------------------------------------------------------------------------------------ the proof

def proof_lines(ver: Mapping[str, Any], what: str = "fold") -> list[str]:
    """The verification in sentences: the exact transform against its bound, the model in its own
    dtype against the original's own error, the RMSNorm inputs' mean; or why nothing was compared."""
    runs = ver.get("num_runs")
    on = f"on {runs} inputs (the example inputs and random inputs of the same shapes)" if runs else "on the inputs"
    if ver.get("why"):
        return [f"The outputs could not be compared {on}: {ver['why']}."]
    lines = []
    rule = exact_rule_line(ver, what)
    if rule:
        where = "" if not ver.get("worst") else f" The largest difference is at {worst_text(ver['worst'])}."
        fallback = f" (not float64: {ver['fallback']})" if ver.get("fallback") else ""
        lines.append(f"- **Exact transform**{fallback}, {on}: {rule}.{where}")
    check = ver.get("model_dtype_check")
    if isinstance(check, dict):
        lines.append(f"- **The model as returned, in {check['dtype']}**: error {number(check['error'])} "
                     f"{'≤' if check.get('ok', True) else '>'} tolerance {number(check['tolerance'])} = "
                     f"{check['tolerance_rule']}.")
    if ver.get("max_input_mean_ratio") is not None:
        lines.append(f"- **RMSNorm inputs**: their mean is at most {number(ver['max_input_mean_ratio'])} of their "
                     "root mean square (zero up to rounding).")
    return lines


def exact_rule_line(ver: Mapping[str, Any], what: str = "fold") -> str | None:
    """The exact check's verdict with its rule in words, e.g. ``exact fold: max relative error 3.1e-08 ≤
    tolerance 2.5e-07 = 2 x (the original's own error in float32) + float32's unit roundoff``."""
    max_rel, tolerance = ver.get("max_rel_error"), ver.get("tolerance")
    if max_rel is None or tolerance is None or ver.get("why"):
        return None
    rule = ver.get("tolerance_rule") or "fixed"
    words = (f"a fixed bound: the {what} is an exact transform, compared in float64" if rule == "fixed" else rule)
    sign = "≤" if max_rel <= tolerance else ">"
    return f"exact {what}: max relative error {number(max_rel)} {sign} tolerance {number(tolerance)}, {words}"


def worst_text(worst: dict[str, Any]) -> str:
    """``out['logits'][0, 3, 7] on input 2 (original 0.1234, folded 0.1234)``."""
    index = ", ".join(map(str, worst.get("index", ())))
    return (f"{worst['output']}[{index}] on input {worst.get('input', 0)} (original {number(worst['original'])}, "
            f"folded {number(worst['folded'])})")


def weights_text(weights: dict[str, Any]) -> str:
    """The tensor-by-tensor check in one line: bit-identical, or the worst tensor."""
    if weights.get("why"):
        return f"FAILED: {weights['why']}"
    worst = weights.get("worst")
    if worst is None:
        return f"{weights['num_tensors']} tensors, all bit-identical"
    return (f"{weights['num_tensors']} tensors within {weights['bound']}; {weights['num_differing_tensors']} not "
            f"bit-identical, worst {worst['name']} ({number(worst['max_ulps'])} ulp, "
            f"max abs {number(worst['max_abs_error'])})")


def saved_dtype_check_text(check: dict[str, Any]) -> str:
    """The check of the weights as stored (rounded to the saved dtype) in one line."""
    if check.get("skipped"):
        return f"skipped: {check['skipped']}"
    own = check.get("stored_dtype_own_error")
    rule = "" if own is None else f" (the original's own error in the stored dtype: {number(own)})"
    return (f"{'passed' if check['ok'] else 'FAILED'}: max relative error {number(check['max_rel_error'])}, "
            f"tolerance {number(check['tolerance'])}{rule}")


_CHECKS = {  # verification parts that are checks of their own: key -> (heading, one line in words)
    "saved_dtype_check": ("Weights rounded to the saved dtype, against the original", saved_dtype_check_text),
    "weights": ("Stored weights against the fold re-derived from the original", weights_text),
}


# -------------------------------------------------------------------------------------- the model card

def write_model_card(report: FolderReport, folder: Path) -> None:
    """Give ``folder``'s model card (``README.md``: the original's, carried over with the side files,
    or none) normfold's section: what was folded, how it was proved, how to load it. The original
    card is kept as it was, but for a normfold section of its own (a folded folder folded again),
    which the new section replaces."""
    path = folder / MODEL_CARD
    original = path.read_text() if path.is_file() else ""
    path.write_text(model_card(report, original))


def model_card(report: FolderReport, original: str) -> str:
    """``original`` (a model card, possibly empty) followed by normfold's section. Only what the
    recipe decides goes in (no measured figure), so re-making the folder re-makes the card exactly."""
    original = original.split(f"\n{CARD_SECTION}\n")[0] if not original.startswith(CARD_SECTION) else ""
    what = (headline(report, report_rows(report)) if report.fold is not None and report.fold.norms
            else "Saved by `normfold.save_pretrained`")
    rotation = report.sections.get("rotation")  # the rotation step's section
    if rotation:
        what += f"; the residual stream rotated ({rotation.get('method')}, seed {rotation.get('seed')})"
    stock = report.layout.stock_compatible
    load = ("normfold.from_pretrained(folder)  # fast RMSNorm kernels; stock transformers loads it too"
            if stock else "normfold.from_pretrained(folder)  # stock transformers refuses this folder")
    section = [CARD_SECTION, "",
               f"{what}; proved against the original model in float64 (`normfold_report.md` has the figures; "
               "`normfold verify ORIGINAL FOLDER` re-checks them).", "",
               "```python", "import normfold", "", f"model = {load}", "```", ""]
    if not original.strip():
        return "\n".join(section)
    return original.rstrip("\n") + "\n\n" + "\n".join(section)
