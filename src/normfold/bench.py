"""End-to-end speed: the original model against its folded and folded+fused versions, side by side.

    rows = bench_model(model, BenchConfig(batches=(1, 8), seqs=(1, 128)))
    normfold bench [MODEL_DIR] [--quick] [--compile] [--csv PATH]

Contenders run interleaved in one process (original, folded, fused, original, ...; the order
rotates every round) so that load drifts hit all of them alike. Each row reports per-contender
medians with their interquartile range, and the speed ratio original/contender (> 1 = faster)
with a bootstrap confidence interval. ``seq = 1`` is a decode step: one token after a prefill of
``BenchConfig.prefill`` tokens with the KV cache (the cache is cropped back after every step, outside
the timed region). The profiler pass reports the forward time spent in the ops norm calls run
(LayerNorm / RMSNorm module calls and fused add+norm calls) plus residual adds: an ``aten::add``
whose result has the size and row length of a tensor a norm normalized, so an activation's
internal adds (GPT-2's tanh GELU has two per layer) and attention scores plus their mask (whose
last dimension equals the hidden size when the sequence length does) do not count.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace

import torch
from torch import nn

CONTENDERS = ("original", "control", "folded", "fused")
_NORM_LABEL = "normfold_bench::norm"
_FORWARD_LABEL = "normfold_bench::forward"



def cpu_model() -> str:
    """The processor's marketing name (Linux /proc/cpuinfo), else what ``platform`` knows."""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"

