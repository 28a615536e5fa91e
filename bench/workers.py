"""How many executor workers, and how many XLA threads each, on this machine?

Each configuration runs in its own process (XLA's thread pool is fixed at start-up)
and drives MiniLM executables from ``workers`` threads at once, as the engine's
workers do, for a fixed time. Reported: throughput (sentences/s) and per-batch
latency, at batch 1 and batch 8 (bucket 32, the median tweet's bucket).

    python -m bench.workers [--seconds 8] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

from bench.common import record, table

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


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--child", nargs=3, default=None)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    if args.child:
        return child(int(args.child[0]), int(args.child[1]), float(args.child[2]))
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
