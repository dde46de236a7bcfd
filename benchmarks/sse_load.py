"""Many open event streams against a generating server: the engine's pace and status polls
with N Server-Sent Events streams open on a real `megaslide serve` over loopback.

    python benchmarks/sse_load.py --json [--streams 0 100 1000] [--duration 5] [--pollers 20]

For each stream count: N connections follow `GET /v1/videos/{id}/events` of a long video while
it denoises, and `--pollers` clients poll its status back to back; reported are the engine's
denoising steps per second meanwhile (from the store's record of the video's step), the status
polls' throughput and latency, and the events the streams received. The clients share this
machine's cores with the server. The streams need descriptors: the process raises its own soft
limit as far as the hard one allows, and the server's connection cap and per-key stream limit
are raised past the largest count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

from api_load import LONG_CLIP, _paced, _submit, _wait_for_first_step, _window

from processes import Server


async def _follow(port: int, path: str, until: float, received: list[int]) -> None:
    """One SSE stream of `path`, read until `until`; adds the events it saw to `received`."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        received.append(-1)
        return
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    events = 0
    try:
        while (left := until - time.perf_counter()) > 0:
            chunk = await asyncio.wait_for(reader.read(65536), left)
            if not chunk:
                break
            events += chunk.count(b"\nevent: ")
    except (TimeoutError, OSError):
        pass
    finally:
        writer.close()
    received.append(events)


async def _streams_and_polls(port, video_id, streams, pollers, duration) -> dict:
    until = time.perf_counter() + duration + 1.0  # streams open before the polls' warm-up
    received: list[int] = []
    followers = [
        asyncio.create_task(_follow(port, f"/v1/videos/{video_id}/events", until, received))
        for _ in range(streams)
    ]
    await asyncio.sleep(0.5)
    polls = await _window(port, f"/v1/videos/{video_id}", pollers, duration)
    await asyncio.gather(*followers)
    failed = sum(1 for n in received if n < 0)
    return {**polls, "streams": streams, "streams_failed": failed, "events": sum(received)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[0, 100, 1000])
    ap.add_argument("--pollers", type=int, default=20)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4096)), hard))

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "sse"
        data_dir.mkdir()
        # Room for every stream: the connection cap (streams get half of it), the per-key
        # stream limit (no keys here: every client is the same principal) and the per-address
        # caps (every client is 127.0.0.1) raised past the largest count measured.
        room = str(2 * max(args.streams) + args.pollers + 100)
        env = {
            f"MEGASLIDE_{name}": room
            for name in (
                "MAX_CONNECTIONS",
                "MAX_STREAMS_PER_KEY",
                "MAX_CONNECTIONS_PER_CLIENT",
                "MAX_PENDING_PER_CLIENT",
            )
        }
        server = Server(
            ["--data-dir", str(data_dir), "--device", "cpu"], Path(tmp) / "serve.log", env
        )
        try:
            video_id = _submit(server, LONG_CLIP)
            server.wait(video_id, statuses=("in_progress",))
            _wait_for_first_step(data_dir, video_id)
            for n in args.streams:
                window, pace = _paced(
                    data_dir,
                    video_id,
                    lambda n=n: asyncio.run(
                        _streams_and_polls(server.port, video_id, n, args.pollers, args.duration)
                    ),
                )
                rows.append({**window, "engine_steps_per_s": pace})
            server.http.post(f"/v1/videos/{video_id}/cancel")
        finally:
            server.stop()
    report = {
        "benchmark": "sse_load",
        "machine": f"{platform.node()}: {multiprocessing.cpu_count()} CPUs, {platform.system()}",
        "duration_s": args.duration,
        "pollers": args.pollers,
        "long_clip": LONG_CLIP,
        "results": rows,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in rows:
            print(
                f"{r['streams']:5} streams: engine {r['engine_steps_per_s']:.2f} steps/s, "
                f"polls {r['req_per_s']:.0f}/s p99 {r['p99_ms']:.1f} ms, "
                f"{r['events']} events, {r['streams_failed']} streams refused"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
