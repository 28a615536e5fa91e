"""Prometheus metrics, in the conventions operators know from Triton and TF Serving."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from jaxserve.compile_cache import compile_count, xla_cache_hits

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _EngineCollector:
    """Values read from the engine and policy at scrape time (no double bookkeeping)."""

    def __init__(self, state):
        self.state = state

    def collect(self):
        eng = self.state.engine
        g = GaugeMetricFamily("jaxserve_compilations", "XLA backend compilations in this process "
                              "(persistent-cache retrievals included)")
        g.add_metric([], compile_count())
        yield g
        g = GaugeMetricFamily("jaxserve_xla_cache_hits", "compilations served by the XLA persistent cache")
        g.add_metric([], xla_cache_hits())
        yield g
        g = GaugeMetricFamily("jaxserve_compilations_since_ready",
                              "compilations after warmup finished (must stay 0: serving never compiles)")
        g.add_metric([], 0 if eng is None else compile_count() - eng.compiles_at_ready)
        yield g
        g = GaugeMetricFamily("jaxserve_ready", "1 once every executable is warm")
        g.add_metric([], 0 if eng is None else 1)
        yield g
        g = GaugeMetricFamily("jaxserve_gc_frozen_objects",
                              "objects moved out of the cyclic GC's reach at ready (jaxserve.launch.settle_heap)")
        g.add_metric([], gc.get_freeze_count())
        yield g
        if eng is None:
            return
        g = GaugeMetricFamily("jaxserve_queue_depth", "items queued, not yet running")
        g.add_metric([], eng.queue_depth)
        yield g
        g = GaugeMetricFamily("jaxserve_model_queue_depth", "items queued, not yet running, per model (every "
                              "served model, 0 included)", labels=["model"])
        by_model = eng.queue_depth_by_model()
        for model in eng.runtimes:
            g.add_metric([model], by_model.get(model, 0))
        yield g
        g = GaugeMetricFamily("jaxserve_in_flight", "items queued or running")
        g.add_metric([], eng.in_flight)
        yield g
        g = GaugeMetricFamily("jaxserve_items", "items by outcome: ok, late, evicted, error, or withdrawn "
                              "(its client left before it ran)", labels=["outcome"])
        for outcome, n in sorted(eng.stats.outcomes.items()):
            g.add_metric([outcome], n)
        yield g
        g = GaugeMetricFamily("jaxserve_worker_restarts", "executor worker restarts after failed batches")
        g.add_metric([], eng.stats.worker_restarts)
        yield g
        yield from _worker_metrics(eng)
        yield from _price_metrics(eng)
        families: dict = {}  # one family per name (a policy yields one series per label set)
        for name, labels, value in eng.policy.metrics():
            g = families.get(name)
            if g is None:
                g = families[name] = GaugeMetricFamily(f"jaxserve_policy_{name}", f"policy counter {name}",
                                                       labels=list(labels))
            g.add_metric(list(labels.values()), value)
        yield from families.values()


def _price_metrics(eng):
    """Measured against profiled prices (jaxserve.cost_drift): per model and per measured cell."""
    if eng.drift is None:
        return
    model = GaugeMetricFamily("jaxserve_price_ratio", "measured / profiled step time per model (running "
                              "log-mean over its cells; 1 until 8 steps); the engine logs a warning past 1.3x "
                              "either way", labels=["model"])
    cell = GaugeMetricFamily("jaxserve_price_ratio_cell", "measured / profiled step time per cell (its model's "
                             "until the cell has 8 steps)", labels=["model", "cell"])
    steps = GaugeMetricFamily("jaxserve_price_ratio_steps", "steps measured per cell", labels=["model", "cell"])
    for name in eng.runtimes:
        if name in eng.drift.cost_model.latency:
            model.add_metric([name], eng.drift.model_ratio(name))
    for name, c, ratio, n in eng.drift.rows():
        cell.add_metric([name, c.label()], ratio)
        steps.add_metric([name, c.label()], n)
    reprices = GaugeMetricFamily("jaxserve_price_reprices", "times the policy was handed corrected prices")
    reprices.add_metric([], eng.drift.reprices)
    yield from (model, cell, steps, reprices)


def _worker_metrics(eng):
    """The workers, what each holds, how long each has computed, and the stage loads."""
    busy = GaugeMetricFamily("jaxserve_worker_busy_seconds", "seconds each worker has spent running steps",
                             labels=["worker", "kind"])
    held = GaugeMetricFamily("jaxserve_worker_param_bytes", "parameter bytes each worker holds", labels=["worker"])
    stages = GaugeMetricFamily("jaxserve_worker_stage", "1 for each (worker, stage) it holds; the placement",
                               labels=["worker", "stage"])
    compiles = GaugeMetricFamily("jaxserve_worker_compilations", "XLA compilations in a worker's own process "
                                 "(Ray actors; as of its last load: 0 when its node's cache was warm)",
                                 labels=["worker"])
    for wid, worker in sorted(eng.workers.items()):
        h = worker.holdings()
        busy.add_metric([str(wid), worker.kind], worker.busy_seconds)
        held.add_metric([str(wid)], h.param_bytes)
        for stage in sorted(h.stages):
            stages.add_metric([str(wid), stage.label()], 1)
        if h.compilations is not None:
            compiles.add_metric([str(wid)], h.compilations)
    yield from (busy, held, stages, compiles)
    loads = GaugeMetricFamily("jaxserve_stage_load_seconds", "time of the last load of each stage on each worker "
                              "(a placement change: parameters and executables)", labels=["stage", "worker"])
    last = {(label, wid): seconds for label, wid, seconds in eng.stats.stage_loads}
    for (label, wid), seconds in sorted(last.items()):
        loads.add_metric([label, str(wid)], seconds)
    yield loads
    g = GaugeMetricFamily("jaxserve_stage_loads", "stage loads carried out (placement changes)")
    g.add_metric([], eng.stats.stage_load_count)
    yield g
    g = GaugeMetricFamily("jaxserve_steps", "steps run (a request of several steps counts each)")
    g.add_metric([], eng.stats.steps)
    yield g


class Metrics:
    def __init__(self, state):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("jaxserve_requests", "HTTP requests by path and status", ["path", "status"], registry=r)
        self.batch_size = Histogram("jaxserve_batch_size", "items per executed batch", ["model"],
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.padding = Histogram("jaxserve_padding_ratio", "padded tokens / real tokens per text batch", ["model"],
                                 buckets=(1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0), registry=r)
        self.exec_latency = Histogram("jaxserve_executable_latency_seconds", "compute time per executable",
                                      ["model", "shape"], buckets=_LATENCY_BUCKETS, registry=r)
        self.handoff = Histogram("jaxserve_batch_handoff_seconds",
                                 "per batch, how long its instance was held beyond the compute: worker pick-up "
                                 "and the completion's wait for the event loop (the simulator's batch_overhead)",
                                 ["model"], buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                                     0.05, 0.1), registry=r)
        self.item_latency = Histogram("jaxserve_item_latency_seconds", "arrival to answer, per item",
                                      ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.slo = Counter("jaxserve_slo_items", "items that carried an SLO, by outcome", ["outcome"], registry=r)
        self.slo_attainment = Gauge("jaxserve_slo_attainment", "share of SLO items answered ok", registry=r)
        self.read_timeouts = Counter(
            "jaxserve_read_timeouts", "connections cut off for a slow client, by phase: idle (connected, sent "
            "nothing), headers (request headers incomplete), body (body incomplete; also a 408 request)",
            ["phase"], registry=r)
        self.asset_reloads = Counter("jaxserve_asset_reloads", "task-asset reloads (POST /admin/reload or "
                                     "SIGHUP), by outcome: ok or refused", ["outcome"], registry=r)
        r.register(_EngineCollector(state))
        self._slo_ok = 0
        self._slo_all = 0

    def request_done(self, path: str, status: int) -> None:
        self.requests.labels(path, str(status)).inc()

    def read_timeout(self, phase: str) -> None:
        self.read_timeouts.labels(phase).inc()

    def observe_batch(self, batch, output, pendings, seconds: float) -> None:
        model = batch.model
        self.batch_size.labels(model).observe(len(pendings))
        self.exec_latency.labels(model, batch.cell.label()).observe(output.compute_seconds)
        self.handoff.labels(model).observe(max(0.0, seconds - output.compute_seconds))
        if batch.cell.seq:
            real = sum(p.request.length for p in pendings)
            self.padding.labels(model).observe(batch.cell.seq * batch.cell.batch / max(real, 1))

    def observe_answer(self, model: str, outcome: str, seconds: float, had_slo: bool) -> None:
        self.item_latency.labels(model).observe(seconds)
        if had_slo:
            self.slo.labels(outcome).inc()
            self._slo_all += 1
            self._slo_ok += outcome == "ok"
            self.slo_attainment.set(self._slo_ok / self._slo_all)

    def render(self) -> bytes:
        return generate_latest(self.registry)
