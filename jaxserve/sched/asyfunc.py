"""AsyFunc: body and shadow replicas, model-level and layer-level scaling (Pei et al., SoCC'23).

A **body** holds the whole model; a **shadow** holds one contiguous layer block ``[i:j)``
(:attr:`SplitOption.block`). In a burst a body splits a batch of ``b`` rows at that block, as
a request of several steps (the engine's multi-step requests, ``jaxserve.engine``):

1. ``[0:i)`` on the body for all ``b`` rows (skipped when ``i == 0``), non-final;
2. ``[i:j)`` as two batches at once: ``b_B`` rows on the body and ``b_S = b - b_B`` on the
   shadow (final when ``j == L``);
3. ``[j:L)`` on the body for all ``b`` rows (skipped when ``j == L``): the engine gathers each
   request's row from whichever step produced it (``Engine._step_for`` concatenates rows of
   different sources), the simulator moves only the shadow's rows.

Its latency is modelled as ``t = t_pre(b) + max(t_blk^B(b_B), x(b_S) + t_blk^S(b_S)) + x(b_S)
+ t_post(b)`` with ``x`` the activation transfer: the paper's ``max(t_np + t_pB, t_np + t_pS +
transfer)`` with ``t_np = t_pre + t_post`` and the transfer written out in both directions
(the paper folds it into t_pS). Cores change latency: every price is looked up in the cost
model profiled at the instance's core count (:attr:`AsyFuncModel.latency`).

The three policies (``variant``):

* ``"asyfunc"``: model-level scaling (MLS, Alg. 1), layer-level scaling (LLS, Alg. 2) and
  adaptive scheduling (§5.1, Alg. 3);
* ``"asyfunc-nolls"``: the paper's AsyFunc⁻, the same without LLS;
* ``"asyfunc-batch"``: BATCH (Ali et al., SC'20) as the paper realises it, on the same MLS but
  with one configuration fixed offline (``c_max`` cores) and BATCH's buffer: a batch leaves
  when it holds ``b_max`` requests or its oldest has waited ``slo - t(c_max, b_max)``.

Decisions the paper leaves open, or where we differ (each is a knob or a line below):

* **Scale.** The paper's nodes have 36 cores, ``C_max = 16``, ``B_max = 4``. This machine has 2
  cores, so ``c_max = 2`` (the core counts we can profile: 1 and 2, by CPU affinity) and nodes
  get ``node_cores = 4`` (36 · 2/16 = 4.5, rounded down). ``b_max = 4`` is kept (one of our
  compiled batch sizes); the SLO is set as the paper sets it, from the latency at
  ``(c_max, b_max)`` (the bench's choice of factor).
* **Rate estimate.** "Historical inter-arrival time": the mean rate of the last period
  (arrivals / period), the last value of the mean.
* **rho.** "A normalising factor related to the whole model's parameter size": ``rho = 1 /
  body_bytes``, so a body's memory weighs as much as one core in η.
* **One queue** per policy (one model, one input shape ``seq``), as the paper's per-model
  function; a request longer than ``seq`` is refused.
* **Alg. 3's fallback** dispatches "a portion of the latest requests" to the largest idle
  instance and drops the rest. We drop (evict) only requests that can no longer meet their
  deadline even alone, then send the largest batch whose oldest member still makes it.
* **Batch cap.** A body, alone or paired, takes at most ``b_max`` rows (Alg. 2 line 9 splits
  ``b ≤ B_max``): a pair is faster at the same ``b``, which is what raises its supported rate.
* **Blocks.** Our engine cuts layer ranges, so a shadow holds one contiguous block; the
  candidates (:attr:`AsyFuncModel.splits`, from ``jaxserve.layer_profile``) are contiguous
  unions of the profiler's blocks in sensitivity order. Attention/MLP halves are profiled but
  cannot be shadowed apart.
* **LLS trigger.** "The waiting queue reaches gamma": the queue is looked at after Alg. 3 has
  given every idle unit its batch, so requests an idle body takes at once never count as
  waiting. Looked at before dispatch, two requests arriving together at an idle body started a
  shadow, at any load, that then had nothing to do. (On the simulated cluster of bench/asyfunc_sim
  it changed little: its bodies are busy at those loads, so requests are left waiting anyway, and
  most shadows still go unused under smallest-first dispatch.)
* **LLS pairing.** Bodies are paired "earliest idle first" (the paper's text; its Alg. 2 says
  descending). A shadow is placed on its body's node only (Alg. 2 line 4): ``c = min(c_a,
  c_max // 2)`` cores when ``c_a ≥ max(1, c_max / 4)``. Live shadows are capped at ``kappa``.
* **Useless pairs.** Alg. 2 provisions the most efficient Φ whatever it buys; we provision a
  shadow only where the pair's Eq.-1 rate (max b / t over splits meeting the SLO) exceeds the
  body's alone, the purpose §4.3 states ("increase the maximum supported batch size").
* **Smallest first.** Alg. 3 tries idle bodies in ascending cores, to maximise "processing
  efficiency (the actual throughput per core)"; it predates the pairs. A body-shadow pair holds
  the body's cores and the shadow's, so it is the larger unit: a body runs a batch alone when
  that meets the head's deadline, and splits it only when alone it would not (or, in the
  fallback, when the split is faster). Splitting whenever it was faster kept a shadow busy at
  any load, so it was never released and held its core and block after the burst (the live run
  of 11-27: AsyFunc held 2.00 cores, as many as BATCH, at a base load a 1-core body met).
* **Release.** "When the burst passes": a shadow is released once the queue is below
  ``gamma`` and the shadow has done nothing for ``shadow_idle_s`` (5 s), smallest η first.
* **Container pool.** A shadow starts from the node's warm empty worker, so it is ready after
  the block's load (``SplitOption.load_s``); a new body pays ``body_load_s`` (container start
  and the whole model). The pool's own reserved resources are not counted.
* **Prices.** The paper plans with its offline profile. Live, we plan with measured prices:
  every step's compute against the profile (one factor for all stages and core counts, since
  on shared cores contention stretches them alike) and each step's overhead besides its
  compute (the call to the worker and the hand-off back), priced once per step, so a split's
  two or three steps pay it two or three times (:meth:`AsyFuncPolicy.observe_step`). The
  simulator has no such measurement and plans with the profile, unless given prices
  (:meth:`AsyFuncPolicy.plan_with_prices`).
* **Accounting.** An instance holds its cores and parameter bytes from the moment it is
  planned (loading included) until it is removed (:class:`ResourceLedger`).

Live (``jaxserve serve --policy asyfunc*``): :func:`jaxserve.launch.make_asyfunc_policy` sets
the knobs for one node (this machine's cores) and the bodies the server starts with, and the
engine carries out the placement this policy plans (workers added, stages loaded, workers
removed); on Ray, :class:`jaxserve.asyfunc_exec.AsyFuncRayWorkers` pins each instance to its
cores and makes shadows of the warm pool worker. ``/metrics`` has the ledger's holdings
(:meth:`AsyFuncPolicy.metrics`). A failed add or load releases its instance.

Pure: no JAX, no clock, no threads. The simulator prices each step through
:meth:`AsyFuncPolicy.service_time` at the instance's core count; it must be given the same
activation transfer (``transfer_hop_s``, ``transfer_bytes_per_s``, ``row_bytes``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from jaxserve.cost_drift import RunningMean
from jaxserve.sched.base import (Batch, Cell, CostModel, LatencyProfile, PlacementChange, Plan, Policy, Request,
                                 ShapeGrid, Stage, StepSummary, WorkerView)

__all__ = ["ASYFUNC_VARIANTS", "AsyFuncKnobs", "AsyFuncModel", "AsyFuncPolicy", "BodySpec", "ResourceLedger",
           "PriceTracker", "SHARED_MEMORY_BYTES_PER_S", "SplitOption", "initial_bodies", "model_from_layers"]

ASYFUNC_VARIANTS = ("asyfunc", "asyfunc-nolls", "asyfunc-batch")
_INF = math.inf


@dataclass(frozen=True)
class AsyFuncKnobs:
    """The paper's parameters (§7.1), scaled to this machine as the module docstring says."""

    slo_s: float
    period_s: float = 60.0
    alpha: float = 0.8
    beta: float = 0.6
    gamma: int = 2
    kappa: int = 10
    c_max: int = 2
    b_max: int = 4
    nodes: int = 30
    node_cores: int = 4
    shadow_idle_s: float = 5.0
    min_bodies: int = 1
    max_queue: int = 100_000


