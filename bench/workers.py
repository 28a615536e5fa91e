"""How many executor workers, and how many XLA threads each, on this machine?

Each configuration runs in its own process (XLA's thread pool is fixed at start-up)
and drives MiniLM executables from ``workers`` threads at once, as the engine's
workers do, for a fixed time. Reported: throughput (sentences/s) and per-batch
latency, at batch 1 and batch 8 (bucket 32, the median tweet's bucket).

Section "ray" (``--section ray``): the same MiniLM executable (real weights, batch 8,
length 64) behind 2 thread workers and behind 2 Ray actors, XLA at one intra-op thread
in each (the thread setup's process and every actor alike), from one run: throughput, Ray's
per-step overhead (a b1 x 16 step's round trip against the same step in-process), transfer
time per MB between actors (hidden-state-sized arrays and larger, through the object store)
and the time a new actor takes to be ready (serialized executables and weights). Then the
hand-off of activations between steps (``WorkerSpec.handoff``): AsyFunc's split of a b8×64
batch (MiniLM cut at layers 2 and 4: ``[0:2)`` on a body, ``[2:4)`` on 4 rows each at the body
and at a shadow, ``[4:6)`` merged on the body) and the same three stages as a pipeline over the
two actors, each step's carry made by the engine's ``gather_carry``, with the activations left
in the store (``"store"``) and sent through the driver (``"driver"``), timed alternately.

    python -m bench.workers [--seconds 8] [--section all|threads|ray] [--write]
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations;
# read by bench.all, bench.status and bench.headline without importing this module).
MEASURES = (
    "bench/workers.py", "jaxserve/workers.py", "jaxserve/ray_workers.py", "jaxserve/launch.py",
    "jaxserve/models", "jaxserve/kernels", "jaxserve/polymorph.py", "jaxserve/servables.py",
    "jaxserve/compile_cache.py", "jaxserve/runtime.py",
)
SECTIONS = {
    "workers": "--section threads --write",
    "workers-ray": "--section ray --seconds 5 --rounds 9 --write",
}
PRODUCES = ("bench/profiles/ray-transfer.json",)  # the measured Ray hop, which QUART's runs price

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.common import add_quick, apply_quick, output, record, table

CONFIGS = [
    ("1 worker, XLA threads = cores", 1, ""),
    ("2 workers, XLA threads = cores", 2, ""),
    ("2 workers, 1 XLA thread each", 2, "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"),
]


def child(workers: int, batch: int, seconds: float) -> None:
    from jaxserve.models.bert import load_hf_bert
    from jaxserve.polymorph import PolymorphTable
    from jaxserve.registry import minilm_dir
    from jaxserve.sched.base import Cell, ShapeGrid
    from jaxserve.servables import bert_servable, weights_of

    cfg, model = load_hf_bert(minilm_dir())
    weights = weights_of(model)
    cell = Cell(batch, 32)
    table_ = PolymorphTable(bert_servable("minilm-l6", cfg, ShapeGrid((batch,), (32,))))
    table_.warmup()
    ids = np.full((batch, 32), 1000, np.int32)
    mask = np.ones_like(ids)
    table_.run(cell, weights, ids, mask)
    lat: list[float] = []
    stop = time.perf_counter() + seconds

    def loop():
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            table_.run(cell, weights, ids, mask)
            lat.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=loop) for _ in range(workers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    print(json.dumps({"throughput": len(lat) * batch / elapsed, "p50_ms": float(np.median(lat) * 1e3),
                      "p98_ms": float(np.percentile(lat, 98) * 1e3)}))


# ------------------------------------------------------------------ Ray actors against threads
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
HIDDEN_BYTES = 8 * 64 * 384 * 4  # MiniLM's hidden states [8, 64, 384] float32: what a stage hands on


def _drive(workers, step, seconds: float, depth: int) -> float:
    """Items/s with one driver thread per worker keeping ``depth`` steps submitted to it."""
    from collections import deque

    done = [0] * len(workers)
    stop = time.perf_counter() + seconds

    def loop(i, worker):
        pending = deque()
        while time.perf_counter() < stop:
            while len(pending) < depth:
                pending.append(worker.submit(step))
            pending.popleft().result()
            done[i] += 1
        for f in pending:
            f.result()
            done[i] += 1

    threads = [threading.Thread(target=loop, args=(i, w)) for i, w in enumerate(workers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) * step.cell.batch / (time.perf_counter() - t0)


def _median_seconds(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _paired_seconds(first, second, repeats: int) -> tuple[float, float, float]:
    """Medians of ``first()`` and ``second()`` timed alternately, and the median of their
    paired differences (second - first): a load that shifts while it runs hits both."""
    for _ in range(3):
        first(), second()
    a, b = [], []
    for _ in range(repeats):
        for fn, times in ((first, a), (second, b)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return float(np.median(a)), float(np.median(b)), float(np.median(np.array(b) - np.array(a)))


def _gone(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def ray_measure(seconds: float, rounds: int, handoff_repeats: int = 100) -> dict:
    """Every number of the ray section, from this process: a local Ray first (before JAX
    starts here), then the thread workers' runtime loaded into a fresh cache (which the actors
    then load from), then ``rounds`` interleaved rounds of threads and actors."""
    import shutil
    import tempfile

    import ray

    from jaxserve.compile_cache import CompileCache
    from jaxserve.launch import ServeSettings, load_runtimes
    from jaxserve.ray_workers import RayWorker, WorkerSpec, ensure_ray, make_ray_workers
    from jaxserve.sched.base import Cell, ShapeGrid, Stage
    from jaxserve.workers import Step, ThreadWorker

    ensure_ray(None, num_cpus=4)  # logical CPUs: actors asking one each never wait for a slot
    cache = tempfile.mkdtemp(prefix="jaxserve-bench-ray-")
    try:
        settings = ServeSettings(models=("minilm-l6",), cache_dir=cache, progress=False,
                                 text_grid=ShapeGrid((1, 4, 8), (16, 64)))
        rt = load_runtimes(settings, CompileCache(cache))["minilm-l6"]  # compiles, fills the cache
        stage = Stage("minilm-l6", 0, rt.num_layers, rt.num_layers)
        rs = np.random.RandomState(0)
        rows = [[101, *rs.randint(1000, 30000, 62).tolist(), 102] for _ in range(8)]
        big = Step(stage, Cell(8, 64), tuple(rows), ("",) * 8)
        tiny = Step(stage, Cell(1, 16), ([101, *range(2000, 2014), 102],), ("",))
        threads = [ThreadWorker(i, lambda s: rt, [stage]) for i in range(2)]
        t0 = time.perf_counter()
        actors = make_ray_workers(settings, 2, lambda i: [stage])
        two_ready = time.perf_counter() - t0
        for w in threads + actors:
            w.submit(big).result()
        out = {"threads": [], "ray": [], "ray_depth2": [], "two_actors_ready_s": two_ready}
        setups = [("threads", threads, 1), ("ray", actors, 1), ("ray_depth2", actors, 2)]
        for i in range(rounds):  # rotated, so no setup always follows the same one
            for key, workers, depth in setups[i % 3:] + setups[:i % 3]:
                out[key].append(_drive(workers, big, seconds, depth))
        out["tiny_thread_s"], out["tiny_ray_s"], out["tiny_overhead_s"] = _paired_seconds(
            lambda: threads[0].submit(tiny).result(), lambda: actors[0].submit(tiny).result(), 300)
        a, b = actors[0].actor, actors[1].actor
        out["actor_call_s"] = _median_seconds(lambda: ray.get(a.echo.remote(None)), 300)
        hops = {}
        for nbytes in (8, HIDDEN_BYTES, 4 * HIDDEN_BYTES, 16 * HIDDEN_BYTES, 64 * HIDDEN_BYTES):
            ref = ray.put(np.random.default_rng(0).random(nbytes // 4, dtype=np.float32))
            hops[nbytes] = _median_seconds(lambda: ray.get(b.nbytes.remote(a.echo.remote(ref))), 20)
            del ref
        out["hops"] = hops
        out["compilations"] = [w.compilations() for w in actors]
        pids = [w.pid() for w in actors]
        for w in actors + threads:
            w.close()
        for pid in pids:
            _gone(pid)
        out["handoff"] = handoff_measure(settings, rt, handoff_repeats)  # its 4 actors after these 2 ended (4 logical CPUs)
        spec = WorkerSpec.from_settings(settings)
        fresh = RayWorker(10, spec, [stage])
        out["new_actor_ready_s"] = fresh.ready.result()
        out["new_actor_compilations"] = fresh.compilations()
        pid = fresh.pid()
        fresh.close()
        _gone(pid)
        empty = RayWorker(11, spec, [])
        out["empty_actor_ready_s"] = empty.ready.result()
        out["load_in_actor_s"] = empty.load(stage).result()
        empty.close()
        return out
    finally:
        ray.shutdown()
        shutil.rmtree(cache, ignore_errors=True)


def handoff_measure(settings, rt, repeats: int) -> dict:
    """Per hand-off ("store", "driver"): the median wall time of a split chain and of a pipeline
    chain (module docstring), timed alternately ``repeats`` times, and their compute time."""
    import dataclasses

    from jaxserve.compile_cache import CompileCache
    from jaxserve.ray_workers import RayWorker, WorkerSpec, all_ready
    from jaxserve.sched.base import Cell
    from jaxserve.stages import build_stage_runtimes, split_stages
    from jaxserve.workers import Step, gather_carry

    pre, blk, post = split_stages("minilm-l6", rt.num_layers, (2, 4))
    build_stage_runtimes(rt, (pre, blk, post), CompileCache(settings.cache_dir), tune=settings.tune)
    spec = WorkerSpec.from_settings(settings)
    pairs = {}
    for handoff in ("store", "driver"):
        s = dataclasses.replace(spec, handoff=handoff)
        pairs[handoff] = (RayWorker(20, s, [pre, blk, post]), RayWorker(21, s, [blk]))
    all_ready([w for pair in pairs.values() for w in pair])
    rs = np.random.RandomState(1)
    payloads = tuple([101, *rs.randint(1000, 30000, 62).tolist(), 102] for _ in range(8))
    tasks = ("",) * 8
    c8, c4 = Cell(8, 64), Cell(4, 64)
    compute: dict[str, list[float]] = {}

    def split(handoff: str) -> None:
        body, shadow = pairs[handoff]
        s1 = body.submit(Step(pre, c8, payloads, tasks)).result()
        fa = body.submit(Step(blk, c4, (), tasks[:4], gather_carry([(s1.carry, i) for i in range(4)])))
        fb = shadow.submit(Step(blk, c4, (), tasks[4:], gather_carry([(s1.carry, i) for i in range(4, 8)])))
        a, b = fa.result(), fb.result()
        merged = gather_carry([(a.carry, i) for i in range(4)] + [(b.carry, i) for i in range(4)])
        s3 = body.submit(Step(post, c8, (), tasks, merged)).result()
        compute.setdefault(f"split_{handoff}", []).append(s1.compute_seconds + max(a.compute_seconds, b.compute_seconds)
                                                            + s3.compute_seconds)

    def pipeline(handoff: str) -> None:
        body, shadow = pairs[handoff]
        s1 = body.submit(Step(pre, c8, payloads, tasks)).result()
        s2 = shadow.submit(Step(blk, c8, (), tasks, gather_carry([(s1.carry, i) for i in range(8)]))).result()
        s3 = body.submit(Step(post, c8, (), tasks, gather_carry([(s2.carry, i) for i in range(8)]))).result()
        compute.setdefault(f"pipeline_{handoff}", []).append(s1.compute_seconds + s2.compute_seconds
                                                               + s3.compute_seconds)

    out = {}
    for name, fn in (("split", split), ("pipeline", pipeline)):
        out[f"{name}_store_s"], out[f"{name}_driver_s"], out[f"{name}_diff_s"] = _paired_seconds(
            lambda: fn("store"), lambda: fn("driver"), repeats)
    out.update({f"{k}_compute_s": float(np.median(v)) for k, v in compute.items()})
    out["carry_mb"] = 8 * 64 * 384 * 4 / 2**20
    out["repeats"] = repeats
    out["handoffs_store_body"] = pairs["store"][0].handoffs()
    out["handoffs_store_shadow"] = pairs["store"][1].handoffs()
    for pair in pairs.values():
        for w in pair:
            w.close()
    return out


def ray_section(seconds: float, rounds: int, write: bool, handoff_repeats: int = 100) -> None:
    if "jax" in sys.modules:
        raise RuntimeError("the ray section sets XLA_FLAGS before JAX starts: run it first")
    os.environ["XLA_FLAGS"] = ONE_THREAD  # this process's thread workers and, passed on, every actor
    load_before = os.getloadavg()[0]
    r = ray_measure(seconds, rounds, handoff_repeats)
    load_after = os.getloadavg()[0]
    thr, ray_, ray2 = (float(np.median(r[k])) for k in ("threads", "ray", "ray_depth2"))
    ratio = {k: float(np.median(np.array(r[k]) / np.array(r["threads"]))) for k in ("ray", "ray_depth2")}
    sizes = sorted(r["hops"])
    mb = np.array(sizes) / 2**20
    per_mb, intercept = np.polyfit(mb, np.array([r["hops"][n] for n in sizes]), 1)
    hidden = r["hops"][HIDDEN_BYTES] - r["hops"][sizes[0]]
    spread = lambda k: "–".join(f"{x:.0f}" for x in (min(r[k]), max(r[k])))  # noqa: E731
    rows = [
        ["throughput, 2 thread workers (sentences/s)", f"{thr:.0f} ({spread('threads')})", "1.00"],
        ["throughput, 2 Ray actors, 1 step in flight each", f"{ray_:.0f} ({spread('ray')})", f"{ratio['ray']:.2f}"],
        ["throughput, 2 Ray actors, 2 steps in flight each", f"{ray2:.0f} ({spread('ray_depth2')})",
         f"{ratio['ray_depth2']:.2f}"],
        ["b1×16 step, in-process thread worker (ms)", f"{r['tiny_thread_s'] * 1e3:.2f}", ""],
        ["b1×16 step, Ray actor (ms)", f"{r['tiny_ray_s'] * 1e3:.2f}", ""],
        ["Ray per-step overhead (ms)", f"{r['tiny_overhead_s'] * 1e3:.2f}", ""],
        ["empty actor call round trip (ms)", f"{r['actor_call_s'] * 1e3:.2f}", ""],
        ["transfer between actors (ms per MB, fit over 0.75–48 MB)", f"{per_mb * 1e3:.2f}", ""],
        [f"hidden states b8×64 ({HIDDEN_BYTES / 2**20:.2f} MB) hop, beyond an empty one (ms)",
         f"{hidden * 1e3:.2f}", ""],
        ["hop latency, 8-byte array (ms)", f"{r['hops'][sizes[0]] * 1e3:.2f}", ""],
        ["new actor ready: process, imports, 4 serialized cells, weights, each cell run once (s)",
         f"{r['new_actor_ready_s']:.2f}", ""],
        ["… of which: an empty actor ready (process start, imports) (s)", f"{r['empty_actor_ready_s']:.2f}", ""],
        ["… of which: loading the stage inside the actor (s)", f"{r['load_in_actor_s']:.2f}", ""],
        ["2 actors started at once, both ready (s)", f"{r['two_actors_ready_s']:.2f}", ""],
        ["compilations in the actors after load", f"{sum(r['compilations']) + r['new_actor_compilations']}", ""],
    ]
    h = r["handoff"]
    for name, label in (("split", "split b8×64 (body [0:2), 4+4 rows [2:4) on body and shadow, body [4:6))"),
                        ("pipeline", "pipeline b8×64 ([0:2) body, [2:4) shadow, [4:6) body)")):
        rows += [[f"{label}, activations left in the store (ms; compute {h[f'{name}_store_compute_s'] * 1e3:.1f})",
                  f"{h[f'{name}_store_s'] * 1e3:.2f}", ""],
                 [f"… the same, activations through the driver (ms; compute {h[f'{name}_driver_compute_s'] * 1e3:.1f})",
                  f"{h[f'{name}_driver_s'] * 1e3:.2f}", ""],
                 ["… through the driver minus left in the store, paired (ms); store / driver",
                  f"{h[f'{name}_diff_s'] * 1e3:.2f}", f"{h[f'{name}_store_s'] / h[f'{name}_driver_s']:.2f}"]]
    text = table(["measure", "value", "× threads"], rows)
    notes = (f"MiniLM-L6 (real weights), cell b8×64, XLA_FLAGS='{ONE_THREAD}' in this process's thread workers "
             f"and in every actor (one core each; Ray logical CPUs: 1 per actor). Throughput: median of {rounds} "
             f"rounds of {seconds:.0f} s per setup, setups interleaved in rotated order, one driver thread per "
             "worker (range in brackets); × threads is the median of each round's ratio to that round's "
             "threads. The per-step overhead is the median difference between a b1×16 step "
             "through `RayWorker.submit` and the same step through `ThreadWorker.submit`, timed alternately. Transfers: actor A returns an array that "
             "actor B takes as an argument (one copy into the object store, mapped by B on this one node); "
             "per MB is the slope of a least-squares fit over 0.75, 3, 12 and 48 MB (plus an 8-byte array), "
             f"intercept {intercept * 1e3:.2f} ms. Hand-off: medians of {h['repeats']} chains per hand-off, timed alternately "
             f"(the last column there: store / driver); {h['carry_mb']:.2f} MB of hidden states per full carry; "
             f"in the store arm the body took {h['handoffs_store_body']} and the shadow "
             f"{h['handoffs_store_shadow']} parts (kept: its own activations on its device). New actor: `RayWorker(...).ready` with the executables "
             "in a cache the driver filled moments before (page cache warm). Load average (1 min) "
             f"{load_before:.1f} before, {load_after:.1f} after: the 2 cores are shared with other jobs, "
             "so read the ratios (interleaved) rather than the absolute rates.")
    print(text)
    print(notes)
    if write:
        record("workers-ray", "Ray actors against thread workers", text, notes)
        # what the simulator prices a hop between workers with (jaxserve.simulator.Transfer.from_profile)
        from jaxserve.profiler import machine_description  # JAX is up by now (see the check above)

        profile = {"hop_latency_s": float(r["hops"][sizes[0]]), "bytes_per_s": float(2**20 / per_mb),
                   "measured_by": "python -m bench.workers --section ray --write", "machine": machine_description()}
        output(Path(__file__).parent / "profiles" / "ray-transfer.json").write_text(json.dumps(profile, indent=1) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--child", nargs=3, default=None)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=3, help="ray section: interleaved rounds")
    ap.add_argument("--handoff-repeats", type=int, default=100, help="ray section: chains per hand-off")
    ap.add_argument("--section", choices=("all", "threads", "ray"), default="all")
    ap.add_argument("--write", action="store_true")
    add_quick(ap, seconds=1.0, rounds=1, handoff_repeats=5)
    args = apply_quick(ap.parse_args())
    if args.child:
        return child(int(args.child[0]), int(args.child[1]), float(args.child[2]))
    if args.section in ("all", "ray"):
        ray_section(args.seconds, args.rounds, args.write, args.handoff_repeats)
    if args.section == "ray":
        return
    rows = []
    base = {}
    for batch in (1, 8):
        for label, workers, flags in CONFIGS:
            env = dict(os.environ, XLA_FLAGS=flags) if flags else dict(os.environ)
            out = subprocess.run([sys.executable, "-m", "bench.workers", "--child", str(workers), str(batch),
                                  str(args.seconds)], capture_output=True, text=True, env=env, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            base.setdefault(batch, r["throughput"])
            rows.append([str(batch), label, f"{r['throughput']:.0f}", f"{r['throughput'] / base[batch]:.2f}",
                         f"{r['p50_ms']:.1f}", f"{r['p98_ms']:.1f}"])
            print(rows[-1], flush=True)
    text = table(["batch", "configuration", "sentences/s", "× 1 worker", "p50 ms/batch", "p98 ms/batch"], rows)
    notes = ("MiniLM, bucket 32, every worker calling its executable back to back for "
             f"{args.seconds:.0f} s. The engine's default follows the best row: see README.")
    print(text)
    if args.write:
        record("workers", "Executor workers and XLA threads", text, notes)


if __name__ == "__main__":
    main()
