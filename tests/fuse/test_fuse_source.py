"""Fusion rewrites only the code that runs: a forward or helper whose file changed on disk since it was
imported is left alone, with a reason, instead of compiling the new text into the model."""
from __future__ import annotations

import importlib.util
import textwrap

import torch

from normfold.fuse import fuse_residual_norms
from normfold.fuse.inline import running_definition, same_code

MODULE = textwrap.dedent('''
    import torch
    from torch import nn
    from normfold.nn import RMSNorm

    EDITED = []


    def add(a, b):
        out = a + b
        return out


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.norm = RMSNorm(8)

        def forward(self, x):
            h = self.lin(x) + x
            return self.norm(h)


    class HelperBlock(Block):
        def forward(self, x):
            h = add(self.lin(x), x)
            return self.norm(h)
''')


def _import(tmp_path, name: str):
    path = tmp_path / f"{name}.py"
    path.write_text(MODULE)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def _edit(path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def _x():
    return torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))


def test_a_forward_edited_on_disk_after_import_is_not_rewritten(tmp_path):
    module, path = _import(tmp_path, "nf_edited_forward")
    torch.manual_seed(0)
    block = module.Block().eval()
    _, report = fuse_residual_norms(block, (_x(),))
    assert [p.norm for p in report.fused] == ["norm"]  # unchanged file: fused
    _edit(path, "        h = self.lin(x) + x\n", "        h = self.lin(x) + x\n        EDITED.append(1)\n")
    fused, report = fuse_residual_norms(block, (_x(),))
    assert report.fused == [] and "does not compile to the code that runs" in report.skipped["norm"]
    assert "Block.forward" in report.skipped["norm"]
    with torch.no_grad():
        assert torch.equal(fused(_x()), block(_x()))
    assert module.EDITED == []  # the new line never ran


def test_a_helper_edited_on_disk_after_import_is_not_inlined(tmp_path):
    module, path = _import(tmp_path, "nf_edited_helper")
    torch.manual_seed(0)
    block = module.HelperBlock().eval()
    _, report = fuse_residual_norms(block, (_x(),))
    assert [p.norm for p in report.fused] == ["norm"] and "add(" in report.fused[0].add  # inlined and fused
    _edit(path, "    out = a + b\n", "    out = a + b\n    marker = EDITED.append(1)\n")
    fused, report = fuse_residual_norms(block, (_x(),))
    assert report.fused == []
    assert "not rewritten: the source of add in" in report.skipped["norm"]
    assert "does not compile to the code that runs" in report.skipped["norm"]
    with torch.no_grad():
        assert torch.equal(fused(_x()), block(_x()))
    assert module.EDITED == []


def test_source_compared_by_code_not_by_lines(tmp_path):
    module, path = _import(tmp_path, "nf_moved_lines")
    _edit(path, "EDITED = []\n", "EDITED = []\n\n\n\n# comments and blank lines move the code, not change it\n")
    assert running_definition(module.add)[0] is not None
    _edit(path, "out = a + b", "out = b + a")
    definition, why = running_definition(module.add)
    assert definition is None and "add" in why


def test_same_code_tells_constants_apart_that_compare_equal():
    def compiled(text):
        return compile(text, "<test>", "exec")
    assert same_code(compiled("x = 1\ny = 2"), compiled("\n\nx = 1\ny = 2"))
    assert not same_code(compiled("x = 1"), compiled("x = 1.0"))
    assert not same_code(compiled("x = 0.0"), compiled("x = -0.0"))
    assert not same_code(compiled("def f():\n    return 1"), compiled("def f():\n    return 2"))  # nested code
