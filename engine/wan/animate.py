"""Wan Animate's inputs, segment by segment, as diffusers' `WanAnimatePipeline` makes them.

The pipeline makes a clip of the pose video's length in segments of `segment_frame_length` (L)
pixel frames. Each segment after the first starts with the last `prev_segment_conditioning_frames`
(P, 1 or 5) frames the one before decoded, so it adds L - P new frames; the segments are

    n = max(1, ceil((F - P) / (L - P)))  covering  L + (n - 1)(L - P) >= F frames,

and every input video (its first F frames) is padded to that length by walking back and forth
over its frames (the pipeline's `pad_video_frames`: 1 2 3 4 5 4 3 2 1 2 ...). The clip is the
first segment's frames, then each later one's past its first P, cut to F. (The pipeline counts
`n` as `(F + padding) // (L - P)`, one segment too many when L <= 2P: `check_animate` refuses
those lengths.)

Per segment, as the pipeline makes them (`segment_inputs`):

- the starting noise, drawn from the request's generator after the previous segment's, in the
  shape of one segment with the character's latent frame before it; and a fresh scheduler;
- the condition channels: the character's latent frame behind a mask of ones (the same for
  every segment: `Segments.lead`), then the VAE latents of a segment's pixels behind a mask.
  The pixels are black (animate) or the background video's segment (replace), the first P
  replaced, after the first segment, by the frames carried over; the mask is zero (animate) or
  where the background is kept (one minus the mask video, nearest-resampled), 1 on the first
  P pixel frames after the first segment, the first frame's value repeated over its latent
  frame's channels;
- the pose video's segment's latents, and its face video's segment resized to the motion
  encoder's square.

Between segments (`Segments.advance`, run by the family when a request's segment's last step is
done, other requests of its batch stepping on) the segment's latents are decoded, their frames
kept (uint8, in host memory: the clip so far) and the last P decoded frames (float, as the VAE
gave them) re-encoded as the next segment's start. The reference mode decodes as the pipeline
does, so every segment's latents and the frames are bitwise its own.

Caution: the input videos' frames are held (uint8, padded to the segments' length) until the
request finishes: four videos of a long 720p clip take about 11 MB a frame.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from ..request import ANIMATE_VIDEOS, ResolvedVideo
from .config import WanConfig


def segment_count(frames: int, length: int, carried: int) -> int:
    """The segments of `length` frames, each after the first carrying `carried` over, that make
    a clip of `frames` (at least one)."""
    return max(1, math.ceil((frames - carried) / (length - carried)))


def reflected(available: int, total: int) -> list[int]:
    """The frame indices `pad_video_frames` takes to make `total` frames of `available`:
    forward, then back, and so on (`[0, 1, 2, 1, 0, 1, ...]`)."""
    if available == 1:
        return [0] * total
    period = 2 * (available - 1)
    return [i % period if i % period < available else period - i % period for i in range(total)]


@dataclass
class Segments:
    """An Animate request's clip in segments: where it is, what stays the same for all of them,
    and the frames made so far."""

    length: int  # pixel frames per segment (L)
    carried: int  # frames each later segment carries over (P)
    count: int  # segments in all
    videos: dict[str, np.ndarray]  # each input video's frames, padded: (n frames, H, W, 3) uint8
    lead: torch.Tensor  # the character's latent frame behind its mask (1, t + C, 1, H', W')
    generator: torch.Generator  # the request's: each segment's noise follows the one before's
    index: int = 0  # the segment being denoised
    made: list[np.ndarray] = field(default_factory=list)  # earlier segments' new frames

    @property
    def start(self) -> int:
        """The segment's first frame in the (padded) clip."""
        return self.index * (self.length - self.carried)

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def stitch_chunks(self, chunks: Iterator[np.ndarray], clip: int) -> Iterator[np.ndarray]:
        """The clip of `clip` frames, chunk by chunk: the earlier segments' frames, then the last
        one's `chunks` (uint8 `(f, H, W, 3)` as the VAE decodes them) past those it carried
        over, until the clip's `clip` frames are out."""

        def own() -> Iterator[np.ndarray]:
            skip = 0 if self.index == 0 else self.carried
            for chunk in chunks:
                cut = min(skip, len(chunk))
                skip -= cut
                yield chunk[cut:]

        left = clip
        for chunk in itertools.chain(self.made, own()):
            chunk = chunk[:left]
            left -= len(chunk)
            if len(chunk):
                yield chunk
            if not left:
                return


