""":class:`CheckpointError`, the user error every part of ``normfold.hf`` raises for a folder it cannot
read or write (an underlying exception is worded in one by ``normfold._text.first_line``)."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A folder cannot be read as a model, or the output folder cannot be written: a user error."""

