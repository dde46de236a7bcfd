"""Counters, gauges and histograms rendered in the Prometheus text format (version 0.0.4).

Small on purpose: each worker updates its own `Registry` and publishes a snapshot of it with every
heartbeat; an API host's `/metrics` adds up the snapshots of the live workers and renders them
together with gauges read from the job store at scrape time (queue depth, jobs by state, live
workers), so those can never disagree with it.
"""

from __future__ import annotations

import bisect
import math
import threading

# Denoising-step latency spans milliseconds (tiny models) to minutes (a streamed 105B model).
STEP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(
        f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for k, v in sorted(labels.items())
    )
    return "{" + inner + "}"


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class Metric:
    kind = "untyped"

    def __init__(self, name: str, help_: str):
        self.name, self.help = name, help_
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(Metric):
    """A monotonically increasing total, optionally split by labels."""

    kind = "counter"

    def __init__(self, name, help_):
        super().__init__(name, help_)
        self._values: dict[tuple, float] = {}

    def inc(self, amount: float = 1.0, **labels) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels) -> float:
        return self._values.get(tuple(sorted(labels.items())), 0.0)

    def snapshot(self) -> list:
        with self._lock:
            return [[dict(k), v] for k, v in self._values.items()]

    def merge(self, snapshot: list) -> None:
        """Add another worker's values (a `snapshot()`)."""
        for labels, value in snapshot:
            self.inc(value, **labels)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items()) or [((), 0.0)]
        return [*self.header(), *(f"{self.name}{_labels(dict(k))} {_num(v)}" for k, v in items)]


class Gauge(Counter):
    """A value that goes up and down."""

    kind = "gauge"

    def set(self, value: float, **labels) -> None:
        with self._lock:
            self._values[tuple(sorted(labels.items()))] = float(value)


class Histogram(Metric):
    """Observations counted into cumulative buckets, with their sum and count."""

    kind = "histogram"

    def __init__(self, name, help_, buckets=STEP_BUCKETS_S):
        super().__init__(name, help_)
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum, self._count = 0.0, 0

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value
            self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def snapshot(self) -> dict:
        with self._lock:
            return {"counts": list(self._counts), "sum": self._sum, "count": self._count}

    def merge(self, snapshot: dict) -> None:
        """Add another worker's observations (a `snapshot()` with the same buckets)."""
        with self._lock:
            for i, n in enumerate(snapshot["counts"]):
                self._counts[i] += n
            self._sum += snapshot["sum"]
            self._count += snapshot["count"]

    @property
    def mean(self) -> float:
        return self._sum / self._count if self._count else 0.0

    def render(self) -> list[str]:
        with self._lock:
            counts, total, count = list(self._counts), self._sum, self._count
        lines, running = self.header(), 0
        for bound, n in zip((*self.buckets, math.inf), counts):
            running += n
            lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {running}')
        return [*lines, f"{self.name}_sum {_num(total)}", f"{self.name}_count {count}"]


class Registry:
    """The metrics one worker keeps."""

    def __init__(self):
        self.steps = Counter(
            "megaslide_denoise_steps_total",
            "Denoising steps run, each counted once per job it advanced",
        )
        self.passes = Counter(
            "megaslide_denoise_passes_total", "Batched forward passes of the video model"
        )
        self.step_seconds = Histogram(
            "megaslide_denoise_step_seconds", "Wall time of one batched denoising step"
        )
        self.batch_size = Histogram(
            "megaslide_denoise_batch_size",
            "Jobs advanced by one denoising pass",
            buckets=(1, 2, 4, 8, 16, 32),
        )
        self.video_seconds = Histogram(
            "megaslide_video_job_seconds",
            "Wall time from start to MP4 of one video",
            buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
        )
        self.jobs_finished = Counter(
            "megaslide_jobs_finished_total", "Jobs that reached a terminal state"
        )
        self.train_steps = Counter("megaslide_finetune_steps_total", "Fine-tuning optimizer steps")
        self.h2d_bytes = Counter(
            "megaslide_h2d_bytes_total", "Bytes copied host to device by weight streaming"
        )
        self.d2h_bytes = Counter(
            "megaslide_d2h_bytes_total", "Bytes copied device to host by weight streaming"
        )

    def snapshot(self) -> dict:
        """Every metric's values, JSON-ready, for the worker's heartbeat."""
        return {m.name: m.snapshot() for m in self.all()}

    def merge(self, snapshot: dict) -> None:
        """Add a worker's `snapshot()`; metrics this version does not know are skipped."""
        for metric in self.all():
            if metric.name in snapshot:
                metric.merge(snapshot[metric.name])

    def all(self) -> list[Metric]:
        return [
            self.steps,
            self.passes,
            self.step_seconds,
            self.batch_size,
            self.video_seconds,
            self.jobs_finished,
            self.train_steps,
            self.h2d_bytes,
            self.d2h_bytes,
        ]


def render(metrics: list[Metric]) -> str:
    return "\n".join(line for m in metrics for line in m.render()) + "\n"
