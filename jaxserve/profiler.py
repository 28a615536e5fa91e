"""Measure what the machine at hand does: the latency staircase and per-cell latency.

Arlo §3.3 found 64-token steps on a GPU (TensorRT tiles). A CPU has no tiles: XLA:CPU
latency grows roughly linearly with length, with small plateaus where the vector and
cache blocking line up. So buckets are not read off "steps"; they are chosen where
padding costs little: :func:`buckets_from_latencies` starts a bucket at the shortest
unserved length and extends it while the padded cost stays within ``tolerance`` of the
cost at that shortest length. On a true staircase this lands exactly on the step edges
(flat latency is free padding); on a ramp it gives geometric buckets.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from jaxserve.sched.base import Cell, CostModel, LatencyProfile


def buckets_from_latencies(
    lengths: Sequence[int], seconds: Sequence[float], tolerance: float = 0.25, max_buckets: int = 12
) -> tuple[int, ...]:
    """Bucket boundaries from a measured latency curve t(length).

    A bucket [lo, hi] is valid when t(hi) <= (1 + tolerance) * t(lo): no input in it
    pays more than ``tolerance`` over its exact-length cost. The largest length is
    always a bucket so the grid covers the model's range. If more than ``max_buckets``
    come out, the tolerance is widened until they fit (each bucket costs a compile per
    batch size at warmup).
    """
    order = np.argsort(lengths)
    L = [int(lengths[i]) for i in order]
    t = [float(seconds[i]) for i in order]
    # enforce monotone cost (measurement noise must not create phantom buckets)
    t = list(np.maximum.accumulate(t))
    tol = tolerance
    while True:
        buckets: list[int] = []
        i = 0
        while i < len(L):
            j = i
            while j + 1 < len(L) and t[j + 1] <= (1.0 + tol) * t[i]:
                j += 1
            buckets.append(L[j])
            i = j + 1
        if len(buckets) <= max_buckets:
            return tuple(buckets)
        tol *= 1.5


def time_call(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def profile_table(table, weights, make_inputs: Callable[[Cell], tuple], repeats: int = 5,
                  progress: bool = False) -> LatencyProfile:
    """Latency of every warmed cell of a polymorph table, on this machine."""
    cells = table.servable.grid.cells()
    it = cells
    if progress:
        from tqdm import tqdm

        it = tqdm(cells, desc=f"profile {table.servable.name}", unit="cell")
    seconds = {}
    for cell in it:
        inputs = make_inputs(cell)
        seconds[cell] = time_call(lambda: table.run(cell, weights, *inputs), repeats=repeats)
    return LatencyProfile(table.servable.name, seconds)


def machine_description() -> str:
    import os

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def save_cost_model(path: str | Path, cost: CostModel) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(cost.to_json())


def load_cost_model(path: str | Path) -> CostModel:
    return CostModel.from_json(Path(path).read_text())


def save_staircase(path: str | Path, model: str, batch: int, lengths, seconds, buckets) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({
        "model": model, "batch": batch, "machine": machine_description(),
        "lengths": [int(x) for x in lengths], "seconds": [float(x) for x in seconds],
        "buckets": [int(b) for b in buckets],
    }, indent=1))
