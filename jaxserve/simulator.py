"""A discrete-event simulator that drives the live engine's policy objects.

The virtual clock jumps from event to event: arrivals (from the trace), batch
completions (a heap) and the policy's own wake-up (``Plan.wake_at``; each plan
supersedes the previous one's). At every event the simulator makes the same
callbacks the engine makes — ``on_arrival`` / ``on_completion`` with the virtual
``now``, then ``plan(now, idle_instances)`` — and starts each planned batch at
once on its instance. A batch takes ``cost_model.latency[model].latency(cell)``
seconds, optionally times a mean-one log-normal noise, or whatever a
caller-supplied ``service_time(batch)`` says (e.g. a dynamic-shape penalty), plus
``batch_overhead``: the time a live instance stays held beyond the compute itself
(the worker thread picking the batch up, and the completion waiting for the event
loop, which is busy with HTTP). The server reports it per batch as
``jaxserve_batch_handoff_seconds`` and per answer as ``latency_ms - queue_ms -
compute_ms``; ``bench/fidelity.py`` measures it on a calibration trace. The policy
does not see it, live or simulated: its cost model prices compute only.

The idle instances are handed to ``plan`` in increasing id order, as the engine hands them
(tests/integration/test_sim_live_decisions.py: the same batches on the same workers as live),
as an :class:`~jaxserve.sched.base.IdleInstances`: also the ids that became idle since the
previous plan, so a policy with a queue per instance need not scan every idle one.

Simultaneous events run completions first (they free instances), then clients
leaving (below), then arrivals in trace order, then the wake-up; ``plan`` is called
after each one.

Admission is the engine's: a request the policy's bounded queue cannot take
(``policy.admits(model)`` if the policy has it, else ``queue_depth() <
max_queue``) is *rejected* (HTTP 429). Every request ends in exactly one outcome:
``ok`` (finished by its deadline), ``late``, ``evicted`` or ``rejected``; the
simulator checks the plans it is given (idle instances only, each request queued
exactly once) and raises if a policy breaks that contract or strands requests.

Requests of more than one step, as in the engine: a non-final batch (a pipeline stage
before the last, a cascade's first model) leaves its requests *held*; the policy gets a
per-request :class:`~jaxserve.sched.base.StepSummary` (from ``summary_of``, which stands in
for the outputs the simulator does not compute) and later plans their next step,
finishes them (``Plan.finish``) or evicts them. A batch of a layer range is priced by the
cost model's profile named ``stage.label()`` (a whole model's by the model's name). A
step of a stage after the first whose requests' previous step ran on another instance
first moves their activations: ``transfer.hop_latency + bytes / transfer.bandwidth``,
with ``transfer.activation_bytes(batch)`` bytes (measured on Ray by bench/workers.py). When
only some of the rows come from another instance (a batch whose rows were split over two
workers and are merged again, AsyFunc's body and shadow), only those move: the batch handed
to ``activation_bytes`` then holds just the moved requests, in a cell of that many rows.
Placement changes in a plan take time as they do live: a new worker is ready after
``worker_start``, a stage load holds its worker for ``load_time(stage)``; the policy
hears of each through ``on_placement`` and ``on_workers``.

Impatient clients (``client_timeout``): as live, a client leaves ``client_timeout``
seconds after it sent its request. If the request is still queued then, the
simulator calls ``policy.withdraw`` as the engine does when the connection closes:
outcome ``withdrawn``, it never runs. One that runs anyway (already dispatched, or a
policy without ``withdraw``) and finishes after its client left is ``abandoned``:
computed for nobody. A leave at the very instant of a completion comes after it
(simultaneous events above): the answer arrived in time. Evictions and rejections
keep their outcomes (the client got that answer, or would have).

Speed (bench/sim_speed.py). :func:`simulate` pauses Python's cyclic garbage collector
while it runs and restores it as it was, even if the policy raises. The event loop
allocates several objects per event (requests, batches, plans), and the collector's
passes would walk every live request and batch again and again. Paused, it walks none of
them: they hold no reference cycles, reference counting frees each as before, and most are gone when
``simulate`` returns. Only cyclic garbage a policy makes during the run waits for the next
collection after it.
"""

