"""Start-up: load and warm every model, price every cell, build the policy and the engine.

``/healthz`` answers from the first moment; ``/readyz`` says 503 until every
executable is compiled or loaded and the cost model exists, then 200. On SIGTERM
uvicorn stops accepting connections and the lifespan shutdown drains the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from fastapi import FastAPI

from jaxserve.compile_cache import CompileCache, compile_count
from jaxserve.engine import Engine
from jaxserve.polymorph import WarmupCancelled, raise_if_stopped
from jaxserve.profiler import load_cost_model, machine_description, profile_table, save_cost_model
from jaxserve.runtime import ModelRuntime
from jaxserve.sched import IMAGE_POLICIES, SERVE_POLICIES, TEXT_STREAM_POLICIES
from jaxserve.sched.base import Cell, CostModel
from serving.app import ServerState, create_app, error_body

log = logging.getLogger("jaxserve.server")


@dataclass
class ServeSettings:
    models: tuple[str, ...] = ("minilm-l6", "vit-demo")
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
    precision: str = "f32"  # dense-kernel dtype of every model: "f32" or "bf16" (jaxserve.models.precision)
    tune: bool = True  # warmup times each cell's alternative compile options and keeps the fastest (PolymorphTable)
    progress: bool = True
    text_grid: object = None  # ShapeGrid override (tests use a small one)
    image_grid: object = None
    heads_dir: str | None = None  # minilm-l6's task heads (TASK.npz); None: the shipped ones
    prompts_dir: str | None = None  # vit-demo's prompt repository; None: the shipped one
    extra: dict = field(default_factory=dict)
    # Arlo and its baselines (--policy arlo|st|dt|infaas; jaxserve/sched/arlo.py, baselines.py)
    # the deadline of every request that sends no slo_ms (Engine.default_slo_ms); for arlo/st/dt/infaas
    # also the stream's SLO they plan for (None there: the paper's SLO scaled by the profile)
    slo_ms: float | None = None
    arlo_period_s: float = 120.0  # Runtime Scheduler period (paper: 120 s)
    arlo_max_batch: int = 1  # requests per batch (paper: 1)
    dt_penalty: float | None = None  # DT's dynamic-shape slowdown; None: baselines.DEFAULT_DT_PENALTY
    arlo_autoscale_from: int | None = None  # arlo: start this many of `instances` slots, target-tracking scaling


def load_runtimes(settings: ServeSettings, cache: CompileCache | None,
                  stop: Callable[[], bool] | None = None) -> dict[str, ModelRuntime]:
    """Every model warmed over its grid; ``stop`` as ``PolymorphTable.warmup``'s."""
    from jaxserve import registry

    runtimes = {}
    for name in settings.models:
        if name == "minilm-l6":
            runtimes[name] = registry.load_text_runtime(
                name, cache, settings.text_grid, settings.progress, precision=settings.precision,
                heads_dir=None if settings.heads_dir is None else Path(settings.heads_dir), stop=stop,
                tune=settings.tune)
        elif name == "vit-demo":
            runtimes[name] = registry.load_image_runtime(name, cache, settings.image_grid, settings.progress,
                                                         prompts_dir=settings.prompts_dir,
                                                         precision=settings.precision, stop=stop,
                                                         tune=settings.tune)
        else:
            raise ValueError(f"unknown model {name!r}; known: minilm-l6, vit-demo")
    return runtimes


def default_cost_model_path(cache_dir: str | Path, precision: str = "f32") -> Path:
    """Where a cache directory keeps its measured cost model: one file per precision, since a
    bf16 cell's latency is not a float32 cell's."""
    return Path(cache_dir) / ("cost_model.json" if precision == "f32" else f"cost_model-{precision}.json")


def example_inputs(rt: ModelRuntime, cell: Cell) -> tuple:
    """Representative inputs for timing a cell: full-length text, random images."""
    if rt.kind == "text":
        ids = np.full((cell.batch, cell.seq), 1000, np.int32)
        return ids, np.ones_like(ids)
    h, w, c = rt.image_shape
    images = np.random.default_rng(0).random((cell.batch, h, w, c), dtype=np.float32)
    return rt.prepare_inputs(cell, list(images), [""] * cell.batch)  # + per-sample prompts/heads


