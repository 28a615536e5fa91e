"""The thin HTTP layer: validate, decode, tokenize, hand items to the engine, map errors.

No scheduling logic and no model code live here (DESIGN.md). Error mapping:

=========================================  ======
malformed JSON, unknown/missing field,      422
wrong JSON type, empty or too many inputs,
text that is not valid Unicode (a lone
surrogate), bad image, non-finite numbers,
``slo_ms`` <= 0
body that is not ``application/json``       415
a body FastAPI cannot parse (nested         400
deeper than Python's recursion limit)
text longer than the longest bucket         413 (unless ``truncate: true``)
body over ``max_body_bytes``                413
body not complete ``body_timeout_s`` after  408 (connection closed; slow headers:
its headers                                 serving.server.timed_protocol)
no or wrong API key (with ``api_key``)      401 + WWW-Authenticate
/admin/reload whose files do not fit the    409 (nothing changes)
executables (or, under an OTAS policy, its
accuracy profile)
unknown model or task                       404
no such route / method                      404 / 405 (with Allow)
more inputs than ``max_queue`` can hold     413
queue full (admission control)              429 + Retry-After
not warm yet / shutting down                503 + Retry-After
a batch that failed twice on its worker     500
anything unforeseen (a bug)                 500, logged with its traceback
the client left before its answer (its      499 in the metrics and log (nobody
queued items are withdrawn, never run), or  is left to read it)
half-way through its body
=========================================  ======

Every error, whatever raised it, is JSON ``{"error": {"status", "message", "field", "type", "param",
"code"}}`` (the last three as OpenAI's API writes them; see ``_error``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import io
import logging
import time
import uuid
import zlib
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from PIL import Image, UnidentifiedImageError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from jaxserve.cascade import CascadeText, truncated_text
from jaxserve.engine import Answer, Draining, Engine, ExecutionFailed, Item, Overloaded, TooManyItems
from jaxserve.runtime import MAX_IMAGE_SIDE, ImageRuntime, ModelRuntime, TextRuntime
from jaxserve.sched.tabi import TabiPolicy
from serving.metrics import Metrics
from serving.schemas import (
    ClassifyImageRequest,
    ClassifyResponse,
    ClassifyTextRequest,
    EmbeddingsRequest,
    EmbeddingsResponse,
)

log = logging.getLogger("jaxserve.serving")

_KINDS = {TextRuntime: "text", ImageRuntime: "image"}  # a runtime class as the API names its models' kind
CASCADE_MODEL = "tabi"  # what /v1/classify/text calls the cascade of --policy tabi (and its baselines)


class ApiError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.field, self.headers = status, message, field, headers or {}


@dataclass
class ServerState:
    """What the app serves; ``engine`` is None until warmup finished."""

    engine: Engine | None = None
    warm_error: str | None = None
    started: float = field(default_factory=time.monotonic)
    created: float = field(default_factory=time.time)  # wall clock, for OpenAI's model "created"
    info: dict[str, Any] = field(default_factory=dict)
    reload: Any = None  # engine -> report: re-read the task assets (jaxserve.launch.reload_assets); None: not offered
    drained: bool | None = None  # at shutdown: True when everything accepted was answered; None: no drain ran


def _path_label(scope, routes=()) -> str:
    """A request's ``path`` label in the metrics: its route's template
    (``/v1/models/{model}``), never the raw path, so scanners and made-up ids cannot grow the
    series without bound; ``<unmatched>`` when no route matched. Before the router has run
    (the body limit), the route is looked up in ``routes``."""
    route = scope.get("route")
    if route is None:
        route = next((r for r in routes if r.matches(scope)[0] != Match.NONE), None)
    return getattr(route, "path", None) or "<unmatched>"


async def _client_gone(receive) -> None:
    """Return once the client has closed its connection. Called after the body was read,
    so the server's next ASGI message for this request can only be ``http.disconnect``
    (uvicorn blocks until then); anything else is skipped, with a pause so that a server
    that answered at once could not make this spin."""
    while (await receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)


# OpenAI's error ``type`` per status, so its clients fill ``APIError.type``/``.param``/``.code``
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def error_body(status: int, message: str, field: str | None = None) -> dict:
    """The one error body: ours (``status``, ``message``, ``field``) and OpenAI's (``message``,
    ``type``, ``param``, ``code``) in the same object, so OpenAI's clients read the field that
    was wrong as ``err.param``; ``code`` is the status as a string (OpenAI sends short names;
    the status is what we have that a client can switch on)."""
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    printable = _printable(field) if field else None
    body = {"error": {"status": status, "message": _printable(message), "type": kind, "param": printable,
                      "code": str(status)}}
    if printable:
        body["error"]["field"] = printable
    return body


# Retry-After of a 503: a warming server is minutes from ready at most (a default grid warms in
# about a minute from an empty cache, seconds from a warm one); a draining one is going away,
# and whatever answers at its address next (its replacement) may take the retry.
WARMING_RETRY = {"Retry-After": "5", "retry-after-ms": "5000"}
DRAINING_RETRY = {"Retry-After": "1", "retry-after-ms": "1000"}


def _error(status: int, message: str, field: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, field), status_code=status, headers=headers)


def _printable(text: str) -> str:
    """Client text echoed in an error (a field name, say) may hold a lone surrogate, which no
    UTF-8 response can carry: it is written as its escape, so the error itself cannot fail."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# pydantic error types that mean "not this JSON type"; under a union (``str | list[str]``)
