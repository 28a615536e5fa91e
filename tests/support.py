"""What several test modules share (besides conftest's fixtures): a real server on 127.0.0.1
and helpers to watch it, and policies used by both the simulator's tests and the live
engine's, so the same objects run in both."""

from __future__ import annotations

import collections
import dataclasses
import os
import socket
import ssl
import threading
import time

import httpx
import uvicorn

from jaxserve.launch import ServeSettings
from jaxserve.sched.base import Batch, Cell, Plan, Policy
from serving.server import build_app, uvicorn_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Where the servers these tests start run their steps: "thread" (the default) or "ray"
# (JAXSERVE_TEST_WORKERS=ray: every server of the run); a *_on_ray module sets "ray" while its
# copy of an HTTP test module runs (rerun_on_ray). Read it through workers_in_use().
TEST_WORKERS = os.environ.get("JAXSERVE_TEST_WORKERS", "thread")


def workers_in_use() -> str:
    """Where a server a test starts now runs its steps: "thread" or "ray"."""
    return TEST_WORKERS


def rerun_on_ray(module) -> dict:
    """What a module that reruns ``module``'s tests with every server's workers as Ray actors puts
    in its namespace (``globals().update(rerun_on_ray(module))``): ``module``'s tests, fixtures
    (module-scoped ones are set up again, for the copy) and marks, and a module-scoped autouse
    fixture that sets :data:`TEST_WORKERS` to "ray" before any other fixture of the module and
    restores it after the module's last test (and fails there if no server of the module ran on
    Ray). Ray is shut down before the module and after it: a Ray an earlier module of the process
    left running has that module's CPUs and object store, and this module's servers would join it
    instead of starting one sized for their workers; so each such module, and the next one, runs
    on a Ray of its own, as in a process of its own. Tests ``module`` names in
    ``SAME_ON_ANY_WORKERS`` (the transport and the gate in front of the engine, which run the same
    code whatever the workers) are left out of the copy."""
    import pytest
    import ray

    @pytest.fixture(scope="module", autouse=True)
    def _workers_on_ray():
        global TEST_WORKERS
        ray.shutdown()  # a Ray an earlier module of this process left running, sized for that module
        before, TEST_WORKERS = TEST_WORKERS, "ray"
        on_ray = LiveServer.started["ray"]
        try:
            yield
        finally:
            TEST_WORKERS = before
            ray.shutdown()
        assert LiveServer.started["ray"] > on_ray, "no server of this module ran on Ray"

    same = set(getattr(module, "SAME_ON_ANY_WORKERS", ()))
    assert same <= set(vars(module)), f"SAME_ON_ANY_WORKERS names no test: {sorted(same - set(vars(module)))}"
    names = {k: v for k, v in vars(module).items() if not k.startswith("__") and k not in same}
    return {**names, "_workers_on_ray": _workers_on_ray}


class LiveServer:
    started = collections.Counter()  # servers ready so far in this process, per kind of worker their engine ran

    def __init__(self, settings: ServeSettings):
        if settings.workers == "thread" and TEST_WORKERS != "thread" and settings.policy != "dt":
            settings = dataclasses.replace(settings, workers=TEST_WORKERS)
        self.port = free_port()
        self.app = build_app(settings)
        self.server = uvicorn.Server(uvicorn_config(self.app, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"{'https' if settings.ssl_certfile else 'http'}://127.0.0.1:{self.port}"
        # the client trusts the server's own (self-signed) certificate, and nothing else
        self.verify = ssl.create_default_context(cafile=settings.ssl_certfile) if settings.ssl_certfile else True

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 300
        with httpx.Client(base_url=self.url, verify=self.verify) as c:
            while time.monotonic() < deadline:
                try:
                    if c.get("/readyz").status_code == 200:
                        LiveServer.started.update({w.kind for w in self.app.state.jaxserve.engine.workers.values()})
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        raise RuntimeError("server did not become ready")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(60)


def _series(url: str, prefix: str) -> float | None:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(prefix + " "):
            return float(line.split()[-1])
    return None


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _until(what, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.05)
    return False



class SmallThenBig(Policy):
    """A two-model cascade for tests (Tabi's is the real one): every request runs on
    ``"small"`` first (a non-final step); those whose top probability reaches ``threshold``
    are finished with the small model's answer, the rest go on to ``"big"`` (final). FIFO,
    ``batch`` requests per step, the big model's work first."""

    def __init__(self, threshold: float, batch: int = 1):
        self.threshold = threshold
        self.batch = batch
        self.queue: list[int] = []
        self.next: list[int] = []
        self.done: list[int] = []
        self.escalated: list[int] = []  # every request sent on to "big", in order
        self.summaries: dict = {}  # the small model's summary of each request

    def on_arrival(self, request, now):
        self.queue.append(request.id)

    def queue_depth(self):
        return len(self.queue)

    def on_completion(self, batch, now, summaries=None):
        if batch.model == "small" and summaries:
            self.summaries.update(summaries)
            for rid, s in summaries.items():
                if s.top_probability >= self.threshold:
                    self.done.append(rid)
                else:
                    self.next.append(rid)
                    self.escalated.append(rid)

    def plan(self, now, idle):
        idle = list(idle)
        batches = []
        if self.next and idle:
            ids, self.next = self.next[:self.batch], self.next[self.batch:]
            batches.append(Batch(tuple(ids), "big", Cell(self.batch), idle.pop(0), final=True))
        if self.queue and idle:
            ids, self.queue = self.queue[:self.batch], self.queue[self.batch:]
            batches.append(Batch(tuple(ids), "small", Cell(self.batch), idle.pop(0), final=False))
        finish, self.done = tuple(self.done), []
        return Plan(tuple(batches), finish=finish)


def layer_profile_entry(num_layers: int, per_layer: dict, edge=(0.5, 0.1)) -> dict:
    """A model's entry in a layer-profile file (jaxserve.layer_profile's format): ``per_layer``
    {cores: [seconds per layer at batch 1]}, split into attention and MLP halves, scaled by the
    batch; embeddings and pooling ``edge`` seconds."""
    by_cores = {}
    for cores, layers in per_layer.items():
        units = [dict(name="embeddings", kind="embeddings", layer=-1,
                      latency={str(b): edge[0] * b for b in (1, 2, 4, 8)})]
        for k, t in enumerate(layers):
            for half, share in (("attn", 0.4), ("mlp", 0.6)):
                units.append(dict(name=f"L{k}.{half}", kind=half, layer=k,
                                  latency={str(b): t * share * b for b in (1, 2, 4, 8)}))
        units.append(dict(name="pool", kind="pool", layer=num_layers,
                          latency={str(b): edge[1] * b for b in (1, 2, 4, 8)}))
        by_cores[str(cores)] = units
    return {"num_layers": num_layers, "seq": 64, "units": by_cores[max(by_cores, key=int)],
            "units_by_cores": by_cores}