@dataclass(frozen=True)
class SplitOption:
    """A candidate shadow block: layers ``block`` (a :class:`Stage`), its parameter bytes and
    the seconds a warm worker takes to load them."""

    block: Stage
    bytes: int
    load_s: float


@dataclass(frozen=True)
class AsyFuncModel:
    """What the policy knows of the served model (written by ``jaxserve profile --layers``).

    ``latency[c]``: the cost model profiled at ``c`` cores, with a profile for the whole model
    (named ``name``) and one per stage label of every split (``m[0:i]``, ``m[i:j]``,
    ``m[j:L]``), at cells ``(b, seq)``. ``row_bytes``: activation bytes per row at a block's
    boundary (hidden states and mask). ``scale`` and ``step_overhead_s``: what live steps cost
    against the profile (:class:`PriceTracker`; 1 and 0 until measured)."""

    name: str
    num_layers: int
    grid: ShapeGrid
    seq: int
    latency: Mapping[int, CostModel]
    body_bytes: int
    body_load_s: float
    splits: tuple[SplitOption, ...] = ()
    row_bytes: float = 0.0
    transfer_hop_s: float = 0.0
    transfer_bytes_per_s: float = _INF
    scale: float = 1.0
    step_overhead_s: float = 0.0
    _memo: dict = field(default_factory=dict, compare=False, repr=False)  # (stage, cores, rows) -> seconds

    def with_prices(self, scale: float, step_overhead_s: float) -> "AsyFuncModel":
        """This model with every compute price times ``scale`` (measured over profiled) and
        ``step_overhead_s`` added per step (:class:`PriceTracker`)."""
        return replace(self, scale=float(scale), step_overhead_s=float(step_overhead_s), _memo={})

    @property
    def whole(self) -> Stage:
        return Stage(self.name, 0, self.num_layers, self.num_layers)

    def pre(self, block: Stage) -> Stage | None:
        return Stage(self.name, 0, block.start, self.num_layers) if block.start > 0 else None

    def post(self, block: Stage) -> Stage | None:
        return Stage(self.name, block.stop, self.num_layers, self.num_layers) if block.stop < self.num_layers else None

    def body_stages(self) -> tuple[Stage, ...]:
        """What a body holds: the whole model and every stage a split runs on it."""
        out = [self.whole]
        for s in self.splits:
            out += [st for st in (self.pre(s.block), s.block, self.post(s.block)) if st is not None]
        return tuple(dict.fromkeys(out))

    def cell(self, rows: int) -> Cell:
        return self.grid.cell_for(rows, self.seq)

    def seconds(self, stage: Stage | None, cores: int, rows: int) -> float:
        """Compute seconds of ``rows`` rows of ``stage`` (None: the whole model) at ``cores``:
        the profile's, times :attr:`scale`."""
        if rows <= 0:
            return 0.0
        key = (stage, cores, rows)
        t = self._memo.get(key)
        if t is None:
            t = self._memo[key] = self.scale * self.profiled(stage, cores, rows)
        return t

    def profiled(self, stage: Stage | None, cores: int, rows: int) -> float:
        """The profile's compute seconds of ``rows`` rows of ``stage`` at ``cores`` (no scale)."""
        profiles = self.latency[cores].latency
        name = self.name if stage is None or stage.whole else stage.label()
        cell = self.cell(rows)
        return float(profiles[name].latency_for(cell.batch, cell.seq, cell.gamma))

    def step_seconds(self, stage: Stage | None, cores: int, rows: int) -> float:
        """One engine step of ``rows`` rows of ``stage``: its compute and the per-step overhead
        (the call to the worker, the hand-off back to the engine's loop)."""
        return self.seconds(stage, cores, rows) + self.step_overhead_s if rows > 0 else 0.0

    def default_slo_s(self, c_max: int, b_max: int) -> float:
        """The SLO when none is given: 3x the whole model's latency at ``(c_max, b_max)`` (the
        paper sets its SLOs from the latency of its largest configuration; the factor is ours)."""
        return 3 * self.seconds(None, c_max, b_max)

    def transfer_s(self, rows: int) -> float:
        return self.transfer_hop_s + rows * self.row_bytes / self.transfer_bytes_per_s if rows else 0.0

    def split_seconds(self, split: SplitOption, body_cores: int, shadow_cores: int, b: int, b_body: int) -> float:
        """The modelled latency of ``b`` rows split ``b_body`` / ``b - b_body`` (module docstring)."""
        blk = split.block
        b_shadow = b - b_body
        pre, post = self.pre(blk), self.post(blk)
        into = 0.0 if blk.first else self.transfer_s(b_shadow)
        back = 0.0 if blk.last else self.transfer_s(b_shadow)
        par = max(self.seconds(blk, body_cores, b_body), into + self.seconds(blk, shadow_cores, b_shadow))
        t_pre = self.seconds(pre, body_cores, b) if pre is not None else 0.0  # None here: no such step,
        t_post = self.seconds(post, body_cores, b) if post is not None else 0.0  # not the whole model
        steps = 1 + (pre is not None) + (post is not None)
        return t_pre + par + back + t_post + steps * self.step_overhead_s

    def best_split(self, split: SplitOption, body_cores: int, shadow_cores: int, b: int) -> tuple[int, float]:
        """(b_B, latency): Alg. 2 line 10, ``b_B`` balancing the two parallel parts (ties: the
        faster); both parts get at least one row."""
        best = None
        for b_body in range(1, b):
            t_b = self.seconds(split.block, body_cores, b_body)
            t_s = self.seconds(split.block, shadow_cores, b - b_body) + self.transfer_s(b - b_body)
            t = self.split_seconds(split, body_cores, shadow_cores, b, b_body)
            key = (abs(t_b - t_s), t)
            if best is None or key < best[0]:
                best = (key, b_body, t)
        if best is None:
            raise ValueError("a split needs b >= 2")
        return best[1], best[2]


