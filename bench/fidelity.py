"""Simulator fidelity: the same trace, live through HTTP and simulated, at about 70% load.

The live server (default policy, MiniLM, one instance) and the simulator (the same
policy class, the cost model the server profiled at start-up) replay one Poisson trace
of real tweets. We compare mean and p98 latency: the server-side latency (the engine's
``latency_ms``: queue + compute + hand-off, what the simulator models) and, for
reference, the client-side one (HTTP and JSON included). Arlo reports 4.3% (mean) and
2.6% (p98); our goal is within 10%.

The 70% load point is found on the simulator itself: the Poisson rate at which the
simulated instance is busy 70% of the time.

    python -m bench.fidelity [--duration 30] [--repeats 3] [--write]
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations;
# read by bench.all, bench.status and bench.headline without importing this module).
MEASURES = (
    "bench/fidelity.py", "bench/load.py", "jaxserve/simulator.py", "jaxserve/traces.py", "serving",
    "jaxserve/engine.py", "jaxserve/launch.py", "jaxserve/workers.py", "jaxserve/cli.py",
    "jaxserve/sched/base.py", "jaxserve/sched/batching.py", "jaxserve/models", "jaxserve/kernels",
    "jaxserve/polymorph.py", "jaxserve/servables.py", "jaxserve/compile_cache.py", "jaxserve/runtime.py",
)
SECTIONS = {"fidelity": "--write"}

import argparse
import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import add_quick, apply_quick, record, table
from bench.load import open_loop, start, stop
from jaxserve import traces
from jaxserve.datasets import load_tweets
from jaxserve.models.tokenizer import TextTokenizer
from jaxserve.profiler import load_cost_model
from jaxserve.registry import minilm_dir
from jaxserve.sched.base import ShapeGrid
from jaxserve.sched.batching import DeadlineBatching
from jaxserve.simulator import simulate


def grid_of(cost, model):
    cells = cost.latency[model].cells()
    return ShapeGrid(tuple(sorted({c.batch for c in cells})), tuple(sorted({c.seq for c in cells if c.seq})))


def simulated(cost, grid, arrivals, lengths, max_wait, noise: float = 0.0, overhead: float = 0.0,
              service_time=None):
    trace = traces.make_trace(arrivals, model="minilm-l6", length=lengths)
    policy = DeadlineBatching({"minilm-l6": grid}, cost, max_queue=256, max_wait=max_wait)
    return simulate(policy, trace, cost, instances=1, latency_noise=noise, batch_overhead=overhead,
                    service_time=service_time)


@dataclass
class Calibration:
    """How the live server's batches differed from the idle-machine profile, one record per
    batch (see ``calibrate``)."""

    ratios: np.ndarray  # measured / profiled compute time
    handoffs: np.ndarray  # seconds an instance stayed held beyond the compute
    sizes: np.ndarray  # batch sizes
    factor: float  # total measured over total profiled compute time

    @property
    def sigma(self) -> float:
        return float(np.std(np.log(self.ratios)))

    @property
    def handoff(self) -> float:
        return float(self.handoffs.mean())

    def __len__(self) -> int:
        return len(self.ratios)


def calibrate(cost, computed, model: str = "minilm-l6") -> Calibration:
    """From answers' (shape, compute ms, held ms) records, one per batch (every item of a
    batch reports the same shape and compute ms; its held time, from two rounded fields,
    can differ by a microsecond):

    - factor: how much slower the executables ran while serving (HTTP path and load
      generator on the same cores) than in the idle-machine profile;
    - sigma: how much one batch's time varies around that (queueing grows with
      service-time variance, which a deterministic profile leaves out);
    - hand-off: how long an instance stays held beyond its compute (worker pick-up, the
      completion waiting for the event loop), the simulator's batch_overhead."""
    by_label = {c.label(): t for c, t in cost.latency[model].seconds.items()}
    batches = {}
    for shape, ms, held_ms in computed:
        batches.setdefault((shape, ms), held_ms)
    profiled = np.array([by_label[shape] for shape, _ in batches])
    measured = np.array([ms for _, ms in batches]) / 1e3
    held = np.array(list(batches.values())) / 1e3
    return Calibration(measured / profiled, np.maximum(held - measured, 0.0),
                       np.array([int(shape.split("_")[0][1:]) for shape, _ in batches]),
                       float(measured.sum() / profiled.sum()))


