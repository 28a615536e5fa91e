"""Ray workers: stages held by a Ray actor in its own process, possibly on another node.

A :class:`RayWorker` is the driver's handle on one actor (:class:`StageHost`, a Ray Core
actor: Ray is the distributed engine, never a home-made RPC). The actor is built from a
picklable :class:`WorkerSpec` (what of the serve settings it needs) and the stages to hold.
In its own process it opens the compile cache *on its own node* (``spec.cache_dir``, the
same path there), loads each model with the server's assembly (``load_runtimes``) and
builds stage runtimes for layer ranges (``jaxserve.stages``). It loads serialized
executables; a compile there means the node's cache lacked a cell (its count is reported:
:meth:`RayWorker.compilations`, and a warning at start). Steps go out as actor calls, and
answers come back through Ray's object store. A dead actor process makes every future of
its steps raise :class:`~jaxserve.workers.WorkerDied`.

**Activations between steps** (``WorkerSpec.handoff``). ``"store"`` (the default): a
non-final step's activations stay out of the driver. The actor returns them as a second
object (host arrays) that the driver never fetches (it holds a
:class:`~jaxserve.workers.StoredCarry`), and keeps its own copy (device arrays, the last
:data:`KEPT_CARRIES`). The next step on the same actor uses that copy and moves nothing;
a step on another actor names the object, which Ray hands over store to actor (zero-copy
on one node), and takes its rows there (:class:`~jaxserve.workers.CarryParts`: AsyFunc's
shadow gets only its rows, and the body merges the shadow's part with its own). Objects
under Ray's inline limit (100 KB) travel inside the call. ``"driver"``: the step returns
its activations to the driver as numpy arrays and the next step sends them back (the hand-off
before, kept for comparison: ``bench/workers.py``). Stored activations live as long as the
driver's handle on them (a request's carry until its next step finishes); on one node they
outlive the actor that made them (the node's object store holds them).

Filling a node's compile cache: run ``jaxserve warmup`` on that node with the flags the
server gets (models, grids, precision, heads/prompts, ``--no-tune``, ``--tune-attention`` or neither) and the same
``--cache-dir`` path, or copy a warmed cache directory there from a machine of the same
kind. Either way the key rules decide: an entry keyed for another jax/jaxlib version,
CPU instruction set, device kind, ``XLA_FLAGS``, attention build or jaxserve source never
loads (the actor compiles that cell instead, and says so). The environment variables that
enter the keys (``JAX_*``, ``XLA_*``, ``JAXSERVE_*``) are passed from the driver to every
actor, so a node's warmup must run with the same ones.

Needs the optional extra: ``pip install 'jaxserve[ray]'``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import socket
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

try:
    import ray
    import ray.exceptions
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("Ray workers need the ray extra: pip install 'jaxserve[ray]'") from exc

from jaxserve.sched.base import Stage
from jaxserve.workers import (CarryParts, Holdings, Step, StepOutput, StoredCarry, Worker, WorkerDied, local_carry,
                              run_step)

log = logging.getLogger("jaxserve.ray_workers")

# the actor process is gone (killed, crashed, its node lost): its steps never finish
_DEATH = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
          ray.exceptions.ObjectLostError, ray.exceptions.LocalRayletDiedError)
# environment variables that enter the compile cache keys or choose the backend
_ENV_PREFIXES = ("JAX_", "XLA_", "JAXSERVE_")
DEFAULT_OBJECT_STORE_MB = 256
KEPT_CARRIES = 8  # activations an actor keeps on its device for its own next steps (the most recent)
HANDOFFS = ("store", "driver")
_WORKER_UIDS = itertools.count(1)  # a RayWorker's identity in this process (a worker id may be reused)
_CARRY_TOKENS = itertools.count(1)  # one per step: the key of the activations it leaves


def _absolute(path: str | None) -> str | None:
    return None if path is None else str(Path(path).expanduser().absolute())


@dataclass(frozen=True)
class WorkerSpec:
    """What an actor needs of the serve settings to load models as the server does.

    Paths are absolute (resolved on the driver) and name the same place on every node.
    ``env``: variables set in the actor before it imports JAX. ``prime``: run every cell
    of a loaded model once before reporting ready, as the server does before ready.
    ``cpus``: the CPU ids the actor's process is pinned to (every thread, before JAX starts, so
    XLA sizes its thread pool to them: :func:`pin_process`); empty: not pinned. ``handoff``:
    where a step's activations wait for the next step (module docstring): ``"store"`` or
    ``"driver"``."""

    models: tuple[str, ...]
    cache_dir: str | None
    precision: str = "f32"
    tune: bool | str = True
    text_grid: Any = None
    image_grid: Any = None
    heads_dir: str | None = None
    prompts_dir: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    prime: bool = True
    cpus: tuple[int, ...] = ()
    handoff: str = "store"

    def __post_init__(self) -> None:
        if self.handoff not in HANDOFFS:
            raise ValueError(f"handoff must be one of {', '.join(HANDOFFS)}, not {self.handoff!r}")

    @classmethod
    def from_settings(cls, settings: Any, env: dict[str, str] | None = None, prime: bool = True) -> "WorkerSpec":
        """The spec of ``settings`` (a ``ServeSettings``); ``env`` defaults to the driver's
        ``JAX_*``, ``XLA_*`` and ``JAXSERVE_*`` variables.

        ``tune`` is kept as given: the cache key names the tuning candidates, so an actor
        must tune (or not) as the node's warmup did to find its entries. Loading a tuned
        entry times nothing: the stored winner loads."""
        if env is None:
            env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
        return cls(models=tuple(settings.models), cache_dir=_absolute(settings.cache_dir),
                   precision=settings.precision, tune=settings.tune, text_grid=settings.text_grid,
                   image_grid=settings.image_grid, heads_dir=_absolute(settings.heads_dir),
                   prompts_dir=_absolute(settings.prompts_dir), env=tuple(sorted(env.items())), prime=prime)


@dataclass(frozen=True)
class HostReport:
    """What an actor holds, as it reports after every change: per stage (param bytes,
    executables); its OS pid and node; backend compiles in its process so far."""

    stages: dict
    pid: int
    node: str
    compilations: int


def _assembly():
    """The server's assembly functions (``jaxserve.launch``; ``serving.server`` before it)."""
    try:
        from jaxserve import launch as assembly
    except ImportError:
        from serving import server as assembly
    return assembly


