"""The ``normfold bench`` command: time the original, folded and folded+fused model of a folder
(the timing itself is ``normfold.bench``)."""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from .._progress import notice
from ..bench.config import QUICK, BenchConfig
from ..bench.driver import bench_model
from ..bench.results import result_paths, write_results
from ..bench.stats import verdict
from ..hf.load import load_model
from ._common import EXIT_OK, UsageError, add_model_dir, model_dir, positive_int


def _run_bench(args) -> int:
    if args.out and not args.overwrite:  # before the model is loaded or anything timed
        taken = [str(p) for p in result_paths(args.out, plot=not args.no_plot) if os.path.lexists(p)]
        if taken:
            raise UsageError(f"--out {args.out}: {', '.join(taken)} already exist{'s' * (len(taken) == 1)}; "
                             "pass --overwrite to replace them, or pick another --out")
    source = model_dir(args)
    config = QUICK if args.quick else BenchConfig()
    config = replace(config, compile=args.compile, rounds=args.rounds or config.rounds,
                     batches=tuple(args.batch) if args.batch else config.batches,
                     seqs=tuple(args.seq) if args.seq else config.seqs, profile=not args.no_profile)
    with notice(f"timing {source.name}: {_how_long(args)}", always=True):  # minutes of silence look like a hang
        rows = bench_model(load_model(source), config, name=source.name)
    for r in rows:
        share = (f"  norm+add {r.norm_share['original']:.1%} -> {r.norm_share['fused']:.1%}"
                 if r.norm_share else "")
        print(f"{r.mode:7s} batch {r.batch:2d} {r.kind:7s} {r.seq:5d}  original {r.median_ms['original']:9.3f} ms  "
              + "  ".join(f"{c} {r.ratio[c]:.3f}x [{r.ratio_ci[c][0]:.3f}, {r.ratio_ci[c][1]:.3f}]"
                          for c in ("control", "folded", "fused") if c in r.ratio) + f"  ({verdict(r)})" + share)
    stem = args.out or new_results_dir(Path.cwd()) / "bench"
    for p in write_results(rows, stem, command="normfold " + shlex.join(sys.argv[1:]), plot=not args.no_plot):
        print(f"wrote {p}")
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    return EXIT_OK


# what a --quick run of the bundled model takes on 2 CPU cores once the C++ kernel is built: 11 s end to end
# on an idle machine (2026-12-02), 53 s on a loaded one (issue 30); most of it the fold, its float64 proof
# and the profiler pass rather than the timed rounds
QUICK_TIME = "10 s to a minute on 2 CPU cores"


def _how_long(args) -> str:
    """What to expect before the first line: --quick's measured time, or that a full grid takes longer."""
    if args.quick:
        return f"--quick, {QUICK_TIME} for a small model"
    return f"the full grid takes many times longer than --quick ({QUICK_TIME})"


def new_results_dir(parent: Path) -> Path:
    """A folder made now under ``parent``, ``normfold-bench-YYYYmmdd-HHMMSS`` (``-2``, ``-3``... when taken):
    results never land on earlier ones, committed tables included."""
    name = time.strftime("normfold-bench-%Y%m%d-%H%M%S")
    for suffix in ["", *(f"-{i}" for i in range(2, 1000))]:
        try:
            (parent / f"{name}{suffix}").mkdir()
        except FileExistsError:
            continue
        return parent / f"{name}{suffix}"
    raise FileExistsError(f"no free folder name {name}-N under {parent}")


def add_commands(subparsers) -> None:
    """Add ``bench`` to the ``normfold`` command's subparsers."""
    p = subparsers.add_parser("bench", help="time the original, folded and folded+fused model side by side")
    add_model_dir(p)
    p.add_argument("--quick", action="store_true",
                   help=f"a short run ({QUICK_TIME} for a small model, mostly folding, proving and profiling): "
                        "batch 1, decode and seq 16, 5 rounds")
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd contenders")
    p.add_argument("--batch", type=positive_int, nargs="+", help="batch sizes (default 1 8)")
    p.add_argument("--seq", type=positive_int, nargs="+", help="sequence lengths; 1 = a decode step (default 1 128 1024)")
    p.add_argument("--rounds", type=positive_int, help="interleaved rounds (default 30)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiler pass")
    p.add_argument("--out", metavar="STEM", help="write STEM.csv, STEM.md and STEM.png, suffixes appended to STEM as "
                                                 "given (notes.v2: notes.v2.csv); default: bench.* in a new folder "
                                                 "./normfold-bench-YYYYmmdd-HHMMSS")
    p.add_argument("--overwrite", action="store_true", help="replace STEM.* files that exist (else refused before "
                                                            "anything is timed)")
    p.add_argument("--no-plot", action="store_true", help="no PNG")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    p.set_defaults(run=_run_bench)
