"""QUART live on this machine (issue 20, experiment 3): MiniLM-L6 as a pipeline of 3 stages on Ray
actors, a burst, key-stage replicas from the parameter cache against the same run with the cache
off, and the same trace through the simulator.

``jaxserve serve --policy quart --workers ray --quart-stages 3 --instances 6`` (real weights; grid
batch 1, 2, 4, 8 x buckets 32, 64), real tweets of <= 64 tokens over HTTP on 127.0.0.1, open loop:
Poisson at ``BASE`` of the whole model's capacity for 15 s, at ``BURST`` for 15 s, at ``BASE`` for
20 s. :func:`run`'s docstring has the decisions.

    python -m bench.quart_live [--rounds 2] [--write]
"""

from __future__ import annotations

MEASURES = (
    "bench/quart_live.py", "bench/load.py", "bench/httpload.py", "bench/profiles/ray-transfer.json",
    "jaxserve/sched/quart.py", "jaxserve/sched/pipeline.py", "jaxserve/quart_exec.py", "jaxserve/keys_manager.py",
    "jaxserve/asyfunc_exec.py", "jaxserve/launch.py", "jaxserve/engine.py", "jaxserve/ray_workers.py",
    "jaxserve/workers.py", "jaxserve/stages.py", "jaxserve/simulator.py", "serving", "jaxserve/polymorph.py",
    "jaxserve/models", "jaxserve/servables.py", "jaxserve/compile_cache.py", "jaxserve/runtime.py",
)
SECTIONS = {"quart_live": "--write"}

import argparse
import sys
from pathlib import Path

import numpy as np

from bench.common import MetricsSampler

MODEL = "minilm-l6"
STAGES, INSTANCES, PERIOD_S = 3, 6, 1.0
BATCHES, BUCKETS = (1, 2, 4, 8), (32, 64)
CACHE = Path("compiled_cache") / "quart_live"
BASE, BURST = 0.3, 1.2  # Poisson rates, fractions of the whole model's profiled capacity at batch 8, bucket 64
PHASES = ((15.0, BASE), (15.0, BURST), (20.0, BASE))  # (seconds, rate fraction)
ARMS = (("on", "cache on"), ("off", "cache off"))
# every request's deadline, and what the policy's stage targets derive from: the server's default (2x the
# whole model's profiled batch-1 time, 16 ms here) gives each stage a target below one Ray call's overhead
# (~4 ms), so the Corrector would call every stage late at any load and fill every slot
SLO_MS = 1000.0


def settings_for(cache: str, cache_dir: str):
    from jaxserve.launch import ServeSettings
    from jaxserve.sched.base import ShapeGrid

    return ServeSettings(models=(MODEL,), cache_dir=cache_dir, policy="quart", workers="ray", instances=INSTANCES,
                         quart_stages=STAGES, quart_period_s=PERIOD_S, quart_cache=cache == "on",
                         text_grid=ShapeGrid(BATCHES, BUCKETS), slo_ms=SLO_MS)


def serve_flags(cache: str) -> list[str]:
    """The server's flags after ``jaxserve serve`` (``cache``: ``--quart-cache``), as
    :func:`settings_for` sets them."""
    return ["--model", MODEL, "--workers", "ray", "--policy", "quart", "--instances", str(INSTANCES),
            "--quart-stages", str(STAGES), "--quart-period-s", f"{PERIOD_S:g}", "--quart-cache", cache,
            "--batch-sizes", ",".join(map(str, BATCHES)), "--buckets", ",".join(map(str, BUCKETS)),
            "--slo-ms", f"{SLO_MS:g}"]


def tweets_that_fit(seq: int):
    """Real tweets of at most ``seq`` tokens, and their token counts."""
    from jaxserve.datasets import load_tweets
    from jaxserve.models.tokenizer import TextTokenizer
    from jaxserve.registry import minilm_dir

    texts, _ = load_tweets()
    tok = TextTokenizer(minilm_dir() / "tokenizer.json")
    pairs = [(t, len(ids)) for t, ids in zip(texts, tok.encode(texts)) if len(ids) <= seq]
    return [t for t, _ in pairs], np.array([n for _, n in pairs])


