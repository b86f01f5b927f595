"""The layers of ``src/normfold`` import only what the dependency rules allow (docs/CONTRIBUTING.md).

The import graph is read from the source with ``ast``: module-level and function-local imports,
absolute and relative. Imports under ``if TYPE_CHECKING:`` never run; they are read too
(``type_only=True``) and held to the same rules: no import runs upward, even for a type.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "normfold"

# the layers that see everything: the package's top level, its composition module and the command line
TOP = {"normfold", "convert", "folders", "cli", "__main__"}

# leaf modules every layer may use: optional-dependency imports, progress output, the command lines'
# option spelling, the wording of exceptions and dtypes
LEAVES = {"_deps", "_progress", "_options", "_text"}

# layer -> the only layers it may import (itself and the leaves besides): every package has a rule
ONLY = {
    **{leaf: set() for leaf in LEAVES},
    "ops": set(),
    "nn": {"ops"},
    "engine": {"ops", "nn"},  # the engine
    # the steps built on the exact fold: fusion, rotation and the lab (lab and hf never import each other)
    "fuse": {"ops", "nn", "engine"},
    "quantize": {"ops", "nn", "engine"},  # fake quantization, and what a learned rotation is trained for
    "rotate": {"ops", "nn", "engine", "quantize"},
    "lab": {"ops", "nn", "engine"},
    "hf": {"ops", "nn", "engine"},
    "train": {"ops", "nn", "engine"},  # CBWC and the GPT harness: the engine's CheckpointError, never hf
    "bench": {"ops", "nn", "engine", "fuse", "hf"},  # times the fold and fusion on Hugging Face models
    # ONNX export: exports what the lower layers made; never hf, lab or the CLI
    "export": {"ops", "nn", "engine", "fuse"},
}
# layer -> layers it must never import (besides TOP, which no lower layer imports); implied by ONLY, spelled
# out for the reader
NEVER = {
    "engine": {"hf", "lab", "train", "fuse", "bench", "rotate"},
    "lab": {"hf"},
    # hf runs the steps above the engine through the registry (normfold.engine.steps), never importing them
    "hf": {"lab", "fuse", "rotate"},
}

# ------------------------------------------------------------------------------------ the graph

def module_name(path: Path, root: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, type_only: bool = False):
    """Import nodes anywhere in the tree (function bodies included); those under ``if TYPE_CHECKING:``
    only with ``type_only``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_only:
            yield from (n for child in node.orelse for n in _imports_in(child, type_only))
            continue
        yield from _imports_in(node, type_only)


def _imports_in(node: ast.AST, type_only: bool):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    yield from _imports(node, type_only)


