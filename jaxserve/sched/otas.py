"""OTAS: selective batching and online token adaptation (Chen et al., "OTAS: An Elastic
Transformer Serving System via Token Adaptation"), plus the paper's baselines.

A ViT here is served by one executable per ``Cell(batch, 0, gamma)``: gamma > 0 adds
gamma prompt tokens per layer (slower, more accurate), gamma < 0 merges |gamma| tokens
per layer with ToMe (faster, a little less accurate), gamma = 0 is the vanilla model.
Every policy in this module forms batches with Alg. 1 and differs only in how it picks
the gamma (or, for INFaaS, the model variant) of each batch:

* :class:`OTASPolicy` — Alg. 2 (the DP, :func:`solve_token_dp`) when the batch queue
  holds more than beta batches, Alg. 3 (:func:`manual_allocate` with the load map
  :class:`LoadToGamma`) otherwise and during the initial stage.
* :class:`PetSPolicy`, :class:`FixedToMePolicy`, :class:`FixedVPTPolicy` — one fixed gamma.
* :class:`INFaaSPolicy` — model switching among variants (e.g. ViT-S/B/L), paying the
  target variant's load time each time it changes variant, with hysteresis (``hold``).

Everything is plain Python (numpy for the DP's large stages; the whole DP in C where a C
compiler can build it, :func:`solve_token_dp`, with the same answers to the bit): the clock is the ``now``
argument, costs come from the profiles (:class:`~jaxserve.sched.base.LatencyProfile`,
:class:`~jaxserve.sched.base.AccuracyProfile`), decisions come back as a
:class:`~jaxserve.sched.base.Plan`.

Where we decide what the paper leaves open, or deliberately differ from it
----------------------------------------------------------------------------
Alg. 1 (Sec. III-C, whose pseudocode is not in our copy; the prose defines it). A
request r may join a queued batch b iff all four hold:

* ``now - s_b < delta``       — the batch's first request has waited less than delta;
* ``|b| < min(epsilon, grid.max_batch)`` — "batch size smaller than epsilon"; the
  largest compiled batch size also caps it (a batch must fit one executable);
* ``|d_r - d_b| <= eta``      — d_b = min deadline of the batch (the paper's d_b) at the
  moment r arrives (literal reading; d_b can drift down as earlier-deadline requests
  join, at most eta per join);
* ``min(u_r, u_b) / max(u_r, u_b) >= mu`` — u_b is the utility of the batch's first
  request. The paper says "close to u_b with a threshold mu" with mu = 0.8; an absolute
  difference <= 0.8 would put every utility of Table II (0.01 ... 1) in one batch, so
  we read mu as a ratio (0.3 and 0.2 split, 0.3 and 0.3 join). Two zeros are equal.

r joins the first such batch in creation order ("if a batch ... is found"), otherwise
opens a new one. delta bounds *joining*, it is not a hold timer: dispatch is
work-conserving — an idle instance always gets the next batch of the current plan (a
0.5 s hold would break the 0.6 s SLOs of Table II). Batches may mix tasks (Sec. III-A).

Batch time and utility (Alg. 2 line 22). The paper sums per-task sample counts times a
per-sample latency. We price a batch of n requests at gamma by the latency of the
executable that will really run it, ``grid.cell_for(n, 0, gamma)`` (padding included),
from the LatencyProfile (``latency_for`` if that exact cell was not profiled): batching
is strongly sub-linear (Fig. 7) and all tasks share one executable, so per-sample sums
overestimate. Utility is exactly the paper's: U_b(gamma) = sum over r in b of
accuracy(task_r, gamma) * u_r. Constraint (1c) (memory) is met by construction: only
compiled, profiled cells exist.

Alg. 2 (the DP). The paper keeps one (utility, clock) per (b, l_b), initialises dp to 0,
S to 1 and C to T, and keeps the larger utility. Three problems, fixed here:

1. An execution with zero utility never passes ``u > dp[b, l_b]`` (0 > 0), so it keeps
   the initial clock T — it looks free — and a garbage back-pointer S = 1; argmax over a
   row of zeros then picks such a state. We start from the single label (0, T) before
   batch 1 and every other state is absent (-inf); an execution always advances the
   clock, and only feasible executions (``C + t_b < d_b``, strict as in line 23) create
   states, so infeasible states are -inf by construction.
2. Ties: among equal utility we keep the EARLIER clock (the paper keeps the first seen).
3. One label per (b, l_b) is not exact: what the future needs is the clock, not l_b, and
   a lower-utility prefix that finishes earlier can enable more later batches. We keep,
   per batch, the Pareto frontier of (utility up, clock down) labels; the paper's table
   is the special case of one label per l_b. This is exact (equals brute force over all
   (N_gamma + 1)^N_B assignments in the same EDD sequential-execution model) as long as
   the frontier stays under ``max_labels``; beyond that it is thinned evenly (the extremes
   kept) and ``DPSolution.truncated`` says so (on random 30-batch, 8-gamma queues a cap
   of 16 already matched the uncapped optimum to 5 digits; the default 128 costs ~10 ms
   per decision there). Per batch, gamma options dominated in both time and utility are
   dropped first (exact).

Alg. 2 without a trade-off. When every queued batch, in EDD order, meets its deadline at its
most useful gamma, and each of those leads its batch's next best option by a clear margin, that
assignment is the DP's answer to the bit, and the policy takes it without building frontiers
(:func:`_all_best_solution`, which proves it; ``OTASParams.all_best_shortcut=False``: always the
full DP). Below capacity that was every decision in our simulations (bench/RESULTS.md, sim_speed),
and at 100 instances the DP (linear in a queue of ~90 batches, ~0.8 ms each even in native code)
had been three quarters of a simulation's wall time.
The paper's DP makes the same decisions, at the paper's cost only where load forces a choice.

l_b = 0 ("batch not executed") is a choice for every batch. A batch the DP leaves out is
not evicted at once: it stays queued and is re-planned at the next decision (new
arrivals and real completion times change the picture); a request is evicted only when
it can no longer meet its deadline even if its batch started at the next free instance
with the fastest gamma (the paper's Type 4, "cannot meet latency constraints before
actual execution").

Alg. 3. f(q) is derived from the profile, not from Table I (measured on an RTX 4080):
gamma sustains rate q iff ``headroom * B_max / latency(Cell(B_max, 0, gamma)) >= q`` and
f(q) is the most accurate sustaining gamma (mean accuracy over the profiled tasks; ties
to the faster), or the fastest gamma if none sustains q. Per batch, in EDD order with a
running clock T: if ``T + t_b(f(q)) >= d_b`` the batch gets the fastest gamma (the paper's
min(L), which is the fastest when latency falls with gamma); else if the mean u_r of the
batch exceeds kappa it gets the most accurate gamma, for its own tasks, among those that
still meet d_b and that sustain q as f(q) reads it (f(q)'s gamma is always a candidate);
else f(q). The paper says max(L) unconditionally. We differ twice. A critical batch that then
misses its deadline earns nothing. And a gamma that the load map says cannot sustain q makes
the queue behind the batch pay for its extra accuracy. Where prompts buy little accuracy for
their time (DINOv2 ViT-S/14), the unbounded rule lost to fixed ToMe under load
(bench/RESULTS.md, otas-utility-live-dinov2-s14). Used when ``N_B <= beta`` (Alg. 2 line
2 says <=, the prose "less than"; we follow the pseudocode) or during the initial stage
(the first ``initial_stage`` seconds after the first callback).

Arrival rate q: arrivals in the last ``rate_window`` seconds divided by the window (by
the elapsed time since start, floored at a tenth of the window, during the first window).

Several instances. OTAS plans for one sequential executor (Sec. III-A); a server with m
instances is m executors. Planned for one executor, both algorithms misread the load
once m > 1: Alg. 3's f(q) compares the fleet's rate q with one instance's capacity (so
it picks the fastest gamma), and Alg. 2 prices the queue as if it ran one batch after
another (at 100 instances it defers most queued batches and picks ToMe while instances
stand idle). Decision: the m executors share one clock. Plans read m = the instances
served (busy or idle, :meth:`SelectiveBatchingPolicy._share`). A batch started at clock
T must still finish, T + t_b, before d_b (it runs on one instance), but it moves the
clock on by t_b / m only: the work spread over the m instances (exact for m = 1, a fluid
approximation of list scheduling for m > 1). The plan's clock starts at now + backlog / m,
backlog the estimated seconds of work still running on busy instances. Alg. 3 reads
f(q / m), one instance's share of the rate (INFaaS likewise compares q / m with a
variant's throughput). With k idle instances we hand out the first k executed batches
of the plan, one each. ``OTASParams(share_instances=False)`` plans for one executor
whatever m. The two are compared in the simulator by ``bench/otas_instances.py``
(section otas-instances of bench/RESULTS.md).

Outcome types (Sec. V, "The execution type of a query"), recorded per request in
``outcomes``:

1. accurate result within the latency constraint;
2. incorrect result within the latency constraint;
3. a result, but after the deadline;
4. evicted before execution because it could not meet its deadline.

A policy never sees labels, so on completion an on-time request is recorded as Type 1
provisionally; whoever knows correctness calls :meth:`record_correctness` to turn it into
Type 2. "On time" at completion is ``now <= deadline``.

Live serving (``jaxserve serve --policy otas|pets|tome|vpt``, built by
:func:`make_otas_policy`): the engine merges :meth:`SelectiveBatchingPolicy.describe_request`
into each answer, so every HTTP answer carries the gamma it ran with and its outcome type
(1 = on time, 3 = late, 4 = evicted; a server has no labels, so 2 is for a client that
knows the truth to resolve). ``record_limit`` bounds the per-request records a long-running
server keeps (oldest dropped).
"""

from __future__ import annotations

import math
import os
import struct
from bisect import bisect_left, bisect_right, insort
from collections import Counter, OrderedDict, deque
from heapq import heapify, heappop, heappush
from itertools import repeat
from operator import attrgetter, itemgetter
from dataclasses import dataclass
from enum import IntEnum
from typing import Collection, Iterable, Mapping, Optional, Sequence

import numpy as np

from jaxserve.sched.base import (
    AccuracyProfile,
    Batch,
    Cell,
    CostModel,
    LatencyProfile,
    Plan,
    Policy,
    Request,
    ShapeGrid,
    StepSummary,
)

__all__ = [
    "BatchDecision", "BatchingParams", "DPSolution", "FixedGammaPolicy", "FixedToMePolicy",
    "FixedVPTPolicy", "GammaOption", "INFaaSPolicy", "LoadToGamma", "ModelVariant", "OTASParams",
    "OTASPolicy", "OutcomeType", "PetSPolicy", "SelectiveBatchingPolicy", "make_otas_policy",
    "manual_allocate", "solve_token_dp",
]

# --------------------------------------------------------------------------- types


class OutcomeType(IntEnum):
    """The paper's four execution types of a query (Sec. V, Fig. 13)."""

    ACCURATE_ON_TIME = 1
    INACCURATE_ON_TIME = 2
    LATE = 3
    EVICTED = 4


@dataclass(frozen=True)
class BatchingParams:
    """Alg. 1 thresholds; defaults are the paper's (Sec. V, Setup)."""

    delta: float = 0.5  # s: a batch accepts joins while its first request waited < delta
    epsilon: int = 64  # a batch holds at most epsilon requests
    eta: float = 0.5  # s: |d_r - d_b| <= eta to join
    mu: float = 0.8  # utility ratio min/max >= mu to join

    def __post_init__(self) -> None:
        if self.delta <= 0 or self.epsilon < 1 or self.eta < 0 or not 0 <= self.mu <= 1:
            raise ValueError(f"invalid batching parameters {self}")


