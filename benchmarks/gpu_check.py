"""GPU check of normfold's Triton norm kernels: correctness against the fp64 reference, then
speed against torch's native kernels, a torch.compile'd RMSNorm and a device-to-device copy.

    bash benchmarks/gpu_check.sh              # one CUDA GPU, under 4 minutes
    python benchmarks/gpu_check.py --dry-run  # the same code path on the CPU (Triton's
                                              # interpreter), tiny shapes, a few seconds

Correctness: every kernel (RMS/LN × weight, bias, residual, offset × fp32/fp16/bf16 × hidden
256…131072, one-block and looped paths) forward and backward against ``normfold.ops.reference``
in fp64, with the rule of ``normfold.ops._triton.selfcheck``: error ≤ 2 × torch's own error in
that dtype + atol. Speed: contenders interleaved rep by rep in one process, CUDA events around
each call, medians; outputs preallocated where the op takes ``out=``; warm-up (and compilation)
outside the timed region. Bandwidth counts the bytes the op must move (forward: read x, write y;
forward+backward: that plus read dy, read x, write dx) and is compared with a same-run
``copy_`` into a preallocated tensor.

Writes ``gpu_check.csv`` and ``gpu_check.md`` to ``$OUT`` when set (how files come back from a
lent GPU machine), else to ``benchmarks/results/``; ``--out`` overrides both. Exit status 1
when any correctness check fails.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable




@dataclasses.dataclass(frozen=True)
class Scale:
    """What one run covers: the full GPU check, or the dry run's few tiny shapes."""

    hiddens: tuple[int, ...]  # checked with the timed options, and timed
    odd_hiddens: tuple[int, ...]  # not powers of two: checked with every option on (masks, chunk tails)
    many_rows: tuple[int, int]  # a shape whose backward spreads over several programs (partial dw sums)
    dtype_names: tuple[str, ...]  # checked and timed, in this order (bf16 first: the headline target)
    tensor_bytes: int  # each timed (M, N) tensor: rows = tensor_bytes / (N · itemsize)
    reps: int
    warmup: int


GPU = Scale(hiddens=(256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072),
            odd_hiddens=(1023, 5000, 20000, 100000), many_rows=(3000, 256),
            dtype_names=("bfloat16", "float16", "float32"), tensor_bytes=128 * 2**20, reps=30, warmup=3)
# one-block and looped (forward and backward) paths, one half and one full precision
DRY_RUN = Scale(hiddens=(64, 20000), odd_hiddens=(300,), many_rows=(40, 64),
                dtype_names=("bfloat16", "float32"), tensor_bytes=16 * 2**10, reps=1, warmup=1)
EPS = 1e-6


@dataclasses.dataclass
class Timing:
    dtype: str
    hidden: int
    rows: int
    phase: str  # "fwd" or "fwd+bwd"
    contender: str
    median_us: float
    tensor_bytes: int  # one (M, N) tensor
    tensors_moved: int  # (M, N) tensors the op must read or write: fwd 2, add+norm 4, fwd+bwd 5
    copy_us: float  # same-run copy_ of one (M, N) tensor (reads one, writes one)
    baseline: str  # the torch contender this one is compared with ("" for baselines)
    baseline_us: float

    @property
    def gbps(self) -> float:
        return self.tensors_moved * self.tensor_bytes / (self.median_us * 1e-6) / 1e9

    @property
    def pct_of_copy(self) -> float:
        return 100 * (self.tensors_moved / self.median_us) / (2 / self.copy_us)

    @property
    def speedup(self) -> float | None:
        return self.baseline_us / self.median_us if self.baseline else None


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes")
    p.add_argument("--out", type=Path, default=None, help="result folder (default: $OUT, else benchmarks/results)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions a contender (default 30; dry run 1)")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="stop starting new timing configurations after this many seconds (default 200)")
    p.add_argument("--compile-dtypes", default="bfloat16",
                   help="comma-separated dtypes that get the torch.compile'd RMSNorm contender ('' for none); "
                        "each hidden size compiles twice, so all three dtypes take minutes")
    p.add_argument("--skip-timing", action="store_true", help="correctness checks only")
    return p.parse_args(argv)


# ---------------------------------------------------------------- correctness

