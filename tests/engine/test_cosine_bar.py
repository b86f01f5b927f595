"""One rule for a cosine bar (``normfold.engine.cosine_bar``), read by every place that takes ``min_cosine``."""
import math

import pytest

from normfold.engine.cosine_bar import DEFAULT_MIN_COSINE, check_cosine_bar, is_cosine_bar


@pytest.mark.parametrize("value", [1, 1.0, 0.5, 1e-12, DEFAULT_MIN_COSINE])
def test_a_number_in_zero_one_is_a_bar(value):
    assert is_cosine_bar(value) and check_cosine_bar(value) == float(value)


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.0000001, math.nan, math.inf, True, False, "0.99", None])
def test_anything_else_is_refused_naming_the_bar_and_the_value(value):
    assert not is_cosine_bar(value)
    with pytest.raises(ValueError, match=r"--min-cosine must be a number in \(0, 1\], got " + repr(value)[:3]):
        check_cosine_bar(value, "--min-cosine")


def test_the_error_type_is_the_callers():
    class RecipeError(ValueError):
        pass
    with pytest.raises(RecipeError, match="recipe.approximate_min_cosine must be"):
        check_cosine_bar(2.0, "recipe.approximate_min_cosine", RecipeError)
