"""One norm call timed the way each model variant runs it (the op-level companion of ``bench_model``)."""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from ..ops import _cpu, rms_norm
from .timing import rotated


def bench_ops(shapes=((1, 768), (8, 768), (128, 768), (1024, 768)), *, rounds: int = 200,
              inner: int = 20) -> list[dict]:
    """Per-call µs of one norm the way each model variant runs it, at decode-like and prefill-like sizes.

    ``layer_norm``: aten LayerNorm with γ, β (the original); ``rms_norm``: normfold weightless RMSNorm
    (folded); ``add+layer_norm`` / ``add+rms_norm``: with the residual add in front; ``fused``:
    ``rms_norm(x, residual=r)``; ``fused_sum_cached``: the same with the sum never streamed (in this
    loop it stays in cache, unlike in a model). Interleaved rounds of ``inner`` calls each, medians.
    """
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
                for k in rotated(names, max(i, 0)):
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
