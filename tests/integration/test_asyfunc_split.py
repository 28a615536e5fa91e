"""AsyFunc's split execution (jaxserve/asyfunc_exec.py) on the real MiniLM-L6 weights: a body that
hands a block's rows to a shadow (a thread worker in this process, or a pool Ray actor) answers as
the unsplit model, at several (b, b_B, b_S) with padding rows and masks; a shadow killed before or
while its part runs leaves the body to compute those rows, and the answer is still the model's.

The compile cache is filled in this process (the whole model's and the stages' tables, no
tuning); the pool actor loads its block from it and compiles nothing."""

from __future__ import annotations

import os
import threading
import time

import jax
import numpy as np
import pytest
import ray

from jaxserve.asyfunc_exec import Body, PoolWorker, load_text_block, modelled_seconds
from jaxserve.compile_cache import CompileCache, compile_count
from jaxserve.ray_workers import WorkerSpec, ensure_ray
from jaxserve.sched.base import Cell, ShapeGrid, Stage
from jaxserve.workers import Step, ThreadWorker, WorkerDied

MODEL, L = "minilm-l6", 6
GRID = ShapeGrid(batch_sizes=(1, 2, 4), seq_buckets=(16,))
BLOCKS = (Stage(MODEL, 2, 4, L), Stage(MODEL, 0, 3, L), Stage(MODEL, 3, 6, L))  # middle, first, last
SPLITS = ((4, 1), (4, 2), (4, 3), (3, 1), (3, 2), (4, 0), (2, 1))  # (b, b_B); b=3: a padding row in cell 4
ATOL = 1e-5
WAIT = 180


@pytest.fixture(scope="module")
def cluster():
    ensure_ray(None, num_cpus=4)  # Ray starts before this process initialises JAX
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("asyfunc-cache")


@pytest.fixture(scope="module")
def runtime(cluster, cache_dir):
    from jaxserve.registry import load_text_runtime

    rt = load_text_runtime(MODEL, CompileCache(str(cache_dir)), GRID, tune=False)
    assert "sentiment" in rt.heads and rt.num_layers == L
    return rt


@pytest.fixture(scope="module")
def bodies(runtime, cache_dir):
    return {block: Body(runtime, block, CompileCache(str(cache_dir))) for block in BLOCKS}


def payloads_of(runtime, b: int, seed: int = 0) -> tuple[list[list[int]], list[str]]:
    """``b`` real sentences of different lengths (masks with padding inside bucket 16), tasks
    mixing a head and none."""
    texts = ["the service was quick and friendly", "never again", "an utterly dull, lifeless film that "
             "drags on", "great", "the plot is thin but the acting is superb and warm"]
    rng = np.random.default_rng(seed)
    picked = [texts[i] for i in rng.permutation(len(texts))[:b]]
    ids = [x[:16] for x in runtime.tokenizer.encode(picked)]
    assert len({len(x) for x in ids}) == len(ids)  # lengths differ: masks differ row by row
    return ids, ["sentiment" if i % 2 == 0 else "" for i in range(b)]


def max_abs_diff(got: list[dict], want: list[dict]) -> float:
    """The largest |difference| over every array of every answer; labels must be equal."""
    assert len(got) == len(want)
    worst = 0.0
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for key, value in w.items():
            if isinstance(value, np.ndarray):
                worst = max(worst, float(np.max(np.abs(np.asarray(g[key], np.float64) - value))))
            else:
                assert g[key] == value, key
    return worst


def spec_for(cache_dir) -> WorkerSpec:
    env = {k: v for k, v in os.environ.items() if k.startswith(("JAX_", "XLA_", "JAXSERVE_"))}
    return WorkerSpec(models=(MODEL,), cache_dir=str(cache_dir), tune=False, text_grid=GRID,
                      env=tuple(sorted(env.items())))


# ------------------------------------------------------------------------------ in process

