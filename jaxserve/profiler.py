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
import os
import platform
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from tqdm import tqdm

from jaxserve.compile_cache import write_owner_only
from jaxserve.polymorph import raise_if_stopped
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


def buckets_for_distribution(
    lengths: Sequence[int], seconds: Sequence[float], observed: Sequence[int], num_buckets: int = 8,
    max_length: int | None = None, max_ratio: float = 2.0,
) -> tuple[int, ...]:
    """The ``num_buckets`` boundaries that minimise the expected padded latency of the
    ``observed`` input lengths, given the measured curve t(length) — an exact DP.

    Where inputs are many and short (tweets: median ~27 tokens) a tolerance rule wastes
    buckets on lengths nobody sends; weighting by the real distribution puts the fine
    steps where the traffic is. Candidate boundaries are the measured lengths; the
    largest (``max_length``, default the largest measured) is always a boundary so the
    grid covers every input the model accepts. ``max_ratio`` bounds each bucket to at
    most that multiple of the one below it, so traffic unlike the observed sample (long
    documents instead of tweets) never pays more than ~2x padding.
    """
    order = np.argsort(lengths)
    L = np.array([int(lengths[i]) for i in order])
    t = np.maximum.accumulate(np.array([float(seconds[i]) for i in order]))
    top = int(max_length or L[-1])
    L, t = L[L <= top], t[L <= top]
    if L[-1] != top:
        raise ValueError(f"max_length {top} was not measured")
    obs = np.clip(np.asarray(observed, dtype=np.int64), 1, top)
    # weight[j]: how many observed inputs have the smallest candidate >= them at index j
    idx = np.searchsorted(L, obs, side="left")
    weight = np.bincount(idx, minlength=len(L)).astype(float)
    n = len(L)
    k_max = min(num_buckets, n)
    INF = float("inf")
    # cost[j][k]: best cost of covering candidates 0..j with k buckets, the last ending at j
    cost = np.full((n, k_max + 1), INF)
    back = np.full((n, k_max + 1), -1, dtype=int)
    prefix = np.concatenate([[0.0], np.cumsum(weight)])
    for j in range(n):
        cost[j, 1] = prefix[j + 1] * t[j]
        for k in range(2, k_max + 1):
            for i in range(k - 2, j):
                if L[j] > max_ratio * L[i]:
                    continue
                c = cost[i, k - 1] + (prefix[j + 1] - prefix[i + 1]) * t[j]
                if c < cost[j, k]:
                    cost[j, k], back[j, k] = c, i
    k_best = int(np.argmin(cost[n - 1, 1:])) + 1
    out, j, k = [], n - 1, k_best
    while j >= 0 and k >= 1:
        out.append(int(L[j]))
        j, k = back[j, k], k - 1
    return tuple(sorted(out))


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
                  progress: bool = False, stop: Callable[[], bool] | None = None) -> LatencyProfile:
    """Latency of every warmed cell of a polymorph table, on this machine (``stop``: as
    ``PolymorphTable.warmup``'s)."""
    cells = table.servable.grid.cells()
    it = cells
    if progress:
        it = tqdm(cells, desc=f"profile {table.servable.name}", unit="cell")
    seconds = {}
    for cell in it:
        raise_if_stopped(stop)
        inputs = make_inputs(cell)
        seconds[cell] = time_call(lambda: table.run(cell, weights, *inputs), repeats=repeats)
    return LatencyProfile(table.servable.name, seconds)


def machine_description() -> str:
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
    """Write ``cost`` to ``path`` as the cache writes its files: owner-only (0600; the default
    path is in the cache directory) and atomically (a server reading it meanwhile sees the
    old model or the new one, never half of one)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_owner_only(Path(path), cost.to_json().encode())


def load_cost_model(path: str | Path) -> CostModel:
    """The cost model saved at ``path``; ValueError naming the file if it is not one."""
    text = Path(path).read_text()
    try:
        return CostModel.from_json(text)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path} is not a jaxserve cost model ({type(exc).__name__}: {exc}); "
                         "write one with jaxserve profile") from None


def save_staircase(path: str | Path, model: str, batch: int, lengths, seconds, buckets) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({
        "model": model, "batch": batch, "machine": machine_description(),
        "lengths": [int(x) for x in lengths], "seconds": [float(x) for x in seconds],
        "buckets": [int(b) for b in buckets],
    }, indent=1))