def empirical_service(cost, cal: Calibration, seed: int, model: str = "minilm-l6"):
    """Price a batch as profile(cell) x ratio + hand-off, one (ratio, hand-off) pair drawn
    at random from the calibration batches of the same batch size (all of them if there are
    fewer than 20): their tails as measured, not a fitted log-normal, and their link to
    congestion kept as far as batch size carries it (busy moments make bigger batches, and
    a busier event loop hands off later)."""
    rng = np.random.default_rng(seed)
    profile = cost.latency[model]
    every = np.arange(len(cal))
    by_size = {b: np.flatnonzero(cal.sizes == b) for b in np.unique(cal.sizes)}
    by_size = {b: idx if len(idx) >= 20 else every for b, idx in by_size.items()}

    def service_time(batch):
        idx = by_size.get(batch.cell.batch, every)
        k = idx[rng.integers(len(idx))]
        return profile.latency(batch.cell) * cal.ratios[k] + cal.handoffs[k]

    return service_time


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--calibrate", type=float, default=30.0, help="seconds of calibration trace")
    ap.add_argument("--port", type=int, default=8021)
    ap.add_argument("--cache-dir", default="compiled_cache")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="live traces (other seeds), pooled")
    ap.add_argument("--write", action="store_true")
    add_quick(ap, duration=3.0, calibrate=3.0, repeats=1)
    args = apply_quick(ap.parse_args())

    url = f"http://127.0.0.1:{args.port}"
    server = start([__import__("sys").executable, "-m", "jaxserve.cli", "serve", "--model", "minilm-l6",
                    "--port", str(args.port), "--instances", "1", "--cache-dir", args.cache_dir], url)
    try:
        cost = load_cost_model(Path(args.cache_dir) / "cost_model.json")
        grid = grid_of(cost, "minilm-l6")
        tok = TextTokenizer(minilm_dir() / "tokenizer.json")
        texts_all, _ = load_tweets()
        rng = np.random.default_rng(args.seed)
        pool = [texts_all[i] for i in rng.choice(len(texts_all), 4000, replace=False)]
        ids = [tok.truncate(x, grid.max_length) for x in tok.encode(pool)]
        pool_len = np.array([len(x) for x in ids])

        def trace_at(rate, seed):
            arr = traces.poisson_arrivals(rate, duration=args.duration, seed=seed)
            pick = np.random.default_rng(seed + 1).integers(0, len(pool), len(arr))
            return arr, pick

        lo, hi = 1.0, 2000.0  # bisect the rate that keeps the simulated instance args.load busy
        for _ in range(25):
            mid = (lo * hi) ** 0.5
            arr, pick = trace_at(mid, args.seed)
            util = simulated(cost, grid, arr, pool_len[pick], 0.0).utilization()
            lo, hi = (mid, hi) if util < args.load else (lo, mid)
        rate = lo
        # Calibration (``calibrate``), on a different trace: other seed, same rate.
        cal_arr = traces.poisson_arrivals(rate, duration=args.calibrate, seed=args.seed + 100)
        cal_pick = np.random.default_rng(args.seed + 101).integers(0, len(pool), len(cal_arr))
        cal = calibrate(cost, asyncio.run(open_loop(url, cal_arr, [pool[i] for i in cal_pick], None)).computed)
        factor, sigma, handoff = cal.factor, cal.sigma, cal.handoff
        # Live and simulated, on args.repeats traces (seeds args.seed, +10, +20, ...), pooled: one
        # 30 s trace's live p98 moves by 10-25% from run to run on this machine.
        sims = {"idle": [], "cal": [], "hand": [], "emp": []}
        server_ms, client_ms = [], []
        for k in range(args.repeats):
            arr, pick = trace_at(rate, args.seed + 10 * k)
            lengths = pool_len[pick]
            sims["idle"].append(simulated(cost, grid, arr, lengths, 0.0))  # the server default (--max-wait-ms 0)
            sims["cal"].append(simulated(cost.scaled(factor), grid, arr, lengths, 0.0, noise=sigma))
            sims["hand"].append(simulated(cost.scaled(factor), grid, arr, lengths, 0.0, noise=sigma,
                                          overhead=handoff))
            sims["emp"].append(simulated(cost, grid, arr, lengths, 0.0, service_time=empirical_service(
                cost, cal, args.seed + 7 + k)))
            live = asyncio.run(open_loop(url, arr, [pool[i] for i in pick], None))  # the same texts, in order
            server_ms.append(live.server_ms)
            client_ms.append(live.latencies * 1e3)
    finally:
        stop(server)

    server_ms, client_ms = np.concatenate(server_ms), np.concatenate(client_ms)
    rows = []
    for label, key in (("idle-machine profile", "idle"), (f"calibrated (x{factor:.2f}, sigma {sigma:.2f})", "cal"),
                       (f"calibrated + hand-off ({handoff * 1e3:.2f} ms/batch)", "hand"),
                       ("calibration batches drawn empirically", "emp")):
        sim_lat = np.concatenate([r.latencies() for r in sims[key]]) * 1e3
        for stat, fn in (("mean", np.mean), ("p98", lambda x: np.percentile(x, 98))):
            s_val, l_val, c_val = fn(sim_lat), fn(server_ms), fn(client_ms)
            rows.append([label, stat, f"{s_val:.2f}", f"{l_val:.2f}", f"{(s_val - l_val) / l_val * 100:+.1f}%",
                         f"{c_val:.2f}"])
    text = table(["cost model", "latency", "simulated ms", "live server-side ms", "sim vs live",
                  "live client-side ms"], rows)
    util = np.mean([r.utilization() for r in sims["idle"]])
    notes = (f"Poisson at {rate:.1f} req/s (simulated utilisation {util:.2f}), {args.repeats} traces of "
             f"{args.duration:.0f} s pooled ({len(server_ms)} real tweets answered live), "
             f"one instance, default policy. Arlo reports 4.3% (mean) and 2.6% (p98). Goal: within 10%.  \n"
             f"Calibrated: the profile's latencies times {factor:.2f}, the ratio of the compute time the server "
             f"reported to the profiled time of the same cells on a separate {args.calibrate:.0f} s calibration "
             f"trace (another seed, same rate) just before, and each batch's time drawn with a mean-one log-normal "
             f"factor of sigma {sigma:.2f}, the spread of log(measured / profiled) on that trace: live, the "
             f"executables share the 2 cores with the HTTP path and the load generator, which the idle-machine "
             f"profile does not see, and their times vary, which a deterministic profile leaves out.  \n"
             f"Hand-off: on the same calibration trace, the mean time an instance stayed held beyond its "
             f"compute ({handoff * 1e3:.2f} ms per batch over {len(cal)} batches: the worker thread picking "
             f"the batch up and the completion waiting for the event loop, which is busy with HTTP), added to "
             f"every simulated batch (simulate(..., batch_overhead=)). Live server-side latency is the engine's "
             f"latency_ms: arrival stamp to answer, HTTP excluded.  \n"
             f"Empirical: each simulated batch priced profile(cell) x ratio + hand-off, with one (measured / "
             f"profiled, hand-off) pair drawn at random from the {len(cal)} calibration batches of its batch "
             f"size, so the tails are the measured ones rather than a log-normal's.")
    print(text)
    print(notes)
    if args.write:
        record("fidelity", "Simulator fidelity against the live engine", text, notes)
    print(json.dumps({"rate": rate, "factor": factor, "sigma": sigma, "handoff_ms": handoff * 1e3,
                      "live_mean": float(server_ms.mean()), "live_p98": float(np.percentile(server_ms, 98))}))


if __name__ == "__main__":
    main()