from __future__ import annotations

import functools
import gc
import math
from dataclasses import dataclass, field
from heapq import heappop, heappush
from typing import Callable, Mapping

import numpy as np

from jaxserve.sched.base import (AccuracyProfile, Batch, Cell, CostModel, IdleInstances, PlacementChange, Policy,
                                 Request, Stage, StepSummary, WorkerView)
from jaxserve.traces import Trace

__all__ = ["OUTCOMES", "OK", "LATE", "EVICTED", "REJECTED", "WITHDRAWN", "ABANDONED", "SimResult", "UtilityScore",
           "simulate", "utility_score"]

OUTCOMES = ("ok", "late", "evicted", "rejected", "withdrawn", "abandoned")
OK, LATE, EVICTED, REJECTED, WITHDRAWN, ABANDONED = range(6)
_INF = math.inf
# A completion this close past its deadline is on time. The virtual clock adds a start time and
# a latency in floating point: a batch the policy starts at exactly ``deadline - latency`` (its
# dispatch-by time) can land an ulp past the deadline it was planned to meet. No real clock
# resolves a nanosecond, and the engine's, which is real, never sees this.
DEADLINE_SLACK_S = 1e-9
_PENDING, _QUEUED, _RUNNING, _DONE, _HELD = range(5)


@dataclass(frozen=True)
class Transfer:
    """What moving activations between instances costs: ``hop_latency`` seconds per hop
    plus ``activation_bytes(batch)`` bytes at ``bandwidth`` bytes per second.
    :meth:`from_profile` reads the values ``bench/workers.py --section ray --write``
    measured between two Ray actors (``bench/profiles/ray-transfer.json``)."""

    bandwidth: float = math.inf
    hop_latency: float = 0.0
    activation_bytes: Callable[[Batch], float] = field(default=lambda batch: 0.0)

    def seconds(self, batch: Batch) -> float:
        return self.hop_latency + self.activation_bytes(batch) / self.bandwidth

    @classmethod
    def from_profile(cls, path, activation_bytes: Callable[[Batch], float]) -> "Transfer":
        """The measured hop (``{"hop_latency_s": .., "bytes_per_s": ..}``) with the caller's
        bytes per batch (e.g. ``batch * seq * hidden * 4`` for float32 hidden states)."""
        import json
        from pathlib import Path

        raw = json.loads(Path(path).read_text())
        return cls(float(raw["bytes_per_s"]), float(raw["hop_latency_s"]), activation_bytes)


def profile_name(batch: Batch) -> str:
    """The cost-model profile that prices ``batch``: its model's, or its layer range's."""
    stage = batch.stage
    return batch.model if stage is None or stage.whole else stage.label()


