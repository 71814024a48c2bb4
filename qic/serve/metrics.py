"""GET /metrics: what the server has done, in the Prometheus text format (the prometheus-client library).

One registry per app (not the library's global one), so that two servers in one process, as the tests start,
count apart. What it holds:
- qic_requests_total{path, status}: HTTP requests answered (paths other than the server's own counted as "other",
  so that a scan of random URLs cannot grow the label set);
- qic_queue_depth, qic_images_running: images waiting, and in the batch running, when scraped;
- qic_batch_size: images per batch run (buckets: the batch sizes the bundle has graphs for);
- qic_batch_seconds, qic_stage_seconds{stage}: seconds per batch, all of it and in each stage, a stage being the
  component of the bundle's graphs that ran (text_encoder, denoiser, vae_decoder, ... as the manifest names them:
  the denoiser's seconds are all of a batch's steps). Measured around each graph call on the compute thread: on a
  CPU a call returns when its work is done; on an accelerator, when it has been queued;
- qic_images_total{outcome}: images of answered requests, made ("ok") or failed ("error": the batch raised, or the
  runner is gone);
- process_*: the server process's resident and virtual memory, CPU seconds and open files (the library's
  process collector, read from /proc on Linux).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

ROUTES = ("/health", "/health/live", "/health/ready", "/metrics", "/v1/models", "/v1/images/generations",
          "/v1/images/edits")
# Seconds of a batch or a stage: from a tiny CPU bundle's few ms to a real one's minutes.
SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500)


class StageClock:
    """Seconds spent in each component's graphs, summed per batch: wraps each Graph's `run` of a loaded bundle
    (qic.runtime.bundle.Graph: what every call of the graph goes through), so the host programs need not know."""

    def __init__(self, bundle):
        self._seconds: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()
        self.watch(bundle)

    def watch(self, bundle) -> None:
        """Time `bundle`'s graphs too (a weight set loaded later: qic.serve.weight_sets)."""
        for (component, _), graph in bundle.graphs.items():   # a second clock on a bundle replaces the first
            graph.run = self._timed(getattr(graph.run, "untimed", graph.run), component)

    def _timed(self, run, component: str):
        def timed(tensors):
            t = time.perf_counter()
            try:
                return run(tensors)
            finally:
                with self._lock:
                    self._seconds[component] += time.perf_counter() - t
        timed.untimed = run
        return timed

    def take(self) -> dict[str, float]:
        """The seconds by component since the last take (one batch's, when taken after each batch)."""
        with self._lock:
            seconds, self._seconds = dict(self._seconds), defaultdict(float)
        return seconds


class _WeightSets:
    """The named weight sets (qic.serve.weight_sets.WeightSets): how often each was mapped, and how many are now."""

    def __init__(self, sets):
        self.sets = sets

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        maps = CounterMetricFamily("qic_weight_set_maps", "Named weight sets mapped (at start and on demand)",
                                   labels=["model"])
        for name in self.sets.paths:
            maps.add_metric([name], self.sets.maps[name])
        yield maps
        yield GaugeMetricFamily("qic_weight_sets_mapped", "Named weight sets mapped now", value=len(self.sets.loaded))


class _Adapters:
    """Per-request LoRA adapters (qic.runtime.lora.Adapters): uses that found their matrices in memory (hits) or read
    them (misses), and what is held."""

    def __init__(self, adapters):
        self.adapters = adapters

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        uses = CounterMetricFamily("qic_lora_adapter_uses", "Adapter uses by requests: matrices in memory (hit) or "
                                   "read from the file (miss)", labels=["cache"])
        uses.add_metric(["hit"], self.adapters.hits)
        uses.add_metric(["miss"], self.adapters.misses)
        yield uses
        yield GaugeMetricFamily("qic_lora_adapters_loaded", "Adapters whose matrices are in memory",
                                value=len(self.adapters.loaded))
        yield GaugeMetricFamily("qic_lora_adapter_bytes", "Bytes of adapter matrices in memory",
                                value=self.adapters.held())


class Metrics:
    def __init__(self, scheduler, batch_sizes, sets=None, adapters=None):
        """sets: the runner's named weight sets, if any (their maps and how many are mapped); adapters: the bundle's
        per-request LoRA adapters, if it has slots."""
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        self.requests = Counter("qic_requests", "HTTP requests answered, by path and status", ["path", "status"],
                                registry=r)
        Gauge("qic_queue_depth", "Images waiting in the queue", registry=r).set_function(
            lambda: len(scheduler.pending))
        Gauge("qic_images_running", "Images in the batch now running", registry=r).set_function(
            lambda: scheduler.running)
        self.batch_size = Histogram("qic_batch_size", "Images per batch run", registry=r,
                                    buckets=sorted({1, *batch_sizes}))
        self.batch_seconds = Histogram("qic_batch_seconds", "Seconds per batch run", registry=r, buckets=SECONDS)
        self.stage_seconds = Histogram("qic_stage_seconds", "Seconds per batch in the graphs of one component",
                                       ["stage"], registry=r, buckets=SECONDS)
        self.images = Counter("qic_images", "Images made (ok) or failed (error)", ["outcome"], registry=r)
        for outcome in ("ok", "error"):
            self.images.labels(outcome)   # both series exist from the start, at 0
        self.partials = Counter("qic_partial_images", "Partial images streamed (qic.serve.stream)", registry=r)
        if sets is not None:
            r.register(_WeightSets(sets))
        if adapters is not None:
            r.register(_Adapters(adapters))

    def request(self, path: str, status: int) -> None:
        self.requests.labels(path if path in ROUTES else "other", str(status)).inc()

    def batch(self, images: int, seconds: float, stages: dict[str, float]) -> None:
        """A batch that ran: its size, its seconds, and its seconds by stage."""
        self.batch_size.observe(images)
        self.batch_seconds.observe(seconds)
        for stage, s in stages.items():
            self.stage_seconds.labels(stage).observe(s)

    def exposition(self) -> tuple[bytes, str]:
        """The text format's body and content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