def pin_process(cpus: Sequence[int]) -> None:
    """Pin every thread of this process to ``cpus`` (Linux affinity is per thread; threads
    started later inherit their creator's). Before JAX starts, this also sizes XLA's CPU
    thread pool, which reads the process's affinity once."""
    cpus = set(cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


class StageHost:
    """The actor: holds stages in its own process and runs steps one at a time (Ray runs
    an actor's calls from one caller in order, one at a time)."""

    def __init__(self, spec: WorkerSpec):
        for key, value in spec.env:  # before anything here imports JAX
            os.environ[key] = value
        if spec.cpus:
            pin_process(spec.cpus)
        self._spec = spec
        self._cache = None
        self._parents: dict[str, Any] = {}  # model -> whole-model runtime
        self._runners: dict[Stage, Any] = {}
        self._kept: OrderedDict[int, Any] = OrderedDict()  # token -> activations this actor made (device arrays)
        self._handoffs: Counter = Counter()  # how the parts of its steps' activations arrived

    # ------------------------------------------------------------------ loading
    def _open_cache(self):
        if self._cache is None and self._spec.cache_dir:
            from jaxserve.compile_cache import CompileCache

            self._cache = CompileCache(self._spec.cache_dir)
        return self._cache

    def _parent(self, model: str):
        if model in self._parents:
            return self._parents[model]
        spec = self._spec
        if model not in spec.models:
            raise ValueError(f"model {model!r} is not served (models: {', '.join(spec.models)})")
        assembly = _assembly()
        settings = assembly.ServeSettings(
            models=(model,), cache_dir=spec.cache_dir, precision=spec.precision, tune=spec.tune, progress=False,
            text_grid=spec.text_grid, image_grid=spec.image_grid, heads_dir=spec.heads_dir,
            prompts_dir=spec.prompts_dir)
        runtimes = assembly.load_runtimes(settings, self._open_cache())
        if spec.prime:
            assembly.run_every_cell_once(runtimes)
        self._parents[model] = runtimes[model]
        return runtimes[model]

    def _runner(self, stage: Stage):
        parent = self._parent(stage.model)
        if parent.num_layers and stage.num_layers != parent.num_layers:
            raise ValueError(f"{stage.label()}: {stage.model} has {parent.num_layers} layers, "
                             f"not {stage.num_layers}")
        if stage.whole:
            return parent
        from jaxserve.stages import build_stage_runtimes

        return build_stage_runtimes(parent, [stage], self._open_cache(), tune=self._spec.tune)[stage]

    def hold(self, stages: Sequence[Stage]) -> HostReport:
        """Load ``stages`` (a new actor's first call)."""
        for stage in stages:
            if stage not in self._runners:
                self._runners[stage] = self._runner(stage)
        return self.report()

    def load(self, stage: Stage) -> tuple[float, HostReport]:
        """Load ``stage``; the seconds it took here, and the new report."""
        t0 = time.perf_counter()
        self.hold([stage])
        return time.perf_counter() - t0, self.report()

    def unload(self, stage: Stage) -> HostReport:
        self._runners.pop(stage, None)
        if not any(s.model == stage.model for s in self._runners):
            self._parents.pop(stage.model, None)  # its weights and executables are freed
        return self.report()

    def reload_assets(self) -> None:
        """Swap in each held model's task assets, re-read from this node's files (what the
        driver checked and swapped in its own process a moment before)."""
        for rt in self._parents.values():
            if rt.read_assets is not None:
                rt.swap_assets(*rt.read_assets())

    def report(self) -> HostReport:
        from jaxserve.compile_cache import compile_count
        from jaxserve.workers import runner_executables, runner_param_bytes

        stages = {s: (runner_param_bytes(r), runner_executables(r)) for s, r in self._runners.items()}
        return HostReport(stages, os.getpid(), socket.gethostname(), compile_count())

    def compilations(self) -> int:
        from jaxserve.compile_cache import compile_count

        return compile_count()

    def pin(self, cpus: Sequence[int]) -> list[int]:
        """Re-pin this process to ``cpus`` (a started pool worker given its shadow's cores;
        XLA's thread pool keeps the size it had at start). Returns the affinity now."""
        pin_process(cpus)
        return sorted(os.sched_getaffinity(0))

    # ------------------------------------------------------------------ steps
    def _run(self, step: Step) -> StepOutput:
        runner = self._runners.get(step.stage)
        if runner is None:
            raise KeyError(f"this actor does not hold {step.stage.label()}")
        return run_step(runner, step)

    def run(self, step: Step) -> StepOutput:
        """Run ``step``; its activations (if any) come back in the output as numpy arrays
        (the ``"driver"`` hand-off)."""
        out = self._run(step)
        if out.carry is not None:  # device arrays leave as numpy, through the object store
            out.carry = _host(out.carry)
        return out

    def run_stored(self, step: Step, how: tuple | None = None, *resolved: Any) -> Any:
        """Run ``step`` (the ``"store"`` hand-off). ``how``: None (a first stage or whole model),
        or (``parts``, ``token``), one argument (Ray pays per argument). ``parts``: where
        its activations come from, per part ``("kept", token, [ref], rows)`` (this actor's
        own, by ``token``; the nested ``ref`` is read only if they were dropped),
        ``("ref", i, rows)`` (``resolved[i]``, which Ray fetched from the object store) or
        ``("inline", activations, rows)``; ``rows`` None takes all of a part as it is.
        A last stage (or whole model) makes no activations: returns its output (one return).
        Else returns (the output with ``carry`` the activations' row count; the activations as
        host arrays), two returns, and keeps the activations under ``token``."""
        parts, token = how if how is not None else ((), 0)
        if parts:
            sources = tuple((self._source(entry, resolved), entry[-1]) for entry in parts)
            step = dataclasses.replace(step, carry=CarryParts(sources).gather())
        out = self._run(step)
        if step.stage.last:
            return out
        self._kept[token] = out.carry
        while len(self._kept) > KEPT_CARRIES:
            self._kept.popitem(last=False)
        return StepOutput(out.items, out.carry.count, out.compute_seconds), _host(out.carry)

    def _source(self, entry: tuple, resolved: tuple) -> Any:
        kind = entry[0]
        if kind == "kept":
            kept = self._kept.get(entry[1])
            if kept is not None:
                self._handoffs["kept"] += 1
                return kept
            self._handoffs["store"] += 1
            return ray.get(entry[2][0])
        self._handoffs["store" if kind == "ref" else kind] += 1
        return resolved[entry[1]] if kind == "ref" else entry[1]

    def handoffs(self) -> dict[str, int]:
        """How the parts of this actor's steps' activations arrived so far: ``kept`` (its
        own, on its device), ``store`` (from Ray's object store), ``inline`` (in the call)."""
        return dict(self._handoffs)

    def echo(self, value: Any) -> Any:
        """Return ``value`` (round trips and transfers, for bench/workers.py)."""
        return value

    def nbytes(self, value: Any) -> int:
        """Bytes of the array(s) received (a transfer's far end, for bench/workers.py)."""
        import numpy as np

        return int(sum(np.asarray(v).nbytes for v in (value if isinstance(value, (list, tuple)) else [value])))


def _host(carry: Any) -> Any:
    """``carry`` with its device arrays as numpy (what leaves the actor's process)."""
    import jax
    import numpy as np

    return jax.tree_util.tree_map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a, carry)