# every branch reports one, so they are merged into "expected a string or a list".
_EXPECTED = {"string_type": "a string", "list_type": "a list", "float_type": "a number",
             "float_parsing": "a number", "int_type": "an integer", "int_parsing": "an integer",
             "bool_type": "true or false", "bool_parsing": "true or false", "dict_type": "a JSON object",
             "model_attributes_type": "a JSON object"}


def validation_message(errors: list[dict]) -> tuple[str, str]:
    """(field, message) for pydantic's errors, as a client reads them: ``input[1]``, not
    ``body.input.list[function-after[...]].1``. Union branch tags are dropped; an error about
    the value (a limit, bad Unicode, a missing field) wins over a branch's type mismatch; the
    deepest field wins next, and type mismatches at one field merge into what was expected."""

    def field_of(loc) -> tuple[str, int]:
        out, depth = "", 0
        for part in loc:
            if isinstance(part, int):
                out, depth = f"{out}[{part}]", depth + 1
            elif part != "body" and "[" not in part and part not in ("str", "int", "float", "bool"):
                out, depth = f"{out}.{part}" if out else part, depth + 1
        return out or "body", depth

    if not errors:
        return "body", "invalid request"
    if errors[0].get("type") == "json_invalid":  # loc: ("body", character offset)
        loc, why = errors[0].get("loc", ()), (errors[0].get("ctx") or {}).get("error", "")
        where = f" at character {loc[-1]}" if loc and isinstance(loc[-1], int) else ""
        return "body", f"malformed JSON body ({why}{where})" if why else "malformed JSON body"
    rows = [(field_of(e.get("loc", ())), e) for e in errors]
    about_value = [r for r in rows if r[1].get("type") not in _EXPECTED]
    pool = about_value or rows
    (field, _), _ = max(pool, key=lambda r: r[0][1])
    chosen = [e for (f, _), e in pool if f == field]
    if chosen[0].get("type") == "string_unicode":  # pydantic-core's own check, e.g. on a key: no loc
        return field, "holds a string that is not valid Unicode (a lone UTF-16 surrogate)"
    if chosen[0].get("type") == "extra_forbidden":
        return field, "unknown field"
    if all(e.get("type") in _EXPECTED for e in chosen):
        expected = list(dict.fromkeys(_EXPECTED[e["type"]] for e in chosen))
        return field, "expected " + " or ".join(expected)
    return field, "; ".join(dict.fromkeys(e.get("msg", "invalid").removeprefix("Value error, ") for e in chosen))


