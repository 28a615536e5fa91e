"""The live engine: queues, futures, the clock, the workers and their placement.

Requests are stamped on arrival (``time.monotonic``), handed to the policy, and the
policy's :class:`~jaxserve.sched.base.Plan` is carried out: each batch is one *step*
(a cell of a whole model or of a layer range, :class:`~jaxserve.sched.base.Stage`) run
on the worker the policy named (:mod:`jaxserve.workers`: threads in this process, or
Ray actors); evictions are answered ``evicted``; held requests in ``plan.finish`` are
answered with their last step's outputs; placement changes (add or remove a worker,
load or unload a stage) are started and reported back to the policy when done; and
``plan.wake_at`` arms a timer. Completions come back to the loop thread with a
per-request summary of the outputs (``Policy.on_completion``), and trigger the next
plan. Every policy call happens on the loop thread, so policies need no locks and
stay plain Python.

Guarantees (tested through HTTP in tests/integration/test_server.py, and in tests/integration/test_steps.py):

* every accepted item gets exactly one answer: ``ok``, ``late``, ``evicted`` or an error,
  however many steps it takes;
* admission is bounded: past ``max_queue`` queued items a submission is refused with
  :class:`Overloaded` (HTTP 429) before anything is queued, never half-queued;
* a step whose execution raises (or whose worker died) is retried once, on another
  worker that holds its stage if there is one, else on the same worker once it is
  restarted; the failed worker is restarted (``worker_restarts``). If the retry fails
  too its items are answered with an error;
* :meth:`Engine.drain` stops admission and waits for in-flight work (SIGTERM path);
* with a ``cost_model`` (the one the policy was built with), each whole-model step's
  measured time is compared with its cell's profiled price (:mod:`jaxserve.cost_drift`):
  the policy gets the corrected cost model through ``Policy.reprice`` whenever a
  correction moved by more than 5 %, and a model whose prices are off by more than 30 %
  either way is logged as a warning (once per crossing), saying how to re-profile;
* :meth:`Engine.withdraw` takes back items whose client went away while they were
  queued or held between steps: the policy forgets them, they never run again, and
  their futures are cancelled (outcome ``withdrawn``). Items already running finish;
  their answers go nowhere.

Between steps a request's activations stay where its step left them
(:func:`~jaxserve.workers.gather_carry`): when the next step runs the same rows in the
same order, the previous step's arrays are passed on as they are (on the device, for a
thread worker, or for the Ray actor that made them); otherwise its rows are gathered. A
Ray step's activations never come to this process: they wait in Ray's object store, and
the next step's actor takes its rows from there.
A later stage's cell must have its predecessor's sequence bucket and gamma (the
activations' shape); its batch size may differ.

A crash that kills the whole process (a native fault in XLA) is outside what a
thread can catch; run the server under a supervisor (systemd, Kubernetes) for that,
or run the workers as Ray actors, whose deaths the engine survives.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from jaxserve.compile_cache import compile_count
from jaxserve.cost_drift import WARN_RATIO, CostDrift
from jaxserve.runtime import ModelRuntime
from jaxserve.sched.base import Batch, CostModel, PlacementChange, Plan, Policy, Request, Stage, WorkerView
from jaxserve.workers import Step, StepOutput, ThreadWorker, Worker, gather_carry, summarize

log = logging.getLogger("jaxserve.engine")

DRAIN_WINDOW_S = 5.0  # the recent past over which the queue's drain rate is measured (Retry-After)


class Overloaded(RuntimeError):
    """The bounded queue is full: answer 429 and ask the client to retry later."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Draining(RuntimeError):
    """The engine is shutting down and admits nothing new (HTTP 503)."""


class TooManyItems(ValueError):
    """One submission holds more items than the queue can ever hold: no retry can succeed
    (HTTP 413, not 429)."""


class ExecutionFailed(RuntimeError):
    """A step failed twice (or its request was finished with no answer to give); its
    items are answered with this error."""


@dataclass(frozen=True)
class Item:
    """One input of a request, as the engine queues it."""

    model: str
    payload: Any  # token ids (text) or a float32 [H, W, C] image
    length: int = 0
    task: str = ""
    slo_ms: float | None = None
    utility: float = 1.0
    seed: int = 0  # the request's part of a randomised policy's draws (Tabi's rerouting)