_HostActor = ray.remote(StageHost)


class RayWorker(Worker):
    """A worker whose stages live in a Ray actor (:class:`StageHost`).

    ``ready`` is a future of the seconds from asking for the actor to its report (process
    start, imports, weights and executables loaded and run once). Steps may be submitted at
    once: they queue behind the load. :meth:`holdings` answers from the actor's last
    report, without a call. A step of a stage neither held nor being loaded raises KeyError.
    """

    kind = "ray"
    actor_class = _HostActor  # a subclass may host a StageHost subclass (asyfunc_exec.PoolWorker)

    def __init__(self, worker_id: int, spec: WorkerSpec, stages: Sequence[Stage] = (), *,
                 num_cpus: float = 1, num_gpus: float = 0):
        super().__init__(worker_id)
        self.spec = spec
        self._options = dict(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_task_retries=0)
        self._state = threading.Lock()
        self._stages: set[Stage] = set(stages)  # held or being loaded: steps may be queued for them
        self._report: HostReport | None = None
        self._generation = 0
        self._dead = False
        self._closed = False
        self._actor = None
        self.uid = next(_WORKER_UIDS)
        self.ready: Future = self._start()

    # ------------------------------------------------------------------ actor life
    def _start(self) -> Future:
        with self._state:
            self._generation += 1
            generation, stages = self._generation, sorted(self._stages)
            self._actor = self.actor_class.options(**self._options).remote(self.spec)
            self._dead = False
            self._report = None
            ref = self._actor.hold.remote(stages)
        t0 = time.perf_counter()

        def ready(report: HostReport) -> float:
            self._take(report, generation)
            if report.compilations:
                log.warning("worker %d (pid %d on %s) compiled %d programs at load: its node's compile cache "
                            "lacked them (run `jaxserve warmup` there with the server's flags)",
                            self.id, report.pid, report.node, report.compilations)
            return time.perf_counter() - t0

        return self._future(ref, generation, ready)

    def _take(self, report: HostReport, generation: int) -> None:
        with self._state:
            if generation == self._generation:
                self._report = report

    def _future(self, ref, generation: int, then: Callable[[Any], Any]) -> Future:
        """A concurrent future of ``then(result of ref)``; a dead actor raises WorkerDied."""
        out: Future = Future()
        out.set_running_or_notify_cancel()

        def done(inner: Future) -> None:
            try:
                value = inner.result()
            except _DEATH as exc:
                with self._state:
                    if generation == self._generation:
                        self._dead = True
                died = WorkerDied(f"worker {self.id}: its actor process is gone ({type(exc).__name__})")
                died.__cause__ = exc
                out.set_exception(died)
                return
            except BaseException as exc:  # the step's own error, raised in the actor
                out.set_exception(exc)
                return
            try:
                out.set_result(then(value))
            except BaseException as exc:
                out.set_exception(exc)

        ref.future().add_done_callback(done)
        return out

    # ------------------------------------------------------------------ Worker
    def submit(self, step: Step) -> Future:
        if self.spec.handoff == "driver":
            return self._submit_through_driver(step)
        carry, parts, refs = step.carry, [], []
        with self._state:
            self._check(step)
            holder, token = (self.uid, self._generation), next(_CARRY_TOKENS)
            if isinstance(carry, (StoredCarry, CarryParts)):
                for src, rows in (carry.parts if isinstance(carry, CarryParts) else ((carry, None),)):
                    if not isinstance(src, StoredCarry):
                        parts.append(("inline", _host(src), rows))
                    elif src.holder == holder:
                        parts.append(("kept", src.token, [src.ref], rows))  # nested: Ray leaves it unread
                    else:
                        parts.append(("ref", len(refs), rows))
                        refs.append(src.ref)  # an argument: Ray hands its object to the actor
                step = dataclasses.replace(step, carry=None)
            generation, call = self._generation, self._actor.run_stored
            # Ray pays per argument and per return (~0.1 ms each here): a whole model's step is
            # one argument and one return, as a plain call
            args = (step,) if step.stage.last and not parts else (step, (tuple(parts), token), *refs)
            if step.stage.last:
                ref, carry_ref = call.remote(*args), None
            else:
                ref, carry_ref = call.options(num_returns=2).remote(*args)

        def finished(out: StepOutput) -> StepOutput:
            self._add_busy(out.compute_seconds)
            if out.carry is not None:  # its row count: the activations wait in the store and the actor
                out.carry = StoredCarry(carry_ref, int(out.carry), holder, token)
            return out

        return self._future(ref, generation, finished)

    def _check(self, step: Step) -> None:
        """Refuse a step this worker may not run (called holding ``_state``)."""
        if self._closed:
            raise RuntimeError(f"worker {self.id} is closed")
        if step.stage not in self._stages:
            raise KeyError(f"worker {self.id} does not hold {step.stage.label()}")

    def _submit_through_driver(self, step: Step) -> Future:
        if isinstance(step.carry, (StoredCarry, CarryParts)):  # made by a "store" worker: fetched here
            step = dataclasses.replace(step, carry=local_carry(step.carry))
        with self._state:
            self._check(step)
            generation, ref = self._generation, self._actor.run.remote(step)

        def finished(out: StepOutput) -> StepOutput:
            self._add_busy(out.compute_seconds)
            return out

        return self._future(ref, generation, finished)

    def holdings(self) -> Holdings:
        with self._state:
            report = self._report
        held = dict(report.stages) if report is not None else {}
        return Holdings(frozenset(held), sum(b for b, _ in held.values()), sum(e for _, e in held.values()),
                        None if report is None else report.compilations)

    def load(self, stage: Stage) -> Future:
        with self._state:
            if stage in self._stages and self._report is not None and stage in self._report.stages:
                fut: Future = Future()
                fut.set_result(0.0)
                return fut
            self._stages.add(stage)
            generation, ref = self._generation, self._actor.load.remote(stage)

        def loaded(result: tuple[float, HostReport]) -> float:
            seconds, report = result
            self._take(report, generation)
            return seconds

        fut = self._future(ref, generation, loaded)

        def forget_on_failure(f: Future) -> None:
            if f.exception() is not None:
                with self._state:
                    if generation == self._generation:
                        self._stages.discard(stage)

        fut.add_done_callback(forget_on_failure)
        return fut

    def unload(self, stage: Stage) -> None:
        with self._state:
            self._stages.discard(stage)
            if self._report is not None and stage in self._report.stages:
                stages = {s: v for s, v in self._report.stages.items() if s != stage}
                self._report = HostReport(stages, self._report.pid, self._report.node, self._report.compilations)
            generation, ref = self._generation, self._actor.unload.remote(stage)
        self._future(ref, generation, lambda report: self._take(report, generation))

    def reload_assets(self) -> Future:
        with self._state:
            generation, ref = self._generation, self._actor.reload_assets.remote()
        return self._future(ref, generation, lambda _: None)

    def restart(self) -> Future:
        """Kill the actor (its queued steps fail with WorkerDied) and start a new one
        holding the same stages; resolves to the seconds until it is ready."""
        with self._state:
            if self._closed:
                raise RuntimeError(f"worker {self.id} is closed")
            old = self._actor
        ray.kill(old, no_restart=True)
        self.ready = self._start()
        return self.ready

    def close(self) -> None:
        """Let the actor finish what was submitted, then end its process."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            actor = self._actor
        actor.__ray_terminate__.remote()

    @property
    def alive(self) -> bool:
        with self._state:
            return not (self._closed or self._dead)

    @property
    def closed(self) -> bool:
        """Closed for good (a dead worker the engine restarts is not)."""
        with self._state:
            return self._closed

    # ------------------------------------------------------------------ beyond Worker
    def pid(self) -> int:
        """The actor's OS pid (waits until it is ready)."""
        self.ready.result()
        with self._state:
            return self._report.pid

    def node(self) -> str:
        """The host name of the actor's node (waits until it is ready)."""
        self.ready.result()
        with self._state:
            return self._report.node

    def compilations(self) -> int:
        """XLA backend compiles in the actor's process so far (one call, queued behind
        the steps submitted before it). Zero after a load from a warmed cache."""
        with self._state:
            actor = self._actor
        return ray.get(actor.compilations.remote())

    def handoffs(self) -> dict[str, int]:
        """:meth:`StageHost.handoffs` of the actor (one call, queued behind earlier steps)."""
        with self._state:
            actor = self._actor
        return ray.get(actor.handoffs.remote())

    @property
    def actor(self):
        """The Ray actor handle (for measurements; steps go through :meth:`submit`)."""
        with self._state:
            return self._actor


