"""How far the simulated latency moves when every batch's service time moves by a few percent:
the precision of service prices that bench/fidelity.py's goal (within 10% of live on mean and
p98, at 30%, 70% and 90% load) asks for, per cell.

bench/fidelity.py calibrates each cell's service prices on a live trace of its own, and the
calibration's mean ratio (measured / profiled compute) moves between the cells of one run (the
text cells: x1.13 to x1.27) and between runs. Near saturation queueing amplifies that: for an
M/M/1 queue the mean sojourn time's elasticity to the service time is 1 / (1 - rho), 10 at 90%.
This script measures the same elasticity for the policies and traces the fidelity cells run, in
the simulator alone (no server): each cell's rate is fidelity's (``rate_at_load``: the idle
profile, the policy choosing), its traces fidelity's text workload (real tweet lengths,
Poisson), its service the fidelity table's log-normal arm (the profile x a ratio, a log-normal
spread and a hand-off). The ratio is then moved by each of ``SHIFTS`` with everything else held
(the same traces and noise draws: common random numbers), and the policy plans at the shifted
prices, as the live server's price correction would.

Arlo, fidelity's other text policy, is not tabled: at one instance its runtime groups are one group
of every runtime, batched by the same DeadlineBatching as ``default``, so its simulated runs are
identical; each cell checks that at the base prices (every request's start and finish).

Decision: the base calibration is the text cells' typical one in the fidelity table (ratio
``RATIO``, sigma ``SIGMA``, hand-off ``HANDOFF_S``); the elasticity is the central difference
over +-3%. The image policy (OTAS on DINOv2) is not run: its cost model is the fidelity server's
own start-up profile, which no file in the repository holds.

    python -m bench.fidelity_sensitivity [--traces 8] [--duration 60] [--write]
"""

from __future__ import annotations

MEASURES = (
    "bench/fidelity_sensitivity.py", "bench/fidelity.py", "bench/results/sim_knee-cost_model.json",
    "jaxserve/simulator.py", "jaxserve/traces.py", "jaxserve/launch.py", "jaxserve/sched/base.py",
    "jaxserve/sched/batching.py", "jaxserve/sched/arlo",
)
SECTIONS = {"fidelity_sensitivity": "--write"}

import argparse
import time
from pathlib import Path

import numpy as np

POLICIES = ("default",)
SAME_AS_DEFAULT = "arlo"  # checked per cell: at one instance it decides as default does (module docstring)
LOADS = (0.3, 0.7, 0.9)
SHIFTS = (-0.06, -0.03, 0.0, 0.03, 0.06)
RATIO, SIGMA, HANDOFF_S = 1.2, 0.3, 0.8e-3
COST = Path(__file__).parent / "results" / "sim_knee-cost_model.json"


def cell(policy: str, load: float, traces_n: int, duration: float, seed: int) -> dict:
    """One (policy, load): the rate, per shift the pooled mean and p98 (ms) and drops, and
    whether :data:`SAME_AS_DEFAULT` ran every trace identically at the base prices."""
    from bench import fidelity as F
    from jaxserve.profiler import load_cost_model

    cost = load_cost_model(COST)
    planned = F.planned_models(cost, F.TEXT_MODEL, policy)
    workload = F.TextWorkload(planned[F.TEXT_MODEL].grid, duration, seed)
    rate, util = F.rate_at_load(policy, planned, cost, workload, load, seed)
    runs = [workload.trace(rate, seed + 10 * (k + 1))[0] for k in range(traces_n)]
    out = {"policy": policy, "load": load, "rate": rate, "util": util, "shifts": {}}
    for shift in SHIFTS:
        scaled = cost.scaled(RATIO * (1 + shift))
        lat, dropped, n = [], 0, 0
        for k, trace in enumerate(runs):
            r = F.simulated(policy, planned, scaled, trace, noise=SIGMA, overhead=HANDOFF_S, seed=seed + 10 * (k + 1))
            lat.append(r.latencies() * 1e3)
            dropped += len(r) - int(r.completed().sum())
            n += len(r)
        ms = np.concatenate(lat)
        out["shifts"][shift] = {"mean": float(ms.mean()), "p98": float(np.percentile(ms, 98)), "dropped": dropped,
                                "n": n}
    other = F.planned_models(cost, F.TEXT_MODEL, SAME_AS_DEFAULT)
    scaled = cost.scaled(RATIO)
    out["same"] = all(
        all(np.array_equal(getattr(a, f), getattr(b, f), equal_nan=True) for f in ("start", "finish", "outcome"))
        for a, b in ((F.simulated(policy, planned, scaled, trace, noise=SIGMA, overhead=HANDOFF_S, seed=seed + 10 * (k + 1)),
                      F.simulated(SAME_AS_DEFAULT, other, scaled, trace, noise=SIGMA, overhead=HANDOFF_S,
                                  seed=seed + 10 * (k + 1))) for k, trace in enumerate(runs)))
    return out


