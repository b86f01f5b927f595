"""A picture of the zero-mean graph: the residual stream as a line of blocks, each norm a chip
that says whether it became an RMSNorm or stayed a LayerNorm, and what kept it."""
from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._deps import require

_FOLDED, _KEPT, _STREAM = "#2e9e5b", "#d9822b", "#9aa5b1"
_ONE_ROW = 12  # up to this many norms on one line; more wrap at 8 per row (a 32-layer model: ~8 rows)
_PER_ROW = 8


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
    return name if len(name) <= 11 else name[:10] + "…"


def draw_zero_mean_graph(norms: Sequence[dict[str, Any]], out_file: str | Path, *, title: str = "") -> Path:
    """Draw ``norms`` (dicts with ``path``, ``folded`` and, when kept, ``blocker``) in module order.

    Saves a PNG (or SVG, by the file suffix) and returns its path.
    """
    require("matplotlib")
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    n = max(1, len(norms))
    per_row = n if n <= _ONE_ROW else _PER_ROW
    rows = (n + per_row - 1) // per_row
    cols = min(n, per_row)
    chip_w, chip_h, gap_x, row_h = 1.0, 0.55, 0.55, 1.9
    width = cols * (chip_w + gap_x) + gap_x
    fig, ax = plt.subplots(figsize=(max(8.0, 1.45 * cols + 1.2), 1.3 + 1.7 * rows))
    ax.set_xlim(0, width)
    ax.set_ylim(-(rows - 1) * row_h - 1.0, 1.05)
    ax.axis("off")

    for r in range(rows):  # the residual stream: one line per row, snaking down at the right/left end
        y = -r * row_h
        in_row = min(per_row, n - r * per_row)
        x0, x1 = gap_x * 0.3, gap_x + in_row * (chip_w + gap_x) - gap_x * 0.5
        ax.annotate("", xy=(x1, y), xytext=(x0, y),
                    arrowprops={"arrowstyle": "-|>", "color": _STREAM, "lw": 2.5, "shrinkA": 0, "shrinkB": 0})
        if r < rows - 1:
            ax.plot([x1, x1, x0, x0], [y, y - row_h / 2, y - row_h / 2, y - row_h], color=_STREAM, lw=2.5, zorder=0)
    ax.text(0.02, 0.55, "residual stream", fontsize=8, color="#52606d", va="bottom")

    last_layer = object()
    for i, norm in enumerate(norms):
        r, c = divmod(i, per_row)
        x, y = gap_x + c * (chip_w + gap_x), -r * row_h
        color = _FOLDED if norm["folded"] else _KEPT
        ax.add_patch(FancyBboxPatch((x, y - chip_h / 2), chip_w, chip_h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                    fc=color, ec="white", lw=1.5, zorder=3))
        ax.text(x + chip_w / 2, y + 0.08, _short_name(norm["path"]), ha="center", va="center",
                fontsize=7.5, color="white", weight="bold", zorder=4)
        kind = ("RMSNorm" if norm.get("affine_folded", True) else "RMSNorm+γβ") if norm["folded"] else "LayerNorm"
        ax.text(x + chip_w / 2, y - 0.13, kind, ha="center", va="center",
                fontsize=6.5, color="white", zorder=4)
        layer = _layer_of(norm["path"])
        if layer != last_layer:
            label = f"block {layer}" if layer is not None else ("after the blocks" if i else "before the blocks")
            ax.text(x, y + chip_h / 2 + 0.08, label, fontsize=7,
                    color="#52606d", va="bottom")
            last_layer = layer
        if not norm["folded"]:
            why = textwrap.fill(str(norm.get("blocker") or "not zero-mean"), 18)
            ax.text(x + chip_w / 2, y - chip_h / 2 - 0.08, why, ha="center", va="top", fontsize=6, color=_KEPT)

    folded = sum(bool(nm["folded"]) for nm in norms)
    heading = f"{title}  " if title else ""
    ax.set_title(f"{heading}{folded} of {len(norms)} LayerNorms folded into RMSNorm", fontsize=10, loc="left")
    handles = [plt.Rectangle((0, 0), 1, 1, fc=_FOLDED), plt.Rectangle((0, 0), 1, 1, fc=_KEPT)]
    ax.legend(handles, ["input zero-mean by construction: now an RMSNorm (+γβ: its affine kept)",
                        "kept as LayerNorm, with the op that breaks zero mean"],
              loc="upper left", fontsize=7, frameon=False, ncol=1, bbox_to_anchor=(0.0, 0.0))
    out = Path(out_file)
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return out