@dataclass(frozen=True)
class BenchConfig:
    """What to measure; every default says why."""

    batches: tuple[int, ...] = (1, 8)          # batch 1 is where norms matter most, 8 a small server batch
    seqs: tuple[int, ...] = (1, 128, 1024)     # 1 = a decode step with KV cache; 128 / 1024 = prefill
    prefill: int = 128                         # tokens in the cache before a timed decode step
    rounds: int = 30                           # interleaved rounds; each contender runs once per round
    shape_budget_s: float = 60.0               # timing seconds per shape at most: slow shapes (seq 1024,
                                               # batch 8) get fewer rounds, so a full grid fits in an hour
    min_rounds: int = 8                        # ... but never fewer than this (a CI needs several pairs)
    warmup: int = 3                            # untimed calls per contender and shape (caches, allocator, compile)
    min_round_s: float = 0.0                   # repeat a call inside one timing until this long (tiny models)
    compile: bool = False                      # also torch.compile every contender (default inductor backend)
    control: bool = True                       # time a deep copy of the original too (A/A): same math, its
                                               # own memory; its ratio shows this run's noise, which the
                                               # bootstrap CI (sampling noise only) does not
    profile: bool = True                       # torch.profiler pass for the norm + add share
    profile_iters: int = 9                     # profiled forwards per contender and shape (median taken)
    bootstrap: int = 2000                      # resamples for the ratio's confidence interval
    confidence: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batches", "seqs"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be positive ints, got {values!r}")
        for name in ("rounds", "min_rounds", "prefill", "bootstrap"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shape_budget_s <= 0:
            raise ValueError(f"shape_budget_s must be > 0, got {self.shape_budget_s}")
        if self.warmup < 0 or self.profile_iters < 1:
            raise ValueError(f"warmup must be >= 0 and profile_iters >= 1, got {self.warmup}, {self.profile_iters}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence must be in (0, 1), got {self.confidence}")


QUICK = BenchConfig(batches=(1,), seqs=(1, 16), prefill=8, rounds=5, warmup=1, bootstrap=200, profile_iters=2)


@dataclass
class BenchRow:
    """One (model, shape, mode) measurement; times in milliseconds."""

    model: str
    mode: str                 # "eager" or "compile"
    batch: int
    seq: int                  # 1 = one decode step after ``prefill`` tokens
    kind: str                 # "decode", "prefill" or "image"
    median_ms: dict = field(default_factory=dict)    # contender -> median
    iqr_ms: dict = field(default_factory=dict)       # contender -> (q1, q3)
    ratio: dict = field(default_factory=dict)        # contender -> original median / contender median
    ratio_ci: dict = field(default_factory=dict)     # contender -> (low, high)
    norm_share: dict = field(default_factory=dict)   # contender -> fraction of forward time in norms + residual adds
    norm_ms: dict = field(default_factory=dict)      # contender -> ms per forward in norms + residual adds

    def flat(self) -> dict:
        """One CSV row: scalar columns per contender."""
        out = {"model": self.model, "mode": self.mode, "batch": self.batch, "seq": self.seq, "kind": self.kind}
        for c in self.median_ms:
            out[f"{c}_median_ms"] = round(self.median_ms[c], 4)
            out[f"{c}_q1_ms"], out[f"{c}_q3_ms"] = (round(v, 4) for v in self.iqr_ms[c])
            if c != "original":
                out[f"{c}_speedup"] = round(self.ratio[c], 4)
                out[f"{c}_ci_low"], out[f"{c}_ci_high"] = (round(v, 4) for v in self.ratio_ci[c])
            if c == "fused" and "fused" in self.ratio_ci:
                out["fused_verdict"] = verdict(self)
            if c in self.norm_share:
                out[f"{c}_norm_add_share"] = round(self.norm_share[c], 4)
                out[f"{c}_norm_add_ms"] = round(self.norm_ms[c], 4)
        return out


# ------------------------------------------------------------------------------------ contenders

def prepare_contenders(model: nn.Module, example_inputs, *, control: bool = True) -> tuple[dict[str, nn.Module], dict]:
    """``{"original", "control", "folded", "fused"}`` models (eval mode) and what fold / fuse reported.

    ``control`` is a deep copy of the original (left out with ``control=False``).
    """
    from .fold import fold
    from .fuse import fuse_residual_norms

    model = model.eval()
    folded, fold_report = fold(model, example_inputs)
    fused, fuse_report = fuse_residual_norms(folded, example_inputs)
    info = {"num_norms": fold_report.num_norms, "num_rms": sum(e.foldable for e in fold_report.norms),
            "num_fused": len(fuse_report.fused)}
    contenders = {"original": model}
    if control:
        contenders["control"] = copy.deepcopy(model).eval()
    contenders.update(folded=folded.eval(), fused=fused.eval())
    return contenders, info


def _cache_argument(model: nn.Module) -> str | None:
    """The forward's KV-cache keyword (transformers 5 says ``cache``, 4 ``past_key_values``), None if none."""
    params = _forward_params(model)
    can_generate = getattr(model, "can_generate", None)
    if "input_ids" not in params or not (callable(can_generate) and can_generate()):
        return None  # encoders (BERT) take a cache argument for cross-attention but return none
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def _forward_params(model: nn.Module):
    import inspect

    return inspect.signature(type(model).forward).parameters


def _workloads(model: nn.Module, config: BenchConfig):
    """(batch, seq, kind, make_call) per shape; ``make_call(m)`` returns ``(call, reset)`` for contender m."""
    from .hf.io import example_inputs_for

    params = _forward_params(model)
    if "pixel_values" in params:
        for b in config.batches:
            inputs = example_inputs_for(model, batch=b, seed=config.seed)
            yield b, inputs["pixel_values"].shape[-1], "image", _plain_call(inputs)
        return
    causal = _cache_argument(model) is not None
    for b in config.batches:
        seen = set()  # lengths past the model's position limit are clipped to it: measure each once
        for t in config.seqs:
            if t == 1:
                if causal:
                    yield b, 1, "decode", _decode_call(model, b, config)
                continue
            inputs = example_inputs_for(model, batch=b, seq=t, seed=config.seed)
            length = inputs["input_ids"].shape[-1]
            if length not in seen:
                seen.add(length)
                yield b, length, "prefill", _plain_call(inputs)


def _plain_call(inputs: dict):
    def make(m: nn.Module):
        # A prefill as generation runs it: logits for the last position only, where the model offers
        # that (transformers' ``logits_to_keep``); otherwise the vocabulary projection of every
        # position (50k × 768 per token for GPT-2) would be most of what is timed.
        kwargs = dict(inputs, logits_to_keep=1) if "logits_to_keep" in _forward_params(m) else inputs
        return (lambda: m(**kwargs)), (lambda: None)
    return make


def _decode_call(model: nn.Module, batch: int, config: BenchConfig):
    """One new token per call, on a KV cache holding ``prefill`` tokens (cropped back after each call)."""
    from .hf.io import example_inputs_for

    # one position short of the model's limit at most (example_inputs_for clips to it): the timed token needs one
    prompt = example_inputs_for(model, batch=batch, seq=config.prefill + 1, seed=config.seed)["input_ids"][:, :-1]
    prefill = prompt.shape[-1]
    token = prompt[:, -1:]  # (B, 1)

    cache_arg = _cache_argument(model)
    extra = {"position_ids": torch.full((batch, 1), prefill)} if "position_ids" in _forward_params(model) else {}

    def make(m: nn.Module):
        with torch.no_grad():
            out = m(input_ids=prompt, use_cache=True)
        cache = out[cache_arg] if cache_arg in out else out["past_key_values"]

        def call():
            return m(input_ids=token, use_cache=True, **{cache_arg: cache}, **extra)

        def reset():
            grown = cache.get_seq_length() - prefill
            if grown > 0:
                cache.crop(-grown)
        return call, reset
    return make


# ------------------------------------------------------------------------------------ timing

def _time_interleaved(calls: dict, config: BenchConfig) -> dict[str, list[float]]:
    """Seconds per call for every contender, measured round by round in rotating order."""
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    with torch.no_grad():
        round_s = 0.0  # one call of every contender, from the last warm-up call
        for name in names:
            call, reset = calls[name]
            for _ in range(max(config.warmup, 1)):
                start = time.perf_counter()
                call()
                elapsed = time.perf_counter() - start
                reset()
            round_s += max(elapsed, config.min_round_s)
        rounds = min(config.rounds, max(config.min_rounds, int(config.shape_budget_s / max(round_s, 1e-9))))
        for r in range(rounds):
            for name in _rotated(names, r):
                call, reset = calls[name]
                total, n = 0.0, 0
                while True:  # the reset (KV cache crop) stays outside the timed region
                    start = time.perf_counter()
                    call()
                    total += time.perf_counter() - start
                    reset()
                    n += 1
                    if total >= config.min_round_s:
                        break
                times[name].append(total / n)
    return times


def _rotated(names: list[str], r: int) -> list[str]:
    """``names`` starting at position ``r`` (mod its length): round r's order, so no contender always goes first."""
    return names[r % len(names):] + names[:r % len(names)]


def verdict(row: BenchRow, contender: str = "fused") -> str:
    """``faster`` / ``slower`` when the contender's CI clears the noise band, else ``within noise``.

    The band is the A/A control's CI widened to include 1 (just 1 without a control).
    """
    low, high = row.ratio_ci[contender]
    band_low, band_high = row.ratio_ci.get("control", (1.0, 1.0))
    band_low, band_high = min(band_low, 1.0), max(band_high, 1.0)
    if low > band_high:
        return "faster"
    if high < band_low:
        return "slower"
    return "within noise"


def ratio_ci(base: list[float], other: list[float], *, resamples: int, confidence: float,
             seed: int = 0) -> tuple[float, float, float]:
    """median(base) / median(other) with a percentile bootstrap interval (rounds resampled in pairs)."""
    if len(base) != len(other) or not base:
        raise ValueError(f"need the same non-zero number of timings, got {len(base)} and {len(other)}")
    b, o = torch.tensor(base, dtype=torch.float64), torch.tensor(other, dtype=torch.float64)
    point = (b.median() / o.median()).item()
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(base), (resamples, len(base)), generator=gen)
    ratios = b[idx].median(dim=1).values / o[idx].median(dim=1).values
    alpha = (1 - confidence) / 2
    low, high = torch.quantile(ratios, torch.tensor([alpha, 1 - alpha], dtype=torch.float64)).tolist()
    return point, low, high


