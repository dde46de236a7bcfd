"""Video I/O: MP4 round trips, the float mapping, atomic writes, frame folders, gif, webm."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")

from megaslide.engine.video import (  # noqa: E402
    center_crop_box,
    float_to_frames,
    frames_to_float,
    read_video,
    sample_indices,
    write_mp4,
)


def smooth_clip(f: int = 6, h: int = 48, w: int = 64) -> np.ndarray:
    """uint8 (F, H, W, 3): gentle gradients that move per frame (no edges, no wrap-around)."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    frames = [
        np.stack([40 + 2 * xx + t, 60 + 2 * yy + 2 * t, 200 - xx - yy + 3 * t], -1)
        for t in range(f)
    ]
    return np.stack(frames).round().clip(0, 255).astype(np.uint8)


def yuv420_round_trip(frames: np.ndarray) -> np.ndarray:
    """What RGB -> yuv420p -> RGB alone does to the frames (the same swscale conversions the
    encoder and decoder use), without any codec."""
    return np.stack(
        [
            av.VideoFrame.from_ndarray(f, format="rgb24")
            .reformat(format="yuv420p")
            .to_ndarray(format="rgb24")
            for f in frames
        ]
    )


def write_png(path, frame: np.ndarray) -> None:
    codec = av.CodecContext.create("png", "w")
    codec.width, codec.height, codec.pix_fmt = frame.shape[1], frame.shape[0], "rgb24"
    vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
    path.write_bytes(b"".join(bytes(p) for p in codec.encode(vf) + codec.encode(None)))


def test_mp4_lossless_round_trip_equals_colorspace_oracle(tmp_path):
    # crf=0 makes x264 lossless on the yuv420p planes, so the only change left is the RGB <-> YUV
    # 4:2:0 conversion; the decoded frames must equal that conversion bit for bit.
    clip = smooth_clip()
    out = write_mp4(tmp_path / "a.mp4", clip, fps=16, crf=0)
    decoded = read_video(out)
    assert decoded.shape == clip.shape and decoded.dtype == np.uint8
    np.testing.assert_array_equal(decoded, yuv420_round_trip(clip))


def test_mp4_default_quality_close_to_input(tmp_path):
    # The colour conversion alone costs ~1.4 levels mean (oracle above). x264 at its default crf 18
    # ("visually lossless") measures ~42 dB on this clip; 38 dB leaves margin for other x264 builds
    # yet fails on any real bug (wrong matrix or range: < 30 dB; swapped channels: < 15 dB).
    clip = smooth_clip()
    decoded = read_video(write_mp4(tmp_path / "a.mp4", clip)).astype(np.float64)
    mse = np.mean((decoded - clip) ** 2)
    psnr = 10 * np.log10(255.0**2 / mse)
    assert psnr >= 38.0, f"PSNR {psnr:.1f} dB"


def test_mp4_container_properties(tmp_path):
    clip = smooth_clip(f=10)
    out = write_mp4(tmp_path / "a.mp4", torch.from_numpy(clip), fps=24)
    head = out.read_bytes()[:64]
    assert head.find(b"moov") != -1, "faststart: the moov index must come before the media data"
    with av.open(str(out)) as c:
        s = c.streams.video[0]
        assert s.codec_context.name == "h264"
        assert s.pix_fmt == "yuv420p"
        assert s.average_rate == 24
        pts = [f.pts for f in c.decode(s)]
    steps = {b - a for a, b in zip(pts, pts[1:])}
    assert len(pts) == 10 and len(steps) == 1, f"not constant frame rate: {pts}"


def test_odd_size_rejected_with_clear_message(tmp_path):
    clip = smooth_clip(h=48, w=63)
    with pytest.raises(ValueError, match=r"63x48: width and height must be even"):
        write_mp4(tmp_path / "a.mp4", clip)
    with pytest.raises(ValueError, match="even"):
        write_mp4(tmp_path / "b.mp4", smooth_clip(h=47, w=64))
    assert list(tmp_path.iterdir()) == []


