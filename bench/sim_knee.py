"""Where is the knee on this machine? The calibrated simulator, swept past saturation.

The live knee (bench/load.py) is measured in 40 req/s steps with the load generator on
the same 2 cores. Here the simulator runs the server's default policy on the cost model
the server profiled, calibrated as ``bench/fidelity.py`` measured it for the default policy
at 70% load (section fidelity: compute x1.10, log-normal spread sigma 0.29, 0.62 ms hand-off
per batch), on Poisson traces of real tweets with a 200 ms SLO, for 1 and 2 workers and
several max-wait settings. Two workers share the 2 cores, so each of their batches is priced
1.7x (bench/workers.py: batch 8 took 61 ms with two workers against 36 ms alone). The
question is the policy's ceiling: how many answered-on-time requests per second can this grid
and machine give at all?

The policy plans with the slowed-down prices, as the live server's does once its price
correction (``jaxserve/cost_drift.py``, on by default) has measured a few steps; the spread
and the hand-off it cannot know. The cost model used is copied to
bench/results/sim_knee-cost_model.json with --write.

    python -m bench.sim_knee [--write]
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations;
# read by bench.all, bench.status and bench.headline without importing this module).
MEASURES = (
    "bench/sim_knee.py", "bench/fidelity.py", "jaxserve/simulator.py", "jaxserve/sched/batching.py",
    "jaxserve/sched/base.py", "jaxserve/traces.py",
)
SECTIONS = {"sim_knee": "--write"}
PRODUCES = ("bench/results/sim_knee-cost_model.json",)  # the cost model it ran on, for later runs

import argparse
import hashlib
import shutil
from pathlib import Path

import numpy as np

from bench.common import add_quick, apply_quick, output, record, table
from bench.fidelity import grid_of
from jaxserve import traces
from jaxserve.datasets import load_tweets
from jaxserve.models.tokenizer import TextTokenizer
from jaxserve.profiler import load_cost_model
from jaxserve.registry import minilm_dir
from jaxserve.sched.batching import DeadlineBatching
from jaxserve.simulator import simulate

FACTOR, SIGMA, HANDOFF_S, SHARED = 1.10, 0.29, 0.00062, 1.7


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cache-dir", default="compiled_cache")
    ap.add_argument("--rates", default="120,160,200,240,280,320")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--write", action="store_true")
    add_quick(ap, rates="120", duration=3.0)
    args = apply_quick(ap.parse_args())
    cost_path = Path(args.cache_dir) / "cost_model.json"
    cost = load_cost_model(cost_path)
    grid = grid_of(cost, "minilm-l6")
    tok = TextTokenizer(minilm_dir() / "tokenizer.json")
    texts, _ = load_tweets()
    pool = [texts[i] for i in np.random.default_rng(0).choice(len(texts), 4000, replace=False)]
    lengths = np.array([len(tok.truncate(x, grid.max_length)) for x in tok.encode(pool)])
    rates = [float(r) for r in args.rates.split(",")]
    rows, best = [], 0.0
    for workers in (1, 2):
        priced = cost.scaled(FACTOR * (SHARED if workers == 2 else 1.0))
        for max_wait in (0.0, 0.005, 0.02):
            cells = []
            for rate in rates:
                arr = traces.poisson_arrivals(rate, duration=args.duration, seed=0)
                pick = np.random.default_rng(1).integers(0, len(pool), len(arr))
                trace = traces.make_trace(arr, model="minilm-l6", length=lengths[pick], slo_s=0.2)
                policy = DeadlineBatching({"minilm-l6": grid}, priced, max_queue=256, max_wait=max_wait)  # as live
                r = simulate(policy, trace, priced, instances=workers, latency_noise=SIGMA, batch_overhead=HANDOFF_S)
                best = max(best, r.goodput())
                cells.append(f"{r.goodput():.0f} / {r.p98() * 1e3:.0f} / {r.mean_batch_size():.1f}")
            rows.append([str(workers), f"{max_wait * 1e3:.0f}", *cells])
    text = table(["workers", "max wait ms", *(f"{r:.0f}/s offered" for r in rates)], rows)
    digest = hashlib.sha256(cost_path.read_bytes()).hexdigest()[:12]
    notes = (f"Each cell: answered on time per second / p98 ms / mean batch. Ceiling: **{best:.0f} answered/s** "
             f"on time. The simulated instances take the server's start-up profile x{FACTOR} (x{SHARED} more with 2 "
             f"workers), with a log-normal spread of sigma {SIGMA} and a {HANDOFF_S * 1e3:.2f} ms hand-off per batch "
             f"(bench/fidelity's default-policy calibration at 70% load, whose simulation came out 18% / 37% low on "
             f"mean / p98 there); the policy plans with the slowed-down prices, as the live one does after its "
             f"price correction's first steps. Cost model: "
             f"bench/results/sim_knee-cost_model.json (sha256 {digest}). A cross-run estimate against the naive "
             f"FastAPI + jit peer's knee of ~116/s (bench/load.py's run, not this one): at most "
             f"~{best / 116:.1f}x the peer on this machine, against the issue's 3x.")
    print(text)
    print(notes)
    if args.write:
        shutil.copyfile(cost_path, output(Path(__file__).parent / "results" / "sim_knee-cost_model.json"))
        record("sim_knee", "Knee ceiling on this machine (calibrated simulator)", text, notes)


if __name__ == "__main__":
    main()
