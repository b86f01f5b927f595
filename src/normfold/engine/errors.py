"""Exceptions of the fold engine, and :class:`CheckpointError`, the user error for the files the layers
above it read and write (``hf``'s folders, ``train``'s output folder and resume state): defined in the
lowest layer both import, so ``train`` need not import ``hf`` for it."""
from __future__ import annotations

from contextlib import contextmanager

from .._text import first_line


class FoldError(RuntimeError):
    """The model cannot be analysed or folded (e.g. torch.export cannot capture it)."""


class FoldVerificationError(FoldError):
    """The folded model's outputs differ from the original's beyond the float64 bound."""


class KeepPatternError(FoldError, ValueError):
    """A ``keep`` pattern that matches no norm of the model (a typo would otherwise keep nothing, silently).
    A ValueError (the caller's argument), and a FoldError subclass so the pipeline passes it on as it is."""


class ExampleInputsError(FoldError, ValueError):
    """The example inputs are not valid for the model: the original model itself raises on them when run
    eagerly, so a capture failure says nothing about the model. A ValueError (the caller's argument), and
    a FoldError subclass so the pipeline passes it on as it is."""


def invalid_example_inputs(model, err: BaseException) -> ExampleInputsError:
    """The ExampleInputsError of ``model`` rejecting its example inputs with ``err`` (raise it ``from err``)."""
    return ExampleInputsError(f"the example inputs are not valid for {model_name(model)}: the original model itself "
                              f"raises {type(err).__name__}: {first_line(err, 300)} when run eagerly on them; pass "
                              f"inputs the model accepts")


class CheckpointError(ValueError):
    """A folder cannot be read as a model, or the output folder cannot be written: a user error."""


def model_name(model) -> str:
    """How errors name a model: its class, and its Hugging Face model type when it has one."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return type(model).__name__ + (f" ({model_type})" if model_type else "")


@contextmanager
def failures_as_fold_error(name: str, step: str):
    """Re-raise any exception of ``step`` other than a FoldError as a FoldError naming the model and
    the step (the original exception chained), so callers see one error type with its context."""
    try:
        yield
    except FoldError as err:
        if type(err) is not FoldError or str(err).startswith(name):
            raise  # a subclass carries its own meaning (and arguments): kept as it is
        raise FoldError(f"{name}: {step}: {err}") from err
    except Exception as err:  # noqa: BLE001  the model's own code, or an engine bug: either way, say where
        raise FoldError(f"{name}: {step} failed: {type(err).__name__}: {first_line(err, 300)}") from err
