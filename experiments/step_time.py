"""Training step time: nn.LayerNorm vs CBWC + normfold RMSNorm vs normfold RMSNorm, interleaved.

One optimizer step is what ``normfold train`` times (``normfold.train.trainer.train_step``): forward,
backward, global-norm clipping, AdamW. All contenders live in one process and run once per round in
rotating order, so load from other work hits them alike; an A/A control (a second LayerNorm model)
shows this run's noise. Reported: the median step time, and each median over LayerNorm's with a
95% bootstrap interval; "faster"/"slower" only where that interval clears the control's band.
A second table times one norm call (forward + backward at the model's (batch·seq, width)) along each
route a training call could take.

    python experiments/step_time.py                  # widths 144 and 384, ≤ 5 min
    python experiments/step_time.py --widths 144 --budget-s 30
    python experiments/step_time.py --widths 144 --compile       # eager and compiled, step_time_compiled.md
    python experiments/step_time.py --op-widths 768              # the per-call table at 768 too
"""
from __future__ import annotations

import argparse
import copy
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.nn import functional as F

from _common import RESULTS, Stopwatch, command_line, machine, markdown_table, write_csv

from normfold.bench.stats import median_and_iqr, ratio_ci, verdict
from normfold.bench.timing import rotated
from normfold.ops import _library, rms_norm
from normfold.train import resolve_config
from normfold.train.cbwc import Centered, CenteringIndex, project_centering_
from normfold.train.trainer import build_model, make_optimizer, train_step

# the norm_comparison experiment's GPT (4 layers, batch 16 × 128 tokens), at its width and a wider one
SETUP = dict(n_layer=4, block_size=128, batch_size=16)
HEADS = {144: 4, 384: 6}  # head size 36 / 64
BASE = "layernorm"
# What a measurement reads: wall time, or this thread's CPU time (--clock cpu: on a machine shared with other
# jobs, the time the process waits descheduled drops out; everything here runs on this one thread)
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
CLOCK = CLOCKS["wall"]
CONTROL = "layernorm (A/A control)"


def contenders(width: int, compile_too: bool) -> dict[str, tuple]:
    """name -> (model, optimizer, config, CBWC index): LayerNorm, its A/A copy, CBWC, normfold RMSNorm (same
    seed)."""
    made = {}
    for norm in (BASE, "cbwc_rmsnorm", "rmsnorm"):
        config = resolve_config(**SETUP, n_embd=width, n_head=HEADS.get(width, 4), norm=norm)
        model = build_model(config)
        project_centering_(model)  # CBWC as the trainer runs it (a no-op for the other norms)
        made[norm] = (model, make_optimizer(model, config), config, CenteringIndex(model))
    control = copy.deepcopy(made[BASE][0])  # same math, its own memory
    made[CONTROL] = (control, make_optimizer(control, made[BASE][2]), made[BASE][2], CenteringIndex(control))
    if compile_too:
        for norm in (BASE, "cbwc_rmsnorm", "rmsnorm"):
            config = resolve_config(**SETUP, n_embd=width, n_head=HEADS.get(width, 4), norm=norm, compile=True)
            model = build_model(config)
            project_centering_(model)
            made[f"{norm} (compiled)"] = (torch.compile(model), make_optimizer(model, config), config,
                                          CenteringIndex(model))
    return made


def time_steps(made: dict[str, tuple], budget_s: float, max_rounds: int, min_rounds: int) -> dict[str, list[float]]:
    """Seconds per optimizer step of every contender, round by round in rotating order."""
    x = torch.randint(256, (SETUP["batch_size"], SETUP["block_size"]), generator=torch.Generator().manual_seed(0))
    for model, optimizer, config, index in made.values():  # warm-up: allocator, AdamW state, compilation
        for _ in range(2):
            train_step(model, optimizer, [(x, x)], config, index)
    names, times = list(made), {name: [] for name in made}
    start = time.perf_counter()
    for r in range(max_rounds):
        if r >= min_rounds and time.perf_counter() - start > budget_s:
            break
        for name in rotated(names, r):
            model, optimizer, config, index = made[name]
            t0 = CLOCK()
            train_step(model, optimizer, [(x, x)], config, index).item()
            times[name].append(CLOCK() - t0)
    return times


