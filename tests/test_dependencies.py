"""The layers of ``src/normfold`` import only what the dependency rules allow (docs/CONTRIBUTING.md).

The import graph is read from the source with ``ast``: module-level and function-local imports,
absolute and relative; imports under ``if TYPE_CHECKING:`` never run and are left out.
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
TOP = {"normfold", "convert", "cli", "__main__"}

# layer -> the only layers it may import (itself included)
ONLY = {
    # leaf modules every layer may use: optional-dependency imports and progress output
    "_deps": {"_deps"},
    "_progress": {"_progress"},
    "_options": {"_options"},
    "_text": {"_text"},
    "ops": {"ops", "_deps", "_progress"},
    "nn": {"nn", "ops", "_deps", "_progress"},
    "fuse": {"fuse", "ops", "nn", "fold", "_deps", "_progress"},
    # rotation builds on the exact fold and nothing above it
    "rotate": {"rotate", "ops", "nn", "fold", "_deps", "_progress"},
}
# layer -> layers it must never import (besides TOP, which no lower layer imports)
NEVER = {
    "fold": {"hf", "lab", "train", "fuse", "bench"},
    "lab": {"hf"},
    "hf": {"lab"},
}

# ------------------------------------------------------------------------------------ the graph

def module_name(path: Path, root: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import nodes anywhere in the tree (function bodies included) except under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in _imports_in(child))
            continue
        yield from _imports_in(node)


def _imports_in(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    yield from _imports(node)


def import_edges(root: Path) -> set[tuple[str, str]]:
    """``(importer, imported)`` module pairs inside the package at ``root``."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    edges = set()
    for importer, path in files.items():
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
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
    """``normfold.fold.plan`` -> ``fold``; the package itself -> ``normfold``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def violations(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """The edges that break a rule."""
    bad = set()
    for importer, imported in edges:
        src, dst = layer(importer), layer(imported)
        if src == dst or src in TOP:
            continue
        if dst in TOP or (src in ONLY and dst not in ONLY[src]) or dst in NEVER.get(src, ()):
            bad.add((importer, imported))
    return bad


# ------------------------------------------------------------------------------------ the rules

def test_normfold_layers_import_only_what_the_rules_allow():
    edges = import_edges(SRC)
    assert len(edges) > 50 and {layer(a) for a, _ in edges} >= {"ops", "nn", "fold", "fuse", "lab", "hf"}
    unexpected = violations(edges)  # no allowances: every edge keeps the rules
    assert not unexpected, "imports that break docs/CONTRIBUTING.md's dependency rules:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in sorted(unexpected))


def test_the_engine_does_not_import_fusion_or_the_lab():
    """The approximate fold and fusion compose at the top level (normfold.convert), not inside normfold.fold."""
    from_fold = {b for a, b in import_edges(SRC) if layer(a) == "fold"}
    assert not {layer(b) for b in from_fold} & {"fuse", "lab", "hf", "normfold", "convert"}


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
    optional = ("transformers", "triton", "matplotlib", "rich", "safetensors")
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
    ("from ..lab.approximate import approximate_fold\n", ("normfold.fold.engine", "normfold.lab.approximate")),
    ("def f():\n    from ..fuse import fuse_residual_norms\n", ("normfold.fold.engine", "normfold.fuse")),
    ("import normfold.hf.load\n", ("normfold.fold.engine", "normfold.hf.load")),
    ("from .. import convert\n", ("normfold.fold.engine", "normfold.convert")),
    ("from normfold import FoldReport\n", ("normfold.fold.engine", "normfold")),
])
def test_a_forbidden_import_is_found_however_it_is_written(tmp_path, source, edge):
    root = _package(tmp_path, {"fold/engine.py": source, "lab/approximate.py": "", "fuse/__init__.py": "",
                               "hf/load.py": "", "convert.py": ""})
    assert edge in import_edges(root)
    assert violations(import_edges(root)) == {edge}


def test_allowed_and_type_only_imports_are_not_violations(tmp_path):
    root = _package(tmp_path, {
        "fold/engine.py": """
            from typing import TYPE_CHECKING
            from ..nn import RMSNorm
            from . import plan
            if TYPE_CHECKING:
                from ..lab.approximate import ApproximateReport
            """,
        "fold/plan.py": "", "nn/__init__.py": "from ..ops import rms_norm\n", "ops/__init__.py": "",
        "lab/approximate.py": "from ..fold import engine\n",
        "convert.py": "from .lab.approximate import x\nfrom .hf import load\n", "hf/load.py": "",
    })
    edges = import_edges(root)
    assert ("normfold.fold.engine", "normfold.fold.plan") in edges
    assert ("normfold.fold.engine", "normfold.lab.approximate") not in edges
    assert violations(edges) == set()


@pytest.mark.parametrize("importer, imported", [
    ("nn/modules.py", "from ..fold import plan\n"),
    ("ops/functional.py", "from ..nn import RMSNorm\n"),
    ("fuse/rewrite.py", "from ..hf import load\n"),
    ("hf/folder.py", "from ..lab import approximate\n"),
    ("lab/check.py", "from ..hf import load\n"),
    ("train/cbwc.py", "from ..cli import main\n"),
])
def test_each_rule_refuses_its_forbidden_layer(tmp_path, importer, imported):
    files = {importer: imported, "fold/plan.py": "", "nn/__init__.py": "", "hf/load.py": "",
             "lab/approximate.py": "", "cli.py": ""}
    assert len(violations(import_edges(_package(tmp_path, files)))) == 1
