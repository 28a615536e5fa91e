"""The contract between policies, the live engine and the simulator.

A policy sees requests, a clock value and a cost model, and returns a :class:`Plan`.
It never reads the wall clock, never imports JAX and never starts a thread: that is
what lets the simulator drive the very same objects at 1000-instance scale, and what
makes policies testable in microseconds (DESIGN.md, "jaxserve/sched/").

Times are seconds on the caller's clock (``time.monotonic()`` in the engine, a
virtual clock in the simulator).
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left, insort
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence


@dataclass(frozen=True, order=True)
class Cell:
    """One polymorph: the static shape an executable was compiled for.

    ``seq`` is the sequence-length bucket (text models; 0 for images) and ``gamma``
    the OTAS token-count variant (images; 0 = the vanilla model).
    """

    batch: int
    seq: int = 0
    gamma: int = 0

    def label(self) -> str:
        return f"b{self.batch}_s{self.seq}_g{self.gamma}"


@dataclass(frozen=True, order=True)
class Stage:
    """A contiguous layer range of one model: layers [start, stop) of ``num_layers``.

    The first stage also holds the embeddings, the last one the pooling and head; the
    whole model is the one-stage case (``Stage(model, 0, L, L)``). Plain data, so
    policies can plan pipelines without importing JAX (jaxserve.stages compiles them).
    """

    model: str
    start: int
    stop: int
    num_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop <= self.num_layers:
            raise ValueError(f"stage [{self.start}:{self.stop}] is not a layer range of a "
                             f"{self.num_layers}-layer model")

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.stop == self.num_layers

    @property
    def whole(self) -> bool:
        return self.first and self.last

    def label(self) -> str:
        return f"{self.model}[{self.start}:{self.stop}]"


@dataclass(frozen=True)
class Request:
    """What a policy knows about one request."""

    id: int
    arrival: float
    model: str
    task: str = ""
    length: int = 0  # tokens, for text; 0 for images
    deadline: float = math.inf  # absolute time on the caller's clock
    utility: float = 1.0
    seed: int = 0  # what a randomised policy's per-request draws derive from (Tabi's rerouting)


@dataclass(frozen=True)
class Batch:
    """A decision: run one step of these requests together on worker ``instance``.

    A step runs executable ``cell`` of ``model``, or of one of its layer ranges
    (``stage``; None: the whole model). ``final``: the step's outputs answer its
    requests. A non-final step (a pipeline stage before the last, the small model of a
    cascade) leaves each request *held*: its outputs are kept (the activations, for the
    next stage; the answer, for a cascade that may stop here), and the policy later
    either plans a next step for it, finishes it with those outputs (``Plan.finish``)
    or evicts it. A step of a stage after the first takes the activations its
    requests' previous step produced; every other step takes the request's input.
    """

    request_ids: tuple[int, ...]
    model: str
    cell: Cell
    instance: int = 0
    stage: Stage | None = None
    final: bool = True


@dataclass(frozen=True)
class StepSummary:
    """The small per-request summary of a step's outputs a policy gets on completion
    (a cascade decides from it whether to go on): a classifier's top probability, label
    and probabilities; None for steps that produce no classification (embeddings,
    activations). A cascade level's step also says how long the next models' inputs are
    (``next_lengths``: (model, tokens) pairs, after word pruning) and how many tokens the
    pruning took out (``pruned_tokens``)."""

    top_probability: float | None = None
    label: str | None = None
    probabilities: tuple[float, ...] | None = None
    next_lengths: tuple[tuple[str, int], ...] = ()
    pruned_tokens: int = 0


@dataclass(frozen=True, order=True)
class PlacementChange:
    """A change of which worker holds what, planned by a policy and carried out by the
    engine (asynchronously: the policy hears of it through ``Policy.on_placement``).
    Ordered (action, worker, stage), so that changes due at the same time in the
    simulator's event heap compare instead of raising.

    ``action``: ``"add_worker"`` (a new worker with id ``worker``; ``stage`` None),
    ``"remove_worker"`` (after its running step finishes), ``"load"`` (the worker
    loads ``stage``'s parameters and executables) or ``"unload"``.
    """

    action: str
    worker: int
    stage: Stage | None = None

    def __post_init__(self) -> None:
        if self.action not in ("add_worker", "remove_worker", "load", "unload"):
            raise ValueError(f"unknown placement action {self.action!r}")
        if (self.stage is None) != (self.action in ("add_worker", "remove_worker")):
            raise ValueError(f"{self.action!r} {'takes no' if self.stage is not None else 'needs a'} stage")


@dataclass(frozen=True)
class Plan:
    """What a policy wants done now.

    ``evict`` lists requests the policy gives up on (their deadline can no longer be
    met); the engine answers each of them with outcome ``evicted``. ``finish`` lists
    held requests (after a non-final step) to answer with their last step's outputs.
    ``placement``: workers to add or remove, stages to load or unload. ``wake_at`` is
    the latest time the caller must ask again even if nothing arrives or completes
    (for example when the oldest request's slack runs out).
    """

    batches: tuple[Batch, ...] = ()
    evict: tuple[int, ...] = ()
    wake_at: float = math.inf
    finish: tuple[int, ...] = ()
    placement: tuple[PlacementChange, ...] = ()


@dataclass(frozen=True)
class WorkerView:
    """What a policy may know of one worker: the stages it holds (a whole model is
    ``Stage(m, 0, L, L)``) and whether it is idle now."""

    id: int
    stages: frozenset[Stage]
    idle: bool


class IdleInstances(list):
    """The idle workers' ids in increasing order, and which of them joined since the last plan.

    The simulator hands :meth:`Policy.plan` one of these (the engine a plain tuple). To any
    policy it is the sequence of idle ids. A policy that keeps a queue per instance may use it
    to look only at the instances that can have changed since its last plan, not at every idle
    one at every event: at 1,000 simulated instances some 300 are idle at each of about two
    events per request, and that scan was most of a plan's time. The contract, which the
    simulator keeps:

    * the ids are in increasing order, as the engine's are (:meth:`holds` bisects);
    * ``joined`` holds every id added since the previous ``plan`` call made with this object
      (ids that joined and left again may stay in it);
    * ``calls`` counts the ``plan`` calls made with it before the current one. A policy that
      remembers the object and the count it expects next knows whether it saw every call in
      between. If it did not, it must look at every id.

    The caller changes it only through :meth:`join`, :meth:`leave` and :meth:`planned`.
    """

    __slots__ = ("joined", "calls")

    def __init__(self, ids: Iterable[int] = ()) -> None:
        super().__init__(sorted(ids))
        self.joined: set[int] = set(self)
        self.calls = 0

    def join(self, worker: int) -> None:
        """``worker`` is idle now (it must not be already)."""
        insort(self, worker)
        self.joined.add(worker)

    def leave(self, worker: int) -> None:
        """``worker`` is no longer idle; ValueError if it was not idle."""
        i = bisect_left(self, worker)
        if i == len(self) or self[i] != worker:
            raise ValueError(f"worker {worker} is not idle")
        del self[i]

    def holds(self, worker: int) -> bool:
        """Whether ``worker`` is idle (a bisection, where ``in`` scans)."""
        i = bisect_left(self, worker)
        return i < len(self) and self[i] == worker

    def planned(self) -> None:
        """A ``plan`` call with this object has returned: start the next ``joined``."""
        self.joined.clear()
        self.calls += 1


class Policy:
    """Every hook the engine and the simulator call, always with the current time.

    Subclasses implement :meth:`on_arrival`, :meth:`plan` and :meth:`queue_depth`; the
    other hooks are optional and have their defaults here, so callers never probe for
    them. All calls come from one thread (the engine's event loop, or the simulator).
    """

    def on_arrival(self, request: Request, now: float) -> None:
        """A request arrived. Raise to refuse it (the engine then answers 429/4xx and
        queues nothing of the request)."""
        raise NotImplementedError

    def plan(self, now: float, idle_instances: Sequence[int]) -> Plan:
        """What to run now on the idle workers (``idle_instances``: their ids, in increasing
        order; the simulator's is an :class:`IdleInstances`). Called after every arrival,
        completion, placement change and requested wake-up."""
        raise NotImplementedError

    def queue_depth(self) -> int:
        """Requests the policy holds queued (not running)."""
        raise NotImplementedError

    def on_completion(self, batch: Batch, now: float,
                      summaries: Mapping[int, StepSummary] | None = None) -> None:
        """``batch`` finished (or failed) on its worker. ``summaries``: per request id,
        its step's output summary (None where the step failed or the caller has none,
        as in the simulator without an output model). Default: nothing."""

    def withdraw(self, request_id: int, now: float) -> bool:
        """Forget a request that is still queued or held between steps (its client went
        away): it must never appear in a later plan. True if it was; False if it is
        running, answered or unknown (the caller then lets it run). Default: False."""
        return False

    def admits(self, model: str) -> bool | None:
        """Whether ``model``'s queue has room; None (default): no opinion, the caller's
        own bound (``max_queue``) decides."""
        return None

    def describe_request(self, request_id: int) -> dict:
        """What the policy reports about how a request was served, merged into its answer
        (OTAS: ``gamma`` and ``outcome_type``). Default: {}."""
        return {}

    def metrics(self) -> Iterable[tuple[str, Mapping[str, str], float]]:
        """``(name, labels, value)`` gauges for ``/metrics`` (``jaxserve_policy_<name>``)."""
        return ()

    def service_time(self, batch: Batch) -> float | None:
        """A simulated batch's time when the cost model's price is not it (DT's dynamic
        shapes); None (default): the cost model's."""
        return None

    def reprice(self, cost_model: "CostModel", now: float) -> None:
        """The live engine measured prices other than the profiled ones: plan with
        ``cost_model`` from now on (the profile with each cell times its measured ratio,
        :mod:`jaxserve.cost_drift`; same models and cells). Called on the loop thread between
        plans, never by the simulator. Default: nothing (the policy keeps its start-up prices;
        the engine still measures and reports the drift)."""

    def observe_step(self, batch: Batch, compute_s: float, wall_s: float, now: float) -> None:
        """A live step of ``batch`` is done: ``compute_s`` on its worker's clock, ``wall_s`` from
        its dispatch to its result on the engine's loop. For policies that price steps
        themselves (``service_time``), which the engine's cell-by-cell drift does not cover.
        Called on the loop thread unless the engine's price correction is off; never by the
        simulator. Default: nothing."""

    def on_workers(self, workers: Sequence[WorkerView], now: float) -> None:
        """The workers and what each holds: called once before the first plan and after
        every placement change. Default: nothing (one-stage policies see only ids)."""

    def on_placement(self, change: PlacementChange, ok: bool, seconds: float, now: float) -> None:
        """A planned placement change is done (``ok``) or failed, after ``seconds``
        (a load's time is the parameters' and executables' load). Default: nothing."""


@dataclass(frozen=True)
class LatencyProfile:
    """Profiled compute latency (seconds) of each executable of one model.

    Looking up a cell that was not profiled is an error rather than a guess, except
    through :meth:`latency_for`, which interpolates linearly in batch size inside
    one (seq, gamma) column; that is what a policy uses to price a partial batch.
    """

    model: str
    seconds: Mapping[Cell, float]

    def latency(self, cell: Cell) -> float:
        return self.seconds[cell]

    def cells(self) -> tuple[Cell, ...]:
        return tuple(sorted(self.seconds))

    def latency_for(self, batch: int, seq: int = 0, gamma: int = 0) -> float:
        column = sorted(c.batch for c in self.seconds if c.seq == seq and c.gamma == gamma)
        if not column:
            raise KeyError(f"no profiled cell with seq={seq} gamma={gamma} for {self.model}")
        if batch <= column[0]:
            return self.seconds[Cell(column[0], seq, gamma)]
        for lo, hi in zip(column, column[1:]):
            if lo <= batch <= hi:
                t_lo = self.seconds[Cell(lo, seq, gamma)]
                t_hi = self.seconds[Cell(hi, seq, gamma)]
                return t_lo + (t_hi - t_lo) * (batch - lo) / (hi - lo)
        top = column[-1]
        return self.seconds[Cell(top, seq, gamma)] * batch / top


@dataclass(frozen=True)
class AccuracyProfile:
    """Profiled accuracy per (task, gamma), measured on a held-out profiling split."""

    model: str
    accuracy: Mapping[tuple[str, int], float]

    def of(self, task: str, gamma: int) -> float:
        return self.accuracy[(task, gamma)]


@dataclass(frozen=True)
class CostModel:
    """Everything a policy may know about costs: written by ``jaxserve profile``.

    The engine and the simulator read the same file, so a simulated run prices
    batches exactly as the live engine's policy does.
    """

    latency: Mapping[str, LatencyProfile]
    accuracy: Mapping[str, AccuracyProfile] = field(default_factory=dict)
    machine: str = ""

    def scaled(self, factor: float) -> "CostModel":
        """Every latency times ``factor`` (accuracy unchanged): a profile rescaled to
        another machine speed, or calibrated to what the executables take under load."""
        latency = {n: LatencyProfile(n, {c: t * factor for c, t in p.seconds.items()}) for n, p in self.latency.items()}
        return CostModel(latency=latency, accuracy=self.accuracy, machine=self.machine)

    def to_json(self) -> str:
        return json.dumps(
            {
                "machine": self.machine,
                "latency": {
                    name: [[c.batch, c.seq, c.gamma, t] for c, t in sorted(p.seconds.items())]
                    for name, p in self.latency.items()
                },
                "accuracy": {
                    name: [[task, g, a] for (task, g), a in sorted(p.accuracy.items())]
                    for name, p in self.accuracy.items()
                },
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        raw = json.loads(text)
        latency = {
            name: LatencyProfile(name, {Cell(int(b), int(s), int(g)): float(t) for b, s, g, t in rows})
            for name, rows in raw["latency"].items()
        }
        accuracy = {
            name: AccuracyProfile(name, {(str(task), int(g)): float(a) for task, g, a in rows})
            for name, rows in raw.get("accuracy", {}).items()
        }
        return cls(latency=latency, accuracy=accuracy, machine=raw.get("machine", ""))

    def merged(self, other: "CostModel") -> "CostModel":
        return CostModel(
            latency={**self.latency, **other.latency},
            accuracy={**self.accuracy, **other.accuracy},
            machine=other.machine or self.machine,
        )


def bucket_for_length(length: int, buckets: Iterable[int]) -> int:
    """The smallest bucket that holds ``length`` tokens.

    This is THE bucketing rule: the polymorph table's precompile path, its serving
    path and every policy call it, so what is compiled and what is served can never
    drift apart. Raises ``ValueError`` when no bucket is large enough.
    """
    best = None
    for b in buckets:
        if b >= length and (best is None or b < best):
            best = b
    if best is None:
        raise ValueError(f"length {length} exceeds the largest bucket {max(buckets)}")
    return best


def batch_size_for(count: int, batch_sizes: Iterable[int]) -> int:
    """The smallest allowed batch size that holds ``count`` items (the largest if none does)."""
    sizes = sorted(batch_sizes)
    for s in sizes:
        if s >= count:
            return s
    return sizes[-1]


@dataclass(frozen=True)
class ShapeGrid:
    """The shapes one model serves, declared as data (Saxml style).

    Text models have ``seq_buckets``; image models have none (``seq`` is 0) and may
    have several ``gammas`` (OTAS token-count variants). Every cell of the product
    is compiled at warmup, and :meth:`cell_for` — built on :func:`bucket_for_length`
    and :func:`batch_size_for` — is the only way any caller maps inputs to a cell.
    """

    batch_sizes: tuple[int, ...]
    seq_buckets: tuple[int, ...] = ()
    gammas: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("batch_sizes must be positive and non-empty")
        object.__setattr__(self, "batch_sizes", tuple(sorted(set(self.batch_sizes))))
        object.__setattr__(self, "seq_buckets", tuple(sorted(set(self.seq_buckets))))
        object.__setattr__(self, "gammas", tuple(sorted(set(self.gammas))))

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    @property
    def max_length(self) -> int:
        return self.seq_buckets[-1] if self.seq_buckets else 0

    def cells(self) -> tuple[Cell, ...]:
        seqs = self.seq_buckets or (0,)
        return tuple(Cell(b, s, g) for b in self.batch_sizes for s in seqs for g in self.gammas)

    def cell_for(self, count: int, max_length: int = 0, gamma: int = 0) -> Cell:
        """The cell for ``count`` inputs whose longest has ``max_length`` tokens."""
        if count > self.max_batch:
            raise ValueError(f"{count} inputs exceed the largest batch size {self.max_batch}")
        if gamma not in self.gammas:
            raise ValueError(f"gamma {gamma} is not one of {self.gammas}")
        seq = bucket_for_length(max_length, self.seq_buckets) if self.seq_buckets else 0
        return Cell(batch_size_for(count, self.batch_sizes), seq, gamma)