@dataclass(frozen=True)
class OTASParams:
    """Alg. 2/3 knobs; beta, initial_stage and kappa are the paper's (Sec. V, Setup)."""

    beta: int = 5  # N_B <= beta batches -> Alg. 3
    initial_stage: float = 2.0  # s after the first callback -> Alg. 3
    kappa: float = 0.8  # mean utility above kappa -> most accurate gamma
    rate_window: float = 1.0  # s, arrival-rate window
    headroom: float = 0.8  # f(q): a gamma may run at most at this utilisation
    max_labels: int = 128  # DP frontier cap per batch (exact below it)
    # Answer Alg. 2 without building frontiers where every queued batch's most useful gamma fits
    # (:func:`_all_best_solution`: provably the DP's own answer); False: always the full DP.
    all_best_shortcut: bool = True
    # Plan for the instances served (m >= 1: the m-executor clock, the rate per instance; the module
    # docstring, Several instances); False: the paper's one sequential executor whatever m.
    share_instances: bool = True


@dataclass(frozen=True)
class GammaOption:
    """Running one batch at ``gamma``: its profiled time and its expected utility."""

    gamma: int
    seconds: float
    utility: float


@dataclass(frozen=True)
class DPSolution:
    """Alg. 2's answer for batches in EDD order: a gamma per batch, None = not executed."""

    gammas: tuple[Optional[int], ...]
    utility: float
    finish: float  # clock after the last executed batch
    max_frontier: int  # largest label set kept for one batch
    truncated: bool  # the frontier was thinned somewhere: optimality not guaranteed
    all_best: bool = False  # answered by :func:`_all_best_solution` (one label per batch, no frontier)


@dataclass(frozen=True)
class BatchDecision:
    """One dispatched batch, for inspection and reports."""

    time: float
    request_ids: tuple[int, ...]
    model: str
    cell: Cell
    instance: int
    source: str  # "dp", "load" (Alg. 3), "backfill", "fixed" or "variant"
    est_seconds: float
    est_utility: float

    @property
    def gamma(self) -> int:
        return self.cell.gamma


@dataclass(frozen=True)
class ModelVariant:
    """One INFaaS model variant (e.g. ViT-S/B/L), profiled like any model at gamma 0.

    ``name`` is what :class:`Batch.model` carries, so the engine/simulator prices and
    runs the batch with that variant's executables.
    """

    name: str
    latency: LatencyProfile
    accuracy: AccuracyProfile
    grid: ShapeGrid


# --------------------------------------------------------------------------- Alg. 2


def _undominated(options: Sequence[GammaOption]) -> list[tuple[int, GammaOption]]:
    """Options not beaten in both time (<=) and utility (>=) by another; first of equals kept.

    One sort instead of every pair (a plan rebuilds this for each batch that changed): ordered by
    (seconds, higher utility first, index), an option is beaten exactly when one before it has at
    least its utility (one before it is no slower, and it is faster, more useful, or equal and
    first). With a NaN anywhere the pairwise rule (:func:`_undominated_pairs`) decides, as always.
    """
    top = None  # the least negated utility so far
    kept_at: list[int] = []
    for seconds, neg, i in sorted([(o.seconds, -o.utility, i) for i, o in enumerate(options)]):
        if seconds != seconds or neg != neg:  # a NaN (the one value unequal to itself): the sort is no order
            return _undominated_pairs(options)
        if top is None or neg < top:
            kept_at.append(i)
            top = neg
    kept_at.sort()
    return [(i, options[i]) for i in kept_at]


def _undominated_pairs(options: Sequence[GammaOption]) -> list[tuple[int, GammaOption]]:
    """:func:`_undominated` by comparing every pair: the definition."""
    kept: list[tuple[int, GammaOption]] = []
    for i, o in enumerate(options):
        dominated = False
        for j, p in enumerate(options):
            if j == i:
                continue
            if p.seconds <= o.seconds and p.utility >= o.utility:
                if p.seconds < o.seconds or p.utility > o.utility or j < i:
                    dominated = True
                    break
        if not dominated:
            kept.append((i, o))
    return kept


