"""early_output_risk: a fused add's early norm output is used only where the code proves the sum unmodified."""
from __future__ import annotations

import ast
import textwrap

import pytest

from normfold.fuse.mutation import early_output_risk


def _risk(body: str) -> str:
    """The risk for the first ``h = ... + ...`` and the first ``self.norm(<name>)`` of a forward with ``body``."""
    source = "def forward(self, x, flag):\n" + textwrap.indent(textwrap.dedent(body), "    ")
    tree = ast.parse(source).body[0]
    add = next(n for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, (ast.BinOp, ast.Call))
               and "+" in ast.unparse(n.value))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "self.norm")
    return early_output_risk(tree, add, call, "self", frozenset({"norm", "other_norm"}))


@pytest.mark.parametrize("body", [
    "h = x + self.f(x)\nreturn self.norm(h)",
    # GPT-2: an alias, and a branch that passes the sum to a call but then rebinds the name the norm takes
    """
    h = self.f(x) + x
    if flag:
        r = h
        h = self.cross(h)
        h = r + self.g(h)
    r = h
    y = self.norm(h)
    return y + r
    """,
    # OPT: metadata reads and a row view of the sum
    """
    h = x + self.f(x)
    shape = h.shape
    h = h.reshape(-1, h.size(-1))
    r = h
    if flag:
        y = self.norm(h)
    return y
    """,
    "h = x + self.f(x)\nz = h * 2\nz.mul_(3)\nreturn self.norm(h)",           # a new tensor changed, not h
    "h = x + self.f(x)\nh = h * 2\nh.mul_(3)\nreturn self.norm(h)",           # h rebound first: not the sum
    "h = x + self.f(x)\ny = self.other_norm(h)\nreturn self.norm(h)",       # a candidate norm only reads
    "h = x + self.f(x)\nreturn self.norm(h)\nh.mul_(2)",                     # after the call
    "h = (x + self.f(x)).view(-1, 8)\nreturn self.norm(h)",
    "self.f(x).mul_(2)\nh = x + self.f(x)\nreturn self.norm(h)",             # before the add
])
def test_code_that_leaves_the_sum_alone_is_proved_safe(body):
    assert _risk(body) == ""


@pytest.mark.parametrize("body, why", [
    ("h = x + self.f(x)\nh.mul_(2)\nreturn self.norm(h)", "changed in place"),
    ("h = x + self.f(x)\nif flag:\n    h.mul_(2)\nreturn self.norm(h)", "changed in place"),
    ("h = x + self.f(x)\nr = h\nr.add_(1)\nreturn self.norm(h)", "changed in place"),          # an alias
    ("h = x + self.f(x)\nv = h[0]\nv.zero_()\nreturn self.norm(h)", "changed in place"),       # a view written
    ("h = x + self.f(x)\nv = h.view(-1)\nv[0] = 1.0\nreturn self.norm(h)", "changed in place"),
    ("h = x + self.f(x)\nh += 1\nreturn self.norm(h)", "changed in place"),                    # augmented
    ("h = x + self.f(x)\nh[0] = 0.0\nreturn self.norm(h)", "changed in place"),                # subscript
    ("h = x + self.f(x)\nself.g(h)\nreturn self.norm(h)", "passed where it could be"),         # a call
    ("h = x + self.f(x)\ntorch.relu_(h)\nreturn self.norm(h)", "passed where it could be"),
    ("h = x + self.f(x)\nself.saved = h\nself.g()\nreturn self.norm(h)", "passed where it could be"),
    ("h = x + self.f(x)\nhs = [h]\nhs[0].mul_(2)\nreturn self.norm(h)", "passed where it could be"),
    ("h = x + self.f(x)\ng = lambda: h.mul_(2)\ng()\nreturn self.norm(h)", "passed where it could be"),
    ("h = x + self.f(x)\nh.foo()\nreturn self.norm(h)", "passed where it could be"),           # unknown method
    ("h = x + self.f(x)\nd = {1: h.mul_(2), self.norm(h): 2}\nreturn d", "changed in place"),   # evaluation order
    ("def g():\n    h.mul_(2)\nh = x + self.f(x)\ng()\nreturn self.norm(h)",  # late binding
     "passed where it could be"),
    ("h = x + self.f(x)\nexec('h.mul_(2)')\nreturn self.norm(h)", "passed where it could be"),
    # in a loop the norm of one iteration follows the change made after the add in an earlier one
    ("for i in range(2):\n    if i:\n        y = self.norm(h)\n    h = x + self.f(x)\n    h.mul_(2)\nreturn y",
     "changed in place"),
    ("h = x + self.f(x)\nwhile flag:\n    h.mul_(2)\n    break\nreturn self.norm(h)", "changed in place"),
    ("h = x + self.f(x)\ntry:\n    pass\nexcept ValueError:\n    pass\nreturn self.norm(h)", "`Try` statement"),
])
def test_code_that_may_change_the_sum_is_refused_with_a_reason(body, why):
    risk = _risk(body)
    assert why in risk and "self.norm(" in risk
