"""`normfold fold DIR` over a tiny folder of every transformers model type: the CLI as a user meets it
(issue 33, Must show: "exit 0 or one `error:` line, never a traceback").

For each type of the installed transformers' CONFIG_MAPPING: the shrunk default config and bare model of
tests/hf/test_zoo_folders.py, every constant parameter randomised (as in hf_zoo.py: γ = 1, β = 0 would
hide a wrong affine fold), saved with the type's image processor or feature extractor built from its class
defaults (tests/hf/test_processor_folders.py) when it has one, so the fold takes the processor route
where a user's folder would; then `normfold fold DIR -o OUT` (its ``main``, time-boxed). The types run in
a child process that imports torch and transformers once for many types; one whose resident memory passes
``--max-rss-gb`` is killed (a "skipped" row saying so) and a new child goes on from the next type.

Each row's ``verdict``: "folded" (exit 0, a report written), "refused" (exit 1 or 2 with exactly one
``normfold:`` line and nothing published), "skipped" (no tiny folder builds offline, or the time box), or
"BUG: ..." (a traceback, several or no ``normfold:`` lines, an output folder left after a refusal).

    python benchmarks/cli_zoo.py                         # every type: benchmarks/results/cli_zoo.{csv,md}
    python benchmarks/cli_zoo.py --types vit whisper     # some types only
    python benchmarks/cli_zoo.py --shard 1/2 --out /tmp/a & python benchmarks/cli_zoo.py --shard 2/2 --out /tmp/b
    python benchmarks/cli_zoo.py --merge /tmp/a.csv /tmp/b.csv   # one table from shards (or a rerun's rows:
                                                                 # a later file's row of a type wins)
    python benchmarks/cli_zoo.py --heads                 # every task head of the test families' types:
                                                         # benchmarks/results/cli_heads.{csv,md}

A row's ``model_type`` may name a head, ``TYPE:CLASS`` (``bert:BertForMultipleChoice``): its folder holds that
class built from the type's shrunk config, as a fine-tuned checkpoint's does.

    python benchmarks/cli_zoo.py --tests /tmp/transformers-tests --out benchmarks/results/cli_zoo_testers

builds each folder from transformers' own tester config instead (a checkout of its test suite, read by
benchmarks/hf_testers.py as hf_zoo.py --tests does): the main head class hf_zoo.py picks for the tester's
inputs, else the bare model; a type without a tester is a "skipped" row saying so.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import csv
import io
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "hf"), str(REPO / "tests"), str(REPO / "benchmarks")]
RESULTS = REPO / "benchmarks" / "results"
SECONDS_PER_TYPE = 300  # build + fold of one type; past it the row is "skipped" with the time
MAX_RSS_GB = 8.0        # a type whose child process holds more is stopped (BLT's shrunk config builds 23 GB)
TESTS: Path | None = None  # --tests: a transformers checkout whose testers' configs build the folders
COLUMNS = ["model_type", "verdict", "exit", "route", "processor", "line", "seconds"]


class _TimeBox(BaseException):
    """The time box ran out (a BaseException: the CLI turns every Exception into its one error line)."""


def _alarm(signum, frame):
    raise _TimeBox(f"took more than {SECONDS_PER_TYPE} s")


def _helpers():
    """The tests' tiny-folder builders and the zoo table's randomiser (imported here: they need transformers)."""
    import hf_zoo
    import test_processor_folders as processors
    import test_zoo_folders as zoo

    return zoo, processors, hf_zoo


def processor_for(model_type: str, config, processors) -> tuple[object | None, str]:
    """The type's image processor or feature extractor, and its name; (None, why) when it has none or
    none builds offline (the folder then has none, as many users' folders do)."""
    if model_type in processors.image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES:
        make = processors._image_processor
    elif model_type in processors.feature_extraction_auto.FEATURE_EXTRACTOR_MAPPING_NAMES:
        make = processors._feature_extractor
    else:
        return None, "none"
    try:
        processor = make(model_type, config)
    except Exception as err:  # noqa: BLE001  a processor class that needs files or packages we lack
        return None, f"none ({type(err).__name__} building it offline)"
    return processor, type(processor).__name__


def build_folder(entry: str, folder: Path, helpers) -> tuple[str | None, str]:
    """Save the tiny folder of ``entry`` (a model type, or ``TYPE:CLASS``: that head class); (why not, "") when
    it does not build, else (None, processor)."""
    zoo, processors, hf_zoo = helpers
    model_type, _, head = entry.partition(":")
    if TESTS is not None:
        try:
            config, model = _tester_model(model_type, head, helpers)
        except Exception as err:  # noqa: BLE001  no tester in the checkout, or its config builds no model
            return f"no tiny model from its tester ({type(err).__name__}: {_first_line(err)})", ""
    try:
        if TESTS is None:
            config = zoo._config(model_type)
            model_class = getattr(zoo.transformers, head) if head else zoo._folder_model_class(config)
            config.architectures = [model_class.__name__]
            torch.manual_seed(0)
            model = model_class(config).eval()
            hf_zoo.randomise_constant_parameters(model)
        model.save_pretrained(folder)  # the shrunk config is validated here
    except Exception as err:  # noqa: BLE001  a config the size rules cannot shrink consistently
        return f"no tiny model from its shrunk default config ({type(err).__name__}: {_first_line(err)})", ""
    processor, name = processor_for(model_type, config, processors)
    if processor is not None:
        try:
            processor.save_pretrained(folder)
        except Exception as err:  # noqa: BLE001
            name = f"none ({type(err).__name__} saving {name})"
    return None, name


def _tester_model(model_type: str, head: str, helpers):
    """(config, randomised model) from the type's tester in ``TESTS``: the head class ``head``, else the class
    hf_zoo.py folds last for the tester's inputs (the main head, when one takes them)."""
    import hf_testers

    zoo, _, hf_zoo = helpers
    config, example, _ = hf_testers.tester_inputs(model_type, TESTS, seed=0)
    classes = [getattr(zoo.transformers, head)] if head else hf_zoo.model_classes(config, zoo, example)
    if not classes:
        raise LookupError(f"no model class takes {type(config).__name__}")
    model = hf_zoo.tester_model(classes[-1], config)
    model.config.architectures = [classes[-1].__name__]
    return model.config, model


def cli_row(model_type: str, root: Path, helpers) -> dict:
    """One row: build the folder, run `normfold fold` on it, judge what it printed (never raises)."""
    from normfold.cli import main as normfold_main

    row = {**dict.fromkeys(COLUMNS, ""), "model_type": model_type}
    folder = root / model_type.replace(":", "-")
    out = folder.with_name(f"{folder.name}-folded")
    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SECONDS_PER_TYPE)
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        why_not, row["processor"] = build_folder(model_type, folder, helpers)
        if why_not:
            row.update(verdict="skipped", line=why_not)
            return row
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = normfold_main(["fold", str(folder), "-o", str(out)])
            except _TimeBox:
                raise
            except BaseException:  # noqa: BLE001  anything escaping main is what a user sees as a traceback
                traceback.print_exc()
                code = None
        row.update(judge(code, stdout.getvalue(), stderr.getvalue(), out))
    except _TimeBox as err:
        row.update(verdict="skipped", line=str(err))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        row["seconds"] = f"{time.monotonic() - start:.1f}"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    return row


