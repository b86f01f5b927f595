"""Fold speed: a 12 × 768 GPT-2 (``transformers.GPT2Config()`` defaults, 124 M parameters, random
weights) folded with its float64 proof, through the API and through the command. Target: ≤ 6 s.

    nice -n 5 .venv/bin/python benchmarks/bench_fold_speed.py               # 5 runs each -> benchmarks/results/fold_speed.*
    .venv/bin/python benchmarks/bench_fold_speed.py --runs 1 --layers 2 --out /tmp/fold_speed   # a quick try
    nice -n 5 .venv/bin/python benchmarks/bench_fold_speed.py --threads 1 --out benchmarks/results/fold_speed_1thread

On a shared machine, use ``--threads 1``: with two intra-op threads every op of the proof's short
forwards waits for the other thread to be scheduled (a 2 × 4-token layer_norm took 7 ms at load 3,
measured with cProfile), so the two-thread times measure the neighbours, not the fold.

What is timed, each ``--runs`` times (medians reported):

- ``api``: ``normfold.fold(model, example_inputs_for(model))`` in this process, the model built once.
  Phases by wrapping the pipeline's functions (each phase's own time, the phases it calls excluded):
  export (``torch.export``), analysis (zero-mean graphs and the plan), apply (the plan on a copy in
  the model's dtype), float64 copy (of the original, for the proof), float64 transform (the plan
  applied to that copy), proof runs (the forwards and the comparison: the rest of the proof).
- ``cli (in process)``: ``normfold.hf.folder.fold_folder`` on the saved folder, split by its own
  steps (loading, folding and verifying in float64, the rounded-weights check, saving and the report
  files) plus the same pipeline phases inside the float64 step.
- ``cli (end to end)``: ``python -m normfold fold DIR -o OUT --overwrite`` in a fresh process: the
  interpreter, the imports, loading, folding, both checks, saving; what a user waits for.

Speed is never asserted by the tests: this is the measurement. Writes ``<out>.csv`` and ``<out>.md``.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

import normfold
from normfold.bench import cpu_model
from normfold.engine import pipeline, transform
from normfold.hf.folder import fold_folder
from normfold.hf.inputs import example_inputs_for

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "fold_speed"
TARGET_S = 6.0
PROOF = "proof runs"  # the prove step's own time: forwards in float64 and the model's dtype, the comparison


class PhaseTimer:
    """Exclusive wall time per phase: a wrapped call's time minus that of the wrapped calls inside it."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [phase, seconds spent in nested wrapped calls]

    def wrap(self, fn, phase):
        """``fn`` timed as ``phase`` (a name, or a function of the enclosing phases giving one)."""
        def timed(*args, **kwargs):
            name = phase([p for p, _ in self._stack]) if callable(phase) else phase
            self._stack.append([name, 0.0])
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                _, nested = self._stack.pop()
                self.seconds[name] += elapsed - nested
                if self._stack:
                    self._stack[-1][1] += elapsed

        return timed


def _transform_phase(enclosing: list[str]) -> str:
    """The plan applied inside the proof is the float64 transform; elsewhere it belongs to its caller."""
    if PROOF in enclosing:
        return "float64 transform"
    return enclosing[-1] if enclosing else "apply"


@contextlib.contextmanager
def timed_pipeline(timer: PhaseTimer):
    """Wrap the fold pipeline's steps (module attributes, looked up at call time) for the duration."""
    verify = importlib.import_module("normfold.engine.verify")  # the module (normfold.engine.verify is also a function)
    targets = [(pipeline, "plan_fold", "plan (other)"), (pipeline, "capture", "export"),
               (pipeline, "analyze_calls", "analysis"), (pipeline, "apply_fold", "apply"),
               (pipeline, "prove_fold", PROOF), (transform, "apply_plan", _transform_phase),
               (verify, "_cast_copy", "float64 copy")]
    saved = [(module, name, getattr(module, name)) for module, name, _ in targets]
    try:
        for module, name, phase in targets:
            setattr(module, name, timer.wrap(getattr(module, name), phase))
        yield timer
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def build_model(layers: int):
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=layers)).eval()


def run_api(model) -> tuple[float, float, dict[str, float], float]:
    """(wall s, CPU s of this process, phase seconds, float64 max relative error) of one API fold."""
    timer = PhaseTimer()
    inputs = example_inputs_for(model)
    with timed_pipeline(timer):
        wall, cpu = time.perf_counter(), time.process_time()
        _, report = normfold.fold(model, inputs)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert report.verification.ok, report.verification
    return wall, cpu, dict(timer.seconds), report.verification.max_rel_error


def run_cli_in_process(model_dir: Path, out_dir: Path) -> tuple[float, dict[str, float]]:
    """(wall s, phase seconds) of ``fold_folder``: its own steps, and the pipeline's phases inside them."""
    timer, steps = PhaseTimer(), defaultdict(float)
    marks: list[tuple[str, float]] = []
    with timed_pipeline(timer):
        start = time.perf_counter()
        fold_folder(model_dir, out_dir, overwrite=True, step=lambda what: marks.append((what, time.perf_counter())))
        end = time.perf_counter()
    for (what, t0), (_, t1) in zip(marks, marks[1:] + [("end", end)]):
        steps[f"step: {what}"] += t1 - t0
    inside = {f"  {k}": v for k, v in timer.seconds.items()}
    return end - start, {**steps, **inside}


