"""Status polls under load: `GET /v1/videos/{id}` throughput and latency at N concurrent clients,
with the engine idle and while it generates, on a real `megaslide serve` over loopback.

    python benchmarks/api_load.py --json [--clients 20 200] [--duration 5] [--modes ...]
                                         [--client bare|httpx]

Modes (each a fresh server on the packaged default model, CPU):

- embedded: `megaslide serve`, the worker a thread of the API's process (the default).
- embedded-1-thread: the same with the engine's tensor maths on one thread
  (`MEGASLIDE_ENGINE_THREADS=1`), leaving a core to the API.
- worker-process: `megaslide serve --worker-process`, the worker a child process of the API's.
- split: `megaslide serve --no-worker` and a `megaslide worker` process on the same store.

For each mode: clients poll a finished video for `--duration` seconds with the engine idle, then
poll the video being rendered while the engine denoises long videos (`busy` says whether it was
still denoising when the window closed, `engine_steps_per_s` how fast it denoised meanwhile, and
the `clients: 0` row how fast it denoises with no one polling). Each client is one connection
polling back to back; latency is the time of one request, throughput the requests answered per
second.

Two views of latency, each from its own process (neither shares the server's, nor this one's):
the load's clients time their own requests (`p50_ms`, `p99_ms`: a closed loop, so they include
the time the clients' process takes to get back to each answer), and a probe on one more
connection, asking every `PROBE_GAP_S` and doing nothing else, times what any other client
gets from the server meanwhile (`probe_p50_ms`, `probe_p99_ms`). `--client httpx` makes the load
20 threads of `httpx.Client` in one process, as a quick script would: its own figures then
measure mostly itself.

Goals (issue: API load): p99 <= 50 ms at 20 clients while generating, as the probe sees it;
throughput while generating >= 0.5x idle at the same client count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import sqlite3
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # processes.py

import numpy as np  # noqa: E402

from processes import Child, Server  # noqa: E402

MODEL = "megaslide-tiny"  # the packaged default model
MODES = ("embedded", "embedded-1-thread", "worker-process", "split")
QUICK_CLIP = {"prompt": "a red circle", "size": "32x32", "num_inference_steps": 2}
# Long enough to keep two cores busy through every window of a run (cancelled at the end).
LONG_CLIP = {
    "prompt": "a blue square moving right",
    "num_frames": 16,
    "size": "64x64",
    "num_inference_steps": 200,
}
WARMUP_S = 0.5
PROBE_GAP_S = 0.01  # the probe's pause between requests: light, and ~100 samples a second


async def _poll(port: int, path: str, until: float, latencies: list, codes: Counter) -> None:
    """One keep-alive connection asking for `path` back to back until `until`.

    A bare HTTP/1.1 exchange on asyncio streams rather than an HTTP client library: at 200
    connections a full client's own bookkeeping costs more CPU than the server's answer (httpx's
    pool cut a healthz loop from ~2,600 to ~650 req/s on two cores), and the clients share the
    server's cores here.
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    try:
        while time.perf_counter() < until:
            start = time.perf_counter()
            writer.write(request)
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            fields = dict(line.lower().split(": ", 1) for line in head[1:] if ": " in line)
            await reader.readexactly(int(fields["content-length"]))
            latencies.append(time.perf_counter() - start)
            codes[int(head[0].split()[1])] += 1
    except (OSError, asyncio.IncompleteReadError) as e:
        codes[type(e).__name__] += 1
    finally:
        writer.close()


async def _window(port: int, path: str, clients: int, duration: float) -> dict:
    """`clients` connections polling `path` for `duration` s, after WARMUP_S s not counted."""
    await asyncio.gather(
        *(_poll(port, path, time.perf_counter() + WARMUP_S, [], Counter()) for _ in range(clients))
    )
    latencies: list[float] = []
    codes: Counter = Counter()
    start = time.perf_counter()
    until = start + duration
    await asyncio.gather(*(_poll(port, path, until, latencies, codes) for _ in range(clients)))
    return _figures(clients, latencies, codes, time.perf_counter() - start)


def _figures(clients: int, latencies: list[float], codes: Counter, elapsed: float) -> dict:
    ms = np.array(latencies) * 1e3
    return {
        "clients": clients,
        "requests": len(latencies),
        "req_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
        "max_ms": round(float(ms.max()), 2),
        "errors": {str(k): v for k, v in codes.items() if k != 200},
    }


