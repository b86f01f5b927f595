"""The package imports with torch alone and exposes its public API."""
import subprocess
import sys

import normfold


def test_public_api_is_exported():
    for name in normfold.__all__:
        assert hasattr(normfold, name), name


def test_learning_a_rotation_is_public_at_top_level():
    """``normfold.learn_rotation`` learns the bases ``normfold.rotate(..., method="learned", bases=...)`` takes."""
    from normfold.rotate import learn_rotation
    assert normfold.learn_rotation is learn_rotation and "learn_rotation" in normfold.__all__


def test_normfold_fold_is_only_the_function_and_the_engine_is_its_own_subpackage():
    """``import normfold.fold`` is no trap: no subpackage of that name hides behind the function."""
    import importlib.util
    import normfold.engine
    assert callable(normfold.fold) and not isinstance(normfold.fold, type(normfold))
    assert importlib.util.find_spec("normfold.fold") is None
    assert normfold.engine.FoldError is normfold.FoldError


def test_import_needs_only_torch():
    code = (
        "import sys, normfold\n"
        "heavy = [m for m in ('transformers', 'triton', 'matplotlib', 'rich') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_python_dash_m_runs_the_command_line():
    """``python -m normfold`` is the ``normfold`` command: its help lists the subcommands, exit 0."""
    done = subprocess.run([sys.executable, "-m", "normfold", "--help"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "fold" in done.stdout and "verify" in done.stdout


def test_python_dash_m_reports_usage_errors_with_exit_2():
    done = subprocess.run([sys.executable, "-m", "normfold", "no-such-command"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "invalid choice" in done.stderr


def test_version_flag_names_normfold_torch_and_python():
    done = subprocess.run([sys.executable, "-m", "normfold", "--version"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"normfold {normfold.__version__} (torch ")


def test_package_ships_its_type_marker():
    """PEP 561: type checkers read normfold's annotations only when py.typed is installed with it."""
    from importlib import resources

    assert resources.files("normfold").joinpath("py.typed").is_file()
