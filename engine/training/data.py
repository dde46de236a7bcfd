"""Fine-tuning data: a directory of videos with a `metadata.jsonl`, validated before training.

Layout (the convention of Hugging Face `datasets` "videofolder" and the diffusers trainers):

    root/
      metadata.jsonl        one JSON object per line: {"file": "clips/a.mp4", "text": "a cat ..."}
      clips/a.mp4           mp4, webm, gif, ... anything FFmpeg decodes,
      clips/b/              or a folder of frames (png/jpg, natural name order)

`file` is relative to root. Blank lines are ignored; other keys are allowed and ignored.

`validate_dataset` checks everything before a step runs: malformed JSON, a line that is not an
object, missing or non-string keys, an empty caption, a path that is absolute or uses ``..``, a
missing file, a video that does not decode or holds no frames or frames of different sizes, and
a clip shorter than the frame count training needs. All problems (up to `max_problems`) are
reported in one `DatasetError`, each naming the line of metadata.jsonl and the file as the
dataset spells it, never where the dataset lies. Each sample keeps its frame count and frame
size, which aspect and length buckets (buckets.py) are planned from. Symlinks are followed (the
Hugging Face cache stores files as symlinks), so only the written path is checked for escaping
the root. A server checking an upload also bounds what the check may cost (`DatasetLimits`):
lines, clips, frames decoded, and pixels per frame.

Order: the sample stream is epoch 0's permutation, then epoch 1's, and so on; the permutation of
epoch e depends only on (seed, e, dataset size). A batch is the next `batch_size` samples of that
stream (it may straddle two epochs). With a bucket plan (buckets.py) a batch is instead the next of
the epoch's batches, each of one bucket, in an order that depends only on (seed, epoch, plan). The
loader's position is (epoch, index in epoch: of a sample, or of a batch with a plan), and
`BackgroundLoader.state_dict()` gives the position of the next batch the consumer will receive, so
a resumed run continues with exactly the next batch.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Protocol

import numpy as np
import torch

from ..video import decode_frames, frames_to_float, read_video

METADATA = "metadata.jsonl"
COPY_CHUNK = 1 << 20  # how much of an overlong metadata line is read at a time, to skip it


class BatchPlan(Protocol):
    """Batches planned ahead for a loader (buckets.py's `BucketPlan`): each epoch's batches of
    sample indices, a pure function of (seed, epoch)."""

    batch_size: int
    batches_per_epoch: int
    fingerprint: str

    def epoch_batches(self, seed: int, epoch: int) -> list[list[int]]: ...


class DatasetError(ValueError):
    """A dataset that cannot be trained on; `problems` lists each "file line N: what" message."""

    def __init__(self, root: str | os.PathLike, problems: list[str], total: int | None = None):
        self.root = Path(root)
        self.problems = problems
        self.total = len(problems) if total is None else total
        super().__init__(f"dataset {root} has {self.summary()}")

    def summary(self) -> str:
        """The problems, without the dataset's location: what a server tells the uploader, who
        knows the dataset by its own names and has no business learning the server's paths."""
        more = f"\n  ... and {self.total - len(self.problems)} more"
        more = more if self.total > len(self.problems) else ""
        return f"{self.total} problem(s):\n  " + "\n  ".join(self.problems) + more


@dataclass(frozen=True)
class DatasetLimits:
    """What checking one dataset may cost; None leaves a bound off (a local dataset is trusted)."""

    max_clips: int | None = None  # lines of metadata.jsonl that are not blank
    max_line_bytes: int | None = None  # one line of metadata.jsonl
    max_frames: int | None = None  # frames decoded, all clips together
    max_pixels: int | None = None  # one frame, from its header, before it is decoded


@dataclass(frozen=True)
class Sample:
    """One validated training clip."""

    path: Path  # absolute path of the video file or frame folder
    text: str  # caption
    line: int  # 1-based line in metadata.jsonl
    num_frames: int  # frames in the clip, counted by decoding it
    size: tuple[int, int] | None = None  # (W, H) of its frames, as decoded


def validate_dataset(
    root: str | os.PathLike,
    *,
    num_frames: int | None = None,
    max_problems: int = 20,
    workers: int | None = None,
    limits: DatasetLimits = DatasetLimits(),
) -> list[Sample]:
    """Check a whole dataset directory and return its samples, or raise `DatasetError`.

    num_frames: frames each clip must have at least (the training clip length); None accepts any
    clip with one frame or more. Every video is decoded in full (on `workers` threads), so an
    undecodable file is found now rather than halfway through training. `limits` bounds the work:
    a dataset past one of them is refused as soon as that is known.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(root, ["not a directory"])
    if not (root / METADATA).is_file():
        raise DatasetError(
            root, [f'{METADATA}: missing (one {{"file": ..., "text": ...}} per line)']
        )
    entries, problems = _read_metadata(root, limits)
    counts = _frame_counts(root, entries, num_frames, limits, workers)
    samples = []
    for (lineno, _, text, path), res in zip(entries, counts):
        if isinstance(res, str):
            problems.append((lineno, res))
        else:
            n, size = res
            samples.append(Sample(path=path, text=text, line=lineno, num_frames=n, size=size))

    if problems:
        problems.sort(key=lambda p: p[0])
        raise DatasetError(root, [m for _, m in problems[:max_problems]], total=len(problems))
    if not samples:
        raise DatasetError(root, [f"{METADATA}: no samples"])
    return samples


# One line of the metadata that names a clip: (line, file as written, caption, absolute path).
_Entry = tuple[int, str, str, Path]


def _read_metadata(root: Path, limits: DatasetLimits) -> tuple[list[_Entry], list[tuple[int, str]]]:
    """The metadata's entries, and its problems as (line, message); raises `DatasetError` at
    once past `limits.max_clips`."""
    problems: list[tuple[int, str]] = []  # (line, message), sorted by line at the end
    entries: list[_Entry] = []
    clips = 0  # lines that are not blank, good or bad
    for lineno, raw in _metadata_lines(root / METADATA, limits.max_line_bytes):
        if raw is not None and not raw.strip():
            continue
        clips += 1
        if limits.max_clips is not None and clips > limits.max_clips:
            raise DatasetError(
                root,
                [f"{METADATA}: more than {limits.max_clips} clips; at most that many are accepted"],
            )
        entry = _entry(root, lineno, raw, limits.max_line_bytes)
        if isinstance(entry, str):
            problems.append((lineno, entry))
        else:
            entries.append(entry)
    return entries, problems


def _entry(root: Path, lineno: int, raw: bytes | None, max_line_bytes: int | None) -> _Entry | str:
    """One line's entry, or what is wrong with it (None in place of a line that was too long)."""
    where = f"{METADATA} line {lineno}"
    if raw is None:
        return f"{where}: longer than {max_line_bytes} bytes"
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return f"{where}: not UTF-8 text ({e.reason} at byte {e.start})"
    except json.JSONDecodeError as e:
        return f"{where}: malformed JSON ({e.msg} at column {e.colno})"
    except RecursionError:
        return f"{where}: JSON nested too deeply"
    if not isinstance(row, dict):
        return f"{where}: expected a JSON object, got {type(row).__name__}"
    missing = [k for k in ("file", "text") if k not in row]
    if missing:
        return f"{where}: missing key(s) {', '.join(missing)}"
    file, text = row["file"], row["text"]
    if not isinstance(file, str) or not file:
        return f'{where}: "file" must be a non-empty string'
    where = f"{METADATA} line {lineno} ({file})"
    if not isinstance(text, str):
        return f'{where}: "text" must be a string'
    if not text.strip():
        return f"{where}: empty caption"
    if _escapes(file):
        return f"{where}: path escapes the dataset root (absolute paths and '..' are not allowed)"
    path = root / file
    if not path.exists():
        return f"{where}: file not found"
    return lineno, file, text, path.absolute()


def _frame_counts(
    root: Path,
    entries: list[_Entry],
    num_frames: int | None,
    limits: DatasetLimits,
    workers: int | None,
) -> list[tuple[int, tuple[int, int]] | str]:
    """Each entry's clip decoded in full: its frame count and frame size `(W, H)`, or a problem.
    Raises `DatasetError` when the clips hold more than `limits.max_frames` frames in all."""
    budget = _FrameBudget(limits.max_frames)

    def check(entry: _Entry) -> tuple[int, tuple[int, int]] | str | None:
        """The clip's frame count and size, or a problem, or None when the frame budget ran
        out."""
        lineno, file, _, path = entry
        where = f"{METADATA} line {lineno} ({file})"
        n, first = 0, None
        try:
            for size in decode_frames(path, max_pixels=limits.max_pixels):
                if not budget.take():
                    return None
                first = size if first is None else first
                if size != first:
                    return (
                        f"{where}: frames of different sizes ({first[0]}x{first[1]} and "
                        f"{size[0]}x{size[1]})"
                    )
                n += 1
        except ValueError as e:
            # The decoders name the path they opened; the uploader knows the file as written.
            return f"{where}: cannot decode video: {str(e).replace(str(path), file)}"
        if n == 0:
            return f"{where}: video has no frames"
        if num_frames is not None and n < num_frames:
            return too_short(where, n, num_frames)
        return n, first

    # FFmpeg decodes without the GIL, so threads give real parallelism here.
    n_workers = workers or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(n_workers, thread_name_prefix="validate") as pool:
        counts = list(pool.map(check, entries))
    if any(res is None for res in counts):
        raise DatasetError(
            root,
            [f"the clips hold more than {limits.max_frames} frames in all; no more are accepted"],
        )
    return counts


def too_short(where: str, frames: int, needed: int) -> str:
    """The problem of a clip of `frames` frames where training needs `needed`."""
    return f"{where}: video has {frames} frames, training needs {needed}"


def sample_name(root: Path, sample: Sample) -> str:
    """How a problem names a sample: its line of metadata.jsonl and its file as the dataset
    spells it."""
    return f"{METADATA} line {sample.line} ({sample.path.relative_to(Path(root).absolute())})"


def _metadata_lines(meta: Path, max_bytes: int | None) -> Iterator[tuple[int, bytes | None]]:
    """(line number from 1, the line without its end), or None in place of a line longer than
    `max_bytes`, whose rest is skipped without being held in memory."""
    chunk = max_bytes + 2 if max_bytes is not None else -1  # room for "\r\n"
    with open(meta, "rb") as f:
        lineno = 0
        while line := f.readline(chunk):
            lineno += 1
            complete = line.endswith(b"\n") or len(line) != chunk  # the last line may lack "\n"
            text = line.rstrip(b"\r\n")
            if complete and (max_bytes is None or len(text) <= max_bytes):
                yield lineno, text
                continue
            while not complete:
                line = f.readline(COPY_CHUNK)
                complete = not line or line.endswith(b"\n")
            yield lineno, None


class _FrameBudget:
    """Frames all the decoding threads may still decode together; None is no bound."""

    def __init__(self, frames: int | None):
        self.left = frames
        self.lock = threading.Lock()

    def take(self) -> bool:
        """Count one decoded frame; False once the budget is spent."""
        if self.left is None:
            return True
        with self.lock:
            self.left -= 1
            return self.left >= 0


def _escapes(file: str) -> bool:
    """True for absolute paths and paths with '..' components (POSIX or Windows spelling)."""
    for pure in (PurePosixPath(file), PureWindowsPath(file)):
        if pure.is_absolute() or pure.anchor or ".." in pure.parts:
            return True
    return False


class VideoDataset:
    """Validated clips as ``(video float32 (3, F, H, W) in [-1, 1], caption)``."""

    def __init__(
        self,
        root: str | os.PathLike,
        num_frames: int,
        size: tuple[int, int],
        *,
        sampling: str = "uniform",
        samples: list[Sample] | None = None,
        cache_bytes: int = 0,
        shapes: list[tuple[int, int, int]] | None = None,
    ):
        """size is (W, H). Validates the whole dataset now (DatasetError) unless `samples` given.

        `shapes`, one `(frames, height, width)` per sample (a clip's bucket, buckets.py), takes
        the place of `num_frames` and `size`: each clip is read at its own shape.
        Decoded clips are kept in memory, first come first kept, up to `cache_bytes` (as uint8): a
        small dataset is decoded once instead of once per epoch."""
        self.root = Path(root)
        self.num_frames = num_frames
        self.size = size
        self.sampling = sampling
        if samples is None:
            samples = validate_dataset(root, num_frames=num_frames)
        if shapes is not None and len(shapes) != len(samples):
            raise ValueError(f"{len(shapes)} shapes for {len(samples)} samples")
        self.samples = samples
        self.shapes = shapes
        self.cache_bytes = cache_bytes
        self._cache: dict[int, np.ndarray] = {}
        self._cached_bytes = 0

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:
        s = self.samples[i]
        u8 = self._cache.get(i)
        if u8 is None:
            frames, size = self.num_frames, self.size
            if self.shapes is not None:
                frames, height, width = self.shapes[i]
                size = (width, height)
            try:
                u8 = read_video(
                    s.path,
                    num_frames=frames,
                    size=size,
                    sampling=self.sampling,
                    frame_count=s.num_frames,
                )  # (F, H, W, 3)
            except ValueError as e:  # changed on disk since validation
                raise DatasetError(self.root, [f"{METADATA} line {s.line} ({s.path}): {e}"]) from e
            if self._cached_bytes + u8.nbytes <= self.cache_bytes:
                self._cache[i] = u8
                self._cached_bytes += u8.nbytes
        return frames_to_float(u8), s.text  # (3, F, H, W)


HELD_OUT_STREAM = 0x4E1D  # keys the held-out draw apart from every epoch's permutation


def held_out_split(
    samples: list[Sample], seed: int, count: int
) -> tuple[list[Sample], list[Sample]]:
    """(training clips, held-out clips): `count` clips drawn by `seed` alone, so a resumed run
    holds out the same ones; both in dataset order. ValueError when no clip would be left to
    train on."""
    if count <= 0:
        return samples, []
    if count >= len(samples):
        raise ValueError(
            f"validation.split holds out {count} of the dataset's {len(samples)} clips: "
            "none would be left to train on"
        )
    held = set(np.random.default_rng([seed, HELD_OUT_STREAM]).permutation(len(samples))[:count])
    train = [s for i, s in enumerate(samples) if i not in held]
    return train, [s for i, s in enumerate(samples) if i in held]


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The sample order of one epoch: a permutation of range(n) fixed by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


@dataclass(frozen=True)
class Batch:
    """`batch_size` consecutive samples of the stream."""

    video: torch.Tensor  # (B, 3, F, H, W) float32 in [-1, 1]
    text: list[str]
    indices: list[int]  # dataset indices of the samples
    epoch: int  # epoch of the first sample


class _Failure:
    """An exception raised on the producer thread, carried to the consumer."""

    def __init__(self, exc: BaseException):
        self.exc = exc


class BackgroundLoader:
    """Decodes batches on a background thread, `prefetch` batches ahead of the consumer.

    Iterating never ends (training stops by step count); see the module docstring for the order.
    With `plan` (buckets.py) every batch is one bucket's, `plan.batch_size` clips. An exception on
    the loader thread is raised from the consumer's next `next()`. `close()` (or leaving the
    `with` block) stops and joins the thread.
    """

    def __init__(
        self,
        dataset: VideoDataset,
        *,
        batch_size: int = 1,
        seed: int = 0,
        prefetch: int = 2,
        plan: BatchPlan | None = None,
    ):
        if plan is not None:
            batch_size = plan.batch_size
        if batch_size < 1 or prefetch < 1:
            raise ValueError(f"batch_size and prefetch must be >= 1, got {batch_size}, {prefetch}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.prefetch = prefetch
        self.plan = plan
        self._epoch, self._index = 0, 0  # position of the next batch the consumer receives
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._failed: BaseException | None = None

    # -- position

    @property
    def samples_per_epoch(self) -> int:
        """Clips served in one epoch: every sample once; with a plan, its batches' clips (a
        bucket's last batch is topped up with clips of that bucket again)."""
        if self.plan is None:
            return len(self.dataset)
        return self.plan.batches_per_epoch * self.batch_size

    def state_dict(self) -> dict:
        """{"seed", "epoch", "index"}: where the next batch handed to the consumer starts; with
        a plan, also "plan": its fingerprint (a position counts batches of that plan)."""
        state = {"seed": self.seed, "epoch": self._epoch, "index": self._index}
        if self.plan is not None:
            state["plan"] = self.plan.fingerprint
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position (drops anything prefetched)."""
        saved, mine = state.get("plan"), None if self.plan is None else self.plan.fingerprint
        if saved != mine:

            def kind(plan: str | None) -> str:
                return "one clip size" if plan is None else f"bucket plan {plan}"

            raise ValueError(
                f"the saved data position counts the batches of {kind(saved)}, this run has "
                f"{kind(mine)}: resume with the dataset and clip options the run started with"
            )
        n = len(self.dataset) if self.plan is None else self.plan.batches_per_epoch
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < n:
            unit = "samples" if self.plan is None else "batches an epoch"
            raise ValueError(f"bad loader position epoch={epoch} index={index} for {n} {unit}")
        self._shutdown()
        self.seed, self._epoch, self._index = int(state["seed"]), epoch, index
        self._failed = None

    # -- iteration

    def __iter__(self) -> BackgroundLoader:
        return self

    def __next__(self) -> Batch:
        if self._failed is not None:
            raise self._failed
        if self._thread is None:
            self._start()
        item = self._queue.get()  # blocks until the loader thread has decoded the next batch
        if isinstance(item, _Failure):
            self._failed = item.exc
            self._shutdown()
            raise item.exc
        batch, (self._epoch, self._index) = item
        return batch

    def close(self) -> None:
        self._shutdown()

    def __enter__(self) -> BackgroundLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- thread

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(
            target=self._produce,
            args=(self._epoch, self._index, self._stop, self._queue),
            name="video-loader",
            daemon=True,
        )
        self._thread.start()

    def _produce(self, epoch: int, index: int, stop: threading.Event, q: queue.Queue) -> None:
        order = self._orders()
        try:
            while not stop.is_set():
                first_epoch = epoch
                idx, (epoch, index) = order(epoch, index)
                videos, texts = [], []
                for i in idx:
                    video, text = self.dataset[i]  # (3, F, H, W)
                    videos.append(video)
                    texts.append(text)
                batch = Batch(torch.stack(videos), texts, idx, first_epoch)  # (B, 3, F, H, W)
                if not self._put(q, (batch, (epoch, index)), stop):
                    return
        except BaseException as e:  # carried to the consumer, which re-raises it
            self._put(q, _Failure(e), stop)

    def _orders(self):
        """`next(epoch, index) -> (dataset indices, next position)`: the batch at a position
        and the position after it (module docstring); each epoch's order is drawn once."""
        n, drawn = len(self.dataset), {}

        def epoch_order(epoch: int):
            if epoch not in drawn:
                drawn.clear()  # one epoch at a time: the stream only moves forward
                if self.plan is None:
                    drawn[epoch] = epoch_permutation(n, self.seed, epoch)
                else:
                    drawn[epoch] = self.plan.epoch_batches(self.seed, epoch)
            return drawn[epoch]

        def next_samples(epoch: int, index: int):
            idx = []
            for _ in range(self.batch_size):
                idx.append(int(epoch_order(epoch)[index]))
                index += 1
                if index == n:
                    epoch, index = epoch + 1, 0
            return idx, (epoch, index)

        def next_batch(epoch: int, index: int):
            batches = epoch_order(epoch)
            idx = list(batches[index])
            index += 1
            if index == len(batches):
                epoch, index = epoch + 1, 0
            return idx, (epoch, index)

        return next_samples if self.plan is None else next_batch

    @staticmethod
    def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
        """Put unless asked to stop; the timeout lets a full queue notice the stop request."""
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _shutdown(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread, self._queue = None, None
