"""OTAS cost model of a ViT: latency per (gamma, batch) and accuracy per (task, gamma).

    nice -n 10 python -m bench.otas_profile [--model vit-demo|dinov2-s14] [--rounds N] [--write]

Latency: every cell of the grid (batch 1..32 x the demo's OTAS gammas) through the serving
runtime (``ImageRuntime.prepare_inputs`` + the AOT executable: normalisation, per-sample prompt
and head gathering included), timed round-robin (one call per cell per round, so the shared
machine's load drifts over all cells alike), minimum over rounds (interference from the other
jobs on the shared cores only adds time). Accuracy: the profiling-split
profile written by ``jaxserve train-prompts`` (jaxserve/assets/vit-demo-prompts/accuracy.json).
Together they are the policy's cost model, saved to ``bench/otas_cost_vit-demo.json`` (read by
bench/otas_utility.py), with the Alg. 3 load map f(q) derived from it (the paper's Table I).

``--model dinov2-s14`` (section ``otas-cost-model-dinov2-s14``): the same for DINOv2 ViT-S/14 over
batch 1, 2, 4, 8 (bench/otas_live.py's grid; batch 8 takes over half a second here) and its OTAS
gammas, with the accuracy of its probes and prompts (jaxserve/assets/dinov2-s14-prompts/
accuracy.json), saved to ``bench/otas_cost_dinov2-s14.json`` (what otas_utility --model dinov2-s14
simulates with).
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations;
# read by bench.all, bench.status and bench.headline without importing this module).
MEASURES = (
    "bench/otas_profile.py", "jaxserve/sched/otas.py", "jaxserve/profiler.py", "jaxserve/prompts.py",
    "jaxserve/assets/vit-demo-prompts", "jaxserve/assets/dinov2-s14-prompts",
    "jaxserve/models", "jaxserve/kernels", "jaxserve/polymorph.py", "jaxserve/servables.py",
    "jaxserve/compile_cache.py", "jaxserve/runtime.py",
)
SECTIONS = {"otas-cost-model": "--write", "otas-cost-model-dinov2-s14": "--model dinov2-s14 --write"}
PRODUCES = ("bench/otas_cost_vit-demo.json", "bench/otas_cost_dinov2-s14.json")  # the OTAS policies' cost models

import argparse
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench.common import add_quick, apply_quick, output, record, table

COST_PATHS = {m: Path(__file__).parent / f"otas_cost_{m}.json" for m in ("vit-demo", "dinov2-s14")}
COST_PATH = COST_PATHS["vit-demo"]
BATCHES = {"vit-demo": (1, 2, 4, 8, 16, 32), "dinov2-s14": (1, 2, 4, 8)}
ROUNDS = {"vit-demo": 41, "dinov2-s14": 9}
SECTION_KEYS = {"vit-demo": "otas-cost-model", "dinov2-s14": "otas-cost-model-dinov2-s14"}


def measure(rounds: int, cache_dir: str | None, batches=BATCHES["vit-demo"], progress: bool = True,
            model: str = "vit-demo"):
    from jaxserve.compile_cache import CompileCache
    from jaxserve.profiler import machine_description
    from jaxserve.registry import OTAS_GAMMAS, load_image_runtime
    from jaxserve.sched.base import CostModel, LatencyProfile, ShapeGrid

    cache = CompileCache(cache_dir) if cache_dir else None
    grid = ShapeGrid(tuple(batches), gammas=OTAS_GAMMAS[model])
    rt = load_image_runtime(model, cache, grid, progress=progress)
    rng = np.random.default_rng(0)
    tasks = list(rt.prompts.tasks)
    jobs = []
    for cell in grid.cells():
        images = list(rng.random((cell.batch, *rt.image_shape), dtype=np.float32))
        mixed = [tasks[i % len(tasks)] for i in range(cell.batch)]
        rt.execute(cell, images, mixed)  # warm call
        jobs.append((cell, images, mixed))
    samples = {cell: [] for cell, _, _ in jobs}
    for _ in tqdm(range(rounds), desc=f"{model}: round-robin rounds", disable=not progress):
        for cell, images, mixed in jobs:
            samples[cell].append(rt.execute(cell, images, mixed).compute_seconds)
    # The minimum over rounds: the 2 cores are shared with other jobs, whose interference only
    # ever adds time; a median still let single busy seconds reorder neighbouring cells.
    latency = LatencyProfile(model, {c: float(np.min(s)) for c, s in samples.items()})
    cost = CostModel(latency={model: latency}, accuracy={model: rt.accuracy}, machine=machine_description())
    return cost, grid


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit-demo", choices=tuple(COST_PATHS))
    p.add_argument("--rounds", type=int, default=None, help="default 41 (vit-demo), 9 (dinov2-s14)")
    p.add_argument("--cache-dir", default="compiled_cache")
    p.add_argument("--out", default=None, help="default bench/otas_cost_<model>.json")
    p.add_argument("--write", action="store_true")
    add_quick(p, rounds=1)
    args = apply_quick(p.parse_args())
    model = args.model
    args.rounds = args.rounds or ROUNDS[model]
    args.out = args.out or str(output(COST_PATHS[model]))  # a quick run: the scratch directory
    from jaxserve.profiler import save_cost_model
    from jaxserve.sched.otas import LoadToGamma

    batches = BATCHES[model]
    batches = (batches[0], batches[-1]) if args.quick else batches  # quick: the smallest and largest batch
    cost, grid = measure(args.rounds, args.cache_dir, batches, model=model)
    save_cost_model(args.out, cost)
    lat = cost.latency[model]
    acc = cost.accuracy[model]
    rows = []
    for g in grid.gammas:
        rows.append([f"{g:+d}"] + [f"{lat.latency(c) * 1e3:.2f}" for c in grid.cells() if c.gamma == g]
                    + [f"{grid.max_batch / lat.latency_for(grid.max_batch, 0, g):.0f}"])
    body = "Latency (ms) per executable, by gamma (rows) and batch size (columns):\n\n" + table(
        ["gamma"] + [f"b{b}" for b in grid.batch_sizes] + [f"img/s at b{grid.max_batch}"], rows)
    tasks = sorted({t for t, _ in acc.accuracy})
    body += "\n\nAccuracy on the held-out profiling split, by task and gamma:\n\n" + table(
        ["task"] + [f"{g:+d}" for g in grid.gammas],
        [[t] + [f"{acc.of(t, g):.3f}" for g in grid.gammas] for t in tasks])
    f = LoadToGamma.from_profile(lat, acc, grid, grid.gammas, headroom=0.8)
    body += "\n\nAlg. 3's f(q) derived from this profile (headroom 0.8; the paper's Table I analogue):\n\n" + table(
        ["arrival rate up to (req/s)", "gamma"], [[f"{cut:.0f}", f"{g:+d}"] for cut, g in f.table()])
    top = grid.max_batch
    fast = lat.latency_for(top, 0, 0) / lat.latency_for(top, 0, min(grid.gammas))
    slow = lat.latency_for(top, 0, max(grid.gammas)) / lat.latency_for(top, 0, 0)
    notes = (f"Written to `{Path(args.out).name}`. Each latency is the minimum of {args.rounds} round-robin rounds "
             "through the serving runtime on mixed-task batches (prompt/head gathering included): the 2 cores are "
             "shared with other jobs, whose interference only adds time (a median let single busy seconds reorder "
             "neighbouring cells). "
             f"At batch {grid.max_batch}, gamma {min(grid.gammas):+d} runs {fast:.2f}x as fast as gamma 0 and gamma "
             f"{max(grid.gammas):+d} takes {slow:.2f}x as long"
             + (": on this 17-token, 4-layer model ToMe saves little (the matching's sort/gather overhead is a "
                "large share of so small a network; small batches are overhead-bound and noisy), so the demo's "
                "token-adaptation range is narrower than ViT-B's (section otas-throughput-vit-b16: 2.4x at gamma -20)."
                if model == "vit-demo" else "."))
    if args.write:
        label = "the demo ViT's" if model == "vit-demo" else f"{model}'s"
        record(SECTION_KEYS[model], f"OTAS: {label} cost model (latency per (gamma, batch), accuracy per (task, gamma))",
               body, notes)
    print(body)
    print(notes)


if __name__ == "__main__":
    main()
