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


def test_default_shape_runs_with_3d_dsa():
    """megaslide-tiny's 3D-DSA geometry fits its own 16x32x32 clips (4x4 tokens a frame)."""
    from megaslide.engine.dit import PRESETS, VideoDiT

    config = PRESETS["megaslide-tiny"].replace(attention="dsa")
    dit = VideoDiT(config).eval()
    x = torch.randn(1, 3, config.frames, config.height, config.width)
    ctx, mask = torch.randn(1, 5, config.text.dim), torch.ones(1, 5, dtype=torch.bool)
    with torch.no_grad():
        assert dit(x, torch.tensor([0.5]), ctx, mask).shape == x.shape
