"""Arlo as a :class:`~jaxserve.sched.base.Policy` (§3.1): the Runtime Scheduler (§3.3), the
Request Scheduler (§3.4) and autoscaling (§4) behind the engine's hooks, for one text model
(one request stream). One runtime per sequence bucket; by default each instance serves a
*group* of consecutive runtimes (:mod:`jaxserve.sched.arlo.groups`), with ``shared_runtimes=False``
exactly one (the paper's deployment); each instance has a FIFO queue. The contract, and where we
differ from the paper (runtime groups, batches up to the profile's max batch, re-dispatch of
queued requests, the switching charge, the scale pool), are on :class:`ArloPolicy`.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from jaxserve.sched.arlo._common import _INF
from jaxserve.sched.arlo.allocation import LatencyCurve
from jaxserve.sched.arlo.autoscale import ScaleDecision, TargetTrackingAutoscaler
from jaxserve.sched.arlo.dispatch import DISPATCHERS, MultiLevelDispatcher
from jaxserve.sched.arlo.groups import GroupCostModel, profile_max_batch
from jaxserve.sched.arlo.runtime_scheduler import GroupScheduler, RuntimeScheduler
from jaxserve.sched.batching import DeadlineBatching
from jaxserve.sched.base import (
    Batch,
    Cell,
    CostModel,
    IdleInstances,
    LatencyProfile,
    Plan,
    Policy,
    Request,
    ShapeGrid,
    StepSummary,
    batch_size_for,
)


_NOTHING = Plan()  # a plan with nothing to do (frozen: one serves every such call)


@dataclass
class ArloCounters:
    """What :class:`ArloPolicy` reports for metrics."""

    dispatched: int = 0
    served: int = 0
    demotions: int = 0  # requests served by a longer runtime than their own bucket
    reallocations: int = 0  # solves of the runtime scheduler
    allocation_changes: int = 0  # solves that moved at least one instance
    instances_moved: int = 0
    redispatched: int = 0  # queued requests re-dispatched because their instance moved
    withdrawn: int = 0  # queued requests taken out because their client went away
    evicted: int = 0  # queued requests answered "evicted": their deadline could no longer be met
    scale_decisions: list[ScaleDecision] = field(default_factory=list)


class ArloPolicy(Policy):
    """Arlo as a :class:`~jaxserve.sched.base.Policy`, for one model (one request stream).

    * **Runtime groups** (``shared_runtimes=True``, the default; ours, not the paper's:
      :mod:`jaxserve.sched.arlo.groups` says why). An instance placed on runtime ``k``
      serves the group of runtimes after the previous deployed one up to ``k``, each
      batch in its requests' own bucket; the :class:`GroupScheduler` chooses the
      groups and their instances from the observed rates per runtime with queueing in
      the objective. The first allocation (before any length is seen) is one group of
      every runtime on all instances: nothing is padded beyond its bucket and every
      instance serves every request, whatever the lengths turn out to be (the paper
      does not say how Arlo starts; an even split of 2 instances over 9 runtimes put
      everything on the two longest). With ``shared_runtimes=False`` instance
      ``0..G-1`` each run exactly one runtime (§3.3), every batch in that runtime's
      bucket, allocated by Eq. 1-7 (:class:`RuntimeScheduler`); the initial allocation
      is then even (remainder to the longest runtimes). Either way
      ``initial_allocation`` (instances per runtime) overrides the start.
    * **Queues and batches.** One runtime per instance: each instance has a FIFO
      queue (§3.4: Alg. 1 picks the instance on arrival) and a batch takes its
      head, up to the max batch (``max_batch=None``, the default, takes each
      runtime's from the profile: :func:`~jaxserve.sched.arlo.groups.profile_max_batch`,
      the largest grid batch within half the SLO; an integer fixes it for every
      runtime, the paper's §5 uses 1), in the instance's runtime's bucket.
      Runtime groups: Alg. 1 still picks the group and charges the request to the
      least loaded instance of it (outstanding load, Fig. 5), but the request then
      waits in the group's queues and whichever instance of the group is idle
      first runs it (the charge moves with it). Inside a group, queues and batches
      are the project's deadline-aware batching (:class:`DeadlineBatching` over the
      runtimes up to the group's longest, so a demoted request still runs in its
      own bucket): a batch per runtime, as large as the profile says the head's
      deadline allows, padded rows filled and smaller runtimes merged while it
      pays, and a request that can no longer meet its deadline even alone answered
      ``evicted`` at once (``Plan.evict``; Triton's queue timeout). Ours, all of it:
      the paper's per-instance queues cannot share a request between GPUs, ours
      share every executable; the paper runs batch 1 and serves every request.
    * ``on_arrival`` records the length for the runtime scheduler and dispatches the
      request to an instance with the request scheduler (``dispatcher``: ``"arlo"``
      = Alg. 1, ``"ilb"``, ``"ig"``).
    * ``plan`` gives idle instances (the caller's truth) batches as above. With an
      :class:`~jaxserve.sched.base.IdleInstances` whose every call it saw (the
      simulator's), it looks only at instances that can have work it had not seen:
      those that became idle, those given a request, and those that were still
      switching, since its last plan (every other idle instance left that plan with
      an empty queue). Otherwise it looks at every idle instance with a queue. With
      runtime groups it keeps each group's idle instances from plan to plan (adding those
      that joined, dropping those it gave a batch, rebuilt whenever an instance is added,
      removed or moved, or a call went unseen), where it would otherwise sort every idle
      instance into its group at every plan: the same groups, in the same order.
    * Every callback first lets the runtime scheduler reallocate (``warmup``
      seconds after the first arrival, then every ``period``); an instance that switches runtime keeps its running batch, its
      queued requests are re-dispatched (nothing is lost), and with
      ``replacement_seconds > 0`` it starts no batch until the switch is done.
      Decision: a switching instance is charged, as dispatcher load, the requests
      its new runtime could have run in that time (released when the switch is
      done), so Alg. 1 sees it as busy rather than empty and does not pile the
      re-dispatched queue onto it while an instance that stayed sits idle. Moves
      apply at once, not "in small batches" (§4): in jaxserve a switch costs
      nothing (every runtime's executable is loaded in the process, so the
      default is 0 s); ``replacement_seconds`` models the paper's ~1 s swap in
      simulation only.
      With ``redispatch_queued`` (default; ours, the paper does not say what
      happens to queued requests) a reallocation that moves any instance
      re-dispatches *every* queued request, oldest first, not only the moved
      instances' ones: when the length distribution drifts, requests whose own
      runtime had no instance pile up on the longest runtime until the next
      solve, and without this that backlog stays there after the solve has
      deployed their runtimes (measured: bench/arlo_sim.py ``periodic``).
    * Outstanding load = queued + running requests, decremented on completion.
    * With an ``autoscaler``, completions feed it and its decisions are appended to
      ``counters.scale_decisions`` (for ``"in"`` the least busy instance is named).
      Who applies them: with ``scale_pool=None`` the driver that owns workers does,
      with :meth:`add_instance` / :meth:`remove_instance`. With ``scale_pool=P``
      the caller runs ``P`` worker slots (ids ``0..P-1``: ``simulate(...,
      instances=P)`` or ``Engine(..., instances=P)``) of which the policy uses
      only its *active* instances, and applies its own decisions: scale-out
      activates the lowest free id (one that is not active and runs nothing) with
      the longest runtime, scale-in deactivates the least busy instance (its
      queue is re-dispatched, a running batch still completes). Inactive slots
      are idle slots the policy never plans on, so neither the simulator nor the
      engine needs a notion of scaling; :attr:`instance_log` (time, active
      count) gives the time-weighted instance count of §5.1.3.
    * ``allocator`` replaces the :class:`RuntimeScheduler` by any object with its
      interface (``capacity``, ``observe``, ``due``, ``maybe_reallocate``): the
      INFaaS-like baseline plugs its headroom allocator in here. ``dispatcher``
      is a name (``"arlo"``, ``"ilb"``, ``"ig"``) or a
      :class:`MultiLevelDispatcher` subclass (the bin-packing baseline).
    * :meth:`_cell_for` is the one place a batch's executable is chosen with one
      runtime per instance (the instance's runtime bucket); the DT baseline
      overrides it.
    * :meth:`metrics` reports instances per runtime, demotions, reallocations,
      allocation changes and scaling for ``/metrics``.
    """

    name = "arlo"

    def __init__(
        self,
        model: str,
        grid: ShapeGrid,
        cost: CostModel | LatencyProfile,
        slo: float,
        instances: int,
        *,
        period: float = 120.0,
        window: float | None = None,
        dispatcher: str = "arlo",
        lam: float = 0.85,
        alpha: float = 0.9,
        peek: int = 6,
        max_batch: int | None = None,
        shared_runtimes: bool = True,
        solver: str = "dp",
        hysteresis: float | None = None,
        initial_allocation: Sequence[int] | None = None,
        replacement_seconds: float = 0.0,
        autoscaler: TargetTrackingAutoscaler | None = None,
        warmup: float = 10.0,
        headroom: float = 1.0,
        allocator=None,
        scale_pool: int | None = None,
        redispatch_queued: bool = True,
    ) -> None:
        if not grid.seq_buckets:
            raise ValueError("Arlo needs sequence buckets (one runtime per bucket)")
        profile = cost.latency[model] if isinstance(cost, CostModel) else cost
        self.model = model
        self.grid = grid
        self.buckets = grid.seq_buckets
        if max_batch is None:
            per_level = [profile_max_batch(profile, grid.batch_sizes, s, slo) for s in self.buckets]
        else:
            per_level = [max(1, min(int(max_batch), grid.max_batch))] * len(self.buckets)
        self.level_max_batch = tuple(per_level)
        self.max_batch = max(per_level)
        self._batch_sizes = tuple(b for b in grid.batch_sizes if b <= self.max_batch) or (grid.batch_sizes[0],)
        self._level_sizes = [tuple(b for b in grid.batch_sizes if b <= mb) or (grid.batch_sizes[0],)
                             for mb in per_level]
        self.shared = bool(shared_runtimes)
        self.slo = float(slo)
        if allocator is None:
            curves = [LatencyCurve(profile, s, mb) for s, mb in zip(self.buckets, per_level)]
            common = dict(period=period, window=window, solver=solver, warmup=min(warmup, period), headroom=headroom)
            if hysteresis is not None:
                common["hysteresis"] = hysteresis
            if self.shared:
                estimate = GroupCostModel(profile, self.buckets, grid.batch_sizes, per_level, slo)
                allocator = GroupScheduler(self.buckets, curves, slo, estimate, **common)
            else:
                allocator = RuntimeScheduler(self.buckets, curves, slo, **common)
        self.runtime = allocator
        if isinstance(dispatcher, str):
            if dispatcher not in DISPATCHERS:
                raise ValueError(f"unknown dispatcher {dispatcher!r}")
            dispatcher = DISPATCHERS[dispatcher]
        self.dispatcher: MultiLevelDispatcher = dispatcher(
            self.buckets, self.runtime.capacity, lam=lam, alpha=alpha, peek=peek
        )
        self.autoscaler = autoscaler
        if autoscaler is not None and autoscaler.longest_runtime is None:
            autoscaler.longest_runtime = len(self.buckets) - 1
        self.replacement_seconds = float(replacement_seconds)
        # requests one instance of each runtime runs per second at full batches: prices a switch
        self._rate = [mb / LatencyCurve(profile, s, mb)(mb)
                      for s, mb in zip(self.buckets, per_level)] if self.replacement_seconds > 0 else []
        self._charged: dict[int, int] = {}  # switching instance -> load charged until it is ready
        self.redispatch_queued = bool(redispatch_queued)
        self.counters = ArloCounters()
        self._queues: dict[int, deque[Request]] = {}
        self._filled: set[int] = set()  # every instance whose FIFO may hold requests (and some emptied since)
        # plan's look at changed instances only (class docstring): the IdleInstances and call count it
        # expects next, instances given a request since the last plan, and those it left waiting for a switch
        self._idle_seen: IdleInstances | None = None
        self._idle_calls = 0
        self._touched: set[int] = set()
        self._waiting: set[int] = set()
        # runtime groups, the same look: each level's idle active instances in increasing order as the
        # last plan left them, valid while _layout (bumped when an instance is added, removed or moved)
        # is the one they were built at
        self._group_idle: dict[int, list[int]] | None = None
        self._layout = 0
        self._group_layout = -1
        self._ready_at: dict[int, float] = {}
        self._running: dict[int, int] = {}  # request id -> instance
        self._arrival: dict[int, float] = {}
        self._pending: deque[Request] = deque()
        self._queued = 0
        # runtime groups: one FIFO per (group, runtime), shared by the group's instances, and the
        # instance Alg. 1 charged each queued request to (class docstring)
        self._cost_model = cost if isinstance(cost, CostModel) else CostModel({model: profile})
        self._batchers: dict[int, DeadlineBatching] = {}  # group (its longest runtime) -> its queues
        self._members: dict[int, dict[int, Request]] = {}  # group -> its queued requests by id
        self._owner: dict[int, int] = {}
        if instances < 1:
            raise ValueError("Arlo needs at least one instance")
        if initial_allocation is not None:
            alloc = list(initial_allocation)
        elif self.shared:  # one group of every runtime (class docstring)
            alloc = [0] * (len(self.buckets) - 1) + [instances]
        else:
            alloc = _even(instances, len(self.buckets))
        if len(alloc) != len(self.buckets) or sum(alloc) != instances or min(alloc) < 0:
            raise ValueError("initial_allocation needs one count >= 0 per bucket summing to instances")
        if alloc[-1] < 1:  # Eq. 7: a request of any length must have an instance that fits it
            raise ValueError("initial_allocation must give the longest bucket an instance (Eq. 7)")
        if scale_pool is not None and scale_pool < instances:
            raise ValueError("scale_pool must be >= instances")
        self.scale_pool = scale_pool
        inst = 0
        for rt, n in enumerate(alloc):
            for _ in range(n):
                self.add_instance(inst, 0.0, runtime=rt)
                inst += 1
        self.instance_log: list[tuple[float, int]] = [(0.0, instances)]

    # -- instances ---------------------------------------------------------------
    def assignment(self) -> dict[int, int]:
        d = self.dispatcher
        return {i: d.level_of(i) for i in d.instances()}

    def instances_per_runtime(self) -> dict[int, int]:
        return dict(zip(self.buckets, self.dispatcher.instances_per_level()))

    def add_instance(self, instance: int, now: float, runtime: int | None = None) -> None:
        """A new worker (scale-out): runs ``runtime`` (default: the longest)."""
        rt = len(self.buckets) - 1 if runtime is None else runtime
        self.dispatcher.add_instance(instance, rt)
        self._queues[instance] = deque()
        self._ready_at[instance] = now
        self._layout += 1
        self._drain_pending()

    def remove_instance(self, instance: int, now: float) -> None:
        """Release a worker (scale-in); its queued requests are re-dispatched.

        A batch it is running still completes through ``on_completion``.
        """
        queue = self._queues.pop(instance)
        self._ready_at.pop(instance, None)
        self._layout += 1
        self._charged.pop(instance, None)
        # runtime groups: the group may lose its last instance, so every queued request goes again
        displaced = self._unqueue_groups() if self.shared else list(queue)
        self.dispatcher.remove_instance(instance)
        self._queued -= len(queue)
        displaced.sort(key=lambda r: (r.arrival, r.id))
        self._redispatch(displaced)

    # -- Policy hooks --------------------------------------------------------------
    def on_arrival(self, request: Request, now: float) -> None:
        if request.model != self.model:
            raise ValueError(f"ArloPolicy serves {self.model!r}, not {request.model!r}")
        self.runtime.observe(request.length, now)  # raises for a too-long request
        self._tick(now)
        self.counters.dispatched += 1
        self._place(request)

    def on_completion(self, batch: Batch, now: float,
                      summaries: Mapping[int, StepSummary] | None = None) -> None:
        n = 0
        for rid in batch.request_ids:
            if self._running.pop(rid, None) is not None:
                n += 1
                arrival = self._arrival.pop(rid)
                if self.autoscaler is not None:
                    self.autoscaler.observe(now - arrival, now)
        self.dispatcher.complete(batch.instance, n)
        if self.autoscaler is not None:
            decision = self.autoscaler.decide(now, len(self._queues))
            if decision is not None:
                if decision.action == "in":
                    decision = ScaleDecision(decision.time, "in", None, self._least_busy(), decision.p98)
                self.counters.scale_decisions.append(decision)
                if self.scale_pool is not None:
                    self._apply_scaling(decision, now)
        self._tick(now)

    def plan(self, now: float, idle_instances: Sequence[int]) -> Plan:
        self._tick(now)
        if self.shared:
            return self._plan_groups(now, idle_instances)
        if not isinstance(idle_instances, (list, tuple)):
            idle_instances = list(idle_instances)
        batches = []
        wake = _INF
        queues = self._queues
        filled = self._idle_filled(idle_instances)
        waiting = self._waiting
        waiting.clear()
        if not filled:
            return _NOTHING
        for inst in filled:
            queue = queues.get(inst)
            if not queue:
                self._filled.discard(inst)
                continue
            ready = self._ready_at[inst]
            if ready > now:
                wake = min(wake, ready)
                waiting.add(inst)
                continue
            rt = self.dispatcher.level_of(inst)
            k = min(len(queue), self.level_max_batch[rt])
            taken = [queue.popleft() for _ in range(k)]
            self._queued -= k
            own = self.dispatcher.fitting_level
            for req in taken:
                self._running[req.id] = inst
                if own(req.length) < rt:
                    self.counters.demotions += 1
            self.counters.served += k
            batches.append(Batch(tuple(r.id for r in taken), self.model, self._cell_for(rt, taken), inst))
        return Plan(batches=tuple(batches), wake_at=wake)

    def _idle_filled(self, idle_instances: Sequence[int]) -> list[int] | set[int]:
        """The idle instances whose FIFO may hold requests, in the caller's order (its
        :meth:`plan`, per-instance queues; class docstring)."""
        touched = self._touched
        self._touched = set()
        if type(idle_instances) is IdleInstances:
            seen = idle_instances is self._idle_seen and idle_instances.calls == self._idle_calls
            self._idle_seen, self._idle_calls = idle_instances, idle_instances.calls + 1
            if seen:
                touched.update(idle_instances.joined)
                touched.update(self._waiting)
                touched.intersection_update(self._filled)
                holds = idle_instances.holds
                filled = [w for w in touched if holds(w)]
                if len(filled) > 1:
                    filled.sort()  # increasing: the caller's order
                return filled
        else:
            self._idle_seen = None
        # A set intersection in C instead of a look at every idle instance in Python.
        filled = self._filled.intersection(idle_instances)
        if len(filled) > 1:  # back into the caller's order (first position of each id)
            position = {w: i for i, w in reversed(list(enumerate(idle_instances)))}
            filled = sorted(filled, key=position.__getitem__)
        return filled

    def _group_idle_now(self, idle_instances: Sequence[int]) -> dict[int, list[int]] | None:
        """Each level's idle active instances in increasing order, kept from the last plan
        (class docstring: ``plan``), or None where the caller's sequence must be read whole."""
        if type(idle_instances) is not IdleInstances:
            self._idle_seen = self._group_idle = None
            return None
        seen = idle_instances is self._idle_seen and idle_instances.calls == self._idle_calls
        self._idle_seen, self._idle_calls = idle_instances, idle_instances.calls + 1
        groups = self._group_idle
        queues, level_of = self._queues, self.dispatcher.level_of
        if not seen or groups is None or self._group_layout != self._layout:
            groups = {}
            for inst in idle_instances:  # increasing
                if inst in queues:
                    groups.setdefault(level_of(inst), []).append(inst)
            self._group_idle, self._group_layout = groups, self._layout
            return groups
        holds = idle_instances.holds
        for inst in idle_instances.joined:
            if inst in queues and holds(inst):
                group = groups.setdefault(level_of(inst), [])
                i = bisect_left(group, inst)
                if i == len(group) or group[i] != inst:
                    group.insert(i, inst)
        return groups

    def _plan_groups(self, now: float, idle_instances: Sequence[int]) -> Plan:
        """Runtime groups: each group's batcher plans for the group's idle, ready instances."""
        kept = self._group_idle_now(idle_instances)
        members_of = self._members
        if not any(members_of.values()):
            return _NOTHING  # no group holds a request: no batch, no eviction, no wake-up
        d = self.dispatcher
        level_of = d.level_of
        queues, ready_at = self._queues, self._ready_at
        idle: dict[int, list[int]] = {}
        wake = _INF
        if kept is not None:
            # still switching (ready_at > now): the instances charged for a switch, since plan's _tick
            # released every charge whose switch is done
            switching = self._charged.keys()
            for level, members in members_of.items():
                group = kept.get(level)
                if not members or not group:
                    continue
                if switching and not switching.isdisjoint(group):
                    ready = []
                    for inst in group:
                        at = ready_at[inst]
                        if at > now:
                            wake = min(wake, at)
                        else:
                            ready.append(inst)
                    group = ready
                idle[level] = group
        else:
            for inst in idle_instances:
                if inst not in queues:
                    continue  # an inactive slot (scale pool)
                level = level_of(inst)
                if not members_of.get(level):
                    continue
                ready = ready_at[inst]
                if ready > now:
                    wake = min(wake, ready)
                    continue
                group = idle.get(level)
                if group is None:
                    idle[level] = [inst]
                else:
                    group.append(inst)
        batches: list[Batch] = []
        evict: list[int] = []
        for level, members in self._members.items():
            if not members:
                continue
            plan = self._batchers[level].plan(now, idle.get(level, ()))
            wake = min(wake, plan.wake_at)
            for rid in plan.evict:
                del members[rid]
                d.complete(self._owner.pop(rid), 1)
                self._arrival.pop(rid, None)
                evict.append(rid)
            for batch in plan.batches:
                inst = batch.instance
                for rid in batch.request_ids:
                    req = members.pop(rid)
                    owner = self._owner.pop(rid)
                    if owner != inst:  # the charge moves to the instance that runs it
                        d.complete(owner, 1)
                        d.charge(inst, 1)
                    self._running[rid] = inst
                    if d.deployed_level(req.length) < level:
                        self.counters.demotions += 1
                self.counters.served += len(batch.request_ids)
                batches.append(batch)
        if kept is not None:  # the instances given a batch are idle no longer
            for batch in batches:
                group = kept[level_of(batch.instance)]
                del group[bisect_left(group, batch.instance)]
        self._queued -= len(evict) + sum(len(b.request_ids) for b in batches)
        self.counters.evicted += len(evict)
        return Plan(batches=tuple(batches), evict=tuple(evict), wake_at=wake)

    def queue_depth(self) -> int:
        return self._queued + len(self._pending)

    def withdraw(self, request_id: int, now: float) -> bool:
        """Take a queued request out (its client went away): out of its instance's FIFO
        (that instance's outstanding load drops by one, as for a completion) or out of
        the requests waiting for a runtime. Its length stays in the runtime scheduler's
        window: it did arrive, and the allocation sizes for what arrives."""
        for inst, queue in self._queues.items():
            for r in queue:
                if r.id == request_id:
                    queue.remove(r)
                    self._queued -= 1
                    self.dispatcher.complete(inst, 1)
                    self._arrival.pop(request_id, None)
                    self.counters.withdrawn += 1
                    return True
        for level, members in self._members.items():
            if request_id in members:
                del members[request_id]
                self._batchers[level].withdraw(request_id, now)
                self._queued -= 1
                self.dispatcher.complete(self._owner.pop(request_id), 1)
                self._arrival.pop(request_id, None)
                self.counters.withdrawn += 1
                return True
        for r in self._pending:
            if r.id == request_id:
                self._pending.remove(r)
                self.counters.withdrawn += 1
                return True
        return False

    def reprice(self, cost_model: CostModel, now: float) -> None:
        """Plan with the engine's measured prices: the groups' queues (their dispatch-by and
        eviction times) and the group solver's queueing estimate take ``cost_model`` from now
        on. Each runtime's max batch and the paper deployment's Eq. 1-7 curves stay as
        profiled: they shape the runtimes, which a price correction does not re-cut."""
        self._cost_model = cost_model
        for b in self._batchers.values():
            b.reprice(cost_model, now)
        if isinstance(self.runtime, GroupScheduler):
            self.runtime.groups = GroupCostModel(cost_model.latency[self.model], self.buckets, self.grid.batch_sizes,
                                                 self.level_max_batch, self.slo)

    def _batcher(self, level: int) -> DeadlineBatching:
        """The queues of the group whose longest runtime is ``level``: deadline batching over
        runtimes ``0..level`` (a request demoted from a shorter group still runs in its own
        bucket), batch sizes up to the largest max batch among them."""
        b = self._batchers.get(level)
        if b is None:
            top = max(self.level_max_batch[: level + 1])
            sizes = tuple(x for x in self.grid.batch_sizes if x <= top) or (self.grid.batch_sizes[0],)
            grid = ShapeGrid(batch_sizes=sizes, seq_buckets=self.buckets[: level + 1])
            b = self._batchers[level] = DeadlineBatching({self.model: grid}, self._cost_model,
                                                         max_queue=1 << 62, max_wait=0.0)
            self._members[level] = {}
        return b

    def _unqueue_groups(self) -> list[Request]:
        """Take every request out of the groups' queues, uncharging their instances."""
        out: list[Request] = []
        d = self.dispatcher
        for members in self._members.values():
            for rid, req in members.items():
                d.complete(self._owner.pop(rid), 1)
                out.append(req)
        self._batchers.clear()  # emptied: the next request of a group starts a fresh one
        self._members.clear()
        self._queued -= len(out)
        return out

    def _cell_for(self, level: int, requests: Sequence[Request]) -> Cell:
        """The executable a batch of ``requests`` runs in: runtime ``level``'s bucket (the
        instance's runtime, or in runtime groups the requests' own)."""
        return Cell(batch_size_for(len(requests), self._level_sizes[level]), self.buckets[level])

    # -- observability ---------------------------------------------------------------
    def metrics(self) -> Iterable[tuple[str, dict[str, str], float]]:
        """``(name, labels, value)`` for ``/metrics`` (``jaxserve_policy_<name>``)."""
        for seq, n in self.instances_per_runtime().items():
            yield "instances", {"runtime": str(seq)}, n
        c = self.counters
        for name in ("dispatched", "served", "demotions", "reallocations", "allocation_changes",
                     "instances_moved", "redispatched", "withdrawn", "evicted"):
            yield name, {}, getattr(c, name)
        outs = sum(1 for d in c.scale_decisions if d.action == "out")
        yield "scale_decisions", {"action": "out"}, outs
        yield "scale_decisions", {"action": "in"}, len(c.scale_decisions) - outs
        yield "queued", {}, self.queue_depth()

    def time_weighted_instances(self, end: float) -> float:
        """Mean number of active instances from time 0 to ``end`` (§5.1.3, Fig. 8)."""
        if end <= 0:
            return float(self.instance_log[-1][1])
        total = 0.0
        log = self.instance_log + [(end, self.instance_log[-1][1])]
        for (t0, n), (t1, _) in zip(log, log[1:]):
            total += n * (min(t1, end) - min(t0, end))
        return total / end

    def _least_busy(self) -> int | None:
        """The scale-in victim: the least busy instance (ties: highest id), never the
        last instance of the longest runtime (Eq. 7: every length must stay servable)."""
        d = self.dispatcher
        loads = d.loads()
        last = len(self.buckets) - 1
        if d.instances_per_level()[last] == 1:
            loads = {i: v for i, v in loads.items() if d.level_of(i) != last}
        return min(loads, key=lambda i: (loads[i], -i)) if loads else None

    def _apply_scaling(self, decision: ScaleDecision, now: float) -> None:
        """Apply an autoscaling decision inside ``scale_pool`` worker slots (class docstring)."""
        if decision.action == "out":
            busy = set(self._running.values())
            free = [i for i in range(self.scale_pool) if i not in self._queues and i not in busy]
            if not free:
                return
            self.add_instance(free[0], now)
        elif decision.instance is not None and len(self._queues) > 1:
            self.remove_instance(decision.instance, now)
        else:
            return
        self.instance_log.append((now, len(self._queues)))

    # -- internals -------------------------------------------------------------------
    def _enqueue(self, inst: int, request: Request) -> deque[Request] | None:
        """Queue ``request``, charged to ``inst``: on ``inst``'s FIFO (returned), or in the
        queues of ``inst``'s group (runtime groups; ``None``)."""
        self._queued += 1
        if not self.shared:
            q = self._queues[inst]
            q.append(request)
            self._filled.add(inst)
            self._touched.add(inst)
            return q
        level = self.dispatcher.level_of(inst)
        self._batcher(level).on_arrival(request, request.arrival)
        self._members[level][request.id] = request
        self._owner[request.id] = inst
        return None

    def _place(self, request: Request) -> int | None:
        inst = self.dispatcher.dispatch(request.length)
        if inst is None:
            self._pending.append(request)
            return None
        self._enqueue(inst, request)
        self._arrival[request.id] = request.arrival
        return inst

    def _redispatch(self, requests: Iterable[Request]) -> None:
        touched: dict[int, deque[Request]] = {}
        for req in requests:
            self.counters.redispatched += 1
            inst = self.dispatcher.dispatch(req.length)
            if inst is None:
                self._pending.append(req)
                continue
            q = self._enqueue(inst, req)
            if q is not None:
                touched[id(q)] = q
        for q in touched.values():  # keep every queue FIFO by arrival
            items = sorted(q, key=lambda r: (r.arrival, r.id))
            q.clear()
            q.extend(items)

    def _drain_pending(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, deque()
            for req in pending:
                self._place(req)

    def _tick(self, now: float) -> None:
        if self._charged:
            for inst in [i for i in self._charged if self._ready_at[i] <= now]:
                self.dispatcher.complete(inst, self._charged.pop(inst))  # its switch is done
        if not self.runtime.due(now):  # cheap check first: the solve needs O(G) snapshots
            return
        d = self.dispatcher
        realloc = self.runtime.maybe_reallocate(now, self.assignment(), d.loads())
        if realloc is None:
            return
        self.counters.reallocations += 1
        if isinstance(self.runtime, GroupScheduler):  # the groups' capacities changed with them
            d.set_capacity(self.runtime.capacity)
        moved = [mv for mv in realloc.moves if mv.source is not None and mv.target is not None]
        if not moved:
            return
        self.counters.allocation_changes += 1
        self.counters.instances_moved += len(moved)
        displaced: list[Request] = self._unqueue_groups() if self.shared else []
        for mv in moved:
            queue = self._queues[mv.instance]
            load = d.load(mv.instance) - len(queue) - self._charged.pop(mv.instance, 0)
            if self.replacement_seconds > 0:  # busy switching (class docstring)
                self._charged[mv.instance] = math.ceil(self.replacement_seconds * self._rate[mv.target])
                load += self._charged[mv.instance]
            d.move_instance(mv.instance, mv.target, load)
            self._queued -= len(queue)
            displaced.extend(queue)
            queue.clear()
            self._ready_at[mv.instance] = now + self.replacement_seconds
        self._layout += 1
        if self.redispatch_queued:  # every queued request may now have a better instance (class docstring)
            for inst, queue in self._queues.items():
                if queue:
                    d.complete(inst, len(queue))
                    self._queued -= len(queue)
                    displaced.extend(queue)
                    queue.clear()
        displaced.sort(key=lambda r: (r.arrival, r.id))
        self._redispatch(displaced)
        self._drain_pending()  # a move may have deployed a runtime that held requests were waiting for


def _even(instances: int, runtimes: int) -> list[int]:
    base, extra = divmod(instances, runtimes)
    return [base + (1 if rt >= runtimes - extra else 0) for rt in range(runtimes)]
