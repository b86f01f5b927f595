"""A picture of the zero-mean graph: the residual stream as a line of blocks, each norm a numbered
chip that says whether it became an RMSNorm (exactly or approximately) or stayed a LayerNorm, and
below it a table with each norm's full name and the reason, wrapped at word boundaries.

The layout is pure arithmetic on a monospaced font (:func:`layout_zero_mean_graph`), so the text
boxes it returns are where the text is drawn: tests check from them that no two texts overlap
and every one lies inside the figure, for any number of norms and any reason length.
"""
from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._deps import require

_FOLDED, _APPROXIMATE, _KEPT, _STREAM, _INK, _MUTED = "#2e9e5b", "#7b4fc4", "#d9822b", "#9aa5b1", "#1f2933", "#52606d"
_FONT = "DejaVu Sans Mono"  # ships with matplotlib; monospaced, so a text's width is known before drawing
_ADVANCE = 0.61             # DejaVu Sans Mono's advance width in ems (1233 / 2048 = 0.602), plus slack
_LINE = 1.2                 # matplotlib's default line spacing, in ems
_PER_ROW, _ONE_ROW = 8, 10  # up to _ONE_ROW chips on one line, else rows of _PER_ROW
_NAME_CHARS, _WHY_CHARS = 44, 72  # table columns wrap at these widths (a longer word widens its column)
_MARGIN, _GAP = 0.25, 0.12  # inches


@dataclass(frozen=True)
class TextBox:
    """A text as drawn: its lines, font size (pt) and box in inches from the figure's bottom-left corner."""

    text: str
    x: float
    y: float
    width: float
    height: float
    size: float
    color: str = _INK
    bold: bool = False

    def overlaps(self, other: TextBox) -> bool:
        """Whether the two boxes share any area (touching edges do not count)."""
        return (self.x < other.x + other.width and other.x < self.x + self.width
                and self.y < other.y + other.height and other.y < self.y + self.height)

    def inside(self, width: float, height: float) -> bool:
        return self.x >= 0 and self.y >= 0 and self.x + self.width <= width and self.y + self.height <= height


@dataclass(frozen=True)
class Rect:
    """A filled rectangle (chip, legend swatch, table stripe), inches from the bottom-left corner."""

    x: float
    y: float
    width: float
    height: float
    color: str
    rounded: bool = False


@dataclass
class GraphLayout:
    """Everything :func:`draw_zero_mean_graph` draws, placed: figure size, texts, rectangles, stream lines."""

    width: float
    height: float
    texts: list[TextBox] = field(default_factory=list)
    rects: list[Rect] = field(default_factory=list)
    lines: list[list[tuple[float, float]]] = field(default_factory=list)  # the residual stream, polylines


def _layer_of(path: str) -> int | None:
    """The first integer component of a module path (``h.3.ln_1`` -> 3), or None."""
    m = re.search(r"(?:^|\.)(\d+)(?:\.|$)", path)
    return int(m.group(1)) if m else None


def _short_name(path: str) -> str:
    """A chip label: the part of the path after the layer index, without a generic norm name
    (``transformer.h.3.ln_1`` -> ``ln_1``, ``encoder.layer.0.attention.output.LayerNorm`` -> ``attention``)."""
    parts = path.split(".")
    idx = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    tail = parts[idx + 1:] if idx is not None else parts
    if len(tail) > 1 and tail[-1].lower() in {"layernorm", "layer_norm", "norm", "ln"}:
        name = tail[0] if idx is not None else tail[-2]
    else:
        name = tail[-1] if tail else parts[-1]
    for suffix in ("_layer_norm", "_layernorm", "_norm"):  # "self_attn_layer_norm" -> "self_attn"
        if name.endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)]
    return name


def _text_size(text: str, size: float) -> tuple[float, float]:
    """Width and height in inches of ``text`` (lines split on newlines) in the monospaced font at ``size`` pt."""
    lines = text.split("\n")
    return max(map(len, lines)) * _ADVANCE * size / 72, len(lines) * _LINE * size / 72


def _wrap_words(text: str, width: int) -> str:
    """``text`` wrapped at spaces to ``width`` characters; a longer word stays whole on its own line."""
    return "\n".join(textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)) or "-"


def _wrap_path(path: str, width: int) -> str:
    """A module path wrapped after its dots (``encoder.layer.0.`` / ``attention.output.LayerNorm``)."""
    lines = [""]
    for part in re.findall(r"[^.]+\.?|\.", path):
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines.append("")
        lines[-1] += part
    return "\n".join(lines)


