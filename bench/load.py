"""Open-loop load against a server on loopback: throughput, latency percentiles, SLO, knee.

Open loop: requests leave on the trace's schedule whether or not earlier ones were
answered (closed-loop generators hide queueing). Bounded in count and time, and
only ever aimed at 127.0.0.1.

Sweeps offered load and reports, per rate: achieved throughput, p50/p98/p99 of the
client-side latency, SLO attainment and error counts. The knee is the highest offered
rate whose p98 stays within the SLO with >= 99% of requests answered ok.

It also measures the HTTP overhead (client p50 at batch 1 minus the engine's own
queue + compute time reported in the answer), and compares jaxserve against a plain
FastAPI endpoint that calls the jitted function once per request (no batching),
started by this script on another port (``bench/naive_server.py``) and warmed on every
length the sweep sends, so the comparison measures batching, not first-sight compiles.

    python -m bench.load [--rates 10,20,40,...] [--duration 20] [--slo-ms 200] [--write]

On a GPU host (``pip install -e '.[cuda]'``) the same script measures where compute is not
the bound: e.g. ``--instances 1 --arrivals poisson --rates 100,200,...,1500 --max-queue 2048
--key load_gpu --out FILE --log-dir DIR`` (``--out`` writes the RESULTS.md section to a file
to splice in elsewhere; ``--log-dir`` keeps both servers' output).
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations;
# read by bench.all, bench.status and bench.headline without importing this module).
MEASURES = (
    "bench/load.py", "bench/httpload.py", "bench/naive_server.py", "serving", "jaxserve/engine.py",
    "jaxserve/launch.py", "jaxserve/workers.py", "jaxserve/cli.py", "jaxserve/sched/base.py",
    "jaxserve/sched/batching.py", "jaxserve/models", "jaxserve/kernels", "jaxserve/polymorph.py",
    "jaxserve/servables.py", "jaxserve/compile_cache.py", "jaxserve/runtime.py",
)
SECTIONS = {
    "load": "--rates 10,40,80,90,100,110,120,130,140,160,180,200,240,280 --write",
    "load_bf16": "--precision bf16 --instances 2 --arrivals poisson --rates 40,80,100,115,130,160,200,250,350,450,500,550,600,650 --key load_bf16 --write",
}
GPU_SECTIONS = {"load_gpu": "--instances 1 --arrivals poisson --rates 100,200,300,400,600,1000,1500 --duration 4 --max-queue 2048 --key load_gpu --out FILE"}  # measured on a GPU host; never run by bench.all

import argparse
import asyncio
import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from bench.common import add_quick, apply_quick, record, section, table

TEXT_PATH = "/v1/embeddings"


@dataclass
class LoadResult:
    offered: float
    sent: int
    ok: int
    late: int
    evicted: int
    rejected: int
    errors: int
    duration: float
    latencies: np.ndarray  # seconds, answered 200 only
    server_ms: np.ndarray  # arrival-to-answer latency reported by jaxserve (nan for the naive peer)
    computed: list  # (shape label, compute ms, ms its instance was held) per answered request (jaxserve only)
    send_lag: np.ndarray  # seconds each request left the client after its scheduled time (trace order)
    error_kinds: Counter  # what each error was (exception or HTTP status), counted
    answered: np.ndarray | None = None  # schedule index of each entry of latencies / server_ms (same order)

    @property
    def throughput(self) -> float:
        return self.ok / self.duration if self.duration else 0.0

    def pct(self, p: float) -> float:
        return float(np.percentile(self.latencies, p) * 1e3) if len(self.latencies) else float("nan")

    def attainment(self, slo_ms: float) -> float:
        good = int((self.latencies * 1e3 <= slo_ms).sum()) if len(self.latencies) else 0
        return good / self.sent if self.sent else 0.0


def arrivals(kind: str, rate: float, duration: float, seed: int) -> np.ndarray:
    from jaxserve import traces

    if kind == "poisson":
        return traces.poisson_arrivals(rate, duration=duration, seed=seed)
    return traces.mmpp_arrivals((rate * 0.5, rate * 2.5), (2.0, 0.5), duration=duration, seed=seed)


async def open_loop(url: str, schedule: np.ndarray, texts: list[str], slo_ms: float | None,
                    timeout_s: float = 60.0) -> LoadResult:
    """Send ``texts`` on ``schedule`` (seconds from start) whatever the answers (open loop).

    Lean keep-alive client (:mod:`bench.httpload`); latency from each request's scheduled
    time, so a lagging client counts against the result instead of hiding it.
    """
    import orjson

    from bench.httpload import Pool, at

    pool = Pool(url, timeout=timeout_s)
    lat, server_ms, computed, answered = [], [], [], []
    send_lag = np.zeros(len(schedule))
    error_kinds = Counter()
    counts = {"ok": 0, "late": 0, "evicted": 0, "rejected": 0, "errors": 0}
    start = time.perf_counter()

    async def one(i: int, when: float):
        await at(start, when)
        send_lag[i] = time.perf_counter() - start - when
        body = {"input": texts[i % len(texts)]}
        if slo_ms:
            body["slo_ms"] = slo_ms
        try:
            r = await pool.post(TEXT_PATH, orjson.dumps(body))
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            counts["errors"] += 1
            error_kinds[f"{type(exc).__name__}: {exc}"[:120]] += 1
            return
        dt = time.perf_counter() - start - when
        if r.status == 429:
            counts["rejected"] += 1
        elif r.status != 200:
            counts["errors"] += 1
            error_kinds[f"HTTP {r.status}: {r.body[:100]!r}"] += 1
        else:
            meta = orjson.loads(r.body)["data"][0].get("meta")
            outcome = meta["outcome"] if meta else "ok"
            counts[outcome] += 1
            if outcome != "evicted":
                answered.append(i)
                lat.append(dt)
                server_ms.append(meta["latency_ms"] if meta else np.nan)
                if meta:
                    computed.append((meta["shape"], meta["compute_ms"], meta["latency_ms"] - meta["queue_ms"]))

    try:
        await asyncio.gather(*(one(i, float(t)) for i, t in enumerate(schedule)))
    finally:
        await pool.close()
    duration = time.perf_counter() - start
    return LoadResult(len(schedule) / max(schedule[-1], 1e-9), len(schedule), counts["ok"], counts["late"],
                      counts["evicted"], counts["rejected"], counts["errors"], duration,
                      np.array(lat), np.array(server_ms), computed, send_lag, error_kinds, np.array(answered, int))


def sample_texts(n: int = 2000, seed: int = 0) -> list[str]:
    from jaxserve.datasets import load_tweets

    texts, _ = load_tweets()
    idx = np.random.default_rng(seed).choice(len(texts), size=n, replace=False)
    return [texts[i] for i in idx]


def wait_ready(url: str, timeout_s: float = 900, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:  # died before it was ready: no point waiting
            raise RuntimeError(f"{url}: the server exited with status {proc.returncode} before it was ready")
        try:
            r = httpx.get(url + "/readyz", timeout=2)
            if r.status_code == 200:
                return
            if "warmup failed" in r.text:  # the server stays up to say why; no point waiting
                raise RuntimeError(f"{url}: {r.text}")
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


def start(cmd: list[str], url: str, log: str | None = None, wait: bool = True) -> subprocess.Popen:
    """Start a server in its own process group; its output goes to ``log`` (a file) if given."""
    out = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
                            start_new_session=True)
    if log:
        out.close()  # the child holds its own copy
    if wait:
        try:
            wait_ready(url, proc=proc)
        except BaseException:  # not ready (or interrupted): nobody else holds a handle to stop it
            stop(proc)
            raise
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def warm_naive(url: str, texts: list[str]) -> None:
    """Send one text of every distinct token length once, so the naive peer has compiled
    every shape the sweep will send: the comparison is then batching, not compiling."""
    from jaxserve.models.tokenizer import TextTokenizer
    from jaxserve.registry import minilm_dir

    tok = TextTokenizer(minilm_dir() / "tokenizer.json")
    by_len = {}
    for text, ids in zip(texts, tok.encode(texts)):
        by_len.setdefault(min(len(ids), 256), text)
    from concurrent.futures import ThreadPoolExecutor

    def send(text):  # FastAPI runs sync endpoints in threads: distinct lengths compile side by side
        with httpx.Client(base_url=url, timeout=600) as c:
            c.post(TEXT_PATH, json={"input": text}).raise_for_status()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, min(8, (os.cpu_count() or 2) // 2))) as pool:
        list(pool.map(send, by_len.values()))
    print(f"naive peer warmed on {len(by_len)} distinct lengths in {time.perf_counter() - t0:.0f} s", flush=True)


def http_overhead(port: int, texts: list[str], n: int = 300, client: str = "http.client") -> tuple[float, str]:
    """p50 of (client latency - the engine's queue + compute) at batch 1, one request at a time.

    The default client is the standard library's keep-alive ``http.client``: the
    overhead measured is then the server's HTTP path (parse, validate, tokenize, hand
    to the engine and back, serialize) plus loopback, not the client library's own
    cost; httpx adds ~0.7 ms of client-side Python here, reported beside it.
    """
    import http.client

    lat, inner = [], []
    if client == "httpx":
        c = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)

        def post(body):
            return c.post(TEXT_PATH, content=body, headers={"content-type": "application/json"}).content
    else:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

        def post(body):
            c.request("POST", TEXT_PATH, body, {"content-type": "application/json"})
            return c.getresponse().read()
    try:
        for i in range(n):
            body = json.dumps({"input": texts[i % len(texts)]})  # --quick samples fewer texts than n
            t0 = time.perf_counter()
            data = post(body)
            lat.append((time.perf_counter() - t0) * 1e3)
            m = json.loads(data)["data"][0]["meta"]
            inner.append(m["queue_ms"] + m["compute_ms"])
    finally:
        c.close()
    over = float(np.median(np.array(lat) - np.array(inner)))
    return over, f"{client}: client p50 {np.median(lat):.2f} ms, engine queue+compute p50 {np.median(inner):.2f} ms"


def sweep(url: str, rates: list[float], duration: float, slo_ms: float, kind: str, texts, seed: int):
    results = []
    for rate in rates:
        schedule = arrivals(kind, rate, duration, seed)
        r = asyncio.run(open_loop(url, schedule, texts, slo_ms))
        results.append(r)
        print(f"  {kind} {rate:7.1f}/s  thr {r.throughput:7.1f}/s  p50 {r.pct(50):7.1f}  p98 {r.pct(98):7.1f}  "
              f"att {r.attainment(slo_ms):.3f}  429 {r.rejected}  evicted {r.evicted}  err {r.errors}  "
              f"send lag p98 {np.percentile(r.send_lag, 98) * 1e3:.1f} ms"
              + (f" {dict(r.error_kinds)}" if r.errors else ""), flush=True)
        if r.attainment(slo_ms) < 0.5:
            break  # far past the knee: stop loading the machine
    return results


def knee(results: list[LoadResult], slo_ms: float) -> LoadResult | None:
    good = [r for r in results if r.pct(98) <= slo_ms and r.attainment(slo_ms) >= 0.99]
    return max(good, key=lambda r: r.throughput) if good else None


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rates", default="5,10,20,40,60,80,100,130,160,200,250")
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--slo-ms", type=float, default=200.0)
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default="compiled_cache")
    ap.add_argument("--instances", default="1,2", help="executor worker counts to sweep (the first also "
                    "runs MMPP and the HTTP-overhead probe)")
    ap.add_argument("--max-queue", type=int, default=256, help="jaxserve's admission bound (serve --max-queue)")
    ap.add_argument("--arrivals", default="poisson,mmpp", help="arrival processes for the first worker count "
                    "(the others and the naive peer run Poisson)")
    ap.add_argument("--log-dir", default="", help="keep the servers' output here (default: discarded)")
    ap.add_argument("--precision", default="f32", choices=("f32", "bf16"),
                    help="serve --precision for jaxserve and the naive peer alike")
    ap.add_argument("--key", default="load", help="RESULTS.md section")
    ap.add_argument("--out", default="", help="write the RESULTS.md section to this file instead "
                    "(to splice in elsewhere: python -m bench.common splice FILE)")
    ap.add_argument("--write", action="store_true")
    add_quick(ap, rates="10,20", duration=2.0, instances="1", arrivals="poisson")
    args = apply_quick(ap.parse_args())
    instance_counts = [int(x) for x in args.instances.split(",")]
    rates = [float(x) for x in args.rates.split(",")]
    texts = sample_texts(40 if args.quick else 2000)  # quick: fewer lengths for the naive peer to compile
    url = f"http://127.0.0.1:{args.port}"
    py = sys.executable
    rows, knees = [], {}
    error_kinds = Counter()

    logs = {name: (str(Path(args.log_dir) / f"{name}.log") if args.log_dir else None) for name in ("jaxserve", "naive")}
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    # the naive peer is started and warmed (it compiles every length the sweep sends) while
    # jaxserve warms up; both are warm before any load is sent, so neither sweep shares the
    # machine with a compile
    naive_url = f"http://127.0.0.1:{args.port + 1}"
    naive = start([py, "-m", "bench.naive_server", "--port", str(args.port + 1), "--precision", args.precision],
                  naive_url, logs["naive"], wait=False)
    atexit.register(stop, naive)  # however this script ends
    naive_warm_error = []

    def warm_naive_bg():
        try:
            wait_ready(naive_url, proc=naive)
            warm_naive(naive_url, texts)
        except Exception as exc:  # reported when the naive sweep would start
            naive_warm_error.append(exc)

    naive_warmer = threading.Thread(target=warm_naive_bg, daemon=True)
    naive_warmer.start()

    peer_label = "naive FastAPI + jit" + (f" {args.precision}" if args.precision != "f32" else "")
    overhead = overhead_httpx = float("nan")
    for n, instances in enumerate(instance_counts):
        label = (f"jaxserve{' ' + args.precision if args.precision != 'f32' else ''}, "
                 f"{instances} worker{'s' if instances > 1 else ''}")
        server = start([py, "-m", "jaxserve.cli", "serve", "--model", "minilm-l6", "--port", str(args.port),
                        "--instances", str(instances), "--cache-dir", args.cache_dir,
                        "--max-queue", str(args.max_queue), "--precision", args.precision], url, logs["jaxserve"])
        naive_warmer.join()
        try:
            if n == 0:  # HTTP overhead at batch 1, one request at a time
                overhead, detail = http_overhead(args.port, texts)
                overhead_httpx, _ = http_overhead(args.port, texts, client="httpx")
                print(f"HTTP overhead p50: {overhead:.2f} ms ({detail}); with an httpx client: {overhead_httpx:.2f} ms")
            for kind in args.arrivals.split(",") if n == 0 else ("poisson",):
                print(f"{label}, {kind}:", flush=True)
                res = sweep(url, rates, args.duration, args.slo_ms, kind, texts, args.seed)
                knees[(label, kind)] = knee(res, args.slo_ms)
                for r in res:
                    error_kinds.update({f"{label}: {k}": v for k, v in r.error_kinds.items()})
                    rows.append([label, kind, f"{r.offered:.0f}", f"{r.throughput:.1f}", f"{r.pct(50):.1f}",
                                 f"{r.pct(98):.1f}", f"{r.pct(99):.1f}", f"{r.attainment(args.slo_ms):.3f}",
                                 str(r.rejected), str(r.evicted), str(r.errors)])
        finally:
            stop(server)

    try:
        naive_warmer.join()
        if naive_warm_error:
            raise naive_warm_error[0]
        res = sweep(naive_url, rates, args.duration, args.slo_ms, "poisson", texts, args.seed)
        knees[("naive", "poisson")] = knee(res, args.slo_ms)
        for r in res:
            error_kinds.update({f"naive: {k}": v for k, v in r.error_kinds.items()})
            rows.append([peer_label, "poisson", f"{r.offered:.0f}", f"{r.throughput:.1f}",
                         f"{r.pct(50):.1f}", f"{r.pct(98):.1f}", f"{r.pct(99):.1f}",
                         f"{r.attainment(args.slo_ms):.3f}", str(r.rejected), str(r.evicted), str(r.errors)])
    finally:
        stop(naive)

    text = table(["server", "arrivals", "offered/s", "answered ok/s", "p50 ms", "p98 ms", "p99 ms", "SLO att.",
                  "429", "evicted", "errors"], rows)
    peer = knees.get(("naive", "poisson"))

    def knee_text(k):
        return f"{k.throughput:.1f}/s (offered {k.offered:.0f}/s, p98 {k.pct(98):.0f} ms)" if k else "none"

    ratios = {}
    knee_lines = [f"{peer_label}: {knee_text(peer)}"]
    for (label, kind), k in knees.items():
        if label == "naive":
            continue
        ratio = (k.throughput / peer.throughput) if k and peer else float("nan")
        if kind == "poisson":
            ratios[label] = ratio
        knee_lines.append(f"{label} ({kind}): {knee_text(k)}" + (f" → **{ratio:.1f}×** the naive peer"
                                                                   if kind == "poisson" else ""))
    notes = (f"SLO {args.slo_ms:.0f} ms on p98; {args.duration:.0f} s per rate; real tweets; MiniLM default grid, "
             + (f"--precision {args.precision} on both servers (bf16 dense kernels, jaxserve/models/precision.py), "
                if args.precision != "f32" else "")
             + f"default policy, max queue {args.max_queue}; load generator on the same {os.cpu_count()} cores.  \nHTTP overhead (client p50 at batch 1 "
             f"minus engine queue+compute, stdlib http.client keep-alive client): **{overhead:.2f} ms** (goal ≤ 2 ms; "
             f"with an httpx client {overhead_httpx:.2f} ms).  \nKnee = the highest "
             f"throughput whose p98 ≤ SLO with ≥ 99% answered on time (goal: jaxserve ≥ 3× the naive peer):  \n"
             + "  \n".join(knee_lines)
             + "  \nErrors (client-side exceptions or statuses other than 200/429): "
             + ("; ".join(f"{k} ×{v}" for k, v in error_kinds.most_common()) or "none"))
    print(text)
    print(notes)
    title = "Open-loop load: throughput, latency and the knee" + (
        f" (--precision {args.precision}, both servers)" if args.precision != "f32" else "")
    if args.out:
        Path(args.out).write_text(section(args.key, title, text, notes))
    elif args.write:
        record(args.key, title, text, notes)
    print(json.dumps({"overhead_ms": overhead, "knee_ratios": ratios}))


if __name__ == "__main__":
    main()
