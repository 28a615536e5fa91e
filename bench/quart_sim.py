"""QUART against INFless-, InferLine- and Cocktail-like scaling, simulated at the paper's scale.

The cluster of §8.1: 24 servers, of which the 12 GPU servers (4 accelerators each, one worker
per accelerator: 48 workers at most) run model stages; the 12 CPU servers run the gateway and
middleware, which the simulator does not model. The model: BERT-base priced by this machine's
profile (bench/profiles/bert-base-cpu.json, sequence bucket 128, batch 1/2/4). BERT's 12
layers are identical, so each layer costs 1/12 of the whole model's step (embeddings and
pooler are not profiled apart: assumed inside the layers' share); :func:`cut_stages` cuts them
into 8 stages (four of 2 layers, four of 1: the 2-layer stages are the slow ones). Parameters
per stage (:func:`jaxserve.launch.quart_stage_megabytes`, float32): 28.4 MB per layer, plus
95 MB of embeddings on the first; the whole model 436 MB. Activations move between stages at the
Ray hop bench/workers.py measured (bench/profiles/ray-transfer.json) with
``batch x 128 x 768`` float32 hidden states. Load times: :class:`jaxserve.sched.quart.LoadModel`
(its docstring: object store 12 ms / 92 MB, page-cache pickle 85 ms / 92 MB, cold disk
200 MB/s assumed, a new Ray actor 2.57 s and its executables 2.77 s as measured here).

Every policy starts from one replica (the pipelines: one per stage; the whole-model
baselines: one), as §8.3 sets "the initial replicas for all scaling to 1"; the pipelines'
stages start one per server (§6.2 keeps accelerators free next to each stage; the baselines
have no cache, so where they start does not matter to them). QUART's cache starts with each
initially placed stage on its server. The SLO the policies plan with is 2x the profiled
inference time (the whole model, batch 1: 114.5 ms);
requests are never evicted (a lenient SLO, §8.3), so latency counts every request.

Workloads:

* **Azure-Functions-shaped** (the MAF trace cannot be fetched): 5 s bins standing for the
  trace's one-minute bins; a mean rate of ``--rate`` req/s times a diurnal wave (amplitude
  0.5, one period over the run), times a log-normal per-bin factor (sigma 0.4), times 4 in
  10% of the bins (bursts); gamma inter-arrivals with CV 1.5 inside a bin. These follow the
  published characterisation (Shahrad et al., ATC'20): invocation rates vary over the day
  and minute to minute, and most functions' inter-arrival CV exceeds 1.
* **CV sweep**: gamma inter-arrivals at ``--rate`` req/s with CV 0.1, 1, 2, 4, 8 (§8.3).

Why several Azure seeds: the trace's x4 bursts fill all 48 workers, and once the cluster is
full, which stage is left short decides the mean, so one trace's outcome turns on small
differences (a seed, a load time). The Azure comparison is reported per seed
(``--azure-seeds``); the headline table is the first seed's.

Fitting (``--fit``): the CV-propagation model (:class:`CvPropagation`) is fitted on the
measured arrival CV of every stage of the static pipeline (one replica per stage, no
scaling), at input CV 0.1-8 and 30-90% of the slowest stage's capacity; the fit is used by
QUART in the runs below, and the measured CV per stage for input CV 0.1 and 4 is the
paper's Fig. 3 question.

    python -m bench.quart_sim [--rate 100] [--duration 120] [--write]
"""

from __future__ import annotations

# What its numbers measure and the runs that write its sections (bench/common.py: declarations).
MEASURES = (
    "bench/quart_sim.py", "jaxserve/sched/quart.py", "jaxserve/sched/pipeline.py", "jaxserve/simulator.py",
    "jaxserve/sched/base.py", "jaxserve/traces.py", "bench/profiles/bert-base-cpu.json",
    "bench/profiles/ray-transfer.json", "jaxserve/launch.py",
)
SECTIONS = {"quart_sim": "--write"}

import argparse
import math
import time
from pathlib import Path

