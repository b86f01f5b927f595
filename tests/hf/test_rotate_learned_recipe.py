"""The recipe of a learned rotation's folder: the SHA-256 of its stored bases, recorded exactly for
method 'learned' (never for another method, a streamed or a sliced rotation), and absent from the
recipes of every other rotation, which stay as they were written."""
from __future__ import annotations

import pytest

from normfold.hf.errors import CheckpointError
from normfold.hf.recipe import Recipe, Rotation

SHA = "ab" * 32


def _recipe(rotation: dict, **fields) -> dict:
    return {"command": "rotate", "streaming": False, "fold_affine": True, "dtype": None, "approximate_min_cosine": None,
            "rotation": rotation, "calibration": None, "stock_plan": True, "side_files": True, **fields}


def test_a_learned_recipe_round_trips_with_its_bases_sha256():
    data = Recipe(command="rotate", streaming=False, fold_affine=True, dtype=None,
                  rotation=Rotation("learned", 3, 0.0, SHA)).to_dict()
    assert data["rotation"] == {"method": "learned", "seed": 3, "slice_fraction": 0.0, "bases_sha256": SHA}
    assert Recipe.from_dict(data).rotation.bases_sha256 == SHA


def test_other_rotations_record_no_bases_sha256_and_read_back_as_before():
    data = Recipe(command="rotate", streaming=False, fold_affine=True, dtype=None,
                  rotation=Rotation("hadamard", 0)).to_dict()
    assert data["rotation"] == {"method": "hadamard", "seed": 0, "slice_fraction": 0.0}
    assert Recipe.from_dict(data).rotation == Rotation("hadamard", 0)


@pytest.mark.parametrize("rotation, fields, message", [
    ({"method": "learned", "seed": 0, "slice_fraction": 0.0}, {},
     "recipe.rotation.bases_sha256 must be recorded exactly for method 'learned', got none for method 'learned'"),
    ({"method": "hadamard", "seed": 0, "slice_fraction": 0.0, "bases_sha256": SHA}, {},
     "recipe.rotation.bases_sha256 must be recorded exactly for method 'learned', got one for method 'hadamard'"),
    ({"method": "learned", "seed": 0, "slice_fraction": 0.0, "bases_sha256": "AB" * 32}, {},
     "recipe.rotation.bases_sha256 must be 64 lowercase hex digits"),
    ({"method": "learned", "seed": 0, "slice_fraction": 0.25, "bases_sha256": SHA}, {},
     "recipe.rotation.slice_fraction must be 0 for method 'learned', got 0.25"),
    ({"method": "learned", "seed": 0, "slice_fraction": 0.0, "bases_sha256": SHA}, {"streaming": True},
     "recipe.rotation.method 'learned' must not be recorded for a streamed rotation"),
])
def test_a_learned_recipe_that_cannot_have_been_written_is_refused_naming_the_field(rotation, fields, message):
    with pytest.raises(CheckpointError) as raised:
        Recipe.from_dict(_recipe(rotation, **fields))
    assert message in str(raised.value)
