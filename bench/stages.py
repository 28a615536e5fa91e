"""What cutting a model into layer-range stages costs: MiniLM whole against a 2-stage chain.

One process, real all-MiniLM-L6-v2 weights, one cell (batch 8, bucket 64 by default). The
chain is stage [0:k) then [k:L) (``jaxserve.stages``), the hidden states handed from the first
executable to the second as device arrays, as two stages on one worker run. Two views:

* **runtime**: ``ModelRuntime.execute`` against ``StageRuntime.execute`` twice (padding, the
  executables, outputs to the host, the answers' dicts): what a worker does per step;
* **executables**: the compiled whole-model executable against the two stage executables
  alone, on prepared inputs: what the cut itself costs (one more dispatch, the mask's bias
  computed twice, no fusion across the cut).

Rounds interleave the alternatives (the order flips each round), each round timing
``--calls`` calls of each (default one: adjacent calls pair up, so a shared machine's drifting
load hits both alike) and keeping the fastest; the ratio is chain / whole per round, reported
as the median over rounds with a bootstrap 95% confidence interval and the middle half of the
rounds, and as the ratio of the fastest calls overall. Both tables are compiled with the same
fixed option rule (``--no-tune`` semantics), so the ratio compares the programs, not tuning.

    python -m bench.stages [--batch 8] [--length 64] [--cut 3] [--rounds 150] [--calls 1] [--write]
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations;
# read by bench.all, bench.status and bench.headline without importing this module).
MEASURES = (
    "bench/stages.py", "jaxserve/stages.py", "jaxserve/models", "jaxserve/kernels", "jaxserve/polymorph.py",
    "jaxserve/servables.py", "jaxserve/compile_cache.py", "jaxserve/runtime.py",
)
SECTIONS = {"stages": "--write"}

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from bench.common import add_quick, apply_quick, bert_inputs, record, table


def _best_seconds(fn, calls: int) -> float:
    """The fastest of ``calls`` calls: on a shared machine the least disturbed one."""
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _median_ci(values, level: float = 0.95, resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap confidence interval of the median of ``values`` (seeded: reproducible)."""
    rng = np.random.default_rng(0)
    v = np.asarray(values)
    medians = np.median(rng.choice(v, size=(resamples, v.size)), axis=1)
    return float(np.quantile(medians, (1 - level) / 2)), float(np.quantile(medians, (1 + level) / 2))


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parent).stdout.strip()
        return out.stdout.strip() + (" (uncommitted changes in the tree)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def measure(batch: int, length: int, cut: int, rounds: int, calls: int) -> dict:
    import jax

    from jaxserve.registry import load_text_runtime
    from jaxserve.sched.base import Cell, ShapeGrid
    from jaxserve.stages import build_stage_runtimes, split_stages

    cell = Cell(batch, length)
    rt = load_text_runtime("minilm-l6", None, ShapeGrid((batch,), (length,)), tune=False)
    first, last = split_stages(rt.name, rt.num_layers, (cut,))
    runners = build_stage_runtimes(rt, (first, last), None, tune=False)
    s0, s1 = runners[first], runners[last]

    ids, mask = bert_inputs(_minilm_config(), batch, length)  # the last row half padding
    payloads = [row[: int(m.sum())].tolist() for row, m in zip(ids, mask)]
    tasks = [""] * batch

    def whole_step():
        return rt.execute(cell, payloads, tasks).items

    def chain_step():
        carry = s0.execute(cell, payloads, tasks).carry
        return s1.execute(cell, [], tasks, carry).items

    ids, mask = rt.prepare_inputs(cell, payloads, tasks)
    ids_d, mask_d = jax.device_put(ids), jax.device_put(mask)
    whole_exe, exe0, exe1 = rt.table.executable(cell), s0.table.executable(cell), s1.table.executable(cell)

    def whole_exe_call():
        return jax.block_until_ready(whole_exe(rt.weights, ids_d, mask_d))

    def chain_exe_call():
        hidden = exe0(s0.weights, ids_d, mask_d)["hidden"]
        return jax.block_until_ready(exe1(s1.weights, hidden, mask_d))

    # the chain answers as the whole model does
    diff = max(float(np.abs(a[k] - b[k]).max()) for a, b in zip(whole_step(), chain_step()) for k in ("embedding", "cls"))
    carry_bytes = s0.execute(cell, payloads, tasks).carry.nbytes()
    for fn in (whole_step, chain_step, whole_exe_call, chain_exe_call):  # first calls out of the timing
        fn()

    load_before = os.getloadavg()[0]
    pairs = {"runtime": (whole_step, chain_step), "executables": (whole_exe_call, chain_exe_call)}
    samples = {view: {"whole": [], "chain": []} for view in pairs}
    for r in range(rounds):
        for view, (whole, chain) in pairs.items():
            order = (("whole", whole), ("chain", chain)) if r % 2 == 0 else (("chain", chain), ("whole", whole))
            for name, fn in order:
                samples[view][name].append(_best_seconds(fn, calls))
    out = {"load": (load_before, os.getloadavg()[0]), "diff": diff, "carry_bytes": carry_bytes, "params": (s0.param_bytes(), s1.param_bytes()),
           "stages": (first.label(), last.label()), "views": {}}
    for view, s in samples.items():
        ratios = [c / w for c, w in zip(s["chain"], s["whole"])]
        out["views"][view] = {
            "whole_ms": statistics.median(s["whole"]) * 1e3, "chain_ms": statistics.median(s["chain"]) * 1e3,
            "ratio": statistics.median(ratios), "q1": np.percentile(ratios, 25), "q3": np.percentile(ratios, 75),
            "best_ratio": min(s["chain"]) / min(s["whole"]), "ci": _median_ci(ratios),
        }
    return out


def _minilm_config():
    """MiniLM's BERT config (its vocabulary size, for the random ids)."""
    import json

    from jaxserve.models.bert import BertConfig
    from jaxserve.registry import minilm_dir

    return BertConfig.from_hf(json.loads((minilm_dir() / "config.json").read_text()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--cut", type=int, default=3, help="the chain is [0:cut) then [cut:L)")
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--calls", type=int, default=1, help="calls per alternative per round (the fastest counts)")
    ap.add_argument("--write", action="store_true", help="also write the stages section of bench/RESULTS.md")
    add_quick(ap, rounds=3)
    args = apply_quick(ap.parse_args())
    r = measure(args.batch, args.length, args.cut, args.rounds, args.calls)
    rows = [[view, f"{v['whole_ms']:.2f}", f"{v['chain_ms']:.2f}", f"{v['ratio']:.3f}",
             f"{v['ci'][0]:.3f}–{v['ci'][1]:.3f}", f"{v['q1']:.3f}–{v['q3']:.3f}", f"{v['best_ratio']:.3f}"]
            for view, v in r["views"].items()]
    body = table(["what runs", "whole ms", f"chain {' + '.join(r['stages'])} ms", "chain / whole (median of rounds)",
                  "95% CI of that median", "middle half of rounds", "fastest chain / fastest whole"], rows)
    ratio, (low, high) = r["views"]["runtime"]["ratio"], r["views"]["runtime"]["ci"]
    notes = (f"MiniLM (all-MiniLM-L6-v2, real weights) at batch {args.batch}, bucket {args.length}, float32, the "
             f"fixed option rule for every table; {args.rounds} interleaved rounds of "
             f"{args.calls} call(s) of each; ms columns: medians over rounds. Goal: the chain costs at most 3% more per step (chain / whole ≤ 1.03): "
             f"median {ratio:.3f}, 95% CI {low:.3f}–{high:.3f}: "
             f"{'met' if high <= 1.03 else 'not met' if low > 1.03 else 'not resolved at this noise'}. The chain's answers match the whole model's "
             f"within {r['diff']:.1e}. The first stage hands on {r['carry_bytes'] / 1024:.0f} KiB of activations "
             f"(hidden states and mask, padded to the cell) as device arrays; the stages hold "
             f"{r['params'][0] / 2**20:.1f} + {r['params'][1] / 2**20:.1f} MiB of parameters "
             f"(embeddings with the first). The machine is shared: its 1-minute load average was "
             f"{r['load'][0]:.1f} when the rounds began and {r['load'][1]:.1f} when they ended (2 cores), so "
             f"single rounds scatter; the interleaving keeps that from favouring either side. Commit: {_commit()}.")
    print(body)
    print(notes)
    if args.write:
        record("stages", "Stage executables: a 2-stage MiniLM chain against the whole model", body, notes)


if __name__ == "__main__":
    main()