import numpy as np

from bench.common import PLOTS, add_quick, apply_quick, record, save_plot, table
from jaxserve.sched.base import Cell, CostModel, LatencyProfile, ShapeGrid, Stage
from jaxserve.sched.quart import (CocktailLike, CpuCompensator, CvPropagation, InferlineLike, InflessLike,
                                  LoadModel, ParameterCache, QuartPolicy, ScalingPipeline, Server, cut_stages,
                                  stage_cost_model)
from jaxserve.simulator import Transfer, simulate
from jaxserve import traces
from jaxserve.launch import quart_stage_megabytes

BENCH = Path(__file__).resolve().parent
MODEL, LAYERS, SEQ, HIDDEN = "bert-base", 12, 128, 768
SERVERS = [Server(i, 4, cache_mb=1024 * 1024.0) for i in range(12)]  # the 12 GPU servers
CVS = (0.1, 1.0, 2.0, 4.0, 8.0)
SLO_MULTIPLES = (1.0, 1.5, 2.0, 2.5, 3.0)
POLICIES = ("quart", "infless", "inferline", "cocktail")
PAPER = {  # §8.2-8.3
    "mean latency vs INFless": "-87.1%", "mean latency vs InferLine": "-70.5%", "mean latency vs Cocktail": "-36.7%",
    "SLO satisfaction at 1.5x": "47.5% (2.19x, 2.37x, 2.09x the baselines)",
    "mean latency over the CV sweep": "-69.8%, -77.2%, -47.8% (vs INFless, InferLine, Cocktail)",
    "goodput over the CV sweep": "13.5x, 14.4x, 2.3x",
}


def setup():
    raw = CostModel.from_json((BENCH / "profiles" / "bert-base-cpu.json").read_text())
    cells = {c: t for c, t in raw.latency[MODEL].seconds.items() if c.seq == SEQ}
    stages = cut_stages(MODEL, [1.0] * LAYERS, 8)
    cost = stage_cost_model(CostModel({MODEL: LatencyProfile(MODEL, cells)}, machine=raw.machine), MODEL, stages)
    grid = {MODEL: ShapeGrid(tuple(sorted({c.batch for c in cells})), (SEQ,))}
    mb = quart_stage_megabytes(MODEL, stages)
    whole_stage = Stage(MODEL, 0, LAYERS, LAYERS)
    transfer = Transfer.from_profile(BENCH / "profiles" / "ray-transfer.json",
                                     lambda b: b.cell.batch * SEQ * HIDDEN * 4.0)
    t_profile = cells[Cell(1, SEQ)]
    return cost, grid, stages, whole_stage, mb, transfer, t_profile


def azure_arrivals(rate: float, duration: float, seed: int) -> np.ndarray:
    """The Azure-Functions-shaped trace of the module docstring."""
    rng = np.random.default_rng(seed)
    bin_s = 5.0
    nb = int(math.ceil(duration / bin_s))
    t = (np.arange(nb) + 0.5) * bin_s
    factor = (1 + 0.5 * np.sin(2 * np.pi * t / duration)) * rng.lognormal(-0.08, 0.4, nb)
    factor *= np.where(rng.random(nb) < 0.1, 4.0, 1.0)
    factor *= 1.0 / factor.mean()
    out = []
    for k in range(nb):
        a = traces.gamma_arrivals(rate * factor[k], 1.5, seed=rng, duration=bin_s)
        out.append(k * bin_s + a)
    return np.sort(np.concatenate(out))


