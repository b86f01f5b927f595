"""Static proof that a fused add's early norm output is still right where the norm is called.

A fused forward computes ``y = norm(h)`` together with ``h = a + b`` and returns ``y`` from the
later call ``self.norm(NAME)`` when ``NAME`` is ``h`` (or a view of all its rows). That is right
only if ``h`` was not modified in place in between. Eager code can read ``h``'s version counter;
``torch.compile`` and inference tensors cannot, so a pair inside one forward is fused only when the
forward's code shows that no path from the add to the call both changes ``h`` in place and then
passes it (or a view of it) to the call.

The analysis follows every path of the forward (branches, loops with ``break``/``continue``). Per
path it keeps the local names that may refer to ``h`` or a view of it (the *aliases*), whether ``h``
may have been changed in place, and whether ``h`` has *escaped* (reached code the analysis does not
see: stored in a container or attribute, passed to a call, captured by a lambda). Only known-safe
uses keep ``h`` in sight: reading metadata (``h.shape``, ``h.size(-1)``), taking a view
(``h.view(...)``, ``h[0]``), arithmetic (``h * 2`` makes a new tensor) and the candidate norms'
own calls. An in-place method (``h.mul_``), ``h += ...``, ``h[...] = ...`` change it; any other use
lets it escape, after which it counts as changed and every value read from outside (a call's
result, an attribute, an item) may be it. A refusal is cheap (the unfused norm runs); a wrong
proof is a wrong output, so everything not understood refuses.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

_META_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "is_leaf", "layout",
                         "is_sparse", "is_quantized", "is_meta", "names"})
_VIEW_ATTRS = frozenset({"T", "mT", "H", "mH", "real", "imag", "data"})
_META_METHODS = frozenset({"size", "dim", "numel", "nelement", "stride", "is_contiguous", "element_size",
                           "storage_offset", "data_ptr", "get_device", "is_floating_point", "is_complex",
                           "is_inference", "has_names"})
# methods that may return the tensor itself or share its memory
_VIEW_METHODS = frozenset({"view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze",
                           "transpose", "permute", "t", "expand", "expand_as", "narrow", "select", "unbind",
                           "split", "chunk", "tensor_split", "contiguous", "unfold", "movedim", "moveaxis",
                           "swapaxes", "swapdims", "detach", "to", "type", "type_as", "float", "double", "half",
                           "bfloat16", "cpu", "cuda", "diagonal", "as_strided", "requires_grad_"})
# methods that return a new tensor and leave the receiver alone
_FRESH_METHODS = frozenset({"clone", "add", "sub", "mul", "div", "pow", "neg", "abs", "exp", "log", "sqrt",
                            "rsqrt", "sum", "mean", "var", "std", "amax", "amin", "max", "min", "norm", "matmul",
                            "softmax", "float_power", "square", "tanh", "sigmoid", "relu", "masked_fill",
                            "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "tolist", "item",
                            "any", "all", "isfinite", "isnan", "eq", "ne", "lt", "le", "gt", "ge"})


class _Unsupported(Exception):
    """A construct the analysis does not follow: the pair is refused with this reason."""


@dataclass(frozen=True)
class _Path:
    """What one path knows about ``h``; ``None`` in a path set stands for "no add on this path yet"."""

    aliases: frozenset[str]
    modified: bool = False
    escaped: bool = False


_MAX_PATHS = 256


def early_output_risk(tree: ast.FunctionDef, add: ast.Assign, call: ast.Call, self_name: str,
                      pure_children: frozenset[str]) -> str:
    """Why the early output of ``add`` may be stale at ``call`` ('' when provably never).

    ``add`` (``NAME = A + B`` or ``NAME = (A + B).view(...)``) and ``call`` (``self.<norm>(name)``)
    are nodes of ``tree``; ``pure_children`` are the attributes of ``self`` whose calls only read
    their argument (the candidate norms).
    """
    flow = _Flow(add, call, self_name, pure_children, _captured_names(tree))
    try:
        flow.block(tree.body, {None})
    except _Unsupported as unsupported:
        return f"the sum cannot be proved unmodified before self.{call.func.attr}(...): {unsupported}"
    return flow.risk


def _captured_names(tree: ast.FunctionDef) -> frozenset[str]:
    """Names used inside nested functions, lambdas, classes and comprehensions of the forward: such a
    scope may read the name later (late binding), when the analysis no longer looks."""
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.ListComp, ast.SetComp,
              ast.DictComp, ast.GeneratorExp)
    nested = [n for statement in tree.body for n in ast.walk(statement) if isinstance(n, scopes)]
    return frozenset(name.id for scope in nested for name in ast.walk(scope) if isinstance(name, ast.Name))


# calls that reach the caller's local variables without being passed them
_FRAME_ACCESS = frozenset({"exec", "eval", "locals", "vars", "globals", "_getframe", "currentframe"})


class _Flow:
    """Runs the forward's statements over sets of paths (see the module docstring)."""

    def __init__(self, add, call, self_name, pure_children, captured: frozenset[str]) -> None:
        self.add, self.call, self.self_name, self.pure = add, call, self_name, pure_children
        self.captured = captured
        self.loops: list[tuple[set, set]] = []   # (break paths, continue paths) of the enclosing loops
        self.risk = ""

    def block(self, statements: list[ast.stmt], paths: set) -> set:
        for statement in statements:
            paths = self.statement(statement, paths)
            if len(paths) > _MAX_PATHS:
                raise _Unsupported(f"more than {_MAX_PATHS} distinct paths")
        return paths

    def statement(self, s: ast.stmt, paths: set) -> set:
        if isinstance(s, ast.If):
            paths = self.each(paths, lambda ev: ev.operand(s.test))
            return self.block(s.body, paths) | self.block(s.orelse, paths)
        if isinstance(s, (ast.For, ast.While)):
            return self.loop(s, paths)
        if isinstance(s, ast.With):
            for item in s.items:
                paths = self.each(paths, lambda ev, item=item: ev.bind(item.optional_vars,
                                                                       ev.consume(item.context_expr)))
            return self.block(s.body, paths)
        if isinstance(s, (ast.Break, ast.Continue)):
            if not self.loops:
                raise _Unsupported(f"`{type(s).__name__.lower()}` outside a loop")
            self.loops[-1][isinstance(s, ast.Continue)].update(paths)
            return set()
        if isinstance(s, (ast.Return, ast.Raise)):
            self.each(paths, lambda ev: [ev.value(child) for child in ast.iter_child_nodes(s)])
            return set()  # the path ends; the early output dies with the frame
        if isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr, ast.Assert, ast.Delete, ast.Pass,
                          ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)):
            paths = self.each(paths, lambda ev: ev.simple(s))
            if s is self.add and paths:  # a new sum: the names bound to it are its only aliases
                name = self.add.targets[0].id
                return {_Path(frozenset({name}), name in self.captured, name in self.captured)}
            return paths
        raise _Unsupported(f"the forward contains a `{type(s).__name__}` statement (line {s.lineno})")

    def loop(self, s, paths: set) -> set:
        head = paths
        for _ in range(_MAX_PATHS):
            broken, continued = set(), set()
            self.loops.append((broken, continued))
            if isinstance(s, ast.For):
                entry = self.each(head, lambda ev: ev.bind(s.target, ev.consume(s.iter)))
            else:
                entry = self.each(head, lambda ev: ev.operand(s.test))
            end = self.block(s.body, entry)
            self.loops.pop()
            grown = head | end | continued
            if grown == head:
                return self.block(s.orelse, head) | broken
            head = grown
        raise _Unsupported("a loop whose paths do not settle")

    def each(self, paths: set, effect) -> set:
        """Apply ``effect(evaluator)`` to every path that has a sum; returns the updated paths."""
        out = set()
        for path in paths:
            if path is None:
                _Eval(self, None).scan(effect)
                out.add(None)
            else:
                ev = _Eval(self, path)
                effect(ev)
                out.add(ev.path())
        return out


