"""Arlo's Runtime Scheduler (§3.3): a sliding window of request lengths and a periodic exact
re-solve of the allocation (:mod:`jaxserve.sched.arlo.allocation`), answered with the new
allocation and its replacement plan. The driver's contract is on :class:`RuntimeScheduler`.

Decisions where the paper is ambiguous or silent (each one is tested):

* **Q_i from a sliding window** (:class:`RuntimeScheduler`): the paper's "average
  number of requests during a period of the SLO" -- the window's counts scaled to
  one SLO period and rounded to integers by largest remainder, so the total is the
  rounded total. ``M_i = max{b : L_i(b) <= SLO}`` (at least 1), so the capacity
  window is the SLO, consistent with the paper.
* **Ties** between equally good allocations are broken toward the current one
  (fewest replacements): the current allocation is kept when it is feasible and
  no worse than the optimum (plus an optional relative ``hysteresis``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from jaxserve.sched.arlo._common import _capacity
from jaxserve.sched.arlo.allocation import (
    Allocation,
    AllocationProblem,
    Move,
    _result,
    allocation_objective,
    demand_per_window,
    replacement_plan,
    solve_allocation,
)
from jaxserve.sched.arlo.groups import GroupCostModel, group_capacity, grouping_objective, solve_groups
from jaxserve.sched.base import bucket_for_length


@dataclass(frozen=True)
class Reallocation:
    """A new allocation and the replacement plan that realises it."""

    time: float
    demand: tuple[int, ...]
    allocation: Allocation
    moves: tuple[Move, ...]


class RuntimeScheduler:
    """§3.3 driver: a sliding window of observed lengths and a periodic exact re-solve.

    ``observe(length, now)`` records one arrival; ``maybe_reallocate(now, assignment)``
    re-solves once ``period`` seconds (default 120, as in the paper) have passed since
    the last solve and returns the new
    allocation and its replacement plan, or ``None``. ``Q_i`` is the window's count
    per runtime bin, scaled to one SLO period (the paper's capacity window) over
    ``min(window, now - first observation)``. With no observation in the window,
    nothing changes. The current allocation is kept when it is feasible and within
    ``hysteresis`` (relative) of the optimum, so ties never cause replacements.
    ``solver="milp"`` solves stop after ``milp_time_limit`` seconds (default 1) with the
    best allocation found: a solve runs inside the callback of the request that made it due.

    ``headroom < 1`` (ours, not the paper's: default 1) computes ``M_i`` against
    ``headroom * SLO``, so no runtime is planned at 100 % of its capacity, where
    queueing delay explodes (the paper's fluid model does not see that).

    The first call only starts the clock, and the first solve comes ``warmup``
    seconds later (default: one ``period``). The paper does not say how Arlo is
    first deployed; :class:`ArloPolicy` starts from an even allocation and uses a
    10 s warmup so a mismatched start is corrected early.
    """

    def __init__(
        self,
        buckets: Sequence[int],
        latency: Sequence[Callable[[int], float]],
        slo: float,
        *,
        period: float = 120.0,
        window: float | None = None,
        solver: str = "dp",
        hysteresis: float = 0.0,
        warmup: float | None = None,
        headroom: float = 1.0,
        milp_time_limit: float = 1.0,
    ) -> None:
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError("buckets must be strictly increasing")
        if len(latency) != len(buckets):
            raise ValueError("one latency curve per bucket")
        self.buckets = tuple(buckets)
        self.latency = tuple(latency)
        self.slo = float(slo)
        if not 0 < headroom <= 1:
            raise ValueError("headroom must be in (0, 1]")
        self.capacity = tuple(_capacity(c, headroom * slo) for c in latency)
        self.period = float(period)
        self.window = float(window if window is not None else period)
        self.solver = solver
        self.milp_time_limit = float(milp_time_limit)
        self.hysteresis = float(hysteresis)
        self.warmup = self.period if warmup is None else float(warmup)
        self._seen: deque[tuple[float, int]] = deque()
        self._counts = [0] * len(buckets)
        self._first: float | None = None
        self._last_solve: float | None = None
        self._warm = False  # the first wait is `warmup`, later ones `period`
        self.solves = 0

    def runtime_of(self, length: int) -> int:
        return self.buckets.index(bucket_for_length(length, self.buckets))

    def observe(self, length: int, now: float) -> None:
        rt = self.runtime_of(length)
        self._seen.append((now, rt))
        self._counts[rt] += 1
        if self._first is None:
            self._first = now

    def _expire(self, now: float) -> None:
        seen, counts, horizon = self._seen, self._counts, now - self.window
        while seen and seen[0][0] <= horizon:
            counts[seen.popleft()[1]] -= 1

    def demand(self, now: float) -> tuple[int, ...]:
        """``Q_i`` per SLO period from the current window."""
        self._expire(now)
        if self._first is None:
            return (0,) * len(self.buckets)
        span = min(self.window, now - self._first)
        if span <= 0:
            span = self.slo
        return demand_per_window(self._counts, span, self.slo)

    def problem(self, demand: Sequence[int], instances: int) -> AllocationProblem:
        return AllocationProblem(tuple(demand), self.capacity, instances, self.latency)

    def due(self, now: float) -> bool:
        """Whether a period has passed since the last solve (the first call starts the clock)."""
        if self._last_solve is None:
            self._last_solve = now
            return False
        return now - self._last_solve >= (self.period if self._warm else self.warmup)

    def maybe_reallocate(
        self,
        now: float,
        assignment: Mapping[int, int],
        load: Mapping[int, float] | None = None,
    ) -> Reallocation | None:
        if not self.due(now):
            return None
        self._last_solve = now
        self._warm = True
        self._expire(now)
        if not self._seen or not assignment:
            return None
        return self.reallocate(now, assignment, load)

    def reallocate(
        self,
        now: float,
        assignment: Mapping[int, int],
        load: Mapping[int, float] | None = None,
    ) -> Reallocation:
        """Solve now, whatever the period (the periodic path calls this)."""
        demand = self.demand(now)
        problem = self.problem(demand, len(assignment))
        best = solve_allocation(problem, self.solver, self.milp_time_limit)
        self.solves += 1
        current = [0] * len(self.buckets)
        for rt in assignment.values():
            current[rt] += 1
        lb, _ = problem.lower_bounds()
        if all(c >= b for c, b in zip(current, lb)):
            cost = allocation_objective(problem, current)
            if cost <= best.objective * (1.0 + self.hysteresis) + 1e-9 * max(1.0, abs(best.objective)):
                best = _result(problem, current, best.feasible, best.solver + "+kept")
        return Reallocation(now, demand, best, replacement_plan(assignment, best.counts, load))


class GroupScheduler(RuntimeScheduler):
    """The Runtime Scheduler for runtime groups (:mod:`jaxserve.sched.arlo.groups`): the same
    window, period, warmup and driver contract as :class:`RuntimeScheduler`, but each solve
    chooses the groups and their instances with :func:`~jaxserve.sched.arlo.groups.solve_groups`
    from the window's request *rates* per runtime (requests per second, not per SLO window: the
    queueing estimate needs rates). So the runtime set that has instances -- the groups' longest
    runtimes -- is re-chosen from the observed length distribution at every period, together
    with the allocation (§3.3 chooses the runtimes once, offline, from the staircase).

    ``capacity`` (Alg. 1's ``M`` per runtime) changes with the groups; the policy hands it to
    its dispatcher after each solve. The current allocation is kept when its estimate is within
    ``hysteresis`` (relative, default 2 %) of the optimum, so noise in the window does not move
    instances back and forth.
    """

    def __init__(
        self,
        buckets: Sequence[int],
        latency: Sequence[Callable[[int], float]],
        slo: float,
        groups: GroupCostModel,
        *,
        hysteresis: float = 0.02,
        **kw,
    ) -> None:
        super().__init__(buckets, latency, slo, hysteresis=hysteresis, **kw)
        self.groups = groups
        self.capacity = group_capacity(groups, [0.0] * len(buckets), [0] * (len(buckets) - 1) + [1])

    def rates(self, now: float) -> tuple[float, ...]:
        """Requests per second per runtime over the window."""
        self._expire(now)
        if self._first is None:
            return (0.0,) * len(self.buckets)
        span = min(self.window, now - self._first)
        span = span if span > 0 else self.slo
        return tuple(c / span for c in self._counts)

    def reallocate(
        self,
        now: float,
        assignment: Mapping[int, int],
        load: Mapping[int, float] | None = None,
    ) -> Reallocation:
        rates = self.rates(now)
        g = len(assignment)
        best = solve_groups(self.groups, rates, g)
        self.solves += 1
        current = [0] * len(self.buckets)
        for rt in assignment.values():
            current[rt] += 1
        counts = best.counts
        if current[-1] >= 1:
            kept = grouping_objective(self.groups, rates, current)
            if kept <= best.objective * (1.0 + self.hysteresis) + 1e-12:
                counts = tuple(current)
        self.capacity = group_capacity(self.groups, rates, counts)
        demand = demand_per_window(self._counts, max(min(self.window, now - (self._first or now)), self.slo),
                                   self.slo)
        alloc = Allocation(tuple(counts), grouping_objective(self.groups, rates, counts), True, "groups")
        return Reallocation(now, demand, alloc, replacement_plan(assignment, counts, load))
