"""The packaged default model loads, fits the size limit, and generates a clip."""

import torch

from megaslide.engine.models import DEFAULT_MODEL, packaged_models
from megaslide.engine.pipeline import GenerationRequest, VideoPipeline


def test_packaged_model_loads_and_generates():
    path = packaged_models()[DEFAULT_MODEL]
    assert sum(f.stat().st_size for f in path.iterdir()) <= 25 * 2**20
    pipe = VideoPipeline.from_pretrained(path, dtype=torch.float32)
    frames = pipe.generate(GenerationRequest("a red circle moving right on a black background", steps=2))
    assert frames.shape == (pipe.config.frames, pipe.config.height, pipe.config.width, 3)
    assert frames.std() > 1  # a clip, not a constant