class _Eval:
    """Evaluates expressions of one path: what may be ``h``, and what changes or leaks it."""

    def __init__(self, flow: _Flow, path: _Path | None) -> None:
        self.flow = flow
        self.live = path is not None
        self.aliases = set(path.aliases) if path else set()
        self.modified = path.modified if path else False
        self.escaped = path.escaped if path else False

    def path(self) -> _Path:
        return _Path(frozenset(self.aliases), self.modified, self.escaped)

    def scan(self, effect) -> None:
        """A path with no sum yet: only look for the call (it takes no early output there)."""
        effect(self)

    # statements --------------------------------------------------------------------------------
    def simple(self, s: ast.stmt) -> None:
        if isinstance(s, ast.Assign):
            value = self.value(s.value)
            for target in s.targets:
                self.bind(target, value)
        elif isinstance(s, ast.AnnAssign):
            if s.value is not None:
                self.bind(s.target, self.value(s.value))
        elif isinstance(s, ast.AugAssign):  # in place for tensors: `h += x` changes h
            self.consume(s.value)
            if isinstance(s.target, ast.Name):
                self.modified |= s.target.id in self.aliases
            else:
                self.store_into(s.target)
        elif isinstance(s, ast.Expr):
            self.value(s.value)
        elif isinstance(s, ast.Assert):
            self.operand(s.test)
            if s.msg is not None:
                self.operand(s.msg)
        elif isinstance(s, ast.Delete):
            for target in s.targets:
                if isinstance(target, ast.Name):
                    self.aliases.discard(target.id)
                else:
                    self.store_into(target)
        elif isinstance(s, (ast.FunctionDef, ast.ClassDef)):  # a closure over an alias lets h escape
            if self._mentions_alias(s):
                self.escape()
            self.aliases.discard(s.name)
        elif isinstance(s, (ast.Import, ast.ImportFrom)):
            for alias in s.names:
                self.aliases.discard((alias.asname or alias.name).split(".")[0])

    def bind(self, target, may_be_h: bool) -> None:
        """Assign a value that may be ``h`` to ``target`` (a name, an unpacking, an item or attribute)."""
        if target is None:
            return
        if isinstance(target, ast.Name):
            (self.aliases.add if may_be_h else self.aliases.discard)(target.id)
            if may_be_h and target.id in self.flow.captured:
                self.escape()
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.bind(element, may_be_h)
        elif isinstance(target, ast.Starred):
            self.bind(target.value, may_be_h)
        else:  # x[i] = v, x.a = v: writes into x, and stores v where the analysis cannot follow it
            self.store_into(target)
            if may_be_h:
                self.escape()

    def store_into(self, target) -> None:
        """A write into ``target``'s object (``x[i] = ...``, ``x.a = ...``): changes h when x may be h."""
        if isinstance(target, ast.Subscript):
            self.operand(target.slice)
        if isinstance(target, (ast.Subscript, ast.Attribute)) and self.value(target.value):
            self.modified = True
        elif not isinstance(target, (ast.Subscript, ast.Attribute)):
            raise _Unsupported(f"an assignment to `{ast.unparse(target)}`")

    # expressions -------------------------------------------------------------------------------
    def escape(self) -> None:
        self.escaped = self.modified = True

    def consume(self, e) -> bool:
        """``e`` used where the analysis cannot follow it: if it may be h, h escapes."""
        may_be_h = self.value(e)
        if may_be_h:
            self.escape()
        return may_be_h

    def operand(self, e) -> None:
        """``e`` only read (an arithmetic operand, a condition): nothing escapes."""
        self.value(e)

    def value(self, e) -> bool:
        """May ``e`` evaluate to ``h`` or a view of it? Records changes and escapes on the way."""
        if e is None or isinstance(e, ast.Constant):
            return False
        if isinstance(e, ast.Name):
            return e.id in self.aliases
        if isinstance(e, ast.BinOp):  # tensors: a new result
            self.operand(e.left)
            self.operand(e.right)
            return False
        if isinstance(e, ast.UnaryOp):
            self.operand(e.operand)
            return False
        if isinstance(e, ast.Compare):
            for part in [e.left, *e.comparators]:
                self.operand(part)
            return False
        if isinstance(e, ast.BoolOp):  # `a or h` is h itself
            return any([self.value(v) for v in e.values])
        if isinstance(e, ast.IfExp):
            self.operand(e.test)
            return any([self.value(e.body), self.value(e.orelse)])
        if isinstance(e, ast.Attribute):
            if self.value(e.value):
                if e.attr in _META_ATTRS:
                    return False
                if e.attr not in _VIEW_ATTRS:
                    self.escape()
                return True
            return self.escaped
        if isinstance(e, ast.Subscript):
            base = self.value(e.value)
            self.operand(e.slice)
            return base or self.escaped
        if isinstance(e, ast.Slice):
            for part in (e.lower, e.upper, e.step):
                self.operand(part)
            return False
        if isinstance(e, ast.Call):
            return self.call(e)
        if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
            for element in e.elts:
                self.consume(element.value if isinstance(element, ast.Starred) else element)
            return self.escaped
        if isinstance(e, ast.Dict):
            for key, value in zip(e.keys, e.values):  # evaluated pair by pair
                self.consume(key)
                self.consume(value)
            return self.escaped
        if isinstance(e, (ast.JoinedStr, ast.FormattedValue)):
            for child in ast.iter_child_nodes(e):
                self.operand(child)
            return False
        if isinstance(e, (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)):
            raise _Unsupported(f"`{ast.unparse(e)}`")
        # lambdas, comprehensions, anything else: an alias inside escapes
        if self._mentions_alias(e):
            self.escape()
        for child in ast.walk(e):
            if isinstance(child, ast.Call) and child is self.flow.call:
                raise _Unsupported("the norm call sits inside a lambda or comprehension")
        return self.escaped

    def call(self, e: ast.Call) -> bool:
        func = e.func
        if e is self.flow.call:
            arg = e.args[0]
            if self.live and arg.id in self.aliases and self.modified:
                self.flow.risk = self.flow.risk or (
                    f"the sum may be changed in place (or passed where it could be) before "
                    f"self.{func.attr}({arg.id}), which torch.compile and inference mode cannot check at run time")
            return False
        if isinstance(func, ast.Attribute) and not (isinstance(func.value, ast.Name)
                                                    and func.value.id == self.flow.self_name):
            if self.value(func.value):  # a method of h
                for arg in [*e.args, *(k.value for k in e.keywords)]:
                    self.consume(arg)
                method = func.attr
                if method in _META_METHODS or method in _FRESH_METHODS:
                    return False
                if method in _VIEW_METHODS:
                    return True
                if method.endswith("_") and not method.startswith("__"):
                    self.modified = True  # in place; returns h
                    return True
                self.escape()
                return True
        elif (isinstance(func, ast.Attribute) and func.attr in self.flow.pure
              and not e.keywords and len(e.args) == 1 and not isinstance(e.args[0], ast.Starred)):
            self.operand(e.args[0])  # a candidate norm only reads its input
            return False
        else:
            self.operand(func)
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in _FRAME_ACCESS and self.aliases:
                self.escape()  # exec("h.mul_(2)") needs no argument to reach h
        for arg in [*e.args, *(k.value for k in e.keywords)]:
            self.consume(arg.value if isinstance(arg, ast.Starred) else arg)
        return self.escaped

    def _mentions_alias(self, node) -> bool:
        return any(isinstance(n, ast.Name) and n.id in self.aliases for n in ast.walk(node))
