"""Arlo's resource allocation (Tan et al., ICPP '24, §3.3, Eq. 1-7): instances per runtime.

:class:`LatencyCurve` (``L_i`` from the profile), :class:`AllocationProblem`, two exact
solvers (:func:`solve_allocation_dp`, :func:`solve_allocation_milp`; :func:`solve_allocation`
picks one), the fewest instance switches that realise a new allocation (§4, "Instance
replacement": :func:`replacement_plan`) and :func:`demand_per_window` (``Q_i`` from counts).
Pure functions of their arguments; the periodic driver is
:mod:`jaxserve.sched.arlo.runtime_scheduler`.

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
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from jaxserve.sched.arlo._common import _INF, _capacity
from jaxserve.sched.base import Cell, LatencyProfile


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
