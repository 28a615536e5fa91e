"""AsyFunc served live (``serve --policy asyfunc|asyfunc-nolls|asyfunc-batch``), through HTTP on
loopback, with the real MiniLM-L6 weights: a burst makes the policy add a shadow, load its block and
split batches across body and shadow; every answer equals the unsplit model's; the shadow is
released once the burst has passed; the policy's cores and bytes are in /metrics; BATCH and
AsyFunc⁻ never add a shadow; a text longer than the profiled bucket is refused with the limit.
test_asyfunc_serving_on_ray.py runs this module again with Ray workers, where the shadow is the
node's warm pool actor.

The layer profile is this module's (input data, like a cost model): prices at which a body of one
core gains from a one-core shadow at the block [2:4), on a bucket of 16 tokens, scaled to tens of
seconds against a 60 s SLO: a batch of 4 alone misses it and split meets it, so a body splits
(it runs alone whenever alone meets the deadline), while the real steps take milliseconds. The
decisions tested are the policy's, not the clock's."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from jaxserve.launch import ServeSettings
from support import LiveServer, _series, _until, workers_in_use

MODEL, L, SEQ = "minilm-l6", 6, 16
SENTENCES = ["the flight was late again", "great service, thank you!", "lost my bag at the airport",
             "a quiet and pleasant trip", "why is boarding so slow", "seat 12c is broken",
             "the crew was kind", "never flying with them again", "smooth landing", "food was cold",
             "gate changed twice", "helpful staff at check-in"]


SCALE = 1600  # profile ms -> modelled ms (module docstring)


def per_row(ms_per_row: float, fixed_ms: float = 0.0) -> dict:
    return {str(b): SCALE * (fixed_ms + ms_per_row * b) / 1e3 for b in (1, 2, 4)}


def layer_profile() -> dict:
    """Latency grows with rows; the block [2:4) is a third of the layers' cost, so a shadow
    that takes part of a batch of 4 lowers its latency (4 rows at one core: 64 s alone, past the
    60 s SLO, and 51.2 s split; 3 rows alone 48 s)."""
    stages = {MODEL: per_row(10.0), f"{MODEL}[0:2]": per_row(3.0), f"{MODEL}[2:4]": per_row(4.0),
              f"{MODEL}[4:6]": per_row(3.0)}
    return {"models": {MODEL: {
        "num_layers": L, "seq": SEQ, "param_bytes": 90_261_504, "load_s": 0.2, "row_bytes": SEQ * 384 * 4 + SEQ * 4,
        "splits": [{"start": 2, "stop": 4, "bytes": 3_550_000, "load_s": 0.01}],
        "latency": {"1": stages, "2": {k: {b: t / 2 for b, t in v.items()} for k, v in stages.items()}}}}}


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("asyfunc") / "cost_model.layers.json"
    path.write_text(json.dumps(layer_profile()))
    return str(path)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("asyfunc-cache"))


def settings_for(policy: str, profile_path: str, cache_dir: str, correct_prices: bool = False) -> ServeSettings:
    """One body on a node of 2 cores: of 1 core (BATCH: of its fixed configuration, 2).
    ``correct_prices`` off by default: the hand-made profile makes a split pay, which the
    measured prices of this model at 16 tokens (and a step's overhead) need not."""
    return ServeSettings(models=(MODEL,), cache_dir=cache_dir, policy=policy, instances=1, progress=False,
                         tune=False, layer_profile=profile_path, asyfunc_node_cores=2, slo_ms=60_000, max_queue=64,
                         asyfunc_body_cores=None if policy == "asyfunc-batch" else 1, correct_prices=correct_prices,
                         asyfunc_period_s=3600)  # no MLS period within a test: its rates are the profile's


def embeddings(client: httpx.Client, texts: list[str]) -> np.ndarray:
    r = client.post("/v1/embeddings", json={"model": MODEL, "input": texts})
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], np.float64)


def gauge(url: str, name: str, **labels) -> float | None:
    label = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return _series(url, f"jaxserve_policy_{name}" + (f"{{{label}}}" if label else ""))


def engine_heard_load(engine, block: str, wid: int, timeout_s: float = 30) -> bool:
    """Whether the engine recorded ``block`` loaded on worker ``wid`` (and so told the policy)
    within ``timeout_s``. The worker's metric turns 1 when the worker holds the block, a moment
    before the engine's loop hears it: wait for the engine, the later of the two."""
    return _until(lambda: any(label == block and w == wid for label, w, _ in list(engine.stats.stage_loads)),
                  timeout_s=timeout_s)