def run_cli_end_to_end(model_dir: Path, out_dir: Path) -> float:
    """Wall seconds of ``python -m normfold fold DIR -o OUT --overwrite`` in a fresh process."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "normfold", "fold", str(model_dir), "-o", str(out_dir), "--overwrite",
                    "--json"], check=True, stdout=subprocess.DEVNULL, env={**os.environ, "NORMFOLD_PROGRESS": "0"})
    return time.perf_counter() - start


def median_phases(runs: list[dict[str, float]]) -> dict[str, float]:
    names = list(dict.fromkeys(name for run in runs for name in run))
    return {name: statistics.median(run.get(name, 0.0) for run in runs) for name in names}


def machine_line() -> str:
    load = os.getloadavg()[0]
    return (f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads); "
            f"run at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average at the start: {load:.1f}")


def write_results(out: Path, rows: list[dict], summary: list[str], command: str, machine: str,
                  example: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["path", "phase", "median_s", "runs"])
        writer.writeheader()
        writer.writerows(rows)
    lines = ["# Fold speed: a 12 × 768 GPT-2 with its float64 proof", "",
             "Random weights, `transformers.GPT2Config()` defaults (124 M parameters, float32), example inputs "
             f"from `normfold.hf.example_inputs_for` ({example}); medians of the runs.", "",
             "| path | phase | median s |", "|---|---|---|"]
    lines += [f"| {r['path']} | {r['phase']} | {r['median_s']:.2f} |" for r in rows]
    lines += ["", *summary, "", f"Command: `{command}`", "", f"Machine: {machine}.", ""]
    out.with_suffix(".md").write_text("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="repetitions of each path (median reported; >= 1)")
    parser.add_argument("--layers", type=int, default=12, help="GPT-2 blocks (12: GPT-2 small)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results stem: writes STEM.csv and STEM.md")
    parser.add_argument("--skip-cli", action="store_true", help="time the API only")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads, here and in the CLI's process (default: torch's own choice)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.layers < 1 or (args.threads is not None and args.threads < 1):
        parser.error(f"--runs, --layers and --threads must be >= 1, got {args.runs}, {args.layers}, {args.threads}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the CLI's fresh process
    machine = machine_line()
    model = build_model(args.layers)
    rows, summary = [], []
    example = " × ".join(map(str, example_inputs_for(model)["input_ids"].shape)) + " tokens"

    api = [run_api(model) for _ in range(args.runs)]
    api_wall = statistics.median(w for w, _, _, _ in api)
    rows.append({"path": "api", "phase": "total (normfold.fold)", "median_s": api_wall, "runs": args.runs})
    rows.append({"path": "api", "phase": "CPU time of the process", "median_s": statistics.median(c for _, c, _, _ in api),
                 "runs": args.runs})
    rows += [{"path": "api", "phase": k, "median_s": v, "runs": args.runs}
             for k, v in median_phases([p for _, _, p, _ in api]).items()]
    worst = max(e for _, _, _, e in api)
    summary.append(f"- API, `normfold.fold(model, inputs)` with the float64 proof: **{api_wall:.2f} s** "
                   f"(target ≤ {TARGET_S:g} s: {'met' if api_wall <= TARGET_S else 'not met'}); "
                   f"float64 max relative error {worst:.1e}")

    if not args.skip_cli:
        with tempfile.TemporaryDirectory(prefix="fold_speed_") as tmp:
            model_dir, out_dir = Path(tmp) / "gpt2", Path(tmp) / "folded"
            model.save_pretrained(model_dir)
            del model
            in_process = [run_cli_in_process(model_dir, out_dir) for _ in range(args.runs)]
            end_to_end = [run_cli_end_to_end(model_dir, out_dir) for _ in range(args.runs)]
        cli_wall = statistics.median(end_to_end)
        rows.append({"path": "cli", "phase": "end to end (fresh process)", "median_s": cli_wall, "runs": args.runs})
        rows.append({"path": "cli", "phase": "fold_folder (in process)",
                     "median_s": statistics.median(w for w, _ in in_process), "runs": args.runs})
        rows += [{"path": "cli", "phase": k, "median_s": v, "runs": args.runs}
                 for k, v in median_phases([p for _, p in in_process]).items()]
        summary.append(f"- CLI, `normfold fold DIR -o OUT` end to end (interpreter, imports, load, fold, both "
                       f"checks, save): **{cli_wall:.2f} s** (target ≤ {TARGET_S:g} s: "
                       f"{'met' if cli_wall <= TARGET_S else 'not met'})")
    source = os.environ.get("PYTHONPATH")  # set when timing another checkout's src (e.g. the code before a change)
    command = (f"PYTHONPATH={source} " if source else "") + "nice -n 5 .venv/bin/python benchmarks/bench_fold_speed.py"
    command += "".join(f" {a}" for a in (sys.argv[1:] if argv is None else argv))
    write_results(args.out, rows, summary, command, machine, example)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