def ensure_ray(address: str | None = None, num_cpus: int | None = None,
               object_store_mb: int = DEFAULT_OBJECT_STORE_MB) -> None:
    """Start or join Ray in this process, once (a second call does nothing). A local Ray is
    started from the main thread only (RuntimeError elsewhere): its processes die with the
    thread that starts them.

    ``address`` None starts a local Ray with ``num_cpus`` logical CPUs, no dashboard, the
    workers' logs left in Ray's log directory and a small object store (``object_store_mb``);
    ``"auto"`` or ``HOST:PORT`` joins a running cluster (``ray start --head`` there; with
    Ray's token authentication on, the driver needs that cluster's token, e.g. in
    ``RAY_AUTH_TOKEN``). Every node needs jaxserve installed and its compile cache filled."""
    if ray.is_initialized():
        return
    if address is None and threading.current_thread() is not threading.main_thread():
        # Ray makes a local cluster's processes (GCS, raylet) die with the thread that started
        # them (Linux's parent-death signal): started from a worker thread, Ray vanishes when
        # that thread ends, and this process with it
        raise RuntimeError("a local Ray must be started from the main thread (it dies with the thread that "
                           "starts it): call jaxserve.launch.start_workers_runtime there first")
    if address is None:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 object_store_memory=object_store_mb << 20, logging_level=logging.WARNING)
    else:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)


