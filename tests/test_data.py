"""Datasets: every bad case rejected up front with file and line; loading, order and resume."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")

import megaslide.engine.training.data as data_mod  # noqa: E402
from megaslide.engine.training.data import (  # noqa: E402
    BackgroundLoader,
    DatasetError,
    DatasetLimits,
    VideoDataset,
    epoch_permutation,
    validate_dataset,
)
from megaslide.engine.video import write_mp4  # noqa: E402

SIZE = (16, 16)  # (W, H)
FRAMES = 4


def clip(seed: int, f: int = 6, h: int = 24, w: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (f, h, w, 3), dtype=np.uint8)


def write_png(path, frame: np.ndarray) -> None:
    codec = av.CodecContext.create("png", "w")
    codec.width, codec.height, codec.pix_fmt = frame.shape[1], frame.shape[0], "rgb24"
    vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
    path.write_bytes(b"".join(bytes(p) for p in codec.encode(vf) + codec.encode(None)))


def write_metadata(root, rows) -> None:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    (root / "metadata.jsonl").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def good_root(tmp_path_factory):
    """Five clips: four mp4 of different sizes and a frame folder."""
    root = tmp_path_factory.mktemp("good")
    (root / "clips").mkdir()
    rows = []
    for i in range(4):
        write_mp4(root / "clips" / f"c{i}.mp4", clip(i, h=24 + 8 * i), fps=8)
        rows.append({"file": f"clips/c{i}.mp4", "text": f"caption {i}", "extra": i})
    folder = root / "clips" / "frames"
    folder.mkdir()
    for j, fr in enumerate(clip(9, f=5)):
        write_png(folder / f"{j:03d}.png", fr)
    rows.append({"file": "clips/frames", "text": "caption 4"})
    write_metadata(root, rows[:2] + [""] + rows[2:])  # a blank line is allowed
    return root


def test_good_dataset_loads(good_root):
    samples = validate_dataset(good_root, num_frames=FRAMES)
    assert [s.text for s in samples] == [f"caption {i}" for i in range(5)]
    assert [s.line for s in samples] == [1, 2, 4, 5, 6]
    assert [s.num_frames for s in samples] == [6, 6, 6, 6, 5]
    ds = VideoDataset(good_root, FRAMES, SIZE)
    assert len(ds) == 5
    for i in range(5):
        video, text = ds[i]
        assert video.shape == (3, FRAMES, 16, 16) and video.dtype == torch.float32
        assert -1.0 <= video.min() and video.max() <= 1.0
        assert text == f"caption {i}"


def bad_case(tmp_path, name: str):
    """Build a dataset whose line 2 has one problem; return (root, expected message regex)."""
    root = tmp_path / name
    root.mkdir()
    write_mp4(root / "ok.mp4", clip(0), fps=8)
    good = {"file": "ok.mp4", "text": "fine"}
    if name == "malformed":
        bad, msg = '{"file": "ok.mp4", "text": "x"', "malformed JSON"
    elif name == "not_object":
        bad, msg = '["ok.mp4", "x"]', "expected a JSON object"
    elif name == "missing_key":
        bad, msg = {"file": "ok.mp4"}, "missing key.*text"
    elif name == "empty_caption":
        bad, msg = {"file": "ok.mp4", "text": "   "}, r"\(ok.mp4\): empty caption"
    elif name == "missing_file":
        bad, msg = {"file": "nope.mp4", "text": "x"}, r"\(nope.mp4\): file not found"
    elif name == "absolute":
        bad, msg = {"file": str(root / "ok.mp4"), "text": "x"}, "escapes the dataset root"
    elif name == "dotdot":
        bad, msg = {"file": "../good/ok.mp4", "text": "x"}, r"\(../good/ok.mp4\): path escapes"
    elif name == "undecodable":
        (root / "bad.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 50)
        bad, msg = {"file": "bad.mp4", "text": "x"}, r"\(bad.mp4\): cannot decode"
    elif name == "empty_file":
        (root / "zero.mp4").write_bytes(b"")
        bad, msg = {"file": "zero.mp4", "text": "x"}, r"\(zero.mp4\): cannot decode"
    elif name == "empty_folder":
        (root / "frames").mkdir()
        bad, msg = {"file": "frames", "text": "x"}, r"\(frames\): video has no frames"
    elif name == "too_short":
        write_mp4(root / "short.mp4", clip(1, f=3), fps=8)
        bad = {"file": "short.mp4", "text": "x"}
        msg = r"\(short.mp4\): video has 3 frames, training needs 4"
    else:
        raise AssertionError(name)
    write_metadata(root, [good, bad, good])
    return root, msg


BAD_CASES = [
    "malformed",
    "not_object",
    "missing_key",
    "empty_caption",
    "missing_file",
    "absolute",
    "dotdot",
    "undecodable",
    "empty_file",
    "empty_folder",
    "too_short",
]


@pytest.mark.parametrize("name", BAD_CASES)
def test_bad_dataset_rejected_before_any_sample(tmp_path, monkeypatch, name):
    root, msg = bad_case(tmp_path, name)

    def consumed(*args, **kwargs):
        raise AssertionError("a sample was decoded for training before validation finished")

    monkeypatch.setattr(data_mod, "read_video", consumed)  # what __getitem__ uses
    with pytest.raises(DatasetError, match=r"metadata\.jsonl line 2\b.*" + msg) as info:
        VideoDataset(root, FRAMES, SIZE)
    assert len(info.value.problems) == 1, info.value.problems  # lines 1 and 3 are fine


def test_all_problems_reported_in_one_error(tmp_path):
    root = tmp_path / "many"
    root.mkdir()
    write_mp4(root / "ok.mp4", clip(0), fps=8)
    write_metadata(
        root,
        [
            {"file": "ok.mp4", "text": "fine"},
            "{oops",
            {"file": "gone.mp4", "text": "x"},
            {"file": "ok.mp4", "text": ""},
            {"file": "ok.mp4", "text": "fine again"},
            {"text": "no file"},
        ],
    )
    with pytest.raises(DatasetError) as info:
        validate_dataset(root)
    problems = info.value.problems
    assert [p.split(":")[0].split(" (")[0] for p in problems] == [
        "metadata.jsonl line 2",
        "metadata.jsonl line 3",
        "metadata.jsonl line 4",
        "metadata.jsonl line 6",
    ]
    assert "4 problem(s)" in str(info.value)
    with pytest.raises(DatasetError) as info:
        validate_dataset(root, max_problems=2)
    assert len(info.value.problems) == 2 and "and 2 more" in str(info.value)


def test_missing_metadata_and_empty_dataset(tmp_path):
    with pytest.raises(DatasetError, match="metadata.jsonl: missing"):
        validate_dataset(tmp_path)
    write_metadata(tmp_path, [""])
    with pytest.raises(DatasetError, match="no samples"):
        validate_dataset(tmp_path)


def collect(loader: BackgroundLoader, n: int):
    return [next(loader) for _ in range(n)]


def test_epoch_order_is_a_permutation_fixed_by_seed(good_root):
    ds = VideoDataset(good_root, FRAMES, SIZE)
    with BackgroundLoader(ds, batch_size=1, seed=3) as a, BackgroundLoader(ds, seed=3) as b:
        seq_a = [x.indices[0] for x in collect(a, 15)]
        seq_b = [x.indices[0] for x in collect(b, 15)]
    assert seq_a == seq_b
    for e in range(3):  # every epoch visits each sample exactly once, in that epoch's order
        assert seq_a[5 * e : 5 * e + 5] == epoch_permutation(5, 3, e).tolist()
        assert sorted(seq_a[5 * e : 5 * e + 5]) == list(range(5))
    other = [epoch_permutation(5, 4, e).tolist() for e in range(3)]
    assert other != [seq_a[0:5], seq_a[5:10], seq_a[10:15]]


def test_loader_resume_continues_with_exactly_the_next_sample(good_root):
    ds = VideoDataset(good_root, FRAMES, SIZE)
    with BackgroundLoader(ds, batch_size=2, seed=7, prefetch=3) as full:
        reference = collect(full, 7)  # 14 samples: crosses two epoch boundaries (5 samples each)
    with BackgroundLoader(ds, batch_size=2, seed=7, prefetch=3) as first:
        collect(first, 3)
        time.sleep(0.05)  # let the thread run ahead: the saved position must not include that
        state = first.state_dict()
    assert state == {"seed": 7, "epoch": 1, "index": 1}
    with BackgroundLoader(ds, batch_size=2, seed=0) as resumed:
        resumed.load_state_dict(state)
        rest = collect(resumed, 4)
    for want, got in zip(reference[3:], rest):
        assert got.indices == want.indices and got.text == want.text and got.epoch == want.epoch
        assert torch.equal(got.video, want.video)
    assert rest[0].video.shape == (2, 3, FRAMES, 16, 16)


class FlakyDataset:
    """Fails on one index; counts reads."""

    def __init__(self, n: int, bad: int):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise RuntimeError(f"boom at {i}")
        return torch.full((3, 1, 2, 2), float(i)), f"t{i}"


def test_background_loader_propagates_errors():
    bad = int(epoch_permutation(6, 0, 0)[2])  # third sample of epoch 0
    loader = BackgroundLoader(FlakyDataset(6, bad), batch_size=1, seed=0)
    assert [b.indices[0] for b in collect(loader, 2)] == epoch_permutation(6, 0, 0)[:2].tolist()
    with pytest.raises(RuntimeError, match=f"boom at {bad}"):
        next(loader)
    with pytest.raises(RuntimeError, match="boom"):  # stays failed
        next(loader)
    assert loader._thread is None  # the thread was joined
    loader.close()


def test_file_removed_after_validation_raises_dataset_error(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    write_mp4(root / "a.mp4", clip(0), fps=8)
    write_metadata(root, [{"file": "a.mp4", "text": "x"}])
    ds = VideoDataset(root, FRAMES, SIZE)
    (root / "a.mp4").write_bytes(b"corrupted later")
    with BackgroundLoader(ds) as loader, pytest.raises(DatasetError, match="line 1"):
        next(loader)


def test_close_does_not_hang_on_a_full_queue():
    loader = BackgroundLoader(FlakyDataset(4, bad=-1), batch_size=1, prefetch=1)
    next(loader)
    time.sleep(0.05)  # the producer is now blocked on the full queue
    t0 = time.perf_counter()
    loader.close()
    assert time.perf_counter() - t0 < 2.0
    assert not any(t.name == "video-loader" for t in threading.enumerate())


def test_cache_keeps_decoded_clips_up_to_its_budget(good_root, monkeypatch):
    import megaslide.engine.training.data as data
    from megaslide.engine.video import read_video

    plain = VideoDataset(good_root, FRAMES, SIZE)
    one_clip = plain[0][0].numel()  # uint8 bytes of one decoded clip
    cached = VideoDataset(good_root, FRAMES, SIZE, cache_bytes=2 * one_clip)
    first = [cached[i][0] for i in range(5)]
    reads = []
    monkeypatch.setattr(
        data, "read_video", lambda path, **kw: reads.append(path) or read_video(path, **kw)
    )
    again = [cached[i][0] for i in range(5)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert len(reads) == 3  # clips 0 and 1 fit the budget and are never decoded again
    assert all(torch.equal(cached[i][0], plain[i][0]) for i in range(5))


def test_limits_bound_what_checking_a_dataset_costs(tmp_path):
    from api_helpers import png_of_zeros

    root = tmp_path / "upload"
    (root / "frames").mkdir(parents=True)
    (root / "frames" / "0.png").write_bytes(png_of_zeros(8192, 8192))  # 67 Mpixels in ~10 KB
    for i in range(3):
        write_mp4(root / f"c{i}.mp4", clip(i), fps=8)  # 6 frames each
    rows = [{"file": f"c{i}.mp4", "text": "x"} for i in range(3)]
    write_metadata(
        root, [*rows, {"file": "frames", "text": "bomb"}, {"file": "c0.mp4", "text": "y" * 300}]
    )

    with pytest.raises(DatasetError) as info:
        validate_dataset(root, limits=DatasetLimits(max_pixels=1_000_000, max_line_bytes=200))
    assert info.value.problems == [
        "metadata.jsonl line 4 (frames): cannot decode video: frames/0.png: frames of 8192x8192 "
        "pixels; at most 1000000 pixels are accepted",
        "metadata.jsonl line 5: longer than 200 bytes",
    ]
    assert str(tmp_path) not in info.value.summary()

    with pytest.raises(DatasetError, match="more than 4 clips"):
        validate_dataset(root, limits=DatasetLimits(max_clips=4))
    write_metadata(root, rows)
    with pytest.raises(DatasetError, match="more than 17 frames in all"):
        validate_dataset(root, limits=DatasetLimits(max_frames=17))
    assert len(validate_dataset(root, limits=DatasetLimits(max_frames=18, max_clips=3))) == 3
