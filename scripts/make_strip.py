"""Render a PNG strip of frames from clips of the packaged model, one row per prompt (docs/ shows it).

python scripts/make_strip.py docs/megaslide-tiny.png
"""

from __future__ import annotations

import sys

import numpy as np
from PIL import Image, ImageDraw

from megaslide.engine.loader import open_pipeline
from megaslide.engine.request import VideoRequest

PROMPTS = [
    "a red circle moving right on a black background",
    "a blue square moving up on a black background",
    "a yellow triangle moving left on a black background",
    "a green circle moving down on a black background",
]
FRAMES_SHOWN = 8  # every other frame of 16
SCALE = 3  # pixels per clip pixel
LABEL_W = 330


def main(out: str) -> int:
    pipe = open_pipeline()  # the packaged default model
    rows = []
    for prompt in PROMPTS:
        frames = pipe.generate(VideoRequest(prompt, seed=0))  # (F, H, W, 3)
        strip = np.concatenate(
            [
                np.pad(f, ((2, 2), (2, 2), (0, 0)), constant_values=255)
                for f in frames[:: len(frames) // FRAMES_SHOWN]
            ],
            axis=1,
        )
        image = Image.fromarray(strip).resize(
            (strip.shape[1] * SCALE, strip.shape[0] * SCALE), Image.NEAREST
        )
        row = Image.new("RGB", (LABEL_W + image.width, image.height), "white")
        ImageDraw.Draw(row).text((8, image.height // 2 - 6), prompt, fill="black")
        row.paste(image, (LABEL_W, 0))
        rows.append(row)
    sheet = Image.new("RGB", (rows[0].width, sum(r.height for r in rows)), "white")
    for i, row in enumerate(rows):
        sheet.paste(row, (0, i * row.height))
    sheet.save(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "docs/megaslide-tiny.png"))
