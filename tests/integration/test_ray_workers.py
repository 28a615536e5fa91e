"""Ray workers (jaxserve/ray_workers.py) against thread workers, on one local Ray.

The compile cache is filled the documented way, by ``jaxserve warmup`` with the grid flags
the workers get (in a child process), and then every worker loads from it: the thread
workers in this process, each Ray actor in its own. A tiny grid (MiniLM batch 1, 2 x
bucket 16; the demo ViT batch 1, 2) keeps the module to a few actor starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import ray

from jaxserve.compile_cache import CompileCache
from jaxserve.datasets import digits_examples
from jaxserve.ray_workers import RayWorker, WorkerSpec, ensure_ray, make_ray_workers
from jaxserve.sched.base import Cell, ShapeGrid, Stage
from jaxserve.workers import Step, StepOutput, ThreadWorker, WorkerDied

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
    """MiniLM cut at layer 3: the first stage in one actor, the last in another; the hidden
    states travel between them as numpy arrays, through Ray's object store."""
    from jaxserve.stages import build_stage_runtimes, split_stages

    rt = runtimes["minilm-l6"]
    first, last = split_stages("minilm-l6", rt.num_layers, (3,))
    # the node's warmup of the stages' executables, with the loaders' tuning
    build_stage_runtimes(rt, (first, last), CompileCache(settings.cache_dir), tune=settings.tune)
    (tail,) = make_ray_workers(settings, 1, [[last]], first_id=5)
    try:
        assert worker.load(first).result(timeout=WAIT) > 0
        step = text_step(runtimes)
        head = worker.submit(Step(first, step.cell, step.payloads, step.tasks)).result(timeout=WAIT)
        assert head.items is None and head.carry.count == 2
        assert isinstance(head.carry.arrays["hidden"], np.ndarray) and head.carry.arrays["hidden"].shape == (2, 16, 384)
        out = tail.submit(Step(last, step.cell, (), step.tasks, head.carry)).result(timeout=WAIT)
        assert_same(out, worker.submit(step).result(timeout=WAIT))
        assert worker.holdings().stages == {first, whole(runtimes, "minilm-l6")}
        assert worker.compilations() == 0 and tail.compilations() == 0
    finally:
        worker.unload(first)
        tail.close()


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
