"""Tabi's mechanisms (jaxserve/sched/tabi.py): Eq. 4's rerouting, the seeded draw, the ensemble,
profiling by expectation, selection, and the policy driven by the simulator."""

import math

import numpy as np
import pytest

from jaxserve.sched.base import Cell, CostModel, LatencyProfile, Request, ShapeGrid, StepSummary
from jaxserve.sched.tabi import (Candidate, LevelData, TabiPolicy, ensemble, evaluate, profile_candidates,
                                 reroute_probabilities, reroute_probability, route_draw, select)
from jaxserve.simulator import OUTCOMES, simulate
from jaxserve.traces import make_trace


def test_eq4_reroutes_everything_up_to_the_cutoff_and_less_the_more_confident():
    c, k = 0.8, 10.0
    assert reroute_probability(0.5, c, k) == 1.0
    assert reroute_probability(c, c, k) == 1.0  # con <= c: always
    mid = (1 + c) / 2  # norm = 0 there
    assert reroute_probability(mid, c, k) == pytest.approx(0.5)
    assert reroute_probability(1.0, c, k) == pytest.approx(1 / (1 + math.exp(k / 2)))
    cons = np.linspace(c + 1e-6, 1.0, 50)
    p = reroute_probabilities(cons, c, k)
    assert (np.diff(p) < 0).all()
    assert np.allclose(p, [reroute_probability(x, c, k) for x in cons])
    # a steeper slope is closer to a hard threshold at the midpoint
    assert reroute_probability(0.95, c, 50.0) < reroute_probability(0.95, c, 2.0)
    assert reroute_probability(0.85, c, 50.0) > reroute_probability(0.85, c, 2.0)


def test_the_draw_is_a_pure_function_of_the_seeds_and_uniform():
    assert route_draw(0, 17, 0) == route_draw(0, 17, 0)
    assert route_draw(0, 17, 0) != route_draw(0, 17, 1) != route_draw(1, 17, 1)
    draws = np.array([route_draw(3, s, 0) for s in range(20000)])
    assert 0.0 <= draws.min() and draws.max() < 1.0
    assert abs(draws.mean() - 0.5) < 0.01
    assert abs((draws < 0.25).mean() - 0.25) < 0.01


def test_ensemble_weights_the_levels():
    small, large = np.array([0.9, 0.1]), np.array([0.2, 0.8])
    assert np.allclose(ensemble([small, large], [1, 3]), 0.25 * small + 0.75 * large)
    with pytest.raises(ValueError, match="weights"):
        ensemble([small, large], [1.0])