class Guard:
    """Pure-ASGI wrapper around the app.

    - A body over ``limit`` bytes is answered 413 before it is parsed, whether its
      Content-Length says so or a chunked body grows past the limit as it arrives.
    - A body that has not fully arrived ``body_timeout_s`` after the request began is answered
      408 and its connection closed: a client that declares a body and trickles it (or sends
      none) would otherwise hold its connection and coroutine for ever. The deadline covers
      the whole body, not the gap between reads, so a byte every few seconds cannot extend it.
      (Slow request headers are cut off earlier, by ``serving.server.timed_protocol``.)
    - An exception nobody anticipated (a bug) is logged and answered with the API's JSON 500
      here, instead of Starlette's default, which answers a text page and then re-raises, so
      uvicorn closes the connection and a keep-alive client's next request fails too.
    - With an ``api_key``, every path but ``OPEN_PATHS`` needs ``Authorization: Bearer <key>``
      (what OpenAI's clients send), checked in constant time before the body is read; else 401.
      Deny by default, so a route added later is covered without anyone remembering to.
    - Every answer carries ``x-request-id``: the client's own (up to 128 visible ASCII
      characters) or a fresh one, also in the log line of an internal error, so a client's
      report can be found in the server log.
    """

    #: answered without an API key: probes, the scraper, the API docs (everything else needs it)
    OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc",
                            "/openapi.json"})

    def __init__(self, app, limit: int, metrics: Metrics, routes=(), body_timeout_s: float = 60.0,
                 api_key: str | None = None):
        self.app, self.limit, self.metrics, self.routes = app, limit, metrics, routes
        self.body_timeout_s = body_timeout_s
        if api_key is not None and not api_key.strip():
            raise ValueError("api_key is empty: an empty bearer token would let anyone in")
        self.api_key = None if api_key is None else api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"")
        if not (0 < len(rid) <= 128 and all(33 <= c <= 126 for c in rid)):
            rid = uuid.uuid4().hex.encode()
        send = _with_header(send, (b"x-request-id", rid))
        declared = headers.get(b"content-length")
        has_body = (declared is not None and declared not in (b"", b"0")) or b"chunked" in headers.get(
            b"transfer-encoding", b"").lower()
        # An answer sent before the body it follows was read says 'connection: close': the
        # server drops the rest of that body and closes (lingering, serving.server), so a
        # client must not send its next request on this connection.
        unread = _with_header(send, (b"connection", b"close")) if has_body else send
        if self.api_key is not None and scope["path"] not in self.OPEN_PATHS and not self._authorized(headers):
            return await self._refuse(scope, unread, _error(
                401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'", "authorization",
                {"www-authenticate": "Bearer"}))
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, unread, self._too_large().response())
        seen, started, body_done = 0, False, False
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s

        async def counted():
            nonlocal seen, body_done
            if body_done:  # later receives wait for the disconnect, for as long as the answer takes
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):  # a timer, not a task per receive (as wait_for)
                    message = await receive()
            except TimeoutError:
                self.metrics.read_timeout("body")
                raise _BodyRefused(408, f"request body not received within {self.body_timeout_s:g} s "
                                        f"({seen} of {declared.decode() if declared else 'an unknown number of'} "
                                        "bytes arrived)", {"connection": "close"}) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise self._too_large()
                body_done = not message.get("more_body", False)
            elif not body_done:  # gone half-way through its body: 499 (nobody reads it), not the 400
                # "error parsing the body" FastAPI makes of Starlette's ClientDisconnect
                raise _BodyRefused(499, f"client closed the connection after {seen} bytes of its body")
            return message

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await (send if body_done else unread)(message)

        try:
            await self.app(scope, counted, tracked)
        except _BodyRefused as exc:  # raised outside a route's body parsing (the route handler maps it otherwise)
            if started:
                raise
            await self._refuse(scope, send, exc.response())
        except Exception as exc:
            if started:  # half an answer is out: nothing sound is left to send
                raise
            log.exception("unhandled error on %s (x-request-id %s)", scope.get("path"), rid.decode())
            self.metrics.request_done(_path_label(scope), 500)
            await self._answer(send, _error(500, f"internal error ({type(exc).__name__}); the server log has "
                                                 "the traceback"))

    def _authorized(self, headers: dict) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    def _too_large(self) -> "_BodyRefused":
        return _BodyRefused(413, f"request body exceeds the limit of {self.limit} bytes")

    async def _refuse(self, scope, send, resp: JSONResponse) -> None:
        """Answer in place of the app, counted under the request's route."""
        self.metrics.request_done(_path_label(scope, self.routes), resp.status_code)
        await self._answer(send, resp)

    @staticmethod
    async def _answer(send, resp: JSONResponse):
        await send({"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers})
        await send({"type": "http.response.body", "body": resp.body})


def _with_header(send, header: tuple[bytes, bytes]):
    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), header]}
        await send(message)

    return wrapped


