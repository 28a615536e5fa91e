"""Workers: what holds stages (weights plus their warmed executables) and runs steps.

A :class:`Worker` runs one :class:`Step` at a time (``submit`` queues behind the one
running) and reports what it holds (:class:`Holdings`) and how long it has been busy.
The engine keeps the placement (which worker holds which stages) and decides, through
its policy, what runs where; a worker only does what it is told.

Two implementations share this interface: :class:`ThreadWorker` (in-process: one
thread, the runners of the process's own warmed runtimes, so a whole model or stage is
held by reference and activations stay on the device between a worker's steps) and
``jaxserve.ray_workers.RayWorker`` (a Ray actor in its own process, possibly on
another node, with its own weights and compile cache).

A *runner* is what executes the steps of one (model, stage): a whole-model runtime
(:class:`~jaxserve.runtime.ModelRuntime`, ``execute(cell, payloads, tasks)``) or a
stage runtime (:class:`~jaxserve.stages.StageRuntime`, ``execute(cell, payloads,
tasks, carry)``). :func:`run_step` runs either and returns a :class:`StepOutput`.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jaxserve.sched.base import Cell, Stage, StepSummary


@dataclass(frozen=True, eq=False)
class Step:
    """One unit of work: run ``cell`` of ``stage`` (a layer range of ``stage.model``; a
    whole model is the full range) on a batch. The first stage (and a whole model)
    takes ``payloads`` (token ids or images) and ``tasks``; a later stage takes
    ``carry``, the activations its predecessor produced (:func:`gather_carry`: an
    :class:`~jaxserve.stages.Activations`, a :class:`StoredCarry` or a :class:`CarryParts`)."""

    stage: Stage
    cell: Cell
    payloads: tuple = ()
    tasks: tuple[str, ...] = ()
    carry: Any = None  # jaxserve.stages.Activations


@dataclass
class StepOutput:
    """A step's result: ``items`` (one dict per real row, as an answer holds them) from a
    last stage or whole model, else ``carry`` for the next stage: the activations
    themselves (a worker in this process) or a :class:`StoredCarry` (a worker in its own
    process, whose activations stay out of the driver)."""

    items: list[dict] | None
    carry: Any
    compute_seconds: float


@dataclass(frozen=True, eq=False)
class StoredCarry:
    """Activations a step left where it ran instead of sending them to the driver: ``ref``
    names them in Ray's object store (host arrays, for a step on another worker), and the
    worker that made them keeps its own copy (device arrays) under ``token``, so its next
    step on them moves nothing. ``holder``: that worker's identity (``RayWorker.uid``,
    restart generation). ``count``: their real rows, as :class:`~jaxserve.stages.Activations`."""

    ref: Any
    count: int
    holder: tuple[int, int]
    token: int


@dataclass(frozen=True)
class CarryParts:
    """A later step's activations as the rows to take from each source, gathered where the
    step runs: ``parts`` are (source, rows) with ``source`` an
    :class:`~jaxserve.stages.Activations` or a :class:`StoredCarry` and ``rows`` its real rows
    in order (None: all of them, as they are). Made by :func:`gather_carry` when a source is
    stored; the step's worker resolves it (:meth:`gather`)."""

    parts: tuple[tuple[Any, tuple[int, ...] | None], ...]

    @property
    def count(self) -> int:
        return sum(src.count if rows is None else len(rows) for src, rows in self.parts)

    def gather(self, resolve: Callable[[Any], Any] | None = None) -> Any:
        """The activations: each part's source (``resolve(source)`` for a stored one), its
        rows taken, concatenated in order (a single whole part: the source as it is)."""
        from jaxserve.stages import Activations

        def source(src: Any) -> Any:
            if isinstance(src, StoredCarry):
                if resolve is None:
                    raise TypeError("stored activations reach only a worker that can read Ray's object store")
                return resolve(src)
            return src

        if len(self.parts) == 1 and self.parts[0][1] is None:
            return source(self.parts[0][0])
        taken = [(s if rows is None else s.rows(list(rows))) for s, rows in
                 ((source(src), rows) for src, rows in self.parts)]
        return taken[0] if len(taken) == 1 else Activations.concat(taken)


