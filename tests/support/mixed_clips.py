"""A fine-tuning dataset of clips of the sizes and lengths asked for (random pixels)."""

import json
from pathlib import Path

import numpy as np

from megaslide.engine.video import write_mp4


def write_mixed_clips(root: Path, clips: list[tuple[int, int, int]], seed: int = 0) -> Path:
    """`clips/<i>.mp4` of (W, H, F) each, captioned "clip <i>", in the dataset layout."""
    (root / "clips").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lines = []
    for i, (w, h, f) in enumerate(clips):
        write_mp4(root / f"clips/{i}.mp4", rng.integers(0, 256, (f, h, w, 3), np.uint8), fps=8)
        lines.append(json.dumps({"file": f"clips/{i}.mp4", "text": f"clip {i}"}))
    (root / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return root
