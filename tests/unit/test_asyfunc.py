"""AsyFunc's policy (jaxserve/sched/asyfunc.py): MLS, LLS, adaptive scheduling, the body-shadow
split as multi-step requests, and the resource ledger, on a hand-made 4-layer model whose
block [1:3) is shadowed (so a split runs all three steps: [0:1), [1:3) twice, [3:4))."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxserve.sched.asyfunc import (AsyFuncKnobs, AsyFuncModel, AsyFuncPolicy, BodySpec, ResourceLedger, SplitOption,
                                    initial_bodies)
from jaxserve.sched.base import Cell, CostModel, LatencyProfile, Request, ShapeGrid, Stage
from jaxserve.simulator import OUTCOMES, Transfer, simulate
from jaxserve.traces import make_trace

WHOLE, PRE, BLOCK, POST = (Stage("m", 0, 4, 4), Stage("m", 0, 1, 4), Stage("m", 1, 3, 4), Stage("m", 3, 4, 4))
TWO_CORES = {"m": (0.10, 0.16, 0.28), "m[0:1]": (0.02, 0.03, 0.05), "m[1:3]": (0.06, 0.10, 0.18),
             "m[3:4]": (0.02, 0.03, 0.05)}


def costs(factor: float) -> CostModel:
    return CostModel({name: LatencyProfile(name, {Cell(b): t * factor for b, t in zip((1, 2, 4), ts)})
                      for name, ts in TWO_CORES.items()})


SPLIT = SplitOption(BLOCK, bytes=40, load_s=0.01)


def model(**kw) -> AsyFuncModel:
    args = dict(name="m", num_layers=4, grid=ShapeGrid((1, 2, 4)), seq=0, latency={1: costs(1.8), 2: costs(1.0)},
                body_bytes=100, body_load_s=5.0, splits=(SPLIT,), row_bytes=1000.0, transfer_hop_s=0.001,
                transfer_bytes_per_s=1e6)
    args.update(kw)
    return AsyFuncModel(**args)


def knobs(**kw) -> AsyFuncKnobs:
    return AsyFuncKnobs(**{"slo_s": 0.5, "period_s": 10.0, "nodes": 4, "node_cores": 4, **kw})


def sim_transfer(m: AsyFuncModel) -> Transfer:
    return Transfer(m.transfer_bytes_per_s, m.transfer_hop_s, lambda b: len(b.request_ids) * m.row_bytes)


def holdings(policy: AsyFuncPolicy) -> dict:
    return {x.id: frozenset(policy.model.body_stages()) for x in policy.bodies()}


def test_the_split_latency_is_the_three_steps_with_transfers_both_ways():
    m = model()
    # b = 4 split 2 / 2, body and shadow at 2 cores: pre(4) 0.05 + max(blk(2) 0.10, x(2) + blk(2) 0.10)
    # + x(2) + post(4) 0.05, with x(2) = 0.001 + 2000 / 1e6 = 0.003
    assert m.split_seconds(SPLIT, 2, 2, 4, 2) == pytest.approx(0.05 + 0.103 + 0.003 + 0.05)
    b_body, t = m.best_split(SPLIT, 2, 1, 4)  # a 1-core shadow is slower: the body keeps more rows
    assert b_body == 2 or b_body == 3
    assert t == pytest.approx(m.split_seconds(SPLIT, 2, 1, 4, b_body))
    assert m.body_stages() == (WHOLE, PRE, BLOCK, POST)


def test_a_block_at_either_end_has_no_step_before_or_after_it():
    """A block [0:j) has no pre step and one [i:L) no post step: nothing is priced for them (not
    the whole model, which is what ``seconds`` prices for the stage None), and the shadow's rows
    make one transfer, not two."""
    first, last = Stage("m", 0, 3, 4), Stage("m", 1, 4, 4)
    lat = {"m": (0.10, 0.16, 0.28), "m[0:3]": (0.07, 0.12, 0.22), "m[3:4]": (0.03, 0.04, 0.06),
           "m[1:4]": (0.08, 0.13, 0.23), "m[0:1]": (0.02, 0.03, 0.05)}
    cost = CostModel({n: LatencyProfile(n, {Cell(b): t for b, t in zip((1, 2, 4), ts)}) for n, ts in lat.items()})
    m = model(latency={2: cost}, splits=(SplitOption(first, 40, 0.01), SplitOption(last, 40, 0.01)))
    x2 = 0.001 + 2000 / 1e6
    # first: max(blk(2) 0.12, blk(2) 0.12) + x(2) back + post(4) 0.06; last: pre(4) 0.05 + x(2) + blk(2)
    assert m.split_seconds(m.splits[0], 2, 2, 4, 2) == pytest.approx(0.12 + x2 + 0.06)
    assert m.split_seconds(m.splits[1], 2, 2, 4, 2) == pytest.approx(0.05 + x2 + 0.13)


def test_mls_provisions_only_configurations_that_meet_the_slo():
    # at 1 core even one row takes 0.18 s > the 0.15 s SLO: every body gets 2 cores
    k = knobs(slo_s=0.15)
    bodies = initial_bodies(model(), k, rate=30.0)
    assert bodies and all(b.cores == 2 for b in bodies)
    policy = AsyFuncPolicy(model(), k, bodies)
    # 2 cores meet 0.15 s at b = 1 only (b = 2 takes 0.16 s): 10 rps a body
    assert policy._max_rps[2] == pytest.approx(10.0) and policy._max_rps[1] == 0.0
    assert policy.r_max() * k.alpha >= 30.0 > (policy.r_max() - 10.0) * k.alpha
    # loose SLO, b = 4 everywhere: eta = 4/(c t) + 4/t is 21.4 at 2 cores (t 0.28) against 15.9 at
    # 1 core (t 0.504, cores scale well) ...
    assert {b.cores for b in initial_bodies(model(), knobs(slo_s=2.0), rate=30.0)} == {2}
    # ... and 23.8 at 1 core when a second core buys little (t 0.336): then 1-core bodies
    poor = model(latency={1: costs(1.2), 2: costs(1.0)})
    assert {b.cores for b in initial_bodies(poor, knobs(slo_s=2.0), rate=30.0)} == {1}


def _period(policy: AsyFuncPolicy, start: float, rps: float, next_id: int) -> int:
    n = int(rps * policy.knobs.period_s)
    for i in range(n):
        t = start + i * policy.knobs.period_s / n
        policy.on_arrival(Request(next_id + i, t, "m", deadline=t + 100.0), t)
    policy._queue.clear()  # what a period's arrivals leave behind is not the point here
    return next_id + n


def test_mls_scales_out_above_alpha_in_below_beta_and_holds_between():
    k = knobs(slo_s=2.0, nodes=8)
    policy = AsyFuncPolicy(model(), k, initial_bodies(model(), k, rate=20.0))
    r_max = policy.r_max()
    rid = 0
    for period, share in enumerate((0.7, 0.62, 0.78)):  # inside [beta, alpha] * R_max: nothing changes
        rid = _period(policy, period * 10.0, share * r_max, rid)
        policy.plan((period + 1) * 10.0, [])
    assert [d for d in policy.decisions if d[0] > 0] == []
    rid = _period(policy, 30.0, 1.5 * r_max, rid)  # above alpha: out, until R <= alpha * R_max
    policy.plan(40.0, [])
    added = [d for d in policy.decisions if d[1] == "add_body" and d[0] == 40.0]
    assert added and 1.5 * r_max <= k.alpha * policy.r_max()
    bodies_then = len(policy.bodies())
    _period(policy, 40.0, 0.1 * r_max, rid)  # below beta: in (only loaded bodies can go)
    policy.plan(50.0, [])
    assert len(policy.bodies()) < bodies_then
    assert any(d[1] == "remove_body" for d in policy.decisions)


FAST_SHADOW = {1: costs(1.2), 2: costs(1.0)}  # a second core buys little: a 1-core shadow pays off


def test_a_shadow_is_only_provisioned_where_the_pair_raises_the_body_s_rate():
    # with 1-core times 1.8x the 2-core ones, a 2-core body alone does 4 / 0.28 = 14.3 rps and
    # paired with a 1-core shadow at best 4 / 0.286: no shadow, however long the queue
    policy = AsyFuncPolicy(model(), knobs(slo_s=1.0), (BodySpec(0, 0, 2),))
    for rid in range(6):
        policy.on_arrival(Request(rid, 0.0, "m", deadline=1.0), 0.0)
    policy.plan(0.0, [])
    assert policy.shadows() == []
    policy = AsyFuncPolicy(model(latency=FAST_SHADOW), knobs(slo_s=1.0), (BodySpec(0, 0, 2),))
    for rid in range(6):
        policy.on_arrival(Request(rid, 0.0, "m", deadline=1.0), 0.0)
    policy.plan(0.0, [])
    assert len(policy.shadows()) == 1  # 4 / 0.226 = 17.7 rps paired


def test_a_burst_pairs_shadows_with_the_bodies_that_become_idle_earliest():
    k = knobs(kappa=1, gamma=3, slo_s=1.0)
    policy = AsyFuncPolicy(model(latency=FAST_SHADOW), k, (BodySpec(0, 0, 2), BodySpec(1, 1, 2), BodySpec(2, 2, 2)))
    # r0 and r1 together on body 0 (busy until 0.16), then r2 alone on body 1 (0.01 -> 0.11) and r3
    # on body 2 (0.02 -> 0.12): each dispatched at once to the smallest idle body (Alg. 3)
    for rid in (0, 1):
        policy.on_arrival(Request(rid, 0.0, "m", deadline=1.0), 0.0)
    assert [(b.instance, b.request_ids) for b in policy.plan(0.0, [0, 1, 2]).batches] == [(0, (0, 1))]
    for rid, t in ((2, 0.01), (3, 0.02)):
        policy.on_arrival(Request(rid, t, "m", deadline=t + 1.0), t)
        plan = policy.plan(t, [w for w in (1, 2) if w >= rid - 1])
        assert [(b.instance, b.request_ids) for b in plan.batches] == [(rid - 1, (rid,))]
    assert policy.shadows() == []  # the queue never reached gamma
    for rid in (4, 5, 6):  # a queue of gamma = 3 with every body busy
        policy.on_arrival(Request(rid, 0.03, "m", deadline=1.03), 0.03)
    plan = policy.plan(0.03, [])
    shadows = policy.shadows()
    assert len(shadows) == 1  # kappa
    assert shadows[0].partner == 1 and shadows[0].node == 1  # the earliest idle body, on its node
    assert shadows[0].cores == 1  # min(free 2, c_max // 2)
    assert [(c.action, c.worker) for c in plan.placement] == [("add_worker", shadows[0].id)]
    plan = policy.plan(0.03, [shadows[0].id])  # the worker is up: it loads the block only
    assert [(c.action, c.worker, c.stage) for c in plan.placement] == [("load", shadows[0].id, BLOCK)]


def test_split_batches_answer_every_row_exactly_once_and_shadows_go_after_the_burst():
    m = model(latency=FAST_SHADOW)
    k = knobs(slo_s=1.0, shadow_idle_s=0.5)
    steps: dict[int, list] = {}

    class Recording(AsyFuncPolicy):
        def on_completion(self, batch, now, summaries=None):
            for r in batch.request_ids:
                steps.setdefault(r, []).append((batch.stage, batch.instance, batch.final))
            super().on_completion(batch, now, summaries)

    policy = Recording(m, k, (BodySpec(0, 0, 2), BodySpec(1, 1, 2)))
    rng = np.random.default_rng(0)
    calm = np.sort(rng.uniform(0, 10, 20))
    burst = np.sort(rng.uniform(10, 12, 60))  # 30 rps against ~2 x 14 rps of bodies
    after = np.sort(rng.uniform(12, 20, 10))
    arrivals = np.concatenate([calm, burst, after])
    trace = make_trace(arrivals.tolist(), model="m", slo_s=[1.0] * len(arrivals))
    r = simulate(policy, trace, m.latency[2], instances=2, holdings=holdings(policy), transfer=sim_transfer(m),
                 load_time=lambda s: SPLIT.load_s if s == BLOCK else 0.0)
    counts = r.outcome_counts()
    assert sum(counts.values()) == len(arrivals) and counts["rejected"] == 0
    assert policy.splits_done > 0
    for rid in range(len(arrivals)):
        if OUTCOMES[r.outcome[rid]] in ("ok", "late"):
            assert sum(final for _, _, final in steps[rid]) == 1  # answered once
        if len(steps.get(rid, ())) > 1:  # a split row: pre on its body, the block somewhere, post on the body
            (s0, w0, _), (s1, w1, _), (s2, w2, f2) = steps[rid]
            assert (s0, s1, s2) == (PRE, BLOCK, POST) and w0 == w2 and f2
    shadow_rows = {rid for rid, st in steps.items() if len(st) == 3 and st[1][1] != st[0][1]}
    assert shadow_rows  # some rows really ran on a shadow
    assert any(d[1] == "add_shadow" for d in policy.decisions)
    assert policy.shadows() == [] and policy.ledger.held("shadow") == (0, 0)  # released after the burst
    released = max(d[0] for d in policy.decisions if d[1] == "remove_shadow")
    assert 12.0 < released < 30.0


def test_asyfunc_minus_never_scales_shadows_and_batch_waits_for_a_full_buffer():
    m = model()
    for variant in ("asyfunc-nolls", "asyfunc-batch"):
        policy = AsyFuncPolicy(m, knobs(slo_s=1.0), (BodySpec(0, 0, 2),), variant=variant)
        arrivals = np.linspace(0, 5, 60).tolist()
        r = simulate(policy, make_trace(arrivals, model="m", slo_s=[1.0] * 60), m.latency[2], instances=1,
                     holdings=holdings(policy))
        assert policy.shadows() == [] and policy.splits_done == 0
        assert sum(r.outcome_counts().values()) == 60
    # BATCH: a lone request waits slo - t(c_max, b_max) = 1.0 - 0.28 for company
    policy = AsyFuncPolicy(m, knobs(slo_s=1.0), (BodySpec(0, 0, 2),), variant="asyfunc-batch")
    policy.on_arrival(Request(0, 0.0, "m", deadline=1.0), 0.0)
    plan = policy.plan(0.0, [0])
    assert plan.batches == () and plan.wake_at == pytest.approx(0.72)
    assert len(policy.plan(0.72, [0]).batches) == 1


def test_the_ledger_sums_cores_and_bytes_over_time():
    ledger = ResourceLedger()
    ledger.add(0.0, 0, "body", 2, 100)
    ledger.add(5.0, 1, "shadow", 1, 40)
    ledger.remove(7.0, 1)
    ledger.add(8.0, 2, "body", 1, 100)
    assert ledger.held() == (3, 200) and ledger.held("shadow") == (0, 0)
    core_s, byte_s = ledger.usage(0.0, 10.0)
    assert core_s == pytest.approx(2 * 10 + 1 * 2 + 1 * 2)
    assert byte_s == pytest.approx(100 * 10 + 40 * 2 + 100 * 2)
    assert ledger.usage(0.0, 10.0, "shadow") == pytest.approx((2.0, 80.0))
    periods = ledger.periods(5.0, 10.0)
    assert [p[1] for p in periods] == pytest.approx([2.0, (2 * 5 + 2 + 2) / 5])
    assert sum(p[1] * 5.0 for p in periods) == pytest.approx(core_s)


def test_the_policy_ledger_matches_its_instances_and_the_nodes():
    m = model()
    k = knobs(slo_s=1.0, shadow_idle_s=0.5)
    policy = AsyFuncPolicy(m, k, (BodySpec(0, 0, 2), BodySpec(1, 1, 2)))
    arrivals = np.sort(np.random.default_rng(1).uniform(0, 4, 80)).tolist()
    r = simulate(policy, make_trace(arrivals, model="m", slo_s=[1.0] * 80), m.latency[2], instances=2,
                 holdings=holdings(policy), transfer=sim_transfer(m))
    cores, nbytes = policy.ledger.held()
    assert cores == sum(x.cores for x in policy._inst.values())
    assert nbytes == sum(x.nbytes for x in policy._inst.values())
    assert sum(policy._node_free) + cores == k.nodes * k.node_cores
    end = float(r.finish.max())
    total = policy.ledger.usage(0.0, end)[0]
    assert total == pytest.approx(sum(p[1] * (min(p[0] + k.period_s, end) - p[0])
                                      for p in policy.ledger.periods(k.period_s, end)))
    assert total >= 4 * end  # the two bodies alone
    assert math.isfinite(total)


def test_the_extractor_groups_similar_layers_and_keeps_the_embeddings_off_the_shadow():
    from jaxserve.layer_profile import Unit, correlation, group_blocks

    def unit(name, layer, nbytes, grow):
        return Unit(name, "x", layer, nbytes, nbytes * 1e-9, {2: 1.0, 4: 1.0 + grow})

    sens = [1.0, 1.1, 0.95, 1.05, 0.2, 0.21]  # layers 0-3 alike, 4-5 far less sensitive
    units = [unit("embeddings", -1, 600, 0.0)]
    units += [unit(f"L{k}", k, 100, s) for k, s in enumerate(sens)]
    blocks, splits = group_blocks(units, 6, edge_bytes=(600, 0), tolerance=0.25, min_share=0.3, max_share=0.5,
                                  max_block_share=1.0)
    got = [(b["start"], b["stop"], b["kept"]) for b in blocks]
    # [0:4) would hold the embeddings (1000 of 1200 bytes): layer 0 is cut off and dropped as large
    assert got == [(0, 1, False), (1, 4, True), (4, 6, False)]
    assert splits == [dict(start=1, stop=4, bytes=300, load_s=pytest.approx(300e-9))]
    c = correlation(units)
    assert c["units"] == 7 and c["pearson"] < 0  # the big embedding table is the least sensitive


def test_the_extractor_cuts_an_edge_layer_that_lowers_sensitivity_per_byte():
    from jaxserve.layer_profile import Unit, group_blocks

    def unit(name, layer, nbytes, grow):
        return Unit(name, "x", layer, nbytes, nbytes * 1e-9, {2: 1.0, 4: 1.0 + grow})

    # MiniLM's shape: layers alike, a table at the front worth half the model that barely grows,
    # a head at the back; no block is above max_share, so only density can cut the edges
    def units_with(embed_grow, head_bytes, head_grow):
        us = [unit("embeddings", -1, 500, embed_grow)]
        us += [unit(f"L{k}", k, 100, 1.0) for k in range(4)]
        return us + [unit("head", 4, head_bytes, head_grow)]

    blocks, splits = group_blocks(units_with(0.1, 300, 0.05), 4, edge_bytes=(500, 300), max_share=1.0,
                                  max_block_share=1.0)
    assert [(b["start"], b["stop"], b["kept"]) for b in blocks] == [(0, 1, False), (1, 3, True), (3, 4, False)]
    assert "embeddings" in blocks[0]["why"] and "head" in blocks[2]["why"]
    assert blocks[1]["sensitivity"] == pytest.approx(2.0) and blocks[0]["sensitivity"] == pytest.approx(1.1)
    assert splits == [dict(start=1, stop=3, bytes=200, load_s=pytest.approx(200e-9))]

    # edges growing more per byte than the layers: the block keeps them
    blocks, splits = group_blocks(units_with(10.0, 300, 6.0), 4, edge_bytes=(500, 300), max_share=1.0,
                                  max_block_share=1.0)
    assert [(b["start"], b["stop"], b["kept"]) for b in blocks] == [(0, 4, True)]
    assert blocks[0]["sensitivity"] == pytest.approx(20.0) and blocks[0]["bytes"] == 1200

    # a block of its own whose bytes buy little is dropped for density, not for size or sensitivity
    us = [unit("embeddings", -1, 10, 0.0), unit("L0", 0, 100, 1.0), unit("L1", 1, 900, 2.0), unit("L2", 2, 100, 1.0)]
    blocks, _ = group_blocks(us, 3, edge_bytes=(10, 0), tolerance=0.1, min_share=0.1, max_share=0.9,
                             min_density_share=0.25)
    assert [(b["start"], b["stop"], b["kept"]) for b in blocks] == [(0, 1, True), (1, 2, False), (2, 3, True)]
    assert "per byte" in blocks[1]["why"]
    blocks, _ = group_blocks(us, 3, edge_bytes=(10, 0), tolerance=0.1, min_share=0.1, max_share=0.9,
                             min_density_share=0.2)
    assert blocks[1]["kept"]

    # identical layers (a transformer's) group into blocks of at most max_block_share of the bytes,
    # so a shadow has several sizes to choose from, not one block of nearly the whole model
    us = [unit("embeddings", -1, 10, 0.05)] + [unit(f"L{k}", k, 100, 1.0) for k in range(8)]
    blocks, splits = group_blocks(us, 8, edge_bytes=(10, 0), max_block_share=0.3)  # 2 layers and the table
    assert [(b["start"], b["stop"]) for b in blocks] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert all(b["kept"] for b in blocks) and len(splits) >= 2 and splits[0]["bytes"] <= 0.3 * 810
    assert [s["stop"] - s["start"] for s in splits] == sorted(s["stop"] - s["start"] for s in splits)
    assert [(s["start"], s["stop"]) for s in splits] == [(0, 2), (0, 4), (0, 6)]  # [0:8) is a body, not a shadow
    blocks, _ = group_blocks(us, 8, edge_bytes=(10, 0), max_block_share=1.0)
    assert [(b["start"], b["stop"], b["kept"]) for b in blocks] == [(0, 1, False), (1, 8, False)]  # above max_share


def test_a_layer_file_becomes_the_model_the_policy_plans_with():
    from jaxserve.sched.asyfunc import model_from_layers

    raw = {"models": {"m": {
        "num_layers": 4, "seq": 64, "param_bytes": 100, "load_s": 0.5, "row_bytes": 1000.0,
        "splits": [{"start": 1, "stop": 3, "bytes": 40, "load_s": 0.01}],
        "latency": {str(c): {name: {str(b): t * f for b, t in zip((1, 2, 4), ts)} for name, ts in TWO_CORES.items()}
                    for c, f in ((1, 1.8), (2, 1.0))}}}}
    m = model_from_layers(raw, "m", batch_sizes=(1, 2, 4), body_start_s=3.0, shadow_start_s=0.1)
    assert m.body_load_s == 3.5 and m.splits == (SplitOption(BLOCK, 40, pytest.approx(0.11)),)
    assert m.seconds(BLOCK, 1, 3) == pytest.approx(0.18 * 1.8) and m.cell(3) == Cell(4, 64)
    with pytest.raises(KeyError, match="profile --layers"):
        model_from_layers(raw, "other")


def test_a_shadow_whose_load_fails_is_released_and_its_body_serves_alone():
    from jaxserve.sched.base import PlacementChange

    k = knobs(gamma=2, slo_s=1.0)
    policy = AsyFuncPolicy(model(latency=FAST_SHADOW), k, (BodySpec(0, 0, 2),))
    for rid in range(4):
        policy.on_arrival(Request(rid, 0.0, "m", deadline=1.0), 0.0)
    policy.plan(0.0, [])  # body busy, queue of 4 >= gamma: a shadow is planned
    (shadow,) = policy.shadows()
    assert policy.instance(shadow.id) == ("shadow", 1) and policy.instance(0) == ("body", 2)
    load = PlacementChange("load", shadow.id, BLOCK)
    policy.on_placement(PlacementChange("add_worker", shadow.id), True, 0.0, 0.01)
    policy.on_placement(load, False, 0.2, 0.2)  # e.g. its actor died while loading
    assert policy.shadows() == [] and policy.bodies()[0].partner is None
    assert policy.instance(shadow.id) is None and policy.failed_placements == 1
    assert policy.ledger.held("shadow") == (0, 0)
    plan = policy.plan(0.2, [0])
    assert [(c.action, c.worker) for c in plan.placement] == [("remove_worker", shadow.id)]
    # the body takes the queue alone (unsplit); no new shadow for shadow_idle_s, then one may come
    assert [(b.instance, b.stage) for b in plan.batches] == [(0, None)]
    for rid in range(4, 8):
        policy.on_arrival(Request(rid, 0.3, "m", deadline=9.0), 0.3)
    assert policy.plan(0.3, []).placement == () and policy.shadows() == []
    later = 0.2 + k.shadow_idle_s
    assert [c.action for c in policy.plan(later, []).placement] == ["add_worker"]
    metrics = {(name, tuple(labels.items())): v for name, labels, v in policy.metrics()}
    assert metrics[("asyfunc_failed_placements", ())] == 1.0
    assert metrics[("asyfunc_cores", (("kind", "body"),))] == 2.0


def test_a_paired_body_runs_a_batch_alone_when_alone_meets_the_deadline_and_splits_when_not():
    """Alg. 3's smallest first: the body alone is a smaller unit than its pair (module docstring)."""
    from jaxserve.sched.base import PlacementChange

    k = knobs(gamma=2, slo_s=1.0)
    policy = AsyFuncPolicy(model(latency=FAST_SHADOW), k, (BodySpec(0, 0, 2),))
    for rid in range(4):
        policy.on_arrival(Request(rid, 0.0, "m", deadline=1.0), 0.0)
    policy.plan(0.0, [])  # the body is busy and the queue reached gamma: a shadow
    (shadow,) = policy.shadows()
    policy.on_placement(PlacementChange("add_worker", shadow.id), True, 0.01, 0.01)
    policy.on_placement(PlacementChange("load", shadow.id, BLOCK), True, 0.02, 0.02)
    alone = policy.model.step_seconds(None, 2, 4)
    split = policy.model.best_split(SPLIT, 2, shadow.cores, 4)[1]
    assert split < alone  # the pair is faster at b = 4 ...
    plan = policy.plan(0.1, [0, shadow.id])  # ... but alone meets the head's deadline (0.1 + 0.28 <= 1)
    assert [(b.instance, b.stage, len(b.request_ids)) for b in plan.batches] == [(0, None, 4)]
    policy.on_completion(plan.batches[0], 0.1 + alone)
    now = 0.5
    for rid in range(4, 8):  # a deadline only the pair meets
        policy.on_arrival(Request(rid, now, "m", deadline=now + (alone + split) / 2), now)
    plan = policy.plan(now, [0, shadow.id])
    assert plan.batches and plan.batches[0].stage == PRE and plan.batches[0].instance == 0
    assert policy.splits_done == 1