def run_every_cell_once(runtimes: dict[str, ModelRuntime], stop: Callable[[], bool] | None = None) -> None:
    """Execute every warm executable once before ready (profiling does this as a side effect).

    A loaded executable's first call pays one-time costs (buffer allocation, thread-pool
    start, first touches of its code and constants); without this, live requests pay
    them, one per cell, in the first seconds after ready.
    """
    import jax

    for rt in runtimes.values():
        for cell in rt.grid.cells():
            raise_if_stopped(stop)
            jax.block_until_ready(rt.table.run(cell, rt.weights, *example_inputs(rt, cell)))


def price_cells(runtimes: dict[str, ModelRuntime], path: Path | None, progress: bool,
                stop: Callable[[], bool] | None = None) -> CostModel:
    """The cost model the policy uses: read from ``path`` if it prices every cell, else
    measured now (``jaxserve profile`` does the same, with more repeats) and saved."""
    if path is not None and path.exists():
        cost = load_cost_model(path)
        if all(n in cost.latency and set(rt.grid.cells()) <= set(cost.latency[n].seconds)
               for n, rt in runtimes.items()):
            run_every_cell_once(runtimes, stop)
            return cost
    latency = {
        name: profile_table(rt.table, rt.weights, lambda cell, rt=rt: example_inputs(rt, cell),
                            repeats=3, progress=progress, stop=stop)
        for name, rt in runtimes.items()
    }
    cost = CostModel(latency=latency, machine=machine_description())
    if path is not None:
        save_cost_model(path, cost)
    return cost


def make_policy(settings: ServeSettings, runtimes: dict[str, ModelRuntime], cost: CostModel):
    grids = {name: rt.grid for name, rt in runtimes.items()}
    if settings.policy == "default":
        from jaxserve.sched.batching import DeadlineBatching

        return DeadlineBatching(grids, cost, max_queue=settings.max_queue, max_wait=settings.max_wait_ms / 1e3)
    if settings.policy in TEXT_STREAM_POLICIES:
        return _arlo_family_policy(settings, runtimes, cost)
    if settings.policy in IMAGE_POLICIES:
        from jaxserve.sched.otas import make_otas_policy

        return make_otas_policy(settings.policy, runtimes, cost, settings.extra.get("otas", {}))
    raise ValueError(f"unknown policy {settings.policy!r}; known: {', '.join(SERVE_POLICIES)}")


def _arlo_family_policy(settings: ServeSettings, runtimes: dict, cost: CostModel):
    """Arlo, ST, DT or INFaaS-like for the one text model served (jaxserve/sched/baselines.py).

    These policies own every instance for one request stream (Arlo §3.1), so the
    server must serve exactly one text model. DT's modelled dynamic-shape cost is
    paid live by wrapping that model's runtime in :class:`DynamicShapeEmulation`
    (the ``runtimes`` dict is the one the engine receives).
    """
    from jaxserve.sched import baselines
    from jaxserve.sched.arlo import ArloPolicy

    if len(runtimes) != 1 or not next(iter(runtimes.values())).grid.seq_buckets:
        raise ValueError(f"--policy {settings.policy} serves exactly one text model (--model minilm-l6); "
                         f"got {sorted(runtimes)}")
    (name, rt), = runtimes.items()
    profile = cost.latency[name]
    slo = settings.slo_ms / 1e3 if settings.slo_ms else baselines.paper_scaled_slo(profile, rt.grid.max_length)
    common = dict(max_batch=settings.arlo_max_batch)
    if settings.policy == "arlo":
        if settings.arlo_autoscale_from is None:
            return ArloPolicy(name, rt.grid, cost, slo, settings.instances, period=settings.arlo_period_s, **common)
        # §4 target tracking: the engine runs `instances` worker slots, the policy activates them as it scales
        from jaxserve.sched.arlo import TargetTrackingAutoscaler

        scaler = TargetTrackingAutoscaler(slo, min_instances=1, max_instances=settings.instances)
        return ArloPolicy(name, rt.grid, cost, slo, settings.arlo_autoscale_from, period=settings.arlo_period_s,
                          autoscaler=scaler, scale_pool=settings.instances, **common)
    if settings.policy == "st":
        return baselines.StaticPaddingPolicy(name, rt.grid, cost, slo, settings.instances, **common)
    if settings.policy == "infaas":
        return baselines.InfaasLikePolicy(name, rt.grid, cost, slo, settings.instances, **common)
    penalty = settings.dt_penalty or baselines.DEFAULT_DT_PENALTY
    policy = baselines.DynamicShapePolicy(name, rt.grid, cost, slo, settings.instances, penalty=penalty, **common)
    if hasattr(rt, "execute"):
        runtimes[name] = DynamicShapeEmulation(rt, policy.live_factor)
    return policy