def _httpx_window(port: int, path: str, clients: int, duration: float) -> dict:
    """`_window`'s figures for `clients` threads each polling through its own `httpx.Client`."""
    import httpx

    latencies: list[float] = []
    codes: Counter = Counter()

    def poll(until: float, out: list, counts: Counter) -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            while time.perf_counter() < until:
                start = time.perf_counter()
                try:
                    status = client.get(path).status_code
                except httpx.TransportError as e:
                    counts[type(e).__name__] += 1
                    return
                out.append(time.perf_counter() - start)
                counts[status] += 1

    def run(until: float, out: list, counts: Counter) -> None:
        threads = [threading.Thread(target=poll, args=(until, out, counts)) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    run(time.perf_counter() + WARMUP_S, [], Counter())
    start = time.perf_counter()
    run(start + duration, latencies, codes)
    return _figures(clients, latencies, codes, time.perf_counter() - start)


def _load_process(port, path, clients, duration, client, measuring, results) -> None:
    """The load, in a process of its own: `_window` (or httpx's), `measuring` set after warm-up."""
    timer = threading.Timer(WARMUP_S, measuring.set)  # the load's warm-up ends
    timer.start()
    if client == "httpx":
        results.put(("load", _httpx_window(port, path, clients, duration)))
    else:
        results.put(("load", asyncio.run(_window(port, path, clients, duration))))
    timer.cancel()


def _probe_process(port, path, duration, measuring, results) -> None:
    """One more connection asking for `path` every PROBE_GAP_S while the load is measured: the
    latency another client gets, free of the load generator's own queueing."""
    import socket

    measuring.wait(60)
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    latencies: list[float] = []
    with socket.create_connection(("127.0.0.1", port)) as conn, conn.makefile("rb") as answers:
        until = time.perf_counter() + duration
        while time.perf_counter() < until:
            start = time.perf_counter()
            conn.sendall(request)
            length = 0
            while (line := answers.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            answers.read(length)
            latencies.append(time.perf_counter() - start)
            time.sleep(PROBE_GAP_S)
    ms = np.array(latencies) * 1e3
    results.put(
        (
            "probe",
            {
                "probe_requests": len(latencies),
                "probe_p50_ms": round(float(np.percentile(ms, 50)), 2),
                "probe_p99_ms": round(float(np.percentile(ms, 99)), 2),
            },
        )
    )


def measure(port: int, path: str, clients: int, duration: float, client: str = "bare") -> dict:
    """The load's figures and the probe's, each measured from a process of its own."""
    spawn = multiprocessing.get_context("spawn")
    measuring, results = spawn.Event(), spawn.Queue()
    procs = [
        spawn.Process(
            target=_load_process,
            args=(port, path, clients, duration, client, measuring, results),
        ),
        spawn.Process(target=_probe_process, args=(port, path, duration, measuring, results)),
    ]
    for proc in procs:
        proc.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(30)
    return {**got["load"], **got["probe"]}


def _start(mode: str, data_dir: Path, logs: Path) -> tuple[Server, list[Child]]:
    store = ["--data-dir", str(data_dir)]
    # Every client here is 127.0.0.1, one address: its caps are raised past the most clients.
    env = {f"MEGASLIDE_MAX_{cap}_PER_CLIENT": "1000" for cap in ("CONNECTIONS", "PENDING")}
    if mode == "embedded-1-thread":
        env["MEGASLIDE_ENGINE_THREADS"] = "1"
    if mode != "split":
        child = ["--worker-process"] if mode == "worker-process" else []
        return Server([*store, "--device", "cpu", *child], logs / f"{mode}-serve.log", env), []
    server = Server([*store, "--no-worker"], logs / f"{mode}-serve.log", env, ready_path="/healthz")
    worker = Child(["worker", *store, "--device", "cpu"], logs / f"{mode}-worker.log")
    server.wait_ready("/readyz")
    return server, [worker]


def _submit(server: Server, clip: dict) -> str:
    answer = server.http.post("/v1/videos", json={"model": MODEL, **clip})
    if answer.status_code != 200:
        raise RuntimeError(f"POST /v1/videos: {answer.status_code} {answer.text}")
    return answer.json()["id"]


def _step(data_dir: Path, video_id: str) -> int:
    """The video's step as the job store records it (written at every step, in every mode)."""
    with sqlite3.connect(f"file:{data_dir / 'megaslide.db'}?mode=ro", uri=True) as db:
        return db.execute("SELECT step FROM videos WHERE id = ?", (video_id,)).fetchone()[0]


def _wait_for_first_step(data_dir: Path, video_id: str, timeout_s: float = 120) -> None:
    """Until the video has taken a step: `in_progress` comes before its prompts are encoded and
    its first step, which on a slow or busy machine can outlast a whole one-second window."""
    deadline = time.monotonic() + timeout_s
    while _step(data_dir, video_id) < 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{video_id} took no step in {timeout_s} s")
        time.sleep(0.05)


def _sleep_past_a_step(
    data_dir: Path, video_id: str, step: int, duration: float, timeout_s: float = 120
) -> None:
    """Sleep `duration` seconds, and on until the video has gone past `step`."""
    time.sleep(duration)
    deadline = time.monotonic() + timeout_s
    while _step(data_dir, video_id) <= step and time.monotonic() < deadline:
        time.sleep(0.05)


def _paced(data_dir: Path, video_id: str, work) -> tuple[object, float]:
    """What `work()` returns, and the engine's denoising steps per second while it ran."""

    def step() -> int:
        return _step(data_dir, video_id)

    before, start = step(), time.perf_counter()
    result = work()
    return result, round((step() - before) / (time.perf_counter() - start), 2)


def one_mode(
    mode: str, clients: list[int], duration: float, tmp: Path, client: str = "bare"
) -> list[dict]:
    data_dir = tmp / mode
    data_dir.mkdir()
    server, children = _start(mode, data_dir, tmp)
    rows = []
    try:
        finished = _submit(server, QUICK_CLIP)
        assert server.wait(finished)["status"] == "completed", server.output()
        path = f"/v1/videos/{finished}"
        for n in clients:
            window = measure(server.port, path, n, duration, client)
            rows.append({"mode": mode, "engine": "idle", **window})
        long = [_submit(server, LONG_CLIP) for _ in range(2)]
        server.wait(long[0], statuses=("in_progress",))
        _wait_for_first_step(data_dir, long[0])
        # No one polling: at least `duration`, and at least one whole step (on a slow or busy
        # machine one step of the long clip can outlast a short window).
        first = _step(data_dir, long[0])
        _, alone = _paced(
            data_dir, long[0], lambda: _sleep_past_a_step(data_dir, long[0], first, duration)
        )
        rows.append(
            {"mode": mode, "engine": "generating", "clients": 0, "engine_steps_per_s": alone}
        )
        rendering = f"/v1/videos/{long[0]}"  # the video being denoised, as its owner polls it
        for n in clients:
            window, pace = _paced(
                data_dir,
                long[0],
                lambda n=n: measure(server.port, rendering, n, duration, client),
            )
            busy = server.video(long[0])["status"] == "in_progress"
            rows.append(
                {
                    "mode": mode,
                    "engine": "generating",
                    "busy": busy,
                    "engine_steps_per_s": pace,
                    **window,
                }
            )
        for video_id in long:
            server.http.post(f"/v1/videos/{video_id}/cancel")
    finally:
        for child in children:
            child.stop()
        server.stop()
    return rows


def goals(rows: list[dict]) -> dict:
    """Per mode: p99 at the smallest client count while generating, and the throughput ratio."""
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        by = {(r["engine"], r["clients"]): r for r in rows if r["mode"] == mode and r["clients"]}
        fewest = min(c for _, c in by)
        ratios = {
            str(c): round(by["generating", c]["req_per_s"] / by["idle", c]["req_per_s"], 2)
            for e, c in by
            if e == "idle" and ("generating", c) in by
        }
        p99 = by["generating", fewest]["probe_p99_ms"]
        out[mode] = {
            f"probe_p99_ms_generating_at_{fewest}": p99,
            f"load_p99_ms_generating_at_{fewest}": by["generating", fewest]["p99_ms"],
            "p99_goal_met": p99 <= 50,
            "generating_over_idle_throughput": ratios,
            "throughput_goal_met": all(r >= 0.5 for r in ratios.values()),
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[20, 200])
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per measured window")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument(
        "--client", choices=("bare", "httpx"), default="bare", help="what the load polls with"
    )
    ap.add_argument("--quick", action="store_true", help="4 clients, 1 s windows, embedded only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.clients, args.duration, args.modes = [4], 1.0, ["embedded"]

    load_at_start = os.getloadavg()  # other work on the machine moves these figures
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            rows += one_mode(mode, args.clients, args.duration, Path(tmp), args.client)
    report = {
        "benchmark": "api_load",
        "machine": f"{platform.node()}: {multiprocessing.cpu_count()} CPUs, {platform.system()}",
        "duration_s": args.duration,
        "client": args.client,
        "load_average_at_start": [round(x, 2) for x in load_at_start],
        "long_clip": LONG_CLIP,
        "results": rows,
        "goals": goals(rows),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in rows:
            if not r["clients"]:
                print(f"{r['mode']:18} engine alone: {r['engine_steps_per_s']:.2f} steps/s")
                continue
            print(
                f"{r['mode']:18} {r['engine']:10} {r['clients']:4} clients: {r['req_per_s']:7.1f} req/s "
                f"p50 {r['p50_ms']:7.2f} ms p99 {r['p99_ms']:8.2f} ms, probe p99 "
                f"{r['probe_p99_ms']:7.2f} ms, errors {r['errors']}"
            )
        print(json.dumps(report["goals"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