class PriceTracker:
    """What live steps cost against the profile: ``scale``, an exponentially weighted mean of
    log(measured compute / profiled compute) over every step (weight ``weight`` per step, so
    a burst's contention shows within tens of steps and passes as fast), and ``overhead_s``,
    the same mean of wall minus compute over whole-model steps (a split's steps also move
    activations, which :meth:`AsyFuncModel.transfer_s` prices). Starts at the profile's (1, 0).
    Both means are :class:`jaxserve.cost_drift.RunningMean`, the engine's drift tracker's: the
    first steps weigh 1/n, a plain mean, rather than moving the profile's price by ``weight``
    each. Like the engine's :class:`CostDrift` (``min_samples``), it is never :meth:`due`
    before ``min_steps`` steps: one slow first step (a worker's first call) taken in full
    would price every step like it, and a policy that then evicts every request runs no
    step that could correct it. ``sigma``: the spread of those log ratios, the root of the
    same weighted mean of each step's squared deviation from the mean before it (so it also
    holds how far one step lands from the price planned for it). Planning uses the mean
    prices only; the spread is what a simulation of the run draws each step's price with
    (``latency_noise``), since queueing grows with service-time variance.

    Why one factor for every stage and core count: on a shared node what moves live prices is
    contention (the front end, the client, the other workers on the same cores), which
    stretches every step alike, and one factor learns from every step. :meth:`due` when the
    scale moved by more than ``step`` (relative) or the overhead by more than ``overhead_step_s``
    since the prices in use."""

    def __init__(self, weight: float = 0.05, step: float = 0.05, overhead_step_s: float = 0.5e-3,
                 min_steps: int = 8):
        self.weight, self.step, self.overhead_step_s, self.min_steps = weight, step, overhead_step_s, min_steps
        self._log_scale = RunningMean()
        self._overhead = RunningMean()
        self._log_var = RunningMean()
        self.steps = 0

    @property
    def scale(self) -> float:
        return math.exp(self._log_scale.mean)

    @property
    def overhead_s(self) -> float:
        return self._overhead.mean

    @property
    def sigma(self) -> float:
        return math.sqrt(self._log_var.mean)

    def observe(self, compute_s: float, profiled_s: float, overhead_s: float | None) -> None:
        if compute_s > 0 and profiled_s > 0:
            x = math.log(compute_s / profiled_s)
            if self._log_scale.n:
                self._log_var.add((x - self._log_scale.mean) ** 2, self.weight)
            self._log_scale.add(x, self.weight)
        if overhead_s is not None:
            self._overhead.add(max(0.0, overhead_s), self.weight)
        self.steps += 1

    def due(self, scale: float, overhead_s: float) -> bool:
        if self.steps < self.min_steps:
            return False
        return (abs(self.scale / scale - 1.0) > self.step
                or abs(self.overhead_s - overhead_s) > self.overhead_step_s)


@dataclass(frozen=True)
class BodySpec:
    """A body instance the run starts with (already loaded): worker ``id`` on ``node``."""

    id: int
    node: int
    cores: int