def correctness_checks(device: str, scale: Scale) -> tuple[list[dict], int]:
    """Run every kernel configuration against the fp64 oracle; returns (rows, failures)."""
    import torch

    from normfold.ops._triton import selfcheck
    from normfold.ops._triton.selfcheck import Case

    plain = [Case(is_rms=True), Case(is_rms=False, bias=True)]  # the timed configurations
    full = [Case(is_rms=True, weight=False), Case(is_rms=True, bias=True, residual=True, offset=1.0),
            Case(is_rms=False, bias=True, residual=True, offset=0.5)]
    plan: list[tuple[Case, tuple[int, int], torch.dtype, torch.dtype | None]] = []
    for dtype in (getattr(torch, name) for name in scale.dtype_names):
        plan += [(case, (3, n), dtype, None) for n in scale.hiddens for case in plain]
        plan += [(case, (3, n), dtype, None) for n in scale.odd_hiddens for case in full]
    plan += [(case, scale.many_rows, torch.bfloat16, None) for case in full[1:]]
    plan.append((full[1], (5, scale.odd_hiddens[0]), torch.bfloat16, torch.float32))  # bf16 x, fp32 weight

    rows, failures = [], 0
    for case, shape, dtype, weight_dtype in plan:
        inp = selfcheck.make_inputs(case, shape, dtype, device, weight_dtype=weight_dtype)
        try:
            result = "; ".join(map(str, selfcheck.compare(case, inp, selfcheck.run_kernels(case, inp)))) or "ok"
        except Exception as exc:  # a kernel that fails to compile or launch is a failed check, not the end
            result = f"raised {type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        failures += result != "ok"
        rows.append({"case": str(case), "shape": shape, "dtype": _dtype_name(dtype),
                     "weight_dtype": _dtype_name(weight_dtype or dtype), "result": result})
        if result != "ok":
            print(f"  FAIL {case} {shape} {_dtype_name(dtype)}: {rows[-1]['result']}", flush=True)
    return rows, failures


# ---------------------------------------------------------------- timing

def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


