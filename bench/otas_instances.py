"""OTAS on several instances: planning for the m instances served against planning for one executor.

The simulator runs OTAS on one trace per (instances, load) cell twice: with the default
``OTASParams(share_instances=True)``, where Alg. 2 and Alg. 3 plan for the m instances (the m
executors share one clock: a batch must finish before its deadline on its own instance, and moves
the plan's clock on by its time / m; Alg. 3 reads one instance's share of the arrival rate), and
with ``share_instances=False``, which plans for one sequential executor whatever m (the paper's
setting, Sec. III-A, and this project's policy before 2026-11-28). The module docstring of
jaxserve/sched/otas.py (Several instances) states the rule.

Set-up, as bench/sim_speed.py's OTAS cells: the demo ViT's OTAS profile (bench/otas_cost_vit-demo.json)
scaled so that gamma 0 at the largest batch serves 580 req/s per instance, Table II's six query types
uniformly, Poisson arrivals at ``load`` x m x 580 req/s, each policy told its run began its 2 s
initial stage before the trace (Alg. 2 from the first plan). Utility is the expected utility of
:func:`jaxserve.simulator.utility_score` (each on-time request right with its profiled accuracy).
Every run is deterministic (seeded): the two arms of a cell see the same trace. One instance is
included as the control, where the two arms must plan the same (every array of the results equal).

    .venv/bin/python -m bench.otas_instances [--instances 1,10,100] [--loads 0.7,1.0,1.3] [--seconds 6] [--write]
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations;
# read by bench.all, bench.status and bench.headline without importing this module).
MEASURES = (
    "bench/otas_instances.py", "bench/sim_speed.py", "bench/otas_utility.py", "bench/otas_cost_vit-demo.json",
    "jaxserve/simulator.py", "jaxserve/sched/base.py", "jaxserve/sched/otas.py", "jaxserve/traces.py",
    "jaxserve/kernels/otas_dp.c",
)
SECTIONS = {"otas-instances": "--write"}

import argparse
import dataclasses
import time

import numpy as np

from bench import sim_speed
from bench.common import add_quick, apply_quick, table
from jaxserve.simulator import simulate, utility_score

RESULT_ARRAYS = ("outcome", "batch", "cell_batch", "cell_gamma", "start", "finish")


def run_arm(setup, instances: int, trace, share: bool) -> dict:
    policy = sim_speed.build(setup, instances)
    policy.params = dataclasses.replace(policy.params, share_instances=share)
    t0 = time.perf_counter()
    result = simulate(policy, trace, setup.cost, instances)
    wall = time.perf_counter() - t0
    score = utility_score(result, trace, accuracy=setup.cost.accuracy[setup.model])
    merged = sum(s for g, s in score.gamma_share.items() if g < 0)
    prompted = sum(s for g, s in score.gamma_share.items() if g > 0)
    return dict(result=result, slo=result.slo_attainment(), utility=score.utility, max_utility=score.max_utility,
                merged=merged, prompted=prompted, dp=policy.counters["dp_runs"],
                deferred=policy.counters["dp_deferred_batches"], wall=wall, requests=len(trace))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", default="1,10,100")
    parser.add_argument("--loads", default="0.7,1.0,1.3", help="offered load, fractions of the fleet's gamma-0 capacity")
    parser.add_argument("--seconds", type=float, default=6.0, help="virtual seconds of each trace")
    parser.add_argument("--max-requests", type=int, default=120_000, help="a trace's cap (shortens the 100-instance ones)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", action="store_true", help="record the table in bench/RESULTS.md")
    add_quick(parser, instances="1,4", loads="1.0", seconds=0.5, max_requests=2000)
    args = apply_quick(parser.parse_args())
    counts = [int(x) for x in args.instances.split(",") if x]
    loads = [float(x) for x in args.loads.split(",") if x]
    setup = sim_speed.otas_setup()
    per_instance = sim_speed.capacity_per_instance(setup, sim_speed.build(setup, 1), np.zeros(1))
    header = ["instances", "load", "requests", "virtual s", "plan for", "SLO attainment", "utility (share of max)",
              "merged / prompted (answered)", "DP runs", "batches the DP deferred per run", "wall s"]
    rows, cells = [], []
    t_all = time.perf_counter()
    print(f"one instance serves {per_instance:.0f} req/s at gamma 0; {args.seconds:g} virtual s per trace\n", flush=True)
    for m in counts:
        for load in loads:
            rate = load * m * per_instance
            n = int(min(args.max_requests, rate * args.seconds))
            trace = sim_speed.make_workload(setup, rate, n, args.seed, None)
            arms = {share: run_arm(setup, m, trace, share) for share in (True, False)}
            same = all(np.array_equal(getattr(arms[True]["result"], f), getattr(arms[False]["result"], f),
                                      equal_nan=True) for f in RESULT_ARRAYS)
            cells.append(dict(m=m, load=load, arms=arms, same=same))
            for share, a in arms.items():
                row = [str(m), f"{load:.1f}", f"{n:,}", f"{trace.arrival[-1]:.1f}",
                       f"all {m}" if share else "one executor",
                       f"{a['slo']:.3f}", f"{a['utility']:,.0f} ({a['utility'] / a['max_utility']:.3f})",
                       f"{a['merged']:.0%} / {a['prompted']:.0%}", f"{a['dp']:,}",
                       f"{a['deferred'] / max(a['dp'], 1):.1f}", f"{a['wall']:.1f}"]
                rows.append(row)
                print("| " + " | ".join(row) + " |", flush=True)
    elapsed = time.perf_counter() - t_all
    many = [c for c in cells if c["m"] > 1]
    slo_wins = sum(c["arms"][True]["slo"] > c["arms"][False]["slo"] for c in many)
    slo_ties = sum(c["arms"][True]["slo"] == c["arms"][False]["slo"] for c in many)
    util_wins = sum(c["arms"][True]["utility"] > c["arms"][False]["utility"] for c in many)
    ratios = [c["arms"][True]["utility"] / c["arms"][False]["utility"] for c in many]
    controls = [c for c in cells if c["m"] == 1]
    text = table(header, rows)
    notes = (
        f"Over the {len(many)} cells with more than one instance, planning for the instances served met more "
        f"deadlines in {slo_wins} ({slo_ties} tied) and earned more utility in {util_wins}; its utility over the "
        f"one-executor plan's: {min(ratios, default=float('nan')):.3f}-{max(ratios, default=float('nan')):.3f}x. "
        + (f"At one instance the two arms gave the same results in {sum(c['same'] for c in controls)} of "
           f"{len(controls)} cells (every array equal). " if controls else "")
        + "Load: a fraction of the fleet's gamma-0 capacity at the largest batch (m x "
        f"{per_instance:.0f} req/s). 'plan for': all m instances (the default) or one executor. 'merged / "
        "prompted': shares of answered requests run at gamma < 0 / > 0. 'batches the DP deferred per run': queued "
        "batches Alg. 2 left for later, per DP. Wall time of `simulate`. "
        f"Whole run: {elapsed:.0f} s.")
    print()
    print(text)
    print()
    print(notes)
    if args.write:
        from bench.common import record

        record("otas-instances", "OTAS on several instances: plan for all of them or for one executor", text, notes)


if __name__ == "__main__":
    main()