# ------------------------------------------------------------------------------------ profiling

@contextlib.contextmanager
def _label_norms(models):
    """Label every norm module call and every fused add+norm call ``normfold_bench::norm`` for the profiler."""
    from torch.autograd.profiler import record_function

    from . import ops

    norm_types = _norm_types()
    open_labels: list = []
    handles = []

    def pre(module, args):
        label = record_function(_NORM_LABEL)
        label.__enter__()
        open_labels.append(label)

    def post(module, args, output):
        open_labels.pop().__exit__(None, None, None)

    for m in models:
        for sub in m.modules():
            if isinstance(sub, norm_types):
                handles += [sub.register_forward_pre_hook(pre), sub.register_forward_hook(post)]
    plain = {name: getattr(ops, name) for name in ("rms_norm", "layer_norm")}

    def labelled(function):  # fused add+norm calls bypass the module (see normfold.fuse.runtime)
        def call(*args, **kwargs):
            with record_function(_NORM_LABEL):
                return function(*args, **kwargs)
        return call
    for name, function in plain.items():
        setattr(ops, name, labelled(function))
    try:
        yield
    finally:
        for name, function in plain.items():
            setattr(ops, name, function)
        for h in handles:
            h.remove()


def _norm_types() -> tuple[type, ...]:
    """The norm modules the profiler pass labels: torch's and normfold's LayerNorm / RMSNorm."""
    from .nn import LayerNorm as NfLayerNorm
    from .nn import RMSNorm

    return (nn.LayerNorm, nn.RMSNorm, NfLayerNorm, RMSNorm)