class Timer:
    """Time one call: CUDA events on a GPU (device time), perf_counter on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._pending: list = []

    def __call__(self, fn: Callable[[], object], sink: list) -> None:
        import torch

        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            self._pending.append((start, end, sink))
        else:
            t0 = time.perf_counter()
            fn()
            sink.append((time.perf_counter() - t0) * 1e6)

    def collect(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            for start, end, sink in self._pending:
                sink.append(start.elapsed_time(end) * 1e3)
            self._pending.clear()


def interleaved_medians(contenders: dict[str, Callable[[], object]], reps: int, warmup: int,
                        timer: Timer, failed: list[str]) -> dict[str, float]:
    """Median microseconds a call; contenders alternate within every repetition (ABCABC…).

    A contender that raises during warm-up (compilation included) is dropped and named in
    ``failed``; the others are still timed.
    """
    for name, fn in list(contenders.items()):
        try:
            for _ in range(warmup):
                fn()
        except Exception as exc:
            failed.append(f"{name}: {type(exc).__name__}: {str(exc).strip()[:300]}")
            print(f"  dropped {failed[-1]}", flush=True)
            del contenders[name]
    timer.collect()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(reps):
        for name, fn in contenders.items():
            timer(fn, samples[name])
    timer.collect()
    return {name: statistics.median(s) for name, s in samples.items()}


def _rms_norm_eager(x, w):
    """RMSNorm as Hugging Face writes it (fp32 statistics), the function torch.compile fuses."""
    import torch

    xf = x.float()
    return w * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS)).to(x.dtype)


def time_config(dtype, hidden: int, device: str, scale: Scale, timer: Timer, compiled,
                public_api: bool, failed: list[str]) -> list[Timing]:
    """All contenders at one (dtype, hidden); forward and forward+backward."""
    import torch
    import torch.nn.functional as F

    import normfold
    from normfold.ops._triton import norm_bwd, norm_fwd

    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = max(1, scale.tensor_bytes // (hidden * itemsize))
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    x, r, dy = randn(rows, hidden), randn(rows, hidden), randn(rows, hidden)
    w, b = 1 + 0.1 * randn(hidden), 0.1 * randn(hidden)
    y, s_out, copy_dst = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    n = (hidden,)
    tensor_bytes_exact = rows * hidden * itemsize
    _, _, _, rstd_rms = norm_fwd(x, w, None, None, EPS, 0.0, True)
    _, _, mean_ln, rstd_ln = norm_fwd(x, w, b, None, EPS, 0.0, False)

    fwd: dict[str, Callable[[], object]] = {
        "copy_": lambda: copy_dst.copy_(x),
        "normfold rms": lambda: norm_fwd(x, w, None, None, EPS, 0.0, True, out=y),
        "torch rms_norm": lambda: F.rms_norm(x, n, w, EPS),
        "normfold ln": lambda: norm_fwd(x, w, b, None, EPS, 0.0, False, out=y),
        "torch layer_norm": lambda: F.layer_norm(x, n, w, b, EPS),
        "normfold add+rms": lambda: norm_fwd(x, w, None, r, EPS, 0.0, True, out=y, residual_out=s_out),
        "torch add+rms_norm": lambda: F.rms_norm(torch.add(x, r, out=s_out), n, w, EPS),
    }
    if compiled is not None:
        fwd["compiled rms"] = lambda: compiled(x, w)
    if public_api:
        fwd["normfold.ops.rms_norm"] = lambda: normfold.ops.rms_norm(x, w, eps=EPS, out=y)

    xg, wg, bg = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()

    def grads(out, *inputs):
        return torch.autograd.grad(out, inputs, dy)

    bwd: dict[str, Callable[[], object]] = {
        "copy_": lambda: copy_dst.copy_(x),
        # kernels only: the forward's y is written into a preallocated buffer
        "normfold rms": lambda: (norm_fwd(x, w, None, None, EPS, 0.0, True, out=y),
                                 norm_bwd(dy, None, x, w, None, rstd_rms, 0.0, True, False)),
        "torch rms_norm": lambda: grads(F.rms_norm(xg, n, wg, EPS), xg, wg),
        "normfold ln": lambda: (norm_fwd(x, w, b, None, EPS, 0.0, False, out=y),
                                norm_bwd(dy, None, x, w, mean_ln, rstd_ln, 0.0, False, True)),
        "torch layer_norm": lambda: grads(F.layer_norm(xg, n, wg, bg, EPS), xg, wg, bg),
    }
    if compiled is not None:
        bwd["compiled rms"] = lambda: grads(compiled(xg, wg), xg, wg)
    if public_api:
        bwd["normfold.ops.rms_norm"] = lambda: grads(normfold.ops.rms_norm(xg, wg, eps=EPS), xg, wg)

    baseline_of = {"normfold rms": "torch rms_norm", "compiled rms": "torch rms_norm",
                   "normfold.ops.rms_norm": "torch rms_norm", "normfold ln": "torch layer_norm",
                   "normfold add+rms": "torch add+rms_norm"}
    results = []
    for phase, contenders, tensors_moved in (("fwd", fwd, 2), ("fwd+bwd", bwd, 5)):
        med = interleaved_medians(contenders, scale.reps, scale.warmup, timer, failed)
        for name, us in med.items():
            if name == "copy_":
                continue
            moved = 4 if "add+" in name else tensors_moved
            base = baseline_of.get(name, "") if baseline_of.get(name) in med else ""
            results.append(Timing(_dtype_name(dtype), hidden, rows, phase, name, us, tensor_bytes_exact, moved,
                                  med["copy_"], base, med.get(base, float("nan"))))
    return results


# ---------------------------------------------------------------- report

def interpreter_problem() -> str | None:
    """Why Triton's CPU interpreter cannot run normfold's looped kernels here (None when it can).

    Triton 3.6's interpreter turns a runtime loop bound (``range(0, N, BLOCK)``) into a Python int
    with ``int(array_of_shape_(1,))``, which NumPy >= 2.4 refuses: every looped kernel then fails
    in a dry run although the compiled GPU kernels are fine. Probed with one tiny kernel.
    """
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _runtime_bound_loop(X, N, BLOCK: tl.constexpr):
        for start in range(0, N, BLOCK):
            tl.store(X + start + tl.arange(0, BLOCK), tl.zeros([BLOCK], dtype=tl.float32))

    try:
        _runtime_bound_loop[(1,)](torch.ones(4), 4, BLOCK=2)
    except Exception as exc:  # InterpreterError wraps the NumPy TypeError
        import numpy

        return (f"the Triton {triton.__version__} interpreter cannot run a loop with a runtime bound under NumPy "
                f"{numpy.__version__} ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:120]}); "
                "for a dry run on this stack install numpy<2.4 (the GPU run does not use the interpreter)")
    return None


def _environment(device: str, dry_run: bool) -> dict[str, str]:
    import torch
    import triton

    gpu = torch.cuda.get_device_name(0) if device == "cuda" else f"CPU ({platform.processor() or platform.machine()}), Triton interpreter"
    return {
        "device": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "mode": ("dry run: Triton interpreter on the CPU, tiny shapes; the timings and targets are meaningless"
                 if dry_run else "GPU run"),
    }


def _targets(timings: list[Timing]) -> list[str]:
    """The issue's GPU targets, evaluated on this run."""
    lines = []
    fwd_bf16 = [t for t in timings if t.phase == "fwd" and t.dtype == "bfloat16" and t.contender == "normfold rms"]
    big = [t for t in fwd_bf16 if t.hidden >= 4096]
    if big:
        worst = min(big, key=lambda t: t.pct_of_copy)
        verdict = "PASS" if worst.pct_of_copy >= 85 else "FAIL"
        lines.append(f"{verdict}: bf16 forward RMSNorm ≥ 85% of copy bandwidth at hidden ≥ 4096 "
                     f"(worst {worst.pct_of_copy:.1f}% at hidden {worst.hidden})")
    for phase in ("fwd", "fwd+bwd"):
        for dtype in dict.fromkeys(t.dtype for t in timings):
            ours = [t for t in timings if t.phase == phase and t.dtype == dtype and t.contender == "normfold rms"
                    and t.speedup is not None]
            if ours:
                worst = min(ours, key=lambda t: t.speedup)
                verdict = "PASS" if worst.speedup > 1 else "FAIL"
                lines.append(f"{verdict}: {dtype} {phase} RMSNorm faster than torch rms_norm at every hidden size "
                             f"(worst {worst.speedup:.2f}× at hidden {worst.hidden})")
    return lines


