"""How far the simulated latency moves when every batch's service time moves by a few percent:
the precision of service prices that bench/fidelity.py's goal (within 10% of live on mean and
p98, at 30%, 70% and 90% load) asks for, per cell.

bench/fidelity.py calibrates each cell's service prices on a live trace of its own, and the
calibration's mean ratio (measured / profiled compute) moves between the cells of one run and
between runs (the cells in ``bench/results/fidelity-calibration.json``). Near saturation queueing amplifies that: for an
M/M/1 queue the mean sojourn time's elasticity to the service time is 1 / (1 - rho), 10 at 90%.
This script measures the same elasticity for the policies and workloads the fidelity cells run,
in the simulator alone (no server): each cell's rate is fidelity's (``rate_at_load``: the idle
profile, the policy choosing), its traces fidelity's (text: real tweet lengths; image: OTAS's
tight and loose requests over DINOv2's tasks, ``bench.fidelity.image_trace``), its service the
fidelity table's log-normal arm (the profile x a ratio, a log-normal spread and a hand-off). The
ratio is then moved by each of ``SHIFTS`` with everything else held (the same traces and noise
draws: common random numbers), and the policy plans at the shifted prices, as the live server's
price correction would (OTAS then picks its gammas at those prices).

Arlo, fidelity's other text policy, is not tabled: at one instance its runtime groups are one group
of every runtime, batched by the same DeadlineBatching as ``default``, so its simulated runs are
identical; each text cell checks that at the base prices (every request's start and finish).

Decisions: the profile and the base calibrations come from one fidelity run, the file it writes
(``bench/results/fidelity-calibration.json``: the servers' own start-up profile, which holds
both models, DINOv2 at the OTAS grid the fidelity server serves, and every cell's calibration,
a ratio to that profile); the base calibration per workload is the median of its policy's three
cells (:func:`bench.fidelity.typical_calibration`), so no figure here is carried from an older
run. The elasticity is the central difference over +-3%, and the tolerance (the error that
moves a cell by 10%) scales the larger one-sided move at -3% or +3% (:func:`tolerance`).

    python -m bench.fidelity_sensitivity [--calibration FILE] [--traces 8] [--write]
"""

from __future__ import annotations

MEASURES = (
    "bench/fidelity_sensitivity.py", "bench/fidelity.py", "bench/results/fidelity-calibration.json",
    "jaxserve/simulator.py", "jaxserve/traces.py", "jaxserve/launch.py",
    "jaxserve/sched/base.py", "jaxserve/sched/batching.py", "jaxserve/sched/arlo", "jaxserve/sched/otas.py",
    "jaxserve/kernels",
)
SECTIONS = {"fidelity_sensitivity": "--write"}

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxserve.sched.base import CostModel

SAME_AS_DEFAULT = "arlo"  # checked per text cell: at one instance it decides as default does (module docstring)
LOADS = (0.3, 0.7, 0.9)
SHIFTS = (-0.06, -0.03, 0.0, 0.03, 0.06)
WORKLOADS = (("default", "minilm-l6", 60.0), ("otas", "dinov2-s14", 90.0))  # policy, model, seconds per trace


@dataclass(frozen=True)
class Setup:
    """One fidelity workload: its policy and model, the profile it is priced by, its typical
    calibration (ratio, log-normal sigma, hand-off s) and the length of one trace."""

    policy: str
    model: str
    cost: CostModel
    ratio: float
    sigma: float
    handoff_s: float
    duration: float


def setups(path: Path) -> tuple[Setup, ...]:
    """:data:`WORKLOADS` priced and calibrated as the fidelity run in ``path`` measured them."""
    from bench.fidelity import load_calibrations, typical_calibration

    cost, cells = load_calibrations(path)
    out = []
    for policy, model, duration in WORKLOADS:
        if model not in cost.latency:
            raise ValueError(f"{path}: its cost model does not price {model} (the fidelity run served "
                             f"{', '.join(sorted(cost.latency))})")
        t = typical_calibration(cells, policy)
        out.append(Setup(policy, model, cost, t["factor"], t["sigma"], t["handoff_s"], duration))
    return tuple(out)


class _ImageTraces:
    """fidelity's image workload without its images (the simulator needs only the trace)."""

    def __init__(self, model: str, slo_s: tuple[float, float], duration: float):
        from jaxserve.datasets import DINOV2_TASKS

        self.model, self.slo_s, self.duration, self.tasks = model, slo_s, duration, tuple(DINOV2_TASKS)

    def trace(self, rate: float, seed: int, duration: float | None = None):
        from bench.fidelity import image_trace

        return image_trace(self.model, self.tasks, 1, self.slo_s, rate, seed, duration or self.duration)


