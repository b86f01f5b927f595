""":class:`CheckpointError`, the user error every part of ``normfold.hf`` raises for a folder it cannot
read or write (defined in ``normfold.engine.errors``, which ``train`` shares; an underlying exception is
worded in one by ``normfold._text.first_line``)."""
from __future__ import annotations

from ..engine.errors import CheckpointError  # noqa: F401  hf's name for it, re-exported
