"""What the commands print: rich tables on stdout, progress notices on stderr, numbers for people.

Text output rounds numbers to 4 significant digits (:func:`number`); ``--json`` prints them whole.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from .._deps import require
from .._progress import notice
from ..hf.card import approximate_warning, exact_rule_line, number, saved_dtype_check_text, weights_text
from ..hf.folder_report import FolderReport


def console(stderr: bool = False):
    """A rich console bound to stdout (or stderr) at call time, so captured output sees it."""
    rich_console = require("rich.console")
    file = sys.stderr if stderr else sys.stdout
    width = None if file.isatty() else 160  # wide when piped, so paths stay whole
    return rich_console.Console(file=file, width=width, highlight=False, soft_wrap=True)


@contextlib.contextmanager
def steps(enabled: bool = True) -> Iterator:
    """Yields ``step(description)``: each call ends the previous step's notice and starts the next
    (``normfold._progress.notice``: one line on stderr with the elapsed time)."""
    with contextlib.ExitStack() as stack:
        def step(description: str) -> None:
            stack.close()  # "<previous step>: done in 1.2 s"
            stack.enter_context(notice(description))

        yield step if enabled else (lambda _description: None)


def print_norm_table(rows: list[dict[str, Any]], architecture: str, capture_line: str | None = None,
                     example_inputs: Mapping[str, Any] | None = None) -> None:
    """One row per norm (:func:`normfold.hf.report.norm_rows`): does it become an RMSNorm (a kept norm is
    named by its kind: LayerNorm, RMSNorm), where its γ/β went, and why; then the submodules captured
    when torch.export could not capture the whole model (``capture_line``) and, for a folder, where its
    example inputs came from (``example_inputs``, the report's section)."""
    table_mod = require("rich.table")
    table = table_mod.Table(title=f"{architecture}: {sum(r['folded'] for r in rows)} of "
                                  f"{len(rows)} LayerNorms foldable", title_justify="left")
    table.add_column("norm", style="bold", no_wrap=True)
    table.add_column("input zero-mean?")
    table.add_column("γ/β")
    table.add_column("why (for a kept norm: the op that breaks zero mean)")
    for r in rows:
        result = ("[green]yes: RMSNorm[/green]" if r["folded"] else
                  "[magenta]no: RMSNorm, approximate[/magenta]" if r["approximate"] else  # --approximate: not exact
                  f"[yellow]no: {r['kind']} kept[/yellow]")
        table.add_row(r["path"], result, "folded into next layer" if r["affine_folded"] else "kept", r["reason"])
    console().print(table)
    if capture_line:  # torch.export could not capture the whole model
        console().print(capture_line, markup=False, highlight=False)
    if example_inputs:  # a folder's: which route made them
        console().print(example_inputs_line(example_inputs), markup=False, highlight=False)


def example_inputs_line(described: Mapping[str, Any]) -> str:
    """``example inputs: processor (BertTokenizerFast)``, or ``example inputs: config (<why not the processor>)``."""
    return f"example inputs: {described['route']} ({described.get('processor') or described.get('why')})"


_FIGURES = {  # verification figure -> how the table names it (a figure the result lacks is not shown)
    "compared_in": "compared in",
    "fallback": "why not float64",
    "max_rel_error": "max relative error",
    "max_abs_error": "max absolute error",
    "model_dtype_max_rel_error": "max relative error, model dtype",
    "max_input_mean_ratio": "RMSNorm inputs: max |mean| / rms",
    "tolerance": "tolerance (relative)",
    "tolerance_rule": "tolerance rule",
    "stored_dtype_own_error": "original's own error in the stored dtype",
    "num_runs": "inputs compared",
    "saved_dtype_check": "weights rounded to the saved dtype",
    "weights": "stored weights vs the fold re-derived from the original",
}


def _figure_text(key: str, value) -> str:
    """A verification figure for people; JSON keeps the numbers whole."""
    if value is None:
        return "n/a"
    if key == "weights":
        return weights_text(value)
    if key == "saved_dtype_check":
        return saved_dtype_check_text(value)
    return number(value) if isinstance(value, float) else str(value)


def print_verification(ver: dict, what: str = "fold", title: str = "verification") -> None:
    """The verification figures as a table titled ``title``, then the rule that judged them in one
    line; ``what`` names the exact transform checked ("fold", "rotation")."""
    table_mod, text_mod = require("rich.table"), require("rich.text")
    where = ""
    if "blocks" in ver:  # a streamed fold: checked piece by piece
        blocks = ", ".join(b["block"] for b in ver["blocks"]) or "none"
        where = f" (blocks {blocks}; {ver['shell']['block'] if 'shell' in ver else 'no shell'}; each alone)"
    table = table_mod.Table(title=f"{title}{where}: {'[green]passed[/green]' if ver['ok'] else '[red]FAILED[/red]'}",
                            title_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, label in _FIGURES.items():
        if key in ver and not (key == "fallback" and ver[key] is None):  # the reason shows only when there is one
            # numbers line up on the right; sentences (the tolerance rule) read from the left
            text = _figure_text(key, ver[key])
            table.add_row(label, text_mod.Text(text, justify="right" if _is_number(text) else "left"))
    console().print(table)
    rule = exact_rule_line(ver, what)
    if rule:
        console().print(rule)


def approximate_rule_line(ver: dict[str, Any]) -> str:
    """``approximate fold: cosine 0.9990 ≥ 0.999 on 20 calibration sentences (mean-pooled sentence embeddings;
    the lowest cosine over 20 output rows)``; a sliced rotation is named by its ``kind``, and the row count
    is left out when the measurement does not give one."""
    measured, bar = ver["min_cosine"], ver["promised_min_cosine"]
    sign = "≥" if measured >= bar else "<"
    what = "approximate fold" if ver.get("kind", "approximate") == "approximate" else ver["kind"]
    rows = "" if ver.get("num_rows") is None else f"; the lowest cosine over {ver['num_rows']} output rows"
    return (f"{what}: cosine {_distinct(measured, bar)} {sign} {bar:g} on {ver['num_inputs']} calibration "
            f"sentences ({ver['compared']}{rows})")


def _distinct(value: float, bar: float) -> str:
    """``value`` to 4 significant digits, or more where 4 would hide which side of ``bar`` it is on."""
    for digits in range(4, 17):
        text = f"{value:.{digits}g}"
        if (float(text) >= bar) == (value >= bar):
            return text
    return repr(value)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def warn(message: str) -> None:
    """One warning line on stderr (so --json stdout stays JSON)."""
    console(stderr=True).print(f"[bold yellow]warning:[/bold yellow] {require('rich.markup').escape(message)}")


def warn_if_approximate(report: FolderReport) -> None:
    warning = approximate_warning(report)
    if warning:
        warn(warning)


def warn_skipped_files(report: FolderReport) -> None:
    """One line per file of the input folder that was not carried over (a link, a pipe, ...)."""
    for skip in report.skipped_files or ():
        warn(f"not copied from the input folder: {skip.path} ({skip.reason})")
