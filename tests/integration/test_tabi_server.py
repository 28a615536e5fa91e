"""serve --policy tabi on 127.0.0.1: a MiniLM-L3 -> MiniLM-L6 cascade with their shipped heads, real
weights, the importance executable, word pruning, the ensemble, /metrics, bad input and a drain."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from jaxserve.datasets import text_task_split
from jaxserve.launch import ServeSettings
from jaxserve.sched.base import ShapeGrid
from jaxserve.sched.tabi import Candidate, ensemble
from tests.support import LiveServer, _series

L3, L6 = "minilm-l3", "minilm-l6"
WEIGHTS = ((1.0,), (0.3, 0.7))
# c = 1 sends every request on (pruned at alpha 1.0); "nohead" has no head at either level
CANDIDATES = {
    "reviews": Candidate("reviews", (L3, L6), (1.0,), 10.0, 1.0, WEIGHTS, 0.8, 0.01),
    "nohead": Candidate("nohead", (L3, L6), (0.9,), 10.0, None, WEIGHTS, 0.9, 0.01),
}
LABELS = {"reviews": ["negative", "positive"], "nohead": ["a", "b"]}
GRID = ShapeGrid(batch_sizes=(1, 4), seq_buckets=(16, 32, 64))


def _settings(tmp, candidates, cache) -> ServeSettings:
    profile = {"tasks": {t: {"labels": LABELS[t], "target_accuracy": 0.5, "candidates": [c.to_json()]}
                         for t, c in candidates.items()}}
    path = tmp / f"cascade-{len(list(tmp.glob('cascade-*')))}.json"
    path.write_text(json.dumps(profile))
    return ServeSettings(policy="tabi", cascade_profile=str(path), cache_dir=str(cache), text_grid=GRID,
                         instances=2, progress=False, tune=False)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("tabi")


@pytest.fixture(scope="module")
def server(workdir):
    with LiveServer(_settings(workdir, CANDIDATES, workdir / "cache")) as srv:
        yield srv


def _classify(srv, **body):
    return httpx.post(srv.url + "/v1/classify/text", json=body, timeout=120)


REVIEWS = text_task_split("reviews", "test")[0][:12]


def test_every_rerouted_answer_ran_both_levels_on_a_pruned_input_and_blends_them(server):
    r = _classify(server, task="reviews", inputs=REVIEWS)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tabi"
    for result in body["results"]:
        assert result["levels"] == [L3, L6]
        assert set(result["probabilities"]) == {"negative", "positive"}
        assert abs(sum(result["probabilities"].values()) - 1) < 1e-5
        assert result["label"] == max(result["probabilities"], key=result["probabilities"].get)
        assert 0.5 <= result["confidence"] <= 1.0
        assert result["meta"]["outcome"] == "ok"
    assert sum(res["pruned_tokens"] for res in body["results"]) > 0  # alpha 1.0 pruned words
    # the same texts again: the same answers (the draw is seeded by the text): the same words
    # pruned and the same labels; probabilities to float32 rounding, since a request may share its
    # batch (and so its padded executable) with other requests this time
    again = _classify(server, task="reviews", inputs=REVIEWS).json()
    assert [a["pruned_tokens"] for a in again["results"]] == [b["pruned_tokens"] for b in body["results"]]
    assert [a["label"] for a in again["results"]] == [b["label"] for b in body["results"]]
    for a, b in zip(again["results"], body["results"]):
        assert a["probabilities"].keys() == b["probabilities"].keys()
        assert all(abs(a["probabilities"][k] - b["probabilities"][k]) < 1e-5 for k in a["probabilities"])


def test_confident_requests_return_at_the_first_level(workdir, server):
    """c = 0 with a steep slope: a request goes on only below 50% confidence, so the confident
    reviews stop at MiniLM-L3 (a second server on the same compile cache: nothing compiles)."""
    steep = {"reviews": Candidate("reviews", (L3, L6), (0.0,), 50.0, 1.0, WEIGHTS, 0.8, 0.01)}
    with LiveServer(_settings(workdir, steep, workdir / "cache")) as srv:
        r = _classify(srv, task="reviews", inputs=REVIEWS)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert _series(srv.url, "jaxserve_compilations_since_ready") == 0
    levels = [tuple(res["levels"]) for res in results]
    assert (L3,) in levels
    for res in results:
        if res["levels"] == [L3]:
            assert res["pruned_tokens"] == 0 and res["confidence"] > 0.5


def test_metrics_show_the_share_returning_at_each_level_and_the_pruned_share(server):
    _classify(server, task="reviews", inputs=REVIEWS[:4])
    share = _series(server.url, f'jaxserve_policy_exit_share{{level="1",model="{L6}",task="reviews"}}')
    assert share == 1.0
    assert _series(server.url, "jaxserve_policy_pruned_token_share") > 0
    assert _series(server.url, "jaxserve_compilations") is not None


def test_bad_input_is_refused_with_the_field_and_the_limit(server):
    r = _classify(server, task="nosuchtask", inputs=["hello"])
    assert r.status_code == 404 and "nosuchtask" in r.text and "reviews" in r.text
    r = _classify(server, task="nohead", inputs=["hello"])
    assert r.status_code == 404 and "no 'nohead' head" in r.json()["error"]["message"]
    r = _classify(server, model=L6, task="reviews", inputs=["hello"])
    assert r.status_code == 404 and "'tabi'" in r.json()["error"]["message"]
    long = "wonderful " * 100
    r = _classify(server, task="reviews", inputs=["fine", long])
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["field"] == "inputs[1]" and "64 tokens" in err["message"]
    r = _classify(server, task="reviews", inputs=[long], truncate=True)
    assert r.status_code == 200 and r.json()["results"][0]["levels"] == [L3, L6]


def test_the_ensemble_is_the_weighted_mean_of_the_levels(server):
    """The answer's probabilities are w * p_L6 + (1 - w) * p_L3 on the candidate's weights:
    recompute both levels' probabilities from the runtimes the server holds."""
    from jaxserve.cascade import CascadeText
    from jaxserve.sched.base import Cell

    engine = server.app.state.jaxserve.engine
    text = REVIEWS[0]
    answer = _classify(server, task="reviews", inputs=[text]).json()["results"][0]
    rt3, rt6 = engine.runtimes[L3], engine.runtimes[L6]
    ids3 = rt3.tokenizer.encode([text])[0]
    first = rt3.execute(Cell(1, 64), [CascadeText(text, tuple(ids3), 1.0, (L6,), (64,))], ["reviews"]).items[0]
    nxt = first["_next"][L6]
    second = rt6.execute(Cell(1, 64), [nxt], ["reviews"]).items[0]
    expect = ensemble([first["probabilities"], second["probabilities"]], WEIGHTS[1])
    got = [answer["probabilities"][label] for label in ("negative", "positive")]
    assert np.allclose(got, expect, atol=1e-4)
    assert answer["pruned_tokens"] == first["pruned_tokens"]


def test_requests_rerouted_while_the_server_drains_are_all_answered(server):
    """Drain starts while cascade requests are in flight (some between their levels): each
    accepted request still gets exactly one answer, with both levels. Last: the server drains."""
    engine = server.app.state.jaxserve.engine
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_classify, server, task="reviews", inputs=[t]) for t in REVIEWS]
        while engine.in_flight == 0 and not all(f.done() for f in futures):
            time.sleep(0.001)
        asyncio.run_coroutine_threadsafe(engine.drain(), engine._loop).result(120)
        results = [f.result() for f in futures]
    accepted = [r for r in results if r.status_code == 200]
    assert accepted, "the drain refused everything"
    assert all(r.status_code in (200, 503) for r in results)
    for r in accepted:
        assert r.json()["results"][0]["levels"] == [L3, L6]
    assert engine.in_flight == 0