class _BodyRefused(StarletteHTTPException):
    """The request body broke a limit while it was being read (413 too large, 408 too slow).

    A Starlette HTTPException, because FastAPI turns any other exception raised while it reads
    a body into a 400 "error parsing the body", and a chunked body over the limit must get
    413."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(status, message, headers)

    def response(self) -> JSONResponse:
        return _error(self.status_code, self.detail, "body", self.headers)


class FastJSON(JSONResponse):
    """orjson rendering; numpy vectors serialise natively (no per-float Python objects)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def _meta(a: Answer) -> dict:
    """The ``Meta`` schema, as a plain dict: handlers return already-valid data and skip
    FastAPI's response re-validation, which cost more than the rest of the HTTP path."""
    gamma = a.outputs.get("gamma")
    otype = a.outputs.get("outcome_type")
    return {"shape": a.cell, "batch_size": a.batch_size, "queue_ms": round(a.queue_ms, 3),
            "compute_ms": round(a.compute_ms, 3), "latency_ms": round(a.latency_ms, 3), "outcome": a.outcome,
            "gamma": None if gamma is None else int(gamma), "outcome_type": None if otype is None else int(otype)}


def decode_image(raw: Any, shape: tuple[int, int, int], index: int, resize: bool = False) -> np.ndarray:
    """A base64 PNG (8-bit) or nested arrays of floats in [0, 1], as float32 [H, W, C] in [0, 1].

    ``resize`` (the runtime's ``ImageRuntime.resizes``): an image of another size, up to
    ``MAX_IMAGE_SIDE`` a side, gray (PNG mode L, or [h, w] / [h, w, 1]) or of the model's
    channels, is resized to ``shape`` by the tasks' own preprocessing
    (:func:`jaxserve.datasets.resize_image`); else only ``shape`` is accepted. Anything else is a
    422 naming the field and what is accepted."""
    from jaxserve.datasets import resize_image

    h, w, c = shape
    where = f"inputs[{index}]"
    accepted = (f"images of up to {MAX_IMAGE_SIDE}x{MAX_IMAGE_SIDE} pixels, resized to {w}x{h}" if resize
                else f"{w}x{h}")

    def size_ok(ih: int, iw: int) -> bool:
        return (ih, iw) == (h, w) or (resize and 1 <= ih <= MAX_IMAGE_SIDE and 1 <= iw <= MAX_IMAGE_SIDE)

    if isinstance(raw, str):
        try:
            data = base64.b64decode(raw, validate=True)
            with warnings.catch_warnings():  # its size is checked below, before any decoding:
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # no bomb goes off
                img = Image.open(io.BytesIO(data), formats=["PNG"])  # reads the header only
        except UnidentifiedImageError:  # PIL's message would name an in-memory buffer object
            raise ApiError(422, f"{where}: not a PNG image (send base64 PNG bytes or nested arrays)", where) from None
        except (binascii.Error, ValueError, OSError, Image.DecompressionBombError) as exc:
            raise ApiError(422, f"{where}: not a decodable base64 PNG image ({exc})", where) from None
        # Size and mode are checked from the header, before any pixel is decoded: a tiny PNG
        # can declare 12000x12000 (144 MB, 0.15 s of the event loop per image to decode).
        if not size_ok(img.size[1], img.size[0]):
            raise ApiError(422, f"{where}: image is {img.size[0]}x{img.size[1]}; the model takes {accepted}", where)
        mode = {1: "L", 3: "RGB"}.get(c)
        modes = (mode, "L") if resize else (mode,)
        if img.mode not in modes:
            raise ApiError(422, f"{where}: image mode {img.mode} has the wrong channels; the model takes "
                                f"{c} channel(s) (PNG mode {' or '.join(dict.fromkeys(modes))})", where)
        try:
            img.load()
        except Exception as exc:  # whatever the decoder makes of damaged data (OSError, SyntaxError, ...)
            raise ApiError(422, f"{where}: not a decodable base64 PNG image ({type(exc).__name__}: {exc})",
                           where) from None
        arr = np.asarray(img, dtype=np.float32) / 255.0
        if arr.shape[:2] != (h, w) or (arr.ndim == 2) != (c == 1):
            return resize_image(arr, (h, w), c)
        return arr.reshape(h, w, c)
    try:  # no dtype yet: strings, booleans or integers beyond float range must not become pixels
        arr = np.asarray(raw)
        if arr.dtype.kind not in "iuf":
            raise TypeError(arr.dtype)
        arr = arr.astype(np.float32)
    except (ValueError, TypeError, OverflowError):
        raise ApiError(422, f"{where}: nested arrays must be a regular grid of numbers", where) from None
    if arr.ndim == 2 and (c == 1 or resize):
        arr = arr[..., None]
    channels_ok = arr.ndim == 3 and (arr.shape[2] == c or (resize and arr.shape[2] == 1))
    if not (channels_ok and size_ok(*arr.shape[:2])):
        wanted = (f"[h, w], [h, w, 1] or [h, w, {c}] with h, w <= {MAX_IMAGE_SIDE}, resized to [{h}, {w}, {c}]"
                  if resize else f"[{h}, {w}, {c}]")
        raise ApiError(422, f"{where}: array shape {list(arr.shape)}; the model takes {wanted}", where)
    if not np.isfinite(arr).all():
        raise ApiError(422, f"{where}: contains non-finite numbers (NaN or Inf)", where)
    if arr.min() < 0.0 or arr.max() > 1.0:
        raise ApiError(422, f"{where}: pixel values must lie in [0, 1]", where)
    return arr if arr.shape == (h, w, c) else resize_image(arr, (h, w), c)


