"""A lean open-loop HTTP/1.1 client for the load benchmarks (loopback only).

Why not httpx: on this 2-core machine the load generator shares the cores with the
server, and httpx's AsyncClient costs ~1 ms of Python per request. At 200 req/s that
alone is a fifth of a core, and once the client falls behind, its own scheduling delay
shows up as "latency" (py-spy showed the server's event loop ~75% idle while httpx
clients reported 9 s). This client keeps a pool of keep-alive connections
(``asyncio`` streams), writes one pre-encoded request and reads the status line,
headers and ``Content-Length`` body: a few tens of microseconds per request.

Latency is measured from the request's *scheduled* send time (open loop, no
coordinated omission): if the client itself lags, that lag counts against the result
rather than hiding.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit


class Response:
    __slots__ = ("status", "body")

    def __init__(self, status: int, body: bytes):
        self.status = status
        self.body = body


class Pool:
    """Keep-alive connections to one loopback host; a new one when every one is busy."""

    def __init__(self, url: str, max_connections: int = 512, timeout: float = 60.0):
        parts = urlsplit(url)
        if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"load generators only target loopback, not {parts.hostname!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.timeout = timeout
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._slots = asyncio.Semaphore(max_connections)

    async def post(self, path: str, body: bytes) -> Response:
        head = (f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        async with self._slots:
            while True:
                reused = bool(self._idle)
                conn = self._idle.pop() if reused else await asyncio.open_connection(self.host, self.port)
                try:
                    resp, keep = await asyncio.wait_for(self._exchange(conn, head + body), self.timeout)
                    break
                except (asyncio.IncompleteReadError, ConnectionError) as exc:
                    conn[1].close()
                    # the server closed an idle keep-alive connection (uvicorn: after 5 s) before
                    # answering a byte: the request never reached it, so send it again on a fresh one
                    unanswered = not isinstance(exc, asyncio.IncompleteReadError) or not exc.partial
                    if not (reused and unanswered):
                        raise
                except BaseException:
                    conn[1].close()
                    raise
            if keep:
                self._idle.append(conn)
            else:
                conn[1].close()
            return resp

    @staticmethod
    async def _exchange(conn, data: bytes) -> tuple[Response, bool]:
        reader, writer = conn
        writer.write(data)
        header = await reader.readuntil(b"\r\n\r\n")
        lines = header.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length, keep = 0, True
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                keep = False
        body = await reader.readexactly(length) if length else b""
        return Response(status, body), keep

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def at(start: float, offset: float) -> None:
    """Sleep until ``offset`` seconds after ``start`` (perf_counter)."""
    delay = offset - (time.perf_counter() - start)
    if delay > 0:
        await asyncio.sleep(delay)
