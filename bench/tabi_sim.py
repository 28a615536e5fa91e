"""Tabi simulated at the paper's load: each text task's test split replayed through the cascade the
profile chose and through each baseline (jaxserve simulate --policy tabi|tabi-small|tabi-large|
tabi-infaas), batch 1:

* **closed loop** (the paper's setting: one query at a time, each after the previous finished):
  arrivals spaced far apart, so each request's latency is its own path's compute;
* **open loop**, Poisson at half of what the largest model alone serves on one instance.

Every step's outputs are the real models' replayed outputs (``jaxserve.sched.tabi.Replay``:
calibrated probabilities on the full and the pruned text, token lengths), priced by the
profile's batch-1 bucket latencies measured on this machine. Accuracy is the answers' (the
ensemble's where two levels ran) against the test labels.

    .venv/bin/python -m bench.tabi_sim [--requests 20000] [--write]
"""

from __future__ import annotations

MEASURES = (
    "bench/tabi_sim.py", "jaxserve/sched/tabi.py", "jaxserve/sched/batching.py", "jaxserve/simulator.py",
    "jaxserve/launch.py", "jaxserve/profiles/cascade.json", "training/profile_cascade.py",
)
SECTIONS = {"tabi_sim": "--write"}

import argparse
import json

import numpy as np

from jaxserve.launch import simulate_cascade
from jaxserve.registry import PROFILES
from jaxserve.traces import poisson_arrivals

POLICIES = ("tabi", "tabi-small", "tabi-large", "tabi-infaas")
PAPER = ("Paper (SST-2 etc., GPUs): mean latency -21% to -40% vs INFaaS and -11% to -26% vs Cocktail at LLM-grade "
         "accuracy; 69.8% of SST-2 queries return at the first level; alpha 0.7 prunes 14.2% of SST-2's words and "
         "cuts the LLM's latency 17%.")


def run(task: str, requests: int, seed: int = 0) -> list[dict]:
    profile = json.loads((PROFILES / "cascade.json").read_text())["tasks"][task]
    large_ms = profile["test"]["tabi-large"]["cost_ms"]
    rows = []
    for mode in ("closed", "open"):
        if mode == "closed":  # 1 s apart: no request ever waits for another (the slowest path is ~0.2 s)
            arrivals = np.arange(requests) * 1.0
        else:
            arrivals = poisson_arrivals(0.5 / (large_ms / 1e3), n=requests, seed=seed)
        for policy in POLICIES:
            out = simulate_cascade(policy, task, arrivals, seed=seed)
            rows.append({"task": task, "mode": mode, "policy": policy, **out})
            print(json.dumps(rows[-1], default=float), flush=True)
    return rows


def main() -> None:
    from bench.common import add_quick, apply_quick, table

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--write", action="store_true")
    add_quick(ap, requests=500)
    args = apply_quick(ap.parse_args())
    profile = json.loads((PROFILES / "cascade.json").read_text())
    rows = []
    for task in sorted(profile["tasks"]):
        rows += run(task, args.requests)
    lines = []
    for r in rows:
        large = next(x for x in rows if x["task"] == r["task"] and x["mode"] == r["mode"] and x["policy"] == "tabi-large")
        infaas = next(x for x in rows if x["task"] == r["task"] and x["mode"] == r["mode"]
                      and x["policy"] == "tabi-infaas")
        lines.append([r["task"], r["mode"], r["policy"], r["candidate"], f"{100 * r['accuracy']:.2f}",
                      f"{100 * (r['accuracy'] - large['accuracy']):+.2f}", f"{r['mean_latency_ms']:.2f}",
                      f"{r['p98_ms']:.2f}", f"{r['mean_latency_ms'] / large['mean_latency_ms']:.2f}x",
                      f"{100 * (r['mean_latency_ms'] / infaas['mean_latency_ms'] - 1):+.0f}%",
                      f"{100 * r['exit_shares'][0]:.1f}%", f"{100 * r['pruned_token_share']:.1f}%"])
    body = table(["task", "loop", "policy", "candidate", "accuracy %", "vs large (pts)", "mean ms", "p98 ms",
                  "mean / large", "mean vs INFaaS", "first level", "tokens pruned"], lines)
    notes_rows = []
    for task, t in sorted(profile["tasks"].items()):
        notes_rows.append([task, str(t["alpha"]), f"{100 * (t['pruned_token_share_test'] or 0):.1f}%",
                           f"{t['test']['tabi']['accuracy'] * 100:.2f}", f"{t['test']['tabi-large']['accuracy'] * 100:.2f}"])
    notes = ("Profile (validation-selected, reported on test): " + table(
        ["task", "alpha", "tokens pruned (next model)", "Tabi accuracy %", "large alone %"], notes_rows)
        + "\n\n" + PAPER + " Cocktail-like (an ensemble of every model on each request, run in parallel) is not "
        "simulated: the engine runs one step of a request at a time.")
    print(body)
    if args.write:
        from bench.common import record

        record("tabi_sim", "Tabi simulated: cascade vs each model alone and INFaaS-like (batch 1, replayed outputs)",
               body, notes)


if __name__ == "__main__":
    main()