def import_edges(root: Path, type_only: bool = False) -> set[tuple[str, str]]:
    """``(importer, imported)`` module pairs inside the package at ``root``: the imports that run, and
    with ``type_only`` those under ``if TYPE_CHECKING:`` too."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    edges = set()
    for importer, path in files.items():
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path)), type_only):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                # `from pkg import name` imports the module pkg.name when there is one, else pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            edges |= {(importer, t) for t in targets if t.split(".")[0] == root.name and t != importer}
    return edges


def layer(module: str) -> str:
    """``normfold.engine.plan`` -> ``engine``; the package itself -> ``normfold``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def violations(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """The edges that break a rule."""
    bad = set()
    for importer, imported in edges:
        src, dst = layer(importer), layer(imported)
        if src == dst or src in TOP:
            continue
        if dst in TOP or (dst not in LEAVES and dst not in ONLY.get(src, {dst})) or dst in NEVER.get(src, ()):
            bad.add((importer, imported))
    return bad


# ------------------------------------------------------------------------------------ the rules

def test_normfold_layers_import_only_what_the_rules_allow():
    edges = import_edges(SRC)
    assert len(edges) > 50 and {layer(a) for a, _ in edges} >= {"ops", "nn", "engine", "fuse", "lab", "hf"}
    unexpected = violations(edges)  # no allowances: every edge keeps the rules
    assert not unexpected, "imports that break docs/CONTRIBUTING.md's dependency rules:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in sorted(unexpected))


def test_the_engine_does_not_import_fusion_or_the_lab():
    """The approximate fold and fusion compose at the top level (normfold.convert), not inside the engine (normfold.engine)."""
    from_engine = {b for a, b in import_edges(SRC) if layer(a) == "engine"}
    assert not {layer(b) for b in from_engine} & {"fuse", "lab", "hf", "normfold", "convert"}


def test_every_package_has_a_rule():
    """A new package (or leaf module) must say what it may import before it can land."""
    layers = {layer(m) for edge in import_edges(SRC, type_only=True) for m in edge}
    assert layers >= {"train", "bench", "rotate", "lab", "hf"}
    assert not layers - set(ONLY) - TOP, f"packages with no rule in ONLY: {sorted(layers - set(ONLY) - TOP)}"


def test_the_rules_run_one_way():
    """No layer may import a layer that may import it, however indirectly: the layers form a stack,
    so no import can run upward."""
    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in ONLY.get(todo.pop(), set()) - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen
    assert not [name for name in ONLY if name in reachable(name)]
    assert all(not ONLY[leaf] for leaf in LEAVES)


def import_cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The groups of two or more modules that import each other, directly or around a loop (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_modules_import_each_other_even_for_types():
    """A type two modules share lives below both (``engine.analyzed_norm``), never in one of them under
    ``if TYPE_CHECKING:``."""
    assert import_cycles(import_edges(SRC, type_only=True)) == []


def test_a_cycle_through_a_type_only_import_is_found(tmp_path):
    root = _package(tmp_path, {"engine/analysis.py": "from .affine import steps\n", "engine/affine.py": """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from .analysis import Norm
        """})
    assert import_cycles(import_edges(root)) == []
    assert import_cycles(import_edges(root, type_only=True)) == [["normfold.engine.affine", "normfold.engine.analysis"]]


@pytest.mark.parametrize("importer_layer", sorted(ONLY))
def test_type_only_imports_keep_the_rules_too(importer_layer):
    edges = {(a, b) for a, b in import_edges(SRC, type_only=True) if layer(a) == importer_layer}
    unexpected = violations(edges)
    assert not unexpected, "imports (TYPE_CHECKING ones included) that run upward:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in sorted(unexpected))


def private_imports(root: Path) -> list[str]:
    """``file:line: name`` for each private name (``_x``, not a module) imported from another module."""
    found = []
    for path in sorted(root.rglob("*.py")):
        importer = module_name(path, root)
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or not _imports_package(node, root.name):
                continue
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])])
            folder = root.parent.joinpath(*base.split("."))
            for alias in node.names:
                is_module = (folder / f"{alias.name}.py").is_file() or (folder / alias.name / "__init__.py").is_file()
                if alias.name.startswith("_") and not alias.name.startswith("__") and not is_module:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {alias.name}")
    return found


def test_no_private_name_is_imported_across_modules():
    """A name another module needs is public where it is defined (private modules such as ``ops._checks``
    may be imported; their private names may not)."""
    found = private_imports(SRC)
    assert not found, "make these public where they are defined, or move them:\n" + "\n".join(found)


def test_a_private_import_is_found_and_a_private_module_is_not(tmp_path):
    root = _package(tmp_path, {"hf/load.py": "def _first_line(e):\n    return e\n",
                               "hf/saving.py": "from .load import _first_line\nfrom . import _private_module\n",
                               "hf/_private_module.py": "", "engine/plan.py": "from ..hf.load import __doc__\n"})
    assert private_imports(root) == ["normfold/hf/saving.py:1: _first_line"]


# Function-local imports of normfold modules hide the import graph from a reader; one stays only to break a
# real import cycle, and says so on its line: `# not at the top: <the cycle>` (docs/CONTRIBUTING.md).
CYCLE_MARK = "not at the top:"


def local_imports(root: Path) -> list[str]:
    """``file:line: import`` for every unmarked import of a package module inside a function body."""
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        for function in ast.walk(ast.parse(source, str(path))):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if not _imports_package(node, root.name):
                    continue
                text = "\n".join(lines[node.lineno - 2: node.end_lineno])  # the line above and the statement
                if CYCLE_MARK not in text:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def _imports_package(node: ast.AST, package: str) -> bool:
    if isinstance(node, ast.ImportFrom):
        return bool(node.level) or (node.module or "").split(".")[0] == package
    return isinstance(node, ast.Import) and any(a.name.split(".")[0] == package for a in node.names)


def test_normfold_modules_are_imported_at_the_top():
    found = local_imports(SRC)
    assert not found, (f"import these at the module top, or say which cycle the import breaks ('# {CYCLE_MARK} "
                       "...'):\n" + "\n".join(found))


