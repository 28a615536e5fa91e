"""Ray workers (jaxserve/ray_workers.py) against thread workers, on one local Ray.

The compile cache is filled the documented way, by ``jaxserve warmup`` with the grid flags
the workers get (in a child process), and then every worker loads from it: the thread
workers in this process, each Ray actor in its own. A tiny grid (MiniLM batch 1, 2 x
bucket 16; the demo ViT batch 1, 2) keeps the module to a few actor starts.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import ray

from jaxserve.compile_cache import CompileCache
from jaxserve.datasets import digits_examples
from jaxserve.ray_workers import RayWorker, WorkerSpec, all_ready, ensure_ray, make_ray_workers
from jaxserve.sched.base import Cell, ShapeGrid, Stage
from jaxserve.workers import CarryParts, Step, StepOutput, StoredCarry, ThreadWorker, WorkerDied, gather_carry

try:
    from jaxserve.launch import ServeSettings, load_runtimes
except ImportError:
    from serving.server import ServeSettings, load_runtimes

TEXT = ShapeGrid(batch_sizes=(1, 2), seq_buckets=(16,))
IMAGE = ShapeGrid(batch_sizes=(1, 2))
WAIT = 120  # seconds any one future may take here (an actor start on a busy 2-core machine)


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    cache = tmp_path_factory.mktemp("ray-cache")
    warm = subprocess.run([sys.executable, "-m", "jaxserve.cli", "warmup", "--model", "minilm-l6", "--model",
                           "vit-demo", "--batch-sizes", "1,2", "--buckets", "16", "--no-tune", "--cache-dir",
                           str(cache)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert warm.returncode == 0, warm.stderr
    return ServeSettings(models=("minilm-l6", "vit-demo"), cache_dir=str(cache), tune=False, progress=False,
                         text_grid=TEXT, image_grid=IMAGE)


@pytest.fixture(scope="module")
def runtimes(settings, cluster):  # Ray starts before this process initialises JAX
    return load_runtimes(settings, CompileCache(settings.cache_dir))


@pytest.fixture(scope="module")
def cluster():
    ensure_ray(None, num_cpus=4)
    yield
    ray.shutdown()


def whole(runtimes, model: str) -> Stage:
    layers = runtimes[model].num_layers
    return Stage(model, 0, layers, layers)


@pytest.fixture(scope="module")
def worker(settings, runtimes, cluster):
    """One actor holding the whole MiniLM, through the factory the server calls."""
    (w,) = make_ray_workers(settings, 1, lambda i: [whole(runtimes, "minilm-l6")])
    yield w
    w.close()


def text_step(runtimes) -> Step:
    ids = runtimes["minilm-l6"].tokenizer.encode(["the service was quick and friendly", "never again"])
    return Step(whole(runtimes, "minilm-l6"), Cell(2, 16), tuple(ids), ("sentiment", ""))


def image_step(runtimes) -> Step:
    images, _ = digits_examples(runtimes["vit-demo"].image_shape, count=2)
    return Step(whole(runtimes, "vit-demo"), Cell(2), tuple(images), ("digits", "digits"))


def assert_same(a: StepOutput, b: StepOutput) -> None:
    assert len(a.items) == len(b.items)
    for x, y in zip(a.items, b.items):
        assert sorted(x) == sorted(y)
        for key in x:
            if isinstance(x[key], np.ndarray):
                np.testing.assert_allclose(x[key], y[key], atol=1e-5, rtol=0)
            else:
                assert x[key] == y[key], key


def same_holdings(a, b) -> bool:
    """The same stages, parameter bytes and executables (the compile counts are per process)."""
    x, y = a.holdings(), b.holdings()
    return (x.stages, x.param_bytes, x.executables) == (y.stages, y.param_bytes, y.executables)


def test_a_ray_worker_answers_as_a_thread_worker_and_holds_the_same(worker, runtimes):
    threads = ThreadWorker(0, lambda stage: runtimes[stage.model], [whole(runtimes, "minilm-l6")])
    try:
        step = text_step(runtimes)
        ours = worker.submit(step).result(timeout=WAIT)
        assert ours.items[0]["label"] in ("negative", "positive") and "label" not in ours.items[1]
        assert_same(ours, threads.submit(step).result(timeout=WAIT))
        assert same_holdings(worker, threads) and worker.holdings().compilations == 0
        assert worker.holdings().executables == len(TEXT.cells()) and worker.holdings().param_bytes > 50e6
        assert worker.busy_seconds > 0
    finally:
        threads.close()


def test_the_actor_loads_from_the_node_cache_and_compiles_nothing(worker, runtimes):
    for cell in TEXT.cells():  # every executable it holds has run
        ids = [[101, 7592, 102]] * cell.batch
        worker.submit(Step(whole(runtimes, "minilm-l6"), cell, tuple(ids), ("",) * cell.batch)).result(timeout=WAIT)
    assert worker.compilations() == 0
    assert worker.pid() != os.getpid()


def test_a_step_of_a_stage_it_does_not_hold_is_refused(worker, runtimes):
    with pytest.raises(KeyError):
        worker.submit(image_step(runtimes))


def test_a_pipeline_of_two_actors_answers_as_the_whole_model(settings, runtimes, worker, cluster):
    """MiniLM cut at layer 3: the first stage in one actor, the last in another. The hidden
    states wait in Ray's object store and go from there to the second actor; the driver
    holds only their name. With the "driver" hand-off they come back here as numpy arrays,
    and the answers are the same."""
    from jaxserve.stages import build_stage_runtimes, split_stages

    rt = runtimes["minilm-l6"]
    first, last = split_stages("minilm-l6", rt.num_layers, (3,))
    # the node's warmup of the stages' executables, with the loaders' tuning
    build_stage_runtimes(rt, (first, last), CompileCache(settings.cache_dir), tune=settings.tune)
    (tail,) = make_ray_workers(settings, 1, [[last]], first_id=5)
    driver_spec = dataclasses.replace(WorkerSpec.from_settings(settings), handoff="driver")
    # num_cpus=0: an earlier module may have left this process's Ray up with fewer logical CPUs
    # than this module's actors would ask for together (they would wait for one for ever)
    driven = [RayWorker(6, driver_spec, [first], num_cpus=0), RayWorker(7, driver_spec, [last], num_cpus=0)]
    try:
        assert worker.load(first).result(timeout=WAIT) > 0
        step = text_step(runtimes)
        whole_out = worker.submit(step).result(timeout=WAIT)
        head = worker.submit(Step(first, step.cell, step.payloads, step.tasks)).result(timeout=WAIT)
        assert head.items is None and isinstance(head.carry, StoredCarry) and head.carry.count == 2
        assert not hasattr(head.carry, "arrays")  # nothing of them in this process
        stored = ray.get(head.carry.ref)  # (read here only to check them)
        assert stored.arrays["hidden"].shape == (2, 16, 384)
        out = tail.submit(Step(last, step.cell, (), step.tasks, head.carry)).result(timeout=WAIT)
        assert_same(out, whole_out)
        assert tail.handoffs() == {"store": 1}
        assert worker.holdings().stages == {first, whole(runtimes, "minilm-l6")}
        assert worker.compilations() == 0 and tail.compilations() == 0

        head = driven[0].submit(Step(first, step.cell, step.payloads, step.tasks)).result(timeout=WAIT)
        assert isinstance(head.carry.arrays["hidden"], np.ndarray)
        np.testing.assert_allclose(head.carry.arrays["hidden"], stored.arrays["hidden"], atol=1e-6, rtol=0)
        assert_same(driven[1].submit(Step(last, step.cell, (), step.tasks, head.carry)).result(timeout=WAIT),
                    whole_out)
        assert driven[1].handoffs() == {}  # the arrays came inside the call
    finally:
        worker.unload(first)
        for w in (tail, *driven):
            w.close()


def test_a_split_step_takes_rows_where_they_wait_and_merges_them_back(settings, runtimes, cluster):
    """AsyFunc's split on two actors: a body holding MiniLM as three stages and a shadow holding
    the middle one. The body runs the first stage on two rows, the middle one on row 0 (its own
    activations, still on its device: nothing moves) while the shadow runs it on row 1 (from
    the object store); the body then merges both parts in its last stage. The answers are the
    whole model's, and the driver gathered nothing."""
    from jaxserve.stages import build_stage_runtimes, split_stages

    rt = runtimes["minilm-l6"]
    first, mid, last = split_stages("minilm-l6", rt.num_layers, (2, 4))
    build_stage_runtimes(rt, (first, mid, last), CompileCache(settings.cache_dir), tune=settings.tune)
    spec = WorkerSpec.from_settings(settings)  # num_cpus=0: see the pipeline test above
    body, shadow = RayWorker(8, spec, [first, mid, last], num_cpus=0), RayWorker(9, spec, [mid], num_cpus=0)
    all_ready([body, shadow])
    try:
        step = text_step(runtimes)
        ones = Cell(1, step.cell.seq)
        s1 = body.submit(Step(first, step.cell, step.payloads, step.tasks)).result(timeout=WAIT)
        mine = gather_carry([(s1.carry, 0)])
        theirs = gather_carry([(s1.carry, 1)])
        assert isinstance(mine, CarryParts) and mine.count == 1
        fa, fb = body.submit(Step(mid, ones, (), step.tasks[:1], mine)), \
            shadow.submit(Step(mid, ones, (), step.tasks[1:], theirs))
        a, b = fa.result(timeout=WAIT), fb.result(timeout=WAIT)
        merged = gather_carry([(a.carry, 0), (b.carry, 0)])
        assert isinstance(merged, CarryParts) and merged.count == 2
        out = body.submit(Step(last, step.cell, (), step.tasks, merged)).result(timeout=WAIT)
        assert_same(out, runtimes["minilm-l6"].execute(step.cell, list(step.payloads), list(step.tasks)))
        assert body.handoffs() == {"kept": 2, "store": 1} and shadow.handoffs() == {"store": 1}
        assert body.compilations() == 0 and shadow.compilations() == 0
    finally:
        body.close()
        shadow.close()


