"""QUART live (§6.1): a model (any of the registry's text models, or an image model) served as a
pipeline of layer-range stages on Ray actors, with new replicas of key stages taking their
parameters from the node's KeysManager. A stage loads with :func:`jaxserve.asyfunc_exec.load_block`:
a text stage hangs on a weightless text runtime (tokenizer for the first, task heads for the last),
an image stage on a weightless image runtime (:func:`jaxserve.registry.image_runtime_shell`:
pixel normalisation for the first; every stage of a prompted gamma, and the last, gather each
sample's prompts and head by the task names carried along).

What the policy (:class:`jaxserve.sched.quart.QuartPolicy`) plans, the engine carries out with
the workers made here:

* **Stage workers.** The server starts one worker per stage (ids ``0..K-1``): a Ray actor
  (:class:`QuartStageHost`) holding that stage only, its executables from the node's compile
  cache and its parameters from the stage's own checkpoint (written at warmup beside the cache:
  :func:`jaxserve.asyfunc_exec.write_block_checkpoint`); a first load from disk asks the node's
  KeysManager to cache the stage, so every stage starts cached where it runs, as the simulator
  starts (``jaxserve.launch.simulate_quart``).
* **A new replica** (the policy's ``add_worker`` then ``load``) is the node's warm pool worker:
  a process already up, JAX imported, every stage's executables loaded (they take the weights as
  arguments, so they hold no parameters); its load only leases the stage from the KeysManager
  (``ray.get`` from the object store and a copy onto the device:
  :meth:`jaxserve.keys_manager.StageReplica.become_ready`). A new pool worker starts at once in
  its place.

Decision (the paper's cache is a forked process per key stage, process and parameters both):
**the cache is the warm pool worker plus the parameters in the object store**, together, and
``cache=False`` turns both off. Without it a new replica is a fresh actor that loads the stage's
executables from the compile cache and reads its checkpoint from disk, which is what
:class:`~jaxserve.sched.quart.LoadModel` prices as a disk load (actor start, executables, read)
against a cache load (the copy alone). Each actor reports where each of its loads took the
parameters from (``"cache"`` or ``"disk"``, :attr:`StageLoad.source`) and how long it took.

A replica that dies is restarted by the engine (a fresh actor of the same class, holding the
same stage): its parameters come from the KeysManager, which is another actor and keeps its
entries. Stale entries (a checkpoint rewritten since) are never served
(:meth:`~jaxserve.keys_manager.KeysManager.lease` checks the record).

Text models only (BERT family: the stages are :class:`~jaxserve.models.bert.BertStage` ranges).
Needs the ray extra.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from jaxserve.sched.base import Stage

__all__ = ["StageLoad", "pipeline_stages", "CUT_TOLERANCE"]


@dataclass(frozen=True)
class StageLoad:
    """One load of a stage in an actor: where its parameters came from (``"cache"``: the
    node's KeysManager; ``"disk"``: its checkpoint), the seconds of the whole load
    (parameters, and the executables when the actor had not prepared them), of the
    parameters alone, and their bytes."""

    stage: Stage
    source: str
    seconds: float
    params_seconds: float
    nbytes: int


def pipeline_stages(model: str, num_layers: int, count: int,
                    layer_costs: Sequence[float] | None = None) -> tuple[Stage, ...]:
    """``model`` cut into ``count`` stages (:func:`jaxserve.sched.quart.cut_stages`): balanced by
    ``layer_costs`` (one per layer, from a layer profile) within :data:`CUT_TOLERANCE`, else of
    equal layers (the paper cuts evenly with DeepSpeed; BERT's encoder layers are identical)."""
    from jaxserve.sched.quart import cut_stages

    if not 2 <= count <= num_layers:
        raise ValueError(f"a pipeline of {model} needs 2 to {num_layers} stages, not {count}")
    if layer_costs is None:
        return cut_stages(model, [1.0] * num_layers, count)
    if len(layer_costs) != num_layers:
        raise ValueError(f"{model} has {num_layers} layers; the profile gives {len(layer_costs)} costs")
    return cut_stages(model, layer_costs, count, tolerance=CUT_TOLERANCE)


# A profile's per-layer costs cut the pipeline only where they move the bottleneck by more than
# this: the layer profile's repeats on this machine differ by about this much between identical
# BERT layers (bench/profiles/asyfunc-live.layers.json: MiniLM's six layers 20.3-22.1 ms at batch 8
# on 1 core and 11.6-14.8 ms on 2 in its 11-26 profile, 20.5-29.6 ms and 11.3-14.0 ms in its 11-27
# one), so a smaller difference is noise, not a slower layer.
CUT_TOLERANCE = 0.1


try:
    import ray

    from jaxserve.asyfunc_exec import PoolWorker, ShadowHost, block_dir, load_block
    from jaxserve.ray_workers import HostReport, WorkerSpec, all_ready
except ImportError:  # pragma: no cover - the ray extra is not installed
    ray = None

if ray is not None:
    @dataclass(frozen=True)
    class QuartReport(HostReport):
        """A stage replica's report: :class:`~jaxserve.ray_workers.HostReport` and every load
        its actor made, so the driver knows each load's source without another call, even
        after the replica is gone."""

        loads: tuple = ()

    class QuartStageHost(ShadowHost):
        """A stage replica's actor: loads stages of a model (:func:`load_block`),
        taking the parameters from the node's KeysManager when it holds them (else from the
        stage's checkpoint, then asking the manager to cache it). ``use_cache`` False: the
        disk always, and nothing cached."""

        use_cache = True

        def __init__(self, spec: WorkerSpec):
            super().__init__(spec)
            self.loads: list[StageLoad] = []

        def _runner(self, stage: Stage):
            from jaxserve.keys_manager import StageReplica, keys_manager

            spec = self._spec
            if stage.whole:
                raise ValueError(f"{stage.label()}: a stage replica holds a layer range, not the whole model")
            t0 = time.perf_counter()
            directory = block_dir(spec.cache_dir, stage, spec.precision)
            replica = StageReplica()
            report = replica.become_ready(stage, str(directory), keys_manager() if self.use_cache else None,
                                          populate=self.use_cache)
            runner = load_block(stage, spec, self._open_cache(), self._prepared.get(stage), params=replica.params)
            self.loads.append(StageLoad(stage, report.source, time.perf_counter() - t0, report.seconds,
                                        report.nbytes))
            return runner

        def report(self) -> QuartReport:
            base = super().report()
            return QuartReport(base.stages, base.pid, base.node, base.compilations, tuple(self.loads))

    class QuartDiskHost(QuartStageHost):
        """:class:`QuartStageHost` without the cache: every load reads the checkpoint."""

        use_cache = False

    _CachedActor = ray.remote(QuartStageHost)
    _DiskActor = ray.remote(QuartDiskHost)

    class QuartWorker(PoolWorker):
        """A stage replica (:class:`QuartStageHost` in a Ray actor; as AsyFunc's pool worker,
        :meth:`kill` ends its process)."""

        kind = "ray-stage"
        actor_class = _CachedActor

        def load_log(self) -> list[StageLoad]:
            """Every load this replica's actor (its current one, after a restart) made, as of
            its last report (after each load): no call, so it answers after the replica is gone."""
            with self._state:
                report = self._report
            return list(getattr(report, "loads", ()))

    class QuartDiskWorker(QuartWorker):
        actor_class = _DiskActor

    class QuartRayWorkers:
        """The workers of a live QUART pipeline on one Ray node: the stage workers it starts
        with (:meth:`initial`) and its ``worker_factory`` (the engine calls it for a planned
        ``add_worker``): the warm pool worker with the cache on, a fresh actor without it
        (module docstring). Actors are not pinned and ask Ray for no CPU (``num_cpus=0``):
        the policy decides how many replicas there are, Ray must not hold one back. One node
        (this driver's): the KeysManager the replicas lease from is that node's, which this
        object holds (:attr:`manager`)."""

        def __init__(self, spec: WorkerSpec, stages: Sequence[Stage], use_cache: bool = True):
            from jaxserve.keys_manager import keys_manager

            self.spec = spec
            self.stages = tuple(stages)
            self.use_cache = use_cache
            # the node's KeysManager, started here and held for the server's life: a named actor
            # that is not detached dies with its last handle, so one made by a replica (which
            # drops its handle after the lease) would take the cache with it
            self.manager = keys_manager() if use_cache else None
            self.cls = QuartWorker if use_cache else QuartDiskWorker
            self._pool: QuartWorker | None = None
            self.made: dict[int, QuartWorker] = {}
            self.from_pool = 0

        def initial(self, placement: Sequence[Stage]) -> list:
            """Workers ``0..len(placement)-1``, worker ``i`` holding ``placement[i]``, ready;
            then (cache on) the first pool worker, started and its stages prepared before this
            returns: the server is ready with its cache warm, and the pool's start does not
            compete with the first requests for the cores."""
            out = [self._new(i, (stage,)) for i, stage in enumerate(placement)]
            all_ready(out)
            self.refill()
            if self._pool is not None:
                ray.get(self._pool.actor.prepare.remote(list(self.stages)))
            return out

        def _new(self, wid: int, stages: Sequence[Stage] = ()):
            worker = self.cls(wid, self.spec, stages, num_cpus=0)
            self.made[wid] = worker
            return worker

        def refill(self) -> None:
            """Start a warm pool worker if there is none (cache on), preparing every stage's
            executables."""
            if self.use_cache and self._pool is None:
                self._pool = QuartWorker(-1, self.spec, (), num_cpus=0)
                self._pool.actor.prepare.remote(list(self.stages))

        def __call__(self, wid: int):
            if not self.use_cache:
                return self._new(wid)
            self.refill()
            worker, self._pool = self._pool, None
            worker.id = wid
            self.made[wid] = worker
            self.from_pool += 1
            self.refill()
            return worker

        def load_sources(self) -> Counter:
            """Loads by parameter source over every replica made, alive or not (a restarted
            replica counts its current actor's)."""
            return Counter(x.source for w in self.made.values() for x in w.load_log())

        def close(self) -> None:
            """End the pool worker (the engine closes the others) and let the manager go."""
            if self._pool is not None:
                self._pool.close()
                self._pool = None
            self.manager = None

    __all__ += ["QuartDiskHost", "QuartDiskWorker", "QuartRayWorkers", "QuartStageHost", "QuartWorker"]
