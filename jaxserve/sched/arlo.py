"""Arlo (Tan et al., ICPP '24): polymorphing with a runtime and a request scheduler.

One runtime per sequence-length bucket ("polymorph" ``Cell(batch, seq=bucket)``);
every instance (GPU worker) runs exactly one runtime at a time. Four pieces, all
plain Python (no JAX, no threads, no wall clock: ``now`` is always an argument):

* **Runtime Scheduler (§3.3, Eq. 1-7)** -- how many instances ``N_i`` each runtime
  gets, solved exactly twice over (:func:`solve_allocation_dp`,
  :func:`solve_allocation_milp`), the minimum replacement plan that realises a new
  allocation (:func:`replacement_plan`) and the periodic driver
  (:class:`RuntimeScheduler`).
* **Request Scheduler (§3.4, Alg. 1)** -- the multi-level queue
  (:class:`MultiLevelDispatcher`) and the two baselines of §5.3, ILB
  (:class:`IntraGroupBalance`) and IG (:class:`InterGroupGreedy`).
* **Autoscaling (§4)** -- target tracking on the p98 latency
  (:class:`TargetTrackingAutoscaler`).
* :class:`ArloPolicy` -- the three together, a :class:`~jaxserve.sched.base.Policy`.

The allocation problem, as implemented
--------------------------------------
Runtimes ``i = 1..I`` are sorted by bucket. ``Q_i`` (integer) is the number of
requests of bin ``i`` (lengths in ``(bucket_{i-1}, bucket_i]``) per *capacity
window*; ``M_i >= 1`` (integer) is how many requests one instance of runtime ``i``
serves within the SLO in that window; ``L_i(b)`` is the latency of an instance of
runtime ``i`` that carries a workload of ``b`` requests per window, read from the
profiled latency of its executables (the paper's "mapping from batch size to mean
latency"). Decision: beyond one batch, ``L_i(b)`` is the time to drain ``b`` requests
in full batches (:class:`LatencyCurve`), i.e. the last request's latency, not the mean
over the ``b`` (about half of it at batch 1): it is what decides whether the window's
requests all meet the SLO, which is what ``M_i`` counts. ``G`` instances in all::

    min   sum_i  N_i * g^_i(C_i / N_i)                              (1)  [= sum L_i(B_i) C_i]
    s.t.  sum_i N_i = G                                             (2)
          N_i >= floor(Q_i / M_i)                 for all i         (3)
          R_0 = 0,  R_i = max(R_{i-1} + Q_i - N_i M_i, 0)           (4)
          C_i = min(R_{i-1} + Q_i, N_i M_i)  (i < I),  C_I = R_{I-1} + Q_I   (5)
          B_i = C_i / N_i                                           (6)
          N_I >= 1                                                  (7)
          N_i integer >= 0

Decisions where the paper is ambiguous or silent (each one is tested):

* **Eq. 1 at fractional B_i.** The paper writes ``L_i(B_i) * C_i`` with
  ``B_i = C_i / N_i``; Eq. 6 says the ``C_i`` requests are spread evenly over the
  ``N_i`` instances. With whole requests that means ``C_i mod N_i`` instances carry
  ``ceil(B_i)`` requests and the others ``floor(B_i)``, so the total latency is
  ``(N_i - r) g_i(k) + r g_i(k+1)`` with ``k = C_i // N_i``, ``r = C_i mod N_i`` and
  ``g_i(b) = b L_i(b)``; this equals ``N_i g^_i(C_i / N_i)`` where ``g^_i`` is ``g_i``
  linearly interpolated between integers, and equals the paper's
  ``L_i(B_i) C_i`` exactly whenever ``B_i`` is an integer. This is what makes the
  problem solvable exactly by a MILP: on each segment ``[k, k+1]``,
  ``N g^(C/N) = u_k C + v_k N`` is linear in ``(C, N)``.
* **N_i = 0.** Runtime ``i`` is not deployed, serves nothing (``C_i = 0``, cost 0)
  and passes all of ``R_{i-1} + Q_i`` on (Eq. 4-5 read literally).
* **Overflow goes up, never down.** Eq. 4-5 carry unserved requests only to the
  next longer runtime (a request fits any runtime whose bucket is >= its length);
  the longest runtime absorbs everything left (``C_I`` has no capacity cap, so an
  overloaded last runtime is priced by ``L_I`` at a workload above ``M_I``).
* **Infeasible Eq. 3** (``sum_i floor(Q_i/M_i) (+1 if that leaves N_I = 0) > G``):
  best effort. The lower bounds are scaled down proportionally
  (``floor(m_i G / sum m)``, then ``N_I >= 1`` restored by taking one from the
  largest other bound) and the problem is solved exactly with those bounds; the
  result says ``feasible=False``. ``G < 1`` is an error (Eq. 7).
* **L_i must be nondecreasing in the workload** (checked). It is what "latency"
  means here, and it makes the DP's dominance pruning exact (more carried overflow
  never lowers future cost) and lets it cap a runtime at ``max(n0, D)`` instances
  (beyond one request per instance more instances cannot help; such spare
  instances are equivalent to spare instances of the last runtime).
* **Q_i from a sliding window** (:class:`RuntimeScheduler`): the paper's "average
  number of requests during a period of the SLO" -- the window's counts scaled to
  one SLO period and rounded to integers by largest remainder, so the total is the
  rounded total. ``M_i = max{b : L_i(b) <= SLO}`` (at least 1), so the capacity
  window is the SLO, consistent with the paper.
* **Ties** between equally good allocations are broken toward the current one
  (fewest replacements): the current allocation is kept when it is feasible and
  no worse than the optimum (plus an optional relative ``hysteresis``).

Request Scheduler decisions are documented on :class:`MultiLevelDispatcher`, the
autoscaler's on :class:`TargetTrackingAutoscaler`, the policy's on
:class:`ArloPolicy`.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush, heapreplace
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from jaxserve.sched.base import (
    Batch,
    Cell,
    CostModel,
    LatencyProfile,
    Plan,
    Policy,
    Request,
    ShapeGrid,
    StepSummary,
    batch_size_for,
    bucket_for_length,
)

__all__ = [
    "LatencyCurve",
    "AllocationProblem",
    "Allocation",
    "allocation_problem",
    "allocation_objective",
    "solve_allocation_dp",
    "solve_allocation_milp",
    "solve_allocation",
    "Move",
    "replacement_plan",
    "Reallocation",
    "RuntimeScheduler",
    "demand_per_window",
    "MultiLevelDispatcher",
    "IntraGroupBalance",
    "InterGroupGreedy",
    "InterGroupGreedyByLoad",
    "ScaleDecision",
    "TargetTrackingAutoscaler",
    "ArloPolicy",
]

_INF = math.inf


# ---------------------------------------------------------------------------------
# Latency curves and the allocation problem
# ---------------------------------------------------------------------------------


class LatencyCurve:
    """``L(b)``: latency (s) of one runtime at a workload of ``b`` requests (module docstring).

    Built from one ``(seq)`` column of a :class:`LatencyProfile` with exactly the
    profile's own rule (:meth:`LatencyProfile.latency_for`: linear between profiled
    batch sizes, proportional beyond the largest one, i.e. the time to drain ``b``
    requests in full batches), restricted to batch sizes ``<= max_batch``, and made
    nondecreasing by a running maximum (profiling noise must not make more work
    look faster). Values are cached; calling the curve is a list lookup.
    """

    def __init__(self, profile: LatencyProfile, seq: int, max_batch: int | None = None) -> None:
        cells = sorted(c.batch for c in profile.seconds if c.seq == seq and c.gamma == 0)
        if not cells:
            raise KeyError(f"no profiled cell with seq={seq} for {profile.model}")
        lat = [profile.seconds[Cell(b, seq, 0)] for b in cells]
        if max_batch is not None and cells[0] > max_batch:
            # no cell holds only max_batch requests: they run padded in the smallest, which
            # then serves max_batch requests per run at that cell's latency
            cells, lat = [max_batch], lat[:1]
        elif max_batch is not None:
            lat = [t for b, t in zip(cells, lat) if b <= max_batch]
            cells = cells[:len(lat)]
        self.seq = seq
        self._batches = cells
        self._lat = lat
        self._values = [0.0]  # index b -> L(b); index 0 unused

    def _raw(self, b: int) -> float:
        bs, lat = self._batches, self._lat
        if b <= bs[0]:
            return lat[0]
        j = bisect_left(bs, b)
        if j < len(bs):
            lo, hi = bs[j - 1], bs[j]
            return lat[j - 1] + (lat[j] - lat[j - 1]) * (b - lo) / (hi - lo)
        return lat[-1] * b / bs[-1]

    def __call__(self, b: int) -> float:
        values = self._values
        if b >= len(values):
            last = values[-1]
            for k in range(len(values), b + 1):
                last = max(last, self._raw(k))
                values.append(last)
        return values[b]

    def capacity(self, slo: float) -> int:
        """``M``: the largest workload whose latency is within ``slo`` (at least 1)."""
        return _capacity(self, slo)


@dataclass(frozen=True)
class AllocationProblem:
    """One instance of Eq. 1-7: demand ``Q_i``, capacity ``M_i``, ``G`` and ``L_i``."""

    demand: tuple[int, ...]
    capacity: tuple[int, ...]
    instances: int
    latency: tuple[Callable[[int], float], ...]

    def __post_init__(self) -> None:
        n = len(self.demand)
        if n == 0 or len(self.capacity) != n or len(self.latency) != n:
            raise ValueError("demand, capacity and latency need one entry per runtime")
        if any(int(q) != q or q < 0 for q in self.demand):
            raise ValueError("demand must be non-negative integers")
        if any(int(m) != m or m < 1 for m in self.capacity):
            raise ValueError("capacity must be integers >= 1")
        if self.instances < 1:
            raise ValueError("Eq. 7 needs at least one instance")
        object.__setattr__(self, "demand", tuple(int(q) for q in self.demand))
        object.__setattr__(self, "capacity", tuple(int(m) for m in self.capacity))

    @property
    def runtimes(self) -> int:
        return len(self.demand)

    def minimum_instances(self) -> tuple[int, ...]:
        """Eq. 3 and Eq. 7 lower bounds, before any relaxation."""
        lb = [q // m for q, m in zip(self.demand, self.capacity)]
        lb[-1] = max(lb[-1], 1)
        return tuple(lb)

    def lower_bounds(self) -> tuple[tuple[int, ...], bool]:
        """The bounds the solvers use and whether Eq. 3 could be honoured.

        When it cannot, the bounds are scaled down proportionally (module docstring).
        """
        lb = list(self.minimum_instances())
        g = self.instances
        if sum(lb) <= g:
            return tuple(lb), True
        m = [q // c for q, c in zip(self.demand, self.capacity)]
        total = sum(m)
        lb = [mi * g // total for mi in m]
        if lb[-1] == 0:
            lb[-1] = 1
        if sum(lb) > g:
            j = max(range(len(lb) - 1), key=lambda k: lb[k])
            lb[j] -= 1
        return tuple(lb), False

    def workload_bound(self, lb: Sequence[int]) -> tuple[list[int], list[int]]:
        """Upper bounds of carried overflow ``R_i`` and of ``ceil(B_i)`` per runtime."""
        rmax, dmax, bmax = 0, [], []
        last = self.runtimes - 1
        for i, (q, m) in enumerate(zip(self.demand, self.capacity)):
            d = rmax + q
            dmax.append(d)
            if i < last:
                bmax.append(min(m, d // max(lb[i], 1) + 1))
                rmax = max(0, d - m * lb[i])
            else:
                bmax.append(d // max(lb[i], 1) + 1)
        return dmax, bmax

    def cost_table(self, i: int, upto: int) -> list[float]:
        """``g_i(b) = b * L_i(b)`` for ``b = 0..upto``; checks ``L_i`` is nondecreasing."""
        lat = self.latency[i]
        table = [0.0]
        prev = -_INF
        for b in range(1, upto + 1):
            v = float(lat(b))
            if v < prev - 1e-12 or v < 0:
                raise ValueError(f"latency of runtime {i} must be non-negative and nondecreasing in the workload")
            prev = v
            table.append(b * v)
        return table


def allocation_problem(
    demand: Sequence[int],
    buckets: Sequence[int],
    profile: LatencyProfile,
    instances: int,
    slo: float,
    max_batch: int | None = 1,
) -> AllocationProblem:
    """The allocation problem for one model's profiled runtimes (one per bucket)."""
    curves = tuple(LatencyCurve(profile, s, max_batch) for s in buckets)
    return AllocationProblem(
        demand=tuple(demand),
        capacity=tuple(c.capacity(slo) for c in curves),
        instances=instances,
        latency=curves,
    )