def test_load_then_unload_a_stage(settings, runtimes, cluster):
    w = RayWorker(7, WorkerSpec.from_settings(settings), [])
    try:
        assert w.ready.result(timeout=WAIT) > 0 and w.holdings().stages == frozenset()
        vit = whole(runtimes, "vit-demo")
        assert w.load(vit).result(timeout=WAIT) > 0
        assert w.holdings().stages == {vit} and w.holdings().executables == len(IMAGE.cells())
        assert w.load(vit).result(timeout=WAIT) == 0.0  # held already
        threads = ThreadWorker(0, lambda stage: runtimes[stage.model], [vit])
        try:
            assert same_holdings(w, threads)
            assert_same(w.submit(image_step(runtimes)).result(timeout=WAIT),
                        threads.submit(image_step(runtimes)).result(timeout=WAIT))
        finally:
            threads.close()
        w.unload(vit)
        assert w.holdings().stages == frozenset() and w.holdings().param_bytes == 0
        with pytest.raises(KeyError):
            w.submit(image_step(runtimes))
        with pytest.raises(ValueError, match="4 layers"):  # a stage of a model that has no such depth
            w.load(Stage("vit-demo", 0, 6, 6)).result(timeout=WAIT)
        assert w.holdings().stages == frozenset()
        assert w.compilations() == 0
    finally:
        w.close()


