"""transformers' own tiny configs and inputs, from a checkout of its test suite (which is not on PyPI):
each ``tests/models/<module>/test_modeling_<module>.py`` has a ``<Name>ModelTester`` whose
``prepare_config_and_inputs_for_common()`` returns ``(config, inputs_dict)``.

The file is not imported: it imports ``test_modeling_common`` and the rest of the suite, which a partial
checkout lacks. It is parsed (``ast``) and only its module-level imports, constants, functions and
non-test classes are run, one statement at a time (a statement that fails is left out), in a namespace
that holds transformers' classes and normfold's own small equivalents of the suite's helpers
(``ids_tensor``, ``floats_tensor``, ``random_attention_mask``). A base tester another file of the suite
defines (``from ...causal_lm_tester import CausalLMModelTester``) is loaded from the checkout the same way;
names imported from ``transformers.testing_utils`` are the literal constants of the checkout's own
``src/transformers/testing_utils.py`` (the testers' defaults) or else pass-through decorators.
The tester is made with a stub ``unittest.TestCase`` as its parent.

    config, inputs, tester = tester_inputs("llava_next", Path("/tmp/transformers-tests"), seed=0)
"""
from __future__ import annotations

import ast
import contextlib
import functools
import random
import unittest
from pathlib import Path

import torch

# the suite's modules whose names the namespace provides itself (never loaded from the checkout)
_SUITE_HELPER_MODULES = ("test_modeling_common", "test_configuration_common", "generation.test_utils",
                         "test_pipeline_mixin", "test_processing_common", "test_image_processing_common",
                         "test_feature_extraction_common", "test_tokenization_common", "test_video_processing_common",
                         "test_sequence_feature_extraction_common", "test_backbone_common")
LABEL_KEYS = ("labels", "start_positions", "end_positions", "next_sentence_label", "mc_labels",
              "sentence_order_label", "mask_labels", "class_labels",
              "return_loss")  # a training loss asked for (CLIP's over 13 texts and 12 images fails): no label, no fold input


class TesterError(Exception):
    """No tester of this model type could be loaded from the checkout (the reason is the message)."""


def ids_tensor(shape, vocab_size, rng=None, name=None):
    """(shape) int64 ids drawn uniformly from [0, vocab_size) (the suite's signature; ``rng`` unused:
    the draws come from torch's seeded generator)."""
    return torch.randint(0, int(vocab_size), tuple(shape), dtype=torch.long)


def floats_tensor(shape, scale=1.0, rng=None, name=None):
    """(shape) float32 values drawn uniformly from [0, scale)."""
    return torch.rand(tuple(shape), dtype=torch.float32) * scale


def random_attention_mask(shape, rng=None, name=None):
    """(shape) 0/1 int64 mask, random, with the last position of every row attended (no row masked out)."""
    mask = ids_tensor(shape, 2)
    mask[..., -1] = 1
    return mask


def _helpers() -> dict:
    """What the namespace provides before the file's own statements run."""
    return {"torch": torch, "torch_device": "cpu", "ids_tensor": ids_tensor, "floats_tensor": floats_tensor,
            "random_attention_mask": random_attention_mask, "is_torch_available": lambda: True,
            "global_rng": random.Random(0), "unittest": unittest, "__name__": "_transformers_tester"}


def _pass_through(*args, **kwargs):
    """A decorator of the suite's ``testing_utils`` (``@require_torch``, ``@is_flaky(...)``): the class or
    function unchanged, used bare or called with options."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda target: target


class _Parent(unittest.TestCase):
    """The stub test case a tester is made with (its ``parent``)."""

    def runTest(self):  # unittest's name
        pass


def tester_file(root: Path, model_type: str) -> Path:
    """``<root>/tests/models/<module>/test_modeling_<module>.py`` of a model type."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name  # not at the top: optional

    module = model_type_to_module_name(model_type)
    return Path(root) / "tests" / "models" / module / f"test_modeling_{module}.py"


def load_namespace(path: Path, root: Path) -> dict:
    """The namespace of one test file's module-level statements that run (see the module docstring)."""
    tree = ast.parse(Path(path).read_text(), filename=str(path))
    namespace = _helpers()
    for statement in _top_statements(tree.body):
        if isinstance(statement, ast.ImportFrom) and statement.level > 0:
            _import_from_suite(statement, namespace, Path(path), Path(root))
            continue
        if isinstance(statement, ast.ClassDef) and _is_test_case(statement):
            continue
        if isinstance(statement, ast.ImportFrom) and (statement.module or "").startswith("transformers.testing_utils"):
            constants = testing_utils_constants(Path(root))
            for alias in statement.names:  # its constants as the checkout wrote them; decorators pass through
                namespace.setdefault(alias.asname or alias.name, constants.get(alias.name, _pass_through))
            continue
        try:
            exec(compile(ast.Module([statement], []), str(path), "exec"), namespace)  # noqa: S102  the suite's own file
        except Exception:  # noqa: BLE001, S110  a statement the partial checkout cannot run is left out
            pass
    return namespace


