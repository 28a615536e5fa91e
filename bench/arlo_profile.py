"""Profile BERT-base (random weights) polymorph cells on this CPU for the Arlo experiments.

Question: what does the latency of a statically compiled BERT-base executable look
like as a function of the sequence length on this CPU (is there a 64-token
staircase, as TensorRT shows on a GPU in Arlo Fig. 2a?), and what does each
(batch, bucket) cell cost? The answer is the cost model the simulated Arlo
experiments (bench/arlo_sim.py) read: ``bench/profiles/bert-base-cpu.json``.

* Batch 1 at every 16 tokens from 16 to 512 (the staircase, and the exact-length
  curve the DT baseline interpolates); batch 2 and 4 at every 128 tokens.
* One instance = one core: XLA runs single-threaded
  (``--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1``, set
  below before JAX is imported), so G instances are G cores working in parallel,
  the CPU analogue of the paper's one runtime instance per GPU.
* Weights are random (``init_bert``): latency does not depend on their values.
* This machine is shared (2 cores, other jobs running: load average 5-7 while we
  measured). Timing each cell 5 times in a row gave medians that were
  non-monotone in the length by up to 50 %. So every cell is compiled first and
  then timed once per *round*, in a shuffled order, for ``--rounds`` rounds;
  contention then hits all cells alike, and the *minimum* over rounds (contention
  only ever adds time) estimates what the executable itself costs. All samples
  are kept in ``bert-base-cpu-raw.json``.
* The cost model the simulator reads is a smooth fit of the minima (:func:`fit`):
  batch 1 as ``a + c1 s + c2 s^2`` (dense layers linear in the tokens, attention
  quadratic), batch ``b`` as a constant multiple of it. The minima still scatter
  by +-20 % between neighbouring lengths (the machine never became quiet), which
  the fit averages away; the fit and the raw minima are both reported
  (bench/arlo_sim.py ``profile``, the "arlo_profile" section).

The live experiment (bench/arlo_live.py) serves MiniLM-L6 and reads the same kind of
profile for it: ``--model minilm-l6`` (random weights of the same shape; the name is
the served model's, so the server uses the file as its cost model).

    nice -n 10 .venv/bin/python -m bench.arlo_profile [--model bert-base] [--rounds 8]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

PROFILES = Path(__file__).parent / "profiles"
MODEL = "bert-base"
SEQS = tuple(range(16, 513, 16))
BATCHES = (1, 2, 4)


def planned_cells() -> list[tuple[int, int]]:
    return [(1, s) for s in SEQS] + [(b, s) for b in (2, 4) for s in range(128, 513, 128)]


def fit(minima: dict[tuple[int, int], float]) -> tuple[np.ndarray, dict[int, float], list[tuple[int, int]]]:
    """The smoothed profile: ``t(1, s) = a + c1 s + c2 s^2`` and ``t(b, s) = r_b t(1, s)``.

    Batch 1 is fitted by least squares on *relative* errors (every length counts
    alike), then refitted without the points more than 15 % above the fit
    (contention only ever adds time). Batch ``b`` is the batch-1 curve times the
    median ratio of its measured minima to that curve (4 noisy points per batch
    size support no more than one parameter). Returns ``(a, c1, c2)``, ``{b: r_b}``
    and the dropped cells.
    """
    ones = sorted(c for c in minima if c[0] == 1)
    keep = list(ones)
    for _ in range(5):
        y = np.array([minima[c] for c in keep])
        A = np.array([[1.0, s, s * s] for _, s in keep]) / y[:, None]
        coef, *_ = np.linalg.lstsq(A, np.ones(len(keep)), rcond=None)
        curve = lambda s: coef[0] + coef[1] * s + coef[2] * s * s  # noqa: E731
        new = [c for c in ones if minima[c] <= 1.15 * curve(c[1])]
        if new == keep:
            break
        keep = new
    ratios = {1: 1.0}
    for b in sorted({c[0] for c in minima} - {1}):
        ratios[b] = float(np.median([minima[c] / curve(c[1]) for c in minima if c[0] == b]))
    return coef, ratios, [c for c in ones if c not in keep]


def paths(model: str) -> tuple[Path, Path]:
    """(raw samples, fitted cost model) files of ``model``."""
    return PROFILES / f"{model}-cpu-raw.json", PROFILES / f"{model}-cpu.json"


def fitted_cost_model(raw: dict):
    from jaxserve.sched.base import Cell, CostModel, LatencyProfile

    minima = {(b, s): min(v) for b, s, v in raw["cells"]}
    coef, ratios, dropped = fit(minima)
    seconds = {Cell(b, s): float(ratios[b] * (coef[0] + coef[1] * s + coef[2] * s * s)) for b in BATCHES for s in SEQS}
    machine = (f"{raw['machine']}; fitted t(1, s) = a + c1 s + c2 s^2 with (a, c1, c2) = "
               f"({coef[0]:.4g}, {coef[1]:.4g}, {coef[2]:.4g}), t(b, s) = r_b t(1, s) with r = "
               + ", ".join(f"{b}: {r:.2f}" for b, r in ratios.items()))
    model = raw["model"]
    return CostModel({model: LatencyProfile(model, seconds)}, machine=machine), coef, dropped, minima


def main() -> None:
    from jaxserve.models.bert import BERT_CONFIGS, init_bert
    from jaxserve.polymorph import PolymorphTable
    from jaxserve.profiler import machine_description, save_cost_model
    from jaxserve.sched.base import Cell, ShapeGrid
    from jaxserve.servables import bert_servable, weights_of

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL, choices=["bert-base", "minilm-l6"])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--refit", action="store_true", help="only refit the saved raw samples")
    args = ap.parse_args()
    raw_path, fitted_path = paths(args.model)

    if not args.refit:
        cfg = BERT_CONFIGS[args.model]
        weights = weights_of(init_bert(cfg))
        tables, inputs = {}, {}
        for b, s in planned_cells():
            table = PolymorphTable(bert_servable(args.model, cfg, ShapeGrid((b,), (s,))))
            table.warmup()
            ids = np.full((b, s), 1000, np.int32)
            tables[(b, s)], inputs[(b, s)] = table, (ids, np.ones_like(ids))
            table.run(Cell(b, s), weights, *inputs[(b, s)])  # first call
        print(f"compiled {len(tables)} cells", flush=True)
        samples: dict[tuple[int, int], list[float]] = {c: [] for c in tables}
        rng = random.Random(0)
        for r in range(args.rounds):
            order = list(tables)
            rng.shuffle(order)
            t_round = time.perf_counter()
            for c in order:
                t0 = time.perf_counter()
                tables[c].run(Cell(*c), weights, *inputs[c])
                samples[c].append(time.perf_counter() - t0)
            print(f"round {r + 1}/{args.rounds}: {time.perf_counter() - t_round:.1f} s", flush=True)
            raw = {"model": args.model, "machine": f"{machine_description()}; XLA_FLAGS={os.environ['XLA_FLAGS']}",
                   "cells": [[b, s, samples[(b, s)]] for b, s in sorted(samples)]}
            PROFILES.mkdir(parents=True, exist_ok=True)
            raw_path.write_text(json.dumps(raw, indent=1))
    raw = json.loads(raw_path.read_text())
    cost, coef, dropped, minima = fitted_cost_model(raw)
    save_cost_model(fitted_path, cost)
    print(f"fit: {cost.machine.split('; fitted ')[-1]}; dropped {dropped}")
    for (b, s), t in sorted(minima.items()):
        f = cost.latency[args.model].seconds[Cell(b, s)]
        print(f"b{b} s{s:3d}: min {t * 1e3:8.1f} ms  fit {f * 1e3:8.1f} ms  ({t / f:.2f})")
    print(f"-> {fitted_path}")


if __name__ == "__main__":
    main()