def step_rows(width: int, times: dict[str, list[float]]) -> list[dict]:
    """Median step time and time / LayerNorm's with its 95% bootstrap interval and verdict, per contender."""
    base = times[BASE]
    # ratio_ci gives median(base)/median(other), a speed ratio; invert it for time
    speed = {name: ratio_ci(base, t, resamples=2000, confidence=0.95) for name, t in times.items()}
    rows = []
    for name, t in times.items():
        median, (q1, q3) = median_and_iqr(t)
        point, low, high = speed[name]
        row = SimpleNamespace(ratio_ci={"contender": (low, high), "control": speed[CONTROL][1:]})
        rows.append(dict(width=width, contender=name, rounds=len(t), median_ms=round(median * 1e3, 1),
                         q1_ms=round(q1 * 1e3, 1), q3_ms=round(q3 * 1e3, 1), time_vs_ln=round(1 / point, 3),
                         ci_low=round(1 / high, 3), ci_high=round(1 / low, 3),
                         verdict="—" if name in (BASE, CONTROL) else verdict(row, "contender")))
    return rows


def op_rows(width: int, repeats: int) -> list[dict]:
    """Forward + backward of one norm call at (batch·seq, width), each route a training call could take.

    Gradients are dropped after every call (outside the timing), as ``zero_grad`` does: accumulating
    into the leaves' ``.grad`` would add a read-modify-write of x's size to every route, a cost of
    the benchmark, not of the norm (in a model, dx flows on to the previous layer).
    """
    m = SETUP["batch_size"] * SETUP["block_size"]
    x = torch.randn(m, width, requires_grad=True)
    weight, bias = torch.ones(width, requires_grad=True), torch.zeros(width, requires_grad=True)
    grad = torch.randn(m, width)
    routes = {
        "torch.nn.functional.layer_norm (what nn.LayerNorm runs)": lambda: F.layer_norm(x, (width,), weight, bias, 1e-5),
        "normfold.ops.rms_norm (eager C++ route, what training runs)": lambda: rms_norm(x, weight, bias, 1e-5),
        "torch.ops.normfold.norm_fwd (the custom op, as traced code calls it)":
            lambda: _library.norm_fwd(x, weight, bias, None, 1e-5, 0.0, True)[0],
        "torch.nn.functional.rms_norm + bias (plain torch)": lambda: F.rms_norm(x, (width,), weight, 1e-5) + bias,
    }
    times = {name: [] for name in routes}

    def run(call) -> float:
        t0 = CLOCK()
        call().backward(grad)
        elapsed = CLOCK() - t0
        x.grad = weight.grad = bias.grad = None
        return elapsed

    for call in routes.values():
        run(call)
    for r in range(repeats):
        for name in rotated(list(routes), r):
            times[name].append(run(routes[name]))
    ln = times[next(iter(routes))]
    rows = []
    for name, t in times.items():
        point, low, high = ratio_ci(ln, t, resamples=2000, confidence=0.95)  # median(ln) / median(t)
        rows.append(dict(width=width, route=name, repeats=repeats, median_us=round(median_and_iqr(t)[0] * 1e6),
                         time_vs_ln=round(1 / point, 2), ci_low=round(1 / high, 2), ci_high=round(1 / low, 2)))
    return rows


def centering_row(width: int, repeats: int, ln_step_s: float) -> dict:
    """What CBWC adds to a step as the trainer runs it (``cbwc.project_centering_``): the gradients and then the
    tensors of the converted Parameters projected (g ↦ P·g, W ↦ P·W), and the tied table's V = P·W (one autograd
    node, ``cbwc.centered_once``); median of ``repeats``, also as a share of LayerNorm's step."""
    config = resolve_config(**SETUP, n_embd=width, n_head=HEADS.get(width, 4), norm="cbwc_rmsnorm")
    model = build_model(config)
    converted = project_centering_(model)
    kept = sum(isinstance(m, Centered) for m in model.modules())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    index = CenteringIndex(model)  # found once, as the trainer does
    times = []
    for _ in range(repeats):
        t0 = CLOCK()
        index.center_gradients_()
        index.center_parameters_()
        with index.centered_once():
            pass
        times.append(CLOCK() - t0)
    added = median_and_iqr(times)[0]
    return dict(width=width, centered_tensors=converted + kept, projected=converted, added_ms=round(added * 1e3, 2),
                share_of_ln_step=round(added / ln_step_s, 4))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="144,384", help="comma-separated model widths")
    parser.add_argument("--budget-s", type=float, default=100.0, help="timing seconds per width (after min rounds)")
    parser.add_argument("--min-rounds", type=int, default=8)
    parser.add_argument("--max-rounds", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (1: on a shared machine two threads wait on each other)")
    parser.add_argument("--compile", action="store_true",
                        help="also time the three models torch.compiled (Inductor; minutes to compile); "
                             "writes step_time_compiled.*")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="time read: wall, or cpu (this thread's CPU time; needs --threads 1)")
    parser.add_argument("--op-widths", default="", help="widths timed per norm call besides --widths (e.g. 768)")
    parser.add_argument("--op-repeats", type=int, default=200, help="interleaved repetitions per norm call route")
    args = parser.parse_args(argv)
    global CLOCK
    CLOCK = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",") if w]
    clock = Stopwatch()
    steps, ops, centering = [], [], []
    for width in sorted(set(widths) | {int(w) for w in args.op_widths.split(",") if w}):
        ops += op_rows(width, repeats=args.op_repeats)
    for width in widths:
        times = time_steps(contenders(width, args.compile), args.budget_s, args.max_rounds, args.min_rounds)
        steps += step_rows(width, times)
        centering.append(centering_row(width, 100, median_and_iqr(times[BASE])[0]))
        print(f"[{clock}] width {width}: " + ", ".join(f"{r['contender']} {r['median_ms']} ms ({r['time_vs_ln']}×)"
                                                     for r in steps if r["width"] == width), flush=True)
    name = "step_time_compiled" if args.compile else "step_time"
    write_csv(args.out / f"{name}.csv", steps)
    write_csv(args.out / f"{name}_ops.csv", ops)
    (args.out / f"{name}.md").write_text(report(steps, ops, centering, clock))
    print(f"[{clock}] wrote {args.out / f'{name}.md'}")


