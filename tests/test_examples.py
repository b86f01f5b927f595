"""The examples run end to end, so they cannot rot."""
import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_fold_gpt2_example_folds_every_norm_and_verifies(capsys):
    pytest.importorskip("transformers")
    runpy.run_path(str(EXAMPLES / "fold_gpt2.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "9/9 norms foldable" in out
    assert "verify: OK" in out
    assert "stock transformers would drop lm_head.bias" in out  # the example says the truth about stock loading
    assert "reloaded with normfold.from_pretrained: max abs difference 0.0" in out