def elasticity(c: dict, stat: str) -> float:
    """Percent change of ``stat`` per percent change of the service time (central, +-3%)."""
    s = c["shifts"]
    return (s[0.03][stat] - s[-0.03][stat]) / s[0.0][stat] / 0.06


def tolerance(c: dict) -> float:
    """The service-time error (percent) that moves the mean or the p98 by 10%, at the larger elasticity."""
    return 10.0 / max(abs(elasticity(c, "mean")), abs(elasticity(c, "p98")), 1e-9)


def main() -> None:
    from bench.common import add_quick, apply_quick, table

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=int, default=8, help="traces per cell (pooled)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of each trace")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true", help="record the section in bench/RESULTS.md")
    add_quick(ap, traces=1, duration=5.0)
    args = apply_quick(ap.parse_args())
    t0 = time.perf_counter()
    cells = []
    for policy in POLICIES:
        for load in LOADS:
            c = cell(policy, load, args.traces, args.duration, args.seed)
            cells.append(c)
            print(f"{policy} at {load:.0%}: rate {c['rate']:.1f} req/s, elasticity mean "
                  f"{elasticity(c, 'mean'):.2f}, p98 {elasticity(c, 'p98'):.2f}", flush=True)
    rows = []
    for c in cells:
        base = c["shifts"][0.0]
        rows.append([c["policy"], f"{c['load']:.0%}", f"{c['rate']:.1f}", f"{base['mean']:.1f} / {base['p98']:.1f}",
                     *(f"{(c['shifts'][s]['mean'] / base['mean'] - 1) * 100:+.1f}% / "
                       f"{(c['shifts'][s]['p98'] / base['p98'] - 1) * 100:+.1f}%" for s in SHIFTS if s),
                     f"{elasticity(c, 'mean'):.2f} / {elasticity(c, 'p98'):.2f}", f"±{tolerance(c):.1f}%",
                     f"{base['dropped']} of {base['n']:,}"])
    body = table(["policy", "load", "rate req/s", "sim mean / p98 ms (ratio x{:g})".format(RATIO),
                  *(f"service {s * 100:+.0f}%: mean / p98" for s in SHIFTS if s), "elasticity mean / p98",
                  "service error that moves mean or p98 by 10%", "dropped"], rows)
    worst = min(cells, key=tolerance)
    differ = [f"{c['load']:.0%}" for c in cells if not c["same"]]
    same_text = "identical in every cell" if not differ else "different at " + ", ".join(differ)
    notes = (f"Each cell: fidelity's rate for the load (idle profile, `rate_at_load`), {args.traces} Poisson traces "
             f"of {args.duration:g} s of real tweet lengths pooled, MiniLM-L6's serve profile "
             f"(`{COST.relative_to(COST.parents[2])}`) x {RATIO:g} x (1 + shift), log-normal spread {SIGMA:g} and "
             f"hand-off {HANDOFF_S * 1e3:g} ms per batch, the policy planning at the shifted prices; the same traces "
             f"and noise draws for every shift. Elasticity: percent change per percent of service time, central "
             f"over ±3% (M/M/1's mean: 1 / (1 - load), 10 at 90%). The tightest cell is {worst['policy']} at "
             f"{worst['load']:.0%}: a service-time error of ±{tolerance(worst):.1f}% moves its mean or p98 by 10%. "
             f"{SAME_AS_DEFAULT} (one instance) against {POLICIES[0]}, every trace at the base prices: "
             f"{same_text}. "
             f"Whole run: {time.perf_counter() - t0:.0f} s.")
    print(body)
    print(notes)
    if args.write:
        from bench.common import record

        record("fidelity_sensitivity", "Simulator fidelity: how far latency moves with the service time, per cell",
               body, notes)


if __name__ == "__main__":
    main()