def test_failed_write_leaves_no_partial_file_and_keeps_old_one(tmp_path):
    path = tmp_path / "a.mp4"
    write_mp4(path, smooth_clip(), crf=0)
    before = path.read_bytes()
    # An invalid x264 preset fails when the encoder opens, after the temporary file exists.
    with pytest.raises(av.FFmpegError):
        write_mp4(path, smooth_clip(f=3), preset="no-such-preset")
    assert [p.name for p in tmp_path.iterdir()] == ["a.mp4"]
    assert path.read_bytes() == before
    with pytest.raises(av.FFmpegError):
        write_mp4(tmp_path / "new.mp4", smooth_clip(f=3), preset="no-such-preset")
    assert [p.name for p in tmp_path.iterdir()] == ["a.mp4"]


def test_float_mapping_exact():
    x = torch.tensor([-1.0, -2.0, 1.0, 3.0, 0.0, -1 + 1 / 127.5, 1 / 255.0 - 1.0])
    x = x.view(1, 1, -1, 1).expand(1, 1, -1, 3)  # (F=1, H=1, W=7, 3)
    got = float_to_frames(x)[0, 0, :, 0].tolist()
    # (x + 1) * 127.5 = 0, -127.5 -> clip 0, 255, 510 -> clip 255, 127.5 -> 128 (half to even),
    # 1, 0.5 -> 0 (half to even)
    assert got == [0, 0, 255, 255, 128, 1, 0]
    u8 = np.arange(256, dtype=np.uint8).reshape(1, 4, 64, 1).repeat(3, axis=-1)  # (1, 4, 64, 3)
    f = frames_to_float(u8)
    assert f.shape == (3, 1, 4, 64) and f.dtype == torch.float32
    assert f.min() == -1.0 and f.max() == 1.0
    np.testing.assert_array_equal(float_to_frames(f), u8)  # (3, F, H, W) layout inferred
    np.testing.assert_array_equal(float_to_frames(f.permute(1, 2, 3, 0)), u8)  # (F, H, W, 3)


def test_float_layout_errors():
    with pytest.raises(ValueError, match="ambiguous"):
        float_to_frames(torch.zeros(3, 2, 2, 3))
    np.testing.assert_array_equal(
        float_to_frames(torch.zeros(3, 2, 2, 3), layout="CFHW"),
        np.full((2, 2, 3, 3), 128, np.uint8),
    )
    with pytest.raises(ValueError, match="NaN"):
        float_to_frames(torch.full((1, 2, 2, 3), float("nan")))
    with pytest.raises(ValueError, match="channel"):
        float_to_frames(torch.zeros(2, 4, 4, 4))


def test_float_input_writes_same_video_as_uint8(tmp_path):
    clip = smooth_clip()
    as_float = frames_to_float(clip)  # (3, F, H, W)
    a = read_video(write_mp4(tmp_path / "u8.mp4", clip, crf=0))
    b = read_video(write_mp4(tmp_path / "f.mp4", as_float, crf=0))
    c = read_video(write_mp4(tmp_path / "f2.mp4", as_float.permute(1, 2, 3, 0).numpy(), crf=0))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)


def test_frame_folder_natural_order_and_sampling(tmp_path):
    folder = tmp_path / "clip"
    folder.mkdir()
    frames = [np.full((8, 10, 3), 20 * i, np.uint8) for i in range(12)]
    for i, fr in enumerate(frames):
        write_png(folder / f"frame{i}.png", fr)  # frame10 must come after frame9, not after frame1
    (folder / "notes.txt").write_text("ignored")
    got = read_video(folder)
    np.testing.assert_array_equal(got, np.stack(frames))
    uniform = read_video(folder, num_frames=4)  # floor(i * 12 / 4) = 0, 3, 6, 9
    assert uniform[:, 0, 0, 0].tolist() == [0, 60, 120, 180]
    first = read_video(folder, num_frames=3, sampling="first")
    assert first[:, 0, 0, 0].tolist() == [0, 20, 40]
    with pytest.raises(ValueError, match="12 frames, 13 needed"):
        read_video(folder, num_frames=13)


