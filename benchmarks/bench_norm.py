"""normfold's fused norms against torch's, forward and forward+backward, on this machine.

    python benchmarks/bench_norm.py            # full run, writes benchmarks/results/bench_norm.{csv,md}
    python benchmarks/bench_norm.py --quick    # seconds: tiny shapes, few repetitions, no torch.compile

Method: every contender of one (shape, mode) is timed in the same process, interleaved
(A B C … A B C …, the order rotated each round), each sample a batch of calls long enough for the
timer; the table shows medians. Warm-up and compilation happen before timing. Where an op takes
``out=`` (ours, ``copy_``) the timed region allocates nothing, since fresh large buffers page-fault
on every call here; torch's modules allocate their output as they do in real use. Bandwidth
counts one read of x and one write of y; the same-run ``copy_`` into a preallocated tensor is
the bandwidth yardstick.
"""
from __future__ import annotations

import argparse
import csv
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from normfold.bench import cpu_model
from torch import nn

import normfold

RESULTS = Path(__file__).resolve().parent / "results"
FULL_SHAPES = [(1024, 384), (4096, 768), (4096, 4096), (8192, 4096)]
QUICK_SHAPES = [(64, 384), (256, 768)]
EPS = 1e-6


@dataclass
class Row:
    shape: tuple[int, int]
    mode: str  # "fwd" or "fwd+bwd"
    contender: str
    median_us: float
    gbps: float