@dataclass(frozen=True)
class Allocation:
    """A solution: instances per runtime and its Eq. 1 value (seconds per window)."""

    counts: tuple[int, ...]
    objective: float
    feasible: bool  # False: Eq. 3 could not be honoured (best-effort bounds were used)
    solver: str = ""
    served: tuple[int, ...] = ()  # C_i
    overflow: tuple[int, ...] = ()  # R_i


def _split_cost(table: Sequence[float], c: int, n: int) -> float:
    """``n * g^(c / n)``: ``c`` requests spread evenly (in whole requests) over ``n`` instances."""
    if n <= 0 or c <= 0:
        return 0.0
    k, r = divmod(c, n)
    if r == 0:
        return n * table[k]
    return (n - r) * table[k] + r * table[k + 1]


def _cascade(problem: AllocationProblem, counts: Sequence[int]) -> tuple[list[int], list[int]]:
    """Eq. 4-5: requests served ``C_i`` and overflow ``R_i`` for given ``N_i``."""
    served, overflow = [], []
    r = 0
    last = problem.runtimes - 1
    for i, (q, m, n) in enumerate(zip(problem.demand, problem.capacity, counts)):
        d = r + q
        if i < last:
            c = min(d, n * m)
            r = d - c
        else:
            c, r = d, max(d - n * m, 0)
        served.append(c)
        overflow.append(r)
    return served, overflow