def report(steps: list[dict], ops: list[dict], centering: list[dict], clock: Stopwatch) -> str:
    step_table = markdown_table(
        ["width", "contender", "rounds", "median step ms (q1–q3)", "time vs LN", "95% CI", "verdict"],
        [[r["width"], r["contender"], r["rounds"], f"{r['median_ms']} ({r['q1_ms']}–{r['q3_ms']})",
          f"{r['time_vs_ln']:.3f}×", f"{r['ci_low']:.3f}–{r['ci_high']:.3f}", r["verdict"]] for r in steps])
    op_table = markdown_table(["width", "route", "median µs", "time vs layer_norm", "95% CI"],
                              [[r["width"], r["route"], r["median_us"], f"{r['time_vs_ln']:.2f}×",
                                f"{r['ci_low']:.2f}–{r['ci_high']:.2f}"] for r in ops])
    control = {r["width"]: (r["ci_low"], r["ci_high"]) for r in steps if r["contender"] == CONTROL}
    lines = [
        "# Training step time: LayerNorm vs CBWC + normfold RMSNorm vs normfold RMSNorm", "",
        f"One optimizer step (forward, backward, clipping, AdamW) of the {SETUP['n_layer']}-layer GPT at batch "
        f"{SETUP['batch_size']} × {SETUP['block_size']} tokens, per width. Contenders interleaved in one process "
        "(rotating order); the A/A control is a copy of the LayerNorm model. A verdict says faster/slower only where "
        "the 95% bootstrap interval of the ratio clears the control's band (widened to 1). Times are "
        + ("this thread's CPU time (`--clock cpu`: time spent descheduled by other jobs drops out)."
           if CLOCK is CLOCKS["cpu"] else "wall time."), "",
        step_table, "",
        "A/A control's interval per width (this run's noise): "
        + ", ".join(f"{w}: {lo:.3f}–{hi:.3f}" for w, (lo, hi) in control.items()) + ".", "",
        "## What CBWC's centering adds to a step", "",
        "As the trainer runs CBWC (`cbwc.project_centering_`): the centered tensors are plain Parameters held at "
        "V = P·W; each step projects their gradients (g ↦ P·g, before clipping) and the tensors after AdamW "
        "(W ↦ P·W), and computes the tied table's V = P·W once (its lookup reads V, the head the free W). "
        "Median of 100 repetitions.", "",
        markdown_table(["width", "centered tensors", "of them projected", "added ms per step",
                        "share of LayerNorm's step"],
                       [[r["width"], r["centered_tensors"], r["projected"], r["added_ms"],
                         f"{r['share_of_ln_step']:.1%}"] for r in centering]), "",
        "## One norm call, forward + backward, by route", "",
        f"At ({SETUP['batch_size'] * SETUP['block_size']}, width), fp32, weight and bias unless said, "
        f"{ops[0]['repeats']} repetitions in rotating order, median; "
        "gradients dropped after each call (as zero_grad does), so no route pays an accumulation into .grad. Eager "
        "training calls take the second route (one C++ call that records the kernels' backward with the C++ "
        "autograd engine). The CI is the 95% bootstrap interval of the ratio of medians.", "",
        op_table, "",
        f"Command: `{command_line()}` (wall time {clock}).",
        f"Machine: {machine()}. {_load_note()}Read the ratios with the control's interval, not the absolute "
        "times.", "",
    ]
    return "\n".join(lines)


def _load_note() -> str:
    """Whether other jobs shared the machine: a load average above the threads this run keeps busy."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > torch.get_num_threads() + 0.5:
        return "Other jobs shared the machine while this ran (load average above this run's threads). "
    return ""


if __name__ == "__main__":
    main()
