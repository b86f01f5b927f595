"""CBWC training and the GPT experiment harness.

``normfold.cbwc_(model, example_inputs)`` keeps a LayerNorm model's producers centered so its
LayerNorms run as RMSNorms with identical training; ``python -m normfold.train`` trains the
experiment GPT with any norm variant and placement.
"""
from .config import TrainConfig, resolve_config
from .model import GPT, GPTConfig, NORMS, PLACEMENTS
from .trainer import train

__all__ = ["GPT", "GPTConfig", "NORMS", "PLACEMENTS", "TrainConfig", "resolve_config", "train"]