def judge(code: int | None, stdout: str, stderr: str, out: Path) -> dict:
    """The verdict on one CLI run, as tests/hf/test_processor_folders.py asserts it."""
    lines = [line for line in stderr.splitlines() if line.startswith("normfold: ")]
    if code is None or "Traceback" in stderr:
        last = [line for line in stderr.splitlines() if line.strip()][-1:]
        return {"verdict": "BUG: traceback", "exit": "" if code is None else code, "line": _clean(" ".join(last))}
    if code == 0:
        report = out / "normfold_report.json"
        if not report.is_file():
            return {"verdict": "BUG: exit 0 without a report", "exit": 0}
        route = json.loads(report.read_text()).get("example_inputs", {})
        said = next((line for line in stdout.splitlines() if line.startswith("example inputs:")), "")
        return {"verdict": "folded", "exit": 0, "route": route.get("route", ""), "line": _clean(said)}
    if len(lines) != 1:
        return {"verdict": f"BUG: {len(lines)} normfold: lines", "exit": code, "line": _clean(" / ".join(lines))}
    if out.exists():
        return {"verdict": "BUG: output left after a refusal", "exit": code, "line": _clean(lines[0])}
    return {"verdict": "refused", "exit": code, "line": _clean(lines[0])}


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]


def _clean(text: str) -> str:
    return text.strip()[:300].replace("|", "/")


