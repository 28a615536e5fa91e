"""Where is the knee on this machine? The calibrated simulator, swept past saturation.

The live knee (bench/load.py) is measured with the load generator on the same 2 cores. Here the
simulator runs the server's default policy on the cost model bench/fidelity.py's servers
profiled at their start, calibrated as that same fidelity run measured the default policy at
70% load (its ``bench/results/fidelity-calibration.json``: the compute ratio to that profile, the
log-normal spread and the hand-off per batch), on Poisson traces of real tweets with a 200 ms
SLO, for 1 and 2 workers and several max-wait settings. Two workers share the 2 cores, so each
of their batches is priced at the slow-down bench/workers.py measured for two workers that run
batch 8 at once (its section's p50 per batch, two workers over one, read from bench/RESULTS.md
at run time, which is why bench.all's ORDER runs bench/workers.py before this script; bench.status
tracks files, not sections, so a workers rerun alone does not mark this one stale; ``--shared``
overrides it). The question is the policy's ceiling: how many
answered-on-time requests per second can this grid and machine give at all?

Decisions: the calibration and its cost model come from one fidelity run and are used together
(a ratio to another run's profile would mean nothing), so nothing here is a constant carried
from an older run; the ceiling is stated in answered/s, and its ratio to the naive peer's knee
is bench.headline's, from the load section it names. The policy plans with the slowed-down
prices, as the live server's does once its price correction (``jaxserve/cost_drift.py``, on by
default) has measured a few steps; the spread and the hand-off it cannot know. The cost model
used is copied to bench/results/sim_knee-cost_model.json with --write, for the scripts that
simulate this server (sim_speed, arlo_short).

    python -m bench.sim_knee [--calibration FILE] [--shared X] [--write]
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations;
# read by bench.all, bench.status and bench.headline without importing this module).
MEASURES = (
    "bench/sim_knee.py", "bench/fidelity.py", "bench/results/fidelity-calibration.json", "jaxserve/simulator.py",
    "jaxserve/sched/batching.py", "jaxserve/sched/base.py", "jaxserve/traces.py",
)
SECTIONS = {"sim_knee": "--write"}
PRODUCES = ("bench/results/sim_knee-cost_model.json",)  # the cost model it ran on, for later runs

import argparse
import hashlib
from pathlib import Path

import numpy as np

from bench.common import CANONICAL_RESULTS, add_quick, apply_quick, output, record, shown_path, table
from bench.fidelity import CALIBRATION, calibration_of, grid_of, load_calibrations
from jaxserve import traces
from jaxserve.datasets import load_tweets
from jaxserve.models.tokenizer import TextTokenizer
from jaxserve.registry import minilm_dir
from jaxserve.sched.batching import DeadlineBatching
from jaxserve.simulator import simulate

TWO_WORKERS, ONE_WORKER = "2 workers, XLA threads = cores", "1 worker, XLA threads = cores"  # the engine's default


def shared_slowdown(results: Path = CANONICAL_RESULTS, batch: int = 8) -> tuple[float, str]:
    """How much slower each of two workers runs a batch of ``batch`` than one worker alone (the
    ``workers`` section's p50 per batch, two over one), and where that was read; ValueError if
    the section or its rows are missing."""
    from bench.headline import NotFound, Sec, num
    from bench.status import parse_sections

    secs = {x.key: x for x in parse_sections(Path(results).read_text())}
    if "workers" not in secs:
        raise ValueError(f"{results} has no workers section: run python -m bench.workers --write, or pass --shared")
    sec = Sec(secs["workers"])
    try:
        p50 = {c: num(sec.row("configuration", batch=str(batch), configuration=c)["p50 ms/batch"])
               for c in (TWO_WORKERS, ONE_WORKER)}
    except (NotFound, KeyError) as exc:
        raise ValueError(f"{results}: section workers lacks batch {batch}'s rows ({exc}); pass --shared") from None
    return p50[TWO_WORKERS] / p50[ONE_WORKER], (f"section workers ({sec.s.fields.get('Date', '?')}): batch {batch} "
                                                f"{p50[TWO_WORKERS]:.1f} ms per batch with two workers, "
                                                f"{p50[ONE_WORKER]:.1f} ms alone")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibration", type=Path, default=CALIBRATION,
                    help="a fidelity run's calibrations and cost model (bench.fidelity --write writes it)")
    ap.add_argument("--load", type=float, default=0.7, help="the default policy's fidelity cell to calibrate by")
    ap.add_argument("--shared", type=float, default=None,
                    help="the two-worker slow-down per batch (default: read from the workers section)")
    ap.add_argument("--rates", default="120,160,200,240,280,320")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--write", action="store_true")
    add_quick(ap, rates="120", duration=3.0)
    args = apply_quick(ap.parse_args())
    try:
        cost, cells = load_calibrations(args.calibration)
        cal = calibration_of(cells, "default", args.load)
        shared, shared_from = shared_slowdown() if args.shared is None else (args.shared, "--shared")
    except ValueError as exc:
        ap.error(str(exc))
    grid = grid_of(cost, "minilm-l6")
    tok = TextTokenizer(minilm_dir() / "tokenizer.json")
    texts, _ = load_tweets()
    pool = [texts[i] for i in np.random.default_rng(0).choice(len(texts), 4000, replace=False)]
    lengths = np.array([len(tok.truncate(x, grid.max_length)) for x in tok.encode(pool)])
    rates = [float(r) for r in args.rates.split(",")]
    rows, best = [], 0.0
    for workers in (1, 2):
        priced = cost.scaled(cal["factor"] * (shared if workers == 2 else 1.0))
        for max_wait in (0.0, 0.005, 0.02):
            out = []
            for rate in rates:
                arr = traces.poisson_arrivals(rate, duration=args.duration, seed=0)
                pick = np.random.default_rng(1).integers(0, len(pool), len(arr))
                trace = traces.make_trace(arr, model="minilm-l6", length=lengths[pick], slo_s=0.2)
                policy = DeadlineBatching({"minilm-l6": grid}, priced, max_queue=256, max_wait=max_wait)  # as live
                r = simulate(policy, trace, priced, instances=workers, latency_noise=cal["sigma"],
                             batch_overhead=cal["handoff_s"])
                best = max(best, r.goodput())
                out.append(f"{r.goodput():.0f} / {r.p98() * 1e3:.0f} / {r.mean_batch_size():.1f}")
            rows.append([str(workers), f"{max_wait * 1e3:.0f}", *out])
    text = table(["workers", "max wait ms", *(f"{r:.0f}/s offered" for r in rates)], rows)
    cost_json = cost.to_json().encode()
    digest = hashlib.sha256(cost_json).hexdigest()[:12]
    err = cal["lognormal_error_pct"]
    notes = (f"Each cell: answered on time per second / p98 ms / mean batch. Ceiling: **{best:.0f} answered/s** "
             f"on time. The simulated instances take the fidelity servers' start-up profile x{cal['factor']:.2f} "
             f"(x{shared:.2f} more with 2 workers: {shared_from}), with a log-normal spread of sigma "
             f"{cal['sigma']:.2f} and a {cal['handoff_s'] * 1e3:.2f} ms hand-off per batch: the default policy's "
             f"calibration at {args.load:.0%} load in `{shown_path(args.calibration)}`, whose log-normal simulation came "
             f"out {err[0]:+.0f}% / {err[1]:+.0f}% on mean / p98 against live there. The policy plans with the "
             f"slowed-down prices, as the live one does after its price correction's first steps. Cost model: "
             f"bench/results/sim_knee-cost_model.json (sha256 {digest}), the one that calibration is relative to. "
             f"Its ratio to the naive peer's knee is the README headline's, from the load section it names.")
    print(text)
    print(notes)
    if args.write:
        output(Path(__file__).parent / "results" / "sim_knee-cost_model.json").write_bytes(cost_json)
        record("sim_knee", "Knee ceiling on this machine (calibrated simulator)", text, notes)


if __name__ == "__main__":
    main()