@dataclass(frozen=True, eq=False)
class SimResult:
    """Per-request and per-batch records of one simulated run (numpy arrays).

    Per request ``i`` (= trace index): ``arrival``, ``deadline``, ``length``,
    ``start`` (batch start, nan if never run), ``finish`` (when the client got its
    answer: batch end, eviction time, or arrival for a rejection), ``outcome``
    (index into :data:`OUTCOMES`), ``batch`` (index of its batch, -1 if none),
    ``cell_batch`` / ``cell_seq`` / ``cell_gamma`` (its executable, 0 if none).
    Per batch ``j``: ``batch_start``, ``batch_finish``, ``batch_count`` (real
    requests), ``batch_instance``.
    """

    arrival: np.ndarray
    deadline: np.ndarray
    length: np.ndarray
    start: np.ndarray
    finish: np.ndarray
    outcome: np.ndarray
    batch: np.ndarray
    cell_batch: np.ndarray
    cell_seq: np.ndarray
    cell_gamma: np.ndarray
    batch_start: np.ndarray
    batch_finish: np.ndarray
    batch_count: np.ndarray
    batch_instance: np.ndarray
    instances: int

    def __len__(self) -> int:
        return len(self.arrival)

    # -- counts ------------------------------------------------------------------

    def outcome_counts(self) -> dict[str, int]:
        counts = np.bincount(self.outcome, minlength=len(OUTCOMES))
        return {name: int(c) for name, c in zip(OUTCOMES, counts)}

    def completed(self) -> np.ndarray:
        """Mask of requests whose answer reached their client (ok or late)."""
        return self.outcome <= LATE

    def computed(self) -> np.ndarray:
        """Mask of requests that ran: answered (ok, late) or computed for nobody (abandoned)."""
        return (self.outcome <= LATE) | (self.outcome == ABANDONED)

    def slo_attainment(self) -> float:
        """Fraction of *all* requests answered by their deadline (evicted and
        rejected ones count as misses)."""
        return float(np.mean(self.outcome == OK)) if len(self) else math.nan

    # -- time ------------------------------------------------------------------

    def span(self) -> float:
        """From the first arrival to the last answer."""
        return float(self.finish.max() - self.arrival.min()) if len(self) else 0.0

    def throughput(self) -> float:
        """Completed requests per second over :meth:`span`."""
        span = self.span()
        return float(self.completed().sum()) / span if span > 0 else math.nan

    def goodput(self) -> float:
        """Requests finished by their deadline per second over :meth:`span`."""
        span = self.span()
        return float((self.outcome == OK).sum()) / span if span > 0 else math.nan

    def latencies(self) -> np.ndarray:
        """End-to-end latency (queueing + compute) of completed requests."""
        done = self.completed()
        return self.finish[done] - self.arrival[done]

    def queue_times(self) -> np.ndarray:
        done = self.completed()
        return self.start[done] - self.arrival[done]

    def mean_latency(self) -> float:
        lat = self.latencies()
        return float(lat.mean()) if len(lat) else math.nan

    def latency_percentile(self, p: float) -> float:
        lat = self.latencies()
        return float(np.percentile(lat, p)) if len(lat) else math.nan

    def p50(self) -> float:
        return self.latency_percentile(50)

    def p98(self) -> float:
        return self.latency_percentile(98)

    def p99(self) -> float:
        return self.latency_percentile(99)

    # -- batching ----------------------------------------------------------------

    def mean_batch_size(self) -> float:
        """Real (unpadded) requests per executed batch."""
        return float(self.batch_count.mean()) if len(self.batch_count) else math.nan

    def padding_ratio(self) -> float:
        """Tokens computed / tokens asked, over executed text requests:
        ``sum(bucket) / sum(length)`` (1.0 = no padding; batch-row padding excluded)."""
        done = self.completed() & (self.length > 0)
        asked = self.length[done].sum()
        return float(self.cell_seq[done].sum() / asked) if asked else math.nan

    def utilization(self) -> float:
        """Busy instance-seconds / (instances × span)."""
        span = self.span()
        busy = float((self.batch_finish - self.batch_start).sum())
        return busy / (self.instances * span) if span > 0 else math.nan

    def summary(self) -> dict[str, float]:
        """The headline numbers, flat (for tables)."""
        return {
            "requests": float(len(self)),
            **{k: float(v) for k, v in self.outcome_counts().items()},
            "slo_attainment": self.slo_attainment(),
            "throughput": self.throughput(),
            "goodput": self.goodput(),
            "mean_latency": self.mean_latency(),
            "p50": self.p50(),
            "p98": self.p98(),
            "p99": self.p99(),
            "mean_batch_size": self.mean_batch_size(),
            "padding_ratio": self.padding_ratio(),
            "utilization": self.utilization(),
        }


