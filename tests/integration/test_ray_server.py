"""The server with Ray workers (`serve --workers ray`): a worker actor killed by its PID
under load. Every request gets exactly one answer, the dead worker is detected through
Ray, its in-flight step is retried on the other worker (or answered with an error), it is
restarted, and the server is back to full capacity: both workers run steps again."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time

import httpx

from jaxserve.launch import ServeSettings
from jaxserve.sched.base import ShapeGrid
from support import LiveServer

GRID = ShapeGrid(batch_sizes=(1, 4), seq_buckets=(16,))


def _busy(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("jaxserve_worker_busy_seconds{"):
            worker = line.split('worker="')[1].split('"')[0]
            out[worker] = float(line.split()[-1])
    return out


def test_a_killed_worker_actor_loses_no_request_and_comes_back(tmp_path):
    settings = ServeSettings(models=("minilm-l6",), cache_dir=str(tmp_path / "cache"), progress=False,
                             text_grid=GRID, instances=2, max_queue=512, workers="ray", tune=False)
    with LiveServer(settings) as srv:
        engine = srv.app.state.jaxserve.engine
        assert sorted(w.kind for w in engine.workers.values()) == ["ray", "ray"]
        victim = engine.workers[0]
        pid = victim.pid()
        assert pid != os.getpid()
        sent = 160
        killed = threading.Event()

        def one(i):
            if i == sent // 3:  # a third of the way in, with steps in flight on both workers
                os.kill(pid, signal.SIGKILL)
                killed.set()
            with httpx.Client(base_url=srv.url, timeout=120) as c:
                r = c.post("/v1/embeddings", json={"input": [f"message {i} about a delayed flight"] * 2})
                return r.status_code, r.json()

        with cf.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one, range(sent)))
        assert killed.is_set() and len(results) == sent
        codes = [c for c, _ in results]
        assert set(codes) <= {200, 500}, set(codes)  # answered, or (a step that failed twice) an error
        assert codes.count(200) >= sent - 8  # at most a couple of batches can fail twice
        for code, body in results:
            if code == 200:
                assert len(body["data"]) == 2 and {d["meta"]["outcome"] for d in body["data"]} <= {"ok", "late"}
            else:
                assert body["error"]["type"] == "server_error"
        assert engine.stats.worker_restarts >= 1 and engine.stats.retries >= 1

        # back to full capacity: the restarted actor (a new process) runs steps again
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (victim.alive and victim.ready.done()):
            time.sleep(0.2)
        assert victim.alive and victim.pid() != pid
        before = _busy(srv.url)
        with cf.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda i: httpx.post(srv.url + "/v1/embeddings", timeout=120,
                                                       json={"input": [f"after {i}"] * 4}).status_code, range(40)))
        assert codes == [200] * 40
        after = _busy(srv.url)
        assert after["0"] > before["0"] and after["1"] > before["1"]
        m = httpx.get(srv.url + "/metrics").text
        assert "jaxserve_compilations_since_ready 0.0" in m
        assert 'jaxserve_worker_compilations{worker="0"} 0.0' in m  # the new actor loaded the node's cache
