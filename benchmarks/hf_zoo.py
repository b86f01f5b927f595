"""Compatibility table over the transformers zoo: every model type of the installed transformers that
builds offline from its default config, shrunk, and holds a LayerNorm, folded exactly (issue 16 item 6).

For each type: a tiny bare model (the size rules of tests/hf/test_zoo_folders.py), every constant
parameter randomised first (γ = 1, β = 0 and zero biases would hide a wrong affine fold), the engine's
exact fold on a 2 x 4 example (proved in float64, or in float32 where the model cannot run in float64),
then the same plan proved again on inputs of another batch size and length (3 x 7). Rows: norms,
folded, affine-folded, the error on those other inputs, each refused norm's reason, and for a model
the engine refuses, its FoldError. Any other exception is a bug and says so in the ``status`` column.

    python benchmarks/hf_zoo.py                         # every type: benchmarks/results/hf_zoo.{csv,md}
    python benchmarks/hf_zoo.py --types bert gpt2 vit   # some types only
    python benchmarks/hf_zoo.py --before benchmarks/results/hf_zoo.csv --reached-only --out /tmp/after
        # only the types the earlier table reached with a LayerNorm or a FoldError, each row with the
        # earlier folded count (``folded_before``) and a summary of the types whose count rose or fell
"""
from __future__ import annotations

import argparse
import collections
import csv
import importlib.util
import platform
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
OTHER_BATCH, OTHER_LENGTH = 3, 7  # the second proof's inputs: another batch size and length than the example
SECONDS_PER_TYPE = 120            # a type that takes longer to build and fold is reported as skipped
COLUMNS = ["model_type", "model_class", "status", "norms", "folded", "affine_folded", "other_inputs_error",
           "compared_in", "tolerance", "seconds", "refused", "detail"]


def _zoo_helpers():
    """tests/hf/test_zoo_folders.py: the config size rules the tests already build their zoo with."""
    spec = importlib.util.spec_from_file_location("_zoo_folders", REPO / "tests" / "hf" / "test_zoo_folders.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class _TimeBox(BaseException):
    """The time box ran out (a BaseException: normfold turns every Exception inside a fold into a FoldError)."""


def _alarm(signum, frame):
    raise _TimeBox(f"took more than {SECONDS_PER_TYPE} s")


def tiny_model(model_type: str, zoo, **config_fields) -> nn.Module:
    """The bare model of ``model_type`` from its shrunk default config (``config_fields`` set on it
    last), in eval mode, randomised."""
    config = zoo.shrink(zoo.transformers.CONFIG_MAPPING[model_type](**zoo.CONFIG_OVERRIDES.get(model_type, {})))
    if hasattr(config, "num_key_value_heads") and config.num_key_value_heads is None:  # a default left unset
        config.num_key_value_heads = config.num_attention_heads  # (Nemotron's): plain multi-head attention
    for name, value in config_fields.items():
        setattr(config, name, value)
    if hasattr(config, "_attn_implementation"):
        config._attn_implementation = "eager"  # the same graph on every torch version
    torch.manual_seed(0)
    model = zoo._bare_model_class(config)(config).eval()
    randomise_constant_parameters(model)
    return model


def randomise_constant_parameters(model: nn.Module, scale: float = 0.2, seed: int = 0) -> int:
    """Add scale·N(0, 1) noise to every floating parameter whose elements are all equal (γ = 1, β = 0, zero
    biases: the initialisations under which a wrong affine fold goes unseen); returns how many changed."""
    generator = torch.Generator().manual_seed(seed)
    changed = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.numel() and bool((p == p.flatten()[0]).all()):
                p.add_(scale * torch.randn(p.shape, generator=generator).to(p.dtype))
                changed += 1
    return changed


def has_layer_norm(model: nn.Module) -> bool:
    """A LayerNorm module, or a parameter-free leaf module named like one (OLMo's ``OlmoLayerNorm``
    calls ``F.layer_norm``; the fold reads what it computes from the trace)."""
    from normfold.nn.kinds import norm_kind

    return any(norm_kind(m) == "LayerNorm" or (type(m).__name__.lower().endswith("layernorm")
                                                and not list(m.children()) and not list(m.parameters()))
               for m in model.modules())


def fold_row(model_type: str, zoo) -> dict:
    """One row of the table for ``model_type`` (never raises: the status column says what happened)."""
    from normfold.engine import FoldError, fold
    from normfold.engine.pipeline import apply_fold, prove_fold
    from normfold.hf.inputs import example_inputs_for

    row = dict.fromkeys(COLUMNS, "")
    row["model_type"] = model_type
    start = time.perf_counter()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SECONDS_PER_TYPE)
    try:
        try:
            model = tiny_model(model_type, zoo)
            example = example_inputs_for(model)
        except _TimeBox:
            raise
        except Exception as err:  # noqa: BLE001  the shrunk default config builds no model: skipped, with why
            return {**row, "status": "skipped", "detail": f"no tiny model: {type(err).__name__}: {_line(err)}"}
        row["model_class"] = type(model).__name__
        if not has_layer_norm(model):
            return {**row, "status": "no LayerNorm"}
        try:
            folded, report = fold(model, example)
            norms = [n for n in report.norms if n.kind == "LayerNorm"]
            if not norms:  # the module named like a LayerNorm computes something else
                return {**row, "status": "no LayerNorm"}
            row.update(norms=len(norms), folded=sum(n.foldable for n in norms),
                       affine_folded=sum(n.affine_folded for n in norms))
            row["refused"] = _reasons(norms)
            other = example_inputs_for(model, batch=OTHER_BATCH, seq=OTHER_LENGTH, seed=1)
            proof = prove_fold(model, apply_fold(model, report.plan), other, report.plan)
            row.update(other_inputs_error=f"{proof.max_rel_error:.1e}", compared_in=proof.compared_in,
                       tolerance=f"{proof.tolerance:.1e}")
            row["status"] = "proved" if proof.ok else "WRONG"
            row["detail"] = proof.fallback or (proof.why or "")
        except FoldError as err:
            row.update(status="FoldError", detail=_line(err))
    except _TimeBox as err:
        row.update(status="skipped", detail=str(err))
    except Exception as err:  # noqa: BLE001  a bug of normfold: the table must show it, not stop
        row.update(status="EXCEPTION", detail=f"{type(err).__name__}: {_line(err)}")
    finally:
        signal.alarm(0)
        row["seconds"] = f"{time.perf_counter() - start:.1f}"
    return row


