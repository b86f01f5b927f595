"""inline_helper_calls: small module-level helpers written out in a forward, or left as calls."""
from __future__ import annotations

import ast
import functools
import textwrap

import pytest
import torch
import torch.nn.functional as F

from normfold.fuse.inline import inline_helper_calls
from normfold.fuse.rewrite import add_in


# ------------------------------------------------------------------------------ helpers to inline (or not)

def dropout_add(x, residual, prob, training):
    """BLOOM's form."""
    out = F.dropout(x, p=prob, training=training)
    out = residual + out
    return out


def scaled_add(a, b, scale):
    total = a + b * scale
    return total


def with_default(a, b, scale=2.0):
    out = a + b * scale
    return out


def with_branch(a, b):
    if a.sum() > 0:
        return a + b
    return a - b


def no_add(a, b):
    out = a * b
    return out


def star_args(*xs):
    out = xs[0] + xs[1]
    return out


def _decorator(f):
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)
    return wrapper


@_decorator
def decorated_add(a, b):
    out = a + b
    return out


def uses_global(a, b):
    out = a + b * SCALE
    return out


SCALE = 3.0


# ------------------------------------------------------------------------------ callers

_ORDER: list[str] = []


def note(tag, value):
    _ORDER.append(tag)
    return value


def _inline(source: str):
    """Parse ``source`` (one function) as if written in this module, inline, and compile the result."""
    tree = ast.parse(textwrap.dedent(source)).body[0]
    described = inline_helper_calls(tree, globals(), add_in)
    namespace: dict = {}
    exec(compile(ast.fix_missing_locations(ast.Module([tree], [])), "<test>", "exec"), globals(), namespace)  # noqa: S102
    return tree, described, namespace[tree.name]


def _caller(call: str) -> str:
    return f"def caller(self, h, r):\n    out = {call}\n    return out\n"


def _calls(tree, name):
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]


@pytest.mark.parametrize("call, helper, expected", [
    ("dropout_add(h, r, 0.0, False)", "dropout_add", lambda h, r: r + h),
    ("scaled_add(b=r, scale=0.5, a=h)", "scaled_add", lambda h, r: h + r * 0.5),
])
def test_a_helper_with_an_add_is_written_out_and_computes_the_same(call, helper, expected):
    tree, described, inlined = _inline(_caller(call))
    assert _calls(tree, helper) == []
    assert len(described) == 1 and helper in next(iter(described.values()))
    h, r = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(inlined(None, h, r), expected(h, r))


def test_each_call_in_nested_blocks_gets_its_own_names():
    tree, described, inlined = _inline("""
        def caller(self, h, r, twice):
            if twice:
                out = dropout_add(h, r, 0.0, False)
                out = dropout_add(out, r, 0.0, False)
            else:
                out = h
            return out
        """)
    assert _calls(tree, "dropout_add") == [] and len(described) == 2
    assert len({ast.unparse(n).split("=")[0] for n in ast.walk(tree) if id(n) in described}) == 2
    h, r = torch.randn(2, 4), torch.randn(2, 4)
    assert torch.equal(inlined(None, h, r, True), r + (r + h))
    assert torch.equal(inlined(None, h, r, False), h)


def test_the_arguments_are_evaluated_in_the_calls_order():
    _ORDER.clear()
    tree, _, inlined = _inline(_caller('scaled_add(note("a", h), scale=note("s", 0.5), b=note("b", r))'))
    assert _calls(tree, "scaled_add") == []
    inlined(None, torch.ones(2), torch.ones(2))
    assert _ORDER == ["a", "s", "b"]


@pytest.mark.parametrize("helper", [
    "with_default",    # a default would be used
    "with_branch",     # control flow in the body
    "no_add",          # nothing a fusion could use
    "star_args",       # *args
    "decorated_add",   # decorated: the name is the wrapper
])
def test_helpers_that_would_not_inline_to_the_same_computation_stay_calls(helper):
    tree, described, inlined = _inline(_caller(f"{helper}(h, r)"))
    assert len(_calls(tree, helper)) == 1 and described == {}
    h, r = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(inlined(None, h, r), globals()[helper](h, r))


def test_a_helper_whose_global_is_a_local_of_the_caller_stays_a_call():
    tree, described, inlined = _inline("""
        def caller(self, h, r):
            SCALE = 100.0
            out = uses_global(h, r)
            return out + SCALE
        """)
    assert len(_calls(tree, "uses_global")) == 1 and described == {}
    h, r = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(inlined(None, h, r), h + r * SCALE + 100.0)


def test_a_helper_from_another_module_stays_a_call():
    tree = ast.parse(_caller("dropout_add(h, r, 0.0, False)")).body[0]
    assert inline_helper_calls(tree, {"dropout_add": dropout_add}, add_in) == {}  # other globals than the helper's
    assert len(_calls(tree, "dropout_add")) == 1
