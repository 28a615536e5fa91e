"""The live engine with requests of more than one step, on real executables and weights:
a pipeline of MiniLM layer ranges on two thread workers, a cascade that finishes confident
requests early, held requests withdrawn or evicted, placement changes carried out, and a
failing worker's step retried on another that holds its stage. The same policy objects
run in the simulator (tests/unit/test_sim_steps.py)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from jaxserve.engine import Answer, Engine, ExecutionFailed, Item
from jaxserve.registry import load_image_runtime, load_text_runtime
from jaxserve.sched.base import PlacementChange, Plan, ShapeGrid, Stage
from jaxserve.sched.pipeline import PipelineBatching
from jaxserve.stages import build_stage_runtimes, split_stages
from jaxserve.workers import ThreadWorker
from support import SmallThenBig

GRID = ShapeGrid(batch_sizes=(1, 4), seq_buckets=(16, 32))
SENTENCES = ["the flight was late again", "great service, thank you!", "lost my bag at the airport",
             "a quiet and pleasant trip", "why is boarding so slow", "seat 12c is broken"]


@pytest.fixture(scope="module")
def text():
    rt = load_text_runtime("minilm-l6", None, GRID, tune=False)
    stages = split_stages("minilm-l6", rt.num_layers, (3,))
    runners = build_stage_runtimes(rt, stages, None)
    return rt, stages, runners


def catalog_of(rt, runners):
    whole = Stage(rt.name, 0, rt.num_layers, rt.num_layers)

    def catalog(stage):
        return rt if stage == whole else runners[stage]
    return catalog


def items_of(rt, sentences, **kw):
    return [Item(rt.name, ids, len(ids), **kw) for ids in rt.tokenizer.encode(sentences)]


def whole_embeddings(rt, sentences):
    ids = rt.tokenizer.encode(sentences)
    out = []
    for x in ids:
        cell = rt.grid.cell_for(1, len(x))
        out.append(rt.execute(cell, [x], [""]).items[0]["embedding"])
    return np.stack(out)


def test_a_two_stage_pipeline_on_two_workers_answers_as_the_whole_model(text):
    rt, (s0, s1), runners = text
    catalog = catalog_of(rt, runners)

    async def scenario():
        workers = [ThreadWorker(0, catalog, [s0]), ThreadWorker(1, catalog, [s1])]
        policy = PipelineBatching({rt.name: (s0, s1)}, {rt.name: GRID})
        engine = Engine({rt.name: rt}, policy, workers=workers, catalog=catalog)
        answers = await asyncio.gather(*engine.submit(items_of(rt, SENTENCES)))
        assert engine.in_flight == 0
        engine.close()
        return answers, engine

    answers, engine = asyncio.run(scenario())
    assert [a.outcome for a in answers] == ["ok"] * len(SENTENCES)
    got = np.stack([a.outputs["embedding"] for a in answers])
    np.testing.assert_allclose(got, whole_embeddings(rt, SENTENCES), atol=1e-5)
    # each request ran two steps: one on each worker; two final batches or more
    assert engine.stats.steps >= 2 * math.ceil(len(SENTENCES) / GRID.max_batch)
    assert engine.stats.steps > engine.stats.batches
    assert all(a.compute_ms > 0 for a in answers)


def test_held_requests_can_be_withdrawn_and_evicted_between_steps(text):
    rt, (s0, s1), runners = text
    catalog = catalog_of(rt, runners)

    class StopAfterFirst(PipelineBatching):
        """Runs stage 0 only; then holds, and evicts held requests whose deadline passed."""

        def plan(self, now, idle):
            p = super().plan(now, [w for w in idle if w == 0])
            return p

    async def scenario():
        workers = [ThreadWorker(0, catalog, [s0]), ThreadWorker(1, catalog, [s1])]
        policy = StopAfterFirst({rt.name: (s0, s1)}, {rt.name: GRID})
        engine = Engine({rt.name: rt}, policy, workers=workers, catalog=catalog)
        keep = engine.submit(items_of(rt, SENTENCES[:2], slo_ms=300))
        leave = engine.submit(items_of(rt, SENTENCES[2:3]))
        for _ in range(400):  # until both submissions are held at stage 1 (event-driven: no sleep asserts)
            await asyncio.sleep(0.005)
            if len(engine._held) == 3:
                break
        assert len(engine._held) == 3 and engine.queue_depth == 0
        assert engine.withdraw(leave) == 1 and leave[0].cancelled()
        answers = await asyncio.gather(*keep)  # evicted at their 300 ms deadline, still held
        assert engine.in_flight == 0
        engine.close()
        return answers, engine

    answers, engine = asyncio.run(scenario())
    assert [a.outcome for a in answers] == ["evicted", "evicted"]
    assert engine.stats.outcomes["withdrawn"] == 1


def test_a_cascade_finishes_confident_requests_with_the_small_models_answer():
    rt = load_image_runtime("vit-demo", None, ShapeGrid((4,)), tune=False)
    rng = np.random.default_rng(0)
    images = [rng.random(rt.image_shape, dtype=np.float32) for _ in range(8)]

    async def scenario(threshold):
        policy = SmallThenBig(threshold, batch=4)
        engine = Engine({"small": rt, "big": rt}, policy, instances=2)
        answers = await asyncio.gather(*engine.submit([Item("small", im, task="digits") for im in images]))
        engine.close()
        return answers, policy

    answers, policy = asyncio.run(scenario(threshold=0.0))  # everything is confident enough
    assert policy.next == [] and len(policy.summaries) == 8
    for a, (rid, s) in zip(answers, sorted(policy.summaries.items())):
        assert a.outcome == "ok" and a.outputs["label"] == s.label
        assert max(a.outputs["probabilities"]) == pytest.approx(s.top_probability)
    answers, policy = asyncio.run(scenario(threshold=1.01))  # nothing is: all go on to "big"
    assert sorted(policy.summaries) == list(range(8))
    assert all(a.outcome == "ok" and a.batch_size == 4 for a in answers)


def test_placement_changes_are_carried_out_and_timed(text):
    rt, (s0, s1), runners = text
    catalog = catalog_of(rt, runners)
    heard = []

    class Grow(PipelineBatching):
        def __init__(self, *a):
            super().__init__(*a)
            self.step = 0

        def plan(self, now, idle):
            self.step += 1
            placement = ()
            if self.step == 1:
                placement = (PlacementChange("add_worker", 1), PlacementChange("load", 1, s1))
                idle = [w for w in idle if w != 1]
            p = super().plan(now, idle)
            return Plan(p.batches, p.evict, p.wake_at, placement=placement)

        def on_placement(self, change, ok, seconds, now):
            heard.append((change.action, ok))

    async def scenario():
        policy = Grow({rt.name: (s0, s1)}, {rt.name: GRID})
        engine = Engine({rt.name: rt}, policy, workers=[ThreadWorker(0, catalog, [s0])], catalog=catalog)
        answers = await asyncio.gather(*engine.submit(items_of(rt, SENTENCES[:3])))
        engine.close()
        return answers, engine

    answers, engine = asyncio.run(scenario())
    assert [a.outcome for a in answers] == ["ok"] * 3
    assert heard == [("add_worker", True), ("load", True)]
    assert [(label, w) for label, w, _ in engine.stats.stage_loads] == [(s1.label(), 1)]
    assert engine.placement() == {0: frozenset({s0}), 1: frozenset({s1})}


class Broken:
    """A runner whose every step raises (a worker gone bad), holding the same stage."""

    def __init__(self, rt):
        self.weights, self.table = rt.weights, rt.table

    def execute(self, *a, **kw):
        raise RuntimeError("this worker is broken")


def test_a_failed_step_is_retried_on_another_worker_holding_its_stage(text):
    rt, _, _ = text
    whole = Stage(rt.name, 0, rt.num_layers, rt.num_layers)

    async def scenario():
        workers = [ThreadWorker(0, lambda s: Broken(rt), [whole]), ThreadWorker(1, lambda s: rt, [whole])]

        class OnZero(PipelineBatching):
            def plan(self, now, idle):  # always worker 0 first, so the retry must move
                return super().plan(now, sorted(idle))

        policy = OnZero({rt.name: (whole,)}, {rt.name: GRID})
        policy._idle_since = {0: -1.0, 1: 0.0}
        engine = Engine({rt.name: rt}, policy, workers=workers)
        answers = await asyncio.gather(*engine.submit(items_of(rt, SENTENCES[:2])), return_exceptions=True)
        engine.close()
        return answers, engine

    answers, engine = asyncio.run(scenario())
    assert all(isinstance(a, Answer) and a.outcome == "ok" for a in answers)
    assert engine.stats.retries >= 1 and engine.stats.worker_restarts >= 1
    np.testing.assert_allclose(np.stack([a.outputs["embedding"] for a in answers]),
                               whole_embeddings(rt, SENTENCES[:2]), atol=1e-5)


def test_with_no_other_holder_a_step_that_fails_twice_is_an_error(text):
    rt, _, _ = text
    whole = Stage(rt.name, 0, rt.num_layers, rt.num_layers)

    async def scenario():
        policy = PipelineBatching({rt.name: (whole,)}, {rt.name: GRID})
        engine = Engine({rt.name: rt}, policy, workers=[ThreadWorker(0, lambda s: Broken(rt), [whole])])
        answers = await asyncio.gather(*engine.submit(items_of(rt, SENTENCES[:2])), return_exceptions=True)
        assert engine.in_flight == 0
        engine.close()
        return answers, engine

    answers, engine = asyncio.run(scenario())
    assert all(isinstance(a, ExecutionFailed) for a in answers)
    assert engine.stats.retries == 1 and engine.stats.outcomes["error"] == 2
