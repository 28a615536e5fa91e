"""DT's live emulation (jaxserve.launch.DynamicShapeEmulation) on a real tiny BERT executable:
the same answers, held for DT's modelled dynamic-shape time."""

from __future__ import annotations

import time

import numpy as np
import pytest

from jaxserve.launch import DynamicShapeEmulation, engine_runtimes
from jaxserve.models.bert import BERT_CONFIGS, init_bert
from jaxserve.polymorph import PolymorphTable
from jaxserve.runtime import TextRuntime
from jaxserve.sched.base import Cell, CostModel, LatencyProfile, ShapeGrid
from jaxserve.sched.baselines import DynamicShapePolicy, StaticPaddingPolicy, exact_length_latency
from jaxserve.servables import bert_servable, weights_of

GRID = ShapeGrid(batch_sizes=(1, 2, 4), seq_buckets=(64, 128, 256))
# 1 ms + 10 us per token per row, profiled at every 32 tokens
PROFILE = LatencyProfile("bert", {Cell(b, s): b * (0.001 + 1e-5 * s) for b in (1, 2, 4) for s in range(32, 257, 32)})
COST = CostModel({"bert": PROFILE})
SLO = 0.1


def test_dynamic_shape_emulation_scales_the_measured_time_by_the_dt_factor():
    """On a real (tiny) text runtime: the same answers, held for the factor times the measured
    time; and it is a text runtime, so the HTTP layer serves it as one."""
    cfg = BERT_CONFIGS["bert-tiny-test"]
    table = PolymorphTable(bert_servable("bert", cfg, ShapeGrid((2,), (64,))))
    table.warmup()
    plain = TextRuntime("bert", table, weights_of(init_bert(cfg)))
    payloads, cell = [[101] + [7] * 28 + [102], [101] + [9] * 48 + [102]], Cell(2, 64)  # 30 and 50 tokens
    fastest = min(plain.execute(cell, payloads, ["", ""]).compute_seconds for _ in range(5))
    seen = []
    rt = DynamicShapeEmulation.of(plain, lambda cell, count, length: seen.append((cell, count, length)) or 50.0)
    t0 = time.perf_counter()
    out = rt.execute(cell, payloads, ["", ""])
    wall = time.perf_counter() - t0
    assert seen == [(cell, 2, 50)]
    assert 10 * fastest < out.compute_seconds <= wall  # held for 50x its measured time (>= the fastest run)
    expected = plain.execute(cell, payloads, ["", ""]).items
    assert all(np.array_equal(o["embedding"], e["embedding"]) for o, e in zip(out.items, expected))
    assert isinstance(rt, TextRuntime) and rt.table is plain.table and rt.heads == plain.heads
    dt = DynamicShapePolicy("bert", GRID, COST, SLO, 2, penalty=2.0)
    assert isinstance(engine_runtimes(dt, {"bert": plain})["bert"], DynamicShapeEmulation)
    st = StaticPaddingPolicy("bert", GRID, COST, SLO, 2)
    runtimes = {"bert": plain}
    assert engine_runtimes(st, runtimes) is runtimes  # only DT is paced
    policy = DynamicShapePolicy("bert", GRID, COST, SLO, 2, penalty=2.0)
    assert policy.live_factor(Cell(1, 128), 1, 96) == pytest.approx(
        2.0 * exact_length_latency(PROFILE, 1, 96) / PROFILE.latency(Cell(1, 128)))
