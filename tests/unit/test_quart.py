"""QUART's pieces (jaxserve/sched/quart.py): queueing, control, smoothing, cache, placement,
and the policies driven through the simulator."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxserve.sched.base import Cell, CostModel, LatencyProfile, ShapeGrid, Stage
from jaxserve.sched.quart import (PID, CocktailLike, CpuCompensator, CvPropagation, InferlineLike, InflessLike,
                                  LoadModel, ParameterCache, QuartPolicy, Server, choose_server, cut_stages,
                                  erlang_c, fit_linear, kl_to_uniform, mmc_delay, mmc_wait, replicas_for,
                                  smooth_allocation, smoothing_beta)
from jaxserve.simulator import simulate
from support import layer_profile_entry
from jaxserve.traces import make_trace


# -- pure pieces ---------------------------------------------------------------------------------

def test_erlang_c_and_mmc_delay_match_textbook_values():
    # M/M/3 with lambda = 2, mu = 1 (a = 2 Erlangs): C = 4/9, Wq = C / (3 - 2) = 0.444.., W = Wq + 1
    assert erlang_c(3, 2.0) == pytest.approx(4 / 9)
    assert mmc_wait(2.0, 1.0, 3) == pytest.approx(4 / 9)
    assert mmc_delay(2.0, 1.0, 3) == pytest.approx(1 + 4 / 9)
    # c = 1 is M/M/1: W = 1 / (mu - lambda)
    assert mmc_delay(0.5, 1.0, 1) == pytest.approx(2.0)
    assert mmc_delay(3.0, 1.0, 3) == math.inf and erlang_c(2, 2.5) == 1.0
    # more replicas, less delay
    assert mmc_delay(2.0, 1.0, 4) < mmc_delay(2.0, 1.0, 3)


def test_replicas_for_grows_with_rate_and_burstiness():
    smooth = replicas_for(50.0, 10.0, 0.15, cv_arrival=0.1, cv_service=0.1)
    bursty = replicas_for(50.0, 10.0, 0.15, cv_arrival=4.0, cv_service=0.1)
    assert smooth >= 6 and bursty > smooth
    assert replicas_for(100.0, 10.0, 0.15) > replicas_for(50.0, 10.0, 0.15)


def test_pid_sign_more_delay_more_replicas():
    pid = PID(1.0, 0.2, 0.2)
    assert pid.update(2.0, 1.0) > 0  # T_i three times the target: add
    pid = PID(1.0, 0.2, 0.2)
    assert pid.update(-0.5, 1.0) < 0.5  # below target: nothing to add
    pid = PID(0.0, 1.0, 0.0)
    outs = [pid.update(0.5, 1.0) for _ in range(3)]
    assert outs == sorted(outs) and outs[-1] > outs[0]  # a persistent excess integrates


def test_cut_stages_balances_cost_and_cuts_evenly_when_layers_are_equal():
    assert [(s.start, s.stop) for s in cut_stages("m", [1.0] * 12, 4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    stages = cut_stages("m", [5.0, 1, 1, 1, 1, 1], 2)
    assert [(s.start, s.stop) for s in stages] == [(0, 1), (1, 6)]
    assert len(cut_stages("m", [1.0] * 3, 8)) == 3


def _all_cuts(n: int, k: int):
    """Every cut of n layers into k contiguous non-empty stages, as (start, stop) pairs."""
    import itertools

    for points in itertools.combinations(range(1, n), k - 1):
        b = (0, *points, n)
        yield [(b[i], b[i + 1]) for i in range(k)]


@pytest.mark.parametrize("seed", range(6))
def test_cut_stages_with_a_tolerance_is_the_most_even_cut_near_the_least_bottleneck_by_brute_force(seed):
    """Against enumeration: the bottleneck is within (1 + tolerance) of the least over all cuts,
    and no cut within it has a smaller largest stage (in layers); tolerance 0 is the least."""
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(4, 10)), int(rng.integers(2, 5))
    costs = list(rng.uniform(0.5, 1.5, n) * (1 + 3 * (rng.random(n) < 0.2)))
    cost = lambda cut: max(sum(costs[a:b]) for a, b in cut)  # noqa: E731
    cuts = list(_all_cuts(n, k))
    least = min(cost(c) for c in cuts)
    exact = [(s.start, s.stop) for s in cut_stages("m", costs, k)]
    assert cost(exact) == pytest.approx(least)
    for tol in (0.05, 0.2, 1.0):
        got = [(s.start, s.stop) for s in cut_stages("m", costs, k, tolerance=tol)]
        assert len(got) == k and got[0][0] == 0 and got[-1][1] == n
        assert cost(got) <= least * (1 + tol) + 1e-9
        near = [c for c in cuts if cost(c) <= least * (1 + tol) + 1e-9]
        assert max(b - a for a, b in got) == min(max(b - a for a, b in c) for c in near)
    with pytest.raises(ValueError):
        cut_stages("m", costs, k, tolerance=-0.1)


def test_a_profile_cut_keeps_equal_layers_on_noise_and_moves_for_a_real_difference():
    from jaxserve.quart_exec import CUT_TOLERANCE, pipeline_stages

    noisy = [12.2, 12.0, 12.8, 14.6, 11.6, 14.8]  # MiniLM's six identical layers as profiled on 2 cores
    assert [(s.start, s.stop) for s in pipeline_stages("m", 6, 3, noisy)] == [(0, 2), (2, 4), (4, 6)]
    assert [(s.start, s.stop) for s in pipeline_stages("m", 6, 3)] == [(0, 2), (2, 4), (4, 6)]
    heavy = [3.0, 1, 1, 1, 1, 1]  # a first layer carrying a large embedding: 2/2/2 would be 4
    got = pipeline_stages("m", 6, 3, heavy)
    assert got[0].stop == 1 and max(sum(heavy[s.start:s.stop]) for s in got) <= 3 * (1 + CUT_TOLERANCE)
    with pytest.raises(ValueError, match="6 layers"):
        pipeline_stages("m", 6, 3, heavy[:5])
    with pytest.raises(ValueError, match="2 to 6 stages"):
        pipeline_stages("m", 6, 7, heavy)


def test_profile_layer_costs_charges_the_edges_to_the_end_layers_at_the_batch_and_cores_asked():
    from jaxserve.sched.quart import profile_layer_costs

    prof = layer_profile_entry(3, {1: [1.0, 2.0, 3.0], 2: [0.5, 1.0, 1.5]})
    costs, b, c = profile_layer_costs(prof, batch=6, cores=2)
    assert (b, c) == (4, 2)  # the largest profiled batch <= 6, the largest core count <= 2
    assert costs == pytest.approx([(0.5 + 0.5) * 4, 1.0 * 4, (1.5 + 0.1) * 4])
    costs, b, c = profile_layer_costs(prof, batch=8, cores=1)
    assert (b, c) == (8, 1) and costs == pytest.approx([(1.0 + 0.5) * 8, 2.0 * 8, (3.0 + 0.1) * 8])
    assert profile_layer_costs(prof, batch=8, cores=None)[2] == 2
    assert profile_layer_costs(prof, batch=8, cores=16)[2] == 2
    with pytest.raises(KeyError):
        profile_layer_costs({"num_layers": 3}, batch=8)


def test_cv_propagation_fit_recovers_its_own_model():
    truth = CvPropagation(0.05, 0.9, 0.4)
    rng = np.random.default_rng(0)
    samples = [(cv, rho, 1, truth.predict(cv, rho)) for cv, rho in zip(rng.uniform(0.1, 8, 50),
                                                                        rng.uniform(0.1, 0.95, 50))]
    fit = CvPropagation.fit(samples)
    assert (fit.w0, fit.w1, fit.w2) == pytest.approx((0.05, 0.9, 0.4), abs=1e-6)
    # a busy stage smooths a bursty input and roughens a regular one
    assert truth.predict(4.0, 0.9) < 4.0 and truth.predict(0.1, 0.9) > 0.1


def test_smoothing_pulls_a_smooth_stage_toward_its_neighbours_and_keeps_a_bursty_one():
    assert smoothing_beta(0.0) == 0.0 and 0.8 < smoothing_beta(8.0) < 1.0
    alloc = (1.0, 6.0, 1.0)
    low = smooth_allocation(alloc, (0.1, 0.1, 0.1))
    high = smooth_allocation(alloc, (8.0, 8.0, 8.0))
    assert low[1] < high[1] < 6.0 + 1e-9 and low[1] < 2.0


def test_fit_linear_and_cpu_compensation():
    assert fit_linear([(1, 0), (1, 1), (1, 2)], [1, 3, 5]) == pytest.approx((1.0, 2.0))
    comp = CpuCompensator(cpu_share=0.3, base_cores=2, max_cores=8).fit(service_rate=10.0, target=0.15)
    assert comp.weights[1] > 0  # more load per replica, more cores
    assert comp.cores(1.0, 10.0, 1) == 2 and comp.cores(9.0, 10.0, 1) > 2
    assert comp.factor(4) < comp.factor(2) == pytest.approx(1.0)


def test_parameter_cache_is_lru_under_its_high_water_mark():
    a, b, c = (Stage("m", i, i + 1, 3) for i in range(3))
    cache = ParameterCache([Server(0, 4, cache_mb=100.0)])
    assert cache.insert(0, a, 40) == () and cache.insert(0, b, 40) == ()
    cache.touch(0, a)  # b is now the least recently used
    assert cache.insert(0, c, 40) == (b,)  # 120 MB > 85: evict b
    assert cache.holds(0, a) and cache.holds(0, c) and not cache.holds(0, b)
    assert cache.source(0, a) == "cache" and cache.source(0, b) == "cold"
    cache.invalidate(a)
    assert cache.source(0, a) == "cold"


def test_load_model_cache_is_much_faster_than_disk():
    lm = LoadModel()
    assert lm.seconds(92, "cache") == pytest.approx(0.05 + 0.0363)  # bench/RESULTS.md quart_cache, per 92 MB
    assert lm.seconds(92, "page") == pytest.approx(2.57 + 2.77 + 0.2488)
    assert lm.seconds(92, "cache") < 0.1 * lm.seconds(92, "page") < lm.seconds(92, "cold")


def test_placement_disperses_and_prefers_a_cached_server():
    counts = {0: 2, 1: 0, 2: 0}
    free = {0: 2, 1: 4, 2: 4}
    assert kl_to_uniform([1, 1, 1]) < kl_to_uniform([3, 0, 0])
    assert choose_server(counts, free, cached=()) == 1  # dispersed: not on 0, most free, lowest id
    assert choose_server(counts, free, cached=(2,)) == 2  # as dispersed, and cached
    assert choose_server({0: 0, 1: 3}, {0: 1, 1: 1}, cached=(1,), kl_slack=0.1) == 0  # too concentrated
    assert choose_server(counts, {0: 0, 1: 0, 2: 0}, cached=()) is None


# -- the policies in simulation ------------------------------------------------------------------------

S = (Stage("m", 0, 1, 4), Stage("m", 1, 2, 4), Stage("m", 2, 3, 4), Stage("m", 3, 4, 4))
WHOLE = Stage("m", 0, 4, 4)
GRID = {"m": ShapeGrid((1, 2, 4))}
STEP = 0.01  # each stage, batch 1; the middle stage (S[1]) is twice as slow: the key stage


def _cost():
    def prof(name, t):
        return LatencyProfile(name, {Cell(1): t, Cell(2): 1.9 * t, Cell(4): 3.6 * t})
    lat = {s.label(): prof(s.label(), STEP * (2 if s is S[1] else 1)) for s in S}
    lat["m"] = prof("m", STEP * 5)
    return CostModel(lat)


SERVERS = [Server(i, 4) for i in range(4)]


def _quart(cache=None, **kw):
    cost = _cost()
    cache = cache or ParameterCache(SERVERS)
    return QuartPolicy({"m": S}, GRID, cost, SERVERS, {i: 0 for i in range(4)}, {s: 50.0 for s in S},
                       cache=cache, slo_s=0.2, period=0.5, reclaim_after=2.0, **kw)


def _burst_trace(seed=0):
    rng = np.random.default_rng(seed)
    quiet1 = np.sort(rng.uniform(0, 10, 200))  # 20 req/s: one replica per stage copes
    burst = np.sort(rng.uniform(10, 20, 800))  # 80 req/s: the slow stage (55 req/s at batch 4) needs more
    quiet2 = np.sort(rng.uniform(20, 40, 400))
    return make_trace(np.concatenate([quiet1, burst, quiet2]), model="m", slo_s=math.inf)


def _run(policy, trace, instances=4, holdings=None):
    holdings = holdings or {i: frozenset({S[i]}) for i in range(4)}
    return simulate(policy, trace, _cost(), instances=instances, holdings=holdings,
                    load_time=policy.planned_load_seconds)


def test_a_burst_makes_the_slow_stage_the_key_stage_it_gets_replicas_first_and_smoothing_reclaims():
    policy = _quart()
    r = _run(policy, _burst_trace())
    assert sum(r.outcome_counts().values()) == len(r) == r.outcome_counts()["ok"]  # answered exactly once
    adds = [e for e in policy.events if e[1] == "load"]
    first = [e[3] for e in adds if e[0] == adds[0][0]]
    assert S[1].label() in first  # the slow stage gets replicas at the first correction
    per_stage = [sum(e[3] == s.label() for e in adds) for s in S]
    assert per_stage[1] == max(per_stage) and per_stage[1] > per_stage[0]
    assert S[1] in policy.key_stages
    during = [rep for t, rep in policy.replica_log if 12 <= t <= 20]
    assert max(rep[1] for rep in during) >= 3 and max(rep[1] for rep in during) > max(rep[0] for rep in during)
    last = policy.replica_log[-1][1]
    assert last[1] < max(rep[1] for rep in during)  # reclaimed after the burst
    assert any(e[1] == "remove" for e in policy.events)


def test_new_key_stage_replicas_load_from_the_cache_where_it_holds_them():
    cache = ParameterCache(SERVERS)
    for srv in (1, 2):
        cache.insert(srv, S[1], 50.0)
    policy = _quart(cache)
    _run(policy, _burst_trace())
    loads = [e for e in policy.events if e[1] == "load" and e[3] == S[1].label()]
    first_two = [policy.worker_server[e[2]] for e in loads[:2]]
    assert set(first_two) <= {1, 2} and all(e[4] == "cache" for e in loads[:2])
    # without a cache the same replicas come from disk, and take longer to come up
    slow = _quart(use_cache=False)
    r_slow = _run(slow, _burst_trace())
    r_fast = _run(_quart(cache=_cached()), _burst_trace())
    assert all(e[4] != "cache" for e in slow.events if e[1] == "load")
    assert r_fast.mean_latency() < r_slow.mean_latency()


def test_a_key_stage_on_a_full_cluster_takes_a_replica_from_a_stage_with_surplus():
    """Point 5 of QuartPolicy's docstring: 6 accelerators, all held (3 replicas of the fast
    first stage, just scaled out, one of each other). The burst makes the slow stage the key stage; no
    accelerator is free, so it takes an idle replica of the first stage's surplus at once, on a
    server whose cache holds it, instead of waiting for the Smoother, and the burst's latency
    is lower for it."""
    servers = [Server(i, 2) for i in range(3)]
    placement = {0: 0, 1: 1, 2: 2, 3: 0, 4: 1, 5: 2}
    holdings = {0: frozenset({S[0]}), 1: frozenset({S[0]}), 2: frozenset({S[0]}), 3: frozenset({S[1]}),
                4: frozenset({S[2]}), 5: frozenset({S[3]})}

    def make(cached_on=(0, 1, 2)):
        cache = ParameterCache(servers)
        for srv in cached_on:  # the KeysManager holds the slow stage there (an earlier burst)
            cache.insert(srv, S[1], 50.0)
        policy = QuartPolicy({"m": S}, GRID, _cost(), servers, placement, {s: 50.0 for s in S}, slo_s=0.2,
                             period=0.5, reclaim_after=30.0, cache=cache)
        policy.key_stages[S[0]] = 0.0  # scaled out just before: the Smoother keeps its replicas for 30 s
        return policy

    policy = make()
    r = _run(policy, _burst_trace(), instances=6, holdings=holdings)
    assert sum(r.outcome_counts().values()) == len(r) == r.outcome_counts()["ok"]
    assert policy.reclaimed_for_key >= 1
    removed = [e for e in policy.events if e[1] == "remove" and e[0] < 15]  # in the burst (after it: the Smoother)
    assert removed and all(e[3] == S[0].label() for e in removed)  # only the stage with surplus gives one up
    loads = [e for e in policy.events if e[1] == "load"]
    assert loads and loads[0][3] == S[1].label() and loads[0][0] >= removed[0][0] and loads[0][4] == "cache"
    assert max(rep[1] for t, rep in policy.replica_log if 10 <= t <= 20) >= 2
    assert all(sum(rep) <= 6 for _, rep in policy.replica_log)  # never more workers than accelerators
    waiting = make()
    waiting._reclaim_for = lambda *a: None  # the ScalingPipeline default: the key stage waits
    r_wait = _run(waiting, _burst_trace(), instances=6, holdings=holdings)
    assert waiting.reclaimed_for_key == 0
    assert not [e for e in waiting.events if e[1] == "load" and e[0] < 30]  # waits for the Smoother's 30 s
    assert r.mean_latency() < r_wait.mean_latency()
    # a move whose new replica would load from disk (no server caches the slow stage) is not made
    uncached = make(cached_on=())
    _run(uncached, _burst_trace(), instances=6, holdings=holdings)
    assert uncached.reclaimed_for_key == 0


def _cached():
    cache = ParameterCache(SERVERS)
    for srv in range(4):
        for s in S:
            cache.insert(srv, s, 50.0)
    return cache


@pytest.mark.parametrize("make", ["infless", "cocktail", "inferline"])
def test_baselines_answer_every_request_once(make):
    cost = _cost()
    trace = _burst_trace(1)
    if make == "inferline":
        policy = InferlineLike({"m": S}, GRID, cost, SERVERS, {i: 0 for i in range(4)}, {s: 50.0 for s in S},
                               slo_s=0.2, planned_rate=20.0, period=0.5)
        r = _run(policy, trace)
        assert any(e[1] == "load" and e[4] == "cold" for e in policy.events)  # no cache: from disk
    else:
        cls = InflessLike if make == "infless" else CocktailLike
        policy = cls({"m": (WHOLE,)}, GRID, cost, SERVERS, {0: 0}, {WHOLE: 200.0}, period=0.5)
        r = _run(policy, trace, instances=1, holdings={0: frozenset({WHOLE})})
        assert max(rep[0] for _, rep in policy.replica_log) > 1
        if make == "infless":
            assert all(e[4] == "cold" for e in policy.events if e[1] == "load")
    counts = r.outcome_counts()
    assert counts["ok"] == len(r)
    assert np.all(r.finish >= r.arrival)


@pytest.mark.parametrize("variant", ["quart", "quart-infless", "quart-inferline", "quart-cocktail"])
def test_simulate_quart_variants_from_a_whole_model_profile(variant):
    from jaxserve.launch import simulate_quart

    cost = CostModel({"minilm-l6": LatencyProfile("minilm-l6", {Cell(b, 64): 0.01 * b for b in (1, 2, 4)})})
    rng = np.random.default_rng(2)
    trace = make_trace(np.sort(rng.uniform(0, 20, 1500)), model="minilm-l6", length=64)
    result, policy = simulate_quart(variant, cost, "minilm-l6", trace, workers=16, slo_s=0.04, planned_rate=75.0)
    assert result.outcome_counts()["ok"] == len(trace)  # no deadline: every request answered, once
    stages = policy.stages
    assert len(stages) == (1 if variant in ("quart-infless", "quart-cocktail") else 6)
    assert max(sum(r) for _, r in policy.replica_log) <= 16
    # the totals count each stage's steps; without noise, CPU compensation or a transfer between
    # stages, a step is busy exactly its price (with a transfer, its hop too: in live runs the
    # activations travel with the call)
    from pathlib import Path

    result, policy = simulate_quart(variant, cost, "minilm-l6", trace, workers=16, slo_s=0.04, planned_rate=75.0,
                                    transfer_profile=Path("/nonexistent/ray-transfer.json"))
    for s in policy.stages:
        t = policy.totals[s]
        assert t.steps > 0 and t.priced_s > 0
        assert t.busy_s == pytest.approx(t.priced_s, rel=1e-9)


@pytest.mark.parametrize("settings, reason", [
    (dict(policy="quart-infless", workers="ray", models=("minilm-l6",), instances=4), "simulation only"),
    (dict(policy="quart-cocktail", workers="ray", models=("minilm-l6",), instances=4), "simulation only"),
    (dict(policy="quart", workers="thread", models=("minilm-l6",), instances=4), "--workers ray"),
    (dict(policy="quart", workers="ray", models=("bert-base",), instances=4), "one of minilm-l3, .*vit-demo"),
    (dict(policy="quart", workers="ray", models=("minilm-l6", "vit-demo"), instances=4), "exactly one"),
    (dict(policy="quart", workers="ray", models=("minilm-l6",), instances=2), "--instances .* >= 3"),
    (dict(policy="quart", workers="ray", models=("minilm-l6",), instances=8, quart_stages=7), "2 to 6 stages"),
])
def test_serve_refuses_what_quart_cannot_serve_live_with_the_reason(settings, reason):
    from jaxserve.launch import ServeSettings, make_policy

    with pytest.raises(ValueError, match=reason):
        make_policy(ServeSettings(**settings), {}, CostModel({}))


def test_live_quart_cuts_even_stages_one_worker_each_on_one_server_caching_each():
    from jaxserve.launch import ServeSettings, make_policy, with_quart

    settings = with_quart(ServeSettings(policy="quart", workers="ray", models=("minilm-l6",), instances=5,
                                        quart_period_s=0.5, layer_profile="/nonexistent/layers.json"))
    stages = settings.extra["quart"]["stages"]
    assert [(s.start, s.stop) for s in stages] == [(0, 2), (2, 4), (4, 6)]
    grid = ShapeGrid((1, 2, 4), (64,))
    cost = CostModel({"minilm-l6": LatencyProfile("minilm-l6", {Cell(b, 64): 0.01 * b for b in (1, 2, 4)})})
    policy = make_policy(settings, {"minilm-l6": type("M", (), {"grid": grid})()}, cost)
    assert policy.servers[0].accelerators == 5 and policy.worker_server == {0: 0, 1: 0, 2: 0}
    assert policy.period == 0.5 and policy.use_cache
    assert all(policy.cache.holds(0, s) for s in stages)
    assert policy.slo_s == pytest.approx(0.02)  # 2x the whole model's batch-1 price at the longest bucket
    # each stage priced at its third of the whole model
    assert policy.cost.latency[stages[1].label()].latency(Cell(4, 64)) == pytest.approx(0.04 / 3)
    off = make_policy(ServeSettings(**{**settings.__dict__, "quart_cache": False}),
                      {"minilm-l6": type("M", (), {"grid": grid})()}, cost)
    assert not off.use_cache and not any(off.cache.holds(0, s) for s in stages)


def test_live_quart_cuts_by_the_layer_profile_and_prices_each_stage_at_its_profiled_share(tmp_path):
    """With a layer profile of the served model (--layer-profile), the cut and the stage prices
    follow its per-layer costs (here a first layer three times the others: 2/2/2 would make it
    the bottleneck); without one, equal layers, and the settings say which."""
    import json

    from jaxserve.launch import ServeSettings, make_policy, with_quart

    path = tmp_path / "layers.json"
    path.write_text(json.dumps({"models": {"minilm-l6": layer_profile_entry(6, {1: [3.0, 1, 1, 1, 1, 1]}, (0.0, 0.0))}}))
    base = dict(policy="quart", workers="ray", models=("minilm-l6",), instances=5,
                text_grid=ShapeGrid((1, 2, 4), (64,)))
    settings = with_quart(ServeSettings(**base, layer_profile=str(path)))
    quart = settings.extra["quart"]
    assert quart["stages"][0].stop == 1 and str(path) in quart["cut"] and "batch 4" in quart["cut"]
    assert quart["layer_costs"] == pytest.approx([12.0, 4, 4, 4, 4, 4])
    grid = ShapeGrid((1, 2, 4), (64,))
    cost = CostModel({"minilm-l6": LatencyProfile("minilm-l6", {Cell(b, 64): 0.08 * b for b in (1, 2, 4)})})
    policy = make_policy(settings, {"minilm-l6": type("M", (), {"grid": grid})()}, cost)
    for s in quart["stages"]:
        share = sum(quart["layer_costs"][s.start:s.stop]) / 32
        assert policy.cost.latency[s.label()].latency(Cell(2, 64)) == pytest.approx(0.16 * share)
    plain = with_quart(ServeSettings(**base, layer_profile=str(tmp_path / "missing.json")))
    assert [(s.start, s.stop) for s in plain.extra["quart"]["stages"]] == [(0, 2), (2, 4), (4, 6)]
    assert plain.extra["quart"]["layer_costs"] is None and "equal layers" in plain.extra["quart"]["cut"]


def test_simulate_quart_cuts_by_the_layer_profile_next_to_the_cost_model(tmp_path, capsys):
    """`jaxserve simulate --policy quart` cuts as serve does: by the layer profile next to
    --cost-model where it profiles the model (a first layer 7x the others takes a stage of its
    own in 3), else equal layers; and says which."""
    import json

    from jaxserve.cli import main
    from jaxserve.layer_profile import layers_path
    from jaxserve.profiler import save_cost_model

    cost_path = tmp_path / "cost.json"
    save_cost_model(cost_path, CostModel({"minilm-l6": LatencyProfile(
        "minilm-l6", {Cell(b, 64): 0.01 * b for b in (1, 2, 4)})}))
    args = ["simulate", "--policy", "quart", "--cost-model", str(cost_path), "--instances", "8", "--rate", "20",
            "--requests", "200", "--trace", "poisson"]

    def run_():
        assert main(args) == 0
        return json.loads(capsys.readouterr().out)

    plain = run_()
    assert plain["cut_by"].startswith("equal layers") and len(plain["stages"]) == 6
    layers_path(cost_path).write_text(json.dumps({"models": {"minilm-l6": layer_profile_entry(
        6, {1: [7.0, 1, 1, 1, 1, 1]}, (0, 0))}}))
    cut = run_()
    assert "the layer profile" in cut["cut_by"] and cut["requests"] == 200
    assert cut["stages"] == plain["stages"]  # up to 8 stages of 6 layers: one layer each either way
    from jaxserve.launch import simulate_quart

    rng = np.random.default_rng(3)
    trace = make_trace(np.sort(rng.uniform(0, 10, 300)), model="minilm-l6", length=64)
    cost = CostModel({"minilm-l6": LatencyProfile("minilm-l6", {Cell(b, 64): 0.01 * b for b in (1, 2, 4)})})
    _, policy = simulate_quart("quart", cost, "minilm-l6", trace, workers=8, slo_s=0.04, planned_rate=30.0,
                               max_stages=3, layer_costs=[7.0, 1, 1, 1, 1, 1])
    assert [(s.start, s.stop) for s in policy.stages] == [(0, 1), (1, 3), (3, 6)]  # 2/2/2 would be 8
    assert policy.cost.latency[policy.stages[0].label()].latency(Cell(4, 64)) == pytest.approx(0.04 * 7 / 12)
