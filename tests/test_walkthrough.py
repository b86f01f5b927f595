"""scripts/walkthrough.py (run by ``make wheel-check`` on the installed wheel) fails when a step fails.

The wheel build itself is ``make wheel-check``'s job; these pin the checks it relies on, so that a
broken wheel, a different generation or an empty comparison cannot pass as a working install.
"""
import importlib.util
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "walkthrough.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("walkthrough", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


walkthrough = _load_script()

COMPLETE_WHEEL = [
    "normfold/__init__.py",
    "normfold/ops/csrc/norm_cpu.cpp",
    "normfold/ops/csrc/output_cache.h",
    "normfold/data/default_model/config.json",
    "normfold/data/default_model/model.safetensors",
    "normfold/py.typed",
]


def _wheel(tmp_path, names):
    path = tmp_path / "normfold-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name in names:
            archive.writestr(name, "")
    return path


def test_a_complete_wheel_passes_the_contents_check(tmp_path, capsys):
    walkthrough.check_wheel(_wheel(tmp_path, COMPLETE_WHEEL))
    assert "holds 6 files" in capsys.readouterr().out


@pytest.mark.parametrize("dropped, pattern", [
    ("normfold/ops/csrc/norm_cpu.cpp", "normfold/ops/csrc/*.cpp"),
    ("normfold/ops/csrc/output_cache.h", "normfold/ops/csrc/*.h"),
    ("normfold/data/default_model/model.safetensors", "normfold/data/default_model/model.safetensors"),
    ("normfold/py.typed", "normfold/py.typed"),
])
def test_a_wheel_without_a_file_an_install_needs_is_refused_naming_it(tmp_path, dropped, pattern):
    names = [n for n in COMPLETE_WHEEL if n != dropped]
    with pytest.raises(walkthrough.WalkthroughError, match="lacks files an install needs") as err:
        walkthrough.check_wheel(_wheel(tmp_path, names))
    assert pattern in str(err.value)


def test_a_file_that_is_not_a_wheel_is_refused(tmp_path):
    path = tmp_path / "normfold.whl"
    path.write_text("not a zip")
    with pytest.raises(walkthrough.WalkthroughError, match="expected a wheel"):
        walkthrough.check_wheel(path)


def test_equal_greedy_tokens_of_the_expected_count_pass():
    walkthrough.check_same_tokens([5, 6, 7], [5, 6, 7], expected_count=3)


def test_greedy_tokens_that_differ_fail_naming_the_first_position():
    with pytest.raises(walkthrough.WalkthroughError, match="differ from position 1"):
        walkthrough.check_same_tokens([5, 6, 7], [5, 9, 7], expected_count=3)


@pytest.mark.parametrize("original, fast", [([], []), ([5, 6], [5, 6])])
def test_a_comparison_of_fewer_tokens_than_asked_fails(original, fast):
    """Two empty (or early-stopped) generations are equal but compare nothing (or less than promised)."""
    with pytest.raises(walkthrough.WalkthroughError, match="expected 3 new tokens"):
        walkthrough.check_same_tokens(original, fast, expected_count=3)


def test_the_installed_package_check_refuses_the_source_tree():
    """Run by the dev venv (an editable install of src/), the check must not pass: it would test src/, not the wheel."""
    import normfold

    assert walkthrough.SOURCE_PACKAGES in Path(normfold.__file__).resolve().parents  # this suite runs on src/
    with pytest.raises(walkthrough.WalkthroughError, match="imported from the source tree"):
        walkthrough.check_installed_package()


def test_new_tokens_below_one_is_a_usage_error():
    with pytest.raises(SystemExit) as exit_:
        walkthrough.main(["--new-tokens", "0"])
    assert exit_.value.code == 2