def _same_utility(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def solve_token_dp(
    deadlines: Sequence[float],
    options: Sequence[Sequence[GammaOption]],
    start: float,
    max_labels: int = 128,
    *,
    undominated: Sequence[Sequence[tuple[int, GammaOption]]] | None = None,
    executors: int = 1,
) -> DPSolution:
    """Alg. 2: the gamma of each batch (or None, l_b = 0) maximising total utility.

    ``deadlines[b]`` is d_b and ``options[b]`` the gamma choices of batch b, batches
    already in EDD order (Alg. 2 line 1) and executed one after another from ``start``;
    an executed batch must finish strictly before its deadline. ``executors`` (m >= 1): the
    batches share m executors; a batch started at clock C finishes at C + t (it runs on one
    executor) and moves the clock on by t / m (the module docstring: Several instances). m = 1
    is the paper's one sequential executor. Among equal utility the earlier finishing clock wins. See the module docstring for the fixes to the paper.
    ``undominated``: ``_undominated(options[b])`` per batch (or its :class:`_DPStage`), if
    the caller keeps them.

    Per batch, every label of the previous frontier is extended by "skip" and by each
    undominated option that meets the deadline; the candidates, ordered by (clock, higher
    utility first, parent, option), keep a label iff its utility strictly exceeds the last
    kept one's (and is not equal to it within 1e-9 relative); a frontier above ``max_labels``
    is thinned evenly. A large stage runs in numpy (:func:`_dp_stage_complex`; once a NaN
    may arise, :func:`_dp_stage_numpy`), a small one in Python (:func:`_dp_stage_python`):
    the same floating-point operations, hence the same labels to the bit
    (tests/unit/test_otas_sched.py compares them with a plain transcription).

    Where no NaN can arise (``start`` is not NaN, every option finite: :attr:`_DPStage.plain`;
    and every number a float or an int: :attr:`_DPStage.native`) the whole DP, every stage and the back-tracking, runs in one native call instead
    (:func:`_dp_native`: numpy's per-call overhead made the stages above the simulator's
    bottleneck). It makes the same IEEE double operations, so the same :class:`DPSolution` to
    the bit (tests/unit/test_otas_native_dp.py). The C source (jaxserve/kernels/otas_dp.c) is
    built by the system C compiler when a server makes an image policy, else on the first call,
    into the kernel directory (:func:`jaxserve.kernels.otas_dp_library`); without a compiler, after a failed build
    (a warning, once) or with ``JAXSERVE_NATIVE_DP=0``, the stages above run.
    """
    if len(deadlines) != len(options):
        raise ValueError("one option list per batch")
    if max_labels < 2:
        raise ValueError("max_labels must be at least 2")
    if undominated is not None and len(undominated) != len(options):
        raise ValueError("one undominated list per batch")
    if isinstance(executors, bool) or not isinstance(executors, int) or executors < 1:
        raise ValueError(f"executors must be an integer >= 1, got {executors!r}")
    if undominated is None:
        stages = [_DPStage(_undominated(o)) for o in options]
    else:
        stages = [u if isinstance(u, _DPStage) else _DPStage(u) for u in undominated]
    return _solve_stages(deadlines, options, stages, start, max_labels, executors)


_STAGE_NATIVE = attrgetter("native")
_DEADLINE = attrgetter("_deadline")
_SECOND, _THIRD = itemgetter(1), itemgetter(2)
_STAGE_RECORD = attrgetter("record")


def _solve_stages(deadlines: Sequence[float], options: Sequence[Sequence[GammaOption]], stages: list["_DPStage"],
                  start: float, max_labels: int, executors: int = 1) -> DPSolution:
    """:func:`solve_token_dp` once every batch's undominated options are a :class:`_DPStage` (and the
    arguments checked): the policy calls it directly with the stages it keeps per queued batch."""
    if (os.environ.get("JAXSERVE_NATIVE_DP", "1").strip().lower() not in _SWITCHED_OFF
            and isinstance(start, _NUMBERS) and not math.isnan(start) and isinstance(max_labels, int)
            and max_labels < 1 << 62 and all(map(_STAGE_NATIVE, stages))
            and all(map(isinstance, deadlines, repeat(_NUMBERS)))):
        solution = _dp_native(deadlines, options, stages, start, max_labels, executors=executors)
        if solution is not None:
            return solution
    # The frontier, in candidate order (clocks ascending, utilities ascending): its clocks and
    # its utilities negated (so that ascending (clock, -utility) is the candidate order), as
    # lists (a small stage made it), two arrays (_dp_stage_numpy) or one complex array
    # clock + 1j * -utility (_dp_stage_complex). -(u + x) == -u - x exactly, so no value differs.
    clocks: list[float] | np.ndarray = [start]
    negs: list[float] | np.ndarray = [-0.0]
    joint: np.ndarray | None = None  # the complex frontier, when the last stage made one (clocks/negs stale)
    # While no NaN can arise (a start that is not NaN, finite options so far) every stage function
    # makes the same labels; after a NaN might, each stage runs where it always did (their sorts
    # may place NaNs differently).
    no_nan = not math.isnan(start)
    links: list[tuple] = []  # per batch, how each label of its frontier was made (see _dp_parent)
    truncated = False
    widest = 1
    for b, deadline in enumerate(deadlines):
        stage = stages[b]
        no_nan = no_nan and stage.plain
        n_labels = len(clocks) if joint is None else len(joint)
        candidates = n_labels * stage.width
        if no_nan and candidates >= _DP_NUMPY_FROM:
            if joint is None:
                joint = np.empty(n_labels, dtype=np.complex128)
                joint.real, joint.imag = clocks, negs
            joint, link, thinned = _dp_stage_complex(joint, stage, deadline, max_labels, executors)
            n_labels = len(joint)
        elif not no_nan and candidates >= _DP_TWO_ARRAYS_FROM:
            if joint is not None:
                clocks, negs, joint = joint.real.copy(), joint.imag.copy(), None
            clocks, negs, link, thinned = _dp_stage_numpy(clocks, negs, stage.useful, deadline, max_labels,
                                                          executors)
            n_labels = len(clocks)
        else:
            if joint is not None:
                clocks, negs, joint = joint.real.tolist(), joint.imag.tolist(), None
            elif isinstance(clocks, np.ndarray):
                clocks, negs = clocks.tolist(), negs.tolist()
            clocks, negs, link, thinned = _dp_stage_python(clocks, negs, stage.useful, deadline, max_labels,
                                                           executors)
            n_labels = len(clocks)
        truncated = truncated or thinned
        widest = max(widest, n_labels)
        links.append(link)
    if joint is not None:
        clocks, negs = joint.real, joint.imag
    best = len(clocks) - 1  # the frontier's last label: max utility, earliest among ties
    utility, finish = -float(negs[best]), float(clocks[best])
    gammas: list[Optional[int]] = []
    index = best
    for b in range(len(deadlines) - 1, -1, -1):
        index, k = _dp_parent(links[b], index)
        gammas.append(None if k < 0 else options[b][k].gamma)
    gammas.reverse()
    return DPSolution(tuple(gammas), utility, finish, widest, truncated)


def _all_best_solution(deadlines: Iterable[float], stages: Iterable["_DPStage"], start: float,
                       executors: int = 1) -> DPSolution | None:
    """Alg. 2's answer where it needs no trade-off, without building a frontier; None elsewhere.

    ``deadlines`` and ``stages``: per batch in EDD order, d_b and its undominated options (read
    lazily, in step: a batch that does not fit ends the pass). Contract: where this returns a
    solution, :func:`solve_token_dp` on the same batches, start and
    executors (any ``max_labels`` >= 2) returns the same gammas and the same ``utility`` and ``finish``
    to the bit; only ``max_frontier`` (1) and ``truncated`` (False) differ, and ``all_best`` is True
    (tests/unit/test_otas_all_best.py checks it on the DP's hard random cases and in whole simulations).

    It answers when, in EDD order from ``start``, every batch at its most useful undominated option
    meets its deadline (the DP's own test: clock + seconds < d_b, the clock moved on by seconds /
    executors per batch, the same double operations in the same order), and that option beats the
    batch's next best (skip's 0 included) by more than ``1e-8 * max(1, sum of the best utilities)``.
    Then every other assignment earns at least that margin less, far more than the DP's near-tie
    tolerance (1e-9 relative) and the rounding of any sum; so at every stage the all-best label has
    the frontier's lowest negated utility by that margin: it is kept when the candidate order reaches
    it, nothing after it is kept, it is the frontier's last label, which thinning keeps, and the
    final label the DP backtracks from. Below load this is most decisions (bench/RESULTS.md,
    sim_speed: at 0.7 of capacity every one): the DP, linear in the queue and at 128 labels about
    0.8 ms on a queue of ~90 batches, was most of a 100-instance simulation's wall time.
    """
    clock, neg, total, lead = start, -0.0, 0.0, math.inf
    gammas: list[Optional[int]] = []
    for stage, deadline in zip(stages, deadlines):
        best = stage.best
        if best is None:
            return None
        gamma, seconds, utility, gap = best
        if not clock + seconds < deadline:
            return None
        if gap < lead:
            lead = gap
        clock = clock + seconds / executors
        neg = neg - utility
        total += abs(utility)
        gammas.append(gamma)
    if not (lead > 1e-8 * max(1.0, total) and math.isfinite(total) and math.isfinite(clock)):
        return None
    return DPSolution(tuple(gammas), -neg, clock, 1, False, True)


_SWITCHED_OFF = ("0", "false", "no", "off")
_NUMBERS = (float, int)  # what Python's float arithmetic reads as the double the native DP reads


def _dp_native(deadlines: Sequence[float], options: Sequence[Sequence[GammaOption]], stages: list["_DPStage"],
               start: float, max_labels: int, *, sort_all: bool = False, executors: int = 1) -> DPSolution | None:
    """:func:`solve_token_dp` in one call of the native DP (jaxserve/kernels/otas_dp.c: every stage
    and the back-tracking), for inputs from which no NaN can arise; None where it cannot answer (no
    library: no compiler or a failed build, logged once; or a utility sum overflowed to an infinity,
    where the Python and numpy stages' near-tie shortcuts could part), and the caller's stages run
    instead. The same labels as those stages, to the bit: the C code makes the same IEEE double
    operations in the same order, compiled without fast-math or FMA contraction. ``sort_all``: every
    stage by a plain sort of all its candidates, the C code's reference order (tests)."""
    from jaxserve.kernels import otas_dp_library

    native = otas_dp_library()
    if native is None:
        return None
    n = len(stages)
    columns = np.empty(n, dtype=np.int32)  # per batch: 0 (not executed) or its undominated option's column
    out = np.empty(4, dtype=np.float64)  # finish, negated utility, then widest and truncated as int64
    address = out.ctypes.data
    rc = native.solve(n, struct.pack(f"{n}d", *deadlines), b"".join(map(_STAGE_RECORD, stages)), start,
                      float(executors), max_labels,
                      int(sort_all), columns.ctypes.data, address, address + 16, address + 24)
    if rc:
        if rc == 2:
            raise MemoryError("native OTAS DP: out of memory")
        return None
    finish, neg = out[:2].tolist()
    widest, truncated = out[2:].view(np.int64).tolist()
    gammas: list[Optional[int]] = [None] * n
    for b in columns.nonzero()[0].tolist():  # few batches run: look up only theirs
        gammas[b] = options[b][stages[b].columns[columns[b]]].gamma
    return DPSolution(tuple(gammas), -neg, finish, widest, bool(truncated))


class _DPStage:
    """One batch's undominated options (``_undominated(options)``) as a DP stage reads them,
    built once per option list: the policy keeps one per queued batch (:meth:`_QueuedBatch.undominated`).

    ``delta``: per column (0: skip, then the options) the complex step added to a label
    ``clock + 1j * -utility``: ``seconds - 1j * utility``, and ``-0.0 - 0.0j`` for skip, which
    leaves every label as it is (x + -0.0 == x for every x, -0.0 included; n + -g == n - g).
    ``plain``: the seconds and utilities are finite, so that from a frontier without NaN no
    candidate is NaN (each step adds a finite number; inf - inf never happens) and the complex
    stage's sort orders the candidates exactly as :func:`np.lexsort` on (clock, -utility) does.
    ``native``: plain, and every number a float or an int, which Python's arithmetic reads as the
    double the native DP reads (a numpy float32 or a Decimal would not be): :func:`_dp_native` may
    take the stage. ``record``: the options as it reads them, float64 bytes: their count, then
    (seconds, utility) per option."""

    __slots__ = ("useful", "width", "columns", "plain", "native", "best", "_delta", "_record", "_shared")

    def __init__(self, useful: Iterable[tuple[int, GammaOption]]) -> None:
        self.useful: tuple[tuple[int, GammaOption], ...] = tuple(useful)
        self.width = len(self.useful) + 1
        columns = [-1]
        plain = native = True
        # the most useful option and the next best utility (skip's 0 included), for ``best``
        top: GammaOption | None = None
        runner_up = 0.0
        isfinite = math.isfinite
        for k, o in self.useful:
            columns.append(k)
            seconds, utility = o.seconds, o.utility
            if not plain:
                continue
            if not (isfinite(seconds) and isfinite(utility)):
                plain = native = False
                continue
            native = native and isinstance(seconds, _NUMBERS) and isinstance(utility, _NUMBERS)
            if top is None or utility > top.utility:  # undominated: no two utilities are equal
                if top is not None and top.utility > runner_up:
                    runner_up = top.utility
                top = o
            elif utility > runner_up:
                runner_up = utility
        self.columns = columns
        self.plain = plain
        self.native = native
        # For _all_best_solution: (gamma, seconds, utility, lead over the next best) of the most
        # useful option; None without options or where one is not finite.
        self.best: tuple[int, float, float, float] | None = None
        if top is not None and plain:
            self.best = (top.gamma, top.seconds, top.utility, top.utility - runner_up)
        self._delta: np.ndarray | None = None  # made on first use: a DP the shortcut answers reads neither
        self._record: bytes | None = None
        self._shared: tuple[int, np.ndarray] | None = None

    @property
    def delta(self) -> np.ndarray:
        if self._delta is None:
            self._delta = np.array([complex(-0.0, -0.0)] + [complex(o.seconds, -o.utility) for _, o in self.useful],
                                   dtype=np.complex128)
        return self._delta

    @property
    def record(self) -> bytes:
        if self._record is None:
            self._record = np.array([len(self.useful)] + [x for _, o in self.useful for x in (o.seconds, o.utility)],
                                    dtype=np.float64).tobytes()
        return self._record

    def shared(self, executors: int) -> np.ndarray:
        """``delta`` with each clock step divided by ``executors`` (-0.0 / m == -0.0: skip still
        leaves a label as it is), kept for the last ``executors`` asked."""
        if self._shared is None or self._shared[0] != executors:
            delta = np.empty_like(self.delta)
            delta.real = self.delta.real / executors
            delta.imag = self.delta.imag
            self._shared = (executors, delta)
        return self._shared[1]

    def __len__(self) -> int:
        return len(self.useful)

    def __iter__(self):
        return iter(self.useful)


_DP_NUMPY_FROM = 40  # candidate labels from which a DP stage runs in numpy (the same labels, faster from ~35)
_DP_TWO_ARRAYS_FROM = 160  # the same where a NaN may arise (_dp_stage_numpy, from as many as it always ran from)
_THIN: dict[tuple[int, int], list[int]] = {}


def _thin(n: int, max_labels: int) -> list[int]:
    """The positions an evenly thinned frontier of ``n`` labels keeps (the extremes included)."""
    pick = _THIN.get((n, max_labels))
    if pick is None:
        step = (n - 1) / (max_labels - 1)
        pick = _THIN[(n, max_labels)] = [round(i * step) for i in range(max_labels)]
        if len(_THIN) > 4096:
            _THIN.clear()
    return pick


_THIN_ARRAYS: dict[tuple[int, int], np.ndarray] = {}


def _thin_array(n: int, max_labels: int) -> np.ndarray:
    """:func:`_thin` as an index array."""
    pick = _THIN_ARRAYS.get((n, max_labels))
    if pick is None:
        pick = _THIN_ARRAYS[(n, max_labels)] = np.array(_thin(n, max_labels), dtype=np.intp)
        if len(_THIN_ARRAYS) > 4096:
            _THIN_ARRAYS.clear()
    return pick


def _dp_keep_near_ties(sn: np.ndarray, low: np.ndarray) -> np.ndarray:
    """The sequential rule of :func:`_dp_stage_python` on sorted negated utilities ``sn``
    (``low``: their running minimum), visiting only the labels it may keep: a label that
    was not kept lies at most 1e-9 relative below the last kept one, so the last kept one
    is within 2e-9 (relative) of the running minimum, and a label above that never passes."""
    lows = low[:-1]
    maybe = np.flatnonzero(sn[1:] < lows + 2e-9 * np.maximum(1.0, np.abs(lows))) + 1
    kept = [0]
    last = float(sn[0])
    for i, n in zip(maybe.tolist(), sn[maybe].tolist()):
        if n < last and last - n > 1e-9 * max(1.0, abs(n), abs(last)):
            kept.append(i)
            last = n
    return np.array(kept, dtype=np.intp)


def _dp_parent(link: tuple, index: int) -> tuple[int, int]:
    """(index of the parent label, option index or -1 = skip) of label ``index`` of a stage."""
    if link[0] == "py":
        return link[1][index], link[2][index]
    _, flat, width, columns = link  # candidate flat = parent * width + column (0: skip)
    parent, column = divmod(int(flat[index]), width)
    return parent, columns[column]


def _dp_stage_python(clocks: list[float], negs: list[float], useful: Sequence[tuple[int, GammaOption]],
                     deadline: float, max_labels: int, executors: int = 1) -> tuple:
    """One DP stage over plain lists: (clocks, negated utilities, link, thinned). A label that runs
    an option must finish (clock + seconds) before the deadline and moves on by seconds / executors."""
    n_labels = len(clocks)
    candidates = list(zip(clocks, negs, range(n_labels), [-1] * n_labels))
    for k, o in useful:
        seconds, gain = o.seconds, o.utility
        step = seconds / executors  # x / 1 == x: one executor advances by the whole time
        for p in range(n_labels):
            clock = clocks[p]
            if not clock + seconds < deadline:  # clocks ascend, so do the finishes: no later label fits
                break
            candidates.append((clock + step, negs[p] - gain, p, k))
    candidates.sort()  # (clock, -utility, parent, option): ties in the order they were made
    fc: list[float] = []
    fn: list[float] = []
    fp: list[int] = []
    fk: list[int] = []
    last = math.inf
    for c, n, p, k in candidates:
        # keep a strictly better utility, unless equal to the last kept within 1e-9 (_same_utility)
        if n < last and (not fn or last - n > 1e-9 * max(1.0, abs(n), abs(last))):
            fc.append(c)
            fn.append(n)
            fp.append(p)
            fk.append(k)
            last = n
    thinned = len(fc) > max_labels
    if thinned:
        pick = _thin(len(fc), max_labels)
        fc, fn, fp, fk = [fc[i] for i in pick], [fn[i] for i in pick], [fp[i] for i in pick], [fk[i] for i in pick]
    return fc, fn, ("py", fp, fk), thinned


def _dp_stage_numpy(clocks, negs, useful: Sequence[tuple[int, GammaOption]], deadline: float,
                    max_labels: int, executors: int = 1) -> tuple:
    """:func:`_dp_stage_python` vectorised: the same labels."""
    c = np.asarray(clocks, dtype=np.float64)
    n = np.asarray(negs, dtype=np.float64)
    width = len(useful) + 1
    seconds = np.array([0.0] + [o.seconds for _, o in useful])
    gains = np.array([0.0] + [o.utility for _, o in useful])
    cc = np.add.outer(c, seconds)  # flat index = parent * width + column: the order candidates are made in
    cc[:, 0] = c  # skip: the label itself (c + 0.0 would turn -0.0 into 0.0)
    nn = np.subtract.outer(n, gains)
    nn[:, 0] = n
    fits = cc < deadline
    fits[:, 0] = True
    if executors != 1:  # the fit test used the whole time; the clock moves on by its share
        cc = np.add.outer(c, seconds / executors)
        cc[:, 0] = c
    flat = np.flatnonzero(fits)
    cc = cc.ravel()[flat]
    nn = nn.ravel()[flat]
    order = np.lexsort((nn, cc))  # stable: (clock, -utility), then the order made (equal clocks are common)
    sn = nn[order]
    low = np.minimum.accumulate(sn)
    better = np.flatnonzero(sn[1:] < low[:-1]) + 1  # utility above every label before it
    kept = None
    if len(better):
        # Each such label is kept unless within 1e-9 of the last kept one, which (all earlier
        # such labels kept) is the best before it: if none is that close, exactly these are kept.
        gap_to = low[better - 1]
        here = sn[better]
        if ((gap_to - here) <= 1e-9 * np.maximum(1.0, np.maximum(np.abs(here), np.abs(gap_to)))).any():
            kept = _dp_keep_near_ties(sn, low)
    if kept is None:
        kept = np.concatenate(([0], better))
    thinned = len(kept) > max_labels
    if thinned:
        kept = kept[_thin(len(kept), max_labels)]
    chosen = order[kept]
    return cc[chosen], nn[chosen], ("np", flat[chosen], width, [-1] + [k for k, _ in useful]), thinned


def _dp_stage_complex(joint: np.ndarray, stage: _DPStage, deadline: float, max_labels: int,
                      executors: int = 1) -> tuple:
    """:func:`_dp_stage_numpy` on the frontier as one complex array ``clock + 1j * -utility``
    (no NaN in it or in ``stage``): (frontier, link, thinned), the same labels with fewer numpy
    calls. One complex addition makes every candidate's clock and negated utility (the real and
    imaginary parts add separately: the same additions); a stable sort of complex numbers is
    lexicographic, (clock, -utility) then the order made, as np.lexsort's; the running minimum
    of the negated utilities drops exactly where a label beats every one before it."""
    cand = joint[:, None] + stage.delta  # flat index = parent * width + column: the order candidates are made in
    fits = cand.real < deadline
    fits[:, 0] = True  # skip: always possible
    if executors != 1:  # the fit test used the whole time; the clock moves on by its share
        cand = joint[:, None] + stage.shared(executors)
    flat = fits.ravel().nonzero()[0]
    cand = cand.ravel()[flat]
    order = cand.argsort(kind="stable")
    cand = cand[order]
    sn = cand.imag
    low = np.minimum.accumulate(sn)
    drop = low[:-1] - low[1:]  # > 0 exactly where the utility beats every label before it (no NaN)
    keep = np.empty(len(sn), dtype=bool)
    keep[0] = True
    np.greater(drop, 0.0, out=keep[1:])
    kept = keep.nonzero()[0]
    if len(kept) > 1:
        # _dp_stage_numpy's near-tie test compares each such label's drop with 1e-9 x the larger
        # magnitude of the two utilities, which lie between low[-1] and sn[0]: a drop above
        # 1e-9 x the larger of those passes every test, so only a smaller one needs the test itself.
        # (Every drop is >= 0: the labels dropping by more than the bound are all of them iff none needs it.)
        bound = 1e-9 * max(1.0, abs(float(low[-1])), abs(float(sn[0])))
        if np.count_nonzero(drop > bound) != len(kept) - 1:
            better = kept[1:]
            gap_to = low[better - 1]
            here = sn[better]
            if ((gap_to - here) <= 1e-9 * np.maximum(1.0, np.maximum(np.abs(here), np.abs(gap_to)))).any():
                kept = _dp_keep_near_ties(sn, low)
    thinned = len(kept) > max_labels
    if thinned:
        kept = kept[_thin_array(len(kept), max_labels)]
    chosen = order[kept]
    return cand[kept], ("np", flat[chosen], stage.width, stage.columns), thinned


# --------------------------------------------------------------------------- Alg. 3


@dataclass(frozen=True)
class LoadToGamma:
    """f(q) of Alg. 3, derived from the profile of the machine at hand.

    ``rows`` holds (gamma, sustainable rate, mean accuracy); the sustainable rate is
    ``headroom * B_max / latency(Cell(B_max, 0, gamma))`` req/s.
    """

    rows: tuple[tuple[int, float, float], ...]

    @classmethod
    def from_profile(
        cls,
        latency: LatencyProfile,
        accuracy: AccuracyProfile,
        grid: ShapeGrid,
        gammas: Sequence[int],
        headroom: float = 0.8,
    ) -> "LoadToGamma":
        if not 0 < headroom <= 1:
            raise ValueError("headroom must be in (0, 1]")
        tasks = sorted({t for (t, _) in accuracy.accuracy})
        tasks = [t for t in tasks if all((t, g) in accuracy.accuracy for g in gammas)]
        if not tasks:
            raise ValueError(f"no task of {accuracy.model} is profiled at every gamma of {tuple(gammas)}")
        top = grid.max_batch
        rows = []
        for g in gammas:
            seconds = latency.latency_for(top, 0, g)
            rate = headroom * top / seconds
            acc = sum(accuracy.of(t, g) for t in tasks) / len(tasks)
            rows.append((g, rate, acc))
        return cls(tuple(rows))

    def sustaining(self, rate: float) -> frozenset[int]:
        """The gammas whose sustainable rate is at least ``rate`` (possibly none)."""
        return frozenset(r[0] for r in self.rows if r[1] >= rate)

    def __call__(self, rate: float) -> int:
        sustaining = [r for r in self.rows if r[1] >= rate]
        if not sustaining:
            return max(self.rows, key=lambda r: (r[1], -r[0]))[0]
        return max(sustaining, key=lambda r: (r[2], r[1], -r[0]))[0]

    def table(self) -> tuple[tuple[float, int], ...]:
        """Like the paper's Table I: (up to this rate, gamma) rows, ascending rate."""
        cuts = sorted({r[1] for r in self.rows})
        out: list[tuple[float, int]] = []
        for cut in cuts:
            g = self(cut)
            if not out or out[-1][1] != g:
                out.append((cut, g))
            else:
                out[-1] = (cut, g)
        return tuple(out)


def manual_allocate(
    deadlines: Sequence[float],
    mean_utilities: Sequence[float],
    options: Sequence[Sequence[GammaOption]],
    start: float,
    load_gamma: int,
    kappa: float,
    executors: int = 1,
    sustaining: Optional[Collection[int]] = None,
) -> tuple[int, ...]:
    """Alg. 3 for batches in EDD order: a gamma for every batch (none is skipped).

    ``load_gamma`` is f(q); ``options[b]`` must contain it. See the module docstring for
    the places where we refine the paper (fastest gamma for min(L); for max(L), the most
    accurate gamma that meets d_b and is in ``sustaining``, the gammas that sustain q:
    :meth:`LoadToGamma.sustaining`; f(q) is always allowed; None allows every gamma). A
    batch started at the running clock T must finish (T + t) before d_b and moves T on by
    t / ``executors`` (as in :func:`solve_token_dp`).
    """
    clock = start
    chosen: list[int] = []
    for deadline, mean_u, opts in zip(deadlines, mean_utilities, options):
        by_gamma = {o.gamma: o for o in opts}
        if load_gamma not in by_gamma:
            raise ValueError(f"f(q) = {load_gamma} is not among the options {sorted(by_gamma)}")
        pick = by_gamma[load_gamma]
        if clock + pick.seconds >= deadline:
            pick = min(opts, key=lambda o: (o.seconds, o.gamma))
        elif mean_u > kappa:
            meeting = [o for o in opts if clock + o.seconds < deadline
                       and (sustaining is None or o.gamma == load_gamma or o.gamma in sustaining)]
            pick = max(meeting, key=lambda o: (o.utility, -o.seconds, o.gamma))
        chosen.append(pick.gamma)
        clock += pick.seconds / executors
    return tuple(chosen)


# --------------------------------------------------------------------------- shared machinery


class _Pricer:
    """Prices batches of one model from its profiles (cached)."""

    def __init__(self, model: str, latency: LatencyProfile, accuracy: AccuracyProfile,
                 grid: ShapeGrid, gammas: Sequence[int]) -> None:
        gammas = tuple(sorted(set(gammas)))
        if not gammas:
            raise ValueError("need at least one gamma")
        missing = [g for g in gammas if g not in grid.gammas]
        if missing:
            raise ValueError(f"gammas {missing} are not compiled in the grid {grid.gammas}")
        self.model, self.latency, self.accuracy, self.grid, self.gammas = model, latency, accuracy, grid, gammas
        self._seconds: dict[tuple[int, int], float] = {}
        self._fastest: dict[int, float] = {}
        self._slowest_fastest: float | None = None
        self._rows: dict[str, tuple[float, ...]] = {}  # task -> accuracy per gamma
        for g in gammas:  # fail at construction, not mid-run, if a column is missing
            self.seconds(grid.max_batch, g)

    def cell(self, count: int, gamma: int) -> Cell:
        return self.grid.cell_for(count, 0, gamma)

    def seconds(self, count: int, gamma: int) -> float:
        key = (count, gamma)
        if key not in self._seconds:
            cell = self.cell(count, gamma)
            try:
                t = self.latency.latency(cell)
            except KeyError:
                t = self.latency.latency_for(cell.batch, 0, gamma)
            self._seconds[key] = t
        return self._seconds[key]

    def fastest_seconds(self, count: int) -> float:
        t = self._fastest.get(count)
        if t is None:
            t = self._fastest[count] = min(self.seconds(count, g) for g in self.gammas)
        return t

    def slowest_fastest(self) -> float:
        """The largest :meth:`fastest_seconds` over the batch sizes the grid runs."""
        if self._slowest_fastest is None:
            self._slowest_fastest = max(self.fastest_seconds(n) for n in range(1, self.grid.max_batch + 1))
        return self._slowest_fastest

    def utilities(self, requests: Sequence[Request], start: int = 0,
                  partial: Sequence[float] | None = None) -> list[float]:
        """Per gamma (in :attr:`gammas` order), the sum over ``requests`` of accuracy x
        utility, summed in request order; ``partial``: the sums over ``requests[:start]``,
        continued from there (the same floating-point sequence as summing all of them)."""
        rows = self._rows
        sums = [0.0] * len(self.gammas) if partial is None else list(partial)
        for r in requests[start:]:
            row = rows.get(r.task)
            if row is None:
                row = self._row(r.task, requests[start:])
            u = r.utility
            sums = [s + a * u for s, a in zip(sums, row)]  # per gamma: the same additions, in request order
        return sums

    def _row(self, task: str, requests: Sequence[Request]) -> tuple[float, ...]:
        """The accuracy of ``task`` per gamma (cached); a KeyError names the first hole, gamma by
        gamma, among ``requests``' tasks."""
        try:
            row = self._rows[task] = tuple(self.accuracy.of(task, g) for g in self.gammas)
        except KeyError:
            for g in self.gammas:
                for r in requests:
                    if (r.task, g) not in self.accuracy.accuracy:
                        raise KeyError(f"no accuracy profiled for task {r.task!r} at gamma {g} ({self.model})") from None
            raise
        return row

    def options(self, requests: Sequence[Request], utilities: Sequence[float] | None = None) -> list[GammaOption]:
        """The batch's gamma options; ``utilities``: :meth:`utilities` of ``requests``, if known."""
        n = len(requests)
        us = self.utilities(requests) if utilities is None else utilities
        return [GammaOption(g, self.seconds(n, g), u) for g, u in zip(self.gammas, us)]


class _QueuedBatch:
    """A batch under construction/waiting (internal, mutable). Its requests change only through
    :meth:`add` and :meth:`keep`, which keep the cached earliest deadline and per-gamma utility
    sums (:meth:`utilities`) and options current: a plan reads them for every queued batch, and
    recomputing them over every request made OTAS the slowest policy to simulate. Sums and
    options are of one pricer; a policy that reprices (a new ``_Pricer``) gets them afresh."""

    __slots__ = ("key", "requests", "opened", "first_utility", "_deadline", "_sums", "_summed", "_options", "_by",
                 "_useful", "queued", "_edd_entry", "_moment_entry", "joinable", "dp")

    def __init__(self, key: int, first: Request, now: float) -> None:
        self.key = key
        self.requests = [first]
        self.opened = now  # s_b, as seen by the policy
        self.first_utility = first.utility
        self._deadline = first.deadline
        self.queued = False  # in a _BatchQueue (which keeps the two entries below and ``joinable``)
        self.joinable = False  # in the _BatchQueue's admission index (_BatchQueue.first_fit)
        self._edd_entry: tuple | None = None
        self._moment_entry: tuple | None = None
        self._sums: list[float] | None = None  # utility sums over requests[:_summed]
        self._summed = 0
        self._options: list[GammaOption] | None = None  # of requests[:_summed]
        self._by: "_Pricer | None" = None  # the pricer the sums and options are of
        self._useful: tuple[list[GammaOption], _DPStage] | None = None  # (options, their undominated ones)
        # (pricer, options, undominated stage) as :meth:`dp_inputs` gave them for these requests; None once
        # they change (add, keep) or the policy reprices (OTASPolicy._schedule clears every queued batch's).
        # A plan reads it for every queued batch without a method call.
        self.dp: tuple[_Pricer, list[GammaOption], _DPStage] | None = None

    def add(self, request: Request) -> None:
        self.requests.append(request)
        self._deadline = min(self._deadline, request.deadline)
        self.dp = None

    def keep(self, requests: list[Request]) -> None:
        """Replace the requests by ``requests`` (a subsequence: some were withdrawn or evicted)."""
        self.requests = requests
        self._deadline = min((r.deadline for r in requests), default=math.inf)
        self._sums, self._summed, self._options = None, 0, None
        self.dp = None

    @property
    def deadline(self) -> float:
        return self._deadline

    def utilities(self, pricer: "_Pricer") -> list[float]:
        """:meth:`_Pricer.utilities` of the requests, extended from the last call's sums when
        requests were only added since (appending continues the same summation order)."""
        n = len(self.requests)
        if self._by is not pricer:  # repriced, or new accuracy (a new pricer): start over
            self._sums, self._summed, self._options, self._by = None, 0, None, pricer
        if self._sums is None or self._summed != n:
            self._sums = pricer.utilities(self.requests, self._summed, self._sums)
            self._summed = n
            self._options = None
        return self._sums

    def options(self, pricer: "_Pricer") -> list[GammaOption]:
        """:meth:`_Pricer.options` of the requests, kept until they change."""
        sums = self.utilities(pricer)
        if self._options is None:
            self._options = pricer.options(self.requests, sums)
        return self._options

    def undominated(self, pricer: "_Pricer") -> _DPStage:
        """``_undominated(self.options(pricer))`` as a DP stage reads it, kept while the options are."""
        options = self.options(pricer)
        if self._useful is None or self._useful[0] is not options:
            self._useful = (options, _DPStage(_undominated(options)))
        return self._useful[1]

    def dp_inputs(self, pricer: "_Pricer") -> tuple[list[GammaOption], _DPStage]:
        """``(self.options(pricer), self.undominated(pricer))``, read without recomputing when nothing
        changed since they were made (the same requests, the same pricer): a DP reads every queued batch."""
        useful = self._useful
        if (useful is None or self._by is not pricer or self._summed != len(self.requests)
                or useful[0] is not self._options):
            self.undominated(pricer)
            useful = self._useful
        return useful

    def cache_dp(self, pricer: "_Pricer") -> tuple["_Pricer", list[GammaOption], _DPStage]:
        """Set and return :attr:`dp` from :meth:`dp_inputs`."""
        self.dp = dp = (pricer, *self.dp_inputs(pricer))
        return dp

    def sort_key(self) -> tuple[float, float, int]:
        return (self.deadline, self.opened, self.key)


class _Ahead:
    """The busy instances' estimated finishes still ahead of the clock, and their sum: the backlog
    :meth:`SelectiveBatchingPolicy._share` reads at every plan that schedules, in O(1) amortised
    instead of a pass over every busy instance (at 1,000 instances that pass was a fifth of a
    simulation's wall time).

    ``set``/``drop`` follow the policy's busy estimates; :meth:`backlog` (``now`` never earlier
    than the last asked) first retires the finishes no longer after ``now``, then returns
    ``sum - count * now``: the same backlog as summing ``finish - now`` over the finishes after
    ``now``, up to rounding (it differs only where two or more instances are busy, the only case
    where the plan reads it: one instance plans from ``now``). The running sum is recomputed
    exactly (``math.fsum``) once the updates since the last recount outnumber its entries (plus
    64), and is 0 whenever it is empty, so rounding never accumulates. None where it cannot answer: ``now`` earlier than a previous
    ask (the caller then reads every estimate) or a finish that is not finite.
    """

    __slots__ = ("_of", "_heap", "_sum", "_swept", "_updates")

    def __init__(self) -> None:
        self._of: dict[int, float] = {}  # instance -> its finish, counted in _sum
        self._heap: list[tuple[float, int]] = []  # (finish, instance), stale entries too
        self._sum = 0.0
        self._swept = -math.inf  # the latest now asked
        self._updates = 0

    def set(self, instance: int, finish: float) -> None:
        self.drop(instance)
        if finish > self._swept:
            self._of[instance] = finish
            self._sum += finish
            self._updates += 1
            heappush(self._heap, (finish, instance))
            if len(self._heap) > 2 * len(self._of) + 64:  # mostly stale: rebuild
                self._heap = [(f, i) for i, f in self._of.items()]
                heapify(self._heap)

    def drop(self, instance: int) -> None:
        finish = self._of.pop(instance, None)
        if finish is not None:
            self._sum -= finish
            self._updates += 1

    def backlog(self, now: float) -> float | None:
        if now < self._swept:
            return None
        self._swept = now
        heap, of = self._heap, self._of
        while heap and heap[0][0] <= now:
            f, i = heappop(heap)
            if of.get(i) == f:
                del of[i]
                self._sum -= f
                self._updates += 1
        if not of:
            self._sum, self._updates = 0.0, 0
            return 0.0
        if self._updates > len(of) + 64:
            self._sum, self._updates = math.fsum(of.values()), 0
        total = self._sum
        if not math.isfinite(total):
            return None
        return total - len(of) * now


class _BatchQueue:
    """The queued batches of a :class:`SelectiveBatchingPolicy`, indexed for what every event asks.

    A plan used to scan every queued batch several times per event (admission, eviction, EDD
    order, the wake-up), which made OTAS at 100+ instances (a queue of ~130 batches) the
    slowest policy to simulate. Kept current on every change, through :meth:`open`,
    :meth:`join`, :meth:`keep` and :meth:`remove` only:

    * iteration and ``batches``: creation order (Alg. 1's "first batch found");
    * :meth:`edd`: the batches sorted by :meth:`_QueuedBatch.sort_key`;
    * :meth:`moments`: per batch ``(deadline - pricer.fastest_seconds(size), key, batch)``,
      ascending: from that moment on its earliest-deadline request is hopeless (eviction and
      the wake-up); rebuilt when asked with another pricer (a reprice, a variant switch);
    * :meth:`first_fit`: Alg. 1's admission, looking only at batches still young enough to
      accept joins and not full (fewer requests than the last ``cap`` asked with), grouped by
      their opener's utility, in creation order: a batch leaves that index when it fills up,
      is dispatched or emptied, and comes back (in its place) when a ``keep`` makes room in it;
    * ``depth``: the number of queued requests.

    The answers equal brute force over the batches in creation order, to the bit
    (tests/unit/test_otas_sched.py checks them after random operation sequences).
    """

    def __init__(self) -> None:
        self.batches: dict[int, _QueuedBatch] = {}  # key -> batch, creation order
        self.depth = 0
        self._edd: list[tuple[float, float, int, _QueuedBatch]] = []
        self._edd_batches: list[_QueuedBatch] = []  # [e[3] for e in _edd], kept alongside it
        self._moments: list[tuple[float, int, _QueuedBatch]] = []
        self._pricer: _Pricer | None = None  # the pricer _moments are of (None: not built)
        # first_fit: per opener utility, (key, batch) of the queued batches with fewer than ``_cap`` requests,
        # opened less than ``batching.delta`` before ``_seen`` (old ones are dropped lazily, from the front),
        # ascending key (creation order, hence opening order); a batch is in it iff its ``joinable``
        self._young: dict[float, list[tuple[int, _QueuedBatch]]] | None = {}  # None: the clock went back, scan all
        self._batching: BatchingParams | None = None  # the parameters _young and _similar are for
        self._cap: int | None = None  # the cap _young is for (None: not built yet; every batch counts as not full)
        self._similar: dict[tuple[float, float], bool] = {}  # (utility, opener's utility) -> ratio >= mu
        self._seen = -math.inf  # the latest ``now`` first_fit was asked at

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches.values())

    def open(self, qb: _QueuedBatch) -> None:
        """Queue a new batch (its key larger than every queued one)."""
        self.batches[qb.key] = qb
        qb.queued = True
        self.depth += len(qb.requests)
        self._index(qb)
        if self._young is not None and (self._cap is None or len(qb.requests) < self._cap):
            group = self._young.get(qb.first_utility)
            if group is None:
                self._young[qb.first_utility] = group = []
            group.append((qb.key, qb))  # the largest key: the end is its place
            qb.joinable = True

    def join(self, qb: _QueuedBatch, request: Request) -> None:
        deadline = qb._deadline
        qb.add(request)
        self.depth += 1
        if qb._deadline is not deadline:  # min() kept the old object: the deadline did not change
            self._unindex(qb)
            self._index(qb)
        elif self._pricer is not None:  # the EDD entry stands; the moment may have moved with the size
            old = qb._moment_entry
            moment = qb._deadline - self._pricer.fastest_seconds(len(qb.requests))
            if moment != old[0] or moment == 0.0:  # equal and non-zero: the same double, the same entry
                _drop(self._moments, old)
                qb._moment_entry = moment = (moment, qb.key, qb)
                insort(self._moments, moment)
        if qb.joinable and self._cap is not None and len(qb.requests) >= self._cap:  # full: admission need not look at it
            self._leave_young(qb)

    def keep(self, qb: _QueuedBatch, requests: list[Request]) -> None:
        """:meth:`_QueuedBatch.keep`; a batch left empty leaves the queue."""
        self.depth += len(requests) - len(qb.requests)
        qb.keep(requests)
        self._unindex(qb)
        if requests:
            self._index(qb)
            if (not qb.joinable and self._young is not None
                    and (self._cap is None or len(requests) < self._cap)):  # room again: back in its place
                group = self._young.get(qb.first_utility)
                if group is None:
                    self._young[qb.first_utility] = group = []
                group.insert(bisect_left(group, (qb.key,)), (qb.key, qb))
                qb.joinable = True
        else:
            del self.batches[qb.key]
            qb.queued = False
            if qb.joinable:
                self._leave_young(qb)

    def remove(self, qb: _QueuedBatch) -> None:
        del self.batches[qb.key]
        qb.queued = False
        self.depth -= len(qb.requests)
        self._unindex(qb)
        if qb.joinable:
            self._leave_young(qb)

    def _leave_young(self, qb: _QueuedBatch) -> None:
        """Take ``qb`` out of first_fit's index (it is there: ``qb.joinable``)."""
        group = self._young[qb.first_utility]
        del group[bisect_left(group, (qb.key,))]
        qb.joinable = False

    def edd(self) -> list[_QueuedBatch]:
        """The batches in EDD order (deadline, then opening time, then creation)."""
        return self._edd_batches[:]

    def moments(self, pricer: "_Pricer") -> list[tuple[float, int, _QueuedBatch]]:
        """``(deadline - pricer.fastest_seconds(size), key, batch)`` per batch, ascending (do not modify)."""
        if pricer is not self._pricer:
            self._pricer = pricer
            for qb in self.batches.values():
                qb._moment_entry = (qb.deadline - pricer.fastest_seconds(len(qb.requests)), qb.key, qb)
            self._moments = sorted(qb._moment_entry for qb in self.batches.values())
        return self._moments

    def first_fit(self, request: Request, now: float, batching: BatchingParams, cap: int) -> Optional[_QueuedBatch]:
        """Alg. 1: the first batch in creation order that ``request`` may join at ``now``, or None."""
        delta = batching.delta
        deadline, utility, eta, mu = request.deadline, request.utility, batching.eta, batching.mu
        if now < self._seen and self._young is not None:  # the clock went back (never in the engine or the
            self._young = None  # simulator): young no longer means "opened last", so scan every batch from now on
            for qb in self.batches.values():
                qb.joinable = False
        if self._young is None:
            for qb in self.batches.values():
                if (now - qb.opened < delta and len(qb.requests) < cap and _deadline_gap(deadline, qb.deadline) <= eta
                        and _utility_ratio(utility, qb.first_utility) >= mu):
                    return qb
            return None
        if batching is not self._batching or cap != self._cap:
            if self._batching is None or batching != self._batching or cap != self._cap:
                # every queued batch may be young (a longer delta) or not full (another cap) again
                for qb in self.batches.values():
                    qb.joinable = False
                self._young = young = {}
                for qb in self.batches.values():
                    if len(qb.requests) < cap:
                        group = young.get(qb.first_utility)
                        if group is None:
                            young[qb.first_utility] = group = []
                        group.append((qb.key, qb))
                        qb.joinable = True
                if batching != self._batching:
                    self._similar = {}
                self._cap = cap
            self._batching = batching
        self._seen = now
        similar = self._similar
        if len(similar) > 4096:  # many distinct utilities
            similar.clear()
        best: Optional[_QueuedBatch] = None
        gone = None
        for first_utility, group in self._young.items():
            # a batch too old to accept joins stays so (the clock only advances): forget it. Every batch
            # here is queued and not full (the index drops it when it is not).
            if group and not now - group[0][1].opened < delta:
                old = 1
                while old < len(group) and not now - group[old][1].opened < delta:
                    old += 1
                for _, qb in group[:old]:
                    qb.joinable = False
                del group[:old]
            if not group:
                gone = [first_utility] if gone is None else gone + [first_utility]
                continue
            ok = similar.get((utility, first_utility))
            if ok is None:
                ok = similar[(utility, first_utility)] = _utility_ratio(utility, first_utility) >= mu
            if not ok:
                continue
            for key, qb in group:  # all young: opened no earlier than the first
                if best is not None and key > best.key:
                    break
                if _deadline_gap(deadline, qb.deadline) <= eta:
                    best = qb
                    break
        if gone is not None:
            for first_utility in gone:
                del self._young[first_utility]
        return best

    def _index(self, qb: _QueuedBatch) -> None:
        qb._edd_entry = entry = (qb.deadline, qb.opened, qb.key, qb)
        i = bisect_right(self._edd, entry)  # where insort puts it
        self._edd.insert(i, entry)
        self._edd_batches.insert(i, qb)
        if self._pricer is not None:
            qb._moment_entry = moment = (qb.deadline - self._pricer.fastest_seconds(len(qb.requests)), qb.key, qb)
            insort(self._moments, moment)

    def _unindex(self, qb: _QueuedBatch) -> None:
        del self._edd_batches[_drop(self._edd, qb._edd_entry)]
        if self._pricer is not None:
            _drop(self._moments, qb._moment_entry)


