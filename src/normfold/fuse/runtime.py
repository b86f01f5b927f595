"""What runs inside a fused forward: the fused add+norm call and the guards that keep it exact.

The generated forwards (``rewrite.py``) call these functions. ``add_norm`` computes ``(norm(a + b), a + b)``
in one kernel call; ``norm_from`` returns that early output at the norm call only when its argument is
the sum (or a view of all its rows), unmodified since, and otherwise runs the norm; ``Handoff`` carries
an early output from the add ending one module's forward to the norm starting another's. A norm
that carries hooks (registered after fusing, or global module hooks) is always called, unfused, so
its hooks run (:func:`runs_hooks`).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module  # the global module hooks nn.Module's own call runs

from .. import ops
from ..nn import RMSNorm


def add_norm(norm: nn.Module, a, b):
    """``(norm(a + b), a + b)`` in one fused call; ``(None, a + b)`` when the operands do not fit it, or
    the norm carries hooks (:func:`runs_hooks`: calling it runs them).

    Both operands contiguous: the fused op's sum is contiguous, ``a + b`` keeps ``a``'s layout, and
    later code (a ``.view``, or torch.compile's replay of one) may depend on that layout.
    """
    if (not runs_hooks(norm) and isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.device == b.device and a.dim() > 0
            and a.shape[-1] == norm.normalized_shape[0] and a.is_contiguous() and b.is_contiguous()):
        # ops.* looked up at call time, so a profiler (normfold.bench) can label these calls
        if isinstance(norm, RMSNorm):
            return ops.rms_norm(a, norm.weight, norm.bias, norm.eps, residual=b, offset=norm.offset)
        return ops.layer_norm(a, norm.weight, norm.bias, norm.eps, residual=b)
    return None, a + b


def runs_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs hooks: its own (forward, pre-forward, backward) or global module
    hooks. A fused call never calls the norm, so where there are any the norm is called instead;
    a few dict lookups per call, and torch.compile guards on them like nn.Module's own call does. A
    plain function runs no module hooks."""
    return isinstance(module, nn.Module) and bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
        or _module._global_forward_hooks or _module._global_forward_pre_hooks or _module._global_backward_hooks
        or _module._global_backward_pre_hooks)


def norm_of_sum(norm: nn.Module, a, b):
    """``norm(a + b)`` for an inline ``self.<norm>(a + b)``: fused where the operands fit."""
    y, s = add_norm(norm, a, b)
    return norm(s) if y is None else y


def pending_output(h, y):
    """What a fused add leaves for its norm call: ``(h, y, h's version)``, or None when it did not fuse.

    The version counter (shared by every view of ``h``) tells whether ``h`` was modified in place
    since. It is None where it cannot be read: while torch.compile traces (Dynamo cannot guard on
    it) and for inference tensors (they have none). A pair inside one forward is fused only when
    the forward's code proves ``h`` unmodified (``mutation.py``), so there the identity test is
    enough; a handoff across forwards needs the version (``Handoff``).
    """
    if y is None:
        return None
    return h, y, _version_of(h)


def _version_of(h: Tensor) -> int | None:
    """``h._version``, or None while compiling or for an inference tensor (no version counter)."""
    if torch.compiler.is_compiling() or h.is_inference():
        return None
    return h._version


def norm_from(pending, norm: nn.Module, x):
    """The early output when ``x`` is the fused add's result, unmodified, else ``norm(x)``.

    ``x`` may be the result itself or a contiguous view of exactly its rows (OPT reshapes the
    residual stream to 2-D between the add and the norm: ``h.reshape(-1, h.size(-1))``); the norm
    acts on rows, so the early output reshaped the same way is ``norm(x)``.
    """
    if pending is not None and not runs_hooks(norm):  # a hook registered since the add: it must run
        h, y, version = pending
        if (x is h or same_rows(x, h)) and (version is None or torch.compiler.is_compiling()
                                              or x._version == version):
            return y if y.shape == x.shape else y.reshape(x.shape)  # the sum may have been viewed
    return norm(x)


def same_rows(x, h) -> bool:
    """True when ``x`` and ``h`` are contiguous views of all of one tensor's memory, rows of one length.

    Covering the whole base (instead of comparing storage offsets, which torch.compile cannot trace)
    makes the two the same memory in the same row-major order.
    """
    if not isinstance(x, Tensor) or not isinstance(h, Tensor) or x._base is None:
        return False
    base = h if h._base is None else h._base
    return (x._base is base and x.numel() == h.numel() == base.numel() and x.dim() > 0 and h.dim() > 0
            and x.shape[-1] == h.shape[-1] and x.is_contiguous() and h.is_contiguous() and base.is_contiguous())


class Handoff:
    """A norm's output computed early, by the fused add at the end of another module's forward.

    The add's module calls ``add(norm, a, b)``; the norm's module calls ``norm(module, x)``, which
    returns the early output only when ``x`` is that sum (or a view of its rows) and its version
    counter shows it unmodified since: the caller's code between the two forwards is not analysed,
    so the version is the proof. Where there is none (torch.compile, inference mode) the add runs
    alone and the norm runs as usual, which is exactly the unfused model; any other path, and a
    model reused after an exception, stays exact too.
    """

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending = None

    def add(self, norm: nn.Module, a, b):
        """``a + b``, with ``norm(a + b)`` kept for the receiving call when it can be checked there."""
        if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
            self.pending = None
            return a + b
        y, h = add_norm(norm, a, b)
        pending = pending_output(h, y)
        self.pending = pending if pending is not None and pending[2] is not None else None
        return h

    def norm(self, module: nn.Module, x):
        pending, self.pending = self.pending, None
        if torch.compiler.is_compiling():  # an early output left by eager code cannot be checked here
            return module(x)
        return norm_from(pending, module, x)