def allocation_objective(problem: AllocationProblem, counts: Sequence[int]) -> float:
    """Eq. 1 for the given ``N_i`` (Eq. 4-6 applied literally); does not check Eq. 2/3/7."""
    if len(counts) != problem.runtimes or any(n < 0 for n in counts):
        raise ValueError("need one non-negative count per runtime")
    served, _ = _cascade(problem, counts)
    total = 0.0
    for i, (c, n) in enumerate(zip(served, counts)):
        if c > 0 and n == 0:
            return _INF  # only the last runtime can be asked to serve with no instance
        if c > 0:
            total += _split_cost(problem.cost_table(i, c // n + 1), c, n)
    return total


def _result(problem: AllocationProblem, counts: Sequence[int], feasible: bool, solver: str) -> Allocation:
    counts = tuple(int(n) for n in counts)
    served, overflow = _cascade(problem, counts)
    return Allocation(
        counts=counts,
        objective=allocation_objective(problem, counts),
        feasible=feasible,
        solver=solver,
        served=tuple(served),
        overflow=tuple(overflow),
    )


# ---------------------------------------------------------------------------------
# Exact solver 1: dynamic programme over (runtime, instances used, overflow carried)
# ---------------------------------------------------------------------------------


def _minplus(values: np.ndarray, costs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``out[t] = min_k values[t - k] + costs[k]`` and its argmin ``k`` (t = 0..S+W-2)."""
    s, w = len(values), len(costs)
    if w == 1:
        return values + costs[0], np.zeros(s, dtype=np.int64)
    pad = np.full(s + 2 * (w - 1), _INF)
    pad[w - 1 : w - 1 + s] = values
    windows = np.lib.stride_tricks.sliding_window_view(pad, w)  # a view: no copy
    rev = costs[::-1]
    out = np.empty(len(windows))
    arg = np.empty(len(windows), dtype=np.int64)
    step = max(1, (1 << 22) // w)  # bound the temporary to ~32 MB whatever G is
    for start in range(0, len(windows), step):
        block = windows[start : start + step] + rev
        e = np.argmin(block, axis=1)
        out[start : start + step] = block[np.arange(len(e)), e]
        arg[start : start + step] = (w - 1) - e
    return out, arg


def solve_allocation_dp(problem: AllocationProblem) -> Allocation:
    """Exact DP over (runtime i, instances used so far x, overflow carried R_i).

    ``V_i[R](x)`` is the least Eq. 1 cost of runtimes ``1..i`` using ``x``
    instances and leaving ``R`` requests for longer runtimes; each ``R`` holds a
    numpy vector over ``x``. From ``(R, x)`` runtime ``i+1`` with ``n`` instances and
    ``D = R + Q_{i+1}`` either saturates (``n < ceil(D/M)``: ``C = nM``, new overflow
    ``D - nM``, cost ``n g(M)``) or absorbs everything (``R' = 0``, cost
    ``n g^(D/n)``; the latter is a min-plus convolution over ``n``). A state is
    dropped when a state with less overflow and no more cost exists for the same
    ``x`` (exact because ``L`` is nondecreasing). The last runtime takes the
    remaining ``G - x`` instances (Eq. 2).
    """
    lb, feasible = problem.lower_bounds()
    q, m, g_total = problem.demand, problem.capacity, problem.instances
    k_last = problem.runtimes - 1
    dmax, bmax = problem.workload_bound(lb)
    tables = [np.asarray(problem.cost_table(i, bmax[i] + 1)) for i in range(problem.runtimes)]
    suffix = [0] * (problem.runtimes + 1)
    for i in range(k_last, -1, -1):
        suffix[i] = suffix[i + 1] + lb[i]

    start = np.full(g_total + 1, _INF)
    start[0] = 0.0
    states: dict[int, np.ndarray] = {0: start}
    back: list[dict[int, tuple[np.ndarray, np.ndarray]]] = []

    for i in range(k_last):
        xmax = g_total - suffix[i + 1]
        mi, table = m[i], tables[i]
        saturated = float(table[mi]) if mi < len(table) else 0.0
        new: dict[int, np.ndarray] = {}
        bk: dict[int, tuple[np.ndarray, np.ndarray]] = {}

        def relax(rp: int, y0: int, vals: np.ndarray, prev_r: int, ns) -> None:
            arr = new.get(rp)
            if arr is None:
                arr = new[rp] = np.full(g_total + 1, _INF)
                bk[rp] = (np.full(g_total + 1, -1, dtype=np.int64), np.zeros(g_total + 1, dtype=np.int64))
            seg = arr[y0 : y0 + len(vals)]
            better = vals < seg
            if better.any():
                seg[better] = vals[better]
                pr, pn = bk[rp]
                pr[y0 : y0 + len(vals)][better] = prev_r
                if np.ndim(ns):
                    pn[y0 : y0 + len(vals)][better] = ns[better]
                else:
                    pn[y0 : y0 + len(vals)][better] = ns

        for r, arr in states.items():
            finite = np.flatnonzero(arr < _INF)
            lo, hi = int(finite[0]), int(finite[-1])
            if lo + lb[i] > xmax:
                continue
            d = r + q[i]
            n0 = -(-d // mi)
            # (a) runtime i saturated, overflow carried on
            for n in range(lb[i], min(n0, xmax - lo + 1)):
                top = min(hi, xmax - n)
                relax(d - n * mi, lo + n, arr[lo : top + 1] + n * saturated, r, n)
            # (b) runtime i absorbs everything
            a = max(lb[i], n0)
            b = min(max(a, d), xmax - lo)
            if a > b:
                continue
            ns = np.arange(a, b + 1)
            if d == 0:
                costs = np.zeros(len(ns))
            else:
                safe = np.maximum(ns, 1)
                k, rem = np.divmod(d, safe)
                costs = (safe - rem) * table[k] + rem * table[np.minimum(k + 1, len(table) - 1)]
            out, kk = _minplus(arr[lo : hi + 1], costs)
            y0 = lo + a
            keep = min(len(out), xmax - y0 + 1)
            relax(0, y0, out[:keep], r, (kk[:keep] + a))
        # dominance: less overflow and no more cost for the same x wins
        running = np.full(g_total + 1, _INF)
        for rp in sorted(new):
            arr = new[rp]
            arr[arr >= running] = _INF
            np.minimum(running, arr, out=running)
            if not np.isfinite(arr).any():
                del new[rp]
        states = new
        back.append(bk)

    # last runtime: N_I = G - x (Eq. 2), N_I >= lb_I >= 1 (Eq. 7)
    table = tables[k_last]
    best, best_r, best_x = _INF, -1, -1
    for r, arr in states.items():
        d = r + q[k_last]
        xs = np.arange(0, g_total - lb[k_last] + 1)
        vals = arr[xs]
        ok = np.isfinite(vals)
        if not ok.any():
            continue
        xs, vals = xs[ok], vals[ok]
        ns = g_total - xs
        k, rem = np.divmod(d, ns)
        tot = vals + (ns - rem) * table[k] + rem * table[np.minimum(k + 1, len(table) - 1)]
        j = int(np.argmin(tot))
        if tot[j] < best:
            best, best_r, best_x = float(tot[j]), r, int(xs[j])
    if best_r < 0:
        raise RuntimeError("no allocation satisfies the bounds")  # cannot happen: bounds sum <= G

    counts = [0] * problem.runtimes
    counts[k_last] = g_total - best_x
    r, x = best_r, best_x
    for i in range(k_last - 1, -1, -1):
        pr, pn = back[i][r]
        n = int(pn[x])
        counts[i] = n
        r, x = int(pr[x]), x - n
    return _result(problem, counts, feasible, "dp")


# ---------------------------------------------------------------------------------
# Exact solver 2: MILP with HiGHS
# ---------------------------------------------------------------------------------


def solve_allocation_milp(problem: AllocationProblem, time_limit: float = 60.0) -> Allocation:
    """Exact MILP of Eq. 1-7, solved by HiGHS (``highspy``).

    Variables: ``N_i`` integer; ``R_i >= 0`` with a binary ``d_i`` making
    ``R_i = max(R_{i-1} + Q_i - M_i N_i, 0)`` exact (big-M from the bounds); ``C_i``
    is substituted (``R_{i-1} + Q_i - R_i``, or ``R_{I-1} + Q_I``); ``t_i`` is the
    cost of runtime ``i``. Because ``N g^(C/N)`` is linear on each segment
    ``C/N in [k, k+1]`` (``u_k C + v_k N``), a convex ``g_i`` needs only the cuts
    ``t_i >= u_k C_i + v_k N_i`` (exact: their maximum is the perspective of the
    interpolated ``g_i``); a nonconvex one gets one binary per segment and
    big-M'd cuts. Gaps are set to (almost) zero so the optimum is exact.
    """
    import highspy

    lb, feasible = problem.lower_bounds()
    q, m, g_total = problem.demand, problem.capacity, problem.instances
    n_rt = problem.runtimes
    last = n_rt - 1
    dmax, bmax = problem.workload_bound(lb)
    ub = [g_total - (sum(lb) - lb[i]) for i in range(n_rt)]
    for i in range(last):  # more instances than requests cannot help (L nondecreasing): spares go last
        ub[i] = min(ub[i], max(lb[i], dmax[i]))

    col_lo: list[float] = []
    col_hi: list[float] = []
    integer: list[int] = []
    cost: list[float] = []

    def var(lo: float, hi: float, is_int: bool = False, c: float = 0.0) -> int:
        col_lo.append(lo)
        col_hi.append(hi)
        cost.append(c)
        if is_int:
            integer.append(len(col_lo) - 1)
        return len(col_lo) - 1

    rows_lo: list[float] = []
    rows_hi: list[float] = []
    starts: list[int] = []
    index: list[int] = []
    value: list[float] = []

    def row(lo: float, hi: float, terms: Iterable[tuple[int, float]]) -> None:
        starts.append(len(index))
        for j, a in terms:
            if a != 0.0:
                index.append(j)
                value.append(a)
        rows_lo.append(lo)
        rows_hi.append(hi)

    inf = highspy.kHighsInf
    n_var = [var(lb[i], ub[i], True) for i in range(n_rt)]
    r_var: list[int | None] = [None] * n_rt  # R_i for i < last; None means R_i == 0
    rmax_prev = 0
    for i in range(last):
        a_max = rmax_prev + q[i] - m[i] * lb[i]  # largest R_{i-1} + Q_i - M_i N_i
        a_min = q[i] - m[i] * ub[i]  # smallest
        if a_max <= 0:
            r_var[i] = None
            rmax_prev = 0
            continue
        rv = var(0.0, float(a_max))
        r_var[i] = rv
        prev = r_var[i - 1] if i > 0 else None
        # R_i >= R_{i-1} + Q_i - M_i N_i
        terms = [(rv, 1.0), (n_var[i], float(m[i]))] + ([(prev, -1.0)] if prev is not None else [])
        row(float(q[i]), inf, terms)
        if a_min >= 0:  # never clipped at 0: R_i == R_{i-1} + Q_i - M_i N_i
            row(-inf, float(q[i]), terms)
        else:  # max() can bind at 0: exact with a binary
            dv = var(0.0, 1.0, True)
            big = float(-a_min)
            # R_i <= R_{i-1} + Q_i - M_i N_i + big (1 - d)
            row(-inf, float(q[i]) + big, terms + [(dv, big)])
            # R_i <= a_max d
            row(-inf, 0.0, [(rv, 1.0), (dv, -float(a_max))])
        rmax_prev = a_max

    for i in range(n_rt):
        tv = var(0.0, inf, False, 1.0)
        table = problem.cost_table(i, bmax[i] + 1)
        # C_i = const + sum coef * var
        c_terms: list[tuple[int, float]] = []
        c_const = float(q[i])
        if i > 0 and r_var[i - 1] is not None:
            c_terms.append((r_var[i - 1], 1.0))
        if i < last and r_var[i] is not None:
            c_terms.append((r_var[i], -1.0))
        segs = [(table[k + 1] - table[k], table[k] - k * (table[k + 1] - table[k])) for k in range(bmax[i])]
        slopes = [u for u, _ in segs]
        convex = all(slopes[k + 1] >= slopes[k] - 1e-12 for k in range(len(slopes) - 1))
        if convex:
            for u, v in segs:
                # t >= u C + v N   <=>   t - u*c_terms - v N >= u * c_const
                row(u * c_const, inf, [(tv, 1.0), (n_var[i], -v)] + [(j, -u * a) for j, a in c_terms])
            continue
        zs = [var(0.0, 1.0, True) for _ in segs]
        row(1.0, 1.0, [(z, 1.0) for z in zs])
        big_c = float(dmax[i] + (len(segs) + 1) * ub[i])
        for k, ((u, v), z) in enumerate(zip(segs, zs)):
            # C - k N >= -big (1 - z)     and     C - (k+1) N <= big (1 - z)
            row(-big_c - c_const, inf, c_terms + [(n_var[i], -float(k)), (z, -big_c)])
            row(-inf, big_c - c_const, c_terms + [(n_var[i], -float(k + 1)), (z, big_c)])
            big_t = abs(u) * dmax[i] + abs(v) * ub[i] + 1.0
            row(u * c_const - big_t, inf, [(tv, 1.0), (n_var[i], -v), (z, -big_t)] + [(j, -u * a) for j, a in c_terms])
    row(float(g_total), float(g_total), [(j, 1.0) for j in n_var])  # Eq. 2

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", 1e-9)
    h.setOptionValue("mip_abs_gap", 1e-9)
    h.setOptionValue("threads", 1)
    # measured: presolve halves solve time on tiny models but doubles it from ~100s of rows up
    h.setOptionValue("presolve", "on" if len(rows_lo) < 150 else "off")
    h.setOptionValue("time_limit", float(time_limit))
    nc = len(col_lo)
    h.addVars(nc, np.asarray(col_lo, dtype=np.float64), np.asarray(col_hi, dtype=np.float64))
    h.changeColsCost(nc, np.arange(nc, dtype=np.int32), np.asarray(cost, dtype=np.float64))
    h.changeColsIntegrality(
        len(integer),
        np.asarray(integer, dtype=np.int32),
        np.full(len(integer), highspy.HighsVarType.kInteger.value, dtype=np.uint8),
    )
    h.addRows(
        len(rows_lo),
        np.asarray(rows_lo, dtype=np.float64),
        np.asarray(rows_hi, dtype=np.float64),
        len(index),
        np.asarray(starts, dtype=np.int32),
        np.asarray(index, dtype=np.int32),
        np.asarray(value, dtype=np.float64),
    )
    h.run()
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kOptimal:
        return _result(problem, [int(round(h.getSolution().col_value[j])) for j in n_var], feasible, "milp")
    if status != highspy.HighsModelStatus.kTimeLimit:
        raise RuntimeError(f"HiGHS failed on a feasible-by-construction model: {h.modelStatusToString(status)}")
    # Out of time: the best allocation HiGHS holds, if it holds one that satisfies Eq. 2-7 as
    # rounded, else the DP's (exact too, and never slow at these sizes); the solver name says so.
    # The policy calls this from a request's arrival, so it must answer, not raise.
    if h.getInfo().primal_solution_status == int(highspy.SolutionStatus.kSolutionStatusFeasible):
        counts = [int(round(h.getSolution().col_value[j])) for j in n_var]
        if sum(counts) == g_total and all(c >= b for c, b in zip(counts, lb)):
            return _result(problem, counts, feasible, "milp (time limit)")
    best = solve_allocation_dp(problem)
    return _result(problem, best.counts, feasible, "dp (milp time limit)")


def solve_allocation(problem: AllocationProblem, solver: str = "dp", time_limit: float = 60.0) -> Allocation:
    """The allocation by ``solver``: ``"dp"`` (default) or ``"milp"`` (HiGHS, stopped after
    ``time_limit`` seconds with the best allocation it has; see :func:`solve_allocation_milp`)."""
    if solver == "dp":
        return solve_allocation_dp(problem)
    if solver == "milp":
        return solve_allocation_milp(problem, time_limit)
    raise ValueError(f"unknown solver {solver!r} (dp or milp)")


# ---------------------------------------------------------------------------------
# Minimum replacement plan
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Move:
    """Instance ``instance`` switches from runtime ``source`` to runtime ``target``.

    ``source is None``: a new instance must be started with ``target`` (the plan
    needs more instances than exist); ``target is None``: the instance is released.
    Runtimes are indices into the sorted buckets.
    """

    instance: int
    source: int | None
    target: int | None


def replacement_plan(
    current: Mapping[int, int],
    target: Sequence[int],
    load: Mapping[int, float] | None = None,
) -> tuple[Move, ...]:
    """The fewest instance changes that turn ``current`` (instance -> runtime) into ``target`` counts.

    Every runtime with ``s_i = current_i - target_i > 0`` surplus instances must
    lose exactly ``s_i`` of them and no instance of any other runtime changes, so
    ``sum_i max(s_i, 0)`` switches (plus starts when the target has more instances)
    is the minimum. The instances that leave a runtime are its least loaded ones
    (``load``; ties and no ``load``: highest id first), so little queued work
    is disturbed. Leaving instances fill deficits in runtime order; the rest are
    released (target ``None``), and deficits left over are new instances
    (source ``None``, instance ids above every current id).
    """
    n_rt = len(target)
    members: list[list[int]] = [[] for _ in range(n_rt)]
    for inst, rt in current.items():
        if not 0 <= rt < n_rt:
            raise ValueError(f"instance {inst} runs unknown runtime {rt}")
        members[rt].append(inst)
    leaving: list[tuple[int, int]] = []
    for rt, insts in enumerate(members):
        surplus = len(insts) - target[rt]
        if surplus > 0:
            key = (lambda i: (load.get(i, 0.0), -i)) if load is not None else (lambda i: -i)
            for inst in sorted(insts, key=key)[:surplus]:
                leaving.append((inst, rt))
    deficits = [rt for rt in range(n_rt) for _ in range(max(0, target[rt] - len(members[rt])))]
    moves: list[Move] = []
    for (inst, src), dst in zip(leaving, deficits):
        moves.append(Move(inst, src, dst))
    for inst, src in leaving[len(deficits) :]:
        moves.append(Move(inst, src, None))
    next_id = max(current, default=-1) + 1
    for dst in deficits[len(leaving) :]:
        moves.append(Move(next_id, None, dst))
        next_id += 1
    return tuple(moves)


# ---------------------------------------------------------------------------------
# Runtime Scheduler: periodic reallocation from a sliding window
# ---------------------------------------------------------------------------------


def demand_per_window(counts: Sequence[int], span: float, window: float) -> tuple[int, ...]:
    """Counts over ``span`` seconds scaled to one ``window``, rounded by largest remainder.

    The total is rounded half up; ties between equal remainders go to the shorter runtime.
    """
    if span <= 0:
        raise ValueError("span must be positive")
    exact = [c * window / span for c in counts]
    floors = [int(math.floor(e)) for e in exact]
    missing = int(math.floor(sum(exact) + 0.5)) - sum(floors)  # total rounded half up
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - floors[i]), i))
    for i in order[: max(0, missing)]:
        floors[i] += 1
    return tuple(floors)


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


def _capacity(latency: Callable[[int], float], slo: float) -> int:
    """``max{b >= 1 : L(b) <= slo}`` (1 if even one request misses it); ``L`` is nondecreasing.
    ``<=`` holds within a relative 1e-9, so an SLO that is an exact multiple of the latency
    is met by that many requests (9 ms at 1 ms each is 9) despite ``l * b`` rounding above it."""
    slo = slo * (1.0 + 1e-9)
    lo, hi = 1, 2
    while latency(hi) <= slo:  # doubling, then bisection
        lo, hi = hi, hi * 2
        if hi > 1 << 40:
            raise ValueError("latency never exceeds the SLO")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if latency(mid) <= slo:
            lo = mid
        else:
            hi = mid
    return lo


# ---------------------------------------------------------------------------------
# Request Scheduler: Alg. 1 and the ILB / IG baselines
# ---------------------------------------------------------------------------------

_SHIFT = 32
_MASK = (1 << _SHIFT) - 1
_ONE = 1 << _SHIFT


class MultiLevelDispatcher:
    """Alg. 1: a multi-level queue of instances, one min-heap per runtime (level).

    An instance's *load* is its number of outstanding requests (queued + running),
    as in the paper (Fig. 5 labels "outstanding / max capacity"); its congestion is
    ``P = load / M`` with ``M`` the runtime's capacity within the SLO. Each heap
    holds ``load << 32 | id`` integers, so the head is the least loaded instance
    (ties: lowest id); completions push a fresh key and stale keys are dropped
    lazily when they surface (the heap is rebuilt if it grows past twice its
    members).

    Decisions where Alg. 1 is ambiguous:

    * Candidates (line 2) are the *deployed* runtimes (>= 1 instance) whose bucket
      holds the request, shortest first; empty runtimes are skipped before TOPK,
      so ``L`` counts levels that can actually take the request.
    * Line 10 is ``P < lambda`` (strict, "less than" in the text), evaluated as
      ``load < lambda * M`` with the products precomputed; ``lambda``
      starts at its initial value for every request and is multiplied by ``alpha``
      after each failing level (line 15), so level ``k`` (0-based) of the
      candidates is tested against ``lambda * alpha**k``.
    * If no level passes, the request goes to the head of the first candidate
      (lines 18-19), even though it is congested.
    * UPDATE (line 22) adds one outstanding request to the chosen instance.
    * No deployed runtime fits: :meth:`dispatch` returns ``None`` (the caller holds
      the request); a length above every bucket raises ``ValueError``.
    """

    name = "arlo"

    def __init__(
        self,
        buckets: Sequence[int],
        capacity: Sequence[int],
        *,
        lam: float = 0.85,
        alpha: float = 0.9,
        peek: int = 6,
    ) -> None:
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError("buckets must be strictly increasing")
        if len(capacity) != len(buckets) or min(capacity) <= 0:
            raise ValueError("one positive capacity per bucket")
        if peek < 1:
            raise ValueError("peek (L) must be >= 1")
        self.buckets = tuple(buckets)
        self.capacity = tuple(float(c) for c in capacity)
        self.lam, self.alpha, self.peek = float(lam), float(alpha), int(peek)
        k = len(buckets)
        # level of the smallest bucket >= length, for every length
        self._level_of = [bisect_left(self.buckets, n) for n in range(self.buckets[-1] + 1)]
        self._heaps: list[list[int]] = [[] for _ in range(k)]
        self._members: list[set[int]] = [set() for _ in range(k)]
        self._key: dict[int, int] = {}  # instance -> load << 32 | id
        self._level: dict[int, int] = {}
        self._next = [-1] * (k + 1)  # first deployed level >= j (sentinel at k)
        # thresholds lambda * alpha**k * M_j, precomputed per (position, level)
        self._thresh = [[self.lam * self.alpha**p * c for c in self.capacity] for p in range(self.peek)]

    # -- instances ---------------------------------------------------------------
    def _refresh(self) -> None:
        nxt = -1
        for j in range(len(self.buckets) - 1, -1, -1):
            if self._members[j]:
                nxt = j
            self._next[j] = nxt

    def add_instance(self, instance: int, level: int, load: int = 0) -> None:
        if not 0 <= instance <= _MASK:
            raise ValueError("instance ids must fit in 32 bits")
        if instance in self._key:
            raise ValueError(f"instance {instance} already present")
        key = (load << _SHIFT) | instance
        self._key[instance] = key
        self._level[instance] = level
        self._members[level].add(instance)
        heappush(self._heaps[level], key)
        self._refresh()

    def remove_instance(self, instance: int) -> int:
        """Forget an instance; returns its outstanding load."""
        key = self._key.pop(instance)
        level = self._level.pop(instance)
        self._members[level].discard(instance)
        self._rebuild(level)
        self._refresh()
        return key >> _SHIFT

    def move_instance(self, instance: int, level: int, load: int | None = None) -> None:
        old = self.remove_instance(instance)
        self.add_instance(instance, level, old if load is None else load)

    def _rebuild(self, level: int) -> None:
        heap = [self._key[i] for i in self._members[level]]
        heapify(heap)
        self._heaps[level] = heap

    def level_of(self, instance: int) -> int:
        return self._level[instance]

    def load(self, instance: int) -> int:
        return self._key[instance] >> _SHIFT

    def loads(self) -> dict[int, int]:
        return {i: k >> _SHIFT for i, k in self._key.items()}

    def instances(self) -> tuple[int, ...]:
        return tuple(self._key)

    def instances_per_level(self) -> tuple[int, ...]:
        return tuple(len(s) for s in self._members)

    def fitting_level(self, length: int) -> int:
        if length < 0 or length >= len(self._level_of):
            raise ValueError(f"length {length} exceeds the largest bucket {self.buckets[-1]}")
        return self._level_of[length]

    # -- load updates ------------------------------------------------------------
    def complete(self, instance: int, count: int = 1) -> None:
        """``count`` outstanding requests of ``instance`` finished (or left it)."""
        key = self._key.get(instance)
        if key is None:
            return
        key -= count << _SHIFT
        if key < 0:
            raise ValueError(f"instance {instance} has fewer than {count} outstanding requests")
        self._key[instance] = key
        level = self._level[instance]
        heap = self._heaps[level]
        heappush(heap, key)
        if len(heap) > 2 * len(self._members[level]) + 16:
            self._rebuild(level)

    # -- Alg. 1 --------------------------------------------------------------------
    def _head(self, level: int) -> int:
        heap, keys = self._heaps[level], self._key
        e = heap[0]
        while keys.get(e & _MASK) != e:
            heappop(heap)
            e = heap[0]
        return e

    def choose_level(self, length: int) -> int:
        """Lines 1-20 of Alg. 1: the runtime level for a request (``-1``: none deployed)."""
        nxt = self._next
        first = nxt[self.fitting_level(length)]
        if first < 0:
            return -1
        j, p, peek, thresh = first, 0, self.peek, self._thresh
        while True:
            if (self._head(j) >> _SHIFT) < thresh[p][j]:
                return j
            p += 1
            if p >= peek:
                return first
            j = nxt[j + 1]
            if j < 0:
                return first

    def dispatch(self, length: int) -> int | None:
        """Alg. 1: the instance for one request of ``length`` tokens (its load +1)."""
        j = self.choose_level(length)
        if j < 0:
            return None
        heap = self._heaps[j]
        e = self._head(j)
        self._key[e & _MASK] = e + _ONE
        heapreplace(heap, e + _ONE)
        return e & _MASK

    def dispatch_many(self, lengths: Iterable[int]) -> list[int | None]:
        """:meth:`dispatch` for a burst, in order: Alg. 1 with the loop inlined (hot path),
        or, for a subclass with its own :meth:`choose_level`, one :meth:`dispatch` each."""
        if type(self).choose_level is not MultiLevelDispatcher.choose_level:
            return [self.dispatch(n) for n in lengths]
        level_of, nxt, heaps, keys, thresh = self._level_of, self._next, self._heaps, self._key, self._thresh
        peek, mask, one, shift = self.peek, _MASK, _ONE, _SHIFT
        get, top = keys.get, len(level_of) - 1
        out: list[int | None] = []
        append = out.append
        for length in lengths:
            if not 0 <= length <= top:
                raise ValueError(f"length {length} exceeds the largest bucket {self.buckets[-1]}")
            first = nxt[level_of[length]]
            if first < 0:
                append(None)
                continue
            j, p = first, 0
            while True:
                heap = heaps[j]
                e = heap[0]
                while get(e & mask) != e:
                    heappop(heap)
                    e = heap[0]
                if (e >> shift) < thresh[p][j]:
                    break
                p += 1
                if p >= peek:
                    j = first
                    break
                j = nxt[j + 1]
                if j < 0:
                    j = first
                    break
            heap = heaps[j]
            e = heap[0]
            while get(e & mask) != e:
                heappop(heap)
                e = heap[0]
            keys[e & mask] = e + one
            heapreplace(heap, e + one)
            append(e & mask)
        return out


class IntraGroupBalance(MultiLevelDispatcher):
    """ILB (§5.3): the runtime with the least padding, least loaded instance of it.

    Exactly Alg. 1 with ``L = 1`` (a request never leaves its own runtime; if that
    runtime has no instance, the next deployed longer one is its "own").
    """

    name = "ilb"

    def __init__(self, buckets: Sequence[int], capacity: Sequence[int], **_: float) -> None:
        super().__init__(buckets, capacity, peek=1)

    def choose_level(self, length: int) -> int:
        return self._next[self.fitting_level(length)]


class InterGroupGreedy(MultiLevelDispatcher):
    """IG (§5.3): the least busy instance among *all* candidate runtimes.

    "Busy" is the congestion ``P = load / M`` Alg. 1 uses (so runtimes with
    different capacities compare fairly); ties go to the shorter runtime.
    """

    name = "ig"

    def __init__(self, buckets: Sequence[int], capacity: Sequence[int], **_: float) -> None:
        super().__init__(buckets, capacity, peek=len(buckets))

    def choose_level(self, length: int) -> int:
        nxt, cap = self._next, self.capacity
        j = nxt[self.fitting_level(length)]
        best, best_p = -1, _INF
        while j >= 0:
            p = (self._head(j) >> _SHIFT) / cap[j]
            if p < best_p:
                best, best_p = j, p
            j = nxt[j + 1]
        return best


class InterGroupGreedyByLoad(InterGroupGreedy):
    """IG read literally: the instance with the fewest outstanding requests among all
    candidate runtimes (ties: the shorter runtime), whatever their capacities.

    The paper's "least busy instance" does not say whether busy is relative to the
    capacity; :class:`InterGroupGreedy` compares ``load / M``, this compares ``load``,
    which lets short requests seize the longer runtimes' (emptier, slower) instances
    — the behaviour the paper blames for IG's tail (§5.2.3).
    """

    name = "ig-load"

    def choose_level(self, length: int) -> int:
        nxt = self._next
        j = nxt[self.fitting_level(length)]
        best, best_load = -1, _INF
        while j >= 0:
            load = self._head(j) >> _SHIFT
            if load < best_load:
                best, best_load = j, load
            j = nxt[j + 1]
        return best


_DISPATCHERS = {"arlo": MultiLevelDispatcher, "ilb": IntraGroupBalance, "ig": InterGroupGreedy,
                "ig-load": InterGroupGreedyByLoad}


# ---------------------------------------------------------------------------------
# Autoscaling: target tracking on p98 latency (§4)
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScaleDecision:
    """``"out"``: add an instance of ``runtime`` (the longest); ``"in"``: release one.

    For ``"in"`` the policy fills ``instance`` with its least busy instance.
    """

    time: float
    action: str
    runtime: int | None = None
    instance: int | None = None
    p98: float = math.nan


class TargetTrackingAutoscaler:
    """Target tracking on the p98 latency of recently completed requests (§4).

    Evaluated at most every ``interval`` seconds (calls in between return ``None``),
    on the completions of the last ``window`` seconds (p98 by nearest rank):

    * p98 ``>= scale_out_at * SLO`` (0.95) -> ``"out"`` (an instance of the longest
      runtime), then no further scale-out for ``cooldown`` seconds (our choice: the
      paper gives none, and without one every evaluation would add another instance
      before the first one could help).
    * p98 ``< scale_in_below * SLO`` (0.5) at *every* evaluation for
      ``scale_in_period`` seconds (60) -> ``"in"``; the 60 s then start again. An
      empty window (no completions) counts as below the target.
    * never below ``min_instances`` nor above ``max_instances``.
    """

    def __init__(
        self,
        slo: float,
        *,
        window: float = 10.0,
        interval: float = 1.0,
        scale_out_at: float = 0.95,
        scale_in_below: float = 0.5,
        scale_in_period: float = 60.0,
        cooldown: float = 10.0,
        min_instances: int = 1,
        max_instances: int | None = None,
        longest_runtime: int | None = None,
    ) -> None:
        self.slo = float(slo)
        self.window, self.interval = float(window), float(interval)
        self.scale_out_at, self.scale_in_below = float(scale_out_at), float(scale_in_below)
        self.scale_in_period, self.cooldown = float(scale_in_period), float(cooldown)
        self.min_instances, self.max_instances = int(min_instances), max_instances
        self.longest_runtime = longest_runtime
        self._obs: deque[tuple[float, float]] = deque()
        self._last_eval = -_INF
        self._last_out = -_INF
        self._below_since: float | None = None

    def observe(self, latency: float, now: float) -> None:
        self._obs.append((now, float(latency)))

    def p98(self, now: float) -> float | None:
        obs, horizon = self._obs, now - self.window
        while obs and obs[0][0] <= horizon:
            obs.popleft()
        if not obs:
            return None
        values = sorted(v for _, v in obs)
        return values[max(0, math.ceil(0.98 * len(values)) - 1)]

    def decide(self, now: float, instances: int) -> ScaleDecision | None:
        if now - self._last_eval < self.interval:
            return None
        self._last_eval = now
        p = self.p98(now)
        if p is not None and p >= self.scale_out_at * self.slo:
            self._below_since = None
            if now - self._last_out >= self.cooldown and (
                self.max_instances is None or instances < self.max_instances
            ):
                self._last_out = now
                return ScaleDecision(now, "out", self.longest_runtime, None, p)
            return None
        if p is None or p < self.scale_in_below * self.slo:
            if self._below_since is None:
                self._below_since = now
            if now - self._below_since >= self.scale_in_period and instances > self.min_instances:
                self._below_since = now
                return ScaleDecision(now, "in", None, None, math.nan if p is None else p)
            return None
        self._below_since = None
        return None


# ---------------------------------------------------------------------------------
# The policy
# ---------------------------------------------------------------------------------


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
    scale_decisions: list[ScaleDecision] = field(default_factory=list)


class ArloPolicy(Policy):
    """Arlo as a :class:`~jaxserve.sched.base.Policy`, for one model (one request stream).

    * Instances ``0..G-1`` each run one runtime (bucket of ``grid.seq_buckets``);
      the initial allocation is even (remainder to the longest runtimes) unless
      ``initial_allocation`` (instances per runtime) is given.
    * ``on_arrival`` records the length for the runtime scheduler and dispatches the
      request to an instance with the request scheduler (``dispatcher``: ``"arlo"``
      = Alg. 1, ``"ilb"``, ``"ig"``); each instance has a FIFO queue.
    * ``plan`` gives every idle instance (the caller's truth) the head of its queue,
      up to ``max_batch`` requests (1, as in the paper; capped by the grid), in
      ``Cell(batch_size_for(k), seq=its runtime's bucket)``.
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
    * :meth:`_cell_for` is the one place a batch's executable is chosen (the
      instance's runtime bucket); the DT baseline overrides it.
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
        max_batch: int = 1,
        solver: str = "dp",
        hysteresis: float = 0.0,
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
        self.max_batch = max(1, min(int(max_batch), grid.max_batch))
        self._batch_sizes = tuple(b for b in grid.batch_sizes if b <= self.max_batch) or (grid.batch_sizes[0],)
        self.slo = float(slo)
        if allocator is None:
            curves = [LatencyCurve(profile, s, self.max_batch) for s in self.buckets]
            allocator = RuntimeScheduler(
                self.buckets,
                curves,
                slo,
                period=period,
                window=window,
                solver=solver,
                hysteresis=hysteresis,
                warmup=min(warmup, period),
                headroom=headroom,
            )
        self.runtime = allocator
        if isinstance(dispatcher, str):
            if dispatcher not in _DISPATCHERS:
                raise ValueError(f"unknown dispatcher {dispatcher!r}")
            dispatcher = _DISPATCHERS[dispatcher]
        self.dispatcher: MultiLevelDispatcher = dispatcher(
            self.buckets, self.runtime.capacity, lam=lam, alpha=alpha, peek=peek
        )
        self.autoscaler = autoscaler
        if autoscaler is not None and autoscaler.longest_runtime is None:
            autoscaler.longest_runtime = len(self.buckets) - 1
        self.replacement_seconds = float(replacement_seconds)
        # requests one instance of each runtime runs per second at full batches: prices a switch
        self._rate = [self.max_batch / LatencyCurve(profile, s, self.max_batch)(self.max_batch)
                      for s in self.buckets] if self.replacement_seconds > 0 else []
        self._charged: dict[int, int] = {}  # switching instance -> load charged until it is ready
        self.redispatch_queued = bool(redispatch_queued)
        self.counters = ArloCounters()
        self._queues: dict[int, deque[Request]] = {}
        self._ready_at: dict[int, float] = {}
        self._running: dict[int, int] = {}  # request id -> instance
        self._arrival: dict[int, float] = {}
        self._pending: deque[Request] = deque()
        self._queued = 0
        if instances < 1:
            raise ValueError("Arlo needs at least one instance")
        alloc = list(initial_allocation) if initial_allocation is not None else _even(instances, len(self.buckets))
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
        self._drain_pending()

    def remove_instance(self, instance: int, now: float) -> None:
        """Release a worker (scale-in); its queued requests are re-dispatched.

        A batch it is running still completes through ``on_completion``.
        """
        queue = self._queues.pop(instance)
        self._ready_at.pop(instance, None)
        self._charged.pop(instance, None)
        self.dispatcher.remove_instance(instance)
        self._queued -= len(queue)
        self._redispatch(queue)

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
        batches = []
        wake = _INF
        queues = self._queues
        for inst in idle_instances:
            queue = queues.get(inst)
            if not queue:
                continue
            ready = self._ready_at[inst]
            if ready > now:
                wake = min(wake, ready)
                continue
            rt = self.dispatcher.level_of(inst)
            k = min(len(queue), self.max_batch)
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
        for r in self._pending:
            if r.id == request_id:
                self._pending.remove(r)
                self.counters.withdrawn += 1
                return True
        return False

    def _cell_for(self, level: int, requests: Sequence[Request]) -> Cell:
        """The executable a batch of ``requests`` runs in on an instance of runtime ``level``."""
        return Cell(batch_size_for(len(requests), self._batch_sizes), self.buckets[level])

    # -- observability ---------------------------------------------------------------
    def metrics(self) -> Iterable[tuple[str, dict[str, str], float]]:
        """``(name, labels, value)`` for ``/metrics`` (``jaxserve_policy_<name>``)."""
        for seq, n in self.instances_per_runtime().items():
            yield "instances", {"runtime": str(seq)}, n
        c = self.counters
        for name in ("dispatched", "served", "demotions", "reallocations", "allocation_changes",
                     "instances_moved", "redispatched", "withdrawn"):
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
    def _place(self, request: Request) -> int | None:
        inst = self.dispatcher.dispatch(request.length)
        if inst is None:
            self._pending.append(request)
            return None
        self._queues[inst].append(request)
        self._arrival[request.id] = request.arrival
        self._queued += 1
        return inst

    def _redispatch(self, requests: Iterable[Request]) -> None:
        touched = set()
        for req in requests:
            self.counters.redispatched += 1
            inst = self.dispatcher.dispatch(req.length)
            if inst is None:
                self._pending.append(req)
                continue
            self._queues[inst].append(req)
            self._queued += 1
            touched.add(inst)
        for inst in touched:  # keep every queue FIFO by arrival
            q = self._queues[inst]
            self._queues[inst] = deque(sorted(q, key=lambda r: (r.arrival, r.id)))

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
        moved = [mv for mv in realloc.moves if mv.source is not None and mv.target is not None]
        if not moved:
            return
        self.counters.allocation_changes += 1
        self.counters.instances_moved += len(moved)
        displaced: list[Request] = []
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