def ray_worker_factory(settings: Any, worker_cpus: float = 1, gpus: bool = False) -> Callable[..., RayWorker]:
    """``factory(worker_id, stages=())``: a new :class:`RayWorker` for ``settings`` (Ray must
    be started: :func:`ensure_ray`); what the engine calls to add a worker at run time.
    ``gpus``: one GPU per actor (ValueError now if the cluster has none)."""
    if gpus and ray.cluster_resources().get("GPU", 0) < 1:
        raise ValueError("GPU workers asked for, but the Ray cluster has no GPU")
    spec = WorkerSpec.from_settings(settings)

    def factory(worker_id: int, stages: Sequence[Stage] = ()) -> RayWorker:
        return RayWorker(worker_id, spec, stages, num_cpus=worker_cpus, num_gpus=1 if gpus else 0)

    return factory


def ensure_ray_for(n: int, address: str | None = None, worker_cpus: float = 1,
                   object_store_mb: int = DEFAULT_OBJECT_STORE_MB) -> None:
    """:func:`ensure_ray` for ``n`` workers of ``worker_cpus`` each: a local Ray gets enough
    logical CPUs for all of them (and twice that, for workers a plan adds later), and an
    object store of ``object_store_mb``."""
    ensure_ray(address, num_cpus=max(os.cpu_count() or 1, int(2 * n * worker_cpus + 0.999))
               if address is None else None, object_store_mb=object_store_mb)