def _is_residual_add(event, norm_rows: set[tuple[int, int]]) -> bool:
    """An ``aten::add`` whose result is shaped like a norm's input: the same (elements, row length).

    Matching the whole size, not only the row length, keeps out adds that merely end in the same
    width, e.g. attention scores (B, H, T, T) plus their mask when T equals the hidden size.
    """
    shapes = [s for s in (event.input_shapes or []) if s]
    if event.name != "aten::add" or len(shapes) < 2:
        return False
    try:
        out = torch.broadcast_shapes(tuple(shapes[0]), tuple(shapes[1]))
    except RuntimeError:
        return False
    return (math.prod(out), out[-1]) in norm_rows


def _norm_rows(norm_events) -> set[tuple[int, int]]:
    """(elements, row length) of the tensors the labelled norm calls normalized (their first op's input)."""
    rows = set()
    for event in norm_events:
        for child in event.cpu_children:
            shape = child.input_shapes[0] if child.input_shapes and child.input_shapes[0] else None
            if shape:
                rows.add((math.prod(shape), shape[-1]))
                break
    return rows


def _medians(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(median share, median ms) over profiled forwards.

    Medians, not sums: on a shared machine one forward can be descheduled inside any op.
    """
    shares = [share for share, _ in samples if share == share]  # drop NaN (a forward of zero length)
    spent = [ms for _, ms in samples]
    return (statistics.median(shares) if shares else float("nan")), (statistics.median(spent) if spent else 0.0)


def _profiled_forwards(call, reset, iters: int) -> list[tuple[float, float]]:
    """(share of the forward's time in norms + residual adds, ms in them) for each of ``iters`` forwards.

    A norm call's time is that of the ops it ran (its label's children: ``aten::layer_norm``,
    ``normfold::rms_norm``, or a hand-written norm's pow / mean / rsqrt ...), not the label's own
    span, which also holds the profiling hooks' cost (measured 10-70 µs per call) that no
    unprofiled forward pays.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(iters):
            with record_function(_FORWARD_LABEL):
                call()
            reset()
    total_us: dict[int, float] = {}
    spent_us: dict[int, float] = {}
    norm_rows = _norm_rows(e for e in prof.events() if e.name == _NORM_LABEL)
    for event in prof.events():
        if event.name == _FORWARD_LABEL:
            total_us[event.id] = event.cpu_time_total
            continue
        # norms never call aten::add, so an add inside a norm label is not counted twice
        if event.name == _NORM_LABEL:
            op_us = sum(child.cpu_time_total for child in event.cpu_children)
        elif _is_residual_add(event, norm_rows) and _ancestor(event, _NORM_LABEL) is None:
            op_us = event.cpu_time_total
        else:
            continue
        forward = _ancestor(event, _FORWARD_LABEL)
        if forward is not None:
            spent_us[forward.id] = spent_us.get(forward.id, 0.0) + op_us
    return [(spent_us.get(i, 0.0) / t if t > 0 else float("nan"), spent_us.get(i, 0.0) / 1000)
            for i, t in total_us.items()]


def _ancestor(event, label: str):
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == label:
            return parent
        parent = parent.cpu_parent
    return None


# ------------------------------------------------------------------------------------ driver

def bench_model(model: nn.Module, config: BenchConfig = BenchConfig(), *, name: str | None = None,
                contenders: dict[str, nn.Module] | None = None, progress=None) -> list[BenchRow]:
    """Measure original / folded / fused ``model`` at every shape of ``config`` (eager, and compiled if asked)."""
    from .hf.io import example_inputs_for

    if not isinstance(config, BenchConfig):
        raise TypeError(f"config must be a BenchConfig, got {type(config).__name__}")
    name = name or type(model).__name__
    if contenders is None:
        contenders, _ = prepare_contenders(model, example_inputs_for(model, batch=2, seq=8, seed=config.seed),
                                           control=config.control)
    modes = [("eager", contenders)]
    if config.compile:
        modes.append(("compile", {k: torch.compile(m) for k, m in contenders.items()}))
    rows = []
    with _room_for_every_contender(len(contenders)):
        for mode, models in modes:
            rows += _bench_mode(name, mode, models, contenders["original"], config, progress)
    return rows


@contextlib.contextmanager
def _room_for_every_contender(count: int):
    """Raise Dynamo's per-function recompile limit while the compiled contenders run.

    The contenders share their classes' forward code, so each one's graphs (prefill, decode, every
    batch) count against one limit (8): with four models the last one compiled would hit it and
    silently run eagerly, which measured as a 2.3× "slowdown" of folded+fused.
    """
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    with config.patch(**{name: max(getattr(config, name), 16 * count)}):
        yield


def _bench_mode(name, mode, models, original, config, progress) -> list[BenchRow]:
    """One row per workload of ``original`` for ``models`` run in ``mode`` ("eager" or "compile")."""
    rows = []
    for batch, seq, kind, make in _workloads(original, config):
        if progress:
            progress(f"{name} {mode} batch {batch} {kind} {seq}")
        calls = {k: make(m) for k, m in models.items()}
        times = _time_interleaved(calls, config)
        row = BenchRow(name, mode, batch, seq, kind)
        for c, ts in times.items():
            q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
            row.median_ms[c] = statistics.median(ts) * 1e3
            row.iqr_ms[c] = (q[0] * 1e3, q[2] * 1e3)
            if c != "original":
                point, low, high = ratio_ci(times["original"], ts, resamples=config.bootstrap,
                                            confidence=config.confidence, seed=config.seed)
                row.ratio[c], row.ratio_ci[c] = point, (low, high)
        if config.profile and mode == "eager":
            profiled = [c for c in calls if c != "control"]  # the original's copy: same numbers
            # a quarter of the shape's budget at most, but 5 forwards for a median (3 proved erratic
            # at shapes whose ops run at DRAM bandwidth)
            slowest = max(statistics.median(times[c]) for c in profiled)
            iters = max(5, min(config.profile_iters, int(config.shape_budget_s / 4 / len(calls) / max(slowest, 1e-9))))
            samples: dict[str, list] = {c: [] for c in profiled}
            with _label_norms(models.values()):
                for r in range(iters):  # one profiled forward per contender per round, rotating, like the timing
                    for c in _rotated(profiled, r):
                        samples[c] += _profiled_forwards(*calls[c], 1)
            for c, forwards in samples.items():
                row.norm_share[c], row.norm_ms[c] = _medians(forwards)
        rows.append(row)
    return rows


def write_results(rows: list[BenchRow], stem, *, command: str, plot: bool = True) -> list:
    """``stem``.csv, ``stem``.md (with the command and the machine) and ``stem``.png; returns the paths."""
    import csv
    from pathlib import Path

    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    flat = [r.flat() for r in rows]
    columns = list(dict.fromkeys(k for f in flat for k in f))
    with open(stem.with_suffix(".csv"), "w", newline="") as fh:
        writer = csv.DictWriter(fh, columns)
        writer.writeheader()
        writer.writerows(flat)
    from .ops import cpu_kernel_available

    machine = (f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} "
               f"torch threads, load average {os.getloadavg()[0]:.1f} at the end, torch {torch.__version__}, "
               f"Python {platform.python_version()}, fused C++ CPU kernel "
               f"{'loaded' if cpu_kernel_available() else 'UNAVAILABLE (reference fallback)'}")
    lines = [f"# End-to-end: original vs folded vs folded+fused", "", f"command: `{command}`", "",
             f"machine: {machine}", "",
             "speedup = original median / contender median (> 1 is faster), [95% bootstrap CI]; "
             "control = a deep copy of the original timed alongside (A/A): how far this run's noise moves "
             "a ratio; fused vs noise = `faster` / `slower` when the fused CI clears the control's CI (widened to "
             "include 1), else `within noise`; "
             "norm+add = profiler: forward CPU time in the ops norm calls run (aten::layer_norm, normfold::rms_norm, "
             "...; not the module call around them) and in residual adds (aten::add whose result has the size "
             "and row length of a norm's input), its share of the forward, and how much of it fusing cut", "",
             "| model | mode | batch | seq | original ms | control (A/A) | folded | fused | fused vs noise "
             "| norm+add share orig → fused | norm+add ms orig → fused (cut) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r.ratio[c]:.3f} [{r.ratio_ci[c][0]:.3f}, {r.ratio_ci[c][1]:.3f}]" if c in r.ratio else "n/a"
                 for c in ("control", "folded", "fused")]
        share = (f"{r.norm_share['original']:.1%} → {r.norm_share['fused']:.1%}" if r.norm_share else "n/a")
        spent = "n/a"
        if r.norm_ms and r.norm_ms["original"] > 0:
            o, f = r.norm_ms["original"], r.norm_ms["fused"]
            spent = f"{o:.3f} → {f:.3f} ({1 - f / o:.0%})"
        lines.append(f"| {r.model} | {r.mode} | {r.batch} | {r.kind} {r.seq} | {r.median_ms['original']:.3f} | "
                     f"{cells[0]} | {cells[1]} | {cells[2]} | {verdict(r)} | {share} | {spent} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    paths = [stem.with_suffix(".csv"), stem.with_suffix(".md")]
    if plot:
        paths.append(plot_rows(rows, stem.with_suffix(".png")))
    return paths


def read_rows(path) -> list[BenchRow]:
    """The rows of a CSV written by ``write_results`` (medians, ratios, CIs, norm shares)."""
    import csv
    from pathlib import Path

    rows = []
    with open(Path(path)) as fh:
        for rec in csv.DictReader(fh):
            row = BenchRow(rec["model"], rec["mode"], int(rec["batch"]), int(rec["seq"]), rec["kind"])
            for c in CONTENDERS:
                if not rec.get(f"{c}_median_ms"):
                    continue
                row.median_ms[c] = float(rec[f"{c}_median_ms"])
                row.iqr_ms[c] = (float(rec[f"{c}_q1_ms"]), float(rec[f"{c}_q3_ms"]))
                if c != "original":
                    row.ratio[c] = float(rec[f"{c}_speedup"])
                    row.ratio_ci[c] = (float(rec[f"{c}_ci_low"]), float(rec[f"{c}_ci_high"]))
                if rec.get(f"{c}_norm_add_share"):
                    row.norm_share[c] = float(rec[f"{c}_norm_add_share"])
                    row.norm_ms[c] = float(rec[f"{c}_norm_add_ms"])
            rows.append(row)
    return rows


def plot_rows(rows: list[BenchRow], path):
    """Bar chart of every contender's speed-up with its CI (PNG at ``path``); needs matplotlib."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install 'normfold[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.model}\n{r.mode} b{r.batch} {r.kind[0]}{r.seq}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows)), 4))
    shown = [c for c in ("control", "folded", "fused") if all(c in r.ratio for r in rows)]
    width = 0.8 / len(shown)
    colors = {"control": "0.7", "folded": "tab:blue", "fused": "tab:orange"}
    for k, c in enumerate(shown):
        xs = [i + (k - (len(shown) - 1) / 2) * width for i in range(len(rows))]
        ys = [r.ratio[c] for r in rows]
        err = [[y - r.ratio_ci[c][0] for y, r in zip(ys, rows)], [r.ratio_ci[c][1] - y for y, r in zip(ys, rows)]]
        # bars grow from 1 (no change) so that a few percent either way is visible
        ax.bar(xs, [y - 1 for y in ys], width, bottom=1.0, yerr=err, capsize=2, color=colors[c],
               label="control (A/A copy)" if c == "control" else c)
    ax.axhline(1.0, color="black", linewidth=0.8)
    extremes = [v for r in rows for c in shown for v in r.ratio_ci[c]]
    ax.set_ylim(min(extremes + [1.0]) - 0.02, max(extremes + [1.0]) + 0.02)
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("speedup over original (median, 95% CI)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------ single ops

def bench_ops(shapes=((1, 768), (8, 768), (128, 768), (1024, 768)), *, rounds: int = 200,
              inner: int = 20) -> list[dict]:
    """Per-call µs of one norm the way each model variant runs it, at decode-like and prefill-like sizes.

    ``layer_norm``: aten LayerNorm with γ, β (the original); ``rms_norm``: normfold weightless RMSNorm
    (folded); ``add+layer_norm`` / ``add+rms_norm``: with the residual add in front; ``fused``:
    ``rms_norm(x, residual=r)``; ``fused_sum_cached``: the same with the sum never streamed (in this
    loop it stays in cache, unlike in a model). Interleaved rounds of ``inner`` calls each, medians.
    """
    import torch.nn.functional as F

    from .ops import _cpu, rms_norm

    rows = []
    for m, n in shapes:
        gen = torch.Generator().manual_seed(0)
        x, r = torch.randn(m, n, generator=gen), torch.randn(m, n, generator=gen)  # (M, N)
        w, b = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        ops = {
            "layer_norm": lambda: F.layer_norm(x, (n,), w, b, 1e-5),
            "rms_norm": lambda: rms_norm(x, None, None, 1e-5),
            "add+layer_norm": lambda: F.layer_norm(x + r, (n,), w, b, 1e-5),
            "add+rms_norm": lambda: rms_norm(x + r, None, None, 1e-5),
            "fused": lambda: rms_norm(x, None, None, 1e-5, residual=r),
        }
        if _cpu.kernel_available():
            ops["fused_sum_cached"] = ops["fused"]
        times = {k: [] for k in ops}
        with torch.no_grad():
            names = list(ops)
            for i in range(-1, rounds):  # round -1 warms up
                for k in _rotated(names, max(i, 0)):
                    previous = _cpu.set_stream_sum_bytes(2**63 - 1) if k == "fused_sum_cached" else None
                    start = time.perf_counter()
                    for _ in range(inner):
                        ops[k]()
                    elapsed = time.perf_counter() - start
                    if previous is not None:
                        _cpu.set_stream_sum_bytes(previous)
                    if i >= 0:
                        times[k].append(elapsed / inner * 1e6)
        rows.append({"shape": f"({m}, {n})", **{f"{k}_us": round(statistics.median(v), 3) for k, v in times.items()}})
    return rows


# ------------------------------------------------------------------------------------ command line

def _run_bench(args) -> int:
    from .hf.io import default_model_path, load_model

    model_dir = args.model_dir or default_model_path()
    config = QUICK if args.quick else BenchConfig()
    config = replace(config, compile=args.compile, rounds=args.rounds or config.rounds,
                     batches=tuple(args.batch) if args.batch else config.batches,
                     seqs=tuple(args.seq) if args.seq else config.seqs, profile=not args.no_profile)
    rows = bench_model(load_model(model_dir), config, name=str(model_dir).rstrip("/").rsplit("/", 1)[-1])
    for r in rows:
        share = (f"  norm+add {r.norm_share['original']:.1%} -> {r.norm_share['fused']:.1%}"
                 if r.norm_share else "")
        print(f"{r.mode:7s} batch {r.batch:2d} {r.kind:7s} {r.seq:5d}  original {r.median_ms['original']:9.3f} ms  "
              + "  ".join(f"{c} {r.ratio[c]:.3f}x [{r.ratio_ci[c][0]:.3f}, {r.ratio_ci[c][1]:.3f}]"
                          for c in ("control", "folded", "fused") if c in r.ratio) + f"  ({verdict(r)})" + share)
    if args.out:
        import shlex
        import sys

        for p in write_results(rows, args.out, command="normfold " + shlex.join(sys.argv[1:]), plot=not args.no_plot):
            print(f"wrote {p}")
    if args.json:
        import json

        print(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


def add_commands(subparsers) -> None:
    """Add ``bench`` to the ``normfold`` command's subparsers."""
    p = subparsers.add_parser("bench", help="time the original, folded and folded+fused model side by side")
    p.add_argument("model_dir", nargs="?", help="Hugging Face folder (default: the bundled model)")
    p.add_argument("--quick", action="store_true", help="a few seconds: batch 1, decode and seq 16, 5 rounds")
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd contenders")
    p.add_argument("--batch", type=int, nargs="+", help="batch sizes (default 1 8)")
    p.add_argument("--seq", type=int, nargs="+", help="sequence lengths; 1 = a decode step (default 1 128 1024)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 30)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiler pass")
    p.add_argument("--out", metavar="STEM", help="write STEM.csv, STEM.md and STEM.png")
    p.add_argument("--no-plot", action="store_true", help="no PNG with --out")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    p.set_defaults(run=_run_bench)


register_cli = add_commands