def write_report(out_dir: Path, env: dict, checks: list[dict], failures: int, timings: list[Timing],
                 skipped: list[str]) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out_dir / "gpu_check.csv", out_dir / "gpu_check.md"
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["dtype", "hidden", "rows", "phase", "contender", "median_us", "gb_per_s", "pct_of_copy",
                         "baseline", "speedup_vs_baseline"])
        for t in timings:
            writer.writerow([t.dtype, t.hidden, t.rows, t.phase, t.contender, f"{t.median_us:.2f}", f"{t.gbps:.1f}",
                             f"{t.pct_of_copy:.1f}", t.baseline, "" if t.speedup is None else f"{t.speedup:.3f}"])

    lines = ["# normfold GPU check", ""]
    lines += [f"- {k}: `{v}`" for k, v in env.items()]
    lines += ["", "## Correctness (kernel vs fp64 reference; error ≤ 2 × torch's own error in the dtype + atol)", "",
              f"{len(checks) - failures} of {len(checks)} configurations pass."]
    lines += [f"- FAIL {c['case']} {c['shape']} {c['dtype']} (weight {c['weight_dtype']}): {c['result']}"
              for c in checks if c["result"] != "ok"]
    if timings:
        lines += ["", "## Targets", ""] + [f"- {line}" for line in _targets(timings)]
        lines += ["", "## Speed", "",
                  "GB/s counts the bytes the op must move (fwd: x read + y written; fwd+bwd: + dy, x read, dx "
                  "written; add+: x, residual read, y, s written); % is of a same-run `copy_`; × is the speedup "
                  "over the torch op named in the baseline column. Medians of interleaved repetitions."]
        for phase in ("fwd", "fwd+bwd"):
            for dtype in dict.fromkeys(t.dtype for t in timings):
                group = [t for t in timings if t.phase == phase and t.dtype == dtype]
                if not group:
                    continue
                names = list(dict.fromkeys(t.contender for t in group))
                lines += ["", f"### {phase}, {dtype}", "",
                          "| hidden | rows | " + " | ".join(names) + " |",
                          "|---:|---:|" + "---:|" * len(names)]
                for hidden in dict.fromkeys(t.hidden for t in group):
                    cells = []
                    for name in names:
                        t = next((t for t in group if t.hidden == hidden and t.contender == name), None)
                        if t is None:
                            cells.append("")
                            continue
                        cell = f"{t.gbps:.0f} GB/s ({t.pct_of_copy:.0f}%)"
                        if t.speedup is not None:
                            cell += f" {t.speedup:.2f}×"
                        cells.append(cell)
                    rows = next(t.rows for t in group if t.hidden == hidden)
                    lines.append(f"| {hidden} | {rows} | " + " | ".join(cells) + " |")
    if skipped:
        lines += ["", "## Skipped", ""] + [f"- {s}" for s in skipped]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def _print_timings(timings: list[Timing]) -> None:
    for t in timings:
        speed = "" if t.speedup is None else f"  {t.speedup:5.2f}× vs {t.baseline}"
        print(f"  {t.phase:7s} {t.dtype:8s} N={t.hidden:6d} M={t.rows:7d} {t.contender:22s} "
              f"{t.median_us:9.1f} us {t.gbps:7.0f} GB/s {t.pct_of_copy:5.1f}% of copy{speed}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    started = time.monotonic()
    if args.dry_run:
        device = "cpu"
        problem = interpreter_problem()
        if problem:
            print(f"gpu_check: {problem}", file=sys.stderr)
            return 2
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        print("gpu_check: no CUDA device (use --dry-run to exercise the script on the CPU)", file=sys.stderr)
        return 2
    out_dir = args.out or Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    env = _environment(device, args.dry_run)
    print("\n".join(f"{k}: {v}" for k, v in env.items()), flush=True)

    scale = DRY_RUN if args.dry_run else GPU
    if args.reps:
        scale = dataclasses.replace(scale, reps=args.reps)
    print("correctness ...", flush=True)
    checks, failures = correctness_checks(device, scale)
    print(f"correctness: {len(checks) - failures}/{len(checks)} configurations pass "
          f"({time.monotonic() - started:.0f} s)", flush=True)

    timings: list[Timing] = []
    skipped: list[str] = []
    if not args.skip_timing:
        timer = Timer(device == "cuda")
        compile_dtypes = {d for d in args.compile_dtypes.split(",") if d} if device == "cuda" else set()
        compiled = None
        if compile_dtypes:
            for knob in ("recompile_limit", "cache_size_limit"):  # one graph a hidden size, forward and backward
                if hasattr(torch._dynamo.config, knob):
                    setattr(torch._dynamo.config, knob, 256)
            compiled = torch.compile(_rms_norm_eager, dynamic=False)
        for dtype_name in scale.dtype_names:
            for hidden in scale.hiddens:
                if time.monotonic() - started > args.budget_s:
                    skipped.append(f"{dtype_name} hidden {hidden}: over the {args.budget_s:.0f} s budget")
                    continue
                # compiling takes seconds a hidden size: only in the first 60% of the budget
                use_compiled = None
                if dtype_name in compile_dtypes:
                    if time.monotonic() - started < 0.6 * args.budget_s:
                        use_compiled = compiled
                    else:
                        skipped.append(f"compiled rms, {dtype_name} hidden {hidden}: past 60% of the budget")
                failed: list[str] = []
                result = time_config(getattr(torch, dtype_name), hidden, device, scale, timer, use_compiled,
                                     public_api=device == "cuda", failed=failed)
                skipped += [f"{dtype_name} hidden {hidden}, {f}" for f in failed]
                _print_timings(result)
                timings += result
                if device == "cuda":
                    torch.cuda.empty_cache()
        if device != "cuda":
            skipped.append("torch.compile'd RMSNorm and the public autograd API: GPU runs only")
        for line in _targets(timings):
            print(line, flush=True)

    csv_path, md_path = write_report(out_dir, env, checks, failures, timings, skipped)
    print(f"wrote {csv_path} and {md_path} ({time.monotonic() - started:.0f} s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
