"""Video I/O: MP4 writing, decoding of clips and frame folders, and the uint8 <-> float mapping.

Pixel convention. Frames on disk and in numpy are uint8 ``(F, H, W, 3)`` RGB. The model sees float
``(3, F, H, W)`` in [-1, 1]. The two maps, exact inverses on uint8 values:

    to float:  x  = u8 / 127.5 - 1
    to uint8:  u8 = clip(round((x + 1) * 127.5), 0, 255)     (round half to even, as numpy/torch)

Values outside [-1, 1] are clipped; NaN or inf is an error.

MP4 output: H.264 (libx264) in yuv420p, constant frame rate (frame i has pts i in a 1/fps time
base), ``movflags=+faststart`` (the index goes first, so browsers can play while downloading).
The same frames give the same file bytes in any process, on any x86 host with the same libraries:
x264 runs a fixed number of frame threads (its output depends on the thread count, which by
default follows the host's CPUs), and never its AVX-512 code, whose macroblock-tree routines read
memory that was never written, so that the output followed whatever the process's heap held
before (identical frames from two runs of `megaslide generate` decoded up to 19 levels apart).
x264's other code paths (C, SSE, AVX2) give bit-identical output, so the bytes do not depend on
the CPU either.
4:2:0 chroma needs even width and height; odd sizes are rejected, not silently padded. The file is
written under a temporary name in the target directory and renamed on success, so a failed write
never leaves a partial file at `path`. `write_mp4_chunks` encodes on a thread while its caller
makes the next chunk of frames (a decoder), through a queue of a few chunks: the same frames in
the same order as `write_mp4`, so the same file. `Mp4Writer` is the same encoder for a caller that
hands the chunks over one at a time (the server's worker feeds one per clip it decodes).

Decoding uses PyAV (FFmpeg): mp4, webm, gif and anything else FFmpeg reads, plus folders of frames
(png/jpg/jpeg/webp/bmp, sorted by name with numbers compared as numbers, so frame2 < frame10).

`av` is imported inside the functions that use it: the engine must import without it.
"""

from __future__ import annotations

import functools
import itertools
import os
import queue
import re
import threading
from collections.abc import Iterable, Iterator
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .atomic import atomic_write
from .request import check_even

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
SAMPLING_MODES = ("uniform", "first")
# x264's frame threads for every encode: a constant, so that the bytes do not follow the host.
# (Frame threads, not slices: slices cost 5-15% in size at the same quality.)
ENCODER_THREADS = 4
# Chunks `write_mp4_chunks` lets wait for the encoder: enough to keep it busy across a decoder's
# uneven chunks (Wan: 1 frame, then 4), few enough that frames do not pile up in memory.
ENCODE_QUEUE_DEPTH = 2
_PUT_POLL_S = 0.1  # how often a producer waiting on a full queue checks that the encoder lives
_END, _ABORT = object(), object()  # the queue's last item: all sent, or the producer failed
# x264's name for each x86 feature it uses, by the flag /proc/cpuinfo lists for it (AVX-512 left
# out: see the module docstring). x264 implies MMX2 from SSE, as the CPU does.
X264_CPU_FEATURES = {
    "sse": "MMX2,SSE",
    "sse2": "SSE2",
    "pni": "SSE3",
    "ssse3": "SSSE3",
    "sse4_1": "SSE4.1",
    "sse4_2": "SSE4.2",
    "avx": "AVX",
    "xop": "XOP",
    "fma4": "FMA4",
    "fma": "FMA3",
    "bmi1": "BMI1",
    "bmi2": "BMI2",
    "avx2": "AVX2",
    "abm": "LZCNT",
}


# ---------------------------------------------------------------------- pixel mapping


