"""The simulator's model of requests of more than one step: stages, placement, transfers,
cascades that finish early, held requests that leave, and the contract around them.

Every expected time here is worked by hand from the profiles in the test."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxserve.sched.base import (Batch, Cell, CostModel, LatencyProfile, PlacementChange, Plan, ShapeGrid,
                                 Stage, StepSummary)
from jaxserve.sched.pipeline import PipelineBatching
from jaxserve.simulator import OUTCOMES, Transfer, simulate
from jaxserve.traces import make_trace
from support import SmallThenBig

INF = math.inf
S0, S1 = Stage("m", 0, 2, 4), Stage("m", 2, 4, 4)
GRID = {"m": ShapeGrid((1, 2))}
COST = CostModel({
    "m[0:2]": LatencyProfile("m[0:2]", {Cell(1): 1.0, Cell(2): 1.5}),
    "m[2:4]": LatencyProfile("m[2:4]", {Cell(1): 0.5, Cell(2): 0.8}),
})


def pipeline(**kw):
    return PipelineBatching({"m": (S0, S1)}, GRID, **kw)


def test_a_two_stage_pipeline_hand_computed_with_transfers():
    # r0 runs stage 0 on worker 0 (0 -> 1.0), moves to worker 1 (0.1 s hop + 1000 B at 10 kB/s
    # = 0.2 s) and runs stage 1 there (1.0 -> 1.7). r1 arrived while worker 0 was busy: 1.0 -> 2.0
    # on stage 0, then 2.0 -> 2.7 on stage 1.
    trace = make_trace([0.0, 0.0], model="m", slo_s=[INF, INF])
    transfer = Transfer(bandwidth=10_000, hop_latency=0.1, activation_bytes=lambda b: 1000.0)
    r = simulate(pipeline(), trace, COST, instances=2, transfer=transfer,
                 holdings={0: frozenset({S0}), 1: frozenset({S1})})
    assert [OUTCOMES[o] for o in r.outcome] == ["ok", "ok"]
    assert r.start.tolist() == [0.0, 1.0]
    assert r.finish.tolist() == pytest.approx([1.7, 2.7])
    assert r.batch_instance.tolist() == [0, 1, 0, 1]  # in start order; the deeper stage is planned first
    assert r.batch_start.tolist() == pytest.approx([0.0, 1.0, 1.0, 2.0])


def test_steps_on_the_same_worker_move_nothing():
    # one worker holding both stages: no hop, so r0 ends at 1.0 + 0.5
    trace = make_trace([0.0], model="m", slo_s=[INF])
    transfer = Transfer(bandwidth=1.0, hop_latency=5.0, activation_bytes=lambda b: 1e9)
    r = simulate(pipeline(), trace, COST, instances=1, transfer=transfer, holdings={0: frozenset({S0, S1})})
    assert r.finish.tolist() == [1.5]


def test_a_held_request_whose_client_leaves_is_withdrawn_between_steps():
    # r0's stage 0 ends at 1.0; worker 1 (stage 1) is busy with r1's... no: only one worker holds
    # stage 1 and it is loading for 5 s, so r0 is held at stage 1 when its client leaves at 2.0
    trace = make_trace([0.0], model="m", slo_s=[INF])

    class LoadFirst(PipelineBatching):
        started = False

        def plan(self, now, idle):
            if not self.started:
                self.started = True
                return Plan(placement=(PlacementChange("load", 1, S1),))
            return super().plan(now, idle)

    r = simulate(LoadFirst({"m": (S0, S1)}, GRID), trace, COST, instances=2, client_timeout=2.0,
                 holdings={0: frozenset({S0})}, load_time=lambda s: 5.0)
    assert OUTCOMES[r.outcome[0]] == "withdrawn" and r.finish[0] == 2.0


def test_a_cascade_finishes_confident_requests_early_and_sends_the_rest_on():
    cost = CostModel({"small": LatencyProfile("small", {Cell(1): 1.0}),
                      "big": LatencyProfile("big", {Cell(1): 3.0})})
    trace = make_trace([0.0, 10.0], model="small", slo_s=[INF, INF])
    policy = SmallThenBig(threshold=0.9)
    r = simulate(policy, trace, cost, instances=1,
                 summary_of=lambda rid, batch: StepSummary(0.95 if rid == 0 else 0.5, "x"))
    assert [OUTCOMES[o] for o in r.outcome] == ["ok", "ok"]
    assert r.finish.tolist() == [1.0, 14.0]  # r1: small 10 -> 11, big 11 -> 14
    assert policy.escalated == [1]
    assert r.batch_count.tolist() == [1, 1, 1]


def test_placement_changes_take_their_time_and_are_reported():
    events = []

    class Grow(PipelineBatching):
        planned = False

        def plan(self, now, idle):
            placement = ()
            if not self.planned:
                self.planned = True
                placement = (PlacementChange("add_worker", 1),)
            elif 1 in idle and S1 not in self._loaded:
                self._loaded.add(S1)
                placement = (PlacementChange("load", 1, S1),)
                idle = [w for w in idle if w != 1]
            p = super().plan(now, idle)
            return Plan(p.batches, p.evict, p.wake_at, placement=placement)

        def on_placement(self, change, ok, seconds, now):
            events.append((change.action, change.worker, seconds, now))

    policy = Grow({"m": (S0, S1)}, GRID)
    policy._loaded = set()
    trace = make_trace([0.0], model="m", slo_s=[INF])
    r = simulate(policy, trace, COST, instances=1, holdings={0: frozenset({S0})},
                 worker_start=2.0, load_time=lambda s: 0.25)
    # r0's stage 0 runs 0 -> 1.0 on worker 0, then waits for a holder of stage 1: worker 1 is
    # ready at 2.0 and loads stage 1 until 2.25, where r0's stage 1 runs (0.5 s, no transfer priced)
    assert events == [("add_worker", 1, 2.0, 2.0), ("load", 1, 0.25, 2.25)]
    assert r.finish.tolist() == [2.75]
    assert r.batch_instance.tolist() == [0, 1]


@pytest.mark.parametrize("bad, message", [
    (Plan(finish=(0,)), "not held"),
    (Plan(placement=(PlacementChange("remove_worker", 7),)), "unknown worker"),
])
def test_step_contract_violations_are_caught(bad, message):
    class Bad(PipelineBatching):
        def plan(self, now, idle):
            return bad

    with pytest.raises(RuntimeError, match=message):
        simulate(Bad({"m": (S0, S1)}, GRID), make_trace([0.0], model="m", slo_s=[1.0]), COST, instances=1)


def test_pipeline_conservation_under_load_every_request_one_outcome():
    rng = np.random.default_rng(3)
    arrivals = np.sort(rng.uniform(0, 60, 300))
    trace = make_trace(arrivals.tolist(), model="m", slo_s=[4.0] * len(arrivals))
    r = simulate(pipeline(max_queue=20), trace, COST, instances=3,
                 holdings={0: frozenset({S0}), 1: frozenset({S0}), 2: frozenset({S1})},
                 transfer=Transfer(1e6, 0.01, lambda b: 1e4), latency_noise=0.1, seed=1)
    counts = r.outcome_counts()
    assert sum(counts.values()) == len(arrivals)
    assert counts["ok"] > 0 and (counts["evicted"] + counts["rejected"] + counts["late"]) > 0
    done = r.completed()
    assert np.all(r.finish[done] >= r.start[done] + 1.5 - 1e-9)  # both stages ran, at least 1.0 + 0.5 each


def test_a_measured_transfer_profile_prices_a_hop(tmp_path):
    path = tmp_path / "ray-transfer.json"
    path.write_text('{"hop_latency_s": 0.004, "bytes_per_s": 2e9}')
    t = Transfer.from_profile(path, lambda b: b.cell.batch * 64 * 384 * 4.0)
    batch = Batch((0,), "m", Cell(8), 1, S1, final=True)
    assert t.seconds(batch) == pytest.approx(0.004 + 8 * 64 * 384 * 4 / 2e9)


def test_rows_split_over_two_workers_and_merged_move_only_the_rows_from_elsewhere():
    # AsyFunc's body-shadow split: r0 runs m[0:2] on worker 0 and r1 on worker 1 (both 0 -> 1.0),
    # then both merge on worker 0 for m[2:4] (cell 2: 0.8 s). Only r1 moves: 0.1 s hop + 1 row x 1000 B at 10 kB/s = 0.2 s.
    class Split(PipelineBatching):
        def plan(self, now, idle):
            if now == 0.0 and len(self._waiting.get((S0, 0), ())) < 2:
                return Plan()  # wait for the second arrival (same instant)
            if now == 0.0 and len(self._waiting[(S0, 0)]) == 2:
                r0, r1 = self._waiting[(S0, 0)]
                self._waiting[(S0, 0)].clear()
                for r in (r0, r1):
                    self._drop(r, S0)
                    self._requests[r.id] = r
                return Plan((Batch((0,), "m", Cell(1), 0, S0, final=False),
                             Batch((1,), "m", Cell(1), 1, S0, final=False)))
            if self._requests:  # merge: wait until both halves are done
                return Plan()
            return super().plan(now, [w for w in idle if w == 0])

    trace = make_trace([0.0, 0.0], model="m", slo_s=[INF, INF])
    rows_moved = []
    transfer = Transfer(bandwidth=10_000, hop_latency=0.1,
                        activation_bytes=lambda b: rows_moved.append(b.request_ids) or 1000.0 * b.cell.batch)
    r = simulate(Split({"m": (S0, S1)}, GRID), trace, COST, instances=2, transfer=transfer,
                 holdings={0: frozenset({S0, S1}), 1: frozenset({S0})})
    assert rows_moved == [(1,)]
    assert r.finish.tolist() == pytest.approx([2.0, 2.0])  # 1.0 + 0.2 + 0.8