class ResourceLedger:
    """Cores and parameter bytes each instance holds over time (§7.2's CPU and memory usage).

    ``add`` / ``remove`` record when an instance starts and stops holding; :meth:`usage`
    integrates over a window. Totals at any time are the sums over live instances."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int, str, int, int]] = []  # (time, id, kind, +-cores, +-bytes)
        self._live: dict[int, tuple[str, int, int]] = {}

    def add(self, now: float, instance: int, kind: str, cores: int, nbytes: int) -> None:
        if instance in self._live:
            raise ValueError(f"instance {instance} is already held")
        self._live[instance] = (kind, cores, nbytes)
        self.events.append((now, instance, kind, cores, nbytes))

    def remove(self, now: float, instance: int) -> None:
        kind, cores, nbytes = self._live.pop(instance)
        self.events.append((now, instance, kind, -cores, -nbytes))

    def held(self, kind: str | None = None) -> tuple[int, int]:
        """(cores, bytes) held now, by ``kind`` ("body", "shadow") or all."""
        live = [v for v in self._live.values() if kind is None or v[0] == kind]
        return sum(v[1] for v in live), sum(v[2] for v in live)

    def usage(self, start: float, end: float, kind: str | None = None) -> tuple[float, float]:
        """(core-seconds, byte-seconds) held in ``[start, end)``."""
        cores = nbytes = 0
        core_s = byte_s = 0.0
        last = start
        for t, _, k, dc, db in self.events:
            if kind is not None and k != kind:
                continue
            if t > start:
                span = min(t, end) - last
                if span > 0:
                    core_s += cores * span
                    byte_s += nbytes * span
                last = max(last, min(t, end))
            if t >= end:
                break
            cores += dc
            nbytes += db
        if end > last:
            core_s += cores * (end - last)
            byte_s += nbytes * (end - last)
        return core_s, byte_s

    def periods(self, period: float, end: float, kind: str | None = None) -> list[tuple[float, float, float]]:
        """Per adaptation period up to ``end``: (start, mean cores, mean bytes)."""
        out = []
        t = 0.0
        while t < end:
            t1 = min(t + period, end)
            c, b = self.usage(t, t1, kind)
            out.append((t, c / (t1 - t), b / (t1 - t)))
            t = t1
        return out


@dataclass
class _Instance:
    id: int
    kind: str  # "body" | "shadow"
    node: int
    cores: int
    nbytes: int
    added: float
    ready: bool = False
    loads: list = field(default_factory=list)  # stages still to load, in order
    partner: int | None = None
    split: SplitOption | None = None  # a shadow's block
    busy_until: float = 0.0
    last_used: float = 0.0
    rows_period: int = 0  # rows served this period (scale-in's eta)
    rows_total: int = 0
    removing: bool = False


@dataclass
class _Group:
    """One split batch in flight: its rows, the pair, and the steps still to come."""

    rows: tuple[int, ...]
    body: int
    shadow: int
    split: SplitOption
    b_body: int
    steps: list = field(default_factory=list)  # remaining phases: "pre", "par", "post"
    running: int = 0  # batches of the current phase still running


def _eta(b: int, t: float, cores: int, mem_units: float) -> float:
    """Resource efficiency (Alg. 1 line 7): throughput per core plus per unit of memory."""
    return b / (cores * t) + b / (mem_units * t)


def initial_bodies(model: AsyFuncModel, knobs: AsyFuncKnobs, rate: float,
                   variant: str = "asyfunc") -> tuple[BodySpec, ...]:
    """The bodies MLS would provision for ``rate`` requests per second from an empty cluster
    (the run's start: they are loaded already)."""
    probe = AsyFuncPolicy(model, knobs, (), variant=variant)
    probe._scale_out(rate, 0.0, loaded=True)
    return tuple(BodySpec(x.id, x.node, x.cores) for x in probe._inst.values())


class AsyFuncPolicy(Policy):
    """AsyFunc and its two baselines (``variant``: one of :data:`ASYFUNC_VARIANTS`) for one
    model. ``bodies``: the loaded bodies the run starts with (their workers hold
    :meth:`AsyFuncModel.body_stages`)."""

    def __init__(self, model: AsyFuncModel, knobs: AsyFuncKnobs, bodies: Sequence[BodySpec],
                 variant: str = "asyfunc") -> None:
        if variant not in ASYFUNC_VARIANTS:
            raise ValueError(f"unknown AsyFunc variant {variant!r}; known: {ASYFUNC_VARIANTS}")
        if knobs.b_max > model.grid.max_batch:
            raise ValueError(f"b_max {knobs.b_max} exceeds {model.name}'s largest batch {model.grid.max_batch}")
        if variant == "asyfunc" and not model.splits:
            raise ValueError(f"{model.name} has no shadow block to scale at the layer level")
        self.model = model
        self.knobs = knobs
        self.variant = variant
        self.lls = variant == "asyfunc"
        self.configs = (knobs.c_max,) if variant == "asyfunc-batch" else tuple(range(1, knobs.c_max + 1))
        self.rho_m = 1.0  # rho * body_bytes (module docstring)
        self.ledger = ResourceLedger()
        self._inst: dict[int, _Instance] = {}
        self._next_id = 0
        self._node_free = [knobs.node_cores] * knobs.nodes
        self.decisions: list[tuple[float, str, int, int]] = []  # (time, action, instance, cores): for reports
        for spec in bodies:
            x = self._new(spec.node, spec.cores, "body", 0.0, loads=[], node_checked=False)
            if x.id != spec.id:
                raise ValueError("initial bodies must have ids 0, 1, 2, ... in order")
            x.ready = True
        self._queue: deque[Request] = deque()
        self._groups: dict[int, _Group] = {}  # request id -> its split group
        self._reserved: set[int] = set()  # bodies between the steps of a split
        self._to_remove: list[int] = []
        self._arrivals_period = 0
        self._next_period = knobs.period_s
        self.rate_estimates: list[tuple[float, float, float]] = []  # (time, R, R_max)
        self.splits_done = 0
        self.failed_placements = 0
        self._no_shadow_until = -_INF  # after a shadow's failed placement (on_placement)
        self._added = set(self._inst)  # workers that exist (the initial bodies) or whose add was planned
        self.prices = PriceTracker()
        self.reprices = 0
        self._set_model(model)

    def _set_model(self, model: AsyFuncModel) -> None:
        """Plan with ``model``'s prices from now on (and what is derived from them)."""
        knobs = self.knobs
        self.model = model
        self._split_memo: dict[tuple, tuple[int, float]] = {}
        self._max_rps = {c: self._max_rps_of(c) for c in range(1, knobs.c_max + 1)}
        self._batch_wait = max(0.0, knobs.slo_s - model.step_seconds(None, knobs.c_max, knobs.b_max))
        self._t1 = min(model.step_seconds(None, c, 1) for c in range(1, knobs.c_max + 1))  # fastest lone request

    def observe_step(self, batch: Batch, compute_s: float, wall_s: float, now: float) -> None:
        """A live step took ``compute_s`` on its worker and ``wall_s`` from dispatch to its
        result on the engine's loop: fold it into :attr:`prices` and plan with the corrected
        prices once they moved by more than :attr:`PriceTracker.step` (:meth:`AsyFuncModel.with_prices`)."""
        x = self._inst.get(batch.instance)
        if x is None or batch.cell.batch <= 0:
            return
        profiled = self.model.profiled(batch.stage, x.cores, batch.cell.batch)
        whole = batch.stage is None or batch.stage.whole
        self.prices.observe(compute_s, profiled, wall_s - compute_s if whole else None)
        if self.prices.due(self.model.scale, self.model.step_overhead_s):
            self.plan_with_prices(self.prices.scale, self.prices.overhead_s)

    def plan_with_prices(self, scale: float, step_overhead_s: float) -> None:
        """Plan from now on with the profile's compute times ``scale`` and ``step_overhead_s``
        per step (what :meth:`observe_step` does live; a simulation may start with measured
        prices this way)."""
        self._set_model(self.model.with_prices(scale, step_overhead_s))
        self.reprices += 1

    def _best_split(self, split: SplitOption, body_cores: int, shadow_cores: int, b: int) -> tuple[int, float]:
        key = (split, body_cores, shadow_cores, b)
        out = self._split_memo.get(key)
        if out is None:
            out = self._split_memo[key] = self.model.best_split(split, body_cores, shadow_cores, b)
        return out

    # -- instances and accounting ----------------------------------------------------
    def _new(self, node: int, cores: int, kind: str, now: float, loads: list, node_checked: bool = True,
             split: SplitOption | None = None) -> _Instance:
        if node_checked and self._node_free[node] < cores:
            raise RuntimeError(f"node {node} has {self._node_free[node]} free cores, not {cores}")
        self._node_free[node] -= cores
        nbytes = self.model.body_bytes if kind == "body" else split.bytes
        x = _Instance(self._next_id, kind, node, cores, nbytes, now, loads=loads, split=split, last_used=now)
        self._next_id += 1
        self._inst[x.id] = x
        self.ledger.add(now, x.id, kind, cores, nbytes)
        self.decisions.append((now, f"add_{kind}", x.id, cores))
        return x

    def _drop_instance(self, x: _Instance, now: float) -> None:
        x.removing = True
        self._node_free[x.node] += x.cores
        self.ledger.remove(now, x.id)
        self.decisions.append((now, f"remove_{x.kind}", x.id, x.cores))
        self._to_remove.append(x.id)
        del self._inst[x.id]

    def instance(self, wid: int) -> tuple[str, int] | None:
        """(kind, cores) of instance ``wid`` ("body" or "shadow"), None if it is not one: what a
        live worker factory needs to start the right worker (``jaxserve.asyfunc_exec``)."""
        x = self._inst.get(wid)
        return None if x is None else (x.kind, x.cores)

    def bodies(self) -> list[_Instance]:
        return [x for x in self._inst.values() if x.kind == "body"]

    def shadows(self) -> list[_Instance]:
        return [x for x in self._inst.values() if x.kind == "shadow"]

    # -- the paper's quantities ----------------------------------------------------
    def _max_rps_of(self, cores: int) -> float:
        """Eq. 1's term: max b / t_l over b <= b_max with t_l <= SLO (0 if none)."""
        best = 0.0
        for b in range(1, self.knobs.b_max + 1):
            t = self.model.step_seconds(None, cores, b)
            if t <= self.knobs.slo_s:
                best = max(best, b / t)
        return best

    def r_max(self) -> float:
        return sum(self._max_rps[x.cores] for x in self.bodies())

    def _best_eta(self, cores: int, rate: float | None) -> float:
        """Alg. 1 lines 4-10: the efficiency of the largest batch whose longest service time
        ``(b - 1) / R + t_l`` meets the SLO (``rate`` None: t_l alone)."""
        for b in range(self.knobs.b_max, 0, -1):
            t = self.model.step_seconds(None, cores, b)
            wait = (b - 1) / rate if rate else 0.0
            if wait + t <= self.knobs.slo_s:
                return _eta(b, t, cores, self.rho_m)
        return 0.0

    # -- model-level scaling (Alg. 1) ----------------------------------------------
    def ranked_configs(self, rate: float | None) -> list[int]:
        """The core counts that can meet the SLO at ``rate`` (None: a lone batch), most
        efficient first (Alg. 1 lines 4-10; ties: the order of ``configs``)."""
        ranked = sorted(self.configs, key=lambda c: -self._best_eta(c, rate))
        return [c for c in ranked if self._best_eta(c, rate) > 0 and self._max_rps[c] > 0]

    def _scale_out(self, rate: float, now: float, loaded: bool = False) -> None:
        """Alg. 1 lines 2-13 (``loaded``: the bodies exist already, as at the run's start)."""
        ranked = self.ranked_configs(rate)
        r_max = self.r_max()
        while ranked and rate > self.knobs.alpha * r_max:
            node = max(range(self.knobs.nodes), key=lambda n: (self._node_free[n], -n))
            cores = next((c for c in ranked if c <= self._node_free[node]), None)
            if cores is None:
                break  # the cluster is full
            x = self._new(node, cores, "body", now, loads=[] if loaded else list(self.model.body_stages()))
            x.ready = loaded
            r_max += self._max_rps[cores]

    def _scale_in(self, rate: float, now: float) -> None:
        r_max = self.r_max()
        period = self.knobs.period_s

        def eta(x: _Instance) -> float:
            return x.rows_period / period / x.cores + x.rows_period / period / self.rho_m

        for x in sorted(self.bodies(), key=lambda x: (eta(x), x.id)):
            if not rate < self.knobs.beta * r_max:
                break
            if len(self.bodies()) <= self.knobs.min_bodies:
                break
            if not x.ready or x.id in self._reserved:
                continue
            if x.partner is not None:
                partner = self._inst.get(x.partner)
                if partner is not None:
                    self._drop_instance(partner, now)
            r_max -= self._max_rps[x.cores]
            self._drop_instance(x, now)

    def _adapt(self, now: float) -> None:
        rate = self._arrivals_period / self.knobs.period_s
        self._arrivals_period = 0
        r_max = self.r_max()
        self.rate_estimates.append((now, rate, r_max))
        if rate > self.knobs.alpha * r_max:
            self._scale_out(rate, now)
        elif rate < self.knobs.beta * r_max:
            self._scale_in(rate, now)
        for x in self._inst.values():
            x.rows_period = 0

    # -- layer-level scaling (Alg. 2) ----------------------------------------------
    def _scale_up_shadows(self, now: float) -> None:
        if now < self._no_shadow_until:
            return
        knobs, model = self.knobs, self.model
        live = len(self.shadows())
        free = [x for x in self.bodies() if x.ready and x.partner is None]
        free.sort(key=lambda x: (max(x.busy_until, now), x.id))
        for x in free:
            if live >= knobs.kappa:
                break
            c_a = self._node_free[x.node]
            if c_a < max(1, knobs.c_max / 4):
                continue
            c = min(c_a, max(1, knobs.c_max // 2))
            best = None
            alone = self._max_rps[x.cores]
            for split in model.splits:  # contiguous blocks, growing, in sensitivity order
                mem = (model.body_bytes + split.bytes) / model.body_bytes
                paired = max((b / self._best_split(split, x.cores, c, b)[1] for b in range(2, knobs.b_max + 1)
                              if self._best_split(split, x.cores, c, b)[1] <= knobs.slo_s), default=0.0)
                if paired <= alone:
                    continue  # the pair would not raise the body's rate (module docstring)
                for b in range(knobs.b_max, 1, -1):
                    _, t = self._best_split(split, x.cores, c, b)
                    if split.load_s + t <= knobs.slo_s:
                        eta = _eta(b, t, x.cores + c, mem * self.rho_m)
                        if best is None or eta > best[0]:
                            best = (eta, split)
                        break
            if best is None:
                continue
            shadow = self._new(x.node, c, "shadow", now, loads=[best[1].block], split=best[1])
            shadow.partner, x.partner = x.id, shadow.id
            live += 1

    def _release_shadows(self, now: float) -> float:
        """Release shadows once the burst has passed; returns when to look again."""
        wake = _INF
        if len(self._queue) >= self.knobs.gamma:
            return wake
        idle_for = self.knobs.shadow_idle_s
        candidates = []
        for s in self.shadows():
            if s.partner in self._reserved or not s.ready:
                continue
            if now - s.last_used >= idle_for:
                life = max(now - s.added, 1e-9)
                candidates.append((s.rows_total / life / s.cores, s.id, s))
            else:
                wake = min(wake, s.last_used + idle_for)
        for _, _, s in sorted(candidates, key=lambda c: c[:2]):
            body = self._inst.get(s.partner)
            if body is not None:
                body.partner = None
            self._drop_instance(s, now)
        return wake

    # -- the policy contract ----------------------------------------------------------
    def admits(self, model: str) -> bool:
        return len(self._queue) < self.knobs.max_queue

    def queue_depth(self) -> int:
        return len(self._queue)

    def on_arrival(self, request: Request, now: float) -> None:
        if request.model != self.model.name:
            raise KeyError(f"this AsyFunc policy serves {self.model.name}, not {request.model}")
        if request.length > self.model.seq:
            raise ValueError(f"length {request.length} exceeds the served bucket {self.model.seq}")
        if len(self._queue) >= self.knobs.max_queue:
            raise OverflowError(f"queue of {request.model!r} is full ({self.knobs.max_queue})")
        self._queue.append(request)
        self._arrivals_period += 1

    def withdraw(self, request_id: int, now: float) -> bool:
        for r in self._queue:
            if r.id == request_id:
                self._queue.remove(r)
                return True
        return False

    def on_workers(self, workers: Sequence[WorkerView], now: float) -> None:
        pass  # the policy plans every placement itself; on_placement tells it when each is done

    def on_placement(self, change: PlacementChange, ok: bool, seconds: float, now: float) -> None:
        """A failed add or load gives the instance up: a shadow is unpaired and released, and no
        shadow is planned for ``shadow_idle_s`` (a load that keeps failing must not churn
        workers through a burst); a body is removed (the next period's MLS provisions again if
        the rate needs it)."""
        x = self._inst.get(change.worker)
        if x is None or change.action not in ("add_worker", "load"):
            return
        if not ok:
            self.failed_placements += 1
            if x.kind == "shadow":
                self._no_shadow_until = now + self.knobs.shadow_idle_s
            partner = self._inst.get(x.partner) if x.partner is not None else None
            if partner is not None:
                partner.partner = None
                if x.kind == "body":  # its shadow has no body to serve
                    self._drop_instance(partner, now)
            self._drop_instance(x, now)
            return
        if change.action == "load" and x.loads and x.loads[0] == change.stage:
            x.loads.pop(0)
        if change.action == "load" and not x.loads:
            x.ready = True
            x.last_used = now

    def metrics(self):
        """Cores, parameter bytes and instances held now, by kind (the ledger's), the split
        batches and failed placements so far, and the prices: the scale and per-step overhead
        planned with, and the tracker's current measurement of each (:class:`PriceTracker`)."""
        for kind in ("body", "shadow"):
            cores, nbytes = self.ledger.held(kind)
            yield "asyfunc_cores", {"kind": kind}, float(cores)
            yield "asyfunc_param_bytes", {"kind": kind}, float(nbytes)
            yield "asyfunc_instances", {"kind": kind}, float(sum(x.kind == kind for x in self._inst.values()))
        yield "asyfunc_split_batches", {}, float(self.splits_done)
        yield "asyfunc_failed_placements", {}, float(self.failed_placements)
        yield "asyfunc_price_scale", {}, float(self.model.scale)
        yield "asyfunc_step_overhead_seconds", {}, float(self.model.step_overhead_s)
        yield "asyfunc_reprices", {}, float(self.reprices)
        yield "asyfunc_measured_scale", {}, float(self.prices.scale)
        yield "asyfunc_measured_step_overhead_seconds", {}, float(self.prices.overhead_s)
        yield "asyfunc_measured_price_sigma", {}, float(self.prices.sigma)
        yield "asyfunc_measured_steps", {}, float(self.prices.steps)

    def service_time(self, batch: Batch) -> float:
        x = self._inst.get(batch.instance)
        cores = x.cores if x is not None else self.knobs.c_max
        return self.model.step_seconds(batch.stage, cores, batch.cell.batch)

    def on_completion(self, batch: Batch, now: float, summaries: Mapping[int, StepSummary] | None = None) -> None:
        group = self._groups.get(batch.request_ids[0])
        if group is None:
            return
        group.running -= 1
        if group.running == 0 and not group.steps:
            for r in group.rows:
                del self._groups[r]
            self._reserved.discard(group.body)

    def plan(self, now: float, idle_instances: Sequence[int]) -> Plan:
        placement: list[PlacementChange] = []
        for wid in self._to_remove:
            placement.append(PlacementChange("remove_worker", wid))
        self._to_remove.clear()
        while now >= self._next_period:
            self._adapt(now)
            self._next_period += self.knobs.period_s
        idle = set(idle_instances)
        known = set(self._inst)
        loading = {x.id for x in self._inst.values() if not x.ready}
        batches: list[Batch] = []
        # steps of split batches in flight come first: their bodies wait for them
        for group in {id(g): g for g in self._groups.values()}.values():
            if group.running == 0 and group.steps and group.body in idle and (
                    group.steps[0] != "par" or group.shadow in idle):
                batches += self._next_steps(group, now, idle)
        evict: list[int] = []
        wake = _INF
        if self.variant == "asyfunc-batch":
            wake = self._dispatch_batch(now, (idle - loading) & known, batches, evict)
        else:
            self._dispatch_adaptive(now, (idle - loading) & known, batches, evict)
        # LLS looks at what still waits once every idle unit took its batch (module docstring)
        if self.lls and len(self._queue) >= self.knobs.gamma:
            self._scale_up_shadows(now)
        # the next period's MLS needs no wake-up of its own when nothing waits: the next arrival
        # runs it (and any period it skipped, with no arrivals), so a finished run ends
        busy = self._queue or self._groups or any(not x.ready for x in self._inst.values())
        wake = min(wake, self._next_period if busy else _INF, self._release_shadows(now) if self.lls else _INF)
        for wid in self._to_remove:
            placement.append(PlacementChange("remove_worker", wid))
        self._to_remove.clear()
        for x in list(self._inst.values()):  # new workers, and the next load of each idle loading one
            if x.ready:
                continue
            if x.id not in self._added:
                self._added.add(x.id)
                placement.append(PlacementChange("add_worker", x.id))
            elif x.id in idle and x.loads:
                placement.append(PlacementChange("load", x.id, x.loads[0]))
        if self._queue:
            wake = min(wake, math.nextafter(self._queue[0].deadline - self._t1, _INF))
        if wake <= now:
            wake = math.nextafter(now, _INF)
        return Plan(tuple(batches), tuple(evict), wake, placement=tuple(placement))

    # -- dispatch -----------------------------------------------------------------------
    def _units(self, idle: set[int]) -> list[_Instance]:
        """Idle ready bodies free for a new batch, smallest first (Alg. 3's X)."""
        xs = [self._inst[w] for w in idle if w in self._inst]
        xs = [x for x in xs if x.kind == "body" and x.ready and x.id not in self._reserved]
        return sorted(xs, key=lambda x: (x.cores, x.id))

    def _pair_of(self, x: _Instance, idle: set[int]) -> _Instance | None:
        s = self._inst.get(x.partner) if x.partner is not None else None
        return s if s is not None and s.ready and s.id in idle else None

    def _options(self, x: _Instance, b: int, idle: set[int]) -> list[tuple[float, int]]:
        """(modelled latency, b_B) of ``b`` rows on body ``x``, smallest unit first: the body
        alone (b_B == b), then split with its idle shadow where that is faster."""
        t = self.model.step_seconds(None, x.cores, b)
        s = self._pair_of(x, idle)
        if s is None or b < 2:
            return [(t, b)]
        b_body, t_split = self._best_split(s.split, x.cores, s.cores, b)
        return [(t, b), (t_split, b_body)] if t_split < t else [(t, b)]

    def _latency(self, x: _Instance, b: int, idle: set[int]) -> tuple[float, int]:
        """The fastest of :meth:`_options`."""
        return min(self._options(x, b, idle))

    def _evict_hopeless(self, now: float, evict: list[int]) -> None:
        t1 = self._t1
        while self._queue and now + t1 > self._queue[0].deadline:
            evict.append(self._queue.popleft().id)

    def _dispatch_adaptive(self, now: float, idle: set[int], batches: list[Batch], evict: list[int]) -> None:
        """Alg. 3: all of the queue (up to b_max) to the smallest idle unit that meets the head's
        deadline, a body alone before its body-shadow pair (module docstring, **Smallest
        first**); if none does, the largest batch that still makes it on the largest one, split
        where that is faster."""
        self._evict_hopeless(now, evict)
        units = self._units(idle)
        while self._queue and units:
            b = min(len(self._queue), self.knobs.b_max)
            head = self._queue[0].deadline
            chosen = None
            for x in units:
                for t, b_body in self._options(x, b, idle):
                    if now + t <= head:
                        chosen = (x, b, b_body, t)
                        break
                if chosen is not None:
                    break
            if chosen is None:  # none meets it: shrink on the largest unit (module docstring)
                x = units[-1]
                k = b - 1
                while k >= 1:
                    t, b_body = self._latency(x, k, idle)
                    if now + t <= head:
                        break
                    k -= 1
                if k == 0:
                    evict.append(self._queue.popleft().id)
                    continue
                chosen = (x, k, b_body, t)
            x, b, b_body, t = chosen
            units.remove(x)
            batches += self._start(x, b, b_body, t, now, idle)

    def _dispatch_batch(self, now: float, idle: set[int], batches: list[Batch], evict: list[int]) -> float:
        """BATCH's buffer: full (b_max) or the oldest has waited its timeout; lowest id first."""
        self._evict_hopeless(now, evict)
        units = sorted(self._units(idle), key=lambda x: x.id)
        while self._queue and units:
            full = len(self._queue) >= self.knobs.b_max
            due = self._queue[0].arrival + self._batch_wait
            if not full and now < due:
                return due
            x = units.pop(0)
            b = min(len(self._queue), self.knobs.b_max)
            batches += self._start(x, b, b, self.model.step_seconds(None, x.cores, b), now, idle)
        return _INF

    def _start(self, x: _Instance, b: int, b_body: int, t: float, now: float, idle: set[int]) -> list[Batch]:
        rows = tuple(self._queue.popleft().id for _ in range(b))
        x.busy_until = now + t
        x.last_used = now
        x.rows_period += b
        x.rows_total += b
        idle.discard(x.id)
        if b_body >= b:
            return [Batch(rows, self.model.name, self.model.cell(b), x.id, None, final=True)]
        s = self._inst[x.partner]
        s.last_used = now
        s.rows_total += b - b_body
        blk = s.split.block
        steps = (["pre"] if blk.start > 0 else []) + ["par"] + (["post"] if blk.stop < self.model.num_layers else [])
        group = _Group(rows, x.id, s.id, s.split, b_body, steps)
        for r in rows:
            self._groups[r] = group
        self._reserved.add(x.id)
        self.splits_done += 1
        return self._next_steps(group, now, idle)

    def _next_steps(self, group: _Group, now: float, idle: set[int]) -> list[Batch]:
        """The batches of the group's next phase (module docstring: the three steps)."""
        model, blk = self.model, group.split.block
        phase = group.steps.pop(0)
        name = model.name
        idle.discard(group.body)
        if phase == "pre":
            out = [Batch(group.rows, name, model.cell(len(group.rows)), group.body, model.pre(blk), final=False)]
        elif phase == "par":
            final = not group.steps
            mine, theirs = group.rows[:group.b_body], group.rows[group.b_body:]
            out = [Batch(mine, name, model.cell(len(mine)), group.body, blk, final=final),
                   Batch(theirs, name, model.cell(len(theirs)), group.shadow, blk, final=final)]
            idle.discard(group.shadow)
            shadow = self._inst.get(group.shadow)
            if shadow is not None:
                shadow.last_used = now
        else:
            out = [Batch(group.rows, name, model.cell(len(group.rows)), group.body, model.post(blk), final=True)]
        group.running = len(out)
        return out


# The paper's transfer between a body and its shadow on one node: shared memory, 0.32 ms per MB
# written and read (§6). The default here, since LLS places a shadow on its body's node.
SHARED_MEMORY_BYTES_PER_S = 1e6 / 0.32e-3


def model_from_layers(raw: Mapping, name: str, batch_sizes: Sequence[int] = (1, 2, 4, 8),
                      body_start_s: float = 0.0, shadow_start_s: float = 0.0, transfer_hop_s: float = 0.0,
                      transfer_bytes_per_s: float = SHARED_MEMORY_BYTES_PER_S) -> AsyFuncModel:
    """The :class:`AsyFuncModel` of ``name`` from a layer file's contents (``jaxserve profile
    --layers``: ``{"models": {name: {"num_layers", "seq", "param_bytes", "load_s", "row_bytes",
    "splits": [{start, stop, bytes, load_s}], "latency": {cores: {profile: {batch: s}}}}}}``).
    ``body_start_s``: what a new body pays before loading (a cold worker; the paper's container
    start), added to the model's load time; ``shadow_start_s``: what a shadow pays besides its
    block's parameters (its executables' load), added to each split's."""
    if name not in raw.get("models", {}):
        raise KeyError(f"the layer profile has {sorted(raw.get('models', {}))}, not {name!r}: "
                       f"jaxserve profile --layers --model {name}")
    p = raw["models"][name]
    L, seq = int(p["num_layers"]), int(p["seq"])
    latency = {int(c): CostModel({label: LatencyProfile(label, {Cell(int(b), seq): float(t) for b, t in ts.items()})
                                  for label, ts in stages.items()})
               for c, stages in p["latency"].items()}
    splits = tuple(SplitOption(Stage(name, int(s["start"]), int(s["stop"]), L), int(s["bytes"]),
                               shadow_start_s + float(s["load_s"])) for s in p["splits"])
    grid = ShapeGrid(tuple(batch_sizes), (seq,) if seq else ())
    return AsyFuncModel(name, L, grid, seq, latency, int(p["param_bytes"]), body_start_s + float(p["load_s"]),
                        splits, float(p["row_bytes"]), transfer_hop_s, transfer_bytes_per_s)
