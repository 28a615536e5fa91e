"""Arlo (Tan et al., ICPP '24): polymorphing with a runtime and a request scheduler.

One runtime per sequence-length bucket ("polymorph" ``Cell(batch, seq=bucket)``); every
instance (worker) runs exactly one runtime at a time. Plain Python (no JAX, no threads, no
wall clock: ``now`` is always an argument), in one module per part:

* :mod:`.allocation` -- §3.3 Eq. 1-7 solved exactly (DP and MILP), and the minimum
  replacement plan (§4);
* :mod:`.runtime_scheduler` -- §3.3's periodic re-allocation from a sliding window;
* :mod:`.dispatch` -- §3.4 Alg. 1 (the multi-level queue) and the ILB / IG baselines (§5.2.3);
* :mod:`.autoscale` -- §4's target tracking on the p98 latency;
* :mod:`.policy` -- :class:`ArloPolicy`, the three behind the engine's Policy hooks.

The public names are imported from here.
"""

from jaxserve.sched.arlo.allocation import (
    Allocation,
    AllocationProblem,
    LatencyCurve,
    Move,
    allocation_objective,
    allocation_problem,
    demand_per_window,
    replacement_plan,
    solve_allocation,
    solve_allocation_dp,
    solve_allocation_milp,
)
from jaxserve.sched.arlo.autoscale import ScaleDecision, TargetTrackingAutoscaler
from jaxserve.sched.arlo.dispatch import (
    InterGroupGreedy,
    InterGroupGreedyByLoad,
    IntraGroupBalance,
    MultiLevelDispatcher,
)
from jaxserve.sched.arlo.policy import ArloCounters, ArloPolicy
from jaxserve.sched.arlo.runtime_scheduler import Reallocation, RuntimeScheduler

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
    "ArloCounters",
    "ArloPolicy",
]
