"""The profiler pass: forward time spent in norms and residual adds, per contender.

Norm module calls and fused add+norm calls (``ops.rms_norm`` / ``ops.layer_norm``, which fused forwards
call directly) are labelled ``NORM_LABEL``; a norm's time is that of the ops it ran, not the label's
span. A residual add is an ``aten::add`` whose result has the size and row length of a tensor a norm
normalized, so an activation's internal adds (GPT-2's tanh GELU has two per layer) and attention
scores plus their mask (last dimension = hidden size when the sequence length is) do not count.
"""
from __future__ import annotations

import contextlib
import math
import os
import statistics
import warnings

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from .. import ops
from ..nn.kinds import LAYER_NORM_TYPES, RMS_NORM_TYPES

NORM_LABEL = "normfold_bench::norm"
FORWARD_LABEL = "normfold_bench::forward"


@contextlib.contextmanager
def label_norms(models):
    """Label every norm module call and every fused add+norm call ``normfold_bench::norm`` for the profiler."""
    norm_types = LAYER_NORM_TYPES + RMS_NORM_TYPES  # torch's and normfold's
    open_labels: list = []
    handles = []

    def pre(module, args):
        label = record_function(NORM_LABEL)
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
            with record_function(NORM_LABEL):
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


def is_residual_add(event, norm_rows: set[tuple[int, int]]) -> bool:
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


def normalized_rows(norm_events) -> set[tuple[int, int]]:
    """(elements, row length) of the tensors the labelled norm calls normalized (their first op's input)."""
    rows = set()
    for event in norm_events:
        for child in event.cpu_children:
            shape = child.input_shapes[0] if child.input_shapes and child.input_shapes[0] else None
            if shape:
                rows.add((math.prod(shape), shape[-1]))
                break
    return rows


def median_share_and_ms(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(median share, median ms) over profiled forwards.

    Medians, not sums: on a shared machine one forward can be descheduled inside any op.
    """
    shares = [share for share, _ in samples if share == share]  # drop NaN (a forward of zero length)
    spent = [ms for _, ms in samples]
    return (statistics.median(shares) if shares else float("nan")), (statistics.median(spent) if spent else 0.0)


# above kineto's highest log level (USDT = 5), whose profiler_start / profiler_stop lines it prints for every profile
_KINETO_SILENT = "6"


@contextlib.contextmanager
def quiet_profiler():
    """Keep torch.profiler's own chatter off stderr while profiling: kineto's log lines (two a
    profile, ~60 for ``normfold bench --quick``) and the profiler's Python warnings. A
    ``KINETO_LOG_LEVEL`` the user set is left as it is."""
    user_level = os.environ.get("KINETO_LOG_LEVEL")
    if user_level is None:
        os.environ["KINETO_LOG_LEVEL"] = _KINETO_SILENT
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"torch\.(autograd\.)?profiler")
            yield
    finally:
        if user_level is None:
            os.environ.pop("KINETO_LOG_LEVEL", None)


def profiled_forwards(call, reset, iters: int) -> list[tuple[float, float]]:
    """(share of the forward's time in norms + residual adds, ms in them) for each of ``iters`` forwards.

    A norm call's time is that of the ops it ran (its label's children: ``aten::layer_norm``,
    ``normfold::rms_norm``, or a hand-written norm's pow / mean / rsqrt ...), not the label's own
    span, which also holds the profiling hooks' cost (measured 10-70 µs per call) that no
    unprofiled forward pays.
    """
    with quiet_profiler(), torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(iters):
            with record_function(FORWARD_LABEL):
                call()
            reset()
    total_us: dict[int, float] = {}
    spent_us: dict[int, float] = {}
    norm_rows = normalized_rows(e for e in prof.events() if e.name == NORM_LABEL)
    for event in prof.events():
        if event.name == FORWARD_LABEL:
            total_us[event.id] = event.cpu_time_total
            continue
        # norms never call aten::add, so an add inside a norm label is not counted twice
        if event.name == NORM_LABEL:
            op_us = sum(child.cpu_time_total for child in event.cpu_children)
        elif is_residual_add(event, norm_rows) and _ancestor(event, NORM_LABEL) is None:
            op_us = event.cpu_time_total
        else:
            continue
        forward = _ancestor(event, FORWARD_LABEL)
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
