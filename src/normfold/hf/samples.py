"""normfold's own sample text, images and audio clips: what a folder's processor is given to make its
example inputs (:mod:`normfold.hf.folder_inputs`). Two of each, so that a batch keeps its rows apart;
computed in code from fixed formulas (no files, no random numbers): the same samples everywhere.
"""
from __future__ import annotations

import math

import torch

from .._deps import require

SAMPLE_TEXTS = ("normfold folds the mean of each LayerNorm into the layers that write its input.",
                "A second, shorter sentence.")
SAMPLE_IMAGE_SIZE = (48, 64)  # (H, W): small and not square, so that a processor's resizing is exercised
SAMPLE_AUDIO_SECONDS = 0.1  # 1,600 samples at 16 kHz: a few frames for a convolutional feature encoder


def sample_images() -> list:
    """Two RGB PIL images of :data:`SAMPLE_IMAGE_SIZE`: colour gradients with a bright disc, the second
    the first mirrored and inverted."""
    image = require("PIL.Image")  # not at the top: Pillow comes with the optional transformers extra
    h, w = SAMPLE_IMAGE_SIZE
    y = torch.linspace(0, 1, h).unsqueeze(1).expand(h, w)
    x = torch.linspace(0, 1, w).unsqueeze(0).expand(h, w)
    disc = (((x - 0.6) ** 2 + (y - 0.4) ** 2) < 0.06).float()
    first = torch.stack([x, y, 0.5 * (1 - x) + 0.5 * disc], dim=-1).clamp(0, 1)  # (H, W, 3) in [0, 1]
    second = 1 - first.flip(1)
    return [image.fromarray((255 * rgb).round().to(torch.uint8).numpy()) for rgb in (first, second)]


def sample_audio(sampling_rate: int) -> list:
    """Two mono clips of :data:`SAMPLE_AUDIO_SECONDS` at ``sampling_rate`` (float32 NumPy arrays, as
    feature extractors take them): a rising chirp, and a chord of three tones."""
    n = max(1, round(SAMPLE_AUDIO_SECONDS * sampling_rate))
    t = torch.arange(n, dtype=torch.float64) / sampling_rate
    chirp = torch.sin(2 * math.pi * (200 + 8000 * t) * t)  # 200 Hz rising by 800 Hz per 0.1 s
    chord = sum(torch.sin(2 * math.pi * f * t) for f in (220.0, 277.2, 329.6)) / 3
    return [(0.5 * clip).to(torch.float32).numpy() for clip in (chirp, chord)]
