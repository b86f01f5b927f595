"""The residual sum streamed past the cache gives bit-identical outputs; its threshold comes from the env."""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch

from normfold import ops
from normfold.ops import _cpu

pytestmark = pytest.mark.skipif(not ops.cpu_kernel_available(), reason="fused CPU kernel not built")

NEVER = 2**63 - 1


@contextmanager
def _stream_sums_from(nbytes: int):
    previous = _cpu.set_stream_sum_bytes(nbytes)
    try:
        yield
    finally:
        _cpu.set_stream_sum_bytes(previous)


def _inputs(shape, dtype, affine, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, r = torch.randn(*shape, generator=g).to(dtype), torch.randn(*shape, generator=g).to(dtype)
    w = torch.randn(shape[-1], generator=g) if affine else None
    b = torch.randn(shape[-1], generator=g) if affine and kind == "layer" else None
    return x, r, w, b


def _fused(kind, x, r, w, b):
    if kind == "rms":
        return ops.rms_norm(x, w, b, residual=r)
    return ops.layer_norm(x, w, b, residual=r)


# Rows of 768 / 1024 floats are 64-byte multiples (streamed when large enough); 1000 floats are not
# (ordinary stores); half precision is never streamed.
@pytest.mark.parametrize("kind, shape, dtype, affine", [
    ("rms", (64, 768), torch.float32, True), ("layer", (64, 768), torch.float32, True),
    ("rms", (3, 1024), torch.float32, False), ("layer", (5, 1000), torch.float32, True),
    ("rms", (64, 768), torch.bfloat16, True), ("layer", (2, 3, 1024), torch.float32, False),
])
def test_streaming_the_sum_changes_no_bit_and_matches_the_reference(kind, shape, dtype, affine):
    x, r, w, b = _inputs(shape, dtype, affine, kind)
    with torch.no_grad():
        with _stream_sums_from(NEVER):
            y0, s0 = _fused(kind, x, r, w, b)
        with _stream_sums_from(1):  # every float case above is large enough
            y1, s1 = _fused(kind, x, r, w, b)
    assert torch.equal(s1, s0) and torch.equal(y1, y0)
    torch.testing.assert_close(s1, x + r, rtol=0, atol=0)
    ref = ops.rms_norm_ref(s1, w, b) if kind == "rms" else ops.layer_norm_ref(s1, w, b)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y1.float(), ref.float(), rtol=tol, atol=tol)


def test_the_streamed_sum_backpropagates_like_the_stored_one():
    grads = []
    for threshold in (NEVER, 1):
        x, r, w, _ = _inputs((16, 768), torch.float32, True, "rms")
        for t in (x, r, w):
            t.requires_grad_()
        with _stream_sums_from(threshold):
            y, s = ops.rms_norm(x, w, residual=r)
            (y.square().sum() + s.sum()).backward()
        grads.append((x.grad, r.grad, w.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("env, expected", [(None, 1024 << 10), ("1", 1024), ("0", NEVER), ("-5", NEVER)])
def test_the_threshold_comes_from_normfold_stream_sum_kb(env, expected):
    child = "from normfold.ops import _cpu; print(_cpu.set_stream_sum_bytes(0))"
    environ = {k: v for k, v in os.environ.items() if k != "NORMFOLD_STREAM_SUM_KB"}
    if env is not None:
        environ["NORMFOLD_STREAM_SUM_KB"] = env
    out = subprocess.run([sys.executable, "-c", child], env=environ, capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) == expected