@pytest.mark.parametrize("block", BLOCKS, ids=lambda s: s.label())
def test_a_split_batch_answers_as_the_unsplit_model(runtime, bodies, cache_dir, block):
    body = bodies[block]
    # the shadow holds only the block, loaded as a pool worker loads it
    shadow_runner = load_text_block(MODEL, block, GRID, CompileCache(str(cache_dir)))
    assert shadow_runner.param_bytes() == body.runners[block].param_bytes() < runtime_bytes(runtime)
    shadow = ThreadWorker(1, {block: shadow_runner}.__getitem__, [block])
    compiles = compile_count()
    try:
        for b, b_B in SPLITS:
            payloads, tasks = payloads_of(runtime, b, seed=b * 10 + b_B)
            want = runtime.execute(GRID.cell_for(b, max(map(len, payloads))), payloads, tasks).items
            busy = shadow.busy_seconds
            got, times = body.run(payloads, tasks, b_B, shadow)
            assert (times.b, times.b_B, times.b_S) == (b, b_B, b - b_B) and not times.recomputed
            assert shadow.busy_seconds > busy  # the shadow did compute its rows
            assert max_abs_diff(got, want) <= ATOL, (b, b_B)
            alone, _ = body.run(payloads, tasks)  # no shadow: the body's own path
            assert max_abs_diff(alone, want) <= ATOL
    finally:
        shadow.close()
    assert compile_count() == compiles  # everything was warmed at load


def test_a_shadow_reads_its_block_checkpoint_and_never_a_stale_one(runtime, bodies, cache_dir):
    """load_text_block reads the block's own checkpoint when its record is intact: parameters
    saved there (here: altered ones) are what it computes with. Rewriting the checkpoint from the
    model (what a server's start does when the digests differ) brings the model's block back; a
    checkpoint whose files no longer match their record is not read (the whole model is)."""
    from jaxserve.asyfunc_exec import block_dir, write_block_checkpoint
    from jaxserve.keys_manager import params_from_state, save_stage_checkpoint

    block = BLOCKS[0]
    body = bodies[block]
    cache = CompileCache(str(cache_dir))
    payloads, tasks = payloads_of(runtime, 4, seed=7)
    want = runtime.execute(GRID.cell_for(4, max(map(len, payloads))), payloads, tasks).items

    def split_answers():
        runner = load_text_block(MODEL, block, GRID, cache, prime=False)
        shadow = ThreadWorker(1, {block: runner}.__getitem__, [block])
        try:
            return body.run(payloads, tasks, 2, shadow)[0]
        finally:
            shadow.close()

    directory, written = write_block_checkpoint(body.runners[block], cache.root)
    assert directory == block_dir(cache.root, block) and written
    assert write_block_checkpoint(body.runners[block], cache.root) == (directory, False)  # up to date
    assert max_abs_diff(split_answers(), want) <= ATOL
    altered = jax.tree_util.tree_map(lambda a: a * 1.5, params_from_state(body.runners[block].weights))
    save_stage_checkpoint(directory, altered)  # another digest, recorded: read as the block's
    assert max_abs_diff(split_answers(), want) > 1e-3
    assert write_block_checkpoint(body.runners[block], cache.root) == (directory, True)  # the model's again
    assert max_abs_diff(split_answers(), want) <= ATOL
    save_stage_checkpoint(directory, altered)
    record = directory / "digest.json"
    record.write_text(record.read_text().replace('"sha256"', '"sha256_old"'))  # no digest: not trusted
    assert max_abs_diff(split_answers(), want) <= ATOL
    assert write_block_checkpoint(body.runners[block], cache.root) == (directory, True)  # for the pool's tests


def runtime_bytes(runtime) -> int:
    import jax

    return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(runtime.weights)))


def test_merged_rows_keep_their_order(runtime, bodies):
    """Each row's answer, whether the body or the shadow computed it, is its own sentence's
    answer alone (batch 1); the rows do differ, so a mix-up would show."""
    body = bodies[BLOCKS[0]]
    payloads, _ = payloads_of(runtime, 4, seed=3)
    tasks = [""] * 4
    shadow = ThreadWorker(2, {body.block: body.runners[body.block]}.__getitem__, [body.block])
    try:
        got, _ = body.run(payloads, tasks, 1, shadow)
    finally:
        shadow.close()
    for k, p in enumerate(payloads):
        (alone,) = runtime.execute(GRID.cell_for(1, len(p)), [p], [""]).items
        np.testing.assert_allclose(got[k]["embedding"], alone["embedding"], atol=ATOL, rtol=0)
    assert float(np.max(np.abs(got[0]["embedding"] - got[1]["embedding"]))) > 1e-2


