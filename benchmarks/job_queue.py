"""The job store under load: no-op video jobs through 1 and 2 worker processes, on SQLite and on
PostgreSQL.

    python benchmarks/job_queue.py --json [--jobs 1000] [--postgres URL]

Each run fills a fresh database with `--jobs` queued videos (one denoising step each), then starts
the worker processes: the real `Worker` (claims, leases, progress, outcomes, heartbeats) on a
backend whose model does nothing and writes no file, so what is measured is the store and the
scheduler, not torch. A watcher process polls the events table the way an API host's SSE streams
do (every `--watch-interval` seconds) to time events across processes.

- jobs_per_s: jobs completed per second, from the moment every worker has registered (process
  start-up excluded) to the last completion.
- claim_latency_ms: wall time of one claim transaction (`Videos.claim`, up to a batch).
- event_latency_ms: from a worker's commit of a video's completion to the watcher seeing the
  `video.completed` event (bounded below by the watcher's polling interval).

PostgreSQL: `--postgres URL` (a scratch database: each run DROPS the job store's tables there
first), or a throwaway server started here from the system's PostgreSQL binaries
(tests/support/postgres.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1] / "tests" / "support")
)  # the fakes, postgres.py

import numpy as np  # noqa: E402

from megaslide.server.settings import Settings  # noqa: E402
from megaslide.server.store import JobStore  # noqa: E402

from server_fakes import FAKE_CARD, FakeBackend  # noqa: E402

SPEC = {
    "model": FAKE_CARD.name,
    "prompt": "p",
    "negative_prompt": "",
    "frames": 1,
    "width": 4,
    "height": 4,
    "fps": 8,
    "steps": 1,
    "guidance": 1.0,
    "seed": 0,
    "image": None,
}


class NoOpBackend(FakeBackend):
    """The fake model with nothing to write: a job is all scheduling."""

    def __init__(self):
        super().__init__(step_s=0.0, train_step_s=0.0)

    def save_video(self, frames, fps, mp4_path, thumbnail_path):
        pass


def run_worker(url: str, storage: str, name: str, batch: int, ready, go, stop, results) -> None:
    """A worker process: registers, says it is `ready`, runs jobs from `go` until `stop`;
    reports claim times and completion commit times."""
    from megaslide.server.worker import Worker

    settings = Settings(database=url, storage=storage, max_batch=batch, worker_name=name)
    store = JobStore(url)
    claims, completed = [], {}
    claim, finish = store.videos.claim, store.videos.finish

    def timed_claim(*args, **kwargs):
        start = time.perf_counter()
        rows = claim(*args, **kwargs)
        if rows:  # an empty claim is the idle loop, not a claim
            claims.append(time.perf_counter() - start)
        return rows

    def timed_finish(video_id, *args, **kwargs):
        status = finish(video_id, *args, **kwargs)
        if status == "completed":
            completed[video_id] = time.time()
        return status

    store.videos.claim, store.videos.finish = timed_claim, timed_finish
    worker = Worker(settings, NoOpBackend(), store, name)
    worker.register()
    ready.release()
    go.wait()
    thread = threading.Thread(target=worker.run)
    thread.start()
    stop.wait()
    worker.stop.set()
    worker.wake.set()
    thread.join()
    worker.close()
    store.close()
    results.put({"claims": claims, "completed": completed})


def watch(url: str, interval: float, expected: int, results) -> None:
    """An API host's view: poll the events table; when was each video.completed first seen.

    Event numbers grow in commit order per job only (store/), so across jobs the watcher
    re-reads every completion rather than resuming after the highest number it saw."""
    import sqlalchemy as sa

    from megaslide.server.tables import events

    store = JobStore(url)
    seen: dict[str, float] = {}
    deadline = time.monotonic() + 600
    stmt = sa.select(events.c.job_id).where(events.c.type == "video.completed")
    while len(seen) < expected and time.monotonic() < deadline:
        rows = store.db.all(stmt)
        now = time.time()
        for row in rows:
            seen.setdefault(row["job_id"], now)
        time.sleep(interval)
    store.close()
    results.put(seen)


def percentiles(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"p50": None, "p99": None, "n": 0}
    a = np.asarray(values) * scale
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "n": len(a)}


def one_run(url: str, storage: str, jobs: int, workers: int, batch: int, interval: float) -> dict:
    store = JobStore(url)
    for i in range(jobs):
        store.videos.insert(f"video_{i:06d}", {**SPEC, "seed": i})
    ctx = multiprocessing.get_context("spawn")
    watch_results = ctx.Queue()
    watcher = ctx.Process(target=watch, args=(url, interval, jobs, watch_results))
    watcher.start()
    ready, go, stop, reported = ctx.Semaphore(0), ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(
            target=run_worker,
            args=(url, storage, f"bench-{i}", batch, ready, go, stop, reported),
        )
        for i in range(workers)
    ]
    for p in procs:
        p.start()
    for _ in procs:  # every worker registered: process start-up is not part of the run
        if not ready.acquire(timeout=120):
            raise RuntimeError("a worker did not start")
    start = time.perf_counter()
    go.set()
    deadline = time.monotonic() + 600
    while store.jobs.counts_by_state().get(("video", "completed"), 0) < jobs:
        if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
            raise RuntimeError(f"the workers did not finish: {store.jobs.counts_by_state()}")
        time.sleep(0.02)
    elapsed = time.perf_counter() - start
    stop.set()
    reports = [reported.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    seen = watch_results.get(timeout=120)
    watcher.join(timeout=60)
    completed = {k: v for r in reports for k, v in r["completed"].items()}
    lags = [seen[k] - t for k, t in completed.items() if k in seen]
    store.close()
    return {
        "workers": workers,
        "jobs": jobs,
        "completed_once": len(completed) == jobs,
        "seconds": elapsed,
        "jobs_per_s": jobs / elapsed,
        "claim_latency_ms": percentiles([c for r in reports for c in r["claims"]]),
        "event_latency_ms": percentiles(lags),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8, help="videos per worker pass (max_batch)")
    ap.add_argument("--watch-interval", type=float, default=Settings().sse_interval_s)
    ap.add_argument("--postgres", metavar="URL", help="default: a throwaway local server")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    results = []
    server = None
    if args.postgres is None:
        from postgres import PostgresServer

        server = PostgresServer()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for database in ("sqlite", "postgresql"):
                for n in args.workers:
                    if database == "sqlite":
                        url = f"sqlite:///{tmp}/queue-{n}.db"
                    elif args.postgres:
                        url = args.postgres
                        _empty(url)
                    else:
                        url = server.database()
                    run = one_run(url, tmp, args.jobs, n, args.batch, args.watch_interval)
                    results.append({"database": database, **run})
    finally:
        if server is not None:
            server.stop()
    report = {
        "benchmark": "queue",
        "machine": f"{platform.node()}: {multiprocessing.cpu_count()} CPUs, {platform.system()}",
        "batch": args.batch,
        "watch_interval_s": args.watch_interval,
        # The throwaway server trades durability for speed (tests/support/postgres.py: fsync off);
        # SQLite commits with synchronous=FULL as served.
        "postgres": args.postgres and "given" or "throwaway local server, fsync off",
        "runs": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in results:
            c, e = r["claim_latency_ms"], r["event_latency_ms"]
            print(
                f"{r['database']:10s} {r['workers']} worker(s): {r['jobs_per_s']:7.1f} jobs/s, "
                f"claim p50/p99 {c['p50']:.1f}/{c['p99']:.1f} ms, "
                f"event p50/p99 {e['p50']:.0f}/{e['p99']:.0f} ms"
            )
    return 0 if all(r["completed_once"] for r in results) else 1


def _empty(url: str) -> None:
    """Drop every table of a user-given database, so the next run starts from nothing."""
    from megaslide.server.tables import metadata

    store = JobStore(url)
    metadata.drop_all(store.db.engine)
    with store.db.engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE IF EXISTS alembic_version")
    store.close()


if __name__ == "__main__":
    sys.exit(main())