def make_policy(name, cost, grid, stages, whole, mb, transfer, t_profile, rate, cv, cv_model=None,
                record_arrivals=False):
    slo = 2.0 * t_profile
    hop = transfer.hop_latency
    if name in ("infless", "cocktail"):
        cls = InflessLike if name == "infless" else CocktailLike
        return cls({MODEL: (whole,)}, grid, cost, SERVERS, {0: 0}, mb), {0: frozenset({whole})}
    placement = {i: i for i in range(len(stages))}  # §6.2: one per server, room for key stages to grow
    holdings = {i: frozenset({s}) for i, s in enumerate(stages)}
    kw = dict(max_replicas=48, record_arrivals=record_arrivals)
    if name == "static":
        return ScalingPipeline({MODEL: stages}, grid, cost, SERVERS, placement, mb, **kw), holdings
    if name == "inferline":
        return InferlineLike({MODEL: stages}, grid, cost, SERVERS, placement, mb, slo_s=slo, planned_rate=rate,
                             planned_cv=min(cv, 2.0), hop_s=hop, **kw), holdings
    cache = ParameterCache(SERVERS)
    for i, s in enumerate(stages):
        cache.insert(placement[i], s, mb[s])
    mu = 1.0 / cost.latency[stages[0].label()].latency(Cell(1, SEQ))
    cpu = CpuCompensator(cpu_share=0.2).fit(mu, slo / len(stages))
    return QuartPolicy({MODEL: stages}, grid, cost, SERVERS, placement, mb, slo_s=slo, hop_s=hop, cache=cache,
                       cv_model=cv_model, cpu=cpu, **kw), holdings


def run(name, arrivals, setup_, rate, cv, cv_model=None, record_arrivals=False, seed=0):
    cost, grid, stages, whole, mb, transfer, t_profile = setup_
    policy, holdings = make_policy(name, cost, grid, stages, whole, mb, transfer, t_profile, rate, cv, cv_model,
                                   record_arrivals)
    trace = traces.make_trace(arrivals, model=MODEL, length=SEQ, slo_s=math.inf)
    t0 = time.process_time()
    r = simulate(policy, trace, cost, instances=len(holdings), holdings=holdings, transfer=transfer,
                 load_time=policy.planned_load_seconds, latency_noise=0.1, seed=seed)
    return policy, r, time.process_time() - t0


def metrics(policy, r, t_profile):
    lat = r.latencies()
    sat = {k: float(np.mean(lat <= k * t_profile)) for k in SLO_MULTIPLES}
    queues = np.array([q for _, q in policy.queue_log], dtype=float)
    reps = np.array([q for _, q in policy.replica_log], dtype=float)
    return {
        "mean": float(lat.mean()), "p75": float(np.percentile(lat, 75)), "p99": float(np.percentile(lat, 99)),
        "sat": sat, "goodput": float(np.sum(lat <= 2.0 * t_profile)) / r.span(),
        "queue": queues.mean(axis=0) if len(queues) else np.zeros(1),
        "replicas": reps.mean(axis=0) if len(reps) else np.zeros(1),
        "max_workers": int(reps.sum(axis=1).max()) if len(reps) else 0,
        "loads": sum(1 for e in policy.events if e[1] == "load"),
        "cache_loads": sum(1 for e in policy.events if e[1] == "load" and e[4] == "cache"),
    }


def stage_cvs(policy) -> list[float]:
    out = []
    for s in policy.stages:
        t = np.sort(np.asarray(policy.arrival_times[s]))
        g = np.diff(t)
        out.append(float(g.std() / g.mean()) if len(g) > 2 and g.mean() > 0 else math.nan)
    return out