def _synthetic(n=4000, seed=0):
    """A small model that is right when confident and a large model right 90% of the time."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    conf = rng.uniform(0.5, 1.0, n)
    small_right = rng.uniform(size=n) < conf  # calibrated: right with probability con
    small_top = np.where(small_right, labels, 1 - labels)
    small = np.zeros((n, 2))
    small[np.arange(n), small_top] = conf
    small[np.arange(n), 1 - small_top] = 1 - conf
    large_right = rng.uniform(size=n) < 0.9
    large_top = np.where(large_right, labels, 1 - labels)
    large = np.full((n, 2), 0.1)
    large[np.arange(n), large_top] = 0.9
    data = {"s": LevelData(small, cost=1.0), "l": LevelData(large, cost=10.0)}
    return data, labels


def test_evaluate_is_the_expectation_of_the_sampled_routing():
    data, labels = _synthetic()
    c, k = 0.8, 10.0
    ev = evaluate(("s", "l"), (c,), k, None, data, labels)
    # sample the policy's own draws and compare
    small, large = data["s"].probabilities, data["l"].probabilities
    w = ev["weights"][1]
    right, cost = [], []
    for i in range(len(labels)):
        go = route_draw(0, i, 0) < reroute_probability(small[i].max(), c, k)
        answer = ensemble([small[i], large[i]], w) if go else small[i]
        right.append(answer.argmax() == labels[i])
        cost.append(11.0 if go else 1.0)
    assert ev["accuracy"] == pytest.approx(np.mean(right), abs=0.015)
    assert ev["cost"] == pytest.approx(np.mean(cost), rel=0.03)
    assert sum(ev["exit_shares"]) == pytest.approx(1.0)


def test_cutoff_one_sends_everything_on_and_the_weights_follow_accuracy_on_rerouted_items():
    data, labels = _synthetic()
    ev = evaluate(("s", "l"), (1.0,), 10.0, None, data, labels)
    assert ev["exit_shares"] == pytest.approx((0.0, 1.0))
    assert ev["cost"] == pytest.approx(11.0)
    w_small, w_large = ev["weights"][1]
    acc_small = (data["s"].probabilities.argmax(1) == labels).mean()
    acc_large = (data["l"].probabilities.argmax(1) == labels).mean()
    assert w_small / w_large == pytest.approx(acc_small / acc_large)


def test_selection_takes_the_cheapest_candidate_that_meets_the_target():
    data, labels = _synthetic()
    cands = profile_candidates("t", [("s",), ("l",), ("s", "l")], data, labels)
    large_alone = next(c for c in cands if c.levels == ("l",))
    cascades = [c for c in cands if len(c.levels) == 2]
    assert cascades, "the sweep kept some cut-offs"
    # the paper's early stop: nothing below the mean accuracy of the models used
    floor = np.mean([(data[m].probabilities.argmax(1) == labels).mean() for m in ("s", "l")])
    assert all(c.accuracy >= floor for c in cascades)
    target = large_alone.accuracy - 0.005
    chosen = select(cands, target)
    assert chosen.assured >= target and chosen.accuracy >= target
    assert all(c.cost >= chosen.cost for c in cands if c.assured >= target)
    assert chosen.cost < large_alone.cost  # the cascade is cheaper than the large model alone
    assert large_alone.accuracy_se == 0.0  # the reference: no paired difference from itself
    assert all(c.accuracy_se > 0 for c in cascades)
    # an easy target: the small model alone
    assert select(cands, 0.5).levels == ("s",)
    # an impossible one: the highest assured accuracy within the bound
    assert select(cands, 1.01).assured == max(c.assured for c in cands)
    with pytest.raises(ValueError, match="within"):
        select(cands, 0.5, max_cost=0.1)


def test_candidates_round_trip_through_json_and_check_their_shape():
    c = Candidate("t", ("a", "b"), (0.85,), 10.0, 0.7, ((1.0,), (0.4, 0.6)), 0.9, 0.01, (0.6, 0.4))
    assert Candidate.from_json(c.to_json()) == c
    with pytest.raises(ValueError, match="cut-offs"):
        Candidate("t", ("a", "b"))
    with pytest.raises(ValueError, match="weights"):
        Candidate("t", ("a", "b"), (0.9,), weights=((1.0,), (1.0,)))


GRID = ShapeGrid(batch_sizes=(1, 2), seq_buckets=(16, 32))
COST = CostModel({
    "s": LatencyProfile("s", {Cell(b, s): 0.001 * b * s / 16 for b in (1, 2) for s in (16, 32)}),
    "l": LatencyProfile("l", {Cell(b, s): 0.010 * b * s / 16 for b in (1, 2) for s in (16, 32)}),
})


def _policy(c=0.8, k=50.0):
    cand = Candidate("t", ("s", "l"), (c,), k, 0.7, ((1.0,), (1.0, 3.0)))
    return TabiPolicy({"t": cand}, {"s": GRID, "l": GRID}, COST, {"t": ("neg", "pos")})


def test_confident_requests_return_at_the_small_model_the_rest_run_both_pruned_into_a_smaller_bucket():
    n = 40
    trace = make_trace(np.arange(n) * 1.0, model="s", length=30, slo_s=10.0, task="t")
    small = {i: (0.99, 0.01) if i % 2 == 0 else (0.55, 0.45) for i in range(n)}
    large = (0.1, 0.9)

    def summary_of(rid, batch):
        probs = small[rid] if batch.model == "s" else large
        nxt = (("l", 12),) if batch.model == "s" else ()  # pruning: 30 tokens -> 12
        return StepSummary(max(probs), None, probs, nxt, 18 if batch.model == "s" else 0)

    policy = _policy()
    cells = []
    orig = policy.on_completion

    def spy(batch, now, summaries=None):
        cells.append((batch.model, batch.cell.seq))
        orig(batch, now, summaries)

    policy.on_completion = spy
    r = simulate(policy, trace, COST, instances=1, summary_of=summary_of)
    assert all(OUTCOMES[o] == "ok" for o in r.outcome)
    assert ("l", 16) in cells and ("l", 32) not in cells  # the pruned input's bucket
    assert ("s", 32) in cells
    answers = [policy.describe_request(i) for i in range(n)]
    for i, a in enumerate(answers):
        if i % 2 == 0:
            assert a["levels"] == ["s"] and a["label"] == "neg" and a["pruned_tokens"] == 0
        else:
            assert a["levels"] == ["s", "l"] and a["pruned_tokens"] == 18
            expect = ensemble([np.array(small[i]), np.array(large)], (1.0, 3.0))
            assert a["probabilities"] == pytest.approx(expect.tolist())
            assert a["label"] == "pos"
    assert policy.describe_request(0) == {}  # described once: the policy forgot it
    metrics = {(name, labels.get("level")): v for name, labels, v in policy.metrics()}
    assert metrics[("exit_share", "0")] == pytest.approx(0.5)
    assert metrics[("pruned_token_share", None)] == pytest.approx(18 / 30)
    # the finishes came with the small step, not one at the end: the small answers are fast
    lat = r.latencies()
    assert lat[0] < 0.01 and lat[1] > 0.01


def test_the_same_request_seed_is_routed_the_same_way():
    def route_of(seed):
        policy = _policy(c=0.6, k=2.0)  # a soft slope: the draw matters
        policy.on_arrival(Request(1, 0.0, "s", "t", 10, seed=seed), 0.0)
        plan = policy.plan(0.006, [0])  # after the batching's 5 ms wait
        policy.on_completion(plan.batches[0], 0.01, {1: StepSummary(0.9, None, (0.9, 0.1))})
        return policy.plan(0.01, [0])

    routes = [route_of(s) for s in range(40)]
    again = [route_of(s) for s in range(40)]
    assert [bool(p.finish) for p in routes] == [bool(p.finish) for p in again]
    assert 0 < sum(bool(p.finish) for p in routes) < 40  # some returned, some went on


def test_withdrawn_and_unknown_requests():
    policy = _policy()
    policy.on_arrival(Request(1, 0.0, "s", "t", 10), 0.0)
    assert policy.withdraw(1, 0.0) and policy.queue_depth() == 0
    assert not policy.withdraw(1, 0.0)
    with pytest.raises(KeyError, match="unknown task"):
        policy.on_arrival(Request(2, 0.0, "s", "other", 10), 0.0)
    with pytest.raises(ValueError, match="starts on"):
        policy.on_arrival(Request(3, 0.0, "l", "t", 10), 0.0)
    with pytest.raises(ValueError, match="not served"):
        TabiPolicy({"t": Candidate("t", ("s", "x"), (0.9,))}, {"s": GRID}, COST, {"t": ("a", "b")})


def test_replay_gives_each_level_its_recorded_outputs_and_the_pruned_lengths():
    from jaxserve.sched.base import Batch
    from jaxserve.sched.tabi import Replay

    arrays = {"labels": np.array([0, 1]),
              "probs/s": np.array([[0.9, 0.1], [0.6, 0.4]]), "length/s": np.array([20, 30]),
              "probs/l": np.array([[0.8, 0.2], [0.3, 0.7]]), "length/l": np.array([22, 33]),
              "probs/l|pruned-by|s": np.array([[0.7, 0.3], [0.2, 0.8]]), "length/l|pruned-by|s": np.array([15, 25])}
    pruning = Candidate("t", ("s", "l"), (0.8,), 10.0, 0.7)
    replay = Replay(arrays, pruning, items=np.array([1, 0]))  # request 0 is item 1
    assert replay.first_lengths().tolist() == [30, 20]
    small = replay(0, Batch((0,), "s", Cell(1, 32)))
    assert small.probabilities == (0.6, 0.4) and small.top_probability == 0.6
    assert small.next_lengths == (("l", 25),) and small.pruned_tokens == 33 - 25
    assert replay(0, Batch((0,), "l", Cell(1, 32))).probabilities == (0.2, 0.8)  # on the pruned text
    plain = Replay(arrays, Candidate("t", ("s", "l"), (0.8,)), items=np.array([1, 0]))
    assert plain(0, Batch((0,), "s", Cell(1, 32))).next_lengths == (("l", 33),)
    assert plain(0, Batch((0,), "l", Cell(1, 32))).probabilities == (0.3, 0.7)


def test_the_pareto_set_keeps_every_choice_selection_can_make():
    from jaxserve.sched.tabi import pareto

    data, labels = _synthetic()
    cands = profile_candidates("t", [("s",), ("l",), ("s", "l")], data, labels)
    front = pareto(cands)
    assert len(front) < len(cands)
    for target in np.linspace(0.6, 1.0, 41):
        for bound in (math.inf, 5.0, 2.0):
            try:
                expect = select(cands, target, bound)
            except ValueError:
                continue
            got = select(front, target, bound)
            assert (got.accuracy, got.cost) == (expect.accuracy, expect.cost)
    assert {c.levels for c in front if len(c.levels) == 1} == {("s",), ("l",)}


def test_cocktail_runs_every_model_on_every_request_and_answers_their_accuracy_weighted_mean():
    from jaxserve.sched.tabi import TaskProfile, choose, cocktail

    singles = (Candidate("t", ("l",), accuracy=0.9, cost=0.01), Candidate("t", ("s",), accuracy=0.6, cost=0.001))
    profile = TaskProfile(("neg", "pos"), 0.85, singles + (Candidate("t", ("s", "l"), (0.8,), accuracy=0.88,
                                                                     cost=0.005),))
    cand = choose("tabi-cocktail", profile)
    assert cand == cocktail(singles)
    assert cand.levels == ("s", "l")  # cheapest first
    assert cand.thresholds == (1.0,) and cand.alpha is None
    assert cand.weights[-1] == (0.6, 0.9)
    assert cand.cost == pytest.approx(0.011)
    policy = TabiPolicy({"t": cand}, {"s": GRID, "l": GRID}, COST, {"t": ("neg", "pos")})
    n = 12
    trace = make_trace(np.arange(n) * 1.0, model="s", length=30, slo_s=10.0, task="t")
    small, large = (0.999, 0.001), (0.3, 0.7)  # however confident the small model, the large one runs

    def summary_of(rid, batch):
        probs = small if batch.model == "s" else large
        return StepSummary(max(probs), None, probs, (("l", 30),) if batch.model == "s" else (), 0)

    r = simulate(policy, trace, COST, instances=1, summary_of=summary_of)
    assert all(OUTCOMES[o] == "ok" for o in r.outcome)
    expect = (0.6 * np.array(small) + 0.9 * np.array(large)) / 1.5
    for i in range(n):
        a = policy.describe_request(i)
        assert a["levels"] == ["s", "l"]
        assert a["probabilities"] == pytest.approx(expect.tolist())
    assert policy.exits["t"] == [0, n]
    with pytest.raises(ValueError, match="at least one"):
        cocktail(())


def test_selection_pays_for_the_noise_of_a_candidates_estimate():
    """The winner's-curse guard: a candidate that differs from the large model on many items
    must clear the target by SELECT_Z standard errors of that paired difference."""
    from jaxserve.sched.tabi import SELECT_Z, paired_se

    ref = np.array([1.0, 1.0, 0.0, 1.0] * 500)
    same = ref.copy()
    assert paired_se(same, ref) == 0.0
    flips = ref.copy()
    flips[:200] = 1.0 - flips[:200]  # differs on 10% of the items
    d = flips - ref
    assert paired_se(flips, ref) == pytest.approx(d.std(ddof=1) / np.sqrt(len(d)))
    lucky = Candidate("t", ("s", "l"), (0.5,), accuracy=0.90, cost=1.0, accuracy_se=0.01)
    steady = Candidate("t", ("s", "l"), (0.8,), accuracy=0.895, cost=2.0, accuracy_se=0.001)
    large = Candidate("t", ("l",), accuracy=0.90, cost=10.0)
    assert lucky.assured == pytest.approx(0.90 - SELECT_Z * 0.01)
    assert select([lucky, steady, large], 0.89) is steady  # the cheaper one's 0.90 is not assured
    assert select([lucky, steady, large], 0.85) is lucky
    assert select([lucky, steady, large], 0.899) is large
