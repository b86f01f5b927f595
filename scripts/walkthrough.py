"""A new user's path, checked end to end against an installed normfold (``make wheel-check`` runs it).

    python scripts/walkthrough.py [--wheel dist/normfold-*.whl] [--new-tokens 20]

Steps, each printing what it compared and raising ``WalkthroughError`` when it does not hold:

1. ``--wheel``: the wheel holds the C++ sources, the bundled model and ``py.typed``.
2. the installed package: ``normfold.__version__``, every public name, imported from outside this
   source tree (a check of ``src/`` would say nothing about the wheel); the C++ kernel builds.
3. ``normfold fold MODEL -o OUT`` (the command line, as a user types it).
4. ``normfold.from_pretrained(OUT)`` then ``normfold.fuse_residual_norms``: the fast model.
5. one greedy ``generate`` call on the original and on the fast model: the same tokens, exactly.

Run it with the Python of the venv under test; it needs the ``hf`` extra (transformers).
"""
from __future__ import annotations

import argparse
import fnmatch
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SOURCE_PACKAGES = Path(__file__).resolve().parent.parent / "src"   # what an editable install imports
PROMPT = "class "  # the bundled model reads bytes: token id = byte value
# wheel members a working install needs (fnmatch patterns) -> why
REQUIRED_WHEEL_MEMBERS = {
    "normfold/ops/csrc/*.cpp": "the fused CPU kernel is compiled from them on first use",
    "normfold/ops/csrc/*.h": "the kernel's headers",
    "normfold/data/default_model/config.json": "the bundled model (normfold demo, default_model_path)",
    "normfold/data/default_model/model.safetensors": "the bundled model's weights",
    "normfold/py.typed": "type checkers read normfold's annotations only with it (PEP 561)",
}


class WalkthroughError(RuntimeError):
    """A step of the user's path did not do what the README promises."""


def missing_wheel_members(names: list[str]) -> dict[str, str]:
    """The required patterns (-> why needed) that no name in the wheel matches."""
    return {pattern: why for pattern, why in REQUIRED_WHEEL_MEMBERS.items()
            if not any(fnmatch.fnmatch(name, pattern) for name in names)}


def check_wheel(wheel: Path) -> None:
    if not zipfile.is_zipfile(wheel):
        raise WalkthroughError(f"expected a wheel (a zip file), got {wheel}")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    missing = missing_wheel_members(names)
    if missing:
        lines = "\n".join(f"  {pattern}: {why}" for pattern, why in missing.items())
        raise WalkthroughError(f"{wheel.name} lacks files an install needs:\n{lines}")
    print(f"wheel: {wheel.name} holds {len(names)} files, including every one of {sorted(REQUIRED_WHEEL_MEMBERS)}")


def check_installed_package() -> None:
    """The normfold under test is an installed one, with its whole public API and a working kernel."""
    import normfold
    from normfold.ops import _cpu

    location = Path(normfold.__file__).resolve()
    if SOURCE_PACKAGES in location.parents:
        raise WalkthroughError(f"normfold was imported from the source tree ({location}), not from an install; "
                               f"run this script with the Python of the venv the wheel went into")
    unresolved = [name for name in normfold.__all__ if not hasattr(normfold, name)]
    if unresolved:
        raise WalkthroughError(f"normfold.__all__ names attributes that do not resolve: {unresolved}")
    print(f"import: normfold {normfold.__version__} from {location.parent}, {len(normfold.__all__)} public names")
    if _cpu.load() is None:
        raise WalkthroughError(f"the fused C++ kernel did not build from the installed sources: {_cpu.build_error()}")
    print(f"kernel: built from the installed sources into {_cpu.build_dir()}")


def fold_with_cli(source: Path, out: Path) -> None:
    """``normfold fold SOURCE -o OUT`` through the console script of this Python's environment."""
    command = Path(sys.executable).parent / "normfold"
    if not command.is_file():
        raise WalkthroughError(f"no normfold command beside {sys.executable}: the wheel's entry point is missing")
    done = subprocess.run([str(command), "fold", str(source), "-o", str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        raise WalkthroughError(f"`normfold fold` exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    print(f"fold: `normfold fold {source} -o {out}` exit 0, wrote {', '.join(sorted(p.name for p in out.iterdir()))}")


def greedy_tokens(model, input_ids, new_tokens: int) -> list[int]:
    """Exactly ``new_tokens`` greedy tokens after ``input_ids`` (eos suppressed, so none end early)."""
    import torch

    with torch.no_grad():
        out = model.generate(input_ids, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=0)
    return out[0, input_ids.shape[1]:].tolist()


def check_same_tokens(original: list[int], fast: list[int], expected_count: int) -> None:
    """Equal token lists of the expected length; two empty lists would compare nothing."""
    if len(original) != expected_count or len(fast) != expected_count:
        raise WalkthroughError(f"expected {expected_count} new tokens from each model, "
                               f"got {len(original)} (original) and {len(fast)} (fast)")
    if original != fast:
        first = next(i for i, (a, b) in enumerate(zip(original, fast)) if a != b)
        raise WalkthroughError(f"greedy tokens differ from position {first}: original {original}, fast {fast}")


def fast_model(folded_dir: Path, input_ids):
    """The folded folder loaded as folded, residual adds fused into its norms (checked in float64 by fuse)."""
    import normfold
    from normfold.nn import RMSNorm

    folded = normfold.from_pretrained(folded_dir)
    rms = sum(isinstance(m, RMSNorm) for m in folded.modules())
    if rms == 0:
        raise WalkthroughError(f"normfold.from_pretrained({folded_dir}) built no RMSNorm: the fold was not loaded")
    fused, report = normfold.fuse_residual_norms(folded, {"input_ids": input_ids})
    if not report.fused:
        raise WalkthroughError(f"fuse_residual_norms fused nothing:\n{report}")
    print(f"load fast: {rms} RMSNorms, {len(report.fused)} residual adds fused (float64 check passed)")
    return fused


def run(new_tokens: int, workdir: Path) -> None:
    import torch
    from normfold.hf.load import default_model_path, load_model

    source = default_model_path()
    out = workdir / "folded"
    fold_with_cli(source, out)
    input_ids = torch.tensor([list(PROMPT.encode())])
    original = greedy_tokens(load_model(source), input_ids, new_tokens)
    fast = greedy_tokens(fast_model(out, input_ids), input_ids, new_tokens)
    check_same_tokens(original, fast, new_tokens)
    text = bytes(original).decode(errors="replace")
    print(f"generate: {new_tokens} greedy tokens after {PROMPT!r} equal, original vs folded+fused: {text!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, help="also check this wheel's contents")
    parser.add_argument("--new-tokens", type=int, default=20, help="greedy tokens to compare (default 20)")
    args = parser.parse_args(argv)
    if args.new_tokens < 1:
        parser.error(f"--new-tokens must be at least 1, got {args.new_tokens}")
    try:
        if args.wheel is not None:
            check_wheel(args.wheel)
        check_installed_package()
        with tempfile.TemporaryDirectory(prefix="normfold-walkthrough-") as tmp:
            run(args.new_tokens, Path(tmp))
    except WalkthroughError as err:
        print(f"walkthrough: FAILED: {err}", file=sys.stderr)
        return 1
    print("walkthrough: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
