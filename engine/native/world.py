"""A procedural video world: coloured shapes moving on plain backgrounds, with captions.

It is the embedded default model's training set, the fine-tuning example, and the yardstick of
prompt adherence: `analyse_clip` reads colour, shape and motion back out of any clip, generated or
rendered, with fixed rules and no learned parts.

Clips are uint8 `(F, H, W, 3)`. Every clip is a pure function of its `ClipSpec`, and every spec of a
dataset is a pure function of the dataset's seed.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

COLOURS = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 80, 240),
    "yellow": (240, 220, 40),
    "magenta": (220, 50, 220),
    "cyan": (40, 220, 230),
}
BACKGROUNDS = {"black": (0, 0, 0), "gray": (110, 110, 110)}
SHAPES = ("circle", "square", "triangle")
MOTIONS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0), "static": (0, 0)}


@dataclass(frozen=True)
class ObjectSpec:
    colour: str
    shape: str
    motion: str
    y: float  # centre at the first frame, in pixels
    x: float
    size: float  # side of the bounding square, in pixels
    speed: float  # pixels per frame

    def phrase(self) -> str:
        motion = "not moving" if self.motion == "static" else f"moving {self.motion}"
        return f"a {self.colour} {self.shape} {motion}"


@dataclass(frozen=True)
class ClipSpec:
    objects: tuple[ObjectSpec, ...]
    background: str = "black"
    frames: int = 16
    height: int = 32
    width: int = 32

    def caption(self) -> str:
        return (
            " and ".join(o.phrase() for o in self.objects) + f" on a {self.background} background"
        )


def caption_for(colour: str, shape: str, motion: str, background: str = "black") -> str:
    """The caption of a one-object clip (the prompts the benchmark asks for)."""
    return ClipSpec((ObjectSpec(colour, shape, motion, 0, 0, 0, 0),), background).caption()


def held_out(colour: str, shape: str, motion: str) -> bool:
    """Combinations of colour, shape and motion that never appear together in training (1 in 5)."""
    return (
        list(COLOURS).index(colour) + SHAPES.index(shape) + list(MOTIONS).index(motion)
    ) % 5 == 0


def random_object(
    rng: random.Random, frames: int, height: int, width: int, colour, shape, motion
) -> ObjectSpec:
    size = rng.uniform(0.28, 0.36) * min(height, width)
    speed = 0.0 if motion == "static" else rng.uniform(0.9, 1.2) * min(height, width) / 32
    dy, dx = MOTIONS[motion]
    travel = speed * (frames - 1)
    margin = size / 2 + 1

    def start(n, d):
        lo, hi = margin, n - margin
        if d > 0:
            hi -= travel
        elif d < 0:
            lo += travel
        return rng.uniform(lo, max(lo, hi))

    return ObjectSpec(colour, shape, motion, start(height, dy), start(width, dx), size, speed)


def random_clip(
    rng: random.Random,
    frames=16,
    height=32,
    width=32,
    *,
    allow_held_out=False,
    max_objects=2,
    backgrounds=tuple(BACKGROUNDS),
) -> ClipSpec:
    """A clip of one (mostly) or two objects of distinct colours, avoiding held-out combinations."""
    n = 1 if max_objects == 1 or rng.random() < 0.75 else 2
    colours = rng.sample(list(COLOURS), n)
    objects = []
    for colour in colours:
        while True:
            shape, motion = rng.choice(SHAPES), rng.choice(list(MOTIONS))
            if allow_held_out or not held_out(colour, shape, motion):
                break
        objects.append(random_object(rng, frames, height, width, colour, shape, motion))
    return ClipSpec(tuple(objects), rng.choice(list(backgrounds)), frames, height, width)


def shape_mask(
    shape: str, cy: float, cx: float, size: float, height: int, width: int
) -> np.ndarray:
    """Boolean `(H, W)` mask of a shape centred at (cy, cx), sampled at pixel centres."""
    yy, xx = np.mgrid[0:height, 0:width] + 0.5
    r = size / 2
    if shape == "square":
        return (np.abs(yy - cy) <= r) & (np.abs(xx - cx) <= r)
    if shape == "circle":
        return (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
    if shape == "triangle":  # apex up, base at the bottom of the bounding square
        top, bottom = cy - r, cy + r
        half = r * (yy - top) / (2 * r)
        return (yy >= top) & (yy <= bottom) & (np.abs(xx - cx) <= half)
    raise ValueError(f"unknown shape {shape!r}")


def render(spec: ClipSpec) -> np.ndarray:
    """Render a clip to uint8 `(F, H, W, 3)`."""
    video = np.empty((spec.frames, spec.height, spec.width, 3), dtype=np.uint8)
    video[:] = BACKGROUNDS[spec.background]
    for f in range(spec.frames):
        for o in spec.objects:
            dy, dx = MOTIONS[o.motion]
            mask = shape_mask(
                o.shape,
                o.y + dy * o.speed * f,
                o.x + dx * o.speed * f,
                o.size,
                spec.height,
                spec.width,
            )
            video[f][mask] = COLOURS[o.colour]
    return video


def write_dataset(
    root: str | Path,
    count: int,
    *,
    seed: int = 0,
    frames=16,
    height=32,
    width=32,
    fps=8,
    backgrounds=tuple(BACKGROUNDS),
) -> Path:
    """Write `count` clips and their captions in the fine-tuning dataset layout (metadata.jsonl + MP4s)."""
    from ..video import write_mp4

    root = Path(root)
    (root / "clips").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(count):
        spec = random_clip(rng, frames, height, width, backgrounds=backgrounds)
        name = f"clips/{i:05d}.mp4"
        write_mp4(root / name, render(spec), fps=fps)
        lines.append(json.dumps({"file": name, "text": spec.caption(), "spec": asdict(spec)}))
    (root / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return root


def benchmark_prompts(
    count: int = 60, *, seed: int = 1, background: str = "black"
) -> list[tuple[str, str, str, str]]:
    """`(caption, colour, shape, motion)` of one-object prompts: every held-out combination, then
    seen ones, on `background`; `count` in all."""
    combos = list(itertools.product(COLOURS, SHAPES, MOTIONS))
    unseen = [c for c in combos if held_out(*c)]
    seen = [c for c in combos if not held_out(*c)]
    random.Random(seed).shuffle(seen)
    chosen = (unseen + seen)[:count]
    return [(caption_for(*c, background), *c) for c in chosen]


# ---------------------------------------------------------------------------------------------
# Analysis: colour from foreground pixels, motion from the centroid track, shape from the mask.


@dataclass(frozen=True)
class Analysis:
    colour: str | None
    shape: str | None
    motion: str | None
    displacement: tuple[float, float]
    fill: float  # object pixels, holes filled, / bounding-box pixels
    drop: float  # height of the centroid within the bounding box, from the top, in [0, 1]


def dilate(mask: np.ndarray) -> np.ndarray:
    """`mask` grown by one pixel toward its four neighbours."""
    grown = mask.copy()
    grown[1:] |= mask[:-1]
    grown[:-1] |= mask[1:]
    grown[:, 1:] |= mask[:, :-1]
    grown[:, :-1] |= mask[:, 1:]
    return grown


def fill_holes(mask: np.ndarray) -> np.ndarray:
    """`mask` with every region of False pixels that does not reach its border (4-connected) set."""
    outside = np.zeros_like(mask)
    outside[[0, -1], :] |= ~mask[[0, -1], :]
    outside[:, [0, -1]] |= ~mask[:, [0, -1]]
    while True:  # grow the outside through False pixels until it stops
        grown = dilate(outside) & ~mask
        if (grown == outside).all():
            return ~outside
        outside = grown


def analyse_clip(video: np.ndarray, background: str = "black") -> Analysis:
    """Read the main object's colour, shape and motion out of a uint8 `(F, H, W, 3)` clip."""
    v = video.astype(np.float32)
    bg = np.array(BACKGROUNDS[background], dtype=np.float32)
    fg = np.linalg.norm(v - bg, axis=-1) > 60  # (F, H, W): clearly not background
    frames_with_object = [f for f in range(len(v)) if fg[f].sum() >= 4]
    if not frames_with_object:
        return Analysis(None, None, None, (0.0, 0.0), 0.0, 0.0)
    palette = np.array(list(COLOURS.values()), dtype=np.float32)
    pixels = v[fg]  # (P, 3)
    nearest = np.linalg.norm(pixels[:, None] - palette[None], axis=-1).argmin(1)
    colour_idx = np.bincount(nearest, minlength=len(palette)).argmax()
    colour = list(COLOURS)[colour_idx]
    # Track only the main colour, so a second object does not move the centroid. Nearest-colour
    # (not a distance threshold) keeps edge pixels whose chroma the video codec has smeared.
    nearest_all = np.linalg.norm(v[..., None, :] - palette, axis=-1).argmin(-1)  # (F, H, W)
    mask = fg & (nearest_all == colour_idx)
    cents, fills, drops = [], [], []
    for f in frames_with_object:
        ys, xs = np.nonzero(mask[f])
        if len(ys) < 4:
            continue
        cents.append((ys.mean(), xs.mean()))
        # The shape is the main colour's mask inside its own box with its holes filled: a dark
        # fleck inside an object (the texture a sampler leaves) is not an edge, and a dark fringe
        # around it (or one the codec smears into the corners of a circle's box) is not the object.
        box = fill_holes(mask[f][ys.min() : ys.max() + 1, xs.min() : xs.max() + 1])  # (h, w)
        rows = np.nonzero(box)[0]
        fills.append(box.mean())
        drops.append(
            (rows.mean() + 0.5) / box.shape[0]
        )  # where the mass sits: 1/2 symmetric, 2/3 triangle
    if len(cents) < 2:
        return Analysis(colour, None, None, (0.0, 0.0), 0.0, 0.0)
    cents = np.array(cents)
    k = max(1, len(cents) // 4)  # average the first and last quarters against jitter
    dy, dx = cents[-k:].mean(0) - cents[:k].mean(0)
    span = 0.15 * min(video.shape[1:3])
    if max(abs(dy), abs(dx)) < span:
        motion = "static"
    elif abs(dx) >= abs(dy):
        motion = "right" if dx > 0 else "left"
    else:
        motion = "down" if dy > 0 else "up"
    fill, drop = float(np.median(fills)), float(np.median(drops))
    # A triangle (apex up) has its mass low in its box (2/3 down, against 1/2); a square fills its
    # box, a circle pi/4 of it.
    shape = "triangle" if drop > 0.563 else "square" if fill > 0.894 else "circle"
    return Analysis(colour, shape, motion, (float(dy), float(dx)), fill, drop)
