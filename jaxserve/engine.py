"""The live engine: queues, futures, the clock and the executor workers.

Requests are stamped on arrival (``time.monotonic``), handed to the policy, and the
policy's :class:`~jaxserve.sched.base.Plan` is carried out: batches go to executor
workers (threads: XLA releases the GIL while it computes, so the asyncio loop never
blocks), evictions are answered ``evicted``, and ``plan.wake_at`` arms a timer.
Completions come back to the loop thread, are reported to the policy, and trigger
the next plan. Every policy call happens on the loop thread, so policies need no
locks and stay plain Python.

Guarantees (tested through HTTP in tests/test_server.py):

* every accepted item gets exactly one answer: ``ok``, ``late``, ``evicted`` or an error;
* admission is bounded: past ``max_queue`` queued items a submission is refused with
  :class:`Overloaded` (HTTP 429) before anything is queued, never half-queued;
* a batch whose execution raises is retried once; if it fails again its items are
  answered with an error and the worker slot is restarted (``worker_restarts``);
* :meth:`Engine.drain` stops admission and waits for in-flight work (SIGTERM path);
* :meth:`Engine.withdraw` takes back items whose client went away while they were still
  queued: the policy forgets them, they never run, and their futures are cancelled
  (outcome ``withdrawn`` in the stats). Items already running finish; their answers go
  nowhere. Without this an overloaded server keeps computing for clients that timed out
  and left, and the queue behind them waits for nobody's work.

A crash that kills the whole process (a native fault in XLA) is outside what a
thread can catch; run the server under a supervisor (systemd, Kubernetes) for that.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from jaxserve.compile_cache import compile_count
from jaxserve.runtime import BatchOutput, ModelRuntime
from jaxserve.sched.base import Batch, Policy, Request

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
    """A batch failed twice on its worker; its items are answered with this error."""


@dataclass(frozen=True)
class Item:
    """One input of a request, as the engine queues it."""

    model: str
    payload: Any  # token ids (text) or a float32 [H, W, C] image
    length: int = 0
    task: str = ""
    slo_ms: float | None = None
    utility: float = 1.0


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


@dataclass
class EngineStats:
    outcomes: Counter = field(default_factory=Counter)
    batches: int = 0
    worker_restarts: int = 0
    retries: int = 0
    observers: list[Callable[[Batch, BatchOutput, list[_Pending], float], None]] = field(default_factory=list)


class Engine:
    def __init__(
        self,
        runtimes: dict[str, ModelRuntime],
        policy: Policy,
        instances: int = 1,
        max_queue: int = 256,
        clock: Callable[[], float] = time.monotonic,
        default_slo_ms: float | None = None,
    ):
        """``default_slo_ms``: the deadline of every item that carries no ``slo_ms`` of its
        own (Triton's default queue timeout; TF Serving's per-request deadline with a server
        default). Clients that send none (OpenAI's embeddings API has no such field)
        then get one too, so the policy evicts what can no longer finish in time
        instead of computing it for a client that has given up. None: no deadline."""
        if instances < 1:
            raise ValueError("instances must be >= 1")
        if default_slo_ms is not None and not (default_slo_ms > 0 and math.isfinite(default_slo_ms)):
            raise ValueError(f"default_slo_ms must be a positive number of milliseconds, got {default_slo_ms!r}")
        self.default_slo_ms = default_slo_ms
        self.runtimes = runtimes
        self.policy = policy
        self.instances = instances
        self.max_queue = max_queue
        self.clock = clock
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._queued: dict[int, _Pending] = {}
        self._running: dict[int, list[_Pending]] = {}  # instance -> its batch
        self._idle: list[int] = list(range(instances))
        self._pool = ThreadPoolExecutor(max_workers=instances, thread_name_prefix="jaxserve-worker")
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
        return len(self._queued) + sum(len(b) for b in self._running.values())

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
                request = Request(rid, now, item.model, item.task, item.length, deadline, item.utility)
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
        """Withdraw the items of ``futures`` that are still queued (their client went
        away): the policy forgets them (``Policy.withdraw``) and their futures are
        cancelled. Items already dispatched, answered, or that the policy cannot take
        back (a policy without ``withdraw``) are left to finish. Returns how many were
        withdrawn. O(queued items). ``counted=False``: not a client's leaving (a refused
        request taking back its own items), so not an outcome in the stats."""
        forget = getattr(self.policy, "withdraw", None)
        if forget is None or not futures:
            return 0
        wanted = set(futures)
        now = self.clock()
        n = 0
        for rid, p in list(self._queued.items()):
            if p.future in wanted and forget(rid, now):
                del self._queued[rid]
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
        now = self.clock()
        plan = self.policy.plan(now, tuple(self._idle))
        for rid in plan.evict:
            p = self._queued.pop(rid, None)
            if p is not None and not p.future.done():
                self.stats.outcomes["evicted"] += 1
                self._note_left_queue(now, 1)
                waited = (now - p.request.arrival) * 1e3
                p.future.set_result(Answer(self._served_info(rid), "evicted", queue_ms=waited, latency_ms=waited))
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

    def _dispatch(self, batch: Batch, now: float) -> None:
        if batch.instance not in self._idle:
            raise RuntimeError(f"policy assigned busy instance {batch.instance}")
        pendings = [self._queued.pop(rid) for rid in batch.request_ids]
        self._idle.remove(batch.instance)
        self._running[batch.instance] = pendings
        runtime = self.runtimes[batch.model]
        payloads = [p.item.payload for p in pendings]
        tasks = [p.item.task for p in pendings]
        started = now
        self.stats.batches += 1
        if self._busy_since is None:
            self._busy_since = now
        self._note_left_queue(now, len(pendings))

        def work() -> BatchOutput:
            try:
                return runtime.execute(batch.cell, payloads, tasks)
            except Exception:
                log.exception("batch %s failed on instance %d; retrying once", batch.cell.label(), batch.instance)
                self.stats.retries += 1
                return runtime.execute(batch.cell, payloads, tasks)

        cf = self._pool.submit(work)
        cf.add_done_callback(
            lambda f: self._loop.call_soon_threadsafe(self._on_complete, batch, pendings, started, f)
        )

    def _on_complete(self, batch: Batch, pendings: list[_Pending], started: float, f) -> None:
        now = self.clock()
        self._running.pop(batch.instance, None)
        self._idle.append(batch.instance)
        self._idle.sort()
        try:
            self.policy.on_completion(batch, now)
        except Exception:  # a policy bug must not strand the batch's answers
            log.exception("policy.on_completion failed")
        exc = f.exception()
        if exc is not None:
            self._restart_worker(batch.instance)
            for p in pendings:
                if not p.future.done():
                    self.stats.outcomes["error"] += 1
                    p.future.set_exception(ExecutionFailed(f"{type(exc).__name__}: {exc}"))
        else:
            out: BatchOutput = f.result()
            for obs in self.stats.observers:
                obs(batch, out, pendings, now - started)
            for p, item_out in zip(pendings, out.items):
                item_out = {**item_out, **self._served_info(p.request.id)}
                outcome = "ok" if now <= p.request.deadline else "late"
                self.stats.outcomes[outcome] += 1
                if not p.future.done():
                    p.future.set_result(Answer(
                        item_out, outcome, cell=batch.cell.label(), batch_size=len(pendings),
                        queue_ms=(started - p.request.arrival) * 1e3, compute_ms=out.compute_seconds * 1e3,
                        latency_ms=(now - p.request.arrival) * 1e3,
                    ))
        self._schedule()
        if not self._queued and not self._running:  # idle: the next busy spell measures its own rate
            self._busy_since = None
            self._left_queue.clear()

    def _served_info(self, request_id: int) -> dict:
        """What the policy reports about how a request was served, merged into its answer's
        outputs (OTAS policies: ``gamma`` and the paper's ``outcome_type``); {} otherwise."""
        describe = getattr(self.policy, "describe_request", None)
        return describe(request_id) if describe is not None else {}

    def _restart_worker(self, instance: int) -> None:
        """Replace the worker pool slot: the failed thread's state is not trusted again."""
        self.stats.worker_restarts += 1
        old = self._pool
        self._pool = ThreadPoolExecutor(max_workers=self.instances, thread_name_prefix="jaxserve-worker")
        old.shutdown(wait=False)

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
        if self._timer is not None:
            self._timer.cancel()
        self._pool.shutdown(wait=True)