def _drop(entries: list, entry: tuple) -> int:
    """Remove ``entry`` (the object itself) from the sorted list ``entries``; its position."""
    i = bisect_left(entries, entry)
    if not (i < len(entries) and entries[i] is entry):  # unordered values (a nan deadline): the slow way
        i = next(j for j, e in enumerate(entries) if e is entry)
    del entries[i]
    return i


def _creation(qb: _QueuedBatch) -> int:
    return qb.key


def _deadline_gap(a: float, b: float) -> float:
    if math.isinf(a) and math.isinf(b) and (a > 0) == (b > 0):
        return 0.0
    return abs(a - b)


def _utility_ratio(a: float, b: float) -> float:
    hi = max(abs(a), abs(b))
    return 1.0 if hi == 0 else min(abs(a), abs(b)) / hi


class SelectiveBatchingPolicy(Policy):
    """Alg. 1 batching, deadline eviction, dispatch and outcome bookkeeping.

    Subclasses choose the gamma of each batch in :meth:`_schedule`. Not a policy on its
    own. It serves one model: every request is treated as one for it and every
    :class:`Batch` carries the policy's model name (INFaaS: the current variant's).
    Busy instances are estimated from its own dispatches (profiled latency) only to
    evict early while none is idle; dispatch always trusts ``idle_instances``. Public
    read-outs: ``outcomes`` (request id -> :class:`OutcomeType`),
    ``request_gamma`` (request id -> gamma it ran with), ``decisions`` (one
    :class:`BatchDecision` per dispatched batch), ``counters`` and ``expected_utility``
    (sum of accuracy * u_r over requests finished on time).
    """

    name = "selective"

    def __init__(self, pricer: _Pricer, batching: BatchingParams = BatchingParams(),
                 rate_window: float = 1.0, start_time: Optional[float] = None) -> None:
        if rate_window <= 0:
            raise ValueError("rate_window must be positive")
        self._pricer = pricer
        self.accuracy_source = "cost model"  # or "repository": where make_otas_policy found it
        self.batching = batching
        self.rate_window = rate_window
        self.start_time = start_time
        self._queue = _BatchQueue()
        self._next_key = 0
        self._arrivals: deque[float] = deque()
        self._inflight: dict[int, tuple[Request, float]] = {}  # id -> (request, accuracy)
        self._busy_until: dict[int, float] = {}  # instance -> estimated finish
        self._finishes: list[tuple[float, int]] = []  # heap of (finish, instance), stale ones too: _free_at
        self._ahead = _Ahead()  # the estimates still ahead of the clock, summed: _share's backlog
        # insertion-ordered like dicts, and the oldest record leaves in O(1) (_trim_records)
        self.outcomes: dict[int, OutcomeType] = OrderedDict()
        self.request_gamma: dict[int, int] = OrderedDict()
        self.decisions: list[BatchDecision] = []
        self.counters: Counter[str] = Counter()
        self.expected_utility = 0.0
        self.record_limit: Optional[int] = None  # bound on outcomes/request_gamma/decisions (None: keep all)
        self.executors = 1  # instances served at the last plan that scheduled (_share)
        self.backlog = 0.0  # seconds of work then running on the busy ones (_share)

    # ------------------------------------------------------------------ Policy hooks


    def use_accuracy(self, accuracy: AccuracyProfile) -> None:
        """Plan with ``accuracy`` from the next decision on: a reloaded prompt repository's
        profile (``jaxserve.launch.reload_assets``, which checks it with :func:`check_coverage`
        first). Batches already dispatched keep the accuracy they were priced with."""
        p = self._pricer
        self._pricer = _Pricer(p.model, p.latency, accuracy, p.grid, p.gammas)

    def reprice(self, cost_model: CostModel, now: float) -> None:
        """Price batches with ``cost_model``'s latency of this model from the next decision on
        (the engine's measured correction). Batches already dispatched keep their prices."""
        p = self._pricer
        if p.model in cost_model.latency:
            self._pricer = _Pricer(p.model, cost_model.latency[p.model], p.accuracy, p.grid, p.gammas)

    def on_arrival(self, request: Request, now: float) -> None:
        self._start(now)
        self._arrivals.append(now)
        self.counters["arrived"] += 1
        cap = min(self.batching.epsilon, self._max_batch())
        qb = self._queue.first_fit(request, now, self.batching, cap)  # creation order: the first batch found
        if qb is not None:
            self._queue.join(qb, request)
            return
        self._queue.open(_QueuedBatch(self._next_key, request, now))
        self._next_key += 1
        self.counters["batches_formed"] += 1

    def on_completion(self, batch: Batch, now: float,
                      summaries: Mapping[int, StepSummary] | None = None) -> None:
        self._busy_until.pop(batch.instance, None)
        self._ahead.drop(batch.instance)
        for rid in batch.request_ids:
            entry = self._inflight.pop(rid, None)
            if entry is None:
                continue
            request, acc = entry
            if now <= request.deadline:
                self.outcomes[rid] = OutcomeType.ACCURATE_ON_TIME
                self.counters["on_time"] += 1
                self.expected_utility += acc * request.utility
            else:
                self.outcomes[rid] = OutcomeType.LATE
                self.counters["late"] += 1
        self._trim_records()

    def plan(self, now: float, idle_instances: Sequence[int]) -> Plan:
        self._start(now)
        idle = idle_instances if isinstance(idle_instances, (list, tuple)) else list(idle_instances)
        free_at = self._free_at(now, bool(idle))
        evicted = self._evict_hopeless(free_at)
        batches: list[Batch] = []
        if idle and self._queue and now >= self._blocked_until():
            ordered = self._queue.edd()
            self._share(now, idle)
            schedule = self._schedule(now, ordered, len(idle))
            for (qb, gamma, source), instance in zip(schedule, idle):
                batches.append(self._dispatch(qb, gamma, source, instance, now))
        return Plan(tuple(batches), tuple(evicted), self._wake_at(now))

    def queue_depth(self) -> int:
        return self._queue.depth

    def _share(self, now: float, idle: Sequence[int]) -> None:
        """Set ``executors`` (m: the instances this policy serves now, busy or idle) and ``backlog``
        (the estimated seconds of work still running on the busy ones; an estimate already past
        counts 0) for :meth:`_schedule`. An instance both idle and still in the busy estimates (its
        completion not yet reported) is idle."""
        busy = self._busy_until
        if not busy:
            self.executors, self.backlog = len(idle), 0.0
            return
        both = [i for i in idle if i in busy]
        self.executors = len(busy) + len(idle) - len(both)
        backlog = self._ahead.backlog(now)
        if backlog is None:  # a clock that went back, or a finish that is not finite: every estimate read
            backlog = sum(f - now for f in busy.values() if f > now)
        for i in both:
            if busy[i] > now:
                backlog -= busy[i] - now
        self.backlog = max(backlog, 0.0)

    def withdraw(self, request_id: int, now: float) -> bool:
        """Take a queued request out of its batch (its client went away); a batch left
        empty is dropped. The batch keeps its opening time and its opener's utility as
        the admission key for later arrivals (Alg. 1 compares against the batch as
        opened), even when the opener is the one withdrawn."""
        for qb in self._queue:
            for i, r in enumerate(qb.requests):
                if r.id == request_id:
                    self._queue.keep(qb, qb.requests[:i] + qb.requests[i + 1:])  # an empty batch leaves
                    self.counters["withdrawn"] += 1
                    return True
        return False

    # ------------------------------------------------------------------ read-outs

    def arrival_rate(self, now: float) -> float:
        """q: arrivals per second over the last ``rate_window`` seconds."""
        while self._arrivals and self._arrivals[0] <= now - self.rate_window:
            self._arrivals.popleft()
        elapsed = now - self.start_time if self.start_time is not None else self.rate_window
        span = min(self.rate_window, max(elapsed, 0.1 * self.rate_window))
        return len(self._arrivals) / span

    def queued_batches(self) -> tuple[tuple[int, ...], ...]:
        """Request ids of each queued batch, in creation order."""
        return tuple(tuple(r.id for r in qb.requests) for qb in self._queue)

    def describe_request(self, request_id: int) -> dict:
        """How a request was served, for its answer: ``gamma`` (if it ran) and
        ``outcome_type`` (if decided). The live engine merges this into the answer."""
        out: dict = {}
        if request_id in self.request_gamma:
            out["gamma"] = self.request_gamma[request_id]
        if request_id in self.outcomes:
            out["outcome_type"] = int(self.outcomes[request_id])
        return out

    def record_correctness(self, request_id: int, correct: bool) -> None:
        """Resolve Type 1 vs 2 for an on-time request once its label is known."""
        outcome = self.outcomes.get(request_id)
        if outcome is None or outcome == OutcomeType.EVICTED:
            raise KeyError(f"request {request_id} has no served outcome")
        if outcome in (OutcomeType.ACCURATE_ON_TIME, OutcomeType.INACCURATE_ON_TIME):
            self.outcomes[request_id] = (OutcomeType.ACCURATE_ON_TIME if correct
                                         else OutcomeType.INACCURATE_ON_TIME)

    # ------------------------------------------------------------------ hooks

    def _schedule(self, clock: float, ordered: list[_QueuedBatch],
                  slots: int) -> list[tuple[_QueuedBatch, int, str]]:
        """Batches to run, in order, each with its gamma and the deciding rule. ``ordered``: the
        queue in EDD order; only the first ``slots`` (>= 1, the idle instances) entries run, so
        a rule that decides each batch from the ones before it may stop there."""
        raise NotImplementedError

    def _max_batch(self) -> int:
        return self._pricer.grid.max_batch

    def _blocked_until(self) -> float:
        """Until when no batch may start (INFaaS while loading a variant)."""
        return -math.inf

    # ------------------------------------------------------------------ internals

    def _start(self, now: float) -> None:
        if self.start_time is None:
            self.start_time = now

    def _free_at(self, now: float, any_idle: bool) -> float:
        if any_idle or not self._busy_until:
            t = now
        else:  # the earliest estimated finish: min(self._busy_until.values()), from the heap
            finishes, busy = self._finishes, self._busy_until
            while busy.get(finishes[0][1]) != finishes[0][0]:  # finished or re-dispatched since
                heappop(finishes)
            t = max(now, finishes[0][0])
        return max(t, self._blocked_until())

    def _evict_hopeless(self, free_at: float) -> list[int]:
        """Evict requests that miss their deadline even if their batch ran next, fastest."""
        evicted: list[int] = []
        pricer = self._pricer
        moments = self._queue.moments(pricer)
        # Only a batch whose moment (deadline - fastest time) is <= free_at can have free_at +
        # fastest >= deadline; the margin (far above rounding) keeps every such batch, and each
        # is checked exactly below, in creation order.
        margin = 1e-9 * (1.0 + abs(free_at) + pricer.slowest_fastest())
        due = bisect_left(moments, (free_at + margin, math.inf))
        for qb in sorted((e[2] for e in moments[:due]), key=_creation) if due else ():
            while qb.queued:
                t = pricer.fastest_seconds(len(qb.requests))
                if free_at + t < qb.deadline:  # its earliest deadline: none is hopeless
                    break
                hopeless = [r for r in qb.requests if free_at + t >= r.deadline]
                if not hopeless:
                    break
                for r in hopeless:
                    self.outcomes[r.id] = OutcomeType.EVICTED
                    evicted.append(r.id)
                self._queue.keep(qb, [r for r in qb.requests if free_at + t < r.deadline])  # empty: it leaves
        self.counters["evicted"] += len(evicted)
        if evicted:
            self._trim_records()
        return evicted

    def _trim_records(self) -> None:
        """Drop the oldest per-request records beyond ``record_limit`` (dicts keep insertion order)."""
        limit = self.record_limit
        if limit is None:
            return
        for records in (self.outcomes, self.request_gamma):
            while len(records) > limit:
                if isinstance(records, OrderedDict):
                    records.popitem(last=False)
                else:  # replaced by a plain dict: next(iter()) walks the dict's deleted prefix
                    del records[next(iter(records))]
        if len(self.decisions) > 2 * limit:
            del self.decisions[: len(self.decisions) - limit]

    def _dispatch(self, qb: _QueuedBatch, gamma: int, source: str, instance: int, now: float) -> Batch:
        self._queue.remove(qb)
        pricer = self._pricer
        n = len(qb.requests)
        cell = pricer.cell(n, gamma)
        seconds = pricer.seconds(n, gamma)
        utility = 0.0
        for r in qb.requests:
            acc = pricer.accuracy.of(r.task, gamma)
            utility += acc * r.utility
            self._inflight[r.id] = (r, acc)
            self.request_gamma[r.id] = gamma
        ids = tuple(r.id for r in qb.requests)
        start = max(now, self._blocked_until())
        self._busy_until[instance] = start + seconds
        self._ahead.set(instance, start + seconds)
        heappush(self._finishes, (start + seconds, instance))
        if len(self._finishes) > 2 * len(self._busy_until) + 64:  # mostly stale: rebuild
            self._finishes = [(f, i) for i, f in self._busy_until.items()]
            heapify(self._finishes)
        self.decisions.append(BatchDecision(now, ids, pricer.model, cell, instance, source, seconds, utility))
        self.counters["dispatched_batches"] += 1
        self.counters[f"source_{source}"] += 1
        self.counters[f"gamma_{gamma}"] += 1
        return Batch(ids, pricer.model, cell, instance)

    def _wake_at(self, now: float) -> float:
        """The earliest moment after ``now`` at which a queued request becomes hopeless
        (``deadline - fastest time of its batch``), or the end of a block (INFaaS's load)."""
        wake = math.inf
        blocked = self._blocked_until()
        if blocked > now and self._queue:
            wake = blocked
        pricer = self._pricer
        for first, _, qb in self._queue.moments(pricer):  # ascending
            if now < first:  # subtraction is monotone: no request of this batch or later ones comes earlier
                return min(wake, first)
            t = pricer.fastest_seconds(len(qb.requests))
            for r in qb.requests:
                when = r.deadline - t  # from then on the request is hopeless
                if now < when < wake:
                    wake = when
        return wake


