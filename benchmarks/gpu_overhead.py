"""Where a norm call's time goes on a GPU: host cost per call, the fwd+bwd kernels, torch.compile.

    bash benchmarks/gpu_overhead.sh             # one CUDA GPU, ~2 minutes
    bash benchmarks/gpu_overhead.sh --dry-run   # the same code on the CPU (timings meaningless)

Three questions the end-to-end table (gpu_e2e.md) raises and cannot answer:

1. Host cost: µs of Python + dispatch + launch per call at a decode-sized input (1, 768) fp16, where
   the kernel itself is ~2 µs, for torch's norms and each layer of normfold's route, down to the raw
   Triton launch. Blocks of calls alternate between contenders; medians over rounds.
2. fwd+bwd through ``normfold.ops.rms_norm`` at (8192, 8192) bf16: the CUDA kernels it runs
   (torch.profiler), next to the bare kernels' and torch's.
3. torch.compile of a 2-layer GPT-2 (768 wide, fp16, batch 1 × 128), original vs folded: graphs,
   graph breaks, recompiles, and the time per call.

Writes ``gpu_overhead.md`` to ``$OUT`` when set, else ``benchmarks/results/``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def host_cost(device: torch.device, calls: int, rounds: int) -> list[tuple[str, float]]:
    """Median µs per call of each contender, blocks of ``calls`` alternating over ``rounds``."""
    import normfold
    from normfold.ops import _library

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    x = torch.randn(1, 768, device=device, dtype=dtype)  # (M, N): one decode token
    r = torch.randn_like(x)
    w = torch.randn(768, device=device, dtype=dtype)
    b = torch.randn(768, device=device, dtype=dtype)
    ln = torch.nn.LayerNorm(768, device=device, dtype=dtype)
    rms = normfold.nn.RMSNorm(768).to(device=device, dtype=dtype)
    contenders = {
        "torch F.layer_norm": lambda: F.layer_norm(x, (768,), w, b, 1e-5),
        "torch F.rms_norm": lambda: F.rms_norm(x, (768,), w, 1e-5),
        "torch nn.LayerNorm module": lambda: ln(x),
        "torch add + F.rms_norm": lambda: F.rms_norm(x + r, (768,), w, 1e-5),
        "normfold.nn.RMSNorm module": lambda: rms(x),
        "normfold.ops.rms_norm": lambda: normfold.ops.rms_norm(x, w, eps=1e-5),
        "normfold.ops.rms_norm(residual=)": lambda: normfold.ops.rms_norm(x, w, eps=1e-5, residual=r),
        "_library.norm (after checks)": lambda: _library.norm(x, w, None, None, 1e-5, 0.0, True),
        "backend.norm_fwd": lambda: _library.select_backend(x).norm_fwd(x, w, None, None, 1e-5, 0.0, True),
        "torch.ops.normfold.norm_fwd (dispatcher)": lambda: torch.ops.normfold.norm_fwd(x, w, None, None, 1e-5,
                                                                                        0.0, True),
        "torch.empty_like x3": lambda: (torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)),
    }
    if device.type == "cuda":
        import triton

        from normfold.ops._triton import kernels, launch

        y, rstd = torch.empty_like(x), torch.empty(1, device=device, dtype=torch.float32)
        plan = launch.plan_launch(768, launch.FWD_MAX_BLOCK)
        grid = (triton.cdiv(1, plan.block_m),)

        def raw_launch():
            kernels.norm_fwd_kernel[grid](x, x, w, x, y, y, rstd, rstd, 1, 768, 1e-5, 0.0, IS_RMS=True,
                                          HAS_RESIDUAL=False, HAS_WEIGHT=True, HAS_BIAS=False, LOOPED=False,
                                          BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, num_warps=plan.num_warps)

        def device_guard():
            with torch.cuda.device(x.device):
                pass

        contenders["raw Triton launch (preallocated)"] = raw_launch
        contenders["torch.cuda.device(x.device) enter+exit"] = device_guard
        contenders["plan_launch"] = lambda: launch.plan_launch(768, launch.FWD_MAX_BLOCK)
        contenders["torch.cuda.get_device_properties"] = lambda: torch.cuda.get_device_properties(x.device)
    with torch.no_grad():
        for fn in contenders.values():
            for _ in range(20):
                fn()
        sync(device)
        per_call: dict[str, list[float]] = {k: [] for k in contenders}
        names = list(contenders)
        for rnd in range(rounds):
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                fn = contenders[name]
                sync(device)
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                sync(device)
                per_call[name].append((time.perf_counter() - start) / calls * 1e6)
    return [(k, statistics.median(v)) for k, v in per_call.items()]


def route_profile(device: torch.device, calls: int) -> str:
    """cProfile of eager ``normfold.ops.rms_norm`` calls (no grad): where the host time goes."""
    import normfold

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    x = torch.randn(1, 768, device=device, dtype=dtype)
    w = torch.randn(768, device=device, dtype=dtype)
    profiler = cProfile.Profile()
    with torch.no_grad():
        normfold.ops.rms_norm(x, w)
        profiler.enable()
        for _ in range(calls):
            normfold.ops.rms_norm(x, w)
        profiler.disable()
    sync(device)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    lines = [ln for ln in text.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if "ncalls" in ln)
    return "\n".join(lines[start:])


def fwd_bwd_kernels(device: torch.device, shape: tuple[int, int]) -> str:
    """The kernels of 3 fwd+bwd steps through the public op, the bare kernels and torch."""
    import normfold
    from torch.profiler import ProfilerActivity, profile

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(shape[1], device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(*shape, device=device, dtype=dtype)
    runs = {
        "normfold.ops.rms_norm": lambda: torch.autograd.grad(normfold.ops.rms_norm(x, w, eps=1e-6), (x, w), dy),
        "torch F.rms_norm": lambda: torch.autograd.grad(F.rms_norm(x, shape[1:], w, 1e-6), (x, w), dy),
    }
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    parts = []
    for name, fn in runs.items():
        for _ in range(3):
            fn()
        sync(device)
        timings = []
        for _ in range(10):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            timings.append((time.perf_counter() - start) * 1e3)
        with profile(activities=activities) as prof:
            for _ in range(3):
                fn()
            sync(device)
        parts.append(f"### {name}: median {statistics.median(timings):.3f} ms per fwd+bwd (wall, synchronized)\n\n"
                     "```\n" + prof.key_averages().table(sort_by=sort, row_limit=14, max_name_column_width=60)
                     + "\n```\n")
    return "\n".join(parts)


def capture_check(device: torch.device) -> str:
    """A CUDA graph captured around norm calls whose shapes never ran eagerly replays what eager computes."""
    import normfold

    if device.type != "cuda":
        return "needs a CUDA device"
    lines = []
    for shape in ((7, 768), (1, 4096), (33, 1000)):
        x = torch.randn(*shape, device=device, dtype=torch.float16)
        r, w = torch.randn_like(x), torch.randn(shape[1], device=device, dtype=torch.float16)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.no_grad(), torch.cuda.graph(graph):
                y, s = normfold.ops.rms_norm(x, w, residual=r)
            graph.replay()
            torch.cuda.synchronize()
            want, _ = normfold.ops.rms_norm(x, w, residual=r)
            err = (y.float() - want.float()).abs().max().item()
            lines.append(f"- {shape}: captured and replayed, max |replay - eager| = {err:.3g}")
        except Exception as exc:
            lines.append(f"- {shape}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    return "\n".join(lines)


def compile_report(device: torch.device, dry_run: bool) -> str:
    """torch.compile of original vs folded 2-layer GPT-2: graphs, breaks, recompiles, ms per call."""
    import gpu_e2e
    from normfold.bench import prepare_contenders

    scale = gpu_e2e.Scale(layers=2, width=64 if dry_run else 768, heads=2 if dry_run else 12, vocab=500,
                          batches=(1,), seqs=(128,), compile_shapes=((1, 128),), rounds=20, warmup=3,
                          budget_s=0.0, compile_reserve_s=0.0)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = gpu_e2e.build("gpt2", scale).eval()
    models, _ = prepare_contenders(model, gpu_e2e.inputs_for(model, 1, 8, "cpu"), control=False)
    kwargs = gpu_e2e.inputs_for(model, 1, 128, device)
    lines = ["| contender | graphs | graph breaks | break reasons | recompiles | eager ms | compiled ms |",
             "|---|---|---|---|---|---|---|"]
    from torch._dynamo.utils import counters

    for name in ("original", "folded", "fused"):
        m = models[name].to(device=device, dtype=dtype)
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            explained = torch._dynamo.explain(m)(**kwargs)
            torch._dynamo.reset()
            counters.clear()
            compiled = torch.compile(m, backend="inductor" if device.type == "cuda" else "eager")
            compiled(**kwargs)
            times = {"eager": [], "compiled": []}
            for _ in range(20):
                for mode, fn in (("eager", m), ("compiled", compiled)):
                    sync(device)
                    start = time.perf_counter()
                    fn(**kwargs)
                    sync(device)
                    times[mode].append((time.perf_counter() - start) * 1e3)
        reasons = "; ".join(sorted({str(b.reason).splitlines()[0][:100] for b in explained.break_reasons})) or "-"
        recompiles = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
        frames = dict(counters["frames"]) if "frames" in counters else {}
        lines.append(f"| {name} | {explained.graph_count} | {explained.graph_break_count} | {reasons} | "
                     f"{recompiles} (frames {frames}) | {statistics.median(times['eager']):.3f} | "
                     f"{statistics.median(times['compiled']):.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, small counts; timings meaningless")
    parser.add_argument("--out", type=Path, help="output folder (default $OUT, else benchmarks/results)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_overhead: no CUDA device (use --dry-run on the CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    out_dir = args.out or Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    hw = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({platform.machine()})"
    sections = [f"# Where a norm call's time goes ({hw})\n",
                f"command: `bash benchmarks/gpu_overhead.sh{' --dry-run' if args.dry_run else ''}`; torch "
                f"{torch.__version__}; Python {platform.python_version()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
                + ("; DRY RUN: timings meaningless" if args.dry_run else "") + "\n"]
    steps = [
        ("Host cost per call at (1, 768) fp16 (µs, median of blocks)",
         lambda: "| call | µs |\n|---|---:|\n" + "\n".join(
             f"| {k} | {v:.1f} |" for k, v in host_cost(device, 50 if args.dry_run else 2000,
                                                          3 if args.dry_run else 7))),
        ("cProfile of eager normfold.ops.rms_norm (no grad), by own time",
         lambda: "```\n" + route_profile(device, 50 if args.dry_run else 2000) + "\n```"),
        ("fwd+bwd kernels", lambda: fwd_bwd_kernels(device, (256, 512) if args.dry_run else (8192, 8192))),
        ("CUDA graph capture of norm calls never run eagerly", lambda: capture_check(device)),
        ("torch.compile, 2-layer GPT-2 at batch 1 × 128", lambda: compile_report(device, args.dry_run)),
    ]
    for title, step in steps:
        step_start = time.perf_counter()
        try:
            body = step()
        except Exception as exc:  # one failed question does not cost the others
            body = f"failed: {type(exc).__name__}: {exc}"
        sections.append(f"## {title}\n\n{body}\n")
        print(f"gpu_overhead: {title}: {time.perf_counter() - step_start:.0f} s", flush=True)
        (out_dir / "gpu_overhead.md").write_text("\n".join(sections))
    print(f"gpu_overhead: wrote {out_dir / 'gpu_overhead.md'} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
