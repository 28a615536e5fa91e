"""DT's live emulation (jaxserve.launch.DynamicShapeEmulation) on a real tiny BERT executable:
the same answers, held for DT's modelled dynamic-shape time."""

from __future__ import annotations

import types

import numpy as np
import pytest

import jaxserve.launch as launch
from jaxserve.launch import DynamicShapeEmulation, engine_runtimes
from jaxserve.models.bert import BERT_CONFIGS, init_bert
from jaxserve.polymorph import PolymorphTable
from jaxserve.runtime import TextRuntime
from jaxserve.sched.base import Cell, CostModel, LatencyProfile, ShapeGrid
from jaxserve.sched.baselines import DynamicShapePolicy, StaticPaddingPolicy
from jaxserve.servables import bert_servable, weights_of

GRID = ShapeGrid(batch_sizes=(1, 2, 4), seq_buckets=(64, 128, 256))
# 1 ms + 10 us per token per row, profiled at every 32 tokens
PROFILE = LatencyProfile("bert", {Cell(b, s): b * (0.001 + 1e-5 * s) for b in (1, 2, 4) for s in range(32, 257, 32)})
COST = CostModel({"bert": PROFILE})
SLO = 0.1


class ScriptedClock:
    """Stands in for the ``time`` module DynamicShapeEmulation reads: ``perf_counter`` returns
    the scripted readings in turn, ``sleep`` records what it was asked to wait (and waits not)."""

    def __init__(self, *readings: float):
        self.readings, self.slept = list(readings), []

    def perf_counter(self) -> float:
        return self.readings.pop(0)

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def test_dynamic_shape_emulation_scales_the_measured_time_by_the_dt_factor(monkeypatch):
    """On a real (tiny) text runtime: the same answers, held for the factor times the measured
    time; and it is a text runtime, so the HTTP layer serves it as one. The hold is checked on an
    injected clock (the run 'measures' 0.1 s), not with a stopwatch."""
    cfg = BERT_CONFIGS["bert-tiny-test"]
    table = PolymorphTable(bert_servable("bert", cfg, ShapeGrid((2,), (64,))))
    table.warmup()
    plain = TextRuntime("bert", table, weights_of(init_bert(cfg)))
    payloads, cell = [[101] + [7] * 28 + [102], [101] + [9] * 48 + [102]], Cell(2, 64)  # 30 and 50 tokens
    expected = plain.execute(cell, payloads, ["", ""]).items
    seen = []
    rt = DynamicShapeEmulation.of(plain, lambda cell, count, length: seen.append((cell, count, length)) or 50.0)

    clock = ScriptedClock(100.0, 100.1)  # before and after the real run: 0.1 s measured
    monkeypatch.setattr(launch, "time", types.SimpleNamespace(perf_counter=clock.perf_counter, sleep=clock.sleep))
    out = rt.execute(cell, payloads, ["", ""])
    assert seen == [(cell, 2, 50)]  # asked for the factor of 2 rows whose longest has 50 tokens
    # held until 50 x 0.1 s = 5 s since the start: 4.9 s more, once; and it reports 5 s of compute
    assert clock.slept == [pytest.approx(4.9)] and clock.readings == []
    assert out.compute_seconds == pytest.approx(5.0)
    assert all(np.array_equal(o["embedding"], e["embedding"]) for o, e in zip(out.items, expected))
    # a factor below 1 holds nothing: the measured time stands
    short = DynamicShapeEmulation.of(plain, lambda cell, count, length: 0.5)
    clock = ScriptedClock(200.0, 200.1)
    monkeypatch.setattr(launch, "time", types.SimpleNamespace(perf_counter=clock.perf_counter, sleep=clock.sleep))
    out = short.execute(cell, payloads, ["", ""])
    assert clock.slept == [] and clock.readings == []
    assert all(np.array_equal(o["embedding"], e["embedding"]) for o, e in zip(out.items, expected))
    monkeypatch.undo()

    assert isinstance(rt, TextRuntime) and rt.table is plain.table and rt.heads == plain.heads
    dt = DynamicShapePolicy("bert", GRID, COST, SLO, 2, penalty=2.0)
    assert isinstance(engine_runtimes(dt, {"bert": plain})["bert"], DynamicShapeEmulation)
    st = StaticPaddingPolicy("bert", GRID, COST, SLO, 2)
    runtimes = {"bert": plain}
    assert engine_runtimes(st, runtimes) is runtimes  # only DT is paced


def test_live_factor_by_hand():
    """penalty x exact-length latency / the cell's latency, from PROFILE at batch 1 (both lengths
    are profiled buckets, so no interpolation): exact(1, 96) = 1 ms + 96 x 10 us = 1.96 ms, the
    cell 1x128 = 1 ms + 128 x 10 us = 2.28 ms; 2.0 x 1.96 / 2.28 = 3.92 / 2.28 = 1.71930."""
    policy = DynamicShapePolicy("bert", GRID, COST, SLO, 2, penalty=2.0)
    assert policy.live_factor(Cell(1, 128), 1, 96) == pytest.approx(1.7193, abs=1e-4)