def check_coverage(policy: "SelectiveBatchingPolicy", accuracy: AccuracyProfile, tasks: Iterable[str]) -> None:
    """ValueError unless ``accuracy`` prices every task in ``tasks`` (and every task it names)
    at every gamma ``policy`` may pick: a hole would make plan() raise for as long as such a
    request stays queued."""
    for task in sorted(set(tasks) | {t for (t, _) in accuracy.accuracy}):
        missing = [g for g in policy._pricer.gammas if (task, g) not in accuracy.accuracy]
        if missing:
            raise ValueError(f"the accuracy profile of {accuracy.model} has no accuracy for task {task!r} at gammas "
                             f"{missing}; re-profile it (`jaxserve train-prompts` or `jaxserve profile --accuracy`)")


def _pricer_from(model: str, latency: LatencyProfile, accuracy: AccuracyProfile, grid: ShapeGrid,
                 gammas: Optional[Iterable[int]]) -> _Pricer:
    return _Pricer(model, latency, accuracy, grid, tuple(gammas) if gammas is not None else grid.gammas)


# --------------------------------------------------------------------------- OTAS


class OTASPolicy(SelectiveBatchingPolicy):
    """OTAS: Alg. 1 batching, then Alg. 2 (DP) or Alg. 3 (load map) per decision."""

    name = "otas"

    def __init__(self, model: str, latency: LatencyProfile, accuracy: AccuracyProfile, grid: ShapeGrid,
                 gammas: Optional[Iterable[int]] = None, batching: BatchingParams = BatchingParams(),
                 params: OTASParams = OTASParams(), start_time: Optional[float] = None) -> None:
        super().__init__(_pricer_from(model, latency, accuracy, grid, gammas), batching,
                         params.rate_window, start_time)
        self.params = params
        self.load_map = LoadToGamma.from_profile(latency, accuracy, grid, self._pricer.gammas, params.headroom)
        self.last_solution: Optional[DPSolution] = None
        self._dp_pricer: Optional[_Pricer] = None  # the pricer the queued batches' cached DP inputs are of

    def use_accuracy(self, accuracy: AccuracyProfile) -> None:
        """As the base class's, and Alg. 3's load map is rebuilt from the new accuracy."""
        super().use_accuracy(accuracy)
        p = self._pricer
        self.load_map = LoadToGamma.from_profile(p.latency, accuracy, p.grid, p.gammas, self.params.headroom)

    def reprice(self, cost_model: CostModel, now: float) -> None:
        """As the base class's, and Alg. 3's load map is rebuilt from the new latency."""
        super().reprice(cost_model, now)
        p = self._pricer
        self.load_map = LoadToGamma.from_profile(p.latency, p.accuracy, p.grid, p.gammas, self.params.headroom)

    @classmethod
    def from_cost_model(cls, cost: CostModel, model: str, grid: ShapeGrid, **kwargs) -> "OTASPolicy":
        return cls(model, cost.latency[model], cost.accuracy[model], grid, **kwargs)

    def _schedule(self, clock, ordered, slots):
        pricer = self._pricer
        m = self.executors if self.params.share_instances else 1
        start = clock + self.backlog / m if m > 1 else clock  # the m executors' clock: module docstring
        in_initial = self.start_time is not None and clock - self.start_time < self.params.initial_stage
        if len(ordered) <= self.params.beta or in_initial:
            rate = self.arrival_rate(clock) / m  # f reads one instance's rate
            load_gamma = self.load_map(rate)
            head = ordered[:slots]  # Alg. 3 decides each batch from the ones before it: the rest cannot run now
            options = [qb.options(pricer) for qb in head]
            deadlines = [qb.deadline for qb in head]
            means = [sum(r.utility for r in qb.requests) / len(qb.requests) for qb in head]
            chosen = manual_allocate(deadlines, means, options, start, load_gamma, self.params.kappa, m,
                                     self.load_map.sustaining(rate))
            self.counters["alg3_runs"] += 1
            return [(qb, g, "load") for qb, g in zip(head, chosen)]
        # solve_token_dp(deadlines, options, clock, max_labels, undominated=stages), less its argument checks
        # (one option list and one stage per batch by construction), reading each batch's cached inputs
        if pricer is not self._dp_pricer:  # repriced: every batch's cached inputs are of the old pricer
            for qb in self._queue:
                qb.dp = None
            self._dp_pricer = pricer
        if self.params.max_labels < 2:
            raise ValueError("max_labels must be at least 2")
        if self.params.all_best_shortcut:  # one pass over the queue, caching each batch's inputs as it goes
            solution = _all_best_solution(map(_DEADLINE, ordered),
                                          ((qb.dp or qb.cache_dp(pricer))[2] for qb in ordered), start, m)
            if solution is not None:
                self.last_solution = solution
                self.counters["dp_runs"] += 1
                self.counters["dp_all_best"] += 1
                # every batch runs; only the first ``slots`` can start now (the contract above)
                return [(qb, g, "dp") for qb, g in zip(ordered[:slots], solution.gammas)]
        dps = [qb.dp for qb in ordered]
        if None in dps:
            dps = [dp if dp is not None else qb.cache_dp(pricer) for qb, dp in zip(ordered, dps)]
        options: list[list[GammaOption]] = list(map(_SECOND, dps))
        stages: list[_DPStage] = list(map(_THIRD, dps))
        solution = _solve_stages([qb._deadline for qb in ordered], options, stages, start, self.params.max_labels, m)
        self.last_solution = solution
        self.counters["dp_runs"] += 1
        self.counters["dp_truncated"] += int(solution.truncated)
        run = [(qb, g, "dp") for qb, g in zip(ordered, solution.gammas) if g is not None]
        self.counters["dp_deferred_batches"] += len(ordered) - len(run)
        if not run:
            # Every still-feasible batch is worth zero utility: rather than idle, run the
            # first feasible one at its fastest gamma (it disturbs later work the least).
            for qb, opts in zip(ordered, options):
                fast = min(opts, key=lambda o: (o.seconds, o.gamma))
                if clock + fast.seconds < qb.deadline:
                    return [(qb, fast.gamma, "backfill")]
        return run