def _line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:300].replace("|", "/")


def _reasons(norms) -> str:
    """Each distinct refusal reason (where it happened left out) with how many norms it refused, most
    frequent first."""
    counts = collections.Counter(re.sub(r" at [\w.\[\]]+", "", n.reason.split("; affine kept")[0])
                                 for n in norms if not n.foldable)
    return "; ".join(f"{count}x {reason}" for reason, count in counts.most_common()).replace("|", "/")


def model_types(zoo, wanted: list[str] | None) -> list[str]:
    """The types to try: ``wanted``, or the tests' zoo first, then every other type of CONFIG_MAPPING."""
    if wanted:
        return wanted
    every = sorted(zoo.transformers.CONFIG_MAPPING.keys())
    return list(zoo.MODEL_TYPES) + [t for t in every if t not in zoo.MODEL_TYPES]


REACHED = ("proved", "FoldError", "WRONG", "EXCEPTION")  # statuses of the types a fold was tried on


def read_table(path: str | Path) -> dict[str, dict]:
    """An earlier table's rows (``--out``'s CSV) by model type."""
    with open(path, newline="") as handle:
        return {row["model_type"]: row for row in csv.DictReader(handle)}


def reached_types(before: dict[str, dict]) -> list[str]:
    """The types an earlier table reached with a LayerNorm or a FoldError, in its order: the ones whose
    folded count a change of the engine can move (no-LayerNorm and skipped types are left out)."""
    return [t for t, row in before.items() if row["status"] in REACHED]


def folded_before(row: dict, before: dict[str, dict]) -> str:
    """The earlier table's folded count for this row's type, or its status where it had no count."""
    old = before.get(row["model_type"])
    if old is None:
        return "not in before"
    return old["folded"] if old["folded"] != "" else old["status"]


def folded_changes(rows: list[dict]) -> tuple[list[str], list[str], list[str]]:
    """"type: before → after" for the types whose folded count rose, for those where it fell, and for
    those with a count before that this run skipped (time box, no tiny model): not measured, not fell.
    A type with no count before counts as 0 there."""
    rose, fell, unmeasured = [], [], []
    for row in rows:
        before, after = _count(row.get("folded_before", "")), _count(row["folded"])
        change = f"{row['model_type']}: {row['folded_before'] or 0} → {row['folded'] or row['status']}"
        if row["status"] == "skipped":
            if before:
                unmeasured.append(change)
        elif after > before:
            rose.append(change)
        elif after < before:
            fell.append(change)
    return rose, fell, unmeasured