def cell(setup: Setup, load: float, traces_n: int, seed: int) -> dict:
    """One (workload, load): the rate, per shift the pooled mean and p98 (ms) and drops, and for
    the text workload whether :data:`SAME_AS_DEFAULT` ran every trace identically at the base prices."""
    from bench import fidelity as F

    cost = setup.cost
    planned = F.planned_models(cost, setup.model, setup.policy)
    if setup.policy in F.IMAGE_POLICIES:
        unit = cost.latency[setup.model].latency_for(max(planned[setup.model].grid.batch_sizes), 0, 0)
        workload = _ImageTraces(setup.model, (2 * unit, 4 * unit), setup.duration)
    else:
        workload = F.TextWorkload(planned[setup.model].grid, setup.duration, seed)
    rate, util = F.rate_at_load(setup.policy, planned, cost, workload, load, seed)
    runs = [workload.trace(rate, seed + 10 * (k + 1))[0] for k in range(traces_n)]

    def run(policy: str, models: dict, shift: float) -> list:
        scaled = cost.scaled(setup.ratio * (1 + shift))
        return [F.simulated(policy, models, scaled, trace, noise=setup.sigma, overhead=setup.handoff_s,
                            seed=seed + 10 * (k + 1)) for k, trace in enumerate(runs)]

    out = {"setup": setup, "load": load, "rate": rate, "util": util, "shifts": {}, "same": None}
    for shift in SHIFTS:
        results = run(setup.policy, planned, shift)
        ms = np.concatenate([r.latencies() for r in results]) * 1e3
        out["shifts"][shift] = {"mean": float(ms.mean()), "p98": float(np.percentile(ms, 98)),
                                "dropped": sum(len(r) - int(r.completed().sum()) for r in results),
                                "n": sum(len(r) for r in results)}
        if shift == 0.0 and setup.policy == "default":
            other = run(SAME_AS_DEFAULT, F.planned_models(cost, setup.model, SAME_AS_DEFAULT), shift)
            out["same"] = all(all(np.array_equal(getattr(a, f), getattr(b, f), equal_nan=True)
                                  for f in ("start", "finish", "outcome")) for a, b in zip(results, other))
    return out


def elasticity(c: dict, stat: str) -> float:
    """Percent change of ``stat`` per percent change of the service time (central, +-3%)."""
    s = c["shifts"]
    return (s[0.03][stat] - s[-0.03][stat]) / s[0.0][stat] / 0.06


def tolerance(c: dict) -> float:
    """The service-time error (percent) that moves the mean or the p98 by 10%: 10 over the largest
    move, per percent, of either at -3% or +3% (one-sided, since a policy that adapts, OTAS, can
    move the same way for both signs, which a central difference would hide)."""
    s = c["shifts"]
    worst = max(abs(s[x][k] / s[0.0][k] - 1) * 100 / 3.0 for x in (-0.03, 0.03) for k in ("mean", "p98"))
    return 10.0 / max(worst, 1e-9)


def main() -> None:
    from bench.common import add_quick, apply_quick, shown_path, table
    from bench.fidelity import CALIBRATION

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibration", type=Path, default=CALIBRATION,
                    help="a fidelity run's calibrations and cost model (bench.fidelity --write writes it)")
    ap.add_argument("--traces", type=int, default=8, help="traces per cell (pooled)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true", help="record the section in bench/RESULTS.md")
    add_quick(ap, traces=1)
    args = apply_quick(ap.parse_args())
    t0 = time.perf_counter()
    cells = []
    try:
        chosen = setups(args.calibration)
    except ValueError as exc:
        ap.error(str(exc))
    for setup in chosen:
        for load in LOADS:
            c = cell(setup, load, args.traces, args.seed)
            cells.append(c)
            print(f"{setup.policy} ({setup.model}) at {load:.0%}: rate {c['rate']:.1f} req/s, elasticity mean "
                  f"{elasticity(c, 'mean'):.2f}, p98 {elasticity(c, 'p98'):.2f}", flush=True)
    rows = []
    for c in cells:
        base, s = c["shifts"][0.0], c["setup"]
        rows.append([s.policy, s.model, f"{c['load']:.0%}", f"{c['rate']:.1f}",
                     f"x{s.ratio:.2f}, {s.sigma:.2f}, {s.handoff_s * 1e3:.2f} ms",
                     f"{base['mean']:.1f} / {base['p98']:.1f}",
                     *(f"{(c['shifts'][x]['mean'] / base['mean'] - 1) * 100:+.1f}% / "
                       f"{(c['shifts'][x]['p98'] / base['p98'] - 1) * 100:+.1f}%" for x in SHIFTS if x),
                     f"{elasticity(c, 'mean'):.2f} / {elasticity(c, 'p98'):.2f}", f"±{tolerance(c):.1f}%",
                     f"{base['dropped']} of {base['n']:,}"])
    body = table(["policy", "model", "load", "rate req/s", "base calibration (ratio, sigma, hand-off)",
                  "sim mean / p98 ms", *(f"service {x * 100:+.0f}%: mean / p98" for x in SHIFTS if x),
                  "elasticity mean / p98", "service error that moves mean or p98 by 10%", "dropped"], rows)
    worst = min(cells, key=tolerance)
    checked = [c for c in cells if c["same"] is not None]
    differ = [f"{c['load']:.0%}" for c in checked if not c["same"]]
    same_text = "identical in every text cell" if not differ else "different at " + ", ".join(differ)
    notes = (f"Each cell: fidelity's rate for the load (idle profile, `rate_at_load`), {args.traces} Poisson traces "
             f"pooled ({', '.join(f'{s.model}: {s.duration:g} s each' for s in chosen)}), the fidelity servers' start-up profile "
             f"(`{shown_path(args.calibration)}`) x the base ratio (the median of the policy's fidelity cells) x (1 + shift), "
             f"its log-normal spread and hand-off per batch, the policy planning at the shifted prices; the same "
             f"traces and noise draws for every shift. Elasticity: percent change per percent of service time, "
             f"central over ±3% (M/M/1's mean: 1 / (1 - load), 10 at 90%); the error that moves a cell by 10%: 10 over "
             f"the larger move per percent of its mean or p98 at -3% or +3%. The tightest cell is "
             f"{worst['setup'].policy} at {worst['load']:.0%}: a service-time error of ±{tolerance(worst):.1f}% moves "
             f"its mean or p98 by 10%. {SAME_AS_DEFAULT} (one instance) against default, every trace at the base "
             f"prices: {same_text}. Whole run: {time.perf_counter() - t0:.0f} s.")
    print(body)
    print(notes)
    if args.write:
        from bench.common import record

        record("fidelity_sensitivity", "Simulator fidelity: how far latency moves with the service time, per cell",
               body, notes)


if __name__ == "__main__":
    main()
