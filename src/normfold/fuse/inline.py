"""Inline small helper functions into a parsed ``forward``, so the adds inside them become visible.

BLOOM and Falcon add their residuals through a module-level helper,

    def dropout_add(x, residual, prob, training):
        out = F.dropout(x, p=prob, training=training)
        out = residual + out
        return out

called as ``output = dropout_add(h, residual, self.hidden_dropout, self.training)``. Written out in
place, with the helper's locals renamed apart, the call becomes statements of the caller, and the add
``out = residual + out`` a statement that ``fuse_residual_norms`` can pair with the norm it feeds.

Only helpers that inline to the same computation are taken: a plain function defined in the caller's
module (same globals, so its global names mean the same), no closure or decorators, fixed positional
or keyword parameters, each one given by the call, and a body of single-name assignments ending in
one ``return``. Its global names must not be locals of the caller. Anything else stays a call.
"""
from __future__ import annotations

import __future__
import ast
import copy
import functools
import linecache
import types
from typing import Callable

_PREFIX = "_nf_in"


def inline_helper_calls(tree: ast.FunctionDef, module_globals: dict, wanted: Callable[[ast.expr], object],
                        refused: dict[str, str] | None = None) -> dict[int, str]:
    """Replace, in place, each ``NAME = helper(...)`` statement of ``tree`` that may be inlined.

    Only helpers with an assignment whose value ``wanted`` accepts (returns something not None:
    the caller's own test for an add site) are inlined. Returns ``{id(assignment): description}``
    for those assignments (the description names the call and the helper's own line, for reports).
    ``refused`` (if given) receives ``{helper name: why}`` for helpers left as calls because their
    source on disk is not the code that runs.
    """
    caller_locals = _local_names(tree)
    described: dict[int, str] = {}
    counter = [0]

    def rewrite(statements: list[ast.stmt]) -> list[ast.stmt]:
        out = []
        for stmt in statements:
            for name in ("body", "orelse", "finalbody"):
                if isinstance(getattr(stmt, name, None), list) and not isinstance(
                        stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    setattr(stmt, name, rewrite(getattr(stmt, name)))
            for handler in getattr(stmt, "handlers", []):
                handler.body = rewrite(handler.body)
            inlined = _inline(stmt, module_globals, wanted, caller_locals, f"{_PREFIX}{counter[0]}_", described,
                              {} if refused is None else refused)
            if inlined is None:
                out.append(stmt)
            else:
                counter[0] += 1
                out += inlined
        return out

    tree.body = rewrite(tree.body)
    return described


def _inline(stmt: ast.stmt, module_globals: dict, wanted, caller_locals: set[str], prefix: str,
            described: dict[int, str], refused: dict[str, str]) -> list[ast.stmt] | None:
    """The statements replacing ``stmt`` (``NAME = helper(...)``), or None when it is not inlined."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name)):
        return None
    call = stmt.value
    inlinable = _inlinable(module_globals.get(call.func.id), module_globals, wanted)
    if isinstance(inlinable, str):
        refused[call.func.id] = inlinable
    if not isinstance(inlinable, tuple) or call.func.id in caller_locals:
        return None
    params, body = inlinable
    bound = _bind(call, params)
    helper_locals = set(params) | {s.targets[0].id for s in body[:-1]}
    helper_globals = {n.id for s in body for n in ast.walk(s) if isinstance(n, ast.Name)} - helper_locals
    if bound is None or helper_globals & caller_locals:
        return None

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node):
            return ast.copy_location(ast.Name(prefix + node.id, node.ctx), node) if node.id in helper_locals else node

    out = [ast.Assign([ast.Name(prefix + p, ast.Store())], value) for p, value in bound.items()]
    call_source = ast.unparse(stmt)
    for s in body[:-1]:
        renamed = Rename().visit(copy.deepcopy(s))
        if wanted(s.value) is not None:
            described[id(renamed)] = f"{call_source}  ({call.func.id}: {ast.unparse(s)})"
        out.append(renamed)
    out.append(ast.Assign([stmt.targets[0]], Rename().visit(copy.deepcopy(body[-1].value))))
    return [ast.copy_location(s, stmt) for s in out]


def _inlinable(helper, module_globals: dict, wanted) -> tuple[list[str], list[ast.stmt]] | str | None:
    """``(parameter names, body without docstring)`` of ``helper`` when it may be inlined (module docstring);
    why not when its source is not the running code, None for the other helpers left alone."""
    if not isinstance(helper, types.FunctionType) or helper.__globals__ is not module_globals:
        return None
    if helper.__code__.co_freevars or hasattr(helper, "__wrapped__"):
        return None
    definition, mismatch = running_definition(helper)
    if definition is None:
        return mismatch
    if definition.decorator_list:
        return None
    args = definition.args
    if args.posonlyargs or args.vararg or args.kwonlyargs or args.kwarg:
        return None
    body = definition.body[1:] if is_docstring(definition.body[0]) else definition.body
    if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return None
    if not all(isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)
               for s in body[:-1]):
        return None
    if not any(wanted(s.value) is not None for s in body[:-1]):
        return None  # nothing the caller could use
    if any(isinstance(n, (ast.Lambda, ast.NamedExpr, ast.Yield, ast.YieldFrom, ast.Await,
                          ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)) for s in body for n in ast.walk(s)):
        return None  # own scopes or control flow inside an expression
    return [a.arg for a in args.args], body


def _bind(call: ast.Call, params: list[str]) -> dict[str, ast.expr] | None:
    """Parameter -> argument expression, when the call gives every parameter exactly once, plainly."""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None
    if len(call.args) > len(params):
        return None
    bound = dict(zip(params, call.args))
    for keyword in call.keywords:
        if keyword.arg not in params or keyword.arg in bound:
            return None
        bound[keyword.arg] = keyword.value
    if set(bound) != set(params):
        return None  # a default would be used: not inlined
    # arguments are evaluated in the call's order: positional first, then keywords as written
    order = [params[i] for i in range(len(call.args))] + [k.arg for k in call.keywords]
    return {p: bound[p] for p in order}


def _local_names(tree: ast.FunctionDef) -> set[str]:
    """Every name the function binds: parameters and assignment targets (nested scopes included, to be safe)."""
    args = tree.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    names |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


SOURCE_CHANGED = "does not compile to the code that runs (the file changed since it was imported?)"
_FUTURE_FLAGS = 0
for _feature in __future__.all_feature_names:
    _FUTURE_FLAGS |= getattr(__future__, _feature).compiler_flag


def running_definition(function: types.FunctionType) -> tuple[ast.FunctionDef | None, str]:
    """``(definition, '')`` when ``function``'s source file compiles to the code that runs, else ``(None, why)``.

    Source is read from disk (as ``inspect.getsource`` does); if the file changed since the module
    was imported, rewriting that text would put code into the model that never ran in this process.
    So the whole file is parsed and compiled as the module was (its ``from __future__`` flags; the
    whole file, because how a call compiles depends on the module's imports), the function found in
    both by its qualified name, and its code object compared with ``function.__code__``
    (bytecode, constants, names, flags; not line numbers). The definition returned is the tree that
    was compared.
    """
    name, code = function.__qualname__, function.__code__
    linecache.checkcache(code.co_filename)
    text = "".join(linecache.getlines(code.co_filename, function.__globals__))
    path = [part for part in name.split(".") if part != "<locals>"]
    parsed = _parse_and_compile(text, code.co_filename, code.co_flags & _FUTURE_FLAGS) if text else None
    definition = _definition_at(parsed[0], path) if parsed else None
    found = _code_at(parsed[1], path) if parsed else None
    if definition is None or found is None:
        return None, f"the source of {name} is not available"
    if not same_code(found, code):
        return None, f"the source of {name} in {code.co_filename} {SOURCE_CHANGED}"
    return _at_running_lines(copy.deepcopy(definition), found, code), ""  # callers rewrite the tree in place


def _at_running_lines(tree: ast.FunctionDef, found: types.CodeType, code: types.CodeType) -> ast.FunctionDef:
    """``tree`` (parsed from the file as it is now) with the line numbers of the code that runs, which
    tracebacks and a captured graph's ``stack_trace`` name: lines moved since import (``same_code``
    ignores them) are mapped instruction by instruction, the two codes being the same bytecode."""
    running = _line_of_offset(code)
    moved = {disk: running[offset] for offset, disk in _line_of_offset(found).items() if offset in running}
    shift = code.co_firstlineno - found.co_firstlineno   # lines without an instruction of their own
    for node in ast.walk(tree):
        for attr in ("lineno", "end_lineno"):
            line = getattr(node, attr, None)
            if line is not None:
                setattr(node, attr, moved.get(line, line + shift))
    return tree


def _line_of_offset(code: types.CodeType) -> dict[int, int]:
    """Bytecode offset -> source line of each instruction of ``code`` (not of the code nested in it)."""
    return {offset: line for start, end, line in code.co_lines() if line is not None for offset in range(start, end, 2)}


@functools.lru_cache(maxsize=32)
def _parse_and_compile(text: str, filename: str, flags: int) -> tuple[ast.Module, types.CodeType] | None:
    """A source file's tree and module code (cached: every module instance of a model asks for its class's file)."""
    try:
        module = ast.parse(text)
        return module, compile(module, filename, "exec", flags=flags, dont_inherit=True)
    except (SyntaxError, ValueError):
        return None


def _definition_at(node: ast.AST, path: list[str]) -> ast.FunctionDef | None:
    """The one ``def`` reached by following ``path`` (class and function names) down from ``node``."""
    for i, part in enumerate(path):
        matches = [n for n in _own_definitions(node) if n.name == part]
        if len(matches) != 1:
            return None
        node = matches[0]
    return node if isinstance(node, ast.FunctionDef) else None


def _own_definitions(node: ast.AST):
    """Functions and classes defined in ``node``'s own scope (inside ifs, loops, with: not nested defs)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield child
        elif isinstance(child, ast.stmt) or isinstance(child, ast.excepthandler):
            yield from _own_definitions(child)