@dataclass(frozen=True, eq=False)
class UtilityScore:
    """The OTAS paper's read-out of one run (Sec. V): utility earned, outcome types, gammas.

    ``utility``: sum of u_r over requests answered on time *and* correctly (their
    ``gained``, per request); ``max_utility``: sum of u_r over all requests. ``types``:
    share of all requests of each outcome type (:class:`~jaxserve.sched.otas.OutcomeType`;
    1 correct on time, 2 wrong on time, 3 ran but late or abandoned, 4 never ran: evicted,
    rejected or withdrawn), summing to 1. ``gamma_share``: share of the answered requests
    (ok or late) that ran at each gamma, summing to 1 (empty if none was answered).
    """

    utility: float
    max_utility: float
    types: Mapping[int, float]
    gamma_share: Mapping[int, float]
    gained: np.ndarray

    @property
    def utility_share(self) -> float:
        """``utility / max_utility`` (nan for a trace worth nothing)."""
        return self.utility / self.max_utility if self.max_utility > 0 else math.nan

    def summary(self) -> dict:
        """Flat and JSON-ready (gammas as keys), for tables and the simulate command."""
        return {
            "utility": self.utility,
            "max_utility": self.max_utility,
            "utility_share": self.utility_share,
            "outcome_type_shares": {str(t): s for t, s in self.types.items()},
            "gamma_shares": {f"{g:+d}" if g else "0": s for g, s in self.gamma_share.items()},
        }


def utility_score(result: SimResult, trace: Trace, *, correct: np.ndarray | None = None,
                  accuracy: AccuracyProfile | None = None) -> UtilityScore:
    """Utility, outcome types and gamma shares of ``result``, a run of ``trace`` (OTAS Sec. V).

    Correctness is known one of two ways, pass exactly one: ``correct``, a bool per request
    (whether its answer, at the gamma it ran with, is right: known labels), or ``accuracy``,
    the profiled accuracy per (task, gamma), which makes every on-time request correct with
    that probability: its type 1 and 2 shares and its utility are then the expected ones
    (``accuracy * u_r``, the utility OTAS plans for).
    """
    if (correct is None) == (accuracy is None):
        raise ValueError("pass exactly one of correct (per request) and accuracy (a profile)")
    n = len(trace)
    if len(result) != n:
        raise ValueError(f"the result has {len(result)} requests, the trace {n}")
    ok = result.outcome == OK
    p_right = np.zeros(n)
    if correct is not None:
        correct = np.asarray(correct, dtype=bool)
        if correct.shape != (n,):
            raise ValueError(f"correct needs one bool per request ({n})")
        p_right[ok] = correct[ok]
    else:
        cache: dict[tuple[str, int], float] = {}
        for i in np.nonzero(ok)[0]:
            key = (str(trace.task[i]), int(result.cell_gamma[i]))
            if key not in cache:
                cache[key] = accuracy.of(*key)
            p_right[i] = cache[key]
    late = (result.outcome == LATE) | (result.outcome == ABANDONED)
    types = {1: float(p_right.sum()), 2: float((ok.sum() - p_right.sum())), 3: float(late.sum())}
    types[4] = float(n - ok.sum() - late.sum())
    types = {t: c / n if n else math.nan for t, c in types.items()}
    answered = result.completed()
    gammas, counts = np.unique(result.cell_gamma[answered], return_counts=True)
    total = max(int(answered.sum()), 1)
    gained = p_right * trace.utility
    return UtilityScore(
        utility=float(gained.sum()), max_utility=float(trace.utility.sum()), types=types,
        gamma_share={int(g): float(c / total) for g, c in zip(gammas, counts)}, gained=gained)


def _collector_paused(fn: Callable) -> Callable:
    """``fn`` with Python's cyclic garbage collector paused while it runs (module docstring,
    Speed), and restored as it was afterwards, even if ``fn`` raises."""

    @functools.wraps(fn)
    def paused(*args, **kwargs):
        collecting = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if collecting:
                gc.enable()

    return paused


