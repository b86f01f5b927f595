"""The source rewrite: parse a module's ``forward``, find its adds and norm calls, generate new forwards.

``ForwardRewrite.parse`` reads the forward's running source (``inline.running_definition``), writes
small helpers out in place (``inline.py``) and lists the candidate sites: ``NAME = A + B`` (or
``(A + B).view(...)``), ``self.<norm>(NAME)`` and ``self.<norm>(A + B)``. From that one parsed tree it
generates the probe forward (where no graph shows the pairs: it records which add's result each norm
call receives, into a ``Probe``) and the fused forward (the pairs of a ``FusePlan`` call
``runtime.add_norm`` / ``runtime.norm_from``), compiled in the original module's globals and rewrapped
in copies of the forward's decorators.
"""
from __future__ import annotations

import ast
import copy
import types
from dataclasses import dataclass, field

from torch import nn

from .inline import inline_helper_calls, is_docstring, running_definition
from .mutation import early_output_risk
from .runtime import Handoff, add_norm, norm_from, norm_of_sum, pending_output, same_rows


@dataclass
class FusePlan:
    """What one parent's fused forward does: pairs inside it, adds handed on, norms handed to."""

    local: list[tuple[int, int]] = field(default_factory=list)           # (add index, call index)
    outgoing: dict[int, tuple[Handoff, nn.Module]] = field(default_factory=dict)   # add index -> (handoff, norm)
    incoming: dict[int, Handoff] = field(default_factory=dict)          # call index -> handoff