def test_lls_counts_only_requests_left_waiting_after_every_idle_body_took_a_batch():
    k = knobs(gamma=2, slo_s=1.0)
    policy = AsyFuncPolicy(model(latency=FAST_SHADOW), k, (BodySpec(0, 0, 2),))
    for rid in range(3):  # a queue of 3 >= gamma, all of it taken at once by the idle body
        policy.on_arrival(Request(rid, 0.0, "m", deadline=1.0), 0.0)
    plan = policy.plan(0.0, [0])
    assert [(b.instance, len(b.request_ids)) for b in plan.batches] == [(0, 3)]
    assert policy.shadows() == [] and plan.placement == ()
    for rid in range(3, 9):  # six more while it is busy: four can wait for it, the burst is real
        policy.on_arrival(Request(rid, 0.01, "m", deadline=1.01), 0.01)
    plan = policy.plan(0.01, [])
    assert len(policy.shadows()) == 1 and [c.action for c in plan.placement] == ["add_worker"]


def test_the_price_tracker_learns_the_measured_ratio_and_the_overhead_of_whole_steps_only():
    from jaxserve.sched.asyfunc import PriceTracker

    t = PriceTracker(weight=0.1, min_steps=1)
    assert (t.scale, t.overhead_s) == (1.0, 0.0) and not t.due(1.0, 0.0)
    t.observe(0.30, 0.10, 0.004)  # the first step weighs 1/n = 1
    assert t.scale == pytest.approx(3.0) and t.overhead_s == pytest.approx(0.004) and t.due(1.0, 0.0)
    assert t.sigma == 0.0
    t.observe(0.10, 0.10, 0.0)  # the second weighs 1/2: the log-mean of x3 and x1
    assert t.scale == pytest.approx(3.0 ** 0.5) and t.overhead_s == pytest.approx(0.002)
    assert t.sigma == pytest.approx(math.log(3.0))  # its deviation from the mean before it
    for _ in range(200):
        t.observe(0.30, 0.10, 0.004)  # 3x the profile, 4 ms beside the compute
        t.observe(0.06, 0.02, None)  # a split's step: its ratio counts, its wall-compute does not
    assert t.scale == pytest.approx(3.0, rel=1e-3)
    assert t.overhead_s == pytest.approx(0.004, rel=1e-3)
    assert t.due(1.0, 0.004) and t.due(3.0, 0.0) and not t.due(2.95, 0.0041)
    assert t.sigma < 0.05  # steady ratios: the spread decays toward 0
    rng = np.random.default_rng(0)
    for _ in range(400):
        t.observe(0.30 * math.exp(rng.normal(0.0, 0.2)), 0.10, 0.004)
    assert t.sigma == pytest.approx(0.2, rel=0.3)  # a log-normal spread of 0.2 around the same mean
    before = t.scale
    t.observe(0.0, 0.10, -0.5)  # a zero compute carries no ratio; a negative overhead counts as none
    assert t.scale == before and t.overhead_s < 0.004