def fit_cv(setup_, duration, seed):
    """The CV-propagation fit of the module docstring; returns (model, samples, fig3 rows)."""
    cost, grid, stages, *_ = setup_
    cap = 4 / cost.latency[max(stages, key=lambda s: s.stop - s.start).label()].latency(Cell(4, SEQ))
    samples, fig3 = [], {}
    for cv in (0.1, 0.5, 1.0, 2.0, 4.0, 8.0):
        for util in (0.3, 0.6, 0.9):
            rate = util * cap
            arr = traces.gamma_arrivals(rate, cv, seed=seed + int(cv * 10) + int(util * 100), duration=duration)
            policy, r, _ = run("static", arr, setup_, rate, cv, record_arrivals=True)
            cvs = stage_cvs(policy)
            for i, s in enumerate(stages[:-1]):
                busy = cost.latency[s.label()].latency(Cell(1, SEQ)) * rate  # upstream utilisation at batch 1
                samples.append((cvs[i], min(busy, 1.0), 1, cvs[i + 1]))
            if util == 0.6 and cv in (0.1, 4.0):
                fig3[cv] = cvs
    model = CvPropagation.fit(samples)
    pred = [model.predict(a, b, c) for a, b, c, _ in samples]
    err = float(np.mean([abs(p - y) / max(y, 1e-9) for p, (*_, y) in zip(pred, samples)]))
    return model, samples, fig3, err


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--fit-duration", type=float, default=40.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cvs", default=",".join(str(c) for c in CVS))
    ap.add_argument("--azure-seeds", type=int, default=5,
                    help="Azure-shaped traces (seeds --seed, --seed+1, ...) each policy runs: one trace's outcome "
                         "turns on which stage a full cluster starves (see the module docstring)")
    ap.add_argument("--write", action="store_true")
    add_quick(ap, duration=20.0, fit_duration=10.0, cvs="1,4", azure_seeds=2)
    args = apply_quick(ap.parse_args())
    cvs = tuple(float(c) for c in args.cvs.split(","))
    setup_ = setup()
    t_profile = setup_[-1]
    cpu0 = time.process_time()

    cv_model, samples, fig3, fit_err = fit_cv(setup_, args.fit_duration, args.seed)
    print(f"CV fit: w = ({cv_model.w0:.3f}, {cv_model.w1:.3f}, {cv_model.w2:.3f}), "
          f"mean relative error {fit_err:.1%} over {len(samples)} stage pairs", flush=True)

    results: dict[tuple[str, str], dict] = {}
    workloads = [("azure", azure_arrivals(args.rate, args.duration, args.seed), 1.5)]
    workloads += [(f"azure-s{args.seed + k}", azure_arrivals(args.rate, args.duration, args.seed + k), 1.5)
                  for k in range(1, args.azure_seeds)]
    workloads += [(f"cv{cv:g}", traces.gamma_arrivals(args.rate, cv, seed=args.seed + 7, duration=args.duration), cv)
                  for cv in cvs]
    for wname, arr, cv in workloads:
        for name in POLICIES:
            policy, r, cpu = run(name, arr, setup_, args.rate, cv, cv_model)
            m = metrics(policy, r, t_profile)
            m["cpu_s"] = cpu
            m["n"] = len(r)
            results[(wname, name)] = m
            print(f"{wname:6s} {name:9s} n={len(r)} mean={m['mean']*1e3:8.1f} ms p99={m['p99']*1e3:9.1f} ms "
                  f"sat1.5={m['sat'][1.5]:.3f} goodput={m['goodput']:.1f}/s workers<={m['max_workers']} "
                  f"loads={m['loads']} (cache {m['cache_loads']}) cpu={cpu:.1f}s", flush=True)
    total_cpu = time.process_time() - cpu0

    body, notes = report(results, cvs, fig3, cv_model, fit_err, len(samples), t_profile, args, total_cpu)
    plots(results, cvs, fig3, t_profile)
    print(body)
    if args.write:
        record("quart_sim", "QUART (simulated at the paper's scale): key stages against INFless, InferLine, Cocktail",
               body, notes)


def _pct(a, b):
    return f"{(a / b - 1) * 100:+.1f}%"