class Probe:
    """Model-wide record, during the probe run, of which add's result each norm call received."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, int], object] = {}   # (parent path, add index) -> its latest result
        self.pairs: list[tuple[tuple[str, int], tuple[str, int]]] = []

    def saw(self, parent: str, add_index: int, value) -> None:
        self.seen[(parent, add_index)] = value

    def note(self, parent: str, call_index: int, value):
        for add, result in self.seen.items():
            pair = (add, (parent, call_index))
            if (result is value or same_rows(value, result)) and pair not in self.pairs:
                self.pairs.append(pair)
        return value

    def observed_pairs(self) -> list[tuple[tuple[str, int], tuple[str, int]]]:
        """((parent, add index), (parent, call index)) pairs; an add or a call joins one pair at most (first seen)."""
        used_adds, used_calls, pairs = set(), set(), []
        for add, call in self.pairs:
            if add not in used_adds and call not in used_calls:
                pairs.append((add, call))
                used_adds.add(add)
                used_calls.add(call)
        return pairs



@dataclass
class _AddSite:
    node: ast.Assign   # NAME = A + B, or NAME = (A + B).view(...) / .reshape(...)
    target: str
    source: str


@dataclass
class _CallSite:
    node: ast.Call
    norm: str        # child attribute name
    arg: str         # the variable passed


@dataclass
class _InlineSite:
    node: ast.Call   # self.<norm>(A + B)
    norm: str
    source: str


class ForwardRewrite:
    """The parsed forward of one parent module and the functions generated from it."""

    def __init__(self, function, tree: ast.FunctionDef, adds: list[_AddSite], calls: list[_CallSite],
                 inline: list[_InlineSite], self_name: str) -> None:
        self.function, self.tree, self.adds, self.calls, self.self_name = function, tree, adds, calls, self_name
        self.inline = inline
        self.wrappers: list = []  # decorators around the forward, outermost first
        self.norm_names: frozenset[str] = frozenset()   # the candidate norms among self's children
        self.refused: dict[str, str] = {}               # norm -> why its observed pair was not fused
        self.helpers_refused: dict[str, str] = {}       # helper -> why it was not inlined (source mismatch)

    @classmethod
    def parse(cls, parent: nn.Module, norm_names: list[str]) -> tuple["ForwardRewrite | None", str]:
        function = type(parent).forward
        if "forward" in vars(parent):
            return None, "its parent's forward is already replaced on the instance"
        wrappers = []
        while hasattr(function, "__wrapped__"):  # decorators (functools.wraps) are kept: see _rewrap
            if not _holds(function, function.__wrapped__):
                return None, f"its parent's forward is wrapped by a decorator ({function.__code__.co_name}) " \
                             "that does not hold the function it wraps"
            wrappers.append(function)
            function = function.__wrapped__
        if function.__code__.co_freevars:
            return None, (f"its parent's forward ({function.__qualname__}) uses closure variables "
                          f"{list(function.__code__.co_freevars)} (e.g. super())")
        tree, mismatch = running_definition(function)
        if tree is None:
            return None, mismatch
        if not tree.args.args:
            return None, f"{function.__qualname__} is not a plain method"
        tree.decorator_list = []
        self_name = tree.args.args[0].arg
        helpers_refused: dict[str, str] = {}
        from_helpers = inline_helper_calls(tree, function.__globals__, add_in, helpers_refused)  # BLOOM's dropout_add
        adds, calls, inline = [], [], []
        for node in _walk_body(tree):
            if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and add_in(node.value) is not None):
                adds.append(_AddSite(node, node.targets[0].id, from_helpers.get(id(node), ast.unparse(node))))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == self_name
                    and node.func.attr in norm_names and len(node.args) == 1 and not node.keywords):
                if isinstance(node.args[0], ast.Name):
                    calls.append(_CallSite(node, node.func.attr, node.args[0].id))
                elif _is_add(node.args[0]):
                    inline.append(_InlineSite(node, node.func.attr, ast.unparse(node)))
        if not adds and not calls and not inline:
            return None, (f"{function.__qualname__} has no `name = a + b` (or `(a + b).view(...)`) statement and "
                          "never calls the norm as self.<norm>(name) or self.<norm>(a + b)")
        rewrite = cls(function, tree, adds, calls, inline, self_name)
        rewrite.wrappers, rewrite.norm_names = wrappers, frozenset(norm_names)
        rewrite.helpers_refused = helpers_refused
        return rewrite, ""

    def early_output_risk(self, add_index: int, call_index: int) -> str:
        """Why the pair's early output may be stale at the call ('' when the code proves it never is)."""
        return early_output_risk(self.tree, self.adds[add_index].node, self.calls[call_index].node,
                                 self.self_name, self.norm_names)

    def why_not(self, norm: str, unread: list[str], fed_by: str = "") -> str:
        """Why ``norm`` was not fused; ``unread``: code not rewritten because its source changed on disk;
        ``fed_by``: where the add is that the graph shows feeding it, when it is no parsed add site."""
        if norm in self.refused:
            return self.refused[norm]
        if not any(c.norm == norm for c in self.calls):
            return f"{self.function.__qualname__} never calls it as self.{norm}(name) or self.{norm}(a + b)"
        if fed_by:
            why = (f"its input is {fed_by}, which is no `name = a + b` statement fusion can rewrite (an in-place "
                   "add, an add inside an expression, or in a function that cannot be inlined)")
        else:
            why = ("no `name = a + b` result reaches it unchanged on the example inputs (its input is scaled or "
                   "copied after the add, or added by a function that cannot be inlined)")
        return why + "".join(f"; not rewritten: {why}" for why in unread)

    # the two generated functions -------------------------------------------------------------
    def probe_function(self, probe: Probe, key: str):
        """The forward with ``probe.saw(key, i, NAME)`` after each add, ``probe.note(key, j, NAME)`` per norm call."""
        tree = copy.deepcopy(self.tree)
        adds = {id(a.node): i for i, a in enumerate(self.adds)}
        calls = {id(c.node): j for j, c in enumerate(self.calls)}
        mapping = {id(new): id(old) for new, old in zip(_walk_body(tree), list(_walk_body(self.tree)))}

        class Instrument(ast.NodeTransformer):
            def visit_Assign(self, node):
                self.generic_visit(node)
                i = adds.get(mapping.get(id(node), -1))
                if i is None:
                    return node
                record = ast.parse(f"_nf_probe.saw(_nf_key, {i}, {node.targets[0].id})").body[0]
                return [node, record]

            def visit_Call(self, node):
                j = calls.get(mapping.get(id(node), -1))
                self.generic_visit(node)
                if j is None:
                    return node
                arg = node.args[0].id
                node.args[0] = ast.parse(f"_nf_probe.note(_nf_key, {j}, {arg})", mode="eval").body
                return node

        tree = Instrument().visit(tree)
        return self._compile(tree, {"_nf_probe": probe, "_nf_key": key})

    def fused_function(self, parent: nn.Module, plan: FusePlan):
        """The forward with each paired add fused into its norm call (guarded: see ``norm_from``).

        Handed-on adds reach their norm and handoff through attributes of the instance
        (``self._nf_targets``, ``self._nf_handoffs``), not closure cells, so ``copy.deepcopy`` of the
        model gives the copy's forward the copy's norms.
        """
        tree = copy.deepcopy(self.tree)
        mapping = {id(new): id(old) for new, old in zip(_walk_body(tree), list(_walk_body(self.tree)))}
        pairs = plan.local
        add_pair = {id(self.adds[i].node): i for i, _ in pairs}
        call_pair = {id(self.calls[j].node): i for i, j in pairs}  # observed_pairs: one add per call
        assert len(call_pair) == len(pairs)
        self_name = self.self_name
        call_norm = {i: self.calls[j].norm for i, j in pairs}
        inline = {id(site.node) for site in self.inline}
        outgoing = {id(self.adds[i].node): (k, i) for k, i in enumerate(plan.outgoing)}
        incoming = {id(self.calls[j].node): k for k, j in enumerate(plan.incoming)}
        parent.__dict__["_nf_targets"] = [norm for _, norm in plan.outgoing.values()]  # plain attributes:
        parent.__dict__["_nf_handoffs"] = [h for h, _ in plan.outgoing.values()]       # not submodules
        parent.__dict__["_nf_handoffs_in"] = list(plan.incoming.values())

        class Fuse(ast.NodeTransformer):
            def visit_Assign(self, node):
                original = mapping.get(id(node), -1)
                i = add_pair.get(original)
                self.generic_visit(node)
                if i is None and original not in outgoing:
                    return node
                name, add = node.targets[0].id, add_in(node.value)
                operands = f"({ast.unparse(add.left)}), ({ast.unparse(add.right)})"
                sum_name = name if add is node.value else f"_nf_s{i if i is not None else outgoing[original][1]}"
                if i is None:  # handed on to a norm in another module's forward
                    k, i = outgoing[original]
                    code = f"{sum_name} = {self_name}._nf_handoffs[{k}].add({self_name}._nf_targets[{k}], {operands})"
                    keep = ""
                else:
                    code = f"_nf_y{i}, {sum_name} = _nf_add_norm({self_name}.{call_norm[i]}, {operands})"
                    keep = f"\n_nf_p{i} = _nf_pending({name}, _nf_y{i})"
                if add is not node.value:  # NAME = (A + B).view(...): the view is taken of the sum
                    node.value.func.value = ast.Name(sum_name, ast.Load())
                    code += f"\n{name} = {ast.unparse(node.value)}"
                return ast.parse(code + keep).body

            def visit_Call(self, node):
                original = mapping.get(id(node), -1)
                i = call_pair.get(original)
                self.generic_visit(node)
                if original in inline:
                    add = node.args[0]
                    return ast.parse(f"_nf_norm_of_sum({ast.unparse(node.func)}, ({ast.unparse(add.left)}), "
                                     f"({ast.unparse(add.right)}))", mode="eval").body
                if original in incoming:
                    return ast.parse(f"{self_name}._nf_handoffs_in[{incoming[original]}].norm("
                                     f"{ast.unparse(node.func)}, {node.args[0].id})", mode="eval").body
                if i is None:
                    return node
                return ast.parse(f"_nf_norm_from(_nf_p{i}, {ast.unparse(node.func)}, {node.args[0].id})",
                                 mode="eval").body

        tree = Fuse().visit(tree)
        init = "\n".join(f"_nf_p{i} = None" for i, _ in pairs)
        start = _first_statement(tree)
        tree.body[start:start] = ast.parse(init).body
        return self._compile(tree, {"_nf_add_norm": add_norm, "_nf_norm_of_sum": norm_of_sum,
                                    "_nf_pending": pending_output, "_nf_norm_from": norm_from})

    def _compile(self, tree: ast.FunctionDef, helpers: dict):
        """Compile ``tree`` in the original module's globals; ``helpers`` reach it as closure variables.

        The globals dict is the module's own (not a copy), so torch.compile's guards on globals
        resolve; the helpers live in a factory's closure instead of being added to that module.
        """
        tree.name = self.function.__name__
        factory = ast.FunctionDef(name="_nf_factory", args=ast.arguments(
            posonlyargs=[], args=[ast.arg(arg=name) for name in helpers], kwonlyargs=[], kw_defaults=[], defaults=[]),
            body=[tree, ast.Return(ast.Name(tree.name, ast.Load()))], decorator_list=[], returns=None, type_params=[])
        module = ast.fix_missing_locations(ast.Module(body=[factory], type_ignores=[]))
        namespace: dict = {}
        code = compile(module, f"<normfold fused {self.function.__qualname__}>", "exec")
        exec(code, self.function.__globals__, namespace)  # noqa: S102 (generated from the model's own source)
        new = namespace["_nf_factory"](*helpers.values())
        new.__defaults__, new.__kwdefaults__ = self.function.__defaults__, self.function.__kwdefaults__
        new.__qualname__ = self.function.__qualname__
        return _rewrap(self.wrappers, self.function, new)


