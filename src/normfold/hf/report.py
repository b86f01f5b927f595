"""Views of a fold report dict: per-norm rows (for the table and the picture) and markdown."""
from __future__ import annotations

from typing import Any


def norm_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per norm, in model order: ``path``, ``folded``, ``affine_folded``, ``approximate``,
    ``reason`` and, for a kept norm, ``blocker`` (the engine's reason: the op that breaks zero mean).

    A norm an ``--approximate`` fold replaced is ``approximate`` (and not ``folded``: the exact fold
    kept it); its reason then says how close the replacement is instead of what blocked the exact fold.
    """
    entries = {e["path"]: e for e in (report.get("approximate") or {}).get("entries", ())}
    approximate = {path: entries.get(path, {}) for path in report.get("approximate_norms", ())}
    return [{"path": e["path"], "folded": bool(e["foldable"]), "affine_folded": bool(e["affine_folded"]),
             "approximate": e["path"] in approximate,
             "reason": _approximate_reason(approximate[e["path"]]) if e["path"] in approximate else e["reason"],
             "blocker": None if e["foldable"] or e["path"] in approximate else e["reason"]}
            for e in report["norms"]]


def _approximate_reason(entry: dict[str, Any]) -> str:
    """What an approximately replaced norm became and how close it is alone, from its approximate entry."""
    cosine = entry.get("cosine_alone")
    close = "" if cosine is None else f"; min cosine {cosine:.6f} on the calibration set with only it replaced"
    return f"approximate: {entry.get('correction') or 'corrected RMSNorm'}{close}"


def _fmt(value: Any) -> str:
    """A figure for people: floats to 2 digits (``1.2e-03``), a tensor summary as its fields."""
    if isinstance(value, float):
        return f"{value:.1e}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    return str(value).replace("|", "\\|")


def render_markdown(report: dict[str, Any], *, picture: str | None = None) -> str:
    """A short human report: what was folded, what was kept and why, and the verification."""
    model = report.get("model", {})
    rows = norm_rows(report)
    folded = sum(r["folded"] for r in rows)
    lines = [f"# normfold report: {model.get('architecture', 'model')}", ""]
    if model.get("source"):
        lines += [f"Source: `{model['source']}` ({model.get('parameters', '?'):,} parameters)", ""]
    lines += [f"**{folded} of {len(rows)} LayerNorms folded into RMSNorm**"
              + (" (affine γ/β folded into the next linear layers)" if report.get("fold_affine") else ""), ""]
    if picture:
        lines += [f"![zero-mean graph]({picture})", ""]
    lines += ["| norm | result | γ/β | why |", "|---|---|---|---|"]

    def result(r) -> str:
        return "RMSNorm" if r["folded"] else "RMSNorm (approximate)" if r["approximate"] else "LayerNorm kept"

    lines += [f"| `{r['path']}` | {result(r)} | "
              f"{'folded into next layer' if r['affine_folded'] else 'kept'} | {r['reason']} |" for r in rows]
    if report.get("untied"):
        lines += ["", "Untied: " + "; ".join(report["untied"])]
    lines += _scope_lines(report)
    ver = report.get("verification")
    if ver:
        lines += ["", f"## Verification: {'passed' if ver['ok'] else 'FAILED'}", "",
                  "Original and folded model on the example inputs and random inputs of the same shapes.", "",
                  "| figure | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in ver.items() if k not in ("outputs", "ok", *_NESTED)]
        for key, title in _NESTED.items():
            if isinstance(ver.get(key), dict):
                lines += ["", f"### {title}", "", "| figure | value |", "|---|---|"]
                lines += [f"| {k} | {_fmt(v)} |" for k, v in ver[key].items() if k != "outputs"]
    return "\n".join(lines) + "\n"


_NESTED = {  # verification parts that are checks of their own
    "saved_dtype_check": "Weights rounded to the saved dtype, against the original",
    "weights": "Stored weights against the fold re-derived from the original",
}


def _scope_lines(report: dict[str, Any]) -> list[str]:
    """What the fold was traced on and what it is therefore exact for (empty for older reports)."""
    calls = report.get("traced_calls") or []
    if not calls:
        return []
    lines = ["", "## What the fold is exact for", ""]
    lines += [f"- traced call {i}: " + ", ".join(f"`{name}` = {what}" for name, what in call.items())
              for i, call in enumerate(calls)]
    if report.get("exactness_scope"):
        lines += ["", report["exactness_scope"][0].upper() + report["exactness_scope"][1:] + "."]
    return lines