def make_ray_workers(settings: Any, n: int, stages_for_worker: Callable[[int], Sequence[Stage]] | Sequence,
                     address: str | None = None, worker_cpus: float = 1, gpus: bool = False,
                     first_id: int = 0, wait: bool = True) -> list[RayWorker]:
    """``n`` Ray workers (ids ``first_id``...) for ``settings`` (a ``ServeSettings``).

    ``stages_for_worker(i)`` (or ``stages_for_worker[i]``) lists what worker ``i`` holds.
    Starts a local Ray (``address`` None; enough logical CPUs for every actor) or joins
    one (:func:`ensure_ray`). Each actor asks for ``worker_cpus`` CPUs and, with ``gpus``,
    one GPU (ValueError if the cluster has none). ``wait``: return once every actor is
    ready (if one fails, all are closed and its error raised)."""
    stages_of = stages_for_worker if callable(stages_for_worker) else stages_for_worker.__getitem__
    ensure_ray_for(n, address, worker_cpus)
    factory = ray_worker_factory(settings, worker_cpus, gpus)
    workers = [factory(first_id + i, tuple(stages_of(i))) for i in range(n)]
    if wait:
        all_ready(workers)
    return workers


def all_ready(workers: Sequence[RayWorker]) -> None:
    """Wait until every worker is ready; if one fails, close them all and raise its error."""
    try:
        for worker in workers:
            worker.ready.result()
    except BaseException:
        for worker in workers:
            worker.close()
        raise