@torch.no_grad()
def prepare_segments(encoders, config: WanConfig, video: ResolvedVideo, generator) -> Segments:
    """The segments of `video`, at the first: the input videos read (their first `frames`
    frames; ValueError naming a file that holds fewer) and padded, and the character image
    resized to fill the clip's frame (its aspect kept, black around) and encoded by the VAE
    behind a mask of ones."""
    from diffusers.pipelines.wan.image_processor import WanAnimateImageProcessor
    from PIL import Image

    from ..video import read_video

    length, carried = video.segment_frame_length, video.prev_segment_conditioning_frames
    count = segment_count(video.frames, length, carried)
    total = length + (count - 1) * (length - carried)
    order = reflected(video.frames, total)
    videos = {}
    for name in ANIMATE_VIDEOS:
        file = getattr(video, name)
        if file is not None:
            frames = read_video(file, num_frames=video.frames, sampling="first")  # (F, H, W, 3)
            videos[name] = frames[order] if total != video.frames else frames
    with Image.open(video.image) as image:
        character = image.convert("RGB")
    fill = WanAnimateImageProcessor(
        vae_scale_factor=config.vae_spatial,
        spatial_patch_size=config.patch[-2:],
        resample="bilinear",
        fill_color=0,
    )
    pixels = fill.preprocess(character, height=video.height, width=video.width, resize_mode="fill")
    latent = encoders.clip(pixels.float().unsqueeze(2))  # (1, C, 1, H', W')
    ones = torch.ones_like(latent[:, :1]).expand(-1, config.vae_temporal, -1, -1, -1)
    lead = torch.cat([ones, latent], dim=1)  # (1, t + C, 1, H', W')
    return Segments(length, carried, count, videos, lead, generator)


@torch.no_grad()
def segment_inputs(
    encoders, config: WanConfig, video: ResolvedVideo, seg: Segments, prev: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs of segment `seg.index` of `video`: the condition channels `(1, t + C, 1 + F',
    H', W')` fp32 (the character's latent frame first), the pose latents `(1, C, F', H', W')`
    and the face frames `(1, 3, L, face, face)` in [-1, 1], both fp32. `prev`: the frames
    carried over from the segment before `(1, 3, P, H, W)` in [-1, 1] (None for the first)."""
    from diffusers.video_processor import VideoProcessor
    from PIL import Image

    height, width = video.height, video.width
    t, s = config.vae_temporal, config.vae_spatial
    h, w = height // s, width // s
    window = slice(seg.start, seg.start + seg.length)
    processor = VideoProcessor(vae_scale_factor=s)

    def frames(name: str, mode: str = "RGB") -> list:
        return [Image.fromarray(f).convert(mode) for f in seg.videos[name][window]]

    if video.background_video is not None:
        pixels = processor.preprocess_video(frames("background_video"), height, width).float()
        masker = VideoProcessor(vae_scale_factor=s, do_normalize=False, do_convert_grayscale=True)
        mask = masker.preprocess_video(frames("background_mask", "L"), height, width)
        kept = 1 - mask.float()  # (1, 1, L, H, W): 1 where the background stays
        kept = torch.nn.functional.interpolate(
            kept[0].transpose(0, 1), size=(h, w), mode="nearest"
        ).transpose(0, 1)[None]  # (1, 1, L, H', W')
    else:
        pixels = torch.zeros((1, 3, seg.length, height, width))
        kept = torch.zeros((1, 1, seg.length, h, w))
    if prev is not None:  # the segment starts where the one before ended
        pixels = torch.cat([prev.to(pixels), pixels[:, :, seg.carried :]], dim=2)
        kept[:, :, : seg.carried] = 1
    # The first frame's mask fills its latent frame's channels, as the pipeline's
    # `get_i2v_mask` repeats it.
    kept = torch.cat([kept[:, :, :1].expand(-1, -1, t, -1, -1), kept[:, :, 1:]], dim=2)
    given = kept.view(1, -1, t, h, w).transpose(1, 2)  # (1, t, F', H', W')
    rest = encoders.clip(pixels)  # (1, C, F', H', W')
    rest = torch.cat([given.to(rest), rest], dim=1)  # (1, t + C, F', H', W')
    condition = torch.cat([seg.lead, rest], dim=2)  # (1, t + C, 1 + F', H', W')
    pose = processor.preprocess_video(frames("pose_video"), height, width)
    pose = encoders.clip(pose.float())  # (1, C, F', H', W')
    size = config.face_size
    face = processor.preprocess_video(frames("face_video"), height=size, width=size).float()
    return condition, pose, face


__all__ = ["Segments", "prepare_segments", "reflected", "segment_count", "segment_inputs"]
