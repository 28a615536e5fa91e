"""The KeysManager (jaxserve/keys_manager.py) on one local Ray, with real orbax checkpoints of
a tiny BERT's stages and real replica actors.

Ray starts once for the module (as tests/integration/test_ray_workers.py starts it, through
``ensure_ray``); each test gets its own manager actor, in a namespace of its own, so entries
never leak from one test to the next. Two replica actors serve the whole module (an actor
start is seconds on a busy 2-core machine).
"""

from __future__ import annotations

import time
import uuid

import jax
import numpy as np
import pytest
import ray
from flax import nnx

from jaxserve.keys_manager import (CacheKey, ReplicaActor, cached_nodes, drop_page_cache, keys_manager, load_stage_params,
                                   params_digest, params_from_state, recorded_digest, save_stage_checkpoint,
                                   stage_dir, state_from_params)
from jaxserve.models.bert import BERT_CONFIGS, abstract_bert_stage, init_bert
from jaxserve.ray_workers import ensure_ray
from jaxserve.sched.base import Stage
from jaxserve.stages import slice_stage_weights, split_stages

CFG = BERT_CONFIGS["bert-tiny-test"]  # 2 layers, hidden 32: the first stage is ~4 MB of embeddings
WAIT = 120


def stage_params(seed: int, model: str) -> dict[Stage, dict]:
    """The tiny BERT of ``seed`` cut into [0:1], [1:2]: each stage's parameters (numpy)."""
    _, weights = nnx.split(init_bert(CFG, seed))
    out = {}
    for stage in split_stages(model, CFG.num_layers, (1,)):
        _, abstract = abstract_bert_stage(CFG, stage.start, stage.stop)
        out[stage] = params_from_state(slice_stage_weights(weights, abstract, stage.start))
    return out