@pytest.mark.parametrize("module", ["normfold", "normfold.cli"])
def test_importing_normfold_loads_no_optional_dependency(module):
    """`import normfold` and the command's parser need only torch: transformers, triton, matplotlib and rich
    load when a feature uses them."""
    optional = ("transformers", "triton", "matplotlib", "rich", "safetensors", "onnx", "onnxscript", "onnxruntime")
    code = f"import sys, {module}; print(' '.join(m for m in {optional!r} if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []


# ---------------------------------------------------------------- the checker on a made-up package

def test_a_function_local_import_is_found_unless_it_names_its_cycle(tmp_path):
    root = _package(tmp_path, {"hf/folder.py": """
        import json

        def fold():
            from .saving import save  # a plain local import: found
            import transformers  # an optional dependency: fine
            from . import streaming  # not at the top: streaming imports this module
        """, "hf/saving.py": "", "hf/streaming.py": ""})
    assert local_imports(root) == ["normfold/hf/folder.py:5: from .saving import save  # a plain local import: found"]


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "normfold"
    for name, source in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    for folder in {p.parent for p in root.rglob("*.py")}:
        (folder / "__init__.py").touch()
    return root


@pytest.mark.parametrize("source, edge", [
    ("from ..lab.approximate import approximate_fold\n", ("normfold.engine.engine", "normfold.lab.approximate")),
    ("def f():\n    from ..fuse import fuse_residual_norms\n", ("normfold.engine.engine", "normfold.fuse")),
    ("import normfold.hf.load\n", ("normfold.engine.engine", "normfold.hf.load")),
    ("from .. import convert\n", ("normfold.engine.engine", "normfold.convert")),
    ("from normfold import FoldReport\n", ("normfold.engine.engine", "normfold")),
])
def test_a_forbidden_import_is_found_however_it_is_written(tmp_path, source, edge):
    root = _package(tmp_path, {"engine/engine.py": source, "lab/approximate.py": "", "fuse/__init__.py": "",
                               "hf/load.py": "", "convert.py": ""})
    assert edge in import_edges(root)
    assert violations(import_edges(root)) == {edge}


def test_allowed_and_type_only_imports_are_not_violations(tmp_path):
    root = _package(tmp_path, {
        "engine/engine.py": """
            from typing import TYPE_CHECKING
            from ..nn import RMSNorm
            from . import plan
            if TYPE_CHECKING:
                from ..lab.approximate import ApproximateReport
            """,
        "engine/plan.py": "", "nn/__init__.py": "from ..ops import rms_norm\n", "ops/__init__.py": "",
        "lab/approximate.py": "from ..engine import engine\n",
        "convert.py": "from .lab.approximate import x\nfrom .hf import load\n", "hf/load.py": "",
    })
    edges = import_edges(root)
    assert ("normfold.engine.engine", "normfold.engine.plan") in edges
    assert ("normfold.engine.engine", "normfold.lab.approximate") not in edges
    assert violations(edges) == set()


@pytest.mark.parametrize("importer, imported", [
    ("nn/modules.py", "from ..engine import plan\n"),
    ("ops/functional.py", "from ..nn import RMSNorm\n"),
    ("fuse/rewrite.py", "from ..hf import load\n"),
    ("hf/folder.py", "from ..lab import approximate\n"),
    ("lab/check.py", "from ..hf import load\n"),
    ("train/cbwc.py", "from ..cli import main\n"),
    # train and bench have rules too, and the leaves are no way around them
    ("train/trainer.py", "from ..hf.load import CheckpointError\n"),
    ("train/cbwc.py", "from ..lab import approximate\n"),
    ("bench/driver.py", "from ..lab import approximate\n"),
    ("bench/driver.py", "from ..rotate import apply\n"),
    ("engine/plan.py", "from ..rotate import apply\n"),
    ("ops/functional.py", "from .._text import first_line\nfrom ..engine import plan\n"),
])
def test_each_rule_refuses_its_forbidden_layer(tmp_path, importer, imported):
    files = {"engine/plan.py": "", "nn/__init__.py": "", "hf/load.py": "", "lab/approximate.py": "", "cli.py": "",
             "rotate/apply.py": "", "_text.py": "", importer: imported}
    assert len(violations(import_edges(_package(tmp_path, files)))) == 1


def test_a_type_only_import_is_read_when_asked_and_breaks_the_rules_like_any_other(tmp_path):
    root = _package(tmp_path, {"engine/report.py": """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from ..lab.approximate import ApproximateReport
        """, "lab/approximate.py": ""})
    assert import_edges(root) == set()
    assert violations(import_edges(root, type_only=True)) == {("normfold.engine.report", "normfold.lab.approximate")}
