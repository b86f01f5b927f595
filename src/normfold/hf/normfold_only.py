"""Folders only normfold loads correctly (rotated, sliced, approximate, or holding parameters the stock
class lacks): written so that stock transformers refuses them loudly instead of building another model.

Stock ``from_pretrained`` would rebuild such a folder's RMSNorms as LayerNorms (which re-center a rotated
stream), drop a created ``lm_head.bias``, or re-initialise sliced tensors, and only log it. So the
weights' entry file gets normfold's own name (``normfold_model.safetensors`` or its index), which no
stock class looks for, and ``config.json`` a ``model_type`` that names the loader to use, with the real
one kept beside it; ``normfold.from_pretrained`` reads both back. Folders stock transformers loads
exactly stay plain ``save_pretrained`` folders.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import CheckpointError

MODEL_TYPE = "normfold: load with normfold.from_pretrained"  # what stock AutoConfig names when it refuses
REAL_MODEL_TYPE_KEY = "normfold_model_type"
SINGLE, INDEX = "normfold_model.safetensors", "normfold_model.safetensors.index.json"
_STOCK_ENTRIES = {"model.safetensors": SINGLE, "model.safetensors.index.json": INDEX}


def is_normfold_only(config: dict[str, Any]) -> bool:
    """Whether a ``config.json`` (as a dict) is one :func:`mark_normfold_only` wrote."""
    return config.get("model_type") == MODEL_TYPE


def mark_normfold_only(folder: Path) -> None:
    """Make the ``save_pretrained`` folder ``folder`` one stock transformers refuses (module docstring):
    its weights' entry file renamed to normfold's name, its ``config.json`` given normfold's model type."""
    entry = next((name for name in _STOCK_ENTRIES if (folder / name).is_file()), None)
    if entry is None:
        raise CheckpointError(f"{folder} holds no model.safetensors or its index to mark as normfold's own")
    (folder / entry).rename(folder / _STOCK_ENTRIES[entry])
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config[REAL_MODEL_TYPE_KEY], config["model_type"] = config["model_type"], MODEL_TYPE
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def real_model_type(config: dict[str, Any], where: Path) -> str:
    """The model type a normfold-only ``config.json`` keeps beside normfold's own; CheckpointError when absent."""
    real = config.get(REAL_MODEL_TYPE_KEY)
    if not isinstance(real, str) or not real:
        raise CheckpointError(f"{where} names normfold's model type but not the model's own "
                              f"(\"{REAL_MODEL_TYPE_KEY}\"): fold it again")
    return real