@dataclass
class Answer:
    outputs: dict[str, Any]
    outcome: str  # "ok", "late" or "evicted"
    cell: str = ""
    batch_size: int = 0
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    latency_ms: float = 0.0  # arrival stamp to answer: queue + compute + hand-off back to the event loop


@dataclass
class _Pending:
    item: Item
    request: Request
    future: asyncio.Future
    carry: Any = None  # (activations or StoredCarry, row) after a non-final step of a stage that is not the last
    outputs: dict | None = None  # the answer a non-final step produced (a cascade may finish with it)
    cell: str = ""  # the last step's cell and batch size, for the answer
    batch_size: int = 0
    first_start: float | None = None  # when its first step started
    compute_s: float = 0.0  # summed over its steps


@dataclass
class EngineStats:
    outcomes: Counter = field(default_factory=Counter)
    batches: int = 0
    worker_restarts: int = 0
    retries: int = 0
    steps: int = 0  # steps run, final or not (batches counts the final ones too)
    # the last stage loads (placement changes): (stage label, worker, seconds); stage_load_count counts all
    stage_loads: deque = field(default_factory=lambda: deque(maxlen=1000))
    stage_load_count: int = 0
    placement_failures: int = 0
    # called on the loop thread after each successful step: (batch, output, pendings, seconds since start)
    observers: list[Callable[[Batch, StepOutput, list[_Pending], float], None]] = field(default_factory=list)


def whole_stage(model: str, runtime: Any) -> Stage:
    """The one-stage case of ``model``: all its layers (a runtime that does not declare its
    depth counts as one layer)."""
    depth = max(1, int(getattr(runtime, "num_layers", 0) or 0))
    return Stage(model, 0, depth, depth)