class DynamicShapeEmulation:
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

    def __init__(self, runtime, factor_for):
        self._runtime = runtime
        self._factor_for = factor_for

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    def execute(self, cell, payloads, tasks):
        import time

        t0 = time.perf_counter()
        out = self._runtime.execute(cell, payloads, tasks)
        measured = time.perf_counter() - t0
        target = measured * self._factor_for(cell, len(payloads), max(len(p) for p in payloads))
        rest = target - measured
        if rest > 0:
            time.sleep(rest)
        out.compute_seconds = max(out.compute_seconds, target)
        return out


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
    prompts it started with, so a reload under it is refused."""
    before = compile_count()
    fresh = {name: rt.read_assets() for name, rt in engine.runtimes.items() if rt.read_assets is not None}
    for name, (heads, prompts, _) in fresh.items():
        engine.runtimes[name].check_assets(heads, prompts)
    then = None
    if settings.policy in IMAGE_POLICIES:
        from jaxserve.sched.otas import check_coverage

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
    log.info("reloaded task assets: %s", "; ".join(f"{n}: {', '.join(m['tasks'])}" for n, m in models.items()))
    report = {"models": models, "compilations": compile_count() - before}
    if then is not None:
        report["then"] = then
    return report


def build_engine(settings: ServeSettings, stop: Callable[[], bool] | None = None) -> Engine:
    """Load and warm every model, price every cell, build the policy and the engine.
    ``stop`` is asked before each cell (compile, profile, first run): True raises
    ``WarmupCancelled``, so a server shut down while it warms exits within a cell."""
    cache = CompileCache(settings.cache_dir) if settings.cache_dir else None
    runtimes = load_runtimes(settings, cache, stop)
    cost_path = Path(settings.cost_model) if settings.cost_model else (
        default_cost_model_path(settings.cache_dir, settings.precision) if settings.cache_dir else None)
    cost = price_cells(runtimes, cost_path, settings.progress, stop)
    policy = make_policy(settings, runtimes, cost)
    return Engine(runtimes, policy, instances=settings.instances, max_queue=settings.max_queue,
                  default_slo_ms=settings.slo_ms)


GC_THRESHOLDS = (50_000, 20, 100)


def settle_heap() -> None:
    """After warmup: freeze everything warmup allocated out of the cyclic GC, and collect rarely.

    Warmup leaves millions of long-lived objects (traced jaxprs, executables, weights'
    Python wrappers, tokenizer tables) that every full collection then walks. Under load
    the allocation rate of the request path triggers collections often enough that
    py-spy found the event loop in ``gc_collect_main`` 25% of the time at 180 req/s, the
    largest single cost on the loop. ``gc.freeze()`` moves the warm heap to a permanent
    generation that collections skip; a larger gen-0 threshold makes young collections
    rarer (request objects die young by reference counting anyway). Cycles are still
    collected, and nothing frozen is ever freed, which is right for objects that live as
    long as the server.
    """
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _reload_on_sighup(app: FastAPI) -> None:
    """SIGHUP reloads the task assets, as daemons conventionally reread their files on it
    (its default action would end the process). Only where the event loop runs in the main
    thread (``jaxserve serve``); an embedding application keeps its own signal handling."""
    import signal

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGHUP"):
        return

    async def reload():
        try:
            await app.state.reload_now()
        except Exception as exc:  # refused (logged by reload_now) or not offered: the server goes on
            log.warning("SIGHUP: %s", getattr(exc, "message", exc))

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(reload()))


def build_app(settings: ServeSettings, on_warmup_error: Callable[[], None] | None = None) -> FastAPI:
    """The app; it warms its engine in the background while /healthz and /readyz answer.
    A warmup error is logged and reported by /readyz and /v1/models; ``on_warmup_error``
    is then called too (``serve`` uses it to stop the server and exit 1, as Triton does by
    default, so a supervisor sees the failure; an embedding caller may keep serving 503s)."""
    state = ServerState(info={"instances": settings.instances, "max_queue": settings.max_queue})
    state.reload = lambda engine: reload_assets(engine, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        _reload_on_sighup(app)  # from the start: before ready it answers "warming up", never ends the process

        stopping = threading.Event()  # set at shutdown: the warmup thread stops at its next cell

        async def warm():
            try:
                engine = await asyncio.to_thread(build_engine, settings, stopping.is_set)
            except WarmupCancelled:
                return
            except Exception as exc:
                log.exception("warmup failed")
                state.warm_error = f"{type(exc).__name__}: {exc}"
                if on_warmup_error is not None:
                    on_warmup_error()
                return
            engine.stats.observers.append(app.state.metrics.observe_batch)
            engine.compiles_at_ready = compile_count()
            settle_heap()
            state.engine = engine
            log.info("ready: %s", ", ".join(engine.runtimes))

        task = asyncio.create_task(warm())
        yield
        stopping.set()  # without it, Ctrl-C while warming waited for the whole grid (42 s for MiniLM's)
        task.cancel()
        if state.engine is not None:
            drained = await state.engine.drain()
            log.info("drained (%s)", "clean" if drained else "timed out")
            state.engine.close()

    app = create_app(state, settings.max_body_bytes, settings.body_timeout_s, settings.api_key)
    app.router.lifespan_context = lifespan
    app.state.settings = settings
    return app


LINGER_S = 2.0  # after an early answer: how long the rest of a body is read and dropped, at most


class _LingeringClose:
    """The transport as a request cycle sees it: ``close()`` lingers (the protocol's
    ``_linger``) while the request's body is still unread, and closes at once otherwise."""

    def __init__(self, protocol):
        self._protocol = protocol

    def close(self) -> None:
        cycle = self._protocol.cycle
        if cycle is not None and cycle.more_body:
            self._protocol._linger()
        else:
            self._protocol.transport.close()

    def __getattr__(self, name):
        return getattr(self._protocol.transport, name)