def test_a_killed_actor_fails_its_steps_with_worker_died_and_restart_brings_it_back(settings, runtimes, cluster):
    stage = whole(runtimes, "minilm-l6")
    (w,) = make_ray_workers(settings, 1, [[stage]], first_id=3)
    try:
        step = text_step(runtimes)
        before = w.submit(step).result(timeout=WAIT)
        pid = w.pid()
        futures = []
        while not futures or futures[-1].done():  # some steps still queued or running in the actor
            futures = [w.submit(step) for _ in range(8)]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDied):
            futures[-1].result(timeout=WAIT)
        for f in futures:  # each either finished before the kill or says the worker died
            assert isinstance(f.exception(timeout=WAIT), (WorkerDied, type(None)))
        assert not w.alive
        assert w.restart().result(timeout=WAIT) > 0
        assert w.alive and w.pid() != pid
        assert w.holdings().stages == {stage}
        assert_same(w.submit(step).result(timeout=WAIT), before)
        assert w.compilations() == 0
    finally:
        w.close()


def test_a_local_ray_is_started_from_the_main_thread_only():
    """Ray's local processes die with the thread that starts them: started from a warmup
    thread, the cluster vanished when that thread ended (and the driver with it). In a fresh
    process (this module's cluster stays as it is), a worker thread asking for a local Ray
    is refused, and nothing starts."""
    script = (
        "import threading, ray\n"
        "from jaxserve.ray_workers import ensure_ray\n"
        "errors = []\n"
        "def start():\n"
        "    try:\n"
        "        ensure_ray(None, num_cpus=1)\n"
        "    except RuntimeError as exc:\n"
        "        errors.append(str(exc))\n"
        "t = threading.Thread(target=start); t.start(); t.join()\n"
        "print(len(errors), 'main thread' in errors[0] if errors else None, ray.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "True", "False"], out.stdout