def report(results, cvs, fig3, cv_model, fit_err, n_samples, t_profile, args, total_cpu):
    names = {"quart": "QUART", "infless": "INFless-like", "inferline": "InferLine-like", "cocktail": "Cocktail-like"}
    rows = []
    for name in POLICIES:
        m = results[("azure", name)]
        rows.append([names[name], f"{m['mean']*1e3:.1f}", f"{m['p75']*1e3:.1f}", f"{m['p99']*1e3:.1f}",
                     *[f"{m['sat'][k]:.3f}" for k in SLO_MULTIPLES], f"{m['goodput']:.1f}",
                     f"{m['max_workers']}", f"{m['loads']} ({m['cache_loads']})"])
    azure = table(["policy", "mean ms", "p75 ms", "p99 ms", *[f"SLO {k:g}x" for k in SLO_MULTIPLES],
                   "goodput /s (2x)", "max workers", "loads (from cache)"], rows)
    q = results[("azure", "quart")]
    head = []
    for name in ("infless", "inferline", "cocktail"):
        b = results[("azure", name)]
        gp = [results[(f"cv{cv:g}", "quart")]["goodput"] / max(results[(f"cv{cv:g}", name)]["goodput"], 1e-9)
              for cv in cvs]
        lat = [results[(f"cv{cv:g}", "quart")]["mean"] / results[(f"cv{cv:g}", name)]["mean"] - 1 for cv in cvs]
        head.append([names[name], _pct(q["mean"], b["mean"]),
                     PAPER[f"mean latency vs {names[name].split('-')[0]}"],
                     f"{q['sat'][1.5]:.3f} ({q['sat'][1.5] / max(b['sat'][1.5], 1e-9):.2f}x)",
                     f"{np.mean(lat)*100:+.1f}%", f"{np.mean(gp):.2f}x"])
    headline = table(["QUART against", "mean latency (Azure)", "paper", "QUART SLO 1.5x (ratio)",
                      "mean latency, CV sweep avg", "goodput ratio, CV sweep avg"], head)
    seeds = [args.seed + k for k in range(args.azure_seeds)]
    wl = ["azure" if k == 0 else f"azure-s{args.seed + k}" for k in range(args.azure_seeds)]
    seed_rows = []
    for name in POLICIES:
        means = [results[(w, name)]["mean"] * 1e3 for w in wl]
        row = [names[name], *(f"{m:.0f}" for m in means), f"{np.median(means):.0f}"]
        if name != "quart":
            ratios = [results[(w, "quart")]["mean"] / results[(w, name)]["mean"] for w in wl]
            row.append(f"{np.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}), lower in "
                       f"{sum(r < 1 for r in ratios)}/{len(ratios)}")
        else:
            row.append("-")
        seed_rows.append(row)
    by_seed = table(["policy", *(f"seed {sd}: mean ms" for sd in seeds), "median",
                     "QUART / policy, per-seed median (range)"], seed_rows)
    full = [results[(w, "quart")]["max_workers"] for w in wl]
    sweep_rows = []
    for cv in cvs:
        row = [f"{cv:g}"]
        for name in POLICIES:
            m = results[(f"cv{cv:g}", name)]
            row.append(f"{m['mean']*1e3:.0f} / {m['p99']*1e3:.0f} / {m['goodput']:.1f}")
        sweep_rows.append(row)
    sweep = table(["input CV", *[f"{names[n]}: mean ms / p99 ms / goodput" for n in POLICIES]], sweep_rows)
    qrows = []
    for wname in ("azure", *(f"cv{cv:g}" for cv in cvs if cv in (1.0, 4.0))):
        for name in POLICIES:
            m = results[(wname, name)]
            qrows.append([wname, names[name], " ".join(f"{x:.1f}" for x in m["queue"]),
                          " ".join(f"{x:.1f}" for x in m["replicas"])])
    queues = table(["workload", "policy", "mean queue per stage (sampled each 1 s)", "mean replicas per stage"],
                   qrows)
    cvrows = [[f"{cv:g}", " ".join(f"{x:.2f}" for x in fig3[cv])] for cv in sorted(fig3)]
    cvtab = table(["input CV", "measured arrival CV, stages 1-8"], cvrows)
    paper = table(["claim (paper)", "value"], [[k, v] for k, v in PAPER.items()])
    body = "\n\n".join([
        f"Azure-Functions-shaped trace, {results[('azure', 'quart')]['n']:,} requests at {args.rate:g} req/s mean "
        f"over {args.duration:g} s; SLO multiples of the profiled inference time {t_profile*1e3:.1f} ms:",
        azure,
        f"The same Azure-shaped workload over {len(seeds)} trace seeds (the table above is seed {args.seed}'s); QUART "
        f"held {min(full)}-{max(full)} of the 48 workers at its peak:", by_seed,
        "Headline against the paper (seed 0's trace; the per-seed table above says how far one trace carries):",
        headline, paper,
        f"CV sweep ({args.rate:g} req/s, gamma inter-arrivals):", sweep,
        "Queues and replicas per stage (the whole-model baselines have one stage):", queues,
        f"CV per stage on the static 8-stage pipeline at 60% of its slowest stage's capacity (Fig. 3):", cvtab,
    ])
    lm = LoadModel()
    notes = (
        f"Model: {MODEL} from bench/profiles/bert-base-cpu.json (this machine's CPU profile), cut into 8 stages by "
        f"equal layer costs (layers per stage {[s.stop - s.start for s in setup()[2]]}). 48 workers at most (12 "
        "servers x 4 accelerators). QUART plans with the SLO 2x the profiled time; goodput counts answers within "
        f"2x per second of the run. Load times: LoadModel's defaults (cache {lm.cache_fixed_s:g} s + "
        f"{lm.cache_s_per_mb * 92e3:.1f} ms/92 MB; disk: {lm.actor_start_s:g} s actor + {lm.executables_s:g} s "
        f"executables + {lm.page_s_per_mb * 92e3:.0f} ms/92 MB warm or {lm.cold_disk_mb_per_s:g} MB/s cold: the "
        "cache and restore rates measured in section quart_cache). CPU compensation prices 20% of a step as CPU "
        "work scaling with cores (an assumption, not measured here). "
        f"CV propagation fitted on {n_samples} stage pairs: cv_out^2 = {cv_model.w0:.3f} + {cv_model.w1:.3f} "
        f"(1 - rho^2) cv_in^2 + {cv_model.w2:.3f} rho^2, mean relative error {fit_err:.1%}. "
        "Latency noise: log-normal sigma 0.1 per step. Everything is simulated (no Ray, no accelerators); the live "
        "KeysManager cache and its measured load times are the rest of issue 20. "
        f"Whole experiment: {total_cpu:.0f} s of CPU. Plots: bench/plots/quart_*.png."
    )
    return body, notes