def timed_protocol(header_timeout_s: float, on_timeout: Callable[[str], None] | None = None) -> type:
    """uvicorn's httptools protocol with a deadline on request headers.

    uvicorn times out only an idle keep-alive connection *after* a response: a connection
    that sends nothing, or sends its headers a byte at a time, is held for ever (checked on
    uvicorn 0.54: still open after minutes), so a few thousand such clients use up the
    process's file descriptors and coroutines and nobody else gets in ("slowloris"). This
    protocol gives every request ``header_timeout_s`` from the moment the connection opens
    (or, on a keep-alive connection, from the request's first byte) to finish its headers.
    A connection that sent nothing is closed silently (like uvicorn's own keep-alive
    timeout); one with partial headers gets a JSON 408 and is closed. The body has its own
    deadline in the ASGI layer (``serving.app.Guard``), where the answer can name the route.
    ``on_timeout(phase)`` counts them ("idle" or "headers") for the metrics. If a pipelined
    response is still being written when the deadline passes, the 408 waits for it (one
    answer at a time on a connection).

    Two ways around those deadlines are closed too. A request answered before its body
    arrived (a 401, 404 or early 413 that never reads it) has its connection closed once
    answered: uvicorn would go on reading the rest of that body to discard it, with no
    deadline, each byte cancelling its keep-alive timer. That close lingers (RFC 7230 §6.6):
    the server half-closes after its answer, drops whatever else arrives and closes when the
    client does or after ``LINGER_S``. Closing at once, with the client's bytes unread or
    still arriving, makes the kernel answer with a reset that can discard the answer before
    the client reads it (seen under load: httpx's 'Connection reset by peer' for a 401).
    And bytes that arrive between
    requests (blank lines, which the parser skips without starting a request) start the
    next request's header deadline, since they cancel uvicorn's keep-alive timer too."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class TimedHttpProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _got_bytes = False

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        _linger_timer: asyncio.TimerHandle | None = None

        def data_received(self, data: bytes) -> None:
            if self._linger_timer is not None:
                return  # after an early answer: the rest of the body is taken in and dropped
            self._got_bytes = self._got_bytes or bool(data)
            if data and self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # between requests: these bytes begin the next one's headers
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.cycle is not None and self.cycle.more_body and not self.transport.is_closing():
                self._linger()  # answered before its body came: not read on, to no deadline

        def _linger(self) -> None:
            if self._linger_timer is not None or self.transport.is_closing():
                return
            self._disarm()
            self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)
            if self.transport.can_write_eof():  # TLS cannot half-close: it only drains, then closes
                self.transport.write_eof()
            self.flow.resume_reading()  # uvicorn pauses reading a body nobody reads
            # the client's end of stream closes the connection (uvicorn's eof_received)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._header_timer is None:  # a keep-alive connection's next request: a fresh deadline
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()
            # uvicorn closes the connection of a 'connection: close' answer itself, through
            # the cycle's transport: that close lingers too while the body is unread
            self.cycle.transport = _LingeringClose(self)

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._linger_timer is not None:
                self._linger_timer.cancel()
            super().connection_lost(exc)

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                self._header_timer = self.loop.call_later(0.05, self._headers_late)
                return
            phase = "headers" if self._got_bytes else "idle"
            if on_timeout is not None:
                on_timeout(phase)
            if phase == "headers":
                body = json.dumps(error_body(408, f"request headers not received within {header_timeout_s:g} s",
                                             "headers")).encode()
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                     b"x-request-id: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                                     % (uuid.uuid4().hex.encode(), len(body), body))
            self.transport.close()

    return TimedHttpProtocol


def uvicorn_config(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, access_log: bool = False,
                   log_level: str = "info"):
    """The uvicorn configuration every server runs under (``serve`` and the tests' live server)."""
    import uvicorn

    settings: ServeSettings = app.state.settings
    if (settings.ssl_certfile is None) != (settings.ssl_keyfile is None):
        raise ValueError("HTTPS needs both ssl_certfile and ssl_keyfile")
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                          timeout_graceful_shutdown=30, ssl_certfile=settings.ssl_certfile,
                          ssl_keyfile=settings.ssl_keyfile,
                          http=timed_protocol(settings.header_timeout_s, app.state.metrics.read_timeout))


