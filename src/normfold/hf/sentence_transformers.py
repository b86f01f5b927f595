"""A folded sentence-transformers folder as a ``SentenceTransformer`` that runs normfold's kernels.

``SentenceTransformer(folded)`` loads the folder's transformer with stock transformers, whose class
rebuilds every RMSNorm the fold made as a LayerNorm (same outputs, none of the speed).
:func:`sentence_transformer` builds the same pipeline (tokenizer, pooling, dense and normalize modules
from the folder's ``modules.json``) around ``normfold.from_pretrained(folder)``: the fast RMSNorms,
and then the steps its configs name (``normfold.FuseConfig()``: residual adds run inside the norm
kernels), each proved by the one runner (``normfold.engine.steps``), whose handlers hf looks up and
never imports.
"""
from __future__ import annotations

import os

from torch import nn

from .._deps import require
from ..engine.steps import run_steps
from .inputs import example_inputs_for
from .load import CheckpointError, check_model_dir
from .saving import from_pretrained

__all__ = ["sentence_transformer"]


def sentence_transformer(path: str | os.PathLike, *configs, device: str | None = None, **kwargs):
    """``SentenceTransformer(path, device=device, **kwargs)`` whose transformer is
    ``normfold.from_pretrained(path)`` after the steps ``configs`` name (e.g. ``normfold.FuseConfig()``:
    inference only, proved equal in float64); its embeddings are the original pipeline's. ``path``: a
    folder ``normfold fold`` wrote from a sentence-transformers folder (``modules.json`` carried over);
    CheckpointError for a folder without one, TypeError for a config that names no step (before loading)."""
    folder = check_model_dir(path)
    if not (folder / "modules.json").is_file():
        raise CheckpointError(f"{folder} is not a sentence-transformers folder (no modules.json): load it with "
                              "normfold.from_pretrained")
    st = require("sentence_transformers")  # not at the top: optional dependency
    pipeline = st.SentenceTransformer(str(folder), device=device, **kwargs)
    transformer = pipeline[0]
    if not isinstance(getattr(transformer, "model", None), nn.Module):
        raise CheckpointError(f"{folder}: the pipeline's first module is a {type(transformer).__name__}, not a "
                              "sentence-transformers Transformer whose model normfold could load")
    model = from_pretrained(folder).to(pipeline.device).eval()
    if configs:
        model, _ = run_steps(model, example_inputs_for(model), configs)
    transformer.model = model  # what ``transformer.auto_model`` returns and its forward calls
    return pipeline