# --------------------------------------------------------------------------- baselines


class FixedGammaPolicy(SelectiveBatchingPolicy):
    """Same batching and eviction as OTAS; every batch runs at one fixed gamma."""

    name = "fixed"

    def __init__(self, model: str, latency: LatencyProfile, accuracy: AccuracyProfile, grid: ShapeGrid,
                 gamma: int, batching: BatchingParams = BatchingParams(), rate_window: float = 1.0,
                 start_time: Optional[float] = None) -> None:
        super().__init__(_pricer_from(model, latency, accuracy, grid, (gamma,)), batching, rate_window, start_time)
        self.gamma = gamma

    def _schedule(self, clock, ordered, slots):
        return [(qb, self.gamma, "fixed") for qb in ordered[:slots]]


class PetSPolicy(FixedGammaPolicy):
    """PetS (Zhou et al., ATC'22) as the paper runs it: tokens unchanged, gamma = 0."""

    name = "pets"

    def __init__(self, model, latency, accuracy, grid, **kwargs) -> None:
        super().__init__(model, latency, accuracy, grid, gamma=0, **kwargs)


class FixedToMePolicy(FixedGammaPolicy):
    """ToMe with a fixed merge count: gamma < 0 for every batch."""

    name = "tome"

    def __init__(self, model, latency, accuracy, grid, gamma: int, **kwargs) -> None:
        if gamma >= 0:
            raise ValueError("ToMe merges tokens: gamma must be negative")
        super().__init__(model, latency, accuracy, grid, gamma=gamma, **kwargs)