def test_sampling_from_mp4(tmp_path):
    clip = np.stack([np.full((16, 16, 3), 16 * i + 8, np.uint8) for i in range(10)])
    path = write_mp4(tmp_path / "a.mp4", clip, crf=0)
    sampled = read_video(path, num_frames=5)  # frames 0, 2, 4, 6, 8
    got = sampled[:, 8, 8, 0].astype(int)
    np.testing.assert_allclose(got, [8, 40, 72, 104, 136], atol=2)  # flat frames: ~lossless
    np.testing.assert_array_equal(read_video(path, num_frames=5, frame_count=10), sampled)
    got = read_video(path, num_frames=2, sampling="first")[:, 8, 8, 0].astype(int)
    np.testing.assert_allclose(got, [8, 24], atol=2)
    assert sample_indices(10, 3, "uniform") == [0, 3, 6]


def test_resize_center_crop(tmp_path):
    # 80x40 frame: red left quarter, green middle half, blue right quarter.
    frame = np.zeros((40, 80, 3), np.uint8)
    frame[:, :20, 0] = 255
    frame[:, 20:60, 1] = 255
    frame[:, 60:, 2] = 255
    folder = tmp_path / "f"
    folder.mkdir()
    write_png(folder / "0.png", frame)
    assert center_crop_box(80, 40, 32, 32) == (20, 0, 40, 40)
    square = read_video(folder, size=(32, 32))  # the centered 40x40 crop is all green
    assert square.shape == (1, 32, 32, 3)
    assert (square[0] == [0, 255, 0]).all()
    wide = read_video(folder, size=(16, 8))  # same aspect: no crop, plain downscale
    assert wide.shape == (1, 8, 16, 3)
    assert (wide[0, :, 0] == [255, 0, 0]).all() and (wide[0, :, -1] == [0, 0, 255]).all()
    tall = read_video(folder, size=(10, 20))  # crop 20x40 from the middle: green
    assert tall.shape == (1, 20, 10, 3) and (tall[0] == [0, 255, 0]).all()


def test_gif(tmp_path):
    # rgb8 gif palette: 3 bits of red and green (0, 36, ..., 252), 2 of blue (0, 85, 170, 255);
    # these colours are exactly representable, so decoding must give them back exactly.
    colours = [(252, 0, 0), (0, 252, 0), (0, 0, 255), (252, 252, 255), (0, 0, 0), (108, 36, 170)]
    path = tmp_path / "a.gif"
    with av.open(str(path), "w") as c:
        s = c.add_stream("gif", rate=8)
        s.width, s.height, s.pix_fmt = 32, 24, "rgb8"
        for i, col in enumerate(colours):
            f = av.VideoFrame.from_ndarray(np.full((24, 32, 3), col, np.uint8), format="rgb24")
            f.pts = i
            c.mux(s.encode(f))
        c.mux(s.encode(None))
    got = read_video(path)
    assert got.shape == (6, 24, 32, 3)
    assert [tuple(int(v) for v in g[5, 5]) for g in got] == colours
    assert read_video(path, num_frames=3).shape == (3, 24, 32, 3)


def test_webm(tmp_path):
    clip = smooth_clip()
    path = tmp_path / "a.webm"
    with av.open(str(path), "w") as c:
        s = c.add_stream("libvpx-vp9", rate=8)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        s.options = {"lossless": "1"}
        for i, fr in enumerate(clip):
            f = av.VideoFrame.from_ndarray(fr, format="rgb24")
            f.pts = i
            c.mux(s.encode(f))
        c.mux(s.encode(None))
    # Lossless VP9: again only the colour conversion remains (webm headers carry no frame count,
    # so this also exercises counting by decoding).
    np.testing.assert_array_equal(read_video(path), yuv420_round_trip(clip))
    assert read_video(path, num_frames=3, size=(32, 32)).shape == (3, 32, 32, 3)


def test_undecodable_file(tmp_path):
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"this is not a video" * 10)
    with pytest.raises(ValueError, match="bad.mp4"):
        read_video(bad)


def test_a_write_that_fails_for_want_of_space_leaves_no_temporary_file(tmp_path):
    import errno

    from megaslide.engine.atomic import atomic_directory, atomic_write, remove_stale

    def full(_tmp):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write(tmp_path / "clip.png", full)
    with pytest.raises(OSError, match="No space"), atomic_directory(tmp_path / "step-3") as tmp:
        (tmp / "model.safetensors").write_bytes(b"half")
        full(tmp)
    assert list(tmp_path.iterdir()) == []  # removed at once, not at the next start
    # What a killed writer leaves is removed only once it has been left alone long enough.
    (tmp_path / ".clip.mp4.abc.tmp").write_bytes(b"x")
    remove_stale(tmp_path, min_age_s=3600)
    assert (tmp_path / ".clip.mp4.abc.tmp").exists()
    remove_stale(tmp_path)
    assert list(tmp_path.iterdir()) == []