class Engine:
    def __init__(
        self,
        runtimes: dict[str, ModelRuntime],
        policy: Policy,
        instances: int = 1,
        max_queue: int = 256,
        clock: Callable[[], float] = time.monotonic,
        default_slo_ms: float | None = None,
        workers: Sequence[Worker] | None = None,
        worker_factory: Callable[[int], Worker] | None = None,
        catalog: Callable[[Stage], Any] | None = None,
        cost_model: CostModel | None = None,
        correct_prices: bool = True,
    ):
        """``workers``: the workers to run steps on (ids 0..n-1 in order); default:
        ``instances`` in-process :class:`~jaxserve.workers.ThreadWorker` s, each holding
        every model whole. ``catalog(stage)``: the in-process runner of a stage (thread
        workers load through it; default: the whole models of ``runtimes`` only).
        ``worker_factory(id)``: a new, empty worker for a plan's ``add_worker`` (default:
        a thread worker over ``catalog``).

        ``default_slo_ms``: the deadline of every item that carries no ``slo_ms`` of its
        own (Triton's default queue timeout; TF Serving's per-request deadline with a server
        default). Clients that send none (OpenAI's embeddings API has no such field)
        then get one too, so the policy evicts what can no longer finish in time
        instead of computing it for a client that has given up. None: no deadline.

        ``cost_model``: the prices the policy was built with; given, the engine measures
        each whole-model step against them (``self.drift``, a
        :class:`~jaxserve.cost_drift.CostDrift`, also read by ``/metrics``) and, with
        ``correct_prices``, hands the policy the corrected prices (``Policy.reprice``).
        ``correct_prices`` also hands every step's measured times to ``Policy.observe_step``
        (policies that price their own steps, such as AsyFunc, learn from it)."""
        if workers is None and instances < 1:
            raise ValueError("instances must be >= 1")
        if default_slo_ms is not None and not (default_slo_ms > 0 and math.isfinite(default_slo_ms)):
            raise ValueError(f"default_slo_ms must be a positive number of milliseconds, got {default_slo_ms!r}")
        self.default_slo_ms = default_slo_ms
        self.runtimes = runtimes
        self.policy = policy
        self.max_queue = max_queue
        self.clock = clock
        self.stats = EngineStats()
        self.catalog = catalog or self._whole_model_runner
        self.worker_factory = worker_factory or (lambda wid: ThreadWorker(wid, self.catalog))
        if workers is None:
            wholes = [self.whole_stage(m) for m in runtimes]
            workers = [ThreadWorker(i, self.catalog, wholes) for i in range(instances)]
        self.workers: dict[int, Worker] = {w.id: w for w in workers}
        if len(self.workers) != len(workers) or not self.workers:
            raise ValueError("workers need distinct ids, and at least one")
        self._ids = itertools.count()
        self._queued: dict[int, _Pending] = {}
        self._held: dict[int, _Pending] = {}  # between steps: the policy decides what comes next
        self._running: dict[int, list[list[_Pending]]] = {}  # worker -> its running steps' items
        self._idle: list[int] = sorted(self.workers)
        self._restarting: set[int] = set()
        self._removing: set[int] = set()
        self._waiting_restart: dict[int, list[Callable[[], None]]] = {}  # worker -> what runs once it is back
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._draining = False
        self._left_queue: deque[tuple[float, int]] = deque()  # (when, items) run or evicted, last DRAIN_WINDOW_S
        # start of the current busy spell (None while idle): the drain rate's window starts no earlier,
        # so a burst after a quiet spell is not measured against the quiet seconds
        self._busy_since: float | None = None
        self._idle_event: asyncio.Event | None = None
        self.compiles_at_ready = compile_count()
        self.drift = CostDrift(cost_model) if cost_model is not None else None
        self.correct_prices = correct_prices
        self._drift_warned: set[str] = set()  # models whose prices are off by more than WARN_RATIO
        self.policy.on_workers(self.worker_views(), self.clock())

    # ------------------------------------------------------------- placement
    def whole_stage(self, model: str) -> Stage:
        return whole_stage(model, self.runtimes[model])

    def _whole_model_runner(self, stage: Stage) -> Any:
        if stage != self.whole_stage(stage.model):
            raise KeyError(f"no runner for {stage.label()}: this engine serves whole models only (give it a catalog)")
        return self.runtimes[stage.model]

    @property
    def instances(self) -> int:
        return len(self.workers)

    def worker_views(self) -> tuple[WorkerView, ...]:
        """What the policy may know of the workers (``Policy.on_workers``)."""
        idle = set(self._idle)
        return tuple(WorkerView(wid, w.holdings().stages, wid in idle) for wid, w in sorted(self.workers.items()))

    def placement(self) -> dict[int, frozenset[Stage]]:
        """Which worker holds which stages."""
        return {wid: w.holdings().stages for wid, w in sorted(self.workers.items())}

    def _apply_placement(self, change: PlacementChange, now: float) -> None:
        """Start one planned placement change; the policy hears when it is done."""
        wid = change.worker
        if change.action == "add_worker":
            if wid in self.workers:
                raise RuntimeError(f"policy added worker {wid}, which exists")
            self.workers[wid] = self.worker_factory(wid)
            self._idle.append(wid)
            self._idle.sort()
            self._placed(change, True, 0.0)
            return
        worker = self.workers.get(wid)
        if worker is None:
            raise RuntimeError(f"policy changed unknown worker {wid}")
        if change.action == "remove_worker":
            self._removing.add(wid)
            if wid in self._idle:
                self._retire(wid)
            return
        if change.action == "unload":
            worker.unload(change.stage)
            self._placed(change, True, 0.0)
            return
        if wid in self._idle:  # a load occupies the worker; the policy sees it busy meanwhile
            self._idle.remove(wid)
        t0 = self.clock()

        def loaded(f) -> None:
            ok = f.exception() is None
            seconds = f.result() if ok else self.clock() - t0
            if ok:
                self.stats.stage_loads.append((change.stage.label(), wid, float(seconds)))
                self.stats.stage_load_count += 1
            else:
                self.stats.placement_failures += 1
                log.error("loading %s on worker %d failed: %s", change.stage.label(), wid, f.exception())
            self._worker_free(wid)
            self._placed(change, ok, float(seconds))
            self._schedule()

        worker.load(change.stage).add_done_callback(lambda f: self._to_loop(loaded, f))

    def _to_loop(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on the loop thread (from a worker's thread). Once the loop is closed
        (the server has shut down) there is no one left to tell: dropped."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            if not self._loop.is_closed():
                raise

    def _placed(self, change: PlacementChange, ok: bool, seconds: float) -> None:
        now = self.clock()
        try:
            self.policy.on_placement(change, ok, seconds, now)
            self.policy.on_workers(self.worker_views(), now)
        except Exception:
            log.exception("policy.on_placement failed")

    def _retire(self, wid: int) -> None:
        worker = self.workers.pop(wid)
        self._removing.discard(wid)
        if wid in self._idle:
            self._idle.remove(wid)
        worker.close()
        self._placed(PlacementChange("remove_worker", wid), True, 0.0)

    def _worker_free(self, wid: int) -> None:
        """``wid`` has nothing running: idle again, or retired if the plan removed it."""
        if wid not in self.workers or self._running.get(wid) or wid in self._restarting:
            return
        if wid in self._removing:
            self._retire(wid)
        elif wid not in self._idle:
            self._idle.append(wid)
            self._idle.sort()

    # -------------------------------------------------------------- admission
    @property
    def queue_depth(self) -> int:
        return len(self._queued)

    def queue_depth_by_model(self) -> Counter:
        """Items queued per model (O(queued items): read at scrape time, not kept up to date)."""
        return Counter(p.item.model for p in self._queued.values())

    @property
    def draining(self) -> bool:
        """True once :meth:`drain` or :meth:`stop_admitting` has begun: nothing new is admitted."""
        return self._draining

    def stop_admitting(self) -> None:
        """Refuse new work from now on (``Draining``), and say so (``draining``), while what was
        accepted runs on: the start of a drain, before anything waits for it to finish."""
        self._draining = True

    @property
    def in_flight(self) -> int:
        running = sum(len(ps) for steps in self._running.values() for ps in steps)
        return len(self._queued) + len(self._held) + running

    def submit(self, items: Sequence[Item]) -> list[asyncio.Future]:
        """Queue all ``items`` or none of them; returns one future per item."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self._draining:
            raise Draining("server is shutting down")
        if len(items) > self.max_queue:
            raise TooManyItems(f"{len(items)} items in one request; this server queues at most "
                               f"{self.max_queue} (max_queue)")
        if len(self._queued) + len(items) > self.max_queue:
            raise Overloaded(
                f"queue full: {len(self._queued)} queued + {len(items)} new > max_queue {self.max_queue}",
                retry_after_s=self._retry_after(),
            )
        now = self.clock()
        futures = []
        try:
            for item in items:
                rid = next(self._ids)
                slo_ms = item.slo_ms if item.slo_ms is not None else self.default_slo_ms
                deadline = now + slo_ms / 1000.0 if slo_ms is not None else math.inf
                request = Request(rid, now, item.model, item.task, item.length, deadline, item.utility, item.seed)
                self.policy.on_arrival(request, now)  # may refuse the item (raises): not queued then
                fut = self._loop.create_future()
                self._queued[rid] = _Pending(item, request, fut)
                futures.append(fut)
        except Exception:
            # the request fails as a whole: its items admitted before the refused one are taken
            # back, so they neither run for nobody nor hold queue places (and a drain) for ever
            self.withdraw(futures, counted=False)
            raise
        self._schedule()
        return futures

    def withdraw(self, futures: Sequence[asyncio.Future], counted: bool = True) -> int:
        """Withdraw the items of ``futures`` that are still queued or held between steps
        (their client went away): the policy forgets them (``Policy.withdraw``) and their
        futures are cancelled. Items running, answered, or that the policy does not take
        back are left to finish. Returns how many were withdrawn. O(queued items).
        ``counted=False``: not a client's leaving (a refused request taking back its own
        items), so not an outcome in the stats."""
        if not futures:
            return 0
        wanted = set(futures)
        now = self.clock()
        n = 0
        for where in (self._queued, self._held):
            for rid, p in list(where.items()):
                if p.future in wanted and self.policy.withdraw(rid, now):
                    del where[rid]
                    p.future.cancel()
                    n += 1
        if n:
            self.stats.outcomes["withdrawn"] += n if counted else 0
            self._schedule()  # a plan that waited on the withdrawn head may now change
        return n

    def _retry_after(self) -> float:
        """Seconds until the items queued now have left the queue (run or evicted), at the rate
        items left it over the last ``DRAIN_WINDOW_S``: the earliest a refused request could
        be admitted. Before anything has left, 10 ms per queued item."""
        now = self.clock()
        self._forget_old_drains(now)
        left = sum(n for _, n in self._left_queue)
        if not left or self._busy_since is None:
            return max(0.01, len(self._queued) * 0.01)
        span = now - max(now - DRAIN_WINDOW_S, self._busy_since)
        return len(self._queued) * span / left if span > 0 else 0.01

    def _note_left_queue(self, now: float, n: int) -> None:
        self._left_queue.append((now, n))
        self._forget_old_drains(now)

    def _forget_old_drains(self, now: float) -> None:
        while self._left_queue and self._left_queue[0][0] < now - DRAIN_WINDOW_S:
            self._left_queue.popleft()

    # ------------------------------------------------------------- scheduling
    def _schedule(self) -> None:
        if self._loop is None:
            return
        now = self.clock()
        plan: Plan = self.policy.plan(now, tuple(self._idle))
        for change in plan.placement:
            self._apply_placement(change, now)
        for rid in plan.evict:
            p = self._queued.pop(rid, None) or self._held.pop(rid, None)
            if p is not None and not p.future.done():
                self.stats.outcomes["evicted"] += 1
                self._note_left_queue(now, 1)
                waited = (now - p.request.arrival) * 1e3
                p.future.set_result(Answer(self._served_info(rid), "evicted", queue_ms=waited, latency_ms=waited))
        for rid in plan.finish:
            p = self._held.pop(rid, None)
            if p is None:
                raise RuntimeError(f"policy finished request {rid}, which is not held between steps")
            self._answer(p, now)
        for batch in plan.batches:
            self._dispatch(batch, now)
        self._arm_timer(plan.wake_at)
        self._maybe_idle()

    def _arm_timer(self, wake_at: float) -> None:
        """Keep one timer, at the earliest wake-up any plan asked for."""
        if wake_at >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = wake_at
        self._timer = self._loop.call_later(max(0.0, wake_at - self.clock()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        self._schedule()

    def _take(self, rid: int, now: float) -> _Pending:
        p = self._queued.pop(rid, None)
        if p is not None:
            self._note_left_queue(now, 1)
            return p
        p = self._held.pop(rid, None)
        if p is None:
            raise RuntimeError(f"policy batched request {rid}, which is neither queued nor held")
        return p

    def _step_for(self, batch: Batch, stage: Stage, pendings: list[_Pending]) -> Step:
        tasks = tuple(p.item.task for p in pendings)
        if stage.first:
            return Step(stage, batch.cell, tuple(self._payload(p, batch.model) for p in pendings), tasks)
        if any(p.carry is None for p in pendings):
            raise RuntimeError(f"a step of {stage.label()} needs its requests' activations; some have none")
        return Step(stage, batch.cell, (), tasks, gather_carry([p.carry for p in pendings]))

    @staticmethod
    def _payload(p: _Pending, model: str) -> Any:
        """A request's input to a first stage of ``model``: the one its previous step made for
        that model (a cascade level's pruned text for the next level: ``outputs["_next"]``),
        else the request's own."""
        made = None if p.outputs is None else p.outputs.get("_next")
        if made is not None and model in made:
            return made[model]
        return p.item.payload

    def _dispatch(self, batch: Batch, now: float) -> None:
        if batch.instance not in self._idle:
            raise RuntimeError(f"policy assigned busy or unknown worker {batch.instance}")
        stage = batch.stage or self.whole_stage(batch.model)
        pendings = [self._take(rid, now) for rid in batch.request_ids]
        for p in pendings:
            if p.first_start is None:
                p.first_start = now
        try:
            step = self._step_for(batch, stage, pendings)
        except Exception as exc:  # a policy's mistake fails these items, not the server
            log.exception("cannot build the step of %s", stage.label())
            self._fail(pendings, exc)
            self.policy.on_completion(batch, now, None)
            return
        self._idle.remove(batch.instance)
        self.stats.steps += 1
        if batch.final:
            self.stats.batches += 1
        if self._busy_since is None:
            self._busy_since = now
        self._start(batch, step, pendings, batch.instance, now, retried=False)

    def _start(self, batch: Batch, step: Step, pendings: list[_Pending], wid: int, started: float,
               retried: bool) -> None:
        self._running.setdefault(wid, []).append(pendings)
        worker = self.workers[wid]
        try:
            cf = worker.submit(step)
        except Exception as exc:  # the worker does not hold the stage: the policy's mistake
            cf = Future()
            cf.set_exception(exc)
        cf.add_done_callback(
            lambda f: self._to_loop(self._on_complete, batch, step, pendings, wid, started,
                                                      retried, f))

    def _retry_worker(self, stage: Stage, failed: int) -> int | None:
        """Another live worker that holds ``stage`` (an idle one if any), else None."""
        others = [wid for wid, w in self.workers.items()
                  if wid != failed and wid not in self._restarting and wid not in self._removing and w.holds(stage)]
        idle = [wid for wid in others if wid in self._idle]
        return (idle or others or [None])[0]

    def _on_complete(self, batch: Batch, step: Step, pendings: list[_Pending], wid: int, started: float,
                     retried: bool, f) -> None:
        now = self.clock()
        running = self._running.get(wid, [])
        if pendings in running:
            running.remove(pendings)
        exc = f.exception()
        if exc is not None:
            self._restart_worker(wid)
            if not retried:
                log.error("step %s %s failed on worker %d (%s: %s); retrying once", step.stage.label(),
                          batch.cell.label(), wid, type(exc).__name__, exc)
                self.stats.retries += 1
                other = self._retry_worker(step.stage, wid)
                if other is not None:
                    if other in self._idle:
                        self._idle.remove(other)
                    self._start(batch, step, pendings, other, started, retried=True)
                else:  # no other worker holds the stage: the same one, once restarted
                    self._after_restart(wid, lambda: self._start(batch, step, pendings, wid, started, retried=True))
                self._schedule()
                return
            self._fail(pendings, exc)
            try:
                self.policy.on_completion(batch, now, None)
            except Exception:  # a policy bug must not strand the batch's answers
                log.exception("policy.on_completion failed")
        else:
            self._worker_free(wid)
            out: StepOutput = f.result()
            for obs in self.stats.observers:
                obs(batch, out, pendings, now - started)
            if self.drift is not None:
                self._measure_price(batch, out.compute_seconds, now)
            if self.correct_prices:
                try:
                    self.policy.observe_step(batch, out.compute_seconds, now - started, now)
                except Exception:  # a policy bug must not strand the batch's answers
                    log.exception("policy.observe_step failed")
            summaries = summarize(out.items, len(pendings))
            for i, p in enumerate(pendings):
                p.compute_s += out.compute_seconds
                p.cell, p.batch_size = batch.cell.label(), len(pendings)
                p.carry = None if out.carry is None else (out.carry, i)
                p.outputs = None if out.items is None else out.items[i]
            try:  # before the answers: what the policy decides here (OTAS' outcome type) goes into them
                self.policy.on_completion(batch, now, {p.request.id: s for p, s in zip(pendings, summaries)})
            except Exception:
                log.exception("policy.on_completion failed")
            for p in pendings:
                if batch.final:
                    self._answer(p, now)
                elif not p.future.done():  # not answered meanwhile (its client may have left)
                    self._held[p.request.id] = p
        self._schedule()
        if not self._queued and not self._held and not any(self._running.values()):
            self._busy_since = None  # idle: the next busy spell measures its own rate
            self._left_queue.clear()

    def _measure_price(self, batch: Batch, seconds: float, now: float) -> None:
        """Compare a step's time with its cell's price; reprice the policy when due, and warn
        once per crossing when a model's prices are off by more than WARN_RATIO."""
        model = batch.model
        if batch.stage is not None and batch.stage != self.whole_stage(model):
            return  # a layer range: not a profiled cell
        if self.policy.service_time(batch) is not None:
            return  # the policy prices this batch itself (DT's emulated dynamic shapes)
        if not self.drift.observe(model, batch.cell, seconds):
            return
        off = self.drift.outside(model)
        if off and model not in self._drift_warned:
            self._drift_warned.add(model)
            log.warning("%s runs %.2fx its profiled prices (over %d steps; warned beyond %.1fx either way): the cost "
                        "model was taken on a machine in another state. Re-profile on a quiet machine: `jaxserve "
                        "profile --model %s --out FILE` and serve with --cost-model FILE, or delete the cache's "
                        "cost_model.json and restart.%s", model, self.drift.model_ratio(model),
                        self.drift.samples(model), WARN_RATIO, model,
                        " Until then the policy plans with the measured prices." if self.correct_prices else "")
        elif not off and model in self._drift_warned:
            self._drift_warned.discard(model)
            log.info("%s runs %.2fx its profiled prices again", model, self.drift.model_ratio(model))
        if self.correct_prices and self.drift.due(model, batch.cell):
            try:
                self.policy.reprice(self.drift.corrected(), now)
            except Exception:  # a policy bug must not strand the batch's answers
                log.exception("policy.reprice failed")
            self.drift.mark_pushed()

    def _answer(self, p: _Pending, now: float) -> None:
        if p.future.done():
            return
        if p.outputs is None:
            self._fail([p], RuntimeError("finished before any step produced an answer"))
            return
        outcome = "ok" if now <= p.request.deadline else "late"
        self.stats.outcomes[outcome] += 1
        start = p.first_start if p.first_start is not None else now
        outputs = {k: v for k, v in p.outputs.items() if not k.startswith("_")}  # "_...": the engine's own
        p.future.set_result(Answer(
            {**outputs, **self._served_info(p.request.id)}, outcome, cell=p.cell, batch_size=p.batch_size,
            queue_ms=(start - p.request.arrival) * 1e3, compute_ms=p.compute_s * 1e3,
            latency_ms=(now - p.request.arrival) * 1e3,
        ))

    def _fail(self, pendings: list[_Pending], exc: BaseException) -> None:
        for p in pendings:
            if not p.future.done():
                self.stats.outcomes["error"] += 1
                p.future.set_exception(ExecutionFailed(f"{type(exc).__name__}: {exc}"))

    def _served_info(self, request_id: int) -> dict:
        """What the policy reports about how a request was served, merged into its answer's
        outputs (OTAS policies: ``gamma`` and the paper's ``outcome_type``); {} otherwise."""
        return self.policy.describe_request(request_id)

    def _restart_worker(self, wid: int) -> None:
        """Replace a failed worker's execution context (its thread, or its actor process):
        the failed one is not trusted again. It is not idle until the restart is done."""
        worker = self.workers.get(wid)
        if worker is None or wid in self._restarting:
            return
        self.stats.worker_restarts += 1
        self._restarting.add(wid)
        if wid in self._idle:
            self._idle.remove(wid)

        def restarted(f) -> None:
            self._restarting.discard(wid)
            if f.exception() is not None:
                log.error("restarting worker %d failed: %s", wid, f.exception())
            for then in self._waiting_restart.pop(wid, []):
                then()
            self._worker_free(wid)
            self._schedule()

        worker.restart().add_done_callback(lambda f: self._to_loop(restarted, f))

    def _after_restart(self, wid: int, then: Callable[[], None]) -> None:
        if wid in self._restarting:
            self._waiting_restart.setdefault(wid, []).append(then)
        else:
            then()

    # --------------------------------------------------------------- shutdown
    def _maybe_idle(self) -> None:
        if self._idle_event is not None and self.in_flight == 0:
            self._idle_event.set()

    async def drain(self, timeout_s: float = 30.0) -> bool:
        """Stop admitting, finish everything accepted; True when nothing was left behind."""
        self.stop_admitting()
        if self.in_flight == 0:
            return True
        self._idle_event = asyncio.Event()
        self._maybe_idle()
        try:
            await asyncio.wait_for(self._idle_event.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def close(self) -> None:
        """Stop the timer and close every worker, and the worker factory if it keeps workers of
        its own (AsyFunc's warm pool worker: ``close()``)."""
        if self._timer is not None:
            self._timer.cancel()
        for worker in self.workers.values():
            worker.close()
        close_factory = getattr(self.worker_factory, "close", None)
        if close_factory is not None:
            close_factory()