def frames_to_float(frames) -> torch.Tensor:
    """uint8 ``(F, H, W, 3)`` (numpy or torch) -> float32 ``(3, F, H, W)`` in [-1, 1]."""
    u8 = torch.as_tensor(frames)
    if u8.dtype != torch.uint8 or u8.ndim != 4 or u8.shape[-1] != 3:
        raise ValueError(f"expected uint8 frames (F, H, W, 3), got {u8.dtype} {tuple(u8.shape)}")
    return u8.permute(3, 0, 1, 2).to(torch.float32) / 127.5 - 1.0  # (3, F, H, W)


def float_to_frames(x, *, layout: str | None = None) -> np.ndarray:
    """float in [-1, 1], ``(3, F, H, W)`` or ``(F, H, W, 3)`` -> uint8 ``(F, H, W, 3)`` numpy.

    ``u8 = clip(round((x + 1) * 127.5), 0, 255)``. `layout` ("CFHW" or "FHWC") is inferred from
    which axis has size 3 and must be given when both ends do.
    """
    t = torch.as_tensor(x)
    if not t.is_floating_point() or t.ndim != 4:
        raise ValueError(f"expected a 4-D float tensor, got {t.dtype} {tuple(t.shape)}")
    layout = layout or _infer_layout(t.shape)
    if layout == "CFHW":
        t = t.permute(1, 2, 3, 0)  # (F, H, W, 3)
    elif layout != "FHWC":
        raise ValueError(f"layout must be 'CFHW' or 'FHWC', got {layout!r}")
    if t.shape[-1] != 3:
        raise ValueError(f"expected 3 channels for layout {layout}, got shape {tuple(t.shape)}")
    # .cpu() copies a device tensor to the host (a sync): the encoder needs the pixels there.
    t = t.detach().to(device="cpu", dtype=torch.float32)
    if not bool(torch.isfinite(t).all()):
        raise ValueError("frames contain NaN or inf")
    u8 = torch.clamp(torch.round((t + 1.0) * 127.5), 0, 255).to(torch.uint8)
    return u8.contiguous().numpy()


def _infer_layout(shape) -> str:
    first, last = shape[0] == 3, shape[-1] == 3
    if first and last:
        raise ValueError(f"ambiguous layout for shape {tuple(shape)}: pass layout='CFHW' or 'FHWC'")
    if not (first or last):
        raise ValueError(f"no channel axis of size 3 in shape {tuple(shape)}")
    return "CFHW" if first else "FHWC"


def to_uint8_frames(frames, *, layout: str | None = None) -> np.ndarray:
    """Any accepted frame input -> contiguous uint8 ``(F, H, W, 3)`` numpy."""
    if isinstance(frames, torch.Tensor) and frames.dtype == torch.uint8:
        # .cpu() is a host copy (a sync for device tensors): the encoder reads host memory.
        frames = frames.detach().cpu().numpy()
    if isinstance(frames, np.ndarray) and frames.dtype == np.uint8:
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"uint8 frames must be (F, H, W, 3), got {frames.shape}")
        return np.ascontiguousarray(frames)
    t = torch.as_tensor(frames)
    if not t.is_floating_point():
        raise ValueError(f"frames must be uint8 or float in [-1, 1], got {t.dtype}")
    return float_to_frames(t, layout=layout)


# ---------------------------------------------------------------------- writing


def write_mp4(
    path: str | os.PathLike,
    frames,
    fps: int | float | Fraction = 16,
    *,
    crf: int = 18,
    preset: str = "medium",
    layout: str | None = None,
) -> Path:
    """Encode frames to an H.264/yuv420p MP4 at `path` (atomically) and return the path.

    frames: uint8 ``(F, H, W, 3)`` or float in [-1, 1] (``(F, H, W, 3)`` or ``(3, F, H, W)``),
    numpy or torch. crf: x264 constant rate factor, 0-51, lower is better (18 is near
    transparent). Raises ValueError for odd width/height, empty input or bad values.
    """
    u8 = to_uint8_frames(frames, layout=layout)
    n, h, w, _ = u8.shape
    if n == 0:
        raise ValueError("no frames to write")
    check_even(w, h, param="frames")
    rate = _encoder_rate(fps, crf)
    return atomic_write(path, lambda tmp: _encode(tmp, iter([u8]), rate, crf, preset))