def plots(results, cvs, fig3, t_profile):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {"quart": "QUART", "infless": "INFless-like", "inferline": "InferLine-like", "cocktail": "Cocktail-like"}
    for key, label, fname in (("mean", "mean latency (s)", "quart_cv_latency.png"),
                              ("goodput", "goodput (req/s within 2x)", "quart_cv_goodput.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name in POLICIES:
            ax.plot(cvs, [results[(f"cv{cv:g}", name)][key] for cv in cvs], marker="o", label=names[name])
        ax.set_xscale("log")
        ax.set_xlabel("input CV")
        ax.set_ylabel(label)
        if key == "mean":
            ax.set_yscale("log")
        save_plot(fig, ax, PLOTS / fname)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in POLICIES:
        m = results[("azure", name)]
        ax.plot(SLO_MULTIPLES, [m["sat"][k] for k in SLO_MULTIPLES], marker="o", label=names[name])
    ax.set_xlabel("SLO (x profiled inference time)")
    ax.set_ylabel("SLO satisfaction")
    save_plot(fig, ax, PLOTS / "quart_slo.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for cv in sorted(fig3):
        ax.plot(range(1, len(fig3[cv]) + 1), fig3[cv], marker="o", label=f"input CV {cv:g}")
    ax.set_xlabel("stage")
    ax.set_ylabel("arrival CV")
    save_plot(fig, ax, PLOTS / "quart_stage_cv.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("quart", "inferline"):
        q = results[("azure", name)]["queue"]
        ax.plot(range(1, len(q) + 1), q, marker="o", label=names[name])
    ax.set_xlabel("stage")
    ax.set_ylabel("mean queue (requests)")
    save_plot(fig, ax, PLOTS / "quart_queues.png")


if __name__ == "__main__":
    main()