@_collector_paused
def simulate(
    policy: Policy,
    trace: Trace,
    cost_model: CostModel,
    instances: int,
    *,
    service_time: Callable[[Batch], float] | None = None,
    latency_noise: float = 0.0,
    batch_overhead: float = 0.0,
    seed: int | np.random.Generator | None = 0,
    max_queue: float = math.inf,
    client_timeout: float = math.inf,
    withdraw_when_clients_leave: bool = True,
    summary_of: Callable[[int, Batch], StepSummary] | None = None,
    transfer: Transfer | None = None,
    holdings: Mapping[int, frozenset[Stage]] | None = None,
    load_time: Callable[[Stage], float] = lambda stage: 0.0,
    worker_start: float = 0.0,
) -> SimResult:
    """Run ``trace`` through ``policy`` on ``instances`` identical instances.

    Args:
        policy: any :class:`~jaxserve.sched.base.Policy`, exactly as the engine uses it.
        trace: the workload; request ``i`` gets id ``i`` and deadline
            ``arrival + slo_s``.
        cost_model: prices a batch as ``latency[model].latency(batch.cell)``.
        instances: instance ids are ``0 .. instances-1``; each runs one batch at a time.
        service_time: overrides the cost model's price of a batch.
        latency_noise: sigma of a mean-one log-normal factor on each batch's time.
        batch_overhead: seconds added to every batch's time after the noise (the
            live hand-off; see the module docstring).
        seed: for the noise.
        max_queue: admission bound used only if the policy has no ``admits(model)``.
        client_timeout: seconds after which each client leaves (module docstring).
        withdraw_when_clients_leave: False simulates a server that keeps a departed
            client's queued items (as if the policy had no ``withdraw``): the ablation.
        summary_of: ``(request id, batch) -> StepSummary`` given to the policy when a
            step completes (default: an empty summary).
        transfer: the price of moving activations between instances (default: free).
        holdings: the stages each instance holds at the start (``Policy.on_workers``);
            default: nothing declared.
        load_time: seconds a planned stage load holds its instance.
        worker_start: seconds before a planned new worker is ready.
    """
    if instances < 1:
        raise ValueError("need at least one instance")
    if not client_timeout > 0:
        raise ValueError("client_timeout must be > 0")
    n = len(trace)
    arrival = trace.arrival.tolist()
    deadline_arr = trace.arrival + trace.slo_s
    deadline = deadline_arr.tolist()
    length = trace.length.tolist()
    model = trace.model.tolist()
    task = trace.task.tolist()
    utility = trace.utility.tolist()

    start = [_INF] * n
    finish = [_INF] * n
    outcome = [-1] * n
    batch_of = [-1] * n
    state = [_PENDING] * n
    batches: list[Batch] = []
    batch_start: list[float] = []
    batch_finish: list[float] = []

    price_cache: dict[tuple[str, Stage | None, Cell], float] = {}

    def price(batch: Batch) -> float:
        key = (batch.model, batch.stage, batch.cell)
        t = price_cache.get(key)
        if t is None:
            t = price_cache[key] = float(cost_model.latency[profile_name(batch)].latency(batch.cell))
        return t

    if service_time is None:
        def service_time(batch: Batch) -> float:
            t = policy.service_time(batch)
            return price(batch) if t is None else t
    noise: list[float] = []
    rng = np.random.default_rng(seed)
    if latency_noise < 0:
        raise ValueError("latency_noise must be >= 0")
    if batch_overhead < 0:
        raise ValueError("batch_overhead must be >= 0")

    admits = policy.admits
    on_arrival = policy.on_arrival
    on_completion = policy.on_completion
    plan_fn = policy.plan
    queue_depth = policy.queue_depth
    withdraw = policy.withdraw if withdraw_when_clients_leave else None
    empty_summary = StepSummary()
    last_instance = [-1] * n  # where each request's last step ran (for transfers)

    idle = IdleInstances(range(instances))
    busy = {i: False for i in range(instances)}
    stages = {i: frozenset((holdings or {}).get(i, ())) for i in range(instances)}
    removing: set[int] = set()
    placements: list[tuple[float, int, PlacementChange]] = []  # (done at, seq, change)

    def views() -> tuple[WorkerView, ...]:
        free = set(idle)
        return tuple(WorkerView(w, stages[w], w in free) for w in sorted(busy))

    policy.on_workers(views(), 0.0)
    completions: list[tuple[float, int]] = []
    wake = _INF
    i = 0
    gone = 0  # the next client to leave: leaving times are in arrival order
    impatient = client_timeout < _INF
    now = 0.0
    while True:
        ta = arrival[i] if i < n else _INF
        tc = completions[0][0] if completions else _INF
        tl = _INF
        if impatient:
            while gone < i and state[gone] != _QUEUED and state[gone] != _HELD:  # nothing to withdraw
                gone += 1
            if gone < i:
                tl = arrival[gone] + client_timeout
        tp = placements[0][0] if placements else _INF
        if tp < tc and tp <= ta and tp <= wake and tp <= tl:
            now, _, change = heappop(placements)
            w = change.worker
            if change.action == "load":
                stages[w] = stages[w] | {change.stage}
            busy[w] = False
            idle.join(w)
            policy.on_placement(change, True, load_time(change.stage) if change.stage else worker_start, now)
            policy.on_workers(views(), now)
        elif tl < tc and tl <= ta and tl <= wake:
            now = tl
            r = gone
            gone += 1
            if withdraw is None or not withdraw(r, now):
                continue  # it stays queued; if it runs, it ends abandoned
            state[r] = _DONE
            finish[r] = now
            outcome[r] = WITHDRAWN  # and, as in the engine, the policy plans again
        elif tc <= ta and tc <= wake:
            if tc == _INF:
                break
            now, b = heappop(completions)
            batch = batches[b]
            inst = batch.instance
            if batch.final:
                for r in batch.request_ids:
                    finish[r] = now
                    if now > arrival[r] + client_timeout:
                        outcome[r] = ABANDONED
                    else:
                        outcome[r] = OK if now <= deadline[r] + DEADLINE_SLACK_S else LATE
                    state[r] = _DONE
                summaries = None
            else:
                summaries = {}
                for r in batch.request_ids:
                    state[r] = _HELD
                    last_instance[r] = inst
                    summaries[r] = summary_of(r, batch) if summary_of is not None else empty_summary
            if inst in removing:
                removing.discard(inst)
                del busy[inst], stages[inst]
                policy.on_placement(PlacementChange("remove_worker", inst), True, 0.0, now)
                policy.on_workers(views(), now)
            else:
                busy[inst] = False
                idle.join(inst)
            on_completion(batch, now, summaries)
        elif ta <= wake:
            now = ta
            r = i
            i += 1
            m = model[r]
            ok = admits(m)
            if ok is None:
                ok = queue_depth() < max_queue
            if ok:
                state[r] = _QUEUED
                on_arrival(Request(r, now, m, task[r], length[r], deadline[r], utility[r], seed=r), now)
            else:
                finish[r] = now
                outcome[r] = REJECTED
                state[r] = _DONE
                continue  # the policy saw nothing, so it has nothing new to plan
        else:
            now = wake
            wake = _INF

        plan = plan_fn(now, idle)
        idle.planned()
        if plan.placement:
            for change in plan.placement:
                w = change.worker
                if change.action == "add_worker":
                    if w in busy:
                        raise RuntimeError(f"policy added worker {w}, which exists")
                    busy[w] = True  # not ready until worker_start has passed
                    stages[w] = frozenset()
                    heappush(placements, (now + worker_start, len(batches) + len(placements), change))
                elif w not in busy:
                    raise RuntimeError(f"policy changed unknown worker {w}")
                elif change.action == "remove_worker":
                    if busy[w]:
                        removing.add(w)
                    else:
                        idle.leave(w)
                        del busy[w], stages[w]
                        policy.on_placement(change, True, 0.0, now)
                        policy.on_workers(views(), now)
                elif change.action == "unload":
                    stages[w] = stages[w] - {change.stage}
                    policy.on_placement(change, True, 0.0, now)
                else:  # load: the worker is busy loading
                    if busy[w]:
                        raise RuntimeError(f"policy loaded a stage on busy worker {w}")
                    busy[w] = True
                    idle.leave(w)
                    heappush(placements, (now + load_time(change.stage), len(batches) + len(placements), change))
        for r in plan.evict:
            if state[r] != _QUEUED and state[r] != _HELD:
                raise RuntimeError(f"policy evicted request {r}, which is not queued")
            state[r] = _DONE
            finish[r] = now
            outcome[r] = EVICTED
        for r in plan.finish:
            if state[r] != _HELD:
                raise RuntimeError(f"policy finished request {r}, which is not held between steps")
            state[r] = _DONE
            finish[r] = now
            if now > arrival[r] + client_timeout:
                outcome[r] = ABANDONED
            else:
                outcome[r] = OK if now <= deadline[r] + DEADLINE_SLACK_S else LATE
        for batch in plan.batches:
            inst = batch.instance
            if busy.get(inst, True):
                raise RuntimeError(f"policy assigned a batch to busy or unknown instance {inst}")
            ids = batch.request_ids
            if len(ids) > batch.cell.batch:
                raise RuntimeError(f"{len(ids)} requests do not fit cell {batch.cell}")
            b = len(batches)
            moved = 0
            for r in ids:
                sr = state[r]
                if sr == _QUEUED:
                    start[r] = now
                elif sr == _HELD:
                    moved += last_instance[r] != inst
                else:
                    raise RuntimeError(f"policy batched request {r}, which is not queued")
                state[r] = _RUNNING
                batch_of[r] = b
            busy[inst] = True
            idle.leave(inst)
            t = service_time(batch)
            if latency_noise:
                if not noise:
                    noise = rng.lognormal(-0.5 * latency_noise**2, latency_noise, 4096).tolist()
                t *= noise.pop()
            if moved and transfer is not None and batch.stage is not None and not batch.stage.first:
                if moved < len(ids):  # only the rows that ran elsewhere move (module docstring)
                    rows = tuple(r for r in ids if last_instance[r] != inst)
                    cell = batch.cell
                    t += transfer.seconds(Batch(rows, batch.model, Cell(len(rows), cell.seq, cell.gamma), inst,
                                                batch.stage, batch.final))
                else:
                    t += transfer.seconds(batch)
            done = now + t + batch_overhead
            batches.append(batch)
            batch_start.append(now)
            batch_finish.append(done)
            heappush(completions, (done, b))
        wake = plan.wake_at
        if wake <= now:
            if not (plan.batches or plan.evict or plan.finish or plan.placement):
                raise RuntimeError(f"policy asked to be woken at {wake} <= now={now} and did nothing")
            wake = now  # it made progress and wants another look at once

    stranded = sum(1 for s in state if s != _DONE)
    if stranded:
        raise RuntimeError(
            f"{stranded} requests were never answered: the policy left them queued (or held between "
            "steps) with no wake-up (e.g. max_wait=inf with no deadline and a partial batch)"
        )

    batch_idx = np.asarray(batch_of, dtype=np.int64)
    ran = batch_idx >= 0
    cell_batch = np.zeros(n, dtype=np.int64)
    cell_seq = np.zeros(n, dtype=np.int64)
    cell_gamma = np.zeros(n, dtype=np.int64)
    if batches:
        cb = np.array([[b.cell.batch, b.cell.seq, b.cell.gamma] for b in batches], dtype=np.int64)
        cell_batch[ran] = cb[batch_idx[ran], 0]
        cell_seq[ran] = cb[batch_idx[ran], 1]
        cell_gamma[ran] = cb[batch_idx[ran], 2]
    start_arr = np.asarray(start, dtype=np.float64)
    start_arr[~ran] = np.nan
    return SimResult(
        arrival=trace.arrival.copy(),
        deadline=deadline_arr,
        length=trace.length.copy(),
        start=start_arr,
        finish=np.asarray(finish, dtype=np.float64),
        outcome=np.asarray(outcome, dtype=np.int8),
        batch=batch_idx,
        cell_batch=cell_batch,
        cell_seq=cell_seq,
        cell_gamma=cell_gamma,
        batch_start=np.asarray(batch_start, dtype=np.float64),
        batch_finish=np.asarray(batch_finish, dtype=np.float64),
        batch_count=np.array([len(b.request_ids) for b in batches], dtype=np.int64),
        batch_instance=np.array([b.instance for b in batches], dtype=np.int64),
        instances=instances,
    )