WRITER = """
import sys, time
from megaslide.engine.atomic import atomic_write

def write(tmp):
    tmp.write_bytes(b"half an mp4")
    print("writing", flush=True)
    time.sleep(60)  # killed here, mid-write

atomic_write(sys.argv[1], write)
"""


@pytest.mark.slow
def test_a_killed_writers_temporary_file_goes_at_once_and_a_live_ones_stays(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from megaslide.engine.atomic import LOCK_GRACE_S, remove_abandoned

    def age(path, seconds):
        os.utime(path, (time.time() - seconds, time.time() - seconds))

    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path / "clip.mp4")], stdout=subprocess.PIPE
    )
    try:
        assert writer.stdout.readline() == b"writing\n"
        (tmp,) = tmp_path.glob(".clip.mp4.*.tmp")
        age(tmp, 2 * LOCK_GRACE_S)
        assert remove_abandoned(tmp_path) == 0 and tmp.exists()  # its writer is alive
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    assert remove_abandoned(tmp_path) == 1 and not tmp.exists()  # its writer is gone
    # One just made may not be locked yet by its writer: it stays until the grace is over.
    young = tmp_path / ".clip.png.abc.tmp"
    young.write_bytes(b"x")
    assert remove_abandoned(tmp_path) == 0 and young.exists()
    age(young, 2 * LOCK_GRACE_S)
    assert remove_abandoned(tmp_path) == 1 and list(tmp_path.iterdir()) == []


def test_a_guard_that_refuses_leaves_the_old_directory_as_it_was(tmp_path):
    """The guard around an atomic directory's renames (a fine-tune's claim, a lock): refusing,
    it leaves what was at the path and no temporary directory; letting it, the new one is in."""
    from megaslide.engine.atomic import atomic_directory

    target = tmp_path / "step-3"
    target.mkdir()
    (target / "which").write_text("old")

    @contextlib.contextmanager
    def refuse():
        raise PermissionError("no longer ours")
        yield

    with pytest.raises(PermissionError), atomic_directory(target, guard=refuse) as tmp:
        (tmp / "which").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["step-3"]
    assert (target / "which").read_text() == "old"
    with atomic_directory(target, guard=contextlib.nullcontext) as tmp:
        (tmp / "which").write_text("new")
    assert (target / "which").read_text() == "new"


_ENCODE = """
import sys
import numpy as np
from megaslide.engine.video import write_mp4
write_mp4(sys.argv[2], np.load(sys.argv[1]), fps=16)
"""


@pytest.mark.slow
def test_the_same_frames_give_the_same_mp4_bytes_in_separate_processes(tmp_path):
    """Two processes encode the same frames as generate and the worker do (`write_mp4`), each
    with a different heap: glibc's MALLOC_PERTURB_ fills memory malloc hands out with a byte of
    its own, as a long-lived process's reused memory holds leftovers. Same bytes, both times."""
    import os
    import subprocess
    import sys

    # A bright spot moving over stripes, with noise: x264's macroblock tree has work to do.
    rng = np.random.default_rng(1)
    yy, xx = np.mgrid[0:64, 0:64].astype(np.float64)
    frames = [
        np.stack(
            [
                255 * np.exp(-((xx - 13 - 2.5 * t) ** 2 + (yy - 32) ** 2) / 228),
                128 + 100 * np.sin(xx / 5 + t / 3),
                80 + 60 * np.cos(yy / 7),
            ],
            -1,
        )
        + rng.normal(0, 6, (64, 64, 3))
        for t in range(16)
    ]
    np.save(tmp_path / "frames.npy", np.stack(frames).round().clip(0, 255).astype(np.uint8))
    outputs = []
    for perturb in ("1", "200"):
        out = tmp_path / f"heap{perturb}.mp4"
        env = {**os.environ, "MALLOC_PERTURB_": perturb}
        args = [sys.executable, "-c", _ENCODE, str(tmp_path / "frames.npy"), str(out)]
        subprocess.run(args, env=env, check=True, timeout=120)
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
