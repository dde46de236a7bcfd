"""The server worker's decode and MP4 encode of clips that finish together: what it did before
encoding overlapped decoding, against what it does now.

    python benchmarks/server_encode.py --json
    python benchmarks/server_encode.py --clips 2 --frames 33 --size 192x320 --json

The model is the tests' tiny random Wan pipeline (tests/support/wan_fixtures.py), sampled for one
step: only the decode and the encode are timed, and their cost is the tiny VAE's and x264's at
the clip's size. Contenders, on the same finished states, one after the other, a warm-up run
each and then `--repeats` timed runs each, interleaved (medians reported):

- `whole_then_encode` (before): the model's `finish_batch` decodes the clips on the worker's loop,
  then the encoder thread writes each whole clip (`TorchBackend.save_video`), one after another;
- `chunked_overlapped` (now): `finish_batch_chunks` hands each latent frame's pixels to its
  clip's `Mp4ClipWriter` (server/torch_backend.py), which encodes on a thread of its own while
  the next decodes; then each is published (`close`).

Reported per contender: `loop_seconds`, how long the worker's loop is busy before it can take
the next denoising step (the decode, and now the hand-over of chunks); `published_seconds`, from
the start of the decode until every MP4 is in place; and the SHA-256 of every clip's frames as
handed to the encoder, which must agree (`bitwise`). Caution: on a loaded machine of few cores
the encoder threads and the decoder share the cores: the overlap can only win what spare cores
allow, and the seconds move with the load.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the tests' tiny Wan builder


def digest(frames: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for f in frames:
        h.update(np.ascontiguousarray(f).tobytes())
    return h.hexdigest()


def whole_then_encode(pipe, states, out: Path, fps: int) -> tuple[float, float, list]:
    from megaslide.server.torch_backend import TorchBackend

    start = time.perf_counter()
    clips = pipe.finish_batch(states)
    loop = time.perf_counter() - start
    for k, frames in enumerate(clips):  # the encoder thread, one clip after the other
        TorchBackend.save_video(None, frames, fps, out / f"w{k}.mp4", out / f"w{k}.png")
    return loop, time.perf_counter() - start, clips


def chunked_overlapped(pipe, states, out: Path, fps: int) -> tuple[float, float, list]:
    from megaslide.server.torch_backend import Mp4ClipWriter

    start = time.perf_counter()
    writers = [Mp4ClipWriter(fps, out / f"c{k}.mp4", out / f"c{k}.png") for k in range(len(states))]
    kept: list[list[np.ndarray]] = [[] for _ in states]
    for i, chunk in pipe.finish_batch_chunks(states):
        kept[i].append(chunk)
        writers[i].add(chunk)
    loop = time.perf_counter() - start
    for writer in writers:
        writer.close()
    return loop, time.perf_counter() - start, [np.concatenate(c) for c in kept]


CONTENDERS = {"whole_then_encode": whole_then_encode, "chunked_overlapped": chunked_overlapped}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clips", type=int, default=2, help="clips finishing together")
    ap.add_argument("--frames", type=int, default=33, help="pixel frames: 1 + 4k")
    ap.add_argument("--size", default="192x320", help="WIDTHxHEIGHT (at most 256 a side)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs each (median reported)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from megaslide.engine.loader import open_pipeline
    from megaslide.engine.request import VideoRequest

    from wan_fixtures import build_tiny_wan

    width, height = (int(v) for v in args.size.split("x"))
    tmp = Path(tempfile.mkdtemp(prefix="server_encode_"))
    pipe = open_pipeline(build_tiny_wan(tmp / "wan"))
    requests = [
        VideoRequest(
            prompt=f"clip {k}", frames=args.frames, height=height, width=width, steps=1, seed=k
        )
        for k in range(args.clips)
    ]
    states = pipe.prepare_batch([pipe.resolve(r) for r in requests])
    while not all(s.done for s in states):
        pipe.denoise_step(states)
    fps = requests[0].fps or 16
    runs: dict[str, list] = {name: [] for name in CONTENDERS}
    made: dict[str, list] = {}  # each contender's clips, as handed to the encoder
    for attempt in range(1 + args.repeats):  # the first warms the decoder and the encoder up
        for name, run in CONTENDERS.items():  # interleaved: the machine's load drifts
            out = tmp / f"{name}-{attempt}"
            out.mkdir()
            loop, published, made[name] = run(pipe, states, out, fps)
            if attempt:
                runs[name].append((loop, published))
    results = {
        name: {
            "loop_seconds": round(float(np.median([r[0] for r in timed])), 3),
            "published_seconds": round(float(np.median([r[1] for r in timed])), 3),
            "frames_sha256": digest(made[name]),
        }
        for name, timed in runs.items()
    }
    digests = {r["frames_sha256"] for r in results.values()}
    report = {
        "clips": args.clips,
        "frames": args.frames,
        "size": args.size,
        "threads": args.threads,
        "repeats": args.repeats,
        "bitwise": len(digests) == 1,
        "contenders": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name, r in results.items():
            print(
                f"{name:20s} loop {r['loop_seconds']:7.3f} s  published {r['published_seconds']:7.3f} s"
            )
        print("bitwise" if report["bitwise"] else "FRAMES DIFFER")
    return 0 if report["bitwise"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