def _category(norm: dict[str, Any]) -> tuple[str, str, str]:
    """(colour, chip kind, table result) of a norm row."""
    if norm.get("approximate"):
        return _APPROXIMATE, "≈RMSNorm", "RMSNorm (approximate)"
    if norm["folded"]:
        kind = "RMSNorm" if norm.get("affine_folded", True) else "RMSNorm+γβ"
        return _FOLDED, kind, kind
    kind = norm["kind"]  # a kept norm is what it was: a LayerNorm, or an RMSNorm left as it is
    return _KEPT, kind, f"{kind} kept"


def _block_label(norm: dict[str, Any], index: int) -> str:
    layer = _layer_of(norm["path"])
    return f"block {layer}" if layer is not None else ("after the blocks" if index else "before the blocks")


def _legend(norms: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(colour, text) for each kind of norm the picture shows, and the stream."""
    cats = {_category(n)[0] for n in norms}
    entries = [(_FOLDED, "exact: input zero-mean by construction, now an RMSNorm (+γβ: its affine kept)"),
               (_APPROXIMATE, "approximate: a corrected RMSNorm judged by cosine on calibration text, NOT exact"),
               (_KEPT, "kept as a LayerNorm: its input is not zero-mean (the op that breaks it: see why)")]
    return [e for e in entries if e[0] in cats] + [(_STREAM, "residual stream, in module order")]


def _heading(norms: Sequence[dict[str, Any]], title: str) -> str:
    exact = sum(bool(n["folded"]) and not n.get("approximate") for n in norms)
    approx = sum(bool(n.get("approximate")) for n in norms)
    text = f"{exact} of {len(norms)} LayerNorms folded into RMSNorm"
    if approx:
        text += f", {approx} replaced approximately"
    return f"{title}: {text}" if title else text


_NAME_PT, _KIND_PT, _SMALL_PT, _TITLE_PT = 7.5, 6.5, 7.0, 10.0
_CHIP_H, _CHIP_GAP, _ROW_GAP, _SWATCH = 0.5, 0.4, 0.45, 0.22  # inches


@dataclass
class _Canvas:
    """Placed items in inches measured down from the figure's top edge (flipped by :meth:`layout`)."""

    # (text, x, top, pt, colour, bold) and (x, top, w, h, colour, rounded)
    texts: list[tuple[str, float, float, float, str, bool]] = field(default_factory=list)
    rects: list[tuple[float, float, float, float, str, bool]] = field(default_factory=list)
    lines: list[list[tuple[float, float]]] = field(default_factory=list)

    def text(self, text: str, x: float, top: float, size: float, color: str = _INK, bold: bool = False) -> float:
        """Place ``text`` with its top-left corner at (x, top); returns its height."""
        self.texts.append((text, x, top, size, color, bold))
        return _text_size(text, size)[1]

    def layout(self, width: float, height: float) -> GraphLayout:
        boxes = [TextBox(t, x, height - top - _text_size(t, pt)[1], *_text_size(t, pt), pt, color, bold)
                 for t, x, top, pt, color, bold in self.texts]
        rects = [Rect(x, height - top - h, w, h, color, rounded) for x, top, w, h, color, rounded in self.rects]
        lines = [[(x, height - y) for x, y in line] for line in self.lines]
        return GraphLayout(width, height, boxes, rects, lines)


@dataclass(frozen=True)
class _Chips:
    """The chip grid: one chip width for all, wide enough for every chip label and block label."""

    labels: list[str]
    width: float
    per_row: int

    @classmethod
    def of(cls, norms: Sequence[dict[str, Any]]) -> _Chips:
        labels = [f"{i} {_short_name(nm['path'])}" for i, nm in enumerate(norms)]
        width = max(0.95, *(_text_size(s, _NAME_PT)[0] + 0.16 for s in labels),
                    *(_text_size(_block_label(nm, i), _SMALL_PT)[0] + 0.04 for i, nm in enumerate(norms)))
        return cls(labels, width, len(norms) if len(norms) <= _ONE_ROW else _PER_ROW)

    @property
    def graph_width(self) -> float:
        return _CHIP_GAP + self.per_row * (self.width + _CHIP_GAP)


def _place_graph(canvas: _Canvas, norms: Sequence[dict[str, Any]], chips: _Chips, top: float) -> float:
    """The chips on the residual stream, snaking down row by row, a block label over each block's
    first chip; returns the bottom of the last row."""
    label_h = _text_size("x", _SMALL_PT)[1]
    row_h = label_h + 0.04 + _CHIP_H + _ROW_GAP  # the stream's return line runs in the row gap
    rows = -(-len(norms) // chips.per_row)
    last_layer: object = object()
    for r in range(rows):
        in_row = min(chips.per_row, len(norms) - r * chips.per_row)
        label_top = top + r * row_h
        chip_top = label_top + label_h + 0.04
        mid = chip_top + _CHIP_H / 2
        x0, x1 = _MARGIN + _CHIP_GAP * 0.3, _MARGIN + _CHIP_GAP + in_row * (chips.width + _CHIP_GAP) - _CHIP_GAP * 0.4
        canvas.lines.append([(x0, mid), (x1, mid)])
        if r < rows - 1:  # down to the next row's start, under this row's chips
            below = chip_top + _CHIP_H + _ROW_GAP / 2
            canvas.lines.append([(x1, mid), (x1, below), (x0, below), (x0, mid + row_h)])
        for c in range(in_row):
            i = r * chips.per_row + c
            x = _MARGIN + _CHIP_GAP + c * (chips.width + _CHIP_GAP)
            color, kind, _ = _category(norms[i])
            canvas.rects.append((x, chip_top, chips.width, _CHIP_H, color, True))
            name_w = _text_size(chips.labels[i], _NAME_PT)[0]
            name_h = canvas.text(chips.labels[i], x + (chips.width - name_w) / 2, chip_top + 0.05, _NAME_PT,
                                 "white", bold=True)
            kind_w = _text_size(kind, _KIND_PT)[0]
            canvas.text(kind, x + (chips.width - kind_w) / 2, chip_top + 0.07 + name_h, _KIND_PT, "white")
            layer = _layer_of(norms[i]["path"])
            if layer != last_layer:
                canvas.text(_block_label(norms[i], i), x, label_top, _SMALL_PT, _MUTED)
                last_layer = layer
    return top + rows * row_h - _ROW_GAP


def _place_legend(canvas: _Canvas, legend: list[tuple[str, str]], top: float) -> float:
    """One line per entry: a swatch (a line for the stream) and its text; returns the bottom."""
    for color, text in legend:
        top += 0.04
        line_h = _text_size(text, _SMALL_PT)[1]
        if color == _STREAM:
            canvas.lines.append([(_MARGIN, top + line_h / 2), (_MARGIN + _SWATCH, top + line_h / 2)])
        else:
            canvas.rects.append((_MARGIN, top + 0.02, _SWATCH, line_h - 0.04, color, False))
        top += canvas.text(text, _MARGIN + _SWATCH + _GAP, top, _SMALL_PT)
    return top


_HEADER = ("#", "norm", "result", "why")


def _table_cells(norms: Sequence[dict[str, Any]], fill_width: float) -> tuple[list[tuple[str, ...]], list[float]]:
    """Rows (#, wrapped path, result, wrapped reason, colour) and column widths; the why column
    fills ``fill_width`` (fewer lines) with at least _WHY_CHARS characters a line."""
    fixed = [(str(i), _wrap_path(nm["path"], _NAME_CHARS), _category(nm)[2]) for i, nm in enumerate(norms)]
    widths = [max(_text_size(row[k], _SMALL_PT)[0] for row in [_HEADER, *fixed]) for k in range(3)]
    char_w = _text_size("x", _SMALL_PT)[0]
    why_chars = max(_WHY_CHARS, int((fill_width - sum(widths) - 3 * _GAP) / char_w))
    cells = [(*row, _wrap_words(nm.get("reason") or nm.get("blocker") or "", why_chars), _category(nm)[0])
             for row, nm in zip(fixed, norms)]
    widths.append(max(_text_size(row[3], _SMALL_PT)[0] for row in [_HEADER, *cells]))
    return cells, widths


def _place_table(canvas: _Canvas, cells: list[tuple[str, ...]], widths: list[float], top: float) -> float:
    """The header and one striped row per norm, each as tall as its tallest cell; returns the bottom."""
    col_x = [_MARGIN + sum(widths[:k]) + _GAP * k for k in range(len(widths))]
    table_w = sum(widths) + _GAP * (len(widths) - 1)
    for k, text in enumerate(_HEADER):
        canvas.text(text, col_x[k], top, _SMALL_PT, bold=True)
    top += _text_size("x", _SMALL_PT)[1] + 0.06
    for i, (*texts, color) in enumerate(cells):
        row_h = max(_text_size(t, _SMALL_PT)[1] for t in texts) + 0.06
        if i % 2 == 0:
            canvas.rects.append((_MARGIN - 0.05, top - 0.03, table_w + 0.1, row_h, "#eef1f4", False))
        for k, text in enumerate(texts):
            canvas.text(text, col_x[k], top, _SMALL_PT, color if k == 2 else _INK, bold=k == 2)
        top += row_h
    return top


def layout_zero_mean_graph(norms: Sequence[dict[str, Any]], *, title: str = "") -> GraphLayout:
    """Place the title, the chips on the residual stream, the legend and the table of ``norms``.

    ``norms``: rows of :func:`normfold.hf.report.norm_rows` (``path``, ``folded``, ``affine_folded``,
    ``approximate``, ``reason``). Every size is computed from the monospaced font, and the figure
    is as wide and tall as its widest and tallest parts, so no text is clipped or overlaps.
    """
    if not norms:
        raise ValueError("the zero-mean graph needs at least one norm, got none")
    chips = _Chips.of(norms)
    cells, widths = _table_cells(norms, chips.graph_width)
    legend, heading = _legend(norms), _heading(norms, title)
    content_w = max(chips.graph_width, sum(widths) + _GAP * (len(widths) - 1), _text_size(heading, _TITLE_PT)[0],
                    *(_SWATCH + _GAP + _text_size(t, _SMALL_PT)[0] for _, t in legend))
    canvas = _Canvas()
    top = _MARGIN + canvas.text(heading, _MARGIN, _MARGIN, _TITLE_PT, bold=True) + 0.2
    top = _place_graph(canvas, norms, chips, top) + 0.25
    top = _place_legend(canvas, legend, top) + 0.25
    bottom = _place_table(canvas, cells, widths, top)
    return canvas.layout(content_w + 2 * _MARGIN, bottom + _MARGIN)


def draw_zero_mean_graph(norms: Sequence[dict[str, Any]], out_file: str | Path, *, title: str = "",
                         dpi: int = 110) -> Path:
    """Draw ``norms`` (rows of :func:`normfold.hf.report.norm_rows`, in module order) as laid out by
    :func:`layout_zero_mean_graph`. Saves a PNG (or SVG, by the file suffix) and returns its path."""
    out = Path(out_file)
    with rendered(layout_zero_mean_graph(norms, title=title), dpi=dpi) as fig:
        if out.suffix.lower() == ".png":
            _save_small_png(fig, out)
        else:
            fig.savefig(out, dpi=dpi)  # no bbox_inches="tight": the layout already is the figure
    return out


def _save_small_png(fig: Any, out: Path) -> None:
    """``fig`` as a 64-colour palette PNG: flat colours and grey text antialiasing need no more,
    and it is a third of the size of matplotlib's RGBA PNG. (Pillow comes with matplotlib.)"""
    import numpy as np
    from PIL import Image

    fig.canvas.draw()
    image = Image.fromarray(np.asarray(fig.canvas.buffer_rgba())).convert("RGB")
    image.quantize(colors=64, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(out, optimize=True)


@contextmanager
def rendered(layout: GraphLayout, *, dpi: int = 110) -> Iterator[Any]:
    """A matplotlib figure with ``layout`` drawn at its coordinates (inches; text anchored bottom-left),
    closed on exit. Text is unhinted while it is open: hinting rounds each glyph's advance to whole
    pixels (7 pt at 110 dpi: 6.4 -> 7 px), which would make every line ~9% wider than laid out."""
    require("matplotlib")
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyBboxPatch, Rectangle

    with matplotlib.rc_context({"text.hinting": "no_hinting"}):
        fig = plt.figure(figsize=(layout.width, layout.height), dpi=dpi)
        try:
            inches = fig.dpi_scale_trans
            for r in layout.rects:
                fig.add_artist(FancyBboxPatch((r.x, r.y), r.width, r.height, transform=inches, fc=r.color, ec="none",
                                              boxstyle="round,pad=0,rounding_size=0.06") if r.rounded
                               else Rectangle((r.x, r.y), r.width, r.height, transform=inches, fc=r.color, ec="none"))
            for line in layout.lines:
                xs, ys = zip(*line)
                fig.add_artist(Line2D(xs, ys, color=_STREAM, lw=2.5, transform=inches, zorder=0))
            for t in layout.texts:
                fig.text(t.x, t.y, t.text, transform=inches, ha="left", va="bottom", fontsize=t.size, color=t.color,
                         family=_FONT, weight="bold" if t.bold else "normal", linespacing=_LINE)
            yield fig
        finally:
            plt.close(fig)