@functools.lru_cache(maxsize=4)  # read once per checkout, not once per import statement
def testing_utils_constants(root: Path) -> dict:
    """The literal module-level constants of the checkout's ``src/transformers/testing_utils.py`` (the
    testers' defaults, ``_TEXT_MODEL_TESTER_DEFAULTS``, ``_COMMON_MODEL_NAMES_MAP``: they change with the
    suite, so the installed transformers' copy may lack them); empty without that file."""
    path = Path(root) / "src" / "transformers" / "testing_utils.py"
    if not path.is_file():
        return {}
    constants = {}
    for statement in _top_statements(ast.parse(path.read_text(), filename=str(path)).body):
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and isinstance(statement.targets[0], ast.Name):
            with contextlib.suppress(ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                constants[statement.targets[0].id] = ast.literal_eval(statement.value)
    return constants


def _top_statements(body: list) -> list:
    """Module-level statements, with the bodies of ``if is_torch_available():`` blocks (and the like) inlined."""
    out = []
    for statement in body:
        if isinstance(statement, ast.If):
            out += _top_statements(statement.body)
        elif isinstance(statement, (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign, ast.FunctionDef,
                                    ast.ClassDef)):
            out.append(statement)
    return out


def _is_test_case(node: ast.ClassDef) -> bool:
    """A unittest class of the file (its tests, not a tester)."""
    if node.name.endswith("Tester"):  # a tester, whatever it subclasses
        return False
    bases = {ast.unparse(b) for b in node.bases}
    return any("TestCase" in b or b.endswith("Mixin") for b in bases) or node.name.endswith("Test")


def _import_from_suite(statement: ast.ImportFrom, namespace: dict, path: Path, root: Path) -> None:
    """``from ...x import a`` inside the suite: the helpers' modules are provided, another file of the
    suite (a base tester) is loaded from the checkout the same way as the test file."""
    module = statement.module or ""
    if module in _SUITE_HELPER_MODULES:
        for alias in statement.names:  # a mixin a tester subclasses (PvtV2ModelTester(ModelTesterMixin)): empty
            if alias.name.endswith("Mixin"):
                namespace.setdefault(alias.asname or alias.name, type(alias.name, (), {}))
        return
    base = path.parent
    for _ in range(statement.level - 1):
        base = base.parent
    source = base.joinpath(*module.split(".")).with_suffix(".py")
    if not source.is_file() or source.resolve() == path.resolve():
        return
    loaded = load_namespace(source, root)
    for alias in statement.names:
        if alias.name in loaded:
            namespace[alias.asname or alias.name] = loaded[alias.name]


def tested_classes(model_type: str, root: Path) -> set[str]:
    """The model classes the type's test file runs its testers' inputs on: the names in the
    ``all_model_classes`` of its test cases (read from the source, not run); empty when it names none."""
    path = tester_file(root, model_type)
    if not path.is_file():
        return set()
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.ClassDef) and _is_test_case(node)):
            continue
        for statement in node.body:
            if isinstance(statement, ast.Assign) and any(getattr(t, "id", None) == "all_model_classes"
                                                         for t in statement.targets):
                value = statement.value.body if isinstance(statement.value, ast.IfExp) else statement.value
                names |= {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
    return names


def tester_classes(namespace: dict) -> list[type]:
    """The tester classes of a namespace, ``*ModelTester`` first."""
    found = [v for k, v in namespace.items() if isinstance(v, type) and k.endswith("Tester")
             and hasattr(v, "prepare_config_and_inputs_for_common")]
    return sorted(found, key=lambda cls: not cls.__name__.endswith("ModelTester"))


def tester_inputs(model_type: str, root: Path, seed: int = 0, model_class: type | None = None):
    """``(config, inputs, tester name)``: the first tester of the type's file whose config is of this model
    type, its inputs drawn under ``torch.manual_seed(seed)`` with the label inputs left out (those it makes
    for ``model_class`` where it makes inputs per class: Perceiver's ids for its masked LM, floats for its
    bare model); TesterError naming why when there is none."""
    path = tester_file(root, model_type)
    if not path.is_file():
        raise TesterError(f"no file {path.relative_to(root)}")
    namespace = load_namespace(path, root)
    classes = tester_classes(namespace)
    if not classes:
        raise TesterError(f"no *Tester class with prepare_config_and_inputs_for_common loaded from {path.name}")
    tried = []
    for cls in classes:
        try:
            torch.manual_seed(seed)
            tester = cls(_Parent())
            if model_class is not None and hasattr(tester, "prepare_config_and_inputs_for_model_class"):
                config, inputs = tester.prepare_config_and_inputs_for_model_class(model_class)
            else:
                config, inputs = tester.prepare_config_and_inputs_for_common()
        except Exception as err:  # noqa: BLE001  the suite's own code on a partial checkout: reported
            tried.append(f"{cls.__name__}: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:150]}")
            continue
        if getattr(config, "model_type", None) == model_type:
            return config, {k: v for k, v in inputs.items() if k not in LABEL_KEYS}, cls.__name__
        tried.append(f"{cls.__name__}: config of type {getattr(config, 'model_type', None)!r}")
    raise TesterError("no tester gives this type's config: " + "; ".join(tried))