def assert_trees_equal(a, b) -> None:
    fa, ta = jax.tree_util.tree_flatten_with_path(a)
    fb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb
    for (path, x), (_, y) in zip(fa, fb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def trees_equal(a, b) -> bool:
    try:
        assert_trees_equal(a, b)
    except AssertionError:
        return False
    return True


@pytest.fixture(scope="module")
def cluster():
    ensure_ray(None, num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def root(tmp_path_factory, cluster):
    """Checkpoints of three tiny BERTs (models a, b, c: different weights, equal shapes)."""
    root = tmp_path_factory.mktemp("stages")
    for seed, model in enumerate("abc"):
        for stage, params in stage_params(seed, model).items():
            save_stage_checkpoint(stage_dir(root, stage), params)
    return root


def first(model: str) -> Stage:
    return Stage(model, 0, 1, CFG.num_layers)


@pytest.fixture
def manager(cluster):
    """A fresh manager actor in a namespace of this test's own; killed afterwards."""
    handles = []

    def make(**options):
        handle = keys_manager(namespace=f"test-{uuid.uuid4().hex}", **options)
        handles.append(handle)
        return handle

    yield make
    for h in handles:
        ray.kill(h)


@pytest.fixture(scope="module")
def replicas(cluster):
    actors = [ReplicaActor.remote({"JAX_PLATFORMS": "cpu"}) for _ in range(2)]
    ray.get([a.ping.remote() for a in actors], timeout=WAIT)
    yield actors
    for a in actors:
        ray.kill(a)


def call(ref):
    return ray.get(ref, timeout=WAIT)


def test_a_checkpoint_round_trips_with_its_digest(root, tmp_path):
    params = stage_params(0, "a")[first("a")]
    directory = stage_dir(root, first("a"))
    assert recorded_digest(directory) == params_digest(params)
    assert_trees_equal(load_stage_params(directory, host=True), params)
    # the loaded stage fits the stage servable's state, and the digest tells other weights apart
    _, abstract = abstract_bert_stage(CFG, 0, 1)
    state_from_params(abstract, params)
    assert params_digest(stage_params(1, "b")[first("b")]) != params_digest(params)
    assert drop_page_cache(directory) >= 1


def test_a_hit_serves_the_arrays_of_the_checkpoint(root, manager):
    km = manager()
    stage, directory = first("a"), str(stage_dir(root, first("a")))
    assert call(km.lease.remote(stage, directory)).source == "disk"  # nothing cached yet
    key = call(km.populate.remote(stage, directory))
    assert key == CacheKey(stage, recorded_digest(directory))
    lease = call(km.lease.remote(stage, directory))
    assert lease.source == "cache" and lease.key == key
    cached = ray.get(lease.ref[0])
    assert_trees_equal(cached, load_stage_params(directory, host=True))
    assert not any(leaf.flags.writeable for leaf in jax.tree_util.tree_leaves(cached))  # views of the store
    assert call(km.stats.remote())["hits"] == 1


def test_a_rewritten_checkpoint_is_never_served_from_the_cache(tmp_path, manager, replicas):
    km = manager()
    stage = first("a")
    directory = stage_dir(tmp_path, stage)
    old, new = stage_params(0, "a")[stage], stage_params(7, "a")[stage]
    save_stage_checkpoint(directory, old)
    assert call(km.populate.remote(stage, str(directory))) is not None
    assert call(km.lease.remote(stage, str(directory))).source == "cache"

    save_stage_checkpoint(directory, new)  # rewritten, with its record
    lease = call(km.lease.remote(stage, str(directory)))
    assert lease.source == "disk" and lease.invalidated == 1
    assert not call(km.holds.remote(stage))  # the stale entry is gone, not just skipped
    report = call(replicas[0].become_ready.remote(stage, str(directory), km, populate=True))
    assert report.source == "disk"
    got = call(replicas[0].host_params.remote())
    assert_trees_equal(got, new) and not trees_equal(got, old)

    # the replica's miss re-populated it with the new arrays: served from the cache now
    call(km.populate.remote(stage, str(directory)))
    report = call(replicas[0].become_ready.remote(stage, str(directory), km))
    assert report.source == "cache"
    assert_trees_equal(call(replicas[0].host_params.remote()), new)

    # rewritten behind the record's back (plain orbax, no new record): the digest is unknown
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / "params", old, force=True)
    assert recorded_digest(directory) is None
    assert call(km.lease.remote(stage, str(directory))).source == "disk"
    report = call(replicas[0].become_ready.remote(stage, str(directory), km, populate=False))
    assert report.source == "disk"
    assert_trees_equal(call(replicas[0].host_params.remote()), old)
    # populating reads the arrays, records their digest and caches them
    key = call(km.populate.remote(stage, str(directory)))
    assert key.digest == params_digest(old) == recorded_digest(directory)


def test_least_recently_used_entries_are_evicted_past_the_high_water_mark(root, manager, replicas):
    size = sum(a.nbytes for a in jax.tree_util.tree_leaves(stage_params(0, "a")[first("a")]))
    # room for two first stages under 85%, not three; only the entries count
    km = manager(capacity_bytes=2.5 * size / 0.85, high_water=0.85, store_usage=False)
    a, b, c = (first(m) for m in "abc")
    dirs = {s: str(stage_dir(root, s)) for s in (a, b, c)}
    assert call(km.populate.remote(a, dirs[a])) and call(km.populate.remote(b, dirs[b]))
    assert call(km.lease.remote(a, dirs[a])).source == "cache"  # a used last: b is the LRU one
    assert call(km.populate.remote(c, dirs[c]))
    held = [e.key.stage for e in call(km.entries.remote())]
    assert held == [a, c]  # least recently used first
    stats = call(km.stats.remote())
    assert stats["evicted"] == 1 and stats["bytes"] <= 0.85 * 2.5 * size / 0.85

    assert call(km.lease.remote(b, dirs[b])).source == "disk"
    report = call(replicas[1].become_ready.remote(b, dirs[b], km, populate=False))
    assert report.source == "disk"
    assert_trees_equal(call(replicas[1].host_params.remote()), stage_params(1, "b")[b])


def test_memory_pressure_evicts_instead_of_failing(root, manager):
    size = sum(a.nbytes for a in jax.tree_util.tree_leaves(stage_params(0, "a")[first("a")]))
    # Ray's own figure of the store counts too (store_usage): one entry fits at most
    km = manager(capacity_bytes=1.5 * size / 0.85, store_usage=True)
    for m in "abc":
        s = first(m)
        assert call(km.populate.remote(s, str(stage_dir(root, s)))) is not None
        assert len(call(km.entries.remote())) == 1
    assert call(km.stats.remote())["evicted"] == 2
    tiny = manager(capacity_bytes=size / 2)  # a stage larger than the mark is not cached
    assert call(tiny.populate.remote(first("a"), str(stage_dir(root, first("a"))))) is None
    assert call(tiny.lease.remote(first("a"), str(stage_dir(root, first("a"))))).source == "disk"


def test_entries_report_the_node_that_holds_them(root, manager):
    km = manager()
    stage, directory = Stage("a", 1, 2, 2), str(stage_dir(root, Stage("a", 1, 2, 2)))
    call(km.populate.remote(stage, directory))
    (entry,) = call(km.entries.remote())
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    assert entry.node_id in nodes and entry.node_id == call(km.node.remote())
    assert entry.nbytes == sum(a.nbytes for a in jax.tree_util.tree_leaves(stage_params(0, "a")[stage]))
    lease = call(km.lease.remote(stage, directory))
    where = ray.experimental.get_object_locations([lease.ref[0]])[lease.ref[0]]
    assert entry.node_id in where["node_ids"]


def test_cached_nodes_names_the_nodes_whose_manager_holds_a_stage(root, cluster):
    namespace = f"test-{uuid.uuid4().hex}"
    stage, directory = Stage("c", 1, 2, 2), str(stage_dir(root, Stage("c", 1, 2, 2)))
    assert cached_nodes(stage, namespace=namespace) == []  # no manager anywhere yet (none is started)
    km = keys_manager(namespace=namespace)
    try:
        assert cached_nodes(stage, directory, namespace=namespace) == []
        call(km.populate.remote(stage, directory))
        assert cached_nodes(stage, directory, namespace=namespace) == [call(km.node.remote())]
        assert cached_nodes(Stage("c", 0, 1, 2), namespace=namespace) == []
    finally:
        ray.kill(km)


def test_a_replica_from_the_cache_holds_what_one_from_disk_holds(root, manager, replicas):
    km = manager()
    stage = first("c")
    directory = str(stage_dir(root, stage))
    drop_page_cache(directory)
    from_disk = call(replicas[0].become_ready.remote(stage, directory, None, digest=True))
    call(km.populate.remote(stage, directory))
    from_cache = call(replicas[1].become_ready.remote(stage, directory, km, digest=True))
    assert (from_disk.source, from_cache.source) == ("disk", "cache")
    assert from_disk.digest == from_cache.digest == recorded_digest(directory)
    assert from_disk.nbytes == from_cache.nbytes > 0
    assert from_cache.node_id == call(km.node.remote())
    assert not from_cache.shared  # the replica's own copy, not a view of the object store
    assert_trees_equal(call(replicas[0].host_params.remote()), call(replicas[1].host_params.remote()))
    assert_trees_equal(call(replicas[1].host_params.remote()), stage_params(2, "c")[stage])
    # sharing the store's memory (the CPU backend aliases it): the same arrays
    shared = call(replicas[1].become_ready.remote(stage, directory, km, share=True))
    assert shared.source == "cache" and shared.shared
    assert_trees_equal(call(replicas[1].host_params.remote()), stage_params(2, "c")[stage])
    call(replicas[1].release.remote())


def test_a_replica_loads_from_disk_when_the_manager_is_gone(root, manager, replicas):
    """A replica whose node's manager died (taking the entries it owned with it) loads from
    the disk."""
    km = manager()
    stage = Stage("b", 1, 2, 2)
    directory = str(stage_dir(root, stage))
    call(km.populate.remote(stage, directory))
    lease = call(km.lease.remote(stage, directory))
    assert lease.source == "cache"
    ray.kill(km)  # asynchronous: a call right after it may still be answered
    deadline = time.monotonic() + 30
    while True:
        try:
            call(km.stats.remote())
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
            break
        assert time.monotonic() < deadline, "the killed manager still answers after 30 s"
        time.sleep(0.05)
    report = call(replicas[0].become_ready.remote(stage, directory, km))
    assert report.source == "disk"
    assert_trees_equal(call(replicas[0].host_params.remote()), stage_params(1, "b")[stage])