def test_a_burst_adds_a_shadow_splits_batches_answers_as_the_whole_model_and_releases_it(profile_path, cache_dir):
    with LiveServer(settings_for("asyfunc", profile_path, cache_dir)) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as c:
        assert gauge(srv.url, "asyfunc_instances", kind="body") == 1.0
        assert gauge(srv.url, "asyfunc_instances", kind="shadow") == 0.0
        assert gauge(srv.url, "asyfunc_cores", kind="body") == 1.0
        first = embeddings(c, SENTENCES)  # 12 items at once: the queue passes gamma = 2
        engine = srv.app.state.jaxserve.engine
        shadows = [d for d in engine.policy.decisions if d[1] == "add_shadow"]
        assert len(shadows) == 1 and shadows[0][3] == 1  # one shadow, of one core
        sid = shadows[0][2]
        # its block loads meanwhile (a Ray pool actor takes about a second, longer than the burst)
        block = f'jaxserve_worker_stage{{stage="{MODEL}[2:4]",worker="{sid}"}}'
        assert _until(lambda: _series(srv.url, block) == 1.0, timeout_s=120)
        assert engine_heard_load(engine, f"{MODEL}[2:4]", sid)
        second = embeddings(c, SENTENCES)  # the next burst finds the pair ready
        assert gauge(srv.url, "asyfunc_split_batches") >= 1.0
        assert [d for d in engine.policy.decisions if d[1] == "add_shadow"] == shadows  # the same shadow
        # the same texts one at a time: batches of one, never split, the whole model's executables
        alone = np.concatenate([embeddings(c, [t]) for t in SENTENCES])
        np.testing.assert_allclose(first, alone, atol=1e-5)
        np.testing.assert_allclose(second, alone, atol=1e-5)
        # the burst is over: the shadow goes after shadow_idle_s (5 s) idle, and its worker with it
        assert _until(lambda: gauge(srv.url, "asyfunc_instances", kind="shadow") == 0.0, timeout_s=30)
        assert _until(lambda: sid not in engine.workers, timeout_s=30)
        assert gauge(srv.url, "asyfunc_cores", kind="shadow") == 0.0
        assert gauge(srv.url, "asyfunc_param_bytes", kind="body") == 90_261_504
        assert _series(srv.url, "jaxserve_compilations_since_ready") == 0.0
        # under --workers ray (test_asyfunc_serving_on_ray.py) the shadow came from the warm pool actor
        kinds = {w.kind for w in engine.workers.values()}
        assert kinds == ({"thread"} if workers_in_use() == "thread" else {"ray"})
        if workers_in_use() == "ray":
            assert engine.worker_factory.shadows_from_pool == 1


@pytest.mark.parametrize("policy", ["asyfunc-batch", "asyfunc-nolls"])
def test_without_layer_level_scaling_a_burst_never_adds_a_shadow(policy, profile_path, cache_dir):
    """... and, with price correction on, the policy measures its steps against the profile
    and, after its first ``min_steps`` steps, plans with what it measured once that differs
    (the hand-made profile is far off). Three bursts: at least 3 steps each."""
    with LiveServer(settings_for(policy, profile_path, cache_dir, correct_prices=True)) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as c:
        for _ in range(3):
            burst = embeddings(c, SENTENCES)
            assert burst.shape == (len(SENTENCES), 384)
        engine = srv.app.state.jaxserve.engine
        assert not [d for d in engine.policy.decisions if d[1] == "add_shadow"]
        assert gauge(srv.url, "asyfunc_split_batches") == 0.0
        assert sorted(engine.workers) == [0]
        assert gauge(srv.url, "asyfunc_cores", kind="body") == (2 if policy == "asyfunc-batch" else 1)
        steps = gauge(srv.url, "asyfunc_measured_steps")
        assert steps >= max(3 * len(SENTENCES) / 4, engine.policy.prices.min_steps) and steps == engine.stats.steps
        measured, planned = gauge(srv.url, "asyfunc_measured_scale"), gauge(srv.url, "asyfunc_price_scale")
        assert measured != 1.0
        assert (planned == 1.0) == (gauge(srv.url, "asyfunc_reprices") == 0.0)
        assert abs(measured / planned - 1) <= 0.05  # within the tracker's step of what it plans with
        assert gauge(srv.url, "asyfunc_measured_price_sigma") > 0.0  # real steps never land on one price


def test_without_slo_ms_every_request_gets_the_policy_s_slo_as_its_deadline(profile_path, cache_dir):
    """AsyFunc plans every request against one SLO (default: 3x the whole model at (c_max, b_max),
    here 3 x 32 s): a request that sends no slo_ms gets it as its deadline."""
    import dataclasses

    settings = dataclasses.replace(settings_for("asyfunc", profile_path, cache_dir), slo_ms=None)
    with LiveServer(settings) as srv:
        engine = srv.app.state.jaxserve.engine
        assert engine.policy.knobs.slo_s == pytest.approx(3 * 0.020 * SCALE)
        assert engine.default_slo_ms == pytest.approx(3 * 20.0 * SCALE)


def test_a_request_longer_than_the_profiled_bucket_is_refused_with_the_limit(profile_path, cache_dir):
    with LiveServer(settings_for("asyfunc", profile_path, cache_dir)) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as c:
        r = c.post("/v1/embeddings", json={"model": MODEL, "input": ["word " * 80]})
        assert r.status_code == 413, r.text
        assert str(SEQ) in r.text
        assert c.get("/readyz").status_code == 200




