"""Tabi live: `jaxserve serve --policy tabi` against its baselines (tabi-small, tabi-large,
tabi-infaas, tabi-cocktail) on 127.0.0.1, closed loop at batch 1 as the paper measures (one query at a time, the
next sent when the previous is answered), on each task's held-out test texts.

All five servers warm first (one compile cache, so the models compile once), then the arms are
interleaved in rounds: each round sends every arm the same ``--per-round`` test texts of a task,
arm after arm, so a change in the machine's load hits every arm alike. Reported per task: the
answers' accuracy against the test labels, the mean and p98 of the server's own latency
(``meta.latency_ms``, arrival to answer) and of the client's round trip, the share answered at
the first level and the share of tokens pruned, and per round the ratio of Tabi's mean to each
baseline's with its spread over rounds.

    nice -n 10 python -m bench.tabi_live [--rounds 5] [--per-round 40] [--write]
"""

from __future__ import annotations

MEASURES = (
    "bench/tabi_live.py", "jaxserve/sched/tabi.py", "jaxserve/cascade.py", "jaxserve/profiles/cascade.json",
    "serving", "jaxserve/engine.py", "jaxserve/launch.py", "jaxserve/runtime.py", "jaxserve/models",
    "jaxserve/kernels", "jaxserve/servables.py", "jaxserve/sched/batching.py",
)
SECTIONS = {"tabi_live": "--write"}

import argparse
import json
import sys
import time

import httpx
import numpy as np

from bench.common import add_quick, apply_quick, table
from bench.load import start, stop
from jaxserve.datasets import text_task_split
from jaxserve.registry import PROFILES

POLICIES = ("tabi", "tabi-small", "tabi-large", "tabi-infaas", "tabi-cocktail")
PORT0 = 8710


def run_round(url: str, task: str, texts: list[str], labels: np.ndarray, label_names) -> dict:
    rec = {"server_ms": [], "client_ms": [], "right": [], "levels": [], "pruned": []}
    with httpx.Client(base_url=url, timeout=120) as c:
        for text, label in zip(texts, labels):
            t0 = time.perf_counter()
            r = c.post("/v1/classify/text", json={"task": task, "inputs": [text], "truncate": True})
            rec["client_ms"].append((time.perf_counter() - t0) * 1e3)
            r.raise_for_status()
            res = r.json()["results"][0]
            rec["server_ms"].append(res["meta"]["latency_ms"])
            rec["right"].append(res["label"] == label_names[int(label)])
            rec["levels"].append(len(res["levels"]))
            rec["pruned"].append(res["pruned_tokens"])
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=40)
    ap.add_argument("--cache-dir", default="compiled_cache")
    ap.add_argument("--write", action="store_true")
    add_quick(ap, rounds=1, per_round=4)
    args = apply_quick(ap.parse_args())
    tasks = sorted(json.loads((PROFILES / "cascade.json").read_text())["tasks"])
    procs, urls = {}, {}
    try:
        for i, policy in enumerate(POLICIES):
            port = PORT0 + i
            urls[policy] = f"http://127.0.0.1:{port}"
            print(f"starting {policy} on :{port}", flush=True)
            procs[policy] = start([sys.executable, "-m", "jaxserve.cli", "serve", "--policy", policy, "--port", str(port),
                                   "--cache-dir", args.cache_dir, "--instances", "1", "--batch-sizes", "1,2,4"],
                                  urls[policy], log=f"/tmp/tabi_live_{policy}.log")
        results = {(t, p): [] for t in tasks for p in POLICIES}
        rng = np.random.default_rng(0)
        for rnd in range(args.rounds):
            for task in tasks:
                texts, labels, names = text_task_split(task, "test")
                pick = rng.choice(len(texts), args.per_round, replace=False)
                sample, truth = [texts[i] for i in pick], labels[pick]
                for policy in POLICIES:
                    results[(task, policy)].append(run_round(urls[policy], task, sample, truth, names))
                    r = results[(task, policy)][-1]
                    print(f"round {rnd} {task} {policy}: mean {np.mean(r['server_ms']):.1f} ms, "
                          f"accuracy {np.mean(r['right']):.3f}", flush=True)
    finally:
        for proc in procs.values():
            stop(proc)
    rows, ratio_rows = [], []
    for task in tasks:
        for policy in POLICIES:
            rounds = results[(task, policy)]
            srv = np.concatenate([r["server_ms"] for r in rounds])
            cli = np.concatenate([r["client_ms"] for r in rounds])
            right = np.concatenate([r["right"] for r in rounds])
            levels = np.concatenate([r["levels"] for r in rounds])
            rows.append([task, policy, f"{100 * right.mean():.1f}", f"{srv.mean():.1f}", f"{np.percentile(srv, 98):.1f}",
                         f"{cli.mean():.1f}", f"{100 * (levels == 1).mean():.0f}%", str(len(srv))])
        tabi = results[(task, "tabi")]
        for base in POLICIES[1:]:
            ratios = [np.mean(a["server_ms"]) / np.mean(b["server_ms"]) for a, b in zip(tabi, results[(task, base)])]
            ratio_rows.append([task, f"tabi / {base}", f"{np.median(ratios):.2f}",
                               f"{min(ratios):.2f}-{max(ratios):.2f}"])
    body = (table(["task", "policy", "accuracy %", "server mean ms", "server p98 ms", "client mean ms",
                   "answered at level 1", "requests"], rows)
            + "\n\nPer-round ratio of mean server latency (median, min-max over rounds):\n\n"
            + table(["task", "ratio", "median", "range"], ratio_rows))
    print(body)
    if args.write:
        from bench.common import record

        record("tabi_live", "Tabi live: the cascade against each model alone, INFaaS-like and Cocktail-like (closed loop, batch 1)",
               body, f"{args.rounds} rounds x {args.per_round} test texts per task and arm, interleaved; one "
               "instance per server; the five servers run side by side, idle but the one measured.")


if __name__ == "__main__":
    main()