class FixedVPTPolicy(FixedGammaPolicy):
    """VPT with a fixed prompt count: gamma = +2 by default (the paper's VPT baseline)."""

    name = "vpt"

    def __init__(self, model, latency, accuracy, grid, gamma: int = 2, **kwargs) -> None:
        if gamma <= 0:
            raise ValueError("VPT adds prompts: gamma must be positive")
        super().__init__(model, latency, accuracy, grid, gamma=gamma, **kwargs)


class INFaaSPolicy(SelectiveBatchingPolicy):
    """INFaaS-like model switching (Romero et al., ATC'21, as the OTAS paper uses it).

    Every ``decision_interval`` seconds (at a dispatch opportunity) it takes the arrival
    rate q per instance (the fleet's rate / the m instances served: each runs the current
    variant) and its *choice*: the most accurate variant whose profiled throughput at its
    largest batch, times ``headroom``, sustains q (mean accuracy over the profiled tasks;
    the fastest variant if none does). Whether it switches to the choice is the
    hysteresis rule below. Switching to variant v costs ``switch_seconds`` of v: one
    number for every variant, or a mapping variant name -> seconds that names every
    variant (v's measured load time: weights, heads, executables). The Plan contract has
    no "load" action, so the policy pays it itself by starting no batch until the load is
    done (``wake_at`` = end of load); pass 0 when the engine pays a real load. Batches run
    at gamma 0 on ``Batch.model`` = the variant's name, so the cost model must hold each
    variant's LatencyProfile under that name. The first variant chosen (the choice at
    q = 0, the most accurate) is loaded for free. Batching and eviction are OTAS's Alg. 1
    and hopeless-request rule, priced with the current variant (and its pending load).

    Hysteresis (``hold``, default 20). A switch *forced* by the load happens at once:
    when the current variant cannot sustain q (its sustainable rate < q) and the choice
    differs, the policy switches to the choice at that decision — staying means a queue
    that grows every second, and a load is the only way out. Every other switch is
    *elective* (the current variant still sustains q, but another is the choice: usually
    a slower, more accurate one after the rate fell) and waits until the current variant
    has not been the choice at ``hold`` consecutive decisions; a decision at which it is
    the choice again resets the count, and the switch goes to the latest choice. So a
    rate that oscillates around a slower variant's capacity, while the current one keeps
    up, does not move it; a fall that lasts ``hold * decision_interval`` seconds does.
    ``hold=1`` is the memoryless rule (switch whenever the choice differs).

    Why: a switch stops all service for the target's load time (1.1-3.3 s for the DINOv2
    variants in bench/otas_infaas_variants_dinov2-s14.json, against batches of a few ms
    at the paper's rates), so a brief dip that buys a few points of accuracy on one
    second's requests and is followed by a forced switch back costs two loads of evicted
    requests. Forced switches cannot be avoided; elective ones pay only if the calm lasts.
    What INFaaS does (we could check its released code, not the paper's text): in
    github.com/stanford-mast/INFaaS, src/worker/autoscaler.cc, the autoscaler re-decides
    every 1 s, acts on an overloaded variant at once (more replicas, or an upgrade to a
    higher-throughput variant), and releases capacity (unload, or a downgrade to a
    lower-throughput variant) only after more than 20 (GPU worker) or 10 (CPU worker)
    scale-down requests for that variant since its last scaling action. Our default, 20
    decisions at 1 s, is the GPU constant: the OTAS paper compares on a GPU, and
    bench/otas_utility.py simulates at that GPU's rates. (In its DINOv2 run 20 also
    serves INFaaS at least as well as 10 on both traces and variant sets, and 1, the old
    rule, far worse: section otas-utility-sim-dinov2-s14 of bench/RESULTS.md.) Two
    differences, both on the side of fewer switches: INFaaS accumulates scale-down
    requests since the variant's last action, we require consecutive decisions (an
    interruption resets the count); and INFaaS's accuracy is a per-query constraint while
    ours is the objective (the choice is the most accurate sustaining variant), so what
    INFaaS calls releasing capacity is here a move to a slower, more accurate variant.

    Read-outs besides the base class's: ``counters["switches"]`` (of which
    ``counters["switches_forced"]`` and ``counters["switches_elective"]``),
    ``loading_seconds`` (the load time paid so far, the sum over switches of the target's
    cost) and ``switch_costs`` (variant name -> seconds). ValueError if ``switch_seconds``
    is negative or not finite, or as a mapping misses a variant or names an unknown one;
    if ``hold`` is not an integer >= 1; if ``decision_interval`` is negative.
    """

    name = "infaas"

    def __init__(self, variants: Sequence[ModelVariant], switch_seconds: float | Mapping[str, float],
                 batching: BatchingParams = BatchingParams(), rate_window: float = 1.0,
                 headroom: float = 0.8, decision_interval: float = 1.0,
                 start_time: Optional[float] = None, hold: int = 20) -> None:
        if not variants:
            raise ValueError("need at least one variant")
        if not isinstance(decision_interval, (int, float)) or not decision_interval >= 0:
            raise ValueError(f"decision_interval must be >= 0, got {decision_interval!r}")
        if isinstance(hold, bool) or not isinstance(hold, int) or hold < 1:
            raise ValueError(f"hold must be an integer >= 1 (consecutive decisions), got {hold!r}")
        self.variants = tuple(variants)
        self.switch_seconds = switch_seconds
        self.decision_interval = decision_interval
        self.hold = hold
        self._pricers = {v.name: _Pricer(v.name, v.latency, v.accuracy, v.grid, (0,)) for v in self.variants}
        if len(self._pricers) != len(self.variants):
            raise ValueError("variant names must be unique")
        self.switch_costs = _switch_costs(switch_seconds, [v.name for v in self.variants])
        self._rows = []  # (name, sustainable rate, mean accuracy)
        for v in self.variants:
            row = LoadToGamma.from_profile(v.latency, v.accuracy, v.grid, (0,), headroom).rows[0]
            self._rows.append((v.name, row[1], row[2]))
        self._sustains = {name: rate for name, rate, _ in self._rows}
        first = self.select_variant(0.0)
        super().__init__(self._pricers[first], batching, rate_window, start_time)
        self._loading_until = -math.inf
        self._last_decision = -math.inf
        self._streak = 0  # consecutive decisions at which the current variant was not the choice
        self.loading_seconds = 0.0

    @property
    def current_variant(self) -> str:
        return self._pricer.model

    def select_variant(self, rate: float) -> str:
        """The choice at arrival rate ``rate``: the most accurate variant that sustains it
        (ties to the faster), else the fastest. No hysteresis: :meth:`_schedule` applies it."""
        sustaining = [r for r in self._rows if r[1] >= rate]
        if not sustaining:
            return max(self._rows, key=lambda r: r[1])[0]
        return max(sustaining, key=lambda r: (r[2], r[1]))[0]

    def _max_batch(self) -> int:
        return min(v.grid.max_batch for v in self.variants)

    def _blocked_until(self) -> float:
        return self._loading_until

    def _schedule(self, clock, ordered, slots):
        if clock - self._last_decision >= self.decision_interval:
            self._last_decision = clock
            rate = self.arrival_rate(clock) / self.executors  # each of the m instances runs the variant
            target = self.select_variant(rate)
            current = self.current_variant
            if target == current:
                self._streak = 0
            else:
                forced = self._sustains[current] < rate
                self._streak += 1
                if forced or self._streak >= self.hold:
                    self._streak = 0
                    self._pricer = self._pricers[target]
                    self.counters["switches"] += 1
                    self.counters["switches_forced" if forced else "switches_elective"] += 1
                    cost = self.switch_costs[target]
                    if cost > 0:
                        self.loading_seconds += cost
                        self._loading_until = clock + cost
                        return []
        return [(qb, 0, "variant") for qb in ordered[:slots]]


