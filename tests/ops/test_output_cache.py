"""The CPU kernel's output-buffer cache: large outputs reuse freed blocks, stay correct, and stay bounded."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from normfold import ops
from normfold.ops import _cpu

pytestmark = pytest.mark.skipif(not ops.cpu_kernel_available(), reason="fused CPU kernel not built")

BIG = (512, 1024)   # 2 MiB in float32: cached
SMALL = (4, 1024)   # 16 KiB: left to the system allocator


def _x(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_a_freed_large_output_is_reused_by_the_next_call_and_results_stay_exact():
    x, r = _x(BIG), _x(BIG, seed=1)
    first = ops.rms_norm(x)
    pointer, expected = first.data_ptr(), first.clone()
    del first
    hits = ops.cpu_cache_info().hits
    second = ops.rms_norm(x)
    assert second.data_ptr() == pointer and ops.cpu_cache_info().hits == hits + 1
    assert torch.equal(second, expected)
    # the recycled block held the old output: a residual call must overwrite y and s entirely
    del second
    y, s = ops.rms_norm(x, residual=r)
    torch.testing.assert_close(s, x + r, rtol=0, atol=0)
    torch.testing.assert_close(y, ops.rms_norm_ref(x + r).float(), rtol=1e-5, atol=1e-5)


def test_live_outputs_never_share_a_block():
    x = _x(BIG)
    outputs = [ops.layer_norm(x) for _ in range(3)]
    assert len({o.data_ptr() for o in outputs}) == 3


def test_small_outputs_are_not_cached():
    before = ops.cpu_cache_info()
    for _ in range(3):
        ops.rms_norm(_x(SMALL))
    after = ops.cpu_cache_info()
    assert (after.hits, after.misses) == (before.hits, before.misses)


def test_backward_gradients_come_from_the_cache_and_match_autograd_of_the_reference():
    x = _x(BIG).requires_grad_()
    w = torch.randn(BIG[1], requires_grad=True)
    for _ in range(2):  # the second round runs on recycled blocks
        x.grad = w.grad = None
        ops.rms_norm(x, w).square().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ops.rms_norm_ref(x, w).square().sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw, w.grad, rtol=1e-4, atol=1e-3)


def test_an_output_from_the_cache_can_be_resized_like_any_tensor():
    y = ops.rms_norm(_x(BIG))
    y.resize_(BIG[0] * 2, BIG[1])
    y[BIG[0]:] = 1.0
    assert y.shape == (BIG[0] * 2, BIG[1]) and torch.all(y[BIG[0]:] == 1.0)


def test_empty_cpu_cache_frees_every_kept_block():
    y = ops.rms_norm(_x(BIG))
    del y
    assert ops.cpu_cache_info().cached_bytes > 0
    ops.empty_cpu_cache()
    info = ops.cpu_cache_info()
    assert info.cached_bytes == 0 and info.cached_blocks == 0


_CHILD = """
import torch
from normfold import ops
assert ops.cpu_kernel_available()
x = torch.randn(512, 1024)  # 2 MiB outputs
for _ in range(4):
    ops.rms_norm(x)
info = ops.cpu_cache_info()
print(info.cached_bytes, info.hits, info.limit_bytes)
"""


@pytest.mark.parametrize("limit_mb, cached, hits", [("0", 0, 0),   # off: nothing kept, nothing served
                                                    ("1", 0, 0),   # a 2 MiB block is over a 1 MiB limit
                                                    ("8", 2 << 20, 3)])
def test_the_limit_comes_from_normfold_cpu_cache_mb(limit_mb, cached, hits):
    env = dict(os.environ, NORMFOLD_CPU_CACHE_MB=limit_mb)
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(cached), str(hits), str(int(limit_mb) << 20)]


_FORK_CHILD = """
import os, torch
from normfold import ops
x = torch.randn(512, 1024)
del_me = ops.rms_norm(x)
del del_me                      # the parent keeps one block
assert ops.cpu_cache_info().cached_blocks == 1
pid = os.fork()
if pid == 0:
    torch.set_num_threads(1)    # as DataLoader workers do: libgomp cannot run a parallel region after a fork
    info = ops.cpu_cache_info()
    ok = info.cached_bytes == 0 and info.cached_blocks == 0
    for _ in range(3):          # the child's cache works from scratch
        ops.rms_norm(x)
    ok = ok and ops.cpu_cache_info().cached_blocks == 1
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), ops.cpu_cache_info().cached_blocks)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_with_an_empty_working_cache_and_the_parent_keeps_its_own():
    out = subprocess.run([sys.executable, "-c", _FORK_CHILD], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["0", "1"]


def test_info_is_all_zeros_without_the_kernel(monkeypatch):
    monkeypatch.setattr(_cpu, "_module", None)
    assert ops.cpu_cache_info() == ops.CpuCacheInfo(0, 0, 0, 0, 0)
    ops.empty_cpu_cache()  # a no-op, not an error
