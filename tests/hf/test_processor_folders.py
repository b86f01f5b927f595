"""`normfold fold DIR` over a tiny folder of every model type that has an image processor or a feature
extractor in the installed transformers: the type's shrunk default config and bare model, saved with that
processor built from its class defaults (its image size shrunk to the model's). The fold takes the
processor route or says why not, and ends in exit 0 or one `normfold: error:` line, never a traceback.

The suite (`make test`) runs a sample of the families; every type (one fold each, a few hundred types,
about an hour on 2 cores): `NORMFOLD_EVERY_PROCESSOR_TYPE=1 pytest -s tests/hf/test_processor_folders.py`;
`-k vit` runs one type."""
from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
import torch
from test_zoo_folders import _bare_model_class, _config

from normfold.cli import main
from normfold.hf.output_dir import REPORT_JSON

transformers = pytest.importorskip("transformers")
image_processing_auto = pytest.importorskip("transformers.models.auto.image_processing_auto")
feature_extraction_auto = pytest.importorskip("transformers.models.auto.feature_extraction_auto")

pytestmark = pytest.mark.slow

IMAGE_TYPES = sorted(image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES)
AUDIO_TYPES = sorted(set(feature_extraction_auto.FEATURE_EXTRACTOR_MAPPING_NAMES) - set(IMAGE_TYPES))
if not os.environ.get("NORMFOLD_EVERY_PROCESSOR_TYPE"):  # the suite's sample: one or two per family
    IMAGE_TYPES = [t for t in ("vit", "deit", "convnext", "clip", "siglip", "segformer", "dinov2", "swin")
                   if t in IMAGE_TYPES]
    AUDIO_TYPES = [t for t in ("wav2vec2", "whisper", "data2vec-audio", "hubert") if t in AUDIO_TYPES]
_SIDES = ("height", "width", "shortest_edge", "longest_edge")  # size keys that a square image size replaces


def _image_processor(model_type: str, config):
    """The type's image processor (its Pillow class: torchvision is optional), resizing to the model's image size."""
    names = image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES[model_type]
    name = names.get("pil") or names.get("torchvision") if isinstance(names, dict) else names
    cls = getattr(transformers, name)
    side = getattr(getattr(config, "vision_config", None) or config, "image_size", None)
    if not isinstance(side, int):
        return cls()
    sizes = {}  # the defaults' size and crop_size (dicts, or transformers' SizeDict), each side set to the model's
    for attribute in ("size", "crop_size"):
        size = getattr(cls(), attribute, None)
        fields = size if isinstance(size, dict) else vars(size) if hasattr(size, "__dict__") else None
        if fields:
            sizes[attribute] = {k: side if k in _SIDES else v for k, v in fields.items() if v is not None}
    return cls(**sizes)


def _feature_extractor(model_type: str, config):
    return getattr(transformers, feature_extraction_auto.FEATURE_EXTRACTOR_MAPPING_NAMES[model_type])()


def _build(model_type: str, folder: Path, make_processor) -> str | None:
    """Save the tiny folder of ``model_type`` with its processor; why not, when the type builds none offline."""
    try:
        config = _config(model_type)
        torch.manual_seed(0)
        model = _bare_model_class(config)(config)
        processor = make_processor(model_type, config)
        model.save_pretrained(folder)  # the shrunk config is validated here
        processor.save_pretrained(folder)
    except Exception as err:
        return f"{model_type}: no tiny folder with a processor offline ({type(err).__name__}: {err})"
    return None


def _fold_says_what_it_did_in_one_line(model_type: str, tmp_path: Path, make_processor) -> None:
    folder, out = tmp_path / model_type, tmp_path / "folded"
    why_not = _build(model_type, folder, make_processor)
    if why_not:
        pytest.skip(why_not)
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        patch.setenv("NORMFOLD_PROGRESS", "0")
        code = main(["fold", str(folder), "-o", str(out)])
    assert "Traceback" not in stderr.getvalue()
    if code == 0:
        route = json.loads((out / REPORT_JSON).read_text())["example_inputs"]
        assert route["route"] in ("processor", "config") and f"example inputs: {route['route']}" in stdout.getvalue()
        print(f"{model_type}: exit 0, {route['route']} route, {route['processor'] or route['why']}")  # pytest -s: counts
        return
    print(f"{model_type}: exit {code}, {stderr.getvalue().strip()[:200]}")
    lines = [line for line in stderr.getvalue().splitlines() if line.startswith("normfold: ")]
    assert code in (1, 2) and len(lines) == 1, stderr.getvalue()
    assert lines[0].startswith(("normfold: error: ", "normfold: verification failed")), stderr.getvalue()
    assert not out.exists()


@pytest.mark.parametrize("model_type", IMAGE_TYPES)
def test_fold_of_a_tiny_folder_with_an_image_processor_folds_or_says_why_in_one_line(model_type, tmp_path):
    _fold_says_what_it_did_in_one_line(model_type, tmp_path, _image_processor)


@pytest.mark.parametrize("model_type", AUDIO_TYPES)
def test_fold_of_a_tiny_folder_with_a_feature_extractor_folds_or_says_why_in_one_line(model_type, tmp_path):
    _fold_says_what_it_did_in_one_line(model_type, tmp_path, _feature_extractor)