def _switch_costs(switch_seconds, names: Sequence[str]) -> dict[str, float]:
    """Variant name -> seconds to switch to it, from one number (the same for all) or a mapping
    naming exactly ``names``; ValueError naming ``switch_seconds`` (and the variant) unless every
    cost is a finite number >= 0."""
    def check(value, what: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{what} must be a finite number >= 0 (seconds), got {value!r}")
        return float(value)

    if isinstance(switch_seconds, Mapping):
        missing = [n for n in names if n not in switch_seconds]
        unknown = sorted(str(n) for n in switch_seconds if n not in names)
        if missing or unknown:
            raise ValueError(f"switch_seconds must name every variant and no other: missing {missing}, "
                             f"unknown {unknown}")
        return {n: check(switch_seconds[n], f"switch_seconds[{n!r}]") for n in names}
    cost = check(switch_seconds, "switch_seconds")
    return {n: cost for n in names}


# --------------------------------------------------------------------------- serving glue


OTAS_POLICY_NAMES = ("otas", "pets", "tome", "vpt")


def make_otas_policy(name: str, runtimes: Mapping, cost: CostModel, options: Optional[Mapping] = None):
    """The policy ``jaxserve serve --policy NAME`` runs for its one image model.

    OTAS plans one request stream (Sec. III-A), so exactly one model must be served. Latency
    comes from the cost model; accuracy from the cost model if it has it, else from the
    runtime's profiled ``accuracy`` (the prompt repository's
    accuracy.json); it must cover every served task (the runtime's heads and the profiled
    tasks) at every gamma the policy may pick (all the grid's for ``otas``), else ValueError.
    ``options``: ``batching`` / ``otas`` (dicts of :class:`BatchingParams` /
    :class:`OTASParams` fields), ``tome_gamma`` (default: the grid's most negative gamma),
    ``vpt_gamma`` (default 2, or the grid's smallest gamma > 0 where 2 is not one of them, e.g.
    DINOv2's +4; a grid without prompts refuses ``vpt``), ``record_limit`` (default 100 000); a given gamma must be one of
    the grid's. The INFaaS baseline needs several model variants and runs in the simulator
    only (bench/otas_utility.py).
    """
    options = dict(options or {})
    if name not in OTAS_POLICY_NAMES:
        raise ValueError(f"unknown OTAS policy {name!r}; known: {OTAS_POLICY_NAMES}")
    if len(runtimes) != 1:
        raise ValueError(f"--policy {name} serves exactly one image model (--model vit-demo); got {sorted(runtimes)}")
    (model, rt), = runtimes.items()
    grid = rt.grid
    if grid.seq_buckets:
        raise ValueError(f"--policy {name} serves image models; {model} is a text model")
    accuracy = cost.accuracy.get(model) or getattr(rt, "accuracy", None)
    if accuracy is None:
        raise ValueError(f"no accuracy profile for {model}: run `jaxserve train-prompts` (writes accuracy.json) "
                         "or `jaxserve profile --accuracy`")
    latency = cost.latency[model]
    batching = BatchingParams(**options.get("batching", {}))
    if name == "otas":
        policy = OTASPolicy(model, latency, accuracy, grid, batching=batching,
                            params=OTASParams(**options.get("otas", {})))
    elif name == "pets":
        policy = PetSPolicy(model, latency, accuracy, grid, batching=batching)
    elif name == "tome":
        gamma = _grid_gamma(options, "tome_gamma", min(grid.gammas), grid)
        policy = FixedToMePolicy(model, latency, accuracy, grid, gamma=gamma, batching=batching)
    else:
        prompted = [g for g in grid.gammas if g > 0]
        if not prompted:
            raise ValueError(f"--policy vpt needs a gamma > 0 (trained prompts) in the grid {grid.gammas}")
        default = 2 if 2 in prompted else min(prompted)
        policy = FixedVPTPolicy(model, latency, accuracy, grid, gamma=_grid_gamma(options, "vpt_gamma", default, grid),
                                batching=batching)
    check_coverage(policy, accuracy, getattr(rt, "heads", None) or ())
    policy.accuracy_source = "cost model" if model in cost.accuracy else "repository"
    policy.record_limit = options.get("record_limit", 100_000)
    return policy


def _grid_gamma(options: Mapping, key: str, default: int, grid: ShapeGrid) -> int:
    """``options[key]`` if given (0 included), else ``default``; a given gamma must be in the grid."""
    gamma = options.get(key)
    if gamma is None:
        return default
    if gamma not in grid.gammas:
        raise ValueError(f"{key}={gamma} is not a gamma of the grid {grid.gammas}")
    return gamma
