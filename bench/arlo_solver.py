"""Arlo overheads: runtime-scheduler solve time and request-scheduler dispatch time.

Question 1 (paper §5.1.4, Table 2): how long does an exact solve of Eq. 1-7 take at
(50 GPUs, 8 runtimes), (200, 12), (1000, 16)? The paper's Gurobi ILP took 0.156 s,
0.623 s and 2.612 s (mean of 20 runs). We time both exact solvers of
``jaxserve/sched/arlo/allocation.py`` -- the numpy DP and the HiGHS MILP -- on the same sizes,
20 runs each (different seeds), at three traffic levels (50 %, 80 % and 120 % of
what the instances can serve within the SLO; 120 % is the infeasible, best-effort
case), and check that both reach the same optimum.

Question 2 (§5.1.4, Fig. 9): how long does Alg. 1 take to dispatch a burst of
2400 requests over 1200 instances of 12 runtimes (paper: 0.737 ms in C++; our
budget: 10 ms in Python)? Also ILB and IG, and the smaller scales of Fig. 9.

Workload: tweet-like lengths (the paper's Twitter trace has median 21 and p98 71
tokens, recalibrated to span 512): lognormal with median 84 and p98 ~284, clipped
to [1, 512]. Runtimes: buckets 512/I apart. Latency: a BERT-Base-like batch-1
profile, 1.5 ms + 0.02 ms/token, SLO 150 ms -- or a measured one with
``--cost-model cost.json --model NAME``.

Usage: ``nice -n 10 .venv/bin/python bench/arlo_solver.py [--runs 20] [--cost-model F --model M] [--write]``
Prints markdown tables; ``--write`` records them as the "arlo_solver" section of bench/RESULTS.md.
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations;
# read by bench.all, bench.status and bench.headline without importing this module).
MEASURES = (
    "bench/arlo_solver.py", "jaxserve/sched/arlo", "jaxserve/sched/base.py",
)
SECTIONS = {"arlo_solver": "--runs 20 --write"}

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.sched.arlo import (  # noqa: E402
    AllocationProblem,
    InterGroupGreedy,
    IntraGroupBalance,
    LatencyCurve,
    MultiLevelDispatcher,
    solve_allocation_dp,
    solve_allocation_milp,
)
from jaxserve.sched.base import Cell, CostModel, LatencyProfile  # noqa: E402

GUROBI = {(50, 8): 0.156, (200, 12): 0.623, (1000, 16): 2.612}
PAPER_DISPATCH_MS = 0.737  # 1200 instances, 2400 requests, C++
SLO = 0.150


def tweet_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(np.log(84.0), 0.593, n)), 1, 512).astype(np.int64)


def buckets_for(runtimes: int) -> list[int]:
    return [512 * (k + 1) // runtimes for k in range(runtimes)]


def synthetic_profile(buckets: list[int]) -> LatencyProfile:
    return LatencyProfile("bert", {Cell(1, s): 0.0015 + 0.00002 * s for s in buckets})


def problem_for(gpus: int, runtimes: int, load: float, seed: int, profile: LatencyProfile | None) -> AllocationProblem:
    buckets = buckets_for(runtimes)
    prof = profile or synthetic_profile(buckets)
    if profile is not None:  # map our buckets onto the measured ones (nearest profiled seq >= bucket)
        seqs = sorted({c.seq for c in prof.seconds})
        prof = LatencyProfile(
            prof.model,
            {Cell(1, s): prof.latency_for(1, min([q for q in seqs if q >= s] or [seqs[-1]])) for s in buckets},
        )
    curves = tuple(LatencyCurve(prof, s, 1) for s in buckets)
    capacity = tuple(c.capacity(SLO) for c in curves)
    rng = np.random.default_rng(seed)
    lengths = tweet_lengths(20_000, rng)
    share = np.bincount(np.searchsorted(buckets, lengths), minlength=runtimes) / len(lengths)
    # requests per SLO period that `load` x all instances serve at their own runtimes
    instances_per_request = float(sum(f / m for f, m in zip(share, capacity)))
    total = load * gpus / instances_per_request
    demand = tuple(int(x) for x in rng.multinomial(int(round(total)), share))
    return AllocationProblem(demand, capacity, gpus, curves)


_LINES: list[str] = []


def emit(*parts, flush: bool = False, **_) -> None:
    """print, and keep the line for --write."""
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    _LINES.append(line)


def timed(fn, *args):
    gc.collect()
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def solver_table(runs: int, profile: LatencyProfile | None) -> None:
    emit("### Runtime Scheduler: exact solve time (s), mean of", runs, "runs (max in brackets)\n")
    emit("| GPUs | runtimes | load | Gurobi (paper) | DP | DP / Gurobi | MILP (HiGHS) | MILP / Gurobi | same optimum |")
    emit("|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for (gpus, runtimes), paper in GUROBI.items():
        for load in (0.5, 0.8, 1.2):
            dp_t, milp_t, agree = [], [], True
            for seed in range(runs):
                p = problem_for(gpus, runtimes, load, seed, profile)
                a, ta = timed(solve_allocation_dp, p)
                b, tb = timed(solve_allocation_milp, p)
                dp_t.append(ta)
                milp_t.append(tb)
                agree &= abs(a.objective - b.objective) <= 1e-7 * max(1.0, abs(a.objective))
            dm, mm = statistics.mean(dp_t), statistics.mean(milp_t)
            emit(
                f"| {gpus} | {runtimes} | {load:.0%} | {paper:.3f} | {dm:.3f} ({max(dp_t):.3f}) | {dm / paper:.3f} "
                f"| {mm:.3f} ({max(milp_t):.3f}) | {mm / paper:.3f} | {'yes' if agree else 'NO'} |",
                flush=True,
            )
    emit()


def dispatch_table(repeats: int) -> None:
    emit(f"### Request Scheduler: time to dispatch a burst (ms), best / median of {repeats}\n")
    emit("| dispatcher | instances | runtimes | requests | initial load | L | best ms | median ms | us/request | demoted |")
    emit("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    runtimes = 12
    buckets = buckets_for(runtimes)
    capacity = [LatencyCurve(synthetic_profile(buckets), s, 1).capacity(SLO) for s in buckets]
    rng = np.random.default_rng(0)
    cases = [(MultiLevelDispatcher, 6), (MultiLevelDispatcher, 3), (MultiLevelDispatcher, 1),
             (IntraGroupBalance, 1), (InterGroupGreedy, runtimes)]
    for instances in (200, 600, 1200):
        lengths = tweet_lengths(2 * instances, rng).tolist()
        for initial in ("idle", "congested", "short-busy"):
            # congested: every instance holds 70-105 % of its SLO capacity (heads often exceed lambda);
            # short-busy: the 6 shortest runtimes hold 80-105 %, the longer ones 0-30 % (a burst of
            # short requests: the case demotion is for)
            levels = np.arange(instances) % runtimes
            caps = np.array(capacity)[levels]
            lo, hi = (0.0, 0.0) if initial == "idle" else (0.70, 1.05)
            lo = np.where((levels >= 6) & (initial == "short-busy"), 0.0, 0.80 if initial == "short-busy" else lo)
            hi = np.where((levels >= 6) & (initial == "short-busy"), 0.30, hi)
            loads = rng.integers((lo * caps).astype(int), (hi * caps).astype(int) + 1)
            for cls, peek in cases:
                if instances != 1200 and (cls is not MultiLevelDispatcher or peek != 6):
                    continue
                times = []
                for _ in range(repeats):
                    d = cls(buckets, capacity, peek=peek) if cls is MultiLevelDispatcher else cls(buckets, capacity)
                    for i in range(instances):
                        d.add_instance(i, i % runtimes, int(loads[i]))
                    chosen, t = timed(d.dispatch_many, lengths)
                    times.append(t)
                demoted = sum(d.level_of(i) > d.fitting_level(n) for i, n in zip(chosen, lengths)) / len(lengths)
                best, med = min(times) * 1e3, statistics.median(times) * 1e3
                name = {"arlo": "Arlo (Alg. 1)", "ilb": "ILB", "ig": "IG"}[cls.name]
                emit(
                    f"| {name} | {instances} | {runtimes} | {len(lengths)} | {initial} | {peek} | {best:.3f} "
                    f"| {med:.3f} | {best * 1e3 / len(lengths):.2f} | {demoted:.1%} |",
                    flush=True,
                )
    emit(f"\nPaper (C++, Fig. 9): {PAPER_DISPATCH_MS} ms for 2400 requests over 1200 instances; budget here: 10 ms.\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="solves per (size, load), as the paper's 20")
    ap.add_argument("--repeats", type=int, default=30, help="dispatch bursts per case")
    ap.add_argument("--cost-model", type=Path, help="a measured cost model (jaxserve profile)")
    ap.add_argument("--model", default="bert", help="model name inside --cost-model")
    ap.add_argument("--skip-solver", action="store_true")
    ap.add_argument("--skip-dispatch", action="store_true")
    ap.add_argument("--write", action="store_true", help="record the tables in bench/RESULTS.md")
    from bench.common import add_quick, apply_quick

    add_quick(ap, runs=1, repeats=2)
    args = apply_quick(ap.parse_args())
    profile = None
    if args.cost_model:
        profile = CostModel.from_json(args.cost_model.read_text()).latency[args.model]
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}\n")
    if not args.skip_solver:
        solver_table(args.runs, profile)
    if not args.skip_dispatch:
        dispatch_table(args.repeats)
    if args.write:
        import os

        from bench.common import record

        load = os.getloadavg()[0]
        notes = (f"python {sys.version.split()[0]}, numpy {np.__version__}, HiGHS via highspy, one thread. "
                 f"Wall-clock times on a shared 2-core machine (load average {load:.1f} at the end of the run), "
                 "so they are upper bounds. Synthetic BERT-Base-like profile unless --cost-model is given; "
                 "workload and loads as in the module docstring of bench/arlo_solver.py.")
        record("arlo_solver", "Arlo overheads (§5.1.4): Runtime Scheduler solve time and Request Scheduler dispatch",
               "\n".join(_LINES).strip(), notes)


if __name__ == "__main__":
    main()
