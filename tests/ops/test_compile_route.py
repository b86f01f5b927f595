"""Which route a norm takes in a traced graph: small static shapes under torch.compile are inlined
math (Inductor fuses them with their neighbours), torch.export keeps the one opaque op per norm."""
from __future__ import annotations

import collections

import torch
from torch._functorch.aot_autograd import aot_module_simplified

from normfold.ops import rms_norm


def _compiled_graph_ops(fn, *args) -> collections.Counter:
    """The aten / custom ops of ``fn``'s forward graph under torch.compile."""
    seen: collections.Counter = collections.Counter()

    def backend(gm, inputs):
        def record(graph_module, _):
            seen.update(str(n.target) for n in graph_module.graph.nodes if n.op == "call_function")
            return graph_module.forward
        return aot_module_simplified(gm, inputs, fw_compiler=record)

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return seen


def _norm(x, w):
    return rms_norm(x, w, eps=1e-6)


def test_small_static_norm_is_inlined_under_compile():
    """On torch 2.11 (the oldest supported) this failed: its Dynamo answers torch.compiler.is_exporting()
    with True under torch.compile, and the norm stayed the opaque op (make oldest-stack runs it there)."""
    ops = _compiled_graph_ops(_norm, torch.randn(128, 768), torch.randn(768))
    assert not any("normfold" in op for op in ops) and "aten.rsqrt.default" in ops, ops


def test_export_keeps_one_opaque_op_per_norm():
    class Norm(torch.nn.Module):
        def forward(self, x, w):
            return _norm(x, w)

    exported = torch.export.export(Norm(), (torch.randn(128, 768), torch.randn(768)))
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert sum("normfold.norm_fwd" in t for t in targets) == 1, targets
