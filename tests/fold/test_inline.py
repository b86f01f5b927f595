"""inline_helper_calls: small module-level helpers written out in a forward, or left as calls."""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import pytest
import torch
import torch.nn.functional as F

from normfold.fold.inline import inline_helper_calls


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

def call_dropout_add(self, h, r):
    out = dropout_add(h, r, 0.0, False)
    return out


def call_keywords(self, h, r):
    out = scaled_add(b=r, scale=0.5, a=h)
    return out


def call_default(self, h, r):
    out = with_default(h, r)
    return out


def call_branch(self, h, r):
    out = with_branch(h, r)
    return out


def call_no_add(self, h, r):
    out = no_add(h, r)
    return out


def call_star(self, h, r):
    out = star_args(h, r)
    return out


def call_decorated(self, h, r):
    out = decorated_add(h, r)
    return out


def call_shadowing_global(self, h, r):
    SCALE = 100.0  # noqa: N806 (a caller local with the helper's global name)
    out = uses_global(h, r)
    return out + SCALE


def call_nested(self, h, r, twice):
    if twice:
        out = dropout_add(h, r, 0.0, False)
        out = dropout_add(out, r, 0.0, False)
    else:
        out = h
    return out


_ORDER: list[str] = []


def note(tag, value):
    _ORDER.append(tag)
    return value


def call_noting_order(self, h, r):
    out = scaled_add(note("a", h), scale=note("s", 0.5), b=note("b", r))
    return out


def _inline(function):
    tree = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    described = inline_helper_calls(tree, function.__globals__)
    namespace: dict = {}
    exec(compile(ast.fix_missing_locations(ast.Module([tree], [])), "<test>", "exec"), function.__globals__,  # noqa: S102
         namespace)
    return tree, described, namespace[function.__name__]


def _calls(tree, name):
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]


@pytest.mark.parametrize("caller, helper", [(call_dropout_add, "dropout_add"), (call_keywords, "scaled_add")])
def test_a_helper_with_an_add_is_written_out_and_computes_the_same(caller, helper):
    tree, described, inlined = _inline(caller)
    assert _calls(tree, helper) == []
    assert len(described) == 1 and helper in next(iter(described.values()))
    h, r = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(inlined(None, h, r), caller(None, h, r))


def test_each_call_in_nested_blocks_gets_its_own_names():
    tree, described, inlined = _inline(call_nested)
    assert _calls(tree, "dropout_add") == [] and len(described) == 2
    assert len({ast.unparse(n).split("=")[0] for n in ast.walk(tree) if id(n) in described}) == 2
    h, r = torch.randn(2, 4), torch.randn(2, 4)
    for twice in (True, False):
        assert torch.equal(inlined(None, h, r, twice), call_nested(None, h, r, twice))


def test_the_arguments_are_evaluated_in_the_calls_order():
    _ORDER.clear()
    tree, _, inlined = _inline(call_noting_order)
    assert _calls(tree, "scaled_add") == []
    inlined(None, torch.ones(2), torch.ones(2))
    assert _ORDER == ["a", "s", "b"]


@pytest.mark.parametrize("caller, helper", [
    (call_default, "with_default"),        # a default would be used
    (call_branch, "with_branch"),          # control flow in the body
    (call_no_add, "no_add"),               # nothing a fusion could use
    (call_star, "star_args"),              # *args
    (call_decorated, "decorated_add"),     # decorated: the name is the wrapper
    (call_shadowing_global, "uses_global"),  # its global SCALE is a local of the caller
])
def test_helpers_that_would_not_inline_to_the_same_computation_stay_calls(caller, helper):
    tree, described, inlined = _inline(caller)
    assert len(_calls(tree, helper)) == 1 and described == {}
    h, r = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(inlined(None, h, r), caller(None, h, r))


def test_a_helper_from_another_module_stays_a_call():
    tree = ast.parse("def caller(self, h, r):\n    out = dropout_add(h, r, 0.0, False)\n    return out\n").body[0]
    assert inline_helper_calls(tree, {"dropout_add": dropout_add}) == {}  # other globals than the helper's
    assert len(_calls(tree, "dropout_add")) == 1
