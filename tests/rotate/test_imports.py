"""rotate builds on the fold engine through its public names only, so the engine can rename its
private helpers without breaking rotation."""
from __future__ import annotations

import ast
from pathlib import Path

from normfold.rotate import closure

ROTATE = Path(closure.__file__).parent  # normfold.rotate is also the function's name

NOT_YET_PUBLIC: set[tuple[str, str]] = set()  # none left: engine.verify's helpers are public


def _private_fold_imports(source: str) -> set[tuple[str, str]]:
    """(engine module, name) for every ``from ..engine.X import _name`` (or normfold.engine.X) in ``source``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or node.module is None:
            continue
        module = node.module.removeprefix("normfold.") if node.level == 0 else node.module
        if (node.level == 0 and not node.module.startswith("normfold.")) or not module.startswith("engine"):
            continue
        found |= {(module, alias.name) for alias in node.names if alias.name.startswith("_")}
    return found


def test_rotate_imports_no_private_name_of_the_fold_engine():
    found = set().union(*(_private_fold_imports(path.read_text()) for path in ROTATE.glob("*.py")))
    assert found <= NOT_YET_PUBLIC, f"rotate imports private names of fold: {sorted(found - NOT_YET_PUBLIC)}"


def test_a_private_import_from_the_engine_is_found_however_it_is_written():
    source = ("from ..engine.analysis import _Walker, Need\n"
              "from normfold.engine.graph import _hidden\n"
              "from ..engine import _top\n"
              "from .closure import _local\n"
              "from torch.fold import _other\n")
    assert _private_fold_imports(source) == {("engine.analysis", "_Walker"), ("engine.graph", "_hidden"),
                                             ("engine", "_top")}