def write_markdown(rows: list[dict], path: Path, command: str) -> None:
    from hf_zoo import command_line

    verdicts = collections.Counter(r["verdict"] for r in rows)
    routes = collections.Counter(r["route"] for r in rows if r["verdict"] == "folded")
    refusals = collections.Counter(_refusal_kind(r["line"]) for r in rows if r["verdict"] == "refused")
    skips = collections.Counter(_skip_kind(r["line"]) for r in rows if r["verdict"] == "skipped")
    with_processor = sum(not r["processor"].startswith("none") for r in rows if r["processor"])
    bugs = sum(n for v, n in verdicts.items() if v.startswith("BUG"))
    lines = [
        "# `normfold fold` over a tiny folder of every " + ("task head of the test families' transformers types"
                                                          if any(":" in r["model_type"] for r in rows)
                                                          else "transformers type"), "",
        command_line(command),
        f"torch {torch.__version__}, transformers {_version('transformers')}; commit {_commit()}  ",
        f"types: {len(rows)}; " + ", ".join(f"{n} {v}" for v, n in verdicts.most_common()), "",
        f"**Tracebacks or malformed exits: {bugs}.** Folded: {verdicts['folded']} (input route: "
        + ", ".join(f"{n} {r}" for r, n in routes.most_common()) + f"); folders saved with a processor: "
        f"{with_processor}. Refused with one line: {verdicts['refused']} ("
        + ", ".join(f"{n} {k}" for k, n in refusals.most_common()) + "). Skipped (not measured): "
        + ", ".join(f"{n} {k}" for k, n in skips.most_common()) + ".", "",
        "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    path.write_text("\n".join(lines) + "\n")


def _skip_kind(line: str) -> str:
    if line.startswith("no tiny model"):  # "from its shrunk default config (...)", or "from its tester (...)"
        return line.split(" (")[0].replace("no tiny model", "no tiny folder")
    return "past the memory limit" if "memory" in line else "past the time box" if "took more than" in line else line


def _refusal_kind(line: str) -> str:
    """A refusal's kind: the words of its one line past ``normfold: error:``, up to where it names the model,
    the folder or the details ("cannot build example inputs for BarkConfig: ..." -> "cannot build example
    inputs"; "EncodecModel (encodec): planning (capture ...": "planning")."""
    body = line.removeprefix("normfold: error: ").removeprefix("normfold: ")
    body = re.sub(r"^\w+ \([\w.-]+\): ", "", body)  # "EncodecModel (encodec): planning ...": the step, not the model
    return re.split(r" for | in /|: | \(", body, maxsplit=1)[0][:60]


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _commit() -> str:
    from hf_zoo import _commit as commit

    return commit()


def read_rows(paths: list[str]) -> list[dict]:
    """The rows of the CSVs at ``paths`` by type, a later file's row replacing an earlier one's (a rerun)."""
    rows: dict[str, dict] = {}
    for path in paths:
        with open(path, newline="") as handle:
            rows.update((row["model_type"], row) for row in csv.DictReader(handle))
    return sorted(rows.values(), key=lambda r: r["model_type"])


def main(argv: list[str] | None = None) -> int:
    global SECONDS_PER_TYPE, TESTS  # --seconds-per-type, --tests: read by each row, in the children too
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="*", help="model types (default: every type of CONFIG_MAPPING)")
    parser.add_argument("--shard", default="1/1", help="K/N: only every N-th type from the K-th (parallel runs)")
    parser.add_argument("--out", default=str(RESULTS / "cli_zoo"), help="output stem (.csv and .md are added)")
    parser.add_argument("--max-rss-gb", type=float, default=MAX_RSS_GB, help="stop a type whose process holds "
                        "more memory than this (a 'skipped' row)")
    parser.add_argument("--seconds-per-type", type=int, default=SECONDS_PER_TYPE, help="build and fold of one "
                        "type: past this long the row is 'skipped' (a slow processor route: Mask2Former, LightGlue)")
    parser.add_argument("--heads", action="store_true", help="every task head class of each type (default: the "
                        "families of tests/hf/test_zoo_folders.py) instead of its bare model")
    parser.add_argument("--merge", nargs="+", metavar="CSV", help="write one table from shards' CSVs (a later "
                        "file's row of a type wins), run nothing")
    parser.add_argument("--tests", type=Path, help="a transformers checkout: each folder from its type's tester "
                        "config (benchmarks/hf_testers.py) instead of the shrunk default config")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # the child: JSON lines out
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)  # the child's folder for the tiny folders
    args = parser.parse_args(argv)
    if args.seconds_per_type <= 0:
        parser.error(f"--seconds-per-type must be > 0, got {args.seconds_per_type}")
    SECONDS_PER_TYPE = args.seconds_per_type
    if args.tests is not None and not (args.tests / "tests" / "models").is_dir():
        parser.error(f"--tests must be a transformers checkout with tests/models/, got {args.tests}")
    TESTS = args.tests
    if args.worker:
        return run_worker(args.types, args.root)
    stem = Path(args.out)
    if args.merge:
        rows = read_rows(args.merge)
        from hf_zoo import merge_provenance

        _write(rows, stem, merge_provenance("cli_zoo.py", args.merge))
        return _exit_code(rows)
    try:
        k, n = (int(part) for part in args.shard.split("/"))
        assert 1 <= k <= n
    except (ValueError, AssertionError):
        parser.error(f"--shard takes K/N with 1 <= K <= N, got {args.shard!r}")
    if args.heads:
        zoo = _helpers()[0]
        types = head_entries(args.types or zoo.MODEL_TYPES, zoo.transformers)
        stem = stem if args.out != parser.get_default("out") else RESULTS / "cli_heads"
    else:
        types = args.types or _every_type()
    types = types[k - 1::n]
    command = "python benchmarks/cli_zoo.py" + (" --heads" if args.heads else "")
    command += f" --types {' '.join(args.types)}" if args.types else ""
    command += f" --shard {args.shard}" if n > 1 else ""
    if args.seconds_per_type != parser.get_default("seconds_per_type"):
        command += f" --seconds-per-type {args.seconds_per_type}"
    command += f" --tests {args.tests}" if args.tests else ""
    rows = []
    for row in isolated_rows(types, args.max_rss_gb):
        rows.append(row)
        print(" | ".join(str(row[c]) for c in COLUMNS), flush=True)
        _write(rows, stem, command)
    return _exit_code(rows)


