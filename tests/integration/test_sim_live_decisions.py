"""The simulator and the live engine make the same batching decisions when they see the same times.

A burst-and-lull schedule of real texts (two sequence buckets) goes through the live engine (the
default deadline batching, two thread workers, real MiniLM executables); every batch's requests,
cell, worker and completion time are recorded. The same arrivals then go through the simulator
with a fresh policy of the same kind, each batch taking as long as it took live (it ends at the
live batch's completion stamp). The engine stamps arrivals and completions on its one event-loop
thread, so the order of events is the same in both; the decisions, made by the same policy code
on the same queue states, must then be the same batches on the same workers. A batch the engine
did not run has no live time: the simulator then fails with the batch named.

This tests the simulator's event semantics against the engine's (which requests are queued when
a worker frees, which worker takes the batch); its prices are bench/fidelity.py's concern."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from jaxserve.engine import Engine, Item
from jaxserve.launch import price_cells
from jaxserve.registry import load_text_runtime
from jaxserve.sched.base import ShapeGrid
from jaxserve.sched.batching import DeadlineBatching
from jaxserve.simulator import simulate
from jaxserve.traces import make_trace

GRID = ShapeGrid(batch_sizes=(1, 2, 4), seq_buckets=(16, 32))
SHORT = ["the flight was late again", "great service, thank you!", "lost my bag", "a quiet trip", "seat 12c"]
LONG = ["the crew was kind and the food was better than I expected for such a short flight, thank you",
        "boarding took forever because the gate changed twice and nobody told us anything at all, again"]


@pytest.fixture(scope="module")
def runtime():
    return load_text_runtime("minilm-l6", None, GRID, tune=False)


def schedule(seed: int) -> tuple[np.ndarray, list[str]]:
    """Bursts of 6-12 requests 1 ms apart, then a lull of 30-80 ms; short and long texts mixed."""
    rng = np.random.default_rng(seed)
    gaps, texts = [], []
    for _ in range(5):
        n = int(rng.integers(6, 13))
        gaps += [float(rng.uniform(0.03, 0.08))] + [0.001] * (n - 1)
        texts += [LONG[int(rng.integers(len(LONG)))] if rng.random() < 0.3 else SHORT[int(rng.integers(len(SHORT)))]
                  for _ in range(n)]
    return np.array(gaps), texts


class Recording(DeadlineBatching):
    """The policy as it is, remembering the time of its last plan (the simulator's dispatch time)."""

    now = 0.0

    def plan(self, now, idle_instances):
        self.now = now
        return super().plan(now, idle_instances)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_simulator_makes_the_engine_s_batches_on_the_engine_s_times(runtime, seed):
    cost = price_cells({runtime.name: runtime}, None, False)
    gaps, texts = schedule(seed)
    ids = runtime.tokenizer.encode(texts)
    ids = [x[:32] for x in ids]

    live: list[tuple[tuple[int, ...], str, int]] = []
    done: dict[tuple[int, ...], float] = {}
    arrival: dict[int, float] = {}

    async def run() -> None:
        engine = Engine({runtime.name: runtime}, DeadlineBatching({runtime.name: GRID}, cost, max_wait=0.0),
                        instances=2)

        def observe(batch, out, pendings, seconds):
            now = engine.clock()
            rows = tuple(batch.request_ids)
            live.append((rows, batch.cell.label(), batch.instance))
            done[rows] = now
            for p in pendings:
                arrival[p.request.id] = p.request.arrival

        engine.stats.observers.append(observe)
        futures = []
        for gap, x in zip(gaps, ids):
            await asyncio.sleep(gap)
            futures += engine.submit([Item(runtime.name, x, len(x))])
        answers = await asyncio.gather(*futures)
        assert [a.outcome for a in answers] == ["ok"] * len(ids)
        engine.close()

    asyncio.run(run())
    assert sorted(arrival) == list(range(len(ids)))  # every request ran once, ids in submission order
    assert len(live) < len(ids)  # the bursts were batched, so there were decisions to make
    t0 = min(arrival.values())
    trace = make_trace(np.array([arrival[i] - t0 for i in range(len(ids))]), model=runtime.name,
                       length=[len(x) for x in ids], slo_s=math.inf)
    policy = Recording({runtime.name: GRID}, cost, max_wait=0.0)
    simulated: list[tuple[tuple[int, ...], str, int]] = []

    def service_time(batch) -> float:
        rows = tuple(batch.request_ids)
        assert rows in done, f"the simulator batched {rows} in {batch.cell.label()}, which the engine did not"
        simulated.append((rows, batch.cell.label(), batch.instance))
        return done[rows] - t0 - policy.now  # it ends when the live batch ended

    result = simulate(policy, trace, cost, instances=2, service_time=service_time)
    assert result.outcome_counts()["ok"] == len(ids)
    assert sorted(simulated) == sorted(live)


def test_pricing_a_served_model_keeps_the_other_models_prices_in_the_cache_s_cost_model(runtime, tmp_path):
    """Servers of different models share one cache's cost_model.json: a start that must profile
    its model adds that model's prices and keeps the others' (it used to write only its own,
    so the next server of another model re-profiled, and erased these in turn); a start whose
    model is priced re-profiles nothing; one with a cell unpriced re-profiles that model."""
    from jaxserve.profiler import load_cost_model, save_cost_model
    from jaxserve.sched.base import Cell, CostModel, LatencyProfile

    path = tmp_path / "cost_model.json"
    other = LatencyProfile("dinov2-s14", {Cell(1, 0, 0): 0.07, Cell(8, 0, -21): 0.28})
    save_cost_model(path, CostModel(latency={"dinov2-s14": other}, machine="elsewhere"))
    first = price_cells({runtime.name: runtime}, path, False)
    saved = load_cost_model(path)
    assert set(saved.latency) == {"dinov2-s14", runtime.name} == set(first.latency)
    assert dict(saved.latency["dinov2-s14"].seconds) == dict(other.seconds)
    assert set(saved.latency[runtime.name].seconds) == set(runtime.grid.cells())
    again = price_cells({runtime.name: runtime}, path, False)  # priced: nothing measured, nothing written
    assert dict(again.latency[runtime.name].seconds) == dict(saved.latency[runtime.name].seconds)
    partial = dict(saved.latency[runtime.name].seconds)
    dropped = next(iter(partial))
    del partial[dropped]
    save_cost_model(path, CostModel(latency={**saved.latency, runtime.name: LatencyProfile(runtime.name, partial)}))
    price_cells({runtime.name: runtime}, path, False)
    redone = load_cost_model(path)
    assert dropped in redone.latency[runtime.name].seconds and "dinov2-s14" in redone.latency