def test_a_shadow_that_does_not_answer_in_time_is_recomputed_by_the_body(runtime, bodies):
    body = bodies[BLOCKS[0]]
    payloads, tasks = payloads_of(runtime, 4, seed=5)
    want = runtime.execute(GRID.cell_for(4, max(map(len, payloads))), payloads, tasks).items
    shadow = ThreadWorker(3, {body.block: body.runners[body.block]}.__getitem__, [body.block])
    carry = body.runners[body.pre].execute(Cell(4, 16), payloads, tasks).carry
    try:
        backlog = [shadow.submit(Step(body.block, Cell(4, 16), (), tuple(tasks), carry)) for _ in range(300)]
        got, times = body.run(payloads, tasks, 2, shadow, shadow_timeout_s=0.001)
        assert not backlog[-1].done()  # the shadow was still busy: the body did not wait for it
        assert times.recomputed and max_abs_diff(got, want) <= ATOL
    finally:
        shadow.close()


def test_the_model_latency_is_the_slower_branch():
    assert modelled_seconds(0.01, 0.02, 0.015, 0.001) == pytest.approx(0.03)
    assert modelled_seconds(0.01, 0.02, 0.015, 0.01) == pytest.approx(0.035)


# ------------------------------------------------------------------------------ through Ray

@pytest.fixture(scope="module")
def pool_shadow(runtime, cache_dir, cluster):
    """A pool worker (started empty) that became the shadow of the middle block."""
    w = PoolWorker(20, spec_for(cache_dir), [])
    try:
        assert w.ready.result(timeout=WAIT) > 0 and w.holdings().stages == frozenset()
        assert w.load(BLOCKS[0]).result(timeout=WAIT) > 0
        yield w
    finally:
        w.close()


def test_a_pool_actor_becomes_a_shadow_and_the_split_answers_as_the_unsplit_model(runtime, bodies, pool_shadow):
    block = BLOCKS[0]
    held = pool_shadow.holdings()
    assert held.stages == {block} and held.param_bytes == bodies[block].runners[block].param_bytes()
    assert held.executables == len(GRID.cells()) and held.compilations == 0  # loaded from the node's cache
    for b, b_B in SPLITS:
        payloads, tasks = payloads_of(runtime, b, seed=b + b_B)
        want = runtime.execute(GRID.cell_for(b, max(map(len, payloads))), payloads, tasks).items
        got, times = bodies[block].run(payloads, tasks, b_B, pool_shadow)
        assert not times.recomputed and max_abs_diff(got, want) <= ATOL, (b, b_B)
        if b_B < b:
            assert times.t_pS > 0 and times.shadow_wall >= times.t_pS
    assert pool_shadow.compilations() == 0


def test_a_shadow_killed_while_or_before_its_part_runs_is_recomputed_by_the_body(runtime, bodies, pool_shadow):
    block, body = BLOCKS[0], bodies[BLOCKS[0]]
    payloads, tasks = payloads_of(runtime, 4, seed=11)
    want = runtime.execute(GRID.cell_for(4, max(map(len, payloads))), payloads, tasks).items
    # keep the shadow busy, so the body's part queues behind work that is under way when it dies
    filler_carry = body.runners[body.pre].execute(Cell(4, 16), payloads, tasks).carry
    import jax

    filler_carry = jax.tree_util.tree_map(np.asarray, filler_carry)
    fillers = [pool_shadow.submit(Step(block, Cell(4, 16), (), tuple(tasks), filler_carry)) for _ in range(200)]
    result = {}
    runner = threading.Thread(target=lambda: result.update(out=body.run(payloads, tasks, 1, pool_shadow)))
    runner.start()
    time.sleep(0.2)
    assert not fillers[-1].done()  # the shadow is mid-queue: the body's part is not done either
    pool_shadow.kill()
    runner.join(timeout=WAIT)
    assert not runner.is_alive()
    got, times = result["out"]
    assert times.recomputed and max_abs_diff(got, want) <= ATOL
    with pytest.raises(WorkerDied):
        fillers[-1].result(timeout=WAIT)
    assert not pool_shadow.alive
    # a shadow dead before its part is handed over: the body does the rows itself, once
    got, times = body.run(payloads, tasks, 2, pool_shadow)
    assert times.recomputed and times.b_S == 2 and max_abs_diff(got, want) <= ATOL