def head_entries(types: list[str], transformers) -> list[str]:
    """``TYPE:CLASS`` for every head class a task mapping of transformers (``MODEL_FOR_*_MAPPING_NAMES``) names
    for each of ``types``, sorted within a type."""
    modeling_auto = transformers.models.auto.modeling_auto
    mappings = [getattr(modeling_auto, name) for name in dir(modeling_auto)
                if name.startswith("MODEL_FOR_") and name.endswith("_MAPPING_NAMES")]
    entries = []
    for model_type in types:
        named = {name for mapping in mappings for name in _names(mapping.get(model_type))}
        entries += [f"{model_type}:{name}" for name in sorted(named) if hasattr(transformers, name)]
    return entries


def _names(value) -> tuple[str, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,) if value else ()


def _every_type() -> list[str]:
    from transformers import CONFIG_MAPPING

    return sorted(CONFIG_MAPPING.keys())


def run_worker(types: list[str], root: Path) -> int:
    """The child: for each type a ``{"start": type}`` line, then its ``{"row": ...}`` line, on stdout; the
    folders under ``root`` (the parent's, which clears what a killed child leaves there)."""
    warnings.filterwarnings("ignore")
    os.environ["NORMFOLD_PROGRESS"] = "0"
    helpers = _helpers()
    helpers[0].transformers.logging.set_verbosity_error()
    helpers[0].transformers.utils.logging.disable_progress_bar()  # "Writing model shards" once per type
    report = sys.stdout
    sys.stdout = sys.stderr  # whatever a model prints stays off the protocol
    parent = os.getppid()
    for model_type in types:
        if os.getppid() != parent:  # the sweep was stopped: no orphan goes on folding
            break
        print(json.dumps({"start": model_type}), file=report, flush=True)
        print(json.dumps({"row": cli_row(model_type, root, helpers)}), file=report, flush=True)
    return 0


