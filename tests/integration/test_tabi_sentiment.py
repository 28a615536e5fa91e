"""The Tabi cascade as shipped answers everyday sentences as well as the default head must.

``serve --policy tabi`` on 127.0.0.1 with the ``sentiment`` task's candidate chosen from the shipped
cascade profile (jaxserve/profiles/cascade.json, ``choose("tabi", ...)``: its models, cut-offs, k,
alpha and ensemble weights) and every level's shipped ``sentiment`` head, on real weights. The
hold-out sentences (tests/fixtures/sentiment_holdout.json) were written before any recipe was
chosen and are never used for training or selection (the heads' recipes are chosen on
sentiment_dev.json, the cascade's thresholds on the task's validation split).
"""

from __future__ import annotations

import json

import httpx
import pytest

from jaxserve.launch import ServeSettings
from jaxserve.registry import PROFILES
from jaxserve.sched.base import ShapeGrid
from jaxserve.sched.tabi import choose, load_cascade_profile
from tests.integration.test_sentiment_quality import sentences
from tests.support import LiveServer, _series

GRID = ShapeGrid(batch_sizes=(1, 8), seq_buckets=(16, 32, 64))


@pytest.fixture(scope="module")
def shipped():
    profile = load_cascade_profile(PROFILES / "cascade.json")
    assert "sentiment" in profile, "the shipped cascade profile serves the sentiment task"
    return profile["sentiment"], choose("tabi", profile["sentiment"])


@pytest.fixture(scope="module")
def server(tmp_path_factory, shipped):
    task, cand = shipped
    tmp = tmp_path_factory.mktemp("tabi-sentiment")
    path = tmp / "cascade.json"
    path.write_text(json.dumps({"tasks": {"sentiment": {
        "labels": list(task.labels), "target_accuracy": task.target_accuracy, "candidates": [cand.to_json()]}}}))
    settings = ServeSettings(policy="tabi", cascade_profile=str(path), cache_dir=str(tmp / "cache"), text_grid=GRID,
                             instances=2, progress=False, tune=False)
    with LiveServer(settings) as srv:
        yield srv


def test_the_shipped_cascade_is_a_cascade():
    profile = load_cascade_profile(PROFILES / "cascade.json")
    cand = choose("tabi", profile["sentiment"])
    assert len(cand.levels) >= 2 and cand.levels[-1] == "mpnet-base"


def test_the_tabi_cascade_gets_90_percent_of_holdout_sentences(server, shipped):
    _, cand = shipped
    texts, labels = sentences("sentiment_holdout")
    r = httpx.post(server.url + "/v1/classify/text", json={"task": "sentiment", "inputs": texts}, timeout=300)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == len(texts)
    wrong = [(t, want, res["label"], res["levels"]) for t, want, res in zip(texts, labels, results)
             if res["label"] != want]
    accuracy = 1.0 - len(wrong) / len(texts)
    assert accuracy >= 0.90, f"{accuracy:.3f} on {len(texts)} hold-out sentences; wrong: {wrong}"
    for res in results:
        assert tuple(res["levels"]) == cand.levels[: len(res["levels"])]
        assert set(res["probabilities"]) == {"negative", "neutral", "positive"}
    ran = {len(res["levels"]) for res in results}
    print(f"levels run: {sorted(ran)}; accuracy {accuracy:.3f}")
    assert _series(server.url, "jaxserve_compilations_since_ready") == 0