def write_mp4_chunks(
    path: str | os.PathLike,
    chunks: Iterable,
    fps: int | float | Fraction = 16,
    *,
    crf: int = 18,
    preset: str = "medium",
    depth: int = ENCODE_QUEUE_DEPTH,
) -> int:
    """`write_mp4` of the frames of consecutive chunks (each uint8 ``(f, H, W, 3)``, or float as
    `write_mp4` takes them), encoded on a thread while the caller's iterator makes the next
    chunk (a decoder: `Pipeline.finish_chunks`); returns the number of frames written.

    At most `depth` chunks wait between the two, so a fast decoder does not pile frames up in
    memory. The encoder receives the same uint8 frames in the same order as `write_mp4` of their
    concatenation, so the file is the same. If the iterator raises, or a chunk's size differs
    from the first's, the encoder stops, no file is published at `path`, and the error is raised
    here; an encoder error is raised here too (the iterator is not drawn further)."""
    writer = Mp4Writer(path, fps, crf=crf, preset=preset, depth=depth)
    try:
        for chunk in chunks:
            writer.add(chunk)
    except BaseException:
        writer.abort()  # the encoder drops its temporary file and stops
        raise
    return writer.close()


class Mp4Writer:
    """`write_mp4_chunks` for a caller that hands the chunks over one at a time (`add`) rather
    than as an iterator: the server's worker, which decodes several clips together and feeds
    each its own writer. The encoder runs on a thread of its own from the start; `close` ends
    the clip and publishes it at `path` (atomically), `abort` publishes nothing.

    `depth` None lets any number of chunks wait, so that `add` never waits for the encoder: for
    a caller that keeps every chunk anyway (the server, to write a clip again after a full
    disk), where a bound saves no memory and would only hold the caller to the encoder's pace.

    Caution: one thread calls `add`, `close` and `abort` at a time (the server adds on its loop
    and closes on its encoder thread, one after the other). A writer that raised from `add` has
    stopped and removed its temporary file: nothing will be published at `path`."""

    def __init__(
        self,
        path: str | os.PathLike,
        fps: int | float | Fraction = 16,
        *,
        crf: int = 18,
        preset: str = "medium",
        depth: int | None = ENCODE_QUEUE_DEPTH,
    ):
        if depth is not None and depth < 1:
            raise ValueError(f"depth must be >= 1 or None, got {depth}")
        rate = _encoder_rate(fps, crf)
        self.path, self.frames = Path(path), 0
        self._size: tuple[int, int] | None = None
        self._waiting: queue.Queue = queue.Queue(maxsize=depth or 0)  # 0: unbounded
        self._failure: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._encoder, args=(rate, crf, preset), name="mp4-encoder", daemon=True
        )
        self._thread.start()

    def _received(self) -> Iterator[np.ndarray]:
        while (item := self._waiting.get()) is not _END:
            if item is _ABORT:
                raise _Aborted("the frames' producer failed")
            yield item

    def _encoder(self, rate: Fraction, crf: int, preset: str) -> None:
        try:
            atomic_write(self.path, lambda tmp: _encode(tmp, self._received(), rate, crf, preset))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self._failure.append(exc)

    def _hand(self, item) -> bool:
        """Queue `item` for the encoder; False once the encoder has stopped (it failed)."""
        while self._thread.is_alive():
            try:
                self._waiting.put(item, timeout=_PUT_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def add(self, chunk) -> None:
        """Hand the encoder the next chunk of frames, waiting while `depth` chunks wait already.
        Raises ValueError for a chunk whose size is odd or differs from the first's, and the
        encoder's own error once it has failed; the writer has stopped then."""
        try:
            u8 = to_uint8_frames(chunk)
            if self._size is None:
                self._size = u8.shape[1:3]
                check_even(self._size[1], self._size[0], param="frames")
            elif u8.shape[1:3] != self._size:
                raise ValueError(
                    f"frames: a chunk is {u8.shape[2]}x{u8.shape[1]}, the first was "
                    f"{self._size[1]}x{self._size[0]}"
                )
        except BaseException:
            self.abort()
            raise
        if len(u8) and not self._hand(u8):
            self._thread.join()
            raise self._failure[0]  # the encoder failed: its temporary file is gone already
        self.frames += len(u8)

    def close(self) -> int:
        """End the clip: wait for the encoder to finish and publish the MP4 at `path`; returns
        the number of frames. Raises ValueError for a clip of no frames, and the encoder's error
        (nothing is published then)."""
        if self.frames == 0:
            self.abort()
            raise ValueError("no frames to write")
        self._hand(_END)
        self._thread.join()
        if self._failure:
            raise self._failure[0]
        return self.frames

    def abort(self) -> None:
        """Stop the encoder and remove its temporary file: nothing is published at `path`. Does
        nothing once the encoder has stopped (closed, failed or aborted before)."""
        if self._thread.is_alive():
            self._hand(_ABORT)
            self._thread.join()


class _Aborted(Exception):
    """The frames' producer failed: the encoder stops and publishes nothing."""


def _encoder_rate(fps, crf: int) -> Fraction:
    """The stream's frame rate, after checking the encoder's settings."""
    if not 0 <= crf <= 51:
        raise ValueError(f"crf must be in [0, 51], got {crf}")
    rate = Fraction(fps).limit_denominator(1001)
    if rate <= 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    return rate


def _encode(tmp: Path, chunks: Iterator[np.ndarray], rate: Fraction, crf: int, preset: str) -> None:
    """Encode checked uint8 chunks ``(f, H, W, 3)`` of one size, at least one frame in all, to
    an MP4 at `tmp`."""
    import av

    first = next(chunks)
    _, h, w, _ = first.shape
    # A real file path, not a buffer: +faststart rewrites the file to move the index first.
    options = {"movflags": "+faststart"}
    with av.open(str(tmp), mode="w", format="mp4", container_options=options) as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.time_base = 1 / rate
        stream.options = {"crf": str(crf), "preset": preset, "x264-params": _x264_params()}
        i = 0
        for u8 in itertools.chain([first], chunks):
            for frame_u8 in u8:
                frame = av.VideoFrame.from_ndarray(frame_u8, format="rgb24")
                frame.pts = i  # constant frame rate: frame i at i / fps seconds
                i += 1
                container.mux(stream.encode(frame))
        container.mux(stream.encode(None))  # flush the encoder's delayed frames


@functools.cache  # the CPU's flags do not change while the process runs: read them once
def _x264_params() -> str:
    """x264 settings that make its bytes reproducible (see the module docstring): a fixed number
    of frame threads and, on a CPU with AVX-512, x264's features without it (only those the CPU
    lists: naming one it lacks would run instructions it cannot)."""
    params = f"threads={ENCODER_THREADS}:sliced-threads=0"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(
                (line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []
            )
    except OSError:
        flags = []
    if "avx512f" in flags:
        asm = [name for flag, name in X264_CPU_FEATURES.items() if flag in flags]
        params += ":asm=" + ",".join(asm)
    return params


def read_video(
    path: str | os.PathLike,
    *,
    num_frames: int | None = None,
    size: tuple[int, int] | None = None,
    sampling: str = "uniform",
    frame_count: int | None = None,
) -> np.ndarray:
    """Decode a video file or a folder of frames to uint8 ``(F, H, W, 3)`` RGB.

    num_frames: None keeps every frame. Otherwise `sampling` picks which of the T decoded frames:
      "uniform": evenly spaced over the whole clip, frame ``floor(i * T / num_frames)`` for
                 i = 0..num_frames-1 (so the first frame is always taken);
      "first":   the first num_frames frames, contiguous (decoding stops there).
    A clip with fewer than num_frames frames raises ValueError.
    size: ``(W, H)`` output size. The largest centered crop with the target's aspect ratio is cut
      from each frame and resized to exactly W x H (bilinear, antialiased), i.e. "resize to cover,
      then center crop".
    frame_count: the clip's frame count if already known (`count_frames`, e.g. from dataset
      validation); uniform sampling of a video file then skips its counting pass.
    Raises ValueError for a file that cannot be decoded or holds no frames.
    """
    if sampling not in SAMPLING_MODES:
        raise ValueError(f"sampling must be one of {SAMPLING_MODES}, got {sampling!r}")
    if num_frames is not None and num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    path = Path(path)
    if path.is_dir():
        frames = _read_folder(path, num_frames, sampling)
    else:
        frames = _read_container(path, num_frames, sampling, frame_count)
    if size is not None:
        frames = resize_center_crop(frames, size)
    return frames


def count_frames(path: str | os.PathLike, *, max_pixels: int | None = None) -> int:
    """Number of frames in a video file or frame folder, by decoding it all (so a corrupt stream
    is found here, not halfway through training). Raises ValueError if undecodable, or if a frame
    has more than `max_pixels` pixels."""
    return sum(1 for _ in decode_frames(path, max_pixels=max_pixels))


def decode_frames(
    path: str | os.PathLike, *, max_pixels: int | None = None
) -> Iterator[tuple[int, int]]:
    """Decode every frame of a video file or frame folder, yielding each frame's size `(W, H)`
    and keeping none: a caller can count, or stop, as it goes. Raises ValueError like
    `count_frames`.

    The frame size is read from the stream's header and checked against `max_pixels` before
    anything is decoded: a PNG of a few kilobytes can declare a frame of gigabytes.
    """
    path = Path(path)
    if path.is_dir():
        for f in list_frame_files(path):
            h, w, _ = _decode_image(f, max_pixels).shape
            yield w, h
    else:
        for frame in _iter_frames(path, max_pixels):
            yield frame.width, frame.height


def sample_indices(total: int, num_frames: int | None, sampling: str) -> list[int]:
    """Frame indices that `read_video` keeps out of `total` (see its docstring)."""
    if num_frames is None:
        return list(range(total))
    if total < num_frames:
        raise ValueError(f"clip has {total} frames, {num_frames} needed")
    if sampling == "first":
        return list(range(num_frames))
    return [i * total // num_frames for i in range(num_frames)]


def list_frame_files(folder: Path) -> list[Path]:
    """Image files of a frame folder in natural order (numbers compared as numbers)."""
    files = [p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES]
    return sorted(files, key=_natural_key)


def _natural_key(p: Path):
    return [(0, int(s), "") if s.isdigit() else (1, 0, s) for s in re.split(r"(\d+)", p.name)]


def _read_folder(folder: Path, num_frames: int | None, sampling: str) -> np.ndarray:
    files = list_frame_files(folder)
    if not files:
        raise ValueError(f"{folder}: no frame images ({', '.join(IMAGE_SUFFIXES)})")
    frames = [_decode_image(files[i]) for i in sample_indices(len(files), num_frames, sampling)]
    shapes = {f.shape for f in frames}
    if len(shapes) > 1:
        raise ValueError(f"{folder}: frames have different sizes {sorted(shapes)}")
    return np.stack(frames)  # (F, H, W, 3)


def _decode_image(path: Path, max_pixels: int | None = None) -> np.ndarray:
    """One image file -> uint8 (H, W, 3), with PyAV (FFmpeg's image decoders)."""
    for frame in _iter_frames(path, max_pixels):
        return _rgb(frame, path)
    raise ValueError(f"{path}: no image could be decoded")


def _iter_frames(path: Path, max_pixels: int | None = None):
    """Yield the decoded av.VideoFrame objects of a file; FFmpeg errors become ValueError.

    Frames stay in their decoded pixel format: only the ones kept are converted to RGB (`_rgb`).
    With `max_pixels`, a stream whose header declares larger frames is refused before decoding.
    """
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ValueError(f"{path}: no video stream")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if max_pixels is not None and width * height > max_pixels:
                raise ValueError(
                    f"{path}: frames of {width}x{height} pixels; at most {max_pixels} pixels "
                    "are accepted"
                )
            stream.thread_type = "AUTO"  # frame + slice threads inside FFmpeg
            yield from container.decode(stream)
    except av.FFmpegError as e:
        raise ValueError(f"{path}: cannot decode: {e}") from e


def _rgb(frame, path: Path) -> np.ndarray:
    """av.VideoFrame -> uint8 (H, W, 3) RGB."""
    import av

    try:
        return frame.to_ndarray(format="rgb24")
    except av.FFmpegError as e:
        raise ValueError(f"{path}: cannot convert a frame to RGB: {e}") from e


def _read_container(
    path: Path, num_frames: int | None, sampling: str, frame_count: int | None
) -> np.ndarray:
    keep = None
    if num_frames is not None:
        if sampling == "uniform" and frame_count is None:
            # The frame count in the header is missing for some formats (webm, gif) and can be
            # wrong; count by decoding, then decode again keeping only the sampled frames.
            frame_count = count_frames(path)
        if sampling == "first":
            keep = set(range(num_frames))
        else:
            keep = set(sample_indices(frame_count, num_frames, sampling))
    frames = []
    for i, frame in enumerate(_iter_frames(path)):
        if keep is None or i in keep:
            frames.append(_rgb(frame, path))
        if keep is not None and len(frames) == len(keep):
            break  # nothing further is needed: stop decoding
    if not frames:
        raise ValueError(f"{path}: no frames decoded")
    if num_frames is not None and len(frames) < num_frames:
        raise ValueError(f"{path}: clip has {len(frames)} frames, {num_frames} needed")
    return np.stack(frames)  # (F, H, W, 3)


# ---------------------------------------------------------------------- geometry


def center_crop_box(w: int, h: int, out_w: int, out_h: int) -> tuple[int, int, int, int]:
    """(left, top, crop_w, crop_h): the largest centered box of aspect out_w:out_h inside w x h."""
    if w * out_h > h * out_w:  # source is wider than the target: keep full height
        crop_h, crop_w = h, min(w, round(h * out_w / out_h))
    else:
        crop_w, crop_h = w, min(h, round(w * out_h / out_w))
    return (w - crop_w) // 2, (h - crop_h) // 2, crop_w, crop_h


def resize_center_crop(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """uint8 (F, H, W, 3) -> (F, out_h, out_w, 3): center crop to the target aspect, resize."""
    out_w, out_h = size
    if out_w < 1 or out_h < 1:
        raise ValueError(f"size must be positive (W, H), got {size}")
    _, h, w, _ = frames.shape
    left, top, cw, ch = center_crop_box(w, h, out_w, out_h)
    crop = frames[:, top : top + ch, left : left + cw]
    if (cw, ch) == (out_w, out_h):
        return np.ascontiguousarray(crop)
    return _resize(crop, out_w, out_h)


def _resize(frames: np.ndarray, out_w: int, out_h: int) -> np.ndarray:
    """uint8 (F, H, W, 3) -> uint8 (F, out_h, out_w, 3), bilinear with antialiasing (CPU)."""
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()  # (F, 3, H, W)
    # antialias=True low-pass filters when shrinking (PIL-style), so downscaled clips do not alias.
    y = F.interpolate(x, size=(out_h, out_w), mode="bilinear", antialias=True, align_corners=False)
    y = torch.clamp(torch.round(y), 0, 255).to(torch.uint8)  # (F, 3, out_h, out_w)
    return y.permute(0, 2, 3, 1).contiguous().numpy()  # (F, out_h, out_w, 3)