def create_app(state: ServerState, max_body_bytes: int = 8 * 1024 * 1024, body_timeout_s: float = 60.0,
               api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="jaxserve", version="0.1.0",
                  description="Transformer encoders served from ahead-of-time compiled polymorphs.")
    metrics = Metrics(state)
    app.state.jaxserve = state
    app.state.metrics = metrics
    app.add_middleware(Guard, limit=max_body_bytes, metrics=metrics, routes=app.routes,  # the live list
                       body_timeout_s=body_timeout_s, api_key=api_key)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        metrics.request_done(_path_label(request.scope), exc.status)
        return _error(exc.status, exc.message, exc.field, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if not (media == "application/json" or media.endswith("+json")):
            # FastAPI hands a non-JSON body (or one with no content-type, as requests' data= sends)
            # to the model as bytes; say what is wrong instead of "expected a JSON object".
            metrics.request_done(_path_label(request.scope), 415)
            what = f"content-type {media!r} is not supported" if media else "no content-type was sent"
            return _error(415, f"{what}; send application/json", "content-type")
        loc, msg = validation_message(exc.errors())
        metrics.request_done(_path_label(request.scope), 422)
        return _error(422, f"{loc}: {msg}", loc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """Routing errors (404, 405 with Allow) and FastAPI's 400 for a body it cannot parse
        (e.g. JSON nested deeper than Python's recursion limit), in the API's error format."""
        metrics.request_done(_path_label(request.scope), exc.status_code)
        if isinstance(exc, _BodyRefused):
            return exc.response()
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, f"{exc.detail}")
        return _error(exc.status_code, message, "body" if exc.status_code == 400 else None, exc.headers)

    def engine() -> Engine:
        if state.engine is None:
            if state.warm_error is not None:  # the server exits: no point in coming back
                raise ApiError(503, f"warmup failed: {state.warm_error}")
            raise ApiError(503, "models are still warming up", headers=WARMING_RETRY)
        return state.engine

    def runtime(model: str, kind: type[ModelRuntime]):
        eng = engine()
        rt = eng.runtimes.get(model)
        if not isinstance(rt, kind):
            names = sorted(n for n, r in eng.runtimes.items() if isinstance(r, kind))
            raise ApiError(404, f"unknown {_KINDS[kind]} model {model!r}; served: {names}", "model")
        return rt

    def head(rt, task: str):
        if task not in rt.heads:
            raise ApiError(404, f"unknown task {task!r} for model {rt.name}; tasks: {sorted(rt.heads)}", "task")

    async def tokenize(rt, texts: list[str], truncate: bool, field_name: str) -> list[list[int]]:
        """Token ids, each within the longest bucket (413 otherwise, unless ``truncate``). A
        large request is encoded on a worker thread: on the event loop, a large body of text
        would stall every other request (measurements: bench/RESULTS.md, 'The measurements
        behind the code's rules')."""
        limit = rt.grid.max_length
        if rt.tokenizer.cheap(texts):
            ids = rt.tokenizer.encode(texts)
        else:
            ids = await asyncio.to_thread(rt.tokenizer.encode, texts)
        out = []
        for i, seq in enumerate(ids):
            if len(seq) > limit:
                if not truncate:
                    raise ApiError(413, f"{field_name}[{i}] has {len(seq)} tokens; the longest bucket of "
                                        f"{rt.name} is {limit} tokens (send truncate=true to cut it)",
                                   f"{field_name}[{i}]")
                seq = rt.tokenizer.truncate(seq, limit)
            out.append(seq)
        return out

    async def run_items(items: list[Item], http: Request, field_name: str) -> list[Answer]:
        """Submit ``items`` and wait for their answers, or for the client to go away: then
        the items still queued are withdrawn (they never run) and the request ends as 499
        (nginx's "client closed request"; nobody reads it, the metrics and log do)."""
        eng = engine()
        try:
            futures = eng.submit(items)
        except TooManyItems as exc:
            raise ApiError(413, str(exc), field_name)
        except Overloaded as exc:
            # milliseconds for clients that read them (OpenAI's), whole seconds (at least 1) for HTTP
            ms = max(1, round(exc.retry_after_s * 1e3))
            raise ApiError(429, str(exc), headers={"Retry-After": str(max(1, -(-ms // 1000))),
                                                   "retry-after-ms": str(ms)})
        except Draining as exc:
            raise ApiError(503, str(exc), headers=DRAINING_RETRY)
        answers = asyncio.gather(*futures, return_exceptions=True)
        gone = asyncio.ensure_future(_client_gone(http.receive))
        try:
            await asyncio.wait((answers, gone), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the handler itself is cancelled (uvicorn's shutdown timed out):
            eng.withdraw(futures)  # what is still queued is for nobody now
            raise
        finally:
            gone.cancel()
        if not answers.done():
            withdrawn = eng.withdraw(futures)
            log.debug("client closed %s before its answer; %d of %d items withdrawn unrun", http.url.path,
                     withdrawn, len(futures))
            raise ApiError(499, f"client closed the request; {withdrawn} of {len(futures)} items withdrawn")
        results = answers.result()
        for item, r in zip(items, results):
            if isinstance(r, Answer):
                metrics.observe_answer(item.model, r.outcome, r.latency_ms / 1e3,
                                       item.slo_ms is not None or eng.default_slo_ms is not None)
        for r in results:
            if isinstance(r, ExecutionFailed):
                raise ApiError(500, f"execution failed: {r}")
            if isinstance(r, BaseException):
                raise r
        return results

    @app.post("/v1/embeddings", response_model=EmbeddingsResponse)
    async def embeddings(req: EmbeddingsRequest, http: Request):
        rt = runtime(req.model, TextRuntime)
        if req.dimensions is not None and req.dimensions != rt.embedding_dim:
            raise ApiError(422, f"dimensions={req.dimensions}: {rt.name} embeds into exactly {rt.embedding_dim} "
                                "dimensions", "dimensions")
        texts = [req.input] if isinstance(req.input, str) else req.input
        ids = await tokenize(rt, texts, req.truncate, "input")
        answers = await run_items(
            [Item(req.model, seq, len(seq), "", req.slo_ms) for seq in ids], http, "input")

        def vector(a: Answer):
            if a.outcome == "evicted":
                return None
            v = np.asarray(a.outputs["embedding"], "<f4")
            return base64.b64encode(v.tobytes()).decode() if req.encoding_format == "base64" else v

        data = [{"object": "embedding", "index": i, "meta": _meta(a), "embedding": vector(a)}
                for i, a in enumerate(answers)]
        metrics.request_done("/v1/embeddings", 200)
        tokens = sum(map(len, ids))
        return FastJSON({"object": "list", "data": data, "model": req.model,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def classify_response(model: str, task: str, answers: list[Answer], path: str) -> FastJSON:
        results = []
        for i, a in enumerate(answers):
            probs = a.outputs.get("probabilities")  # labels: those of the head its batch ran with
            result = {
                "index": i, "label": a.outputs.get("label"), "meta": _meta(a),
                "probabilities": None if probs is None else {l: float(p) for l, p in zip(a.outputs["labels"], probs)}}
            if "levels" in a.outputs:  # a cascade's answer
                result.update(levels=a.outputs["levels"], confidence=a.outputs["confidence"],
                              pruned_tokens=a.outputs["pruned_tokens"])
            results.append(result)
        metrics.request_done(path, 200)
        return FastJSON({"model": model, "task": task, "results": results})

    @app.post("/v1/classify/text", response_model=ClassifyResponse)
    async def classify_text(req: ClassifyTextRequest, http: Request):
        policy = engine().policy
        if isinstance(policy, TabiPolicy):
            return await classify_cascade(policy, req, http)
        model = req.model or "minilm-l6"
        rt = runtime(model, TextRuntime)
        head(rt, req.task)
        ids = await tokenize(rt, req.inputs, req.truncate, "inputs")
        answers = await run_items(
            [Item(model, seq, len(seq), req.task, req.slo_ms, req.utility) for seq in ids], http, "inputs")
        return classify_response(model, req.task, answers, "/v1/classify/text")

    async def classify_cascade(policy: TabiPolicy, req: ClassifyTextRequest, http: Request) -> FastJSON:
        """A cascade request (--policy tabi and its baselines): each text starts on its task's
        first level as a CascadeText (its ids within that model's longest bucket: 413 otherwise,
        unless ``truncate``), seeded by ``seed`` or the text's CRC32."""
        if req.model not in (None, CASCADE_MODEL):
            raise ApiError(404, f"this server serves text classification through its cascade: model must be "
                                f"{CASCADE_MODEL!r} (or left out), not {req.model!r}", "model")
        if req.task not in policy.candidates:
            reason = getattr(policy, "unavailable", {}).get(req.task)
            raise ApiError(404, f"task {req.task!r} is not served: {reason}" if reason else
                           f"unknown task {req.task!r}; the cascade serves {sorted(policy.candidates)}", "task")
        cand = policy.candidates[req.task]
        rt = runtime(cand.levels[0], TextRuntime)
        texts = list(req.inputs)
        ids = await tokenize(rt, texts, req.truncate, "inputs")
        limits = tuple(engine().runtimes[m].grid.max_length for m in cand.levels[1:])
        items = []
        for text, seq in zip(texts, ids):
            if req.truncate and len(rt.tokenizer.encode([text])[0]) > len(seq):
                text, seq = truncated_text(rt.tokenizer, text, len(seq))
            payload = CascadeText(text, tuple(seq), cand.alpha, cand.levels[1:], limits)
            seed = req.seed if req.seed is not None else zlib.crc32(text.encode("utf-8", "surrogatepass"))
            items.append(Item(cand.levels[0], payload, len(seq), req.task, req.slo_ms, req.utility, seed))
        answers = await run_items(items, http, "inputs")
        return classify_response(CASCADE_MODEL, req.task, answers, "/v1/classify/text")

    @app.post("/v1/classify/image", response_model=ClassifyResponse)
    async def classify_image(req: ClassifyImageRequest, http: Request):
        rt = runtime(req.model, ImageRuntime)
        head(rt, req.task)
        images = [decode_image(raw, rt.image_shape, i, rt.resizes) for i, raw in enumerate(req.inputs)]
        answers = await run_items(
            [Item(req.model, img, 0, req.task, req.slo_ms, req.utility) for img in images], http, "inputs")
        return classify_response(req.model, req.task, answers, "/v1/classify/image")

    def model_card(name: str, rt) -> dict:
        """One served model, as OpenAI's model object (``id``, ``object``, ``created``,
        ``owned_by``: what OpenAI-compatible clients read) plus what jaxserve knows of it."""
        g = rt.grid
        text = isinstance(rt, TextRuntime)
        return {
            "id": name, "object": "model", "created": int(state.created), "owned_by": "jaxserve",
            "kind": "text" if text else "image",
            "warm": rt.table.warm, "precision": rt.table.servable.precision,
            "tasks": {t: list(h.labels) for t, h in rt.heads.items()},
            "grid": {"batch_sizes": list(g.batch_sizes), "seq_buckets": list(g.seq_buckets),
                     "gammas": list(g.gammas)},
            "max_tokens": g.max_length if text else None,
            "embedding_dim": rt.embedding_dim if text else None,
            "image_shape": None if text else list(rt.image_shape),
            # images of other sizes (up to this many pixels a side) are resized to image_shape; None: not
            "image_resize_max_side": MAX_IMAGE_SIDE if not text and rt.resizes else None,
        }

    @app.get("/v1/models")
    async def models():
        """OpenAI's model list (``{"object": "list", "data": [...]}``: ``client.models.list()``
        works), with the server's readiness, policy and settings beside it."""
        eng = state.engine
        if eng is None:
            return {"object": "list", "data": [], "ready": False, "warm_error": state.warm_error}
        return {"object": "list", "data": [model_card(n, rt) for n, rt in eng.runtimes.items()], "ready": True,
                "policy": type(eng.policy).__name__, **state.info}

    @app.get("/v1/models/{model}")
    async def one_model(model: str):
        eng = engine()
        if model not in eng.runtimes:
            raise ApiError(404, f"unknown model {model!r}; served: {sorted(eng.runtimes)}", "model")
        return model_card(model, eng.runtimes[model])

    reloading = asyncio.Lock()

    async def reload_now() -> dict:
        """Re-read the task heads and prompt repositories from disk and serve them from the
        next batch on, with no compile and no restart (they are arguments of the executables,
        or applied after them). All or nothing: ApiError 409 with the reason if the new files
        do not fit, and the server goes on with what it had. One reload at a time. Called by
        ``POST /admin/reload`` and on SIGHUP (``serving.server``)."""
        eng = engine()
        if state.reload is None:
            raise ApiError(404, "this server does not reload its assets")
        async with reloading:
            try:
                report = await asyncio.to_thread(state.reload, eng)
            except Exception as exc:  # whatever the files made the reading raise: nothing was swapped
                metrics.asset_reloads.labels("refused").inc()
                log.warning("reload refused: %s", exc, exc_info=not isinstance(exc, ValueError))
                raise ApiError(409, f"reload refused, still serving the previous assets: {exc}") from None
            then = report.pop("then", None)
            if then is not None:  # the policy's part of the switch, here on the engine's thread
                then()
        metrics.asset_reloads.labels("ok").inc()
        return report

    app.state.reload_now = reload_now

    @app.post("/admin/reload")
    async def reload_assets():
        return await reload_now()

    @app.get("/healthz")
    async def healthz():
        return {"status": "alive", "uptime_s": round(time.monotonic() - state.started, 3)}

    @app.get("/readyz")
    async def readyz():
        if state.engine is None:
            return _error(503, "warming up" if state.warm_error is None else f"warmup failed: {state.warm_error}")
        if state.engine.draining:  # a load balancer should stop sending: new work would be refused
            return _error(503, "shutting down: finishing accepted work")
        return {"status": "ready"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    return app