def hand_rms_norm(x, weight, eps: float = EPS):
    """RMSNorm written from elementary ops, as model code often does."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _time_batch(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def interleaved_medians(contenders: dict[str, Callable[[], object]], rounds: int,
                        min_sample_s: float) -> dict[str, float]:
    """Median seconds per call of each contender, sampled in rotating interleaved order."""
    calls = {}
    for name, fn in contenders.items():  # warm-up (and compilation), then size the batches
        for _ in range(3):
            fn()
        one = _time_batch(fn, 3)
        calls[name] = max(1, int(min_sample_s / max(one, 1e-9)))
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(_time_batch(contenders[name], calls[name]))
    return {name: statistics.median(s) for name, s in samples.items()}


def forward_contenders(x, weight, bias, out, compiled_rms) -> dict[str, Callable[[], object]]:
    n = x.shape[-1]
    ln = nn.LayerNorm(n, eps=EPS).to(x.dtype)
    rms = nn.RMSNorm(n, eps=EPS).to(x.dtype)
    copy_dst = torch.empty_like(x)
    found = {
        "copy_": lambda: copy_dst.copy_(x),
        "normfold.rms_norm(out=)": lambda: normfold.rms_norm(x, weight, eps=EPS, out=out),
        "normfold.rms_norm": lambda: normfold.rms_norm(x, weight, eps=EPS),
        "normfold.layer_norm(out=)": lambda: normfold.layer_norm(x, weight, bias, eps=EPS, out=out),
        "nn.LayerNorm": lambda: ln(x),
        "nn.RMSNorm": lambda: rms(x),
        "hand-written RMSNorm": lambda: hand_rms_norm(x, weight),
    }
    if compiled_rms is not None:
        found["compiled RMSNorm"] = lambda: compiled_rms(x, weight)
    return found


def backward_contenders(x, weight, bias, dy, compiled_rms) -> dict[str, Callable[[], object]]:
    n = x.shape[-1]
    xg = x.detach().requires_grad_(True)
    wg = weight.detach().requires_grad_(True)
    bg = bias.detach().requires_grad_(True)
    ln = nn.LayerNorm(n, eps=EPS).to(x.dtype)
    rms = nn.RMSNorm(n, eps=EPS).to(x.dtype)

    def fwd_bwd(fn, *params):
        return lambda: torch.autograd.grad(fn(), (xg, *params), dy)

    found = {
        "normfold.rms_norm": fwd_bwd(lambda: normfold.rms_norm(xg, wg, eps=EPS), wg),
        "normfold.layer_norm": fwd_bwd(lambda: normfold.layer_norm(xg, wg, bg, eps=EPS), wg, bg),
        "nn.LayerNorm": fwd_bwd(lambda: ln(xg), ln.weight, ln.bias),
        "nn.RMSNorm": fwd_bwd(lambda: rms(xg), rms.weight),
        "hand-written RMSNorm": fwd_bwd(lambda: hand_rms_norm(xg, wg), wg),
    }
    if compiled_rms is not None:
        found["compiled RMSNorm"] = fwd_bwd(lambda: compiled_rms(xg, wg), wg)
    return found


def run(shapes, dtype, rounds: int, min_sample_s: float, use_compile: bool) -> list[Row]:
    compiled_rms = torch.compile(hand_rms_norm, dynamic=False) if use_compile else None
    rows = []
    for m, n in shapes:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(m, n, generator=g).to(dtype)
        weight = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
        bias = (0.1 * torch.randn(n, generator=g)).to(dtype)
        out, dy = torch.empty_like(x), torch.randn(m, n, generator=g).to(dtype)
        traffic = 2 * x.numel() * x.element_size()  # read x, write y
        with torch.no_grad():
            fwd = interleaved_medians(forward_contenders(x, weight, bias, out, compiled_rms), rounds, min_sample_s)
        bwd = interleaved_medians(backward_contenders(x, weight, bias, dy, compiled_rms), rounds, min_sample_s)
        for mode, medians in (("fwd", fwd), ("fwd+bwd", bwd)):
            for name, seconds in medians.items():
                rows.append(Row((m, n), mode, name, seconds * 1e6, traffic / seconds / 1e9 if mode == "fwd" else 0.0))
        print(_shape_table(rows[-len(fwd) - len(bwd):]), flush=True)
    return rows


def _lookup(rows, shape, mode, contender) -> float:
    return next(r.median_us for r in rows if r.shape == shape and r.mode == mode and r.contender == contender)


def _shape_table(rows: list[Row]) -> str:
    lines = []
    for mode in ("fwd", "fwd+bwd"):
        ours = _lookup(rows, rows[0].shape, mode, "normfold.rms_norm")
        lines.append(f"\n{rows[0].shape} {mode}: median µs, GB/s, speed-up of normfold.rms_norm over it")
        for r in (r for r in rows if r.mode == mode):
            gbps = f"{r.gbps:7.1f}" if r.gbps else "      -"
            lines.append(f"  {r.contender:28s} {r.median_us:10.1f} {gbps}  {r.median_us / ours:5.2f}×")
    return "\n".join(lines)


def target_checks(rows: list[Row]) -> list[tuple[str, float, float]]:
    """(claim, measured, target) for issue 2's CPU targets whose shapes were run."""
    checks = []

    def ratio(shape, mode, theirs, ours="normfold.rms_norm"):
        return _lookup(rows, shape, mode, theirs) / _lookup(rows, shape, mode, ours)

    shapes = {r.shape for r in rows}
    for shape in [(1024, 384), (4096, 768)]:
        if shape in shapes:
            checks.append((f"fwd {shape}: speed-up over nn.LayerNorm", ratio(shape, "fwd", "nn.LayerNorm"), 1.3))
    if (4096, 4096) in shapes:
        checks.append(("fwd (4096, 4096): speed-up over nn.RMSNorm", ratio((4096, 4096), "fwd", "nn.RMSNorm"), 3.0))
    if (4096, 768) in shapes:
        checks.append(("fwd+bwd (4096, 768): speed-up over nn.RMSNorm",
                       ratio((4096, 768), "fwd+bwd", "nn.RMSNorm"), 4.0))
        checks.append(("fwd+bwd (4096, 768): speed-up over nn.LayerNorm",
                       ratio((4096, 768), "fwd+bwd", "nn.LayerNorm"), 1.0))
    if (8192, 4096) in shapes:
        copy = _lookup(rows, (8192, 4096), "fwd", "copy_")
        ours = _lookup(rows, (8192, 4096), "fwd", "normfold.rms_norm(out=)")
        checks.append(("fwd out= (8192, 4096): fraction of copy_ bandwidth", copy / ours, 0.8))
    return checks


