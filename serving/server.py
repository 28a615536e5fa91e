"""The HTTP server around the engine: its lifespan, signals and uvicorn protocol.

The engine is assembled by :func:`jaxserve.launch.build_engine`, in the background:
``/healthz`` answers from the first moment; ``/readyz`` says 503 until every executable is
compiled or loaded and the cost model exists, then 200. On SIGTERM uvicorn stops accepting
connections and the lifespan shutdown drains the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import signal
import sys
import threading
import time
import uuid
from typing import Callable

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from jaxserve.compile_cache import compile_count
from jaxserve.launch import ServeSettings, build_engine, reload_assets, settle_heap, start_workers_runtime
from jaxserve.polymorph import WarmupCancelled
from serving.app import ServerState, create_app, error_body

log = logging.getLogger("jaxserve.server")


def _reload_on_sighup(app: FastAPI) -> None:
    """SIGHUP reloads the task assets, as daemons conventionally reread their files on it
    (its default action would end the process). Only where the event loop runs in the main
    thread (``jaxserve serve``); an embedding application keeps its own signal handling."""
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
    start_workers_runtime(settings)  # here, in the caller's thread: not in the warmup thread (see there)

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
            drained = state.drained = await state.engine.drain()
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
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def serve(settings: ServeSettings, host: str = "127.0.0.1", port: int = 8000, access_log: bool = False) -> None:
    """Run the server. ``access_log`` is off by default: a log line per request costs the
    event loop measurable time at load (measurements: bench/RESULTS.md, 'The measurements
    behind the code's rules'), and ``/metrics`` counts requests by status."""
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
    # uvicorn re-raises the SIGTERM it handled once its shutdown is done, to whatever handler was
    # there before it: this one notes it, so a clean drain exits 0 (not 143, which make and
    # supervisors read as a failure) and one that timed out exits 1
    terminated = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: terminated.append(signum))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled: its shutdown is done, no traceback
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not server.started:
        sys.exit(3)
    if app.state.jaxserve.warm_error is not None:
        sys.exit(f"jaxserve serve: warmup failed: {app.state.jaxserve.warm_error}")
    if terminated and app.state.jaxserve.drained is False:
        sys.exit("jaxserve serve: stopped by SIGTERM before everything accepted was answered (drain timed out)")