def _holds(wrapper, inner) -> bool:
    """True when ``wrapper`` reaches ``inner`` through a closure cell (so a copy can hold another function)."""
    return any(_cell_value(c) is inner for c in wrapper.__closure__ or ())


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # empty cell
        return None


def _rewrap(wrappers: list, original, new):
    """Copies of the decorator functions around ``original``, each holding the new inner function instead.

    A decorator made with ``functools.wraps`` (transformers' ``deprecate_kwarg``, its gradient
    checkpointing wrapper) keeps the wrapped function in a closure cell; the copy gets a fresh cell
    with the rewritten function in its place and otherwise runs the same code.
    """
    inner_old, inner_new = original, new
    for wrapper in reversed(wrappers):
        cells = tuple(types.CellType(inner_new) if _cell_value(c) is inner_old else c for c in wrapper.__closure__)
        copy_ = types.FunctionType(wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__, cells)
        copy_.__kwdefaults__ = wrapper.__kwdefaults__
        copy_.__dict__.update(wrapper.__dict__)
        copy_.__wrapped__ = inner_new
        inner_old, inner_new = wrapper, copy_
    return inner_new


def _is_add(node: ast.AST) -> bool:
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)


def add_in(value: ast.AST) -> ast.BinOp | None:
    """The add of ``A + B`` or of ``(A + B).view(...)`` / ``.reshape(...)`` (OPT's layer end), else None."""
    if _is_add(value):
        return value
    if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in ("view", "reshape")
            and _is_add(value.func.value)):
        return value.func.value
    return None


def _walk_body(tree: ast.FunctionDef):
    """Nodes of the function body in a fixed order, not entering nested functions, lambdas or classes."""
    stack = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _first_statement(tree: ast.FunctionDef) -> int:
    """Index after the docstring, where generated initialisations go."""
    return 1 if tree.body and is_docstring(tree.body[0]) else 0