def test_one_slow_first_step_does_not_reprice_before_min_steps():
    """A worker's first call can take 20x its price: the tracker reports it, but is not due
    (the policy keeps the profile's prices) until ``min_steps`` steps, whose mean dilutes it."""
    from jaxserve.sched.asyfunc import PriceTracker

    t = PriceTracker()
    t.observe(2.1, 0.10, 0.02)  # 21x
    assert t.scale == pytest.approx(21.0) and not t.due(1.0, 0.0)
    for _ in range(t.min_steps - 1):
        t.observe(0.12, 0.10, 0.004)
    assert t.due(1.0, 0.0) and t.scale < 1.2 * 21 ** (1 / t.min_steps)  # the mean of 8 logs, not the outlier


def test_steps_and_splits_are_priced_with_the_measured_scale_and_a_per_step_overhead():
    m = model().with_prices(2.0, 0.004)
    assert m.seconds(None, 2, 4) == pytest.approx(0.56) and m.profiled(None, 2, 4) == pytest.approx(0.28)
    assert m.step_seconds(None, 2, 4) == pytest.approx(0.564) and m.step_seconds(None, 2, 0) == 0.0
    x2 = 0.001 + 2000 / 1e6  # the transfer is not scaled: it is priced from bytes and the Ray hop
    assert m.split_seconds(SPLIT, 2, 2, 4, 2) == pytest.approx(2 * (0.05 + 0.10 + 0.05) + 2 * x2 + 3 * 0.004)
    assert model().with_prices(1.0, 0.0).split_seconds(SPLIT, 2, 2, 4, 2) == model().split_seconds(SPLIT, 2, 2, 4, 2)


