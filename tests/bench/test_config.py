"""normfold.bench.config: a bad BenchConfig is refused when it is made."""
from __future__ import annotations

import pytest

from normfold.bench.config import BenchConfig


@pytest.mark.parametrize("kwargs, match", [
    ({"batches": ()}, "batches"), ({"seqs": (0,)}, "seqs"), ({"rounds": 0}, "rounds"),
    ({"confidence": 1.0}, "confidence"), ({"warmup": -1}, "warmup"), ({"min_rounds": 0}, "min_rounds"),
    ({"shape_budget_s": 0.0}, "shape_budget_s"),
])
def test_bad_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BenchConfig(**kwargs)