def folded_summary(rows: list[dict]) -> str:
    """"12 → 20; rose in 2 types (...); fell in 0 types (none); not measured (skipped) in 1 type (...)",
    over the types measured both times."""
    rose, fell, unmeasured = folded_changes(rows)
    measured = [r for r in rows if r["status"] != "skipped"]
    total_before = sum(_count(r["folded_before"]) for r in measured)
    parts = [f"{total_before} → {sum(_count(r['folded']) for r in measured)}"]
    for what, changes in (("rose", rose), ("fell", fell), ("not measured (skipped)", unmeasured)):
        parts.append(f"{what} in {len(changes)} type{'s' * (len(changes) != 1)} ({', '.join(changes) or 'none'})")
    return "; ".join(parts)


def _count(value: str) -> int:
    return int(value) if str(value).isdigit() else 0


def write_markdown(rows: list[dict], path: Path, command: str, not_reached: list[str] = ()) -> None:
    statuses = collections.Counter(r["status"] for r in rows)
    tried = [r for r in rows if r["status"] in ("proved", "FoldError", "WRONG", "EXCEPTION")]
    lines = [
        "# The transformers zoo, folded", "",
        f"command: `{command}`  ",
        f"machine: {platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} threads; "
        f"torch {torch.__version__}, transformers {_version('transformers')}; commit {_commit()}  ",
        f"types: {len(rows)} tried; " + ", ".join(f"{n} {s}" for s, n in statuses.most_common()), "",
        f"With a LayerNorm: {len(tried)}; norms {sum(int(r['norms'] or 0) for r in tried)}, folded "
        f"{sum(int(r['folded'] or 0) for r in tried)}; wrong claims {statuses['WRONG']}; exceptions other than "
        f"FoldError {statuses['EXCEPTION']}.", "",
    ]
    columns = columns_of(rows)
    if "folded_before" in columns:
        lines += [f"Folded norms before → after: {folded_summary(rows)}.", ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    if not_reached:
        lines += ["", f"Not reached within --max-minutes ({len(not_reached)}): {', '.join(not_reached)}"]
    path.write_text("\n".join(lines) + "\n")


def columns_of(rows: list[dict]) -> list[str]:
    """COLUMNS, with ``folded_before`` after ``folded`` when the rows carry it (``--before``)."""
    if rows and "folded_before" in rows[0]:
        i = COLUMNS.index("folded") + 1
        return [*COLUMNS[:i], "folded_before", *COLUMNS[i:]]
    return list(COLUMNS)


def _version(name: str) -> str:
    module = sys.modules.get(name)
    return getattr(module, "__version__", "?")


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="*", help="model types (default: every type of CONFIG_MAPPING)")
    parser.add_argument("--out", default=str(RESULTS / "hf_zoo"), help="output stem (.csv and .md are added)")
    parser.add_argument("--max-minutes", type=float, default=None, help="try no new type after this long")
    parser.add_argument("--before", metavar="CSV", help="an earlier table (e.g. benchmarks/results/hf_zoo.csv): "
                        "adds its folded count as folded_before, and which types rose or fell")
    parser.add_argument("--reached-only", action="store_true", help="with --before: only the types it reached "
                        "with a LayerNorm or a FoldError (plus any --types)")
    args = parser.parse_args(argv)
    if args.reached_only and not args.before:
        parser.error("--reached-only needs --before CSV")
    before = read_table(args.before) if args.before else None
    warnings.filterwarnings("ignore")
    zoo = _zoo_helpers()
    zoo.transformers.logging.set_verbosity_error()
    stem = Path(args.out)
    command = "python benchmarks/hf_zoo.py" + (f" --types {' '.join(args.types)}" if args.types else "")
    if args.max_minutes is not None:
        command += f" --max-minutes {args.max_minutes:g}"
    if before is not None:
        command += f" --before {args.before}" + (" --reached-only" if args.reached_only else "")
    if args.reached_only:
        types = list(dict.fromkeys([*reached_types(before), *(args.types or [])]))
    else:
        types = model_types(zoo, args.types)
    rows, start = [], time.monotonic()
    columns = columns_of([{"folded_before": ""}] if before is not None else [])
    with open(stem.with_suffix(".csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        for i, model_type in enumerate(types):
            if args.max_minutes is not None and time.monotonic() - start > 60 * args.max_minutes:
                write_markdown(rows, stem.with_suffix(".md"), command, not_reached=types[i:])
                break
            rows.append(fold_row(model_type, zoo))
            if before is not None:
                rows[-1]["folded_before"] = folded_before(rows[-1], before)
            writer.writerow(rows[-1])
            handle.flush()
            print(" | ".join(str(rows[-1][c]) for c in COLUMNS[:7]), flush=True)
            write_markdown(rows, stem.with_suffix(".md"), command, not_reached=types[i + 1:])
    if before is not None:
        print(f"folded norms before → after: {folded_summary(rows)}", flush=True)
    return 1 if any(r["status"] in ("WRONG", "EXCEPTION") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