def isolated_rows(types: list[str], max_rss_gb: float):
    """The rows of ``types`` from child processes (:func:`run_worker`), in order: a child whose resident
    memory passes ``max_rss_gb``, or that dies or hangs within a type, is killed; that type gets a "skipped"
    row with the reason and a new child goes on from the next type."""
    with tempfile.TemporaryDirectory(prefix="cli_zoo_") as root:
        yield from _rows_in_children(types, Path(root), max_rss_gb)


def _rows_in_children(types: list[str], root: Path, max_rss_gb: float):
    remaining = list(types)
    while remaining:
        for leftover in root.iterdir():  # a killed child's folders (BLT's: 5.6 GB)
            shutil.rmtree(leftover, ignore_errors=True)
        child = subprocess.Popen([sys.executable, __file__, "--worker", "--seconds-per-type", str(SECONDS_PER_TYPE),
                                  "--root", str(root), *(["--tests", str(TESTS)] if TESTS else []), "--types", *remaining],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                 env={**os.environ, "HF_HUB_OFFLINE": "1"})  # a tester's code may reach for the hub
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in child.stdout] and None, daemon=True).start()
        current, since, why = None, time.monotonic(), None
        while why is None:
            try:
                message = json.loads(lines.get(timeout=0.5))
            except queue.Empty:
                if child.poll() is not None and lines.empty():
                    why = f"the child process ended with code {child.returncode}"
                elif current is not None and _rss_gb(child.pid) > max_rss_gb:  # imports are no type's
                    why = f"resident memory passed {max_rss_gb:g} GB: stopped"
                elif current is not None and time.monotonic() - since > 2 * SECONDS_PER_TYPE:
                    why = f"took more than {2 * SECONDS_PER_TYPE} s: stopped"
                continue
            if "start" in message:
                current, since = message["start"], time.monotonic()
            else:
                yield message["row"]
                remaining.remove(current)
                current = None
                if not remaining:
                    break
        child.kill()
        child.wait()
        if current is not None:
            yield {**dict.fromkeys(COLUMNS, ""), "model_type": current, "verdict": "skipped", "line": why,
                   "seconds": f"{time.monotonic() - since:.1f}"}
            remaining.remove(current)
        elif why is not None and remaining:  # died before starting a type: nothing more to learn from it
            for model_type in remaining:
                yield {**dict.fromkeys(COLUMNS, ""), "model_type": model_type, "verdict": "skipped", "line": why}
            return


def _rss_gb(pid: int) -> float:
    from hf_zoo import _rss_gb as rss

    return rss(pid)


def _write(rows: list[dict], stem: Path, command: str) -> None:
    with open(stem.with_suffix(".csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    write_markdown(rows, stem.with_suffix(".md"), command)


def _exit_code(rows: list[dict]) -> int:
    return 1 if any(r["verdict"].startswith("BUG") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