def test_live_steps_slower_than_the_profile_make_the_policy_plan_with_the_measured_prices():
    """The engine hands every step's times to ``observe_step``: whole-model steps at 1.5x the
    profile with 5 ms of overhead move the prices the policy plans with, so its supported rate
    (Eq. 1), BATCH's buffer wait and what it reports follow; a step of a worker it does not know
    changes nothing."""
    from jaxserve.sched.base import Batch

    k = knobs(slo_s=0.5)
    policy = AsyFuncPolicy(model(), k, (BodySpec(0, 0, 2),), variant="asyfunc-batch")
    r_max, wait = policy.r_max(), policy._batch_wait
    cell = Cell(4)
    policy.observe_step(Batch((1, 2, 3, 4), "m", cell, 99, None), 10.0, 10.0, 0.0)  # no such instance
    assert policy.reprices == 0 and policy.model.scale == 1.0
    for i in range(200):
        policy.observe_step(Batch((1, 2, 3, 4), "m", cell, 0, None), 1.5 * 0.28, 1.5 * 0.28 + 0.005, float(i))
    assert policy.model.scale == pytest.approx(1.5, rel=0.06)
    assert policy.model.step_overhead_s == pytest.approx(0.005, abs=0.0006)
    assert 1 <= policy.reprices < 30
    assert policy.r_max() == pytest.approx(r_max / (1.5 * 0.28 + 0.005) * 0.28, rel=0.07)
    assert policy._batch_wait < wait
    assert policy.service_time(Batch((1, 2, 3, 4), "m", cell, 0, None)) == pytest.approx(1.5 * 0.28 + 0.005, rel=0.06)
    shown = {name: v for name, _, v in policy.metrics()}
    assert shown["asyfunc_price_scale"] == policy.model.scale and shown["asyfunc_reprices"] == policy.reprices