def machine() -> dict[str, str]:
    model = cpu_model()
    load = " ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return {
        "cpu": model,
        "cores": str(os.cpu_count()),
        "torch threads": str(torch.get_num_threads()),
        "cpu capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "fused CPU kernel": "yes" if normfold.ops.cpu_kernel_available() else "no (reference fallback)",
        "load average at start": load,
        # torch's switch for 2 MB pages on large CPU allocations: page faults of fresh outputs dominate
        # every allocating contender at 4096×4096 (≈ 20 ms of 25 for ours) and shrink ~30× with it
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", "unset"),
        "transparent_hugepage": _thp_mode(),
        # normfold's CPU outputs recycle freed blocks (0 = off: every allocating call faults like torch's)
        "normfold CPU output cache": f"{normfold.ops.cpu_cache_info().limit_bytes >> 20} MiB",
    }


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "n/a"
    return next((w.strip("[]") for w in text.split() if w.startswith("[")), text.strip())


def write_results(rows: list[Row], checks, info: dict[str, str], command: str, directory: Path, stem: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{stem}.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["m", "n", "mode", "contender", "median_us", "gbps", "speedup_of_normfold_rms_norm"])
        for r in rows:
            ours = _lookup(rows, r.shape, r.mode, "normfold.rms_norm")
            writer.writerow([*r.shape, r.mode, r.contender, f"{r.median_us:.2f}", f"{r.gbps:.2f}",
                             f"{r.median_us / ours:.3f}"])
    lines = ["# normfold norm benchmark (CPU, float32)", "",
             f"Command: `{command}`", "", "| machine | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in info.items()]
    lines += ["", "Medians of interleaved samples; `speed-up` = contender time / `normfold.rms_norm` time "
              "(> 1: normfold is faster). GB/s counts one read of x and one write of y.", ""]
    if checks:
        lines += ["## Targets (issue 2)", "", "| claim | measured | target | met |", "|---|---|---|---|"]
        lines += [f"| {c} | {v:.2f} | ≥ {t} | {'yes' if v >= t else 'NO'} |" for c, v, t in checks]
        lines.append("")
    lines += ["## All results", "", "| shape | mode | contender | median µs | GB/s | speed-up |", "|---|---|---|---|---|---|"]
    for r in rows:
        ours = _lookup(rows, r.shape, r.mode, "normfold.rms_norm")
        gbps = f"{r.gbps:.1f}" if r.gbps else "-"
        lines.append(f"| {r.shape[0]}×{r.shape[1]} | {r.mode} | {r.contender} | {r.median_us:.1f} | {gbps} | "
                     f"{r.median_us / ours:.2f} |")
    (directory / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few rounds, no torch.compile (smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved samples per contender (default 41, quick 5)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile'd RMSNorm")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="where the CSV and markdown go")
    parser.add_argument("--shapes", nargs="+", metavar="MxN", help="shapes to run, e.g. 4096x4096 (default: all four)")
    parser.add_argument("--stem", default=None, help="result file name (default bench_norm, quick bench_norm_quick)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    if args.shapes:
        try:
            shapes = [tuple(int(d) for d in s.lower().split("x")) for s in args.shapes]
        except ValueError:
            parser.error(f"--shapes takes MxN pairs like 4096x768, got {args.shapes}")
        if any(len(s) != 2 or min(s) < 1 for s in shapes):
            parser.error(f"--shapes takes positive MxN pairs like 4096x768, got {args.shapes}")
    rounds = args.rounds or (5 if args.quick else 41)
    min_sample_s = 0.0005 if args.quick else 0.005
    info = machine()
    print("\n".join(f"{k}: {v}" for k, v in info.items()))
    rows = run(shapes, torch.float32, rounds, min_sample_s, use_compile=not (args.quick or args.no_compile))
    checks = target_checks(rows)
    if checks:
        print("\nTargets (issue 2):")
        for claim, value, target in checks:
            print(f"  {claim:55s} {value:6.2f}  (target ≥ {target})  {'met' if value >= target else 'NOT met'}")
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__), *(argv or sys.argv[1:])])
    stem = args.stem or ("bench_norm_quick" if args.quick else "bench_norm")
    write_results(rows, checks, info, command, args.results_dir, stem)
    print(f"\nwrote {args.results_dir / stem}.csv and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