def schedule(rate: float, seed: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(send times, phase index of each): Poisson per phase at its share of ``rate``, each phase
    ``scale`` times its length."""
    from jaxserve import traces

    times, phase, t0 = [], [], 0.0
    for k, (seconds, frac) in enumerate(PHASES):
        seconds *= scale
        arr = traces.poisson_arrivals(frac * rate, duration=seconds, seed=seed * 10 + k)
        times.append(arr + t0)
        phase.append(np.full(len(arr), k))
        t0 += seconds
    return np.concatenate(times), np.concatenate(phase)


def simulated(cache: str, cost, times: np.ndarray, lengths: np.ndarray, seed: int = 0,
              ratios: dict[str, float] | None = None) -> dict:
    """The schedule through the simulator with the policy the live server builds (its cost model,
    the stages priced at their share of the whole model, new replicas' loads priced by
    ``LoadModel``, activations at the measured Ray hop). ``ratios`` (stage label -> live busy /
    priced seconds, from another run): each stage's steps take their price times its ratio, which
    holds the hop (live, a step's wall time includes taking its activations from Ray's object
    store), so no transfer is added; the policy still plans with the profile, as live."""
    from jaxserve import traces
    from jaxserve.launch import make_quart_policy, with_quart
    from jaxserve.models.bert import BERT_CONFIGS
    from jaxserve.sched.base import CostModel, LatencyProfile
    from jaxserve.simulator import Transfer, simulate

    settings = with_quart(settings_for(cache, "unused"))
    policy = make_quart_policy(settings, {MODEL: settings.text_grid}, cost)
    stages = settings.extra["quart"]["stages"]
    hidden = BERT_CONFIGS[MODEL].hidden_size
    transfer = Transfer.from_profile(Path(__file__).parent / "profiles" / "ray-transfer.json",
                                     lambda b: b.cell.batch * max(b.cell.seq, 1) * hidden * 4.0)
    priced = policy.cost
    if ratios is not None:
        transfer = None
        priced = CostModel({**priced.latency, **{s.label(): LatencyProfile(s.label(), {
            c: t * ratios[s.label()] for c, t in priced.latency[s.label()].seconds.items()}) for s in stages}},
            priced.accuracy, priced.machine)
    trace = traces.make_trace(times, model=MODEL, length=lengths, slo_s=SLO_MS / 1e3)
    result = simulate(policy, trace, priced, instances=len(stages),
                      holdings={i: frozenset({s}) for i, s in enumerate(stages)}, transfer=transfer,
                      load_time=policy.planned_load_seconds, seed=seed)
    done = result.completed()
    lat = (result.finish - result.arrival) * 1e3
    return {"latency_ms": lat, "done": done, "loads": [e for e in policy.events if e[1] == "load"],
            "max_replicas": max((sum(r) for _, r in policy.replica_log), default=len(stages))}


def stage_ratios(m: dict[str, float]) -> dict[str, float]:
    """Stage label -> live busy / priced seconds over the run (the policy's StageTotals, /metrics)."""
    out = {}
    for k, busy in m.items():
        if k.startswith("jaxserve_policy_quart_stage_busy_seconds{"):
            label = k.split('stage="')[1].split('"')[0]
            priced = m.get(f'jaxserve_policy_quart_stage_priced_seconds{{stage="{label}"}}', 0.0)
            out[label] = busy / priced if priced > 0 else 1.0
    return dict(sorted(out.items()))


def _stats(ms: np.ndarray) -> tuple[float, float]:
    return (float(np.mean(ms)), float(np.percentile(ms, 98))) if len(ms) else (float("nan"), float("nan"))


def run(args) -> tuple[str, str]:
    """``--rounds`` rounds; in each, one schedule (three Poisson phases) is sent to a fresh server
    with the cache on and one with it off, in an order alternating by round, so each comparison is
    of the same requests.

    Decisions. *SLO* 1 s for every request (:data:`SLO_MS`: why not the server's default), the
    target QUART's Corrector divides among the stages. *Load*: fractions of the whole model's
    capacity at batch 8 and bucket 64 as the server's own start-up profile prices it (the stages
    are priced at their third of it, so the pipeline's priced capacity is 3x that on 3 free
    workers; on these 2 shared cores it is far less, and the burst queues). *Latency* is the
    server's (``meta.latency_ms``, arrival stamp to answer), by phase of the request's send
    time. *Replica loads*: ``/metrics`` at the end of the run: the policy's planned sources
    (``jaxserve_policy_quart_loads``) and each new worker's load seconds as its actor timed it
    (``jaxserve_stage_load_seconds``, workers beyond the first three). *Simulator*: the same
    schedule and token lengths, the policy built as the server builds it with the server's cost
    model: once as it is (stage prices are the profile's shares, the Ray hop added between
    stages), once with each stage's steps at the ratio of busy to priced seconds the live policy
    counted in the other round of the same arm (``StageTotals``: held out).
    New replicas' loads are priced by :class:`jaxserve.sched.quart.LoadModel` in both."""
    import asyncio
    import time

    from bench.common import scrape, table
    from bench.load import open_loop, start, stop
    from jaxserve.profiler import load_cost_model

    url = f"http://127.0.0.1:{args.port}"
    texts, lengths = tweets_that_fit(max(BUCKETS))
    rng = np.random.default_rng(5)
    cost_path = Path(args.cache_dir) / "cost_model.json"
    rows = []
    t_start = time.perf_counter()
    for rnd in range(args.rounds):
        order = ARMS if rnd % 2 == 0 else ARMS[::-1]
        for arm, label in order:
            cmd = [sys.executable, "-m", "jaxserve.cli", "serve", *serve_flags(arm), "--cache-dir", args.cache_dir,
                   "--max-queue", "4096", "--port", str(args.port)]
            proc = start(cmd, url, log=args.log)
            try:
                cost = load_cost_model(cost_path)
                rate = max(BATCHES) / cost.latency[MODEL].latency_for(max(BATCHES), max(BUCKETS))
                times, phase = schedule(rate, seed=rnd, scale=args.scale)
                pick = rng.integers(0, len(texts), len(times))
                with MetricsSampler(url, "jaxserve_policy_quart_ready_replicas", "jaxserve_policy_quart_queued",
                                    every=0.25) as sampler:
                    res = asyncio.run(open_loop(url, times, [texts[i] for i in pick], None))
                m = scrape(url, "jaxserve_policy_quart_", "jaxserve_compilations_since_ready",
                           "jaxserve_stage_load_seconds")
            finally:
                stop(proc)
            sim = simulated(arm, cost, times, lengths[pick], seed=rnd)
            ready = [(t, sum(v for k, v in mm.items() if "ready_replicas" in k)) for t, mm in sampler.rows]
            first = next((t for t, n in ready if n > STAGES), None)
            loads = sorted(v for k, v in m.items() if k.startswith("jaxserve_stage_load_seconds")
                           and int(k.split('worker="')[1].split('"')[0]) >= STAGES)
            srv = res.server_ms
            by_phase = {k: srv[phase[res.answered] == k] for k in range(len(PHASES))}
            attained = {k: float((by_phase[k] <= SLO_MS).sum() / max(1, (phase == k).sum())) for k in by_phase}
            sim_ok = sim["done"] & (sim["latency_ms"] <= SLO_MS)
            sim_attained = {k: float(sim_ok[phase == k].sum() / max(1, (phase == k).sum())) for k in by_phase}
            sim_phase = {k: sim["latency_ms"][sim["done"] & (phase == k)] for k in range(len(PHASES))}
            row = {"round": rnd + 1, "arm": arm, "label": label, "rate": rate, "sent": res.sent, "ok": res.ok,
                   "late": res.late, "evicted": res.evicted, "refused": res.rejected, "errors": res.errors,
                   "phases": {k: _stats(v) for k, v in by_phase.items()}, "all": _stats(srv),
                   "attained": attained, "sim_attained": sim_attained,
                   "sim_phases": {k: _stats(v) for k, v in sim_phase.items()},
                   "sim_all": _stats(sim["latency_ms"][sim["done"]]),
                   "planned": {s: m.get(f'jaxserve_policy_quart_loads{{source="{s}"}}', 0.0)
                               for s in ("cache", "page", "cold")},
                   "sim_loads": len(sim["loads"]), "load_s": loads, "first_ready_s": first,
                   "max_ready": max((n for _, n in ready), default=STAGES),
                   "compiles": m.get("jaxserve_compilations_since_ready", 0.0),
                   "ratios": stage_ratios(m), "_trace": (times, lengths[pick], phase)}
            rows.append(row)
            print(f"round {rnd + 1} {label}: rate unit {rate:.1f} req/s, sent {res.sent}, mean/p98 by phase "
                  + "; ".join(f"{a:.0f}/{b:.0f}" for a, b in row["phases"].values())
                  + " ms (sim " + "; ".join(f"{a:.0f}/{b:.0f}" for a, b in row["sim_phases"].values())
                  + f"), planned loads {row['planned']}, replica load s {[round(x, 3) for x in loads]}, first "
                  f"replica ready at {first}, max ready {row['max_ready']}, compiles {row['compiles']:.0f}",
                  flush=True)
    # the simulator again, each stage's steps at the busy / priced ratio measured live in the other
    # round of the same arm (held out; with one round, its own)
    for r in rows:
        same = [x for x in rows if x["arm"] == r["arm"]]
        other = next((x for x in same if x["round"] != r["round"]), r)
        times, lens, phase = r["_trace"]
        cal = simulated(r["arm"], load_cost_model(cost_path), times, lens, seed=r["round"], ratios=other["ratios"])
        r["cal_all"] = _stats(cal["latency_ms"][cal["done"]])
        r["cal_phases"] = {k: _stats(cal["latency_ms"][cal["done"] & (phase == k)]) for k in range(len(PHASES))}
        r["held_out"] = other is not r
    header = ["round", "arm", "requests", "SLO att. base / burst / after", "sim", "mean / p98 ms, base", "burst",
              "after", "sim: base", "burst", "after",
              "sim at live step times: base", "burst", "after", "live / sim mean, p98 (all)",
              "live / sim at live step times", "live step time / price per stage",
              "replica loads planned (cache / page / cold)", "replica load s (live)",
              "first replica ready at s", "most ready workers", "late/evicted/429/errors", "compiles after ready"]
    out = []
    for r in rows:
        ph, sp, cp = r["phases"], r["sim_phases"], r["cal_phases"]
        out.append([r["round"], r["label"], f"{r['sent']:,}",
                    " / ".join(f"{r['attained'][k]:.3f}" for k in range(len(PHASES))),
                    " / ".join(f"{r['sim_attained'][k]:.3f}" for k in range(len(PHASES))),
                    *(f"{ph[k][0]:.0f} / {ph[k][1]:.0f}" for k in range(len(PHASES))),
                    *(f"{sp[k][0]:.0f} / {sp[k][1]:.0f}" for k in range(len(PHASES))),
                    *(f"{cp[k][0]:.0f} / {cp[k][1]:.0f}" for k in range(len(PHASES))),
                    f"{r['all'][0] / r['sim_all'][0]:.2f}x, {r['all'][1] / r['sim_all'][1]:.2f}x",
                    f"{r['all'][0] / r['cal_all'][0]:.2f}x, {r['all'][1] / r['cal_all'][1]:.2f}x"
                    + ("" if r["held_out"] else " (own)"),
                    ", ".join(f"x{v:.1f}" for v in r["ratios"].values()),
                    " / ".join(f"{r['planned'][s]:.0f}" for s in ("cache", "page", "cold")),
                    ", ".join(f"{x:.2f}" for x in r["load_s"]) or "-",
                    "-" if r["first_ready_s"] is None else f"{r['first_ready_s']:.1f}", f"{r['max_ready']:.0f}",
                    f"{r['late']}/{r['evicted']}/{r['refused']}/{r['errors']}", f"{r['compiles']:.0f}"])
    text = table(header, out)
    on = [x for r in rows if r["arm"] == "on" for x in r["load_s"]]
    off = [x for r in rows if r["arm"] == "off" for x in r["load_s"]]
    phases = ", ".join(f"{s * args.scale:.0f} s" for s, _ in PHASES)
    notes = (f"`jaxserve serve {' '.join(serve_flags('on|off'))}` "
             f"(MiniLM-L6, real weights), a fresh server per run, its cost model "
             f"profiled at its first start on this machine. Open loop: Poisson at {BASE}x / {BURST}x / {BASE}x the "
             f"whole "
             f"model's priced capacity at batch 8 ({phases}), real tweets of <= {max(BUCKETS)} tokens to "
             f"/v1/embeddings; latency (of answered requests) and SLO attainment (answered within the SLO over "
             f"sent: late and evicted requests miss) by the phase of each request's send time. Replica "
             f"loads (workers beyond the first {STAGES}): median {np.median(on) if on else float('nan'):.2f} s with "
             f"the "
             f"cache (n={len(on)}), {np.median(off) if off else float('nan'):.2f} s without (n={len(off)}). "
             f"Whole run: {time.perf_counter() - t_start:.0f} s. The script's `run` docstring has the decisions.")
    return text, notes


def main() -> None:
    from bench.common import add_quick, apply_quick, record

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=8031)
    ap.add_argument("--cache-dir", default=str(CACHE))
    ap.add_argument("--log", default=None, help="append the servers' output to this file")
    ap.add_argument("--scale", type=float, default=1.0, help="each phase's length times this")
    ap.add_argument("--write", action="store_true")
    add_quick(ap, rounds=1, scale=0.1)
    args = apply_quick(ap.parse_args())
    text, notes = run(args)
    print(text)
    print(notes)
    if args.write:
        record("quart_live", "QUART live: key-stage replicas from the parameter cache vs from disk, and the simulator",
               text, notes)


if __name__ == "__main__":
    main()