# ------------------------------------------------------------------ Ray: the pool shadow's faults and reloads

def last_block_profile() -> dict:
    """The profile above with the shadow's block at the end, [4:6): the shadow's step is final and
    applies the task heads itself."""
    raw = layer_profile()
    p = raw["models"][MODEL]
    p["splits"] = [{"start": 4, "stop": 6, "bytes": 3_550_000, "load_s": 0.01}]
    for stages in p["latency"].values():
        stages[f"{MODEL}[0:4]"] = {b: t * 7 / 3 for b, t in stages.pop(f"{MODEL}[0:2]").items()}
        stages[f"{MODEL}[4:6]"] = stages.pop(f"{MODEL}[2:4]")
    return raw


def shadow_ready(srv, block: str) -> int:
    """The id of the policy's one shadow, once its worker holds ``block``."""
    engine = srv.app.state.jaxserve.engine
    assert _until(lambda: len(engine.policy.shadows()) == 1, timeout_s=30)
    sid = engine.policy.shadows()[0].id
    metric = f'jaxserve_worker_stage{{stage="{block}",worker="{sid}"}}'
    assert _until(lambda: _series(srv.url, metric) == 1.0, timeout_s=120)
    assert engine_heard_load(engine, block, sid)
    return sid


def classify(client: httpx.Client, texts: list[str]) -> list[tuple[str, dict]]:
    r = client.post("/v1/classify/text", json={"task": "sentiment", "inputs": texts})
    assert r.status_code == 200, r.text
    return [(x["label"], x["probabilities"]) for x in r.json()["results"]]


def same_answers(got, want) -> None:
    assert [label for label, _ in got] == [label for label, _ in want]
    for (_, p), (_, q) in zip(got, want):
        assert set(p) == set(q) and all(abs(p[k] - q[k]) < 1e-5 for k in p)


def test_a_killed_ray_shadow_s_rows_are_recomputed_by_its_body_and_answered_once(profile_path, cache_dir):
    import dataclasses

    settings = dataclasses.replace(settings_for("asyfunc", profile_path, cache_dir), workers="ray")
    with LiveServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        alone = np.concatenate([embeddings(c, [t]) for t in SENTENCES])
        embeddings(c, SENTENCES)  # the burst that starts the shadow
        sid = shadow_ready(srv, f"{MODEL}[2:4]")
        engine = srv.app.state.jaxserve.engine
        # the server's start wrote the block's own checkpoint: the pool actor read that, not the model
        from jaxserve.asyfunc_exec import block_dir
        from jaxserve.keys_manager import recorded_digest
        from jaxserve.sched.base import Stage

        assert recorded_digest(block_dir(cache_dir, Stage(MODEL, 2, 4, L))) is not None
        engine.workers[sid].kill()  # its process ends; the policy still pairs it with the body
        answers = c.post("/v1/embeddings", json={"model": MODEL, "input": SENTENCES}).json()["data"]
        assert len(answers) == len(SENTENCES) and [a["index"] for a in answers] == list(range(len(SENTENCES)))
        np.testing.assert_allclose(np.array([a["embedding"] for a in answers]), alone, atol=1e-5)
        assert engine.stats.retries >= 1 and engine.stats.outcomes["error"] == 0
        assert gauge(srv.url, "asyfunc_split_batches") >= 1.0


def test_a_ray_shadow_holding_the_last_block_answers_with_reloaded_heads(tmp_path, cache_dir):
    import dataclasses
    import shutil

    from jaxserve.registry import ASSETS
    from jaxserve.runtime import TaskHead

    heads = tmp_path / "heads"
    heads.mkdir()
    shutil.copy(ASSETS / "heads" / MODEL / "sentiment.npz", heads / "sentiment.npz")
    profile = tmp_path / "cost_model.layers.json"
    profile.write_text(json.dumps(last_block_profile()))
    settings = dataclasses.replace(settings_for("asyfunc", str(profile), cache_dir), workers="ray",
                                   heads_dir=str(heads))
    with LiveServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        classify(c, SENTENCES)  # the burst that starts the shadow
        shadow_ready(srv, f"{MODEL}[4:6]")
        before = classify(c, SENTENCES)
        same_answers(before, [classify(c, [t])[0] for t in SENTENCES])
        # the head retrained: here, the old one negated, so every label moves
        old = TaskHead.load("sentiment", heads / "sentiment.npz")
        dataclasses.replace(old, weight=-old.weight, bias=-old.bias).save(heads / "sentiment.npz")
        assert c.post("/admin/reload").status_code == 200
        splits = gauge(srv.url, "asyfunc_split_batches")
        after = classify(c, SENTENCES)
        assert gauge(srv.url, "asyfunc_split_batches") > splits  # the shadow's heads answered some rows
        same_answers(after, [classify(c, [t])[0] for t in SENTENCES])
        assert [label for label, _ in after] != [label for label, _ in before]