def local_carry(carry: Any) -> Any:
    """``carry`` as activations in this process: a :class:`StoredCarry` (or a
    :class:`CarryParts` naming one) is read from Ray's object store; anything else is
    returned as it is. For a caller that computes on a Ray worker's activations itself (an
    in-process :class:`~jaxserve.asyfunc_exec.Body` merging its shadow's rows)."""
    if isinstance(carry, StoredCarry):
        carry = CarryParts(((carry, None),))
    if isinstance(carry, CarryParts):
        import ray

        return carry.gather(lambda src: ray.get(src.ref))
    return carry


def gather_carry(pairs: Sequence[tuple[Any, int]]) -> Any:
    """The carry of a step whose rows come from ``pairs``: (activations or
    :class:`StoredCarry`, row) per request, in the step's order. The same source's rows all
    in order: that source as it is (no copy; on the device for a worker's own activations).
    Else consecutive rows of one source form one part: gathered here into one
    :class:`~jaxserve.stages.Activations` when every source is in this process, else a
    :class:`CarryParts` the step's worker gathers (stored activations never pass through
    the driver)."""
    source = pairs[0][0]
    if all(s is source for s, _ in pairs) and [r for _, r in pairs] == list(range(source.count)):
        return source
    parts: list[tuple[Any, list[int]]] = []
    for src, row in pairs:
        if parts and parts[-1][0] is src:
            parts[-1][1].append(row)
        else:
            parts.append((src, [row]))
    recipe = CarryParts(tuple((src, tuple(rows)) for src, rows in parts))
    return recipe if any(isinstance(src, StoredCarry) for src, _ in parts) else recipe.gather()


@dataclass(frozen=True)
class Holdings:
    """What a worker holds: its stages, their parameter bytes and warmed executables, and
    (a worker in its own process) the compilations its process made, as of its last load
    (None: it shares the driver's process, whose count is the driver's)."""

    stages: frozenset[Stage]
    param_bytes: int
    executables: int
    compilations: int | None = None


class WorkerDied(RuntimeError):
    """The worker's process is gone (a Ray actor killed or crashed): its steps never ran
    to the end, and it must be restarted before it runs another."""


def summarize(items: Sequence[Mapping[str, Any]] | None, count: int) -> list[StepSummary]:
    """The per-request summary a policy gets of a step: top probability, label and
    probabilities for a classification, empty otherwise (``count`` rows); for a cascade
    level (an item with ``_next``, the next models' inputs) their lengths and the tokens
    pruned from them."""
    if items is None:
        return [StepSummary()] * count
    out = []
    for item in items:
        probs = item.get("probabilities")
        if probs is None:
            out.append(StepSummary())
            continue
        nxt = item.get("_next")
        lengths = () if nxt is None else tuple((m, len(p.ids)) for m, p in nxt.items())
        out.append(StepSummary(float(np.max(probs)), str(item.get("label")), tuple(float(x) for x in probs),
                               lengths, int(item.get("pruned_tokens", 0))))
    return out


def runner_param_bytes(runner: Any) -> int:
    """Bytes of a runner's parameters (the arrays of its weights pytree)."""
    explicit = getattr(runner, "param_bytes", None)
    if callable(explicit):
        return int(explicit())
    import jax

    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree_util.tree_leaves(runner.weights)))


def runner_executables(runner: Any) -> int:
    """Warmed executables of a runner (its polymorph table's cells)."""
    return len(runner.table.servable.grid.cells())


def run_step(runner: Any, step: Step) -> StepOutput:
    """Execute ``step`` on ``runner`` (a whole-model runtime or a stage runtime)."""
    if step.stage.whole and not hasattr(runner, "stage"):
        out = runner.execute(step.cell, list(step.payloads), list(step.tasks))
        return StepOutput(out.items, None, out.compute_seconds)
    carry = step.carry.gather() if isinstance(step.carry, CarryParts) else step.carry
    res = runner.execute(step.cell, list(step.payloads), list(step.tasks), carry)
    return StepOutput(res.items, res.carry, res.compute_seconds)