def graceful_server(config, app: FastAPI):
    """uvicorn's server, with ``settings.drain_grace_s`` between SIGTERM and its shutdown.

    uvicorn closes its listening socket as soon as SIGTERM lands, so a load balancer still
    routing here during the seconds its health checks need to notice meets refused
    connections (Kubernetes users add a ``preStop: sleep`` for this). With a grace, the
    first SIGTERM of a ready server instead turns it not-ready (``/readyz`` 503 "shutting
    down") and makes it refuse new work (503 with Retry-After) while it keeps listening and
    finishes what it accepted; after the grace, uvicorn's own shutdown runs (connections
    close, accepted work drains, the process ends as SIGTERM would end it). A second
    SIGTERM, Ctrl-C, or a server still warming skips the grace."""
    import signal
    import uvicorn

    grace_s = app.state.settings.drain_grace_s

    class GracefulServer(uvicorn.Server):
        _exit_at: float | None = None

        def handle_exit(self, sig, frame) -> None:
            engine = app.state.jaxserve.engine
            if sig == signal.SIGTERM and grace_s > 0 and self._exit_at is None and engine is not None:
                engine.stop_admitting()
                self._exit_at = time.monotonic() + grace_s
                self._captured_signals.append(sig)  # re-raised after shutdown, as uvicorn does
                log.info("SIGTERM: not ready, refusing new work; shutting down in %g s", grace_s)
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if self._exit_at is not None and time.monotonic() >= self._exit_at:
                self.should_exit = True
            return await super().on_tick(counter)

    return GracefulServer(config)


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def serve(settings: ServeSettings, host: str = "127.0.0.1", port: int = 8000, access_log: bool = False) -> None:
    """Run the server. ``access_log`` is off by default: a log line per request took ~5% of
    the event loop's time at load (py-spy), and ``/metrics`` counts requests by status."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for chatty in ("absl", "jax"):  # orbax's per-restore INFO lines (through absl), jax's "no TPU here"
        logging.getLogger(chatty).setLevel(logging.WARNING)
    server: uvicorn.Server | None = None

    def stop() -> None:
        server.should_exit = True

    if not _loopback(host):
        if settings.api_key is None:
            log.warning("listening on %s without an API key: anyone who can reach this port can use its cores "
                        "(set JAXSERVE_API_KEY or --api-key)", host)
        elif settings.ssl_certfile is None:
            log.warning("listening on %s over plain HTTP: the API key crosses the network in clear text "
                        "(--ssl-certfile/--ssl-keyfile, or a TLS proxy in front)", host)
    app = build_app(settings, on_warmup_error=stop)
    config = uvicorn_config(app, host, port, access_log)
    # Bind before warmup starts: a port in use now exits at once (uvicorn's exit 3), where
    # uvicorn.run bound after startup and the exit then waited for the whole grid to compile.
    try:
        sock = config.bind_socket()
    except SystemExit:  # uvicorn has logged the OS error; say which address it was
        log.error("cannot listen on %s:%d; nothing was warmed", host, port)
        raise
    server = graceful_server(config, app)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled: its shutdown is done, no traceback
        sys.exit(130)
    if not server.started:
        sys.exit(3)
    if app.state.jaxserve.warm_error is not None:
        sys.exit(f"jaxserve serve: warmup failed: {app.state.jaxserve.warm_error}")