def _code_at(code: types.CodeType, path: list[str]) -> types.CodeType | None:
    """The one code object reached by following ``path`` through nested code constants."""
    for part in path:
        matches = [c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == part]
        if len(matches) != 1:
            return None
        code = matches[0]
    return code


def same_code(a: types.CodeType, b: types.CodeType) -> bool:
    """True when two code objects run the same: bytecode, constants (nested code compared the same way),
    names, local names, free and cell variables, flags. Line numbers and file names are not compared."""
    if (a.co_code != b.co_code or a.co_names != b.co_names or a.co_varnames != b.co_varnames
            or a.co_freevars != b.co_freevars or a.co_cellvars != b.co_cellvars or a.co_flags != b.co_flags
            or len(a.co_consts) != len(b.co_consts)):
        return False
    for x, y in zip(a.co_consts, b.co_consts):
        if isinstance(x, types.CodeType) or isinstance(y, types.CodeType):
            if not (isinstance(x, types.CodeType) and isinstance(y, types.CodeType) and same_code(x, y)):
                return False
        elif type(x) is not type(y) or repr(x) != repr(y):  # 1 == 1.0, -0.0 == 0.0, nan != nan: not by ==
            return False
    return True


def is_docstring(stmt: ast.stmt) -> bool:
    """True for a string-constant expression statement (a function's docstring, when first)."""
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)