class Worker(ABC):
    """One worker: holds stages, runs steps one at a time, in submission order."""

    kind = "worker"  # what /metrics calls it ("thread", "ray")

    def __init__(self, worker_id: int):
        self.id = worker_id
        self._busy = 0.0
        self._lock = threading.Lock()

    @abstractmethod
    def submit(self, step: Step) -> Future:
        """Queue ``step``; the future resolves to its :class:`StepOutput`, or raises
        (:class:`WorkerDied` when the worker's process is gone)."""

    @abstractmethod
    def holdings(self) -> Holdings:
        """What the worker holds now."""

    @abstractmethod
    def load(self, stage: Stage) -> Future:
        """Load ``stage`` (its parameters and executables, from the compile cache; never
        a compile at request time if warmup filled the cache); resolves to the seconds
        it took. Loading a stage already held resolves at once."""

    @abstractmethod
    def unload(self, stage: Stage) -> None:
        """Drop ``stage``: its steps may no longer be submitted here."""

    @abstractmethod
    def restart(self) -> Future:
        """Replace the worker's execution context (thread, or actor process) and reload
        what it held; resolves to the seconds it took. Steps queued on the old one fail."""

    @abstractmethod
    def close(self) -> None:
        """Release the worker; nothing may be submitted afterwards."""

    def reload_assets(self) -> Future:
        """Re-read the task assets (heads, prompts) of the models it holds from where they
        were loaded, as the driver just did (``jaxserve.launch.reload_assets``); resolves
        when they serve. Default: done at once (an in-process worker shares the driver's
        runtimes, so the driver's swap is already its own)."""
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @property
    def alive(self) -> bool:
        return True

    @property
    def busy_seconds(self) -> float:
        """Seconds spent computing steps so far."""
        with self._lock:
            return self._busy

    def _add_busy(self, seconds: float) -> None:
        with self._lock:
            self._busy += seconds

    def stages(self) -> frozenset[Stage]:
        return self.holdings().stages

    def holds(self, stage: Stage) -> bool:
        return stage in self.holdings().stages


class ThreadWorker(Worker):
    """An in-process worker: one thread running steps on runners it holds by reference.

    ``catalog(stage)`` returns the runner of a stage in this process (building a stage
    runtime from the compile cache when asked for the first time); :meth:`load` times
    it. XLA releases the GIL while it computes, so thread workers compute in parallel
    and the event loop never blocks.
    """

    kind = "thread"

    def __init__(self, worker_id: int, catalog: Callable[[Stage], Any], stages: Sequence[Stage] = ()):
        super().__init__(worker_id)
        self._catalog = catalog
        self._runners: dict[Stage, Any] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"jaxserve-worker-{worker_id}")
        for stage in stages:
            self._runners[stage] = catalog(stage)

    def submit(self, step: Step) -> Future:
        runner = self._runners.get(step.stage)
        if runner is None:
            raise KeyError(f"worker {self.id} does not hold {step.stage.label()}")

        def work() -> StepOutput:
            t0 = time.perf_counter()
            try:
                return run_step(runner, step)
            finally:
                self._add_busy(time.perf_counter() - t0)

        return self._pool.submit(work)

    def holdings(self) -> Holdings:
        runners = dict(self._runners)
        return Holdings(frozenset(runners), sum(runner_param_bytes(r) for r in runners.values()),
                        sum(runner_executables(r) for r in runners.values()))

    def load(self, stage: Stage) -> Future:
        fut: Future = Future()
        if stage in self._runners:
            fut.set_result(0.0)
            return fut

        def work() -> float:
            t0 = time.perf_counter()
            self._runners[stage] = self._catalog(stage)
            return time.perf_counter() - t0

        return self._pool.submit(work)

    def unload(self, stage: Stage) -> None:
        self._runners.pop(stage, None)

    def restart(self) -> Future:
        old = self._pool
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"jaxserve-worker-{self.id}")
        old.shutdown(wait=False)
        fut: Future = Future()
        fut.set_result(0.0)  # the runners live in this process and were never lost
        return fut

    def close(self) -> None:
        self._pool.shutdown(wait=True)
