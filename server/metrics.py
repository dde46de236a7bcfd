"""The workers' metrics, counted and rendered by prometheus-client.

Each worker counts into a `Registry`: prometheus-client counters and histograms in a collector
registry of its own (several workers may share a process). It publishes a snapshot of them to the
job store's registry of workers with every heartbeat and, at most every `PUBLISH_INTERVAL_S`,
after a step or a job ends, so what an API host shows lags a worker by a fraction of a second, not
a heartbeat. The API host's `/metrics` adds up the snapshots of the live workers (`Totals`) and has
prometheus-client render them, with gauges read from the job store at scrape time (queue depth,
jobs by state, live workers), so those can never disagree with it.

Why snapshots in the store and not prometheus-client's multiprocess mode: that mode shares values
through files in one directory, which reaches the processes of one host; a fleet's workers run on
other hosts and already report to the store, which every API host reads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder

# A worker publishes its metrics after a step at most this often (and with every heartbeat).
PUBLISH_INTERVAL_S = 0.25

# Denoising-step latency spans milliseconds (tiny models) to minutes (a streamed 105B model).
STEP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass(frozen=True)
class Spec:
    """One worker metric: a counter (rendered `<name>_total`) or a histogram with `buckets`."""

    attr: str
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    @property
    def histogram(self) -> bool:
        return self.buckets is not None

    @property
    def key(self) -> str:
        """The name a snapshot keys it by: the rendered name, as earlier versions sent it."""
        return self.name if self.histogram else f"{self.name}_total"


SPECS = (
    Spec(
        "steps",
        "megaslide_denoise_steps",
        "Denoising steps run, each counted once per job it advanced",
    ),
    Spec("passes", "megaslide_denoise_passes", "Batched forward passes of the video model"),
    Spec(
        "step_seconds",
        "megaslide_denoise_step_seconds",
        "Wall time of one batched denoising step",
        buckets=STEP_BUCKETS_S,
    ),
    Spec(
        "batch_size",
        "megaslide_denoise_batch_size",
        "Jobs advanced by one denoising pass",
        buckets=(1, 2, 4, 8, 16, 32),
    ),
    Spec(
        "video_seconds",
        "megaslide_video_job_seconds",
        "Wall time from start to MP4 of one video",
        buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
    ),
    Spec(
        "jobs_finished",
        "megaslide_jobs_finished",
        "Jobs that reached a terminal state",
        labels=("kind", "status"),
    ),
    Spec("train_steps", "megaslide_finetune_steps", "Fine-tuning optimizer steps"),
    Spec("h2d_bytes", "megaslide_h2d_bytes", "Bytes copied host to device by weight streaming"),
    Spec("d2h_bytes", "megaslide_d2h_bytes", "Bytes copied device to host by weight streaming"),
    Spec(
        "compile_recompiles",
        "megaslide_compile_recompiles",
        "Graphs torch.compile compiled again for the compiled blocks (a new shape or guard)",
    ),
)


class Registry:
    """The metrics one worker keeps, as prometheus-client objects (`registry.steps.inc()`,
    `registry.jobs_finished.labels(kind=..., status=...).inc()`)."""

    def __init__(self):
        self.collector = CollectorRegistry(auto_describe=True)
        for spec in SPECS:
            if spec.histogram:
                metric = Histogram(
                    spec.name, spec.help, spec.labels, buckets=spec.buckets, registry=self.collector
                )
            else:
                metric = Counter(spec.name, spec.help, spec.labels, registry=self.collector)
            setattr(self, spec.attr, metric)

    def snapshot(self) -> dict:
        """Every metric's values, JSON-ready, for the store: a counter as `[[labels, value]...]`,
        a histogram as its per-bucket (not cumulative) counts, sum and count."""
        specs = {spec.name: spec for spec in SPECS}
        out: dict = {}
        for family in self.collector.collect():
            spec = specs[family.name]
            if spec.histogram:
                out[spec.key] = _histogram_snapshot(family.samples)
            else:
                out[spec.key] = [
                    [s.labels, s.value] for s in family.samples if s.name.endswith("_total")
                ]
        return out


def _histogram_snapshot(samples) -> dict:
    cumulative = [s.value for s in samples if s.name.endswith("_bucket")]
    total = next(s.value for s in samples if s.name.endswith("_sum"))
    count = next(s.value for s in samples if s.name.endswith("_count"))
    counts = [int(b - a) for a, b in zip([0.0, *cumulative], cumulative)]
    return {"counts": counts, "sum": total, "count": int(count)}


class Totals:
    """The live workers' snapshots added up: a prometheus-client collector for `/metrics`."""

    def __init__(self, snapshots: Iterable[dict] = ()):
        self.counters: dict[str, dict[tuple, float]] = {}
        self.histograms = {
            spec.key: {"counts": [0] * (len(spec.buckets) + 1), "sum": 0.0, "count": 0}
            for spec in SPECS
            if spec.histogram
        }
        for snapshot in snapshots:
            self.add(snapshot)

    def add(self, snapshot: dict) -> None:
        """Add one worker's `Registry.snapshot()`; metrics this version does not know, or whose
        buckets differ, are skipped."""
        for spec in SPECS:
            value = snapshot.get(spec.key)
            if value is None:
                continue
            if spec.histogram:
                total = self.histograms[spec.key]
                if len(value["counts"]) != len(total["counts"]):
                    continue
                total["counts"] = [a + b for a, b in zip(total["counts"], value["counts"])]
                total["sum"] += value["sum"]
                total["count"] += value["count"]
            else:
                values = self.counters.setdefault(spec.key, {})
                for labels, amount in value:
                    key = tuple(sorted(labels.items()))
                    values[key] = values.get(key, 0.0) + amount

    def mean(self, attr: str) -> float:
        """The mean observation of the histogram `attr` (e.g. "video_seconds"); 0 with none."""
        spec = next(s for s in SPECS if s.attr == attr)
        total = self.histograms[spec.key]
        return total["sum"] / total["count"] if total["count"] else 0.0

    def collect(self) -> Iterator[Metric]:
        for spec in SPECS:
            if spec.histogram:
                total, running, buckets = self.histograms[spec.key], 0, []
                for bound, n in zip((*spec.buckets, math.inf), total["counts"]):
                    running += n
                    buckets.append((_bound(bound), running))
                yield HistogramMetricFamily(
                    spec.name, spec.help, buckets=buckets, sum_value=total["sum"]
                )
            else:
                family = CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
                values = self.counters.get(spec.key, {})
                if not values and not spec.labels:
                    values = {(): 0.0}
                for key, value in sorted(values.items()):
                    labels = dict(key)
                    family.add_metric([labels.get(n, "") for n in spec.labels], value)
                yield family


def _bound(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


class Gauges:
    """Gauges read at scrape time, as a collector: `gauges.set(name, help, value, **labels)`."""

    def __init__(self):
        self.families: dict[str, GaugeMetricFamily] = {}

    def set(self, name: str, help_: str, value: float, **labels) -> None:
        family = self.families.get(name)
        if family is None:
            family = self.families[name] = GaugeMetricFamily(name, help_, labels=sorted(labels))
        family.add_metric([str(labels[k]) for k in sorted(labels)], value)

    def collect(self) -> Iterator[Metric]:
        yield from self.families.values()


def exposition(accept: str | None, *collectors) -> tuple[bytes, str]:
    """The body and content type of a scrape of `collectors`, in the format the scraper asked
    for (`Accept`: OpenMetrics, or the classic text format by default)."""
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
