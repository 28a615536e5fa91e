"""How many requests per minute can the simulator push through the default policy?

Runs :func:`jaxserve.simulator.simulate` with :class:`DeadlineBatching` on synthetic
BERT-like and ViT-like cost models, Poisson and bursty (gamma CV=4) traces, a few
instance counts, and prints a markdown table of simulated requests per wall-clock
minute (the goal is >= 1,000,000) next to what the policy achieved.

    .venv/bin/python bench/sim_speed.py [--requests 200000]
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations;
# read by bench.all, bench.status and bench.headline without importing this module).
MEASURES = (
    "bench/sim_speed.py", "jaxserve/simulator.py", "jaxserve/sched/base.py", "jaxserve/sched/batching.py",
    "jaxserve/traces.py",
)
SECTIONS = {"sim_speed": "--write"}

import argparse
import math
import time

import numpy as np

from jaxserve.sched.base import Cell, CostModel, LatencyProfile, ShapeGrid
from jaxserve.sched.batching import DeadlineBatching
from jaxserve.simulator import simulate
from jaxserve.traces import gamma_arrivals, make_trace, poisson_arrivals, sample_lengths

BATCH_SIZES = (1, 2, 4, 8, 16, 32)
BUCKETS = (16, 32, 64, 128)


def text_setup():
    grid = ShapeGrid(BATCH_SIZES, BUCKETS)
    # a linear-in-tokens latency with a fixed launch cost (shaped like a small BERT)
    seconds = {c: 0.002 + 2.5e-6 * c.batch * c.seq for c in grid.cells()}
    cost = CostModel({"bert": LatencyProfile("bert", seconds)}, machine="synthetic")
    return {"bert": grid}, cost


def image_setup():
    grid = ShapeGrid(BATCH_SIZES)
    seconds = {c: 0.003 + 0.0008 * c.batch for c in grid.cells()}
    cost = CostModel({"vit": LatencyProfile("vit", seconds)}, machine="synthetic")
    return {"vit": grid}, cost


def tweet_like_lengths(seed: int) -> np.ndarray:
    """Stand-in for real tweet token counts: log-normal, median ~30, clipped to 128."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(math.log(30), 0.6, 5000)), 3, 128).astype(np.int64)


def run(kind: str, arrivals_kind: str, instances: int, load: float, n: int, seed: int = 0):
    grids, cost = text_setup() if kind == "text" else image_setup()
    model = next(iter(grids))
    # capacity of one instance with full batches at a typical cell
    typical = Cell(32, 32) if kind == "text" else Cell(32)
    per_instance = 32 / cost.latency[model].latency(typical)
    rate = load * per_instance * instances
    if arrivals_kind == "poisson":
        arrivals = poisson_arrivals(rate, n=n, seed=seed)
    else:
        arrivals = gamma_arrivals(rate, 4.0, n=n, seed=seed)
    length = sample_lengths(tweet_like_lengths(seed), n, seed=seed + 1) if kind == "text" else 0
    trace = make_trace(arrivals, model=model, length=length, slo_s=0.05)
    policy = DeadlineBatching(grids, cost, max_queue=4096, max_wait=0.005)
    t0 = time.perf_counter()
    result = simulate(policy, trace, cost, instances)
    wall = time.perf_counter() - t0
    return result, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--write", action="store_true", help="record the table in bench/RESULTS.md")
    from bench.common import add_quick, apply_quick

    add_quick(parser, requests=2000)
    args = apply_quick(parser.parse_args())
    print(f"DeadlineBatching(max_wait=5 ms, max_queue=4096), SLO 50 ms; offered load is relative to "
          f"full (32, 32) batches, so text traces with longer buckets run hotter (see utilization)\n")
    rows = []
    for kind, arrivals_kind, instances, load in [
        ("text", "poisson", 1, 0.5),
        ("text", "poisson", 8, 0.7),
        ("text", "gamma cv=4", 8, 0.7),
        ("text", "poisson", 100, 0.7),
        ("image", "poisson", 8, 0.7),
        ("text", "poisson", 1000, 0.3),
        ("text", "poisson", 8, 1.5),  # overload: evictions and 429s
    ]:
        result, wall = run(kind, arrivals_kind, instances, load, args.requests)
        s = result.summary()
        rows.append(
            f"| {kind} | {arrivals_kind} | {instances} | {load:.1f} | {len(result):,} | {wall:.2f} | "
            f"{len(result) / wall * 60:,.0f} | {s['utilization']:.2f} | {s['mean_batch_size']:.1f} | "
            f"{s['slo_attainment']:.3f} | {s['evicted'] / len(result):.3f} | {s['rejected'] / len(result):.3f} | "
            f"{s['p99'] * 1e3:.1f} |"
        )
        print(rows[-1], flush=True)
    text = "\n".join([
        "| model | arrivals | instances | offered load | requests | wall s | simulated req/min "
        "| utilization | mean batch | SLO att. | evicted | rejected | p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    print()
    print(text)
    if args.write:
        from bench.common import record

        record("sim_speed", "Simulator speed", text,
               "DeadlineBatching (max_wait 5 ms), SLO 50 ms, synthetic profile. Goal: ≥ 1M simulated requests/min.")


if __name__ == "__main__":
    main()
