"""AsyFunc live on this machine (issue 21, experiment 3): one body and its shadow as Ray actors under
bursts, against BATCH and AsyFunc⁻ on the same two cores, and the same trace through the simulator.

``jaxserve serve --workers ray --policy P`` (MiniLM-L6, real weights, the committed layer profile
``bench/profiles/asyfunc-cost.layers.json``), real tweets that fit the profile's bucket over HTTP on
127.0.0.1, open loop on an MMPP schedule; :func:`run`'s docstring has the decisions.

    python -m bench.asyfunc_live [--rounds 3] [--seconds 60] [--write]
"""

from __future__ import annotations

MEASURES = (
    "bench/asyfunc_live.py", "bench/load.py", "bench/httpload.py", "bench/profiles/asyfunc-live.layers.json",
    "jaxserve/layer_profile.py",
    "jaxserve/sched/asyfunc.py", "jaxserve/asyfunc_exec.py", "jaxserve/launch.py", "jaxserve/engine.py",
    "jaxserve/ray_workers.py", "jaxserve/workers.py", "jaxserve/stages.py", "jaxserve/simulator.py",
    "jaxserve/keys_manager.py", "serving", "jaxserve/polymorph.py", "jaxserve/models", "jaxserve/servables.py",
    "jaxserve/compile_cache.py", "jaxserve/runtime.py",
)
SECTIONS = {"asyfunc_live": "--write"}

import argparse
import sys
from pathlib import Path

import numpy as np

from bench.common import MetricsSampler

MODEL = "minilm-l6"
# measured by the wall clock on this machine while quiet (jaxserve profile --layers --clock wall --out
# bench/profiles/asyfunc-live.json): what a worker pinned to c cores takes (the simulated cluster's
# asyfunc-cost profile is CPU time over cores, taken on shared cores)
LAYERS = Path(__file__).parent / "profiles" / "asyfunc-live.layers.json"
CACHE = Path("compiled_cache") / "asyfunc_live"
NODE_CORES = 2
PERIOD_S = 30.0
# (policy, label, cores of the body it starts with): AsyFunc and AsyFunc⁻ start one 1-core body and may
# add a 1-core shadow or body; BATCH's one configuration is c_max = 2 cores
POLICIES = (("asyfunc", "AsyFunc", 1), ("asyfunc-nolls", "AsyFunc⁻", 1), ("asyfunc-batch", "BATCH", 2))
BASE, BURST = 0.15, 0.6  # MMPP rates, as fractions of BATCH's Eq. 1 rate (its body's max b / t within the SLO)
SLO_MS = 250.0  # run's docstring: why not the default
MEANS = (8.0, 2.0)  # mean seconds in the base and the burst state


def settings_for(policy: str, body_cores: int):
    from jaxserve.launch import ServeSettings

    return ServeSettings(models=(MODEL,), policy=policy, workers="ray", layer_profile=str(LAYERS), slo_ms=SLO_MS,
                         asyfunc_node_cores=NODE_CORES, asyfunc_body_cores=body_cores, asyfunc_period_s=PERIOD_S)


def planned(policy: str, body_cores: int):
    """A fresh policy exactly as the live server builds it (the simulator runs this one)."""
    from jaxserve.launch import make_asyfunc_policy, with_asyfunc

    return make_asyfunc_policy(with_asyfunc(settings_for(policy, body_cores)), {})


def tweets_that_fit(seq: int) -> list[str]:
    """Real tweets whose tokens fit the profile's bucket (longer ones would be refused, 413)."""
    from jaxserve.datasets import load_tweets
    from jaxserve.models.tokenizer import TextTokenizer
    from jaxserve.registry import minilm_dir

    texts, _ = load_tweets()
    tok = TextTokenizer(minilm_dir() / "tokenizer.json")
    return [t for t, ids in zip(texts, tok.encode(texts)) if len(ids) <= seq]


class Sampler(MetricsSampler):
    """Samples the policy's held cores and parameter bytes, and its measured prices (scale,
    per-step overhead, spread), from /metrics every ``every`` seconds."""

    def __init__(self, url: str, every: float = 0.5):
        super().__init__(url, "jaxserve_policy_asyfunc_cores", "jaxserve_policy_asyfunc_param_bytes",
                         "jaxserve_policy_asyfunc_measured_", every=every)

    @property
    def table(self) -> list[tuple]:
        """(t, cores, bytes, scale, overhead s, steps, sigma) per sample."""
        out = []
        for t, m in self.rows:
            out.append((t, sum(v for k, v in m.items() if k.startswith("jaxserve_policy_asyfunc_cores")),
                        sum(v for k, v in m.items() if k.startswith("jaxserve_policy_asyfunc_param_bytes")),
                        m.get("jaxserve_policy_asyfunc_measured_scale", 1.0),
                        m.get("jaxserve_policy_asyfunc_measured_step_overhead_seconds", 0.0),
                        m.get("jaxserve_policy_asyfunc_measured_steps", 0.0),
                        m.get("jaxserve_policy_asyfunc_measured_price_sigma", 0.0)))
        return out

    def means(self) -> tuple[float, float]:
        rows = np.array(self.table) if self.rows else np.zeros((1, 7))
        return float(rows[:, 1].mean()), float(rows[:, 2].mean())

    def prices(self) -> tuple[float, float, float]:
        """(scale, per-step overhead s, sigma of the log ratio): the policy's measurements,
        time-averaged over the samples taken once it had measured a step; (1, 0, 0) if it never
        did."""
        rows = np.array([r for r in self.table if r[5] > 0])
        if not len(rows):
            return 1.0, 0.0, 0.0
        return float(np.exp(np.log(rows[:, 3]).mean())), float(rows[:, 4].mean()), float(rows[:, 6].mean())


def shadow_loads(metrics: dict[str, float], blocks: set[str]) -> list[float]:
    """Seconds of each shadow's block load (workers other than the first body's)."""
    out = []
    for name, value in metrics.items():
        if name.startswith("jaxserve_stage_load_seconds{"):
            stage = name.split('stage="')[1].split('"')[0]
            worker = int(name.split('worker="')[1].split('"')[0])
            if stage in blocks and worker != 0:
                out.append(value)
    return out


def simulated(policy: str, body_cores: int, schedule: np.ndarray, prices: tuple[float, float, float] | None = None,
              seed: int = 0, pol=None) -> dict:
    """The schedule through the simulator with the live server's policy (every request at the
    bucket's length, as the engine pads it). ``prices`` (scale, per-step overhead s, sigma):
    plan and run with the first two instead of the profile's (``AsyFuncPolicy.plan_with_prices``),
    and draw each step's price with a mean-one log-normal factor of the measured sigma. ``pol``:
    a fresh policy to run instead of ``planned(policy, body_cores)`` (bench/asyfunc_pair.py's,
    over a changed profile)."""
    from jaxserve import traces
    from jaxserve.launch import simulate_asyfunc

    pol = planned(policy, body_cores) if pol is None else pol
    noise = 0.0
    if prices is not None:
        pol.plan_with_prices(*prices[:2])
        noise = prices[2]
    trace = traces.make_trace(schedule, model=MODEL, length=np.full(len(schedule), pol.model.seq),
                              slo_s=pol.knobs.slo_s)
    result, pol = simulate_asyfunc(policy, None, None, trace, policy=pol, latency_noise=noise, seed=seed)
    end = float(np.nanmax(result.finish))
    core_s, byte_s = pol.ledger.usage(0.0, end)
    s = result.summary()
    done = result.completed()
    return {"latencies": (result.finish - result.arrival)[done], "mean_ms": s["mean_latency"] * 1e3, "p98_ms": s["p98"] * 1e3, "violation": 1 - s["slo_attainment"],
            "cores": core_s / end, "mb": byte_s / end / 1e6, "splits": pol.splits_done,
            "shadows": sum(d[1] == "add_shadow" for d in pol.decisions),
            "bodies": sum(d[1] == "add_body" for d in pol.decisions)}


def run(args) -> None:
    """``--rounds`` rounds; in each, one MMPP schedule of ``--seconds`` (base ``BASE``, bursts
    ``BURST`` of BATCH's Eq. 1 rate, means ``MEANS``) is sent to a fresh server of each policy in
    turn (order rotated by round), so every comparison is of the same requests.

    Decisions. *Same cores*: the node has 2 cores (this machine's); BATCH runs its one
    configuration, a 2-core body; AsyFunc and AsyFunc⁻ start a 1-core body and may add a 1-core
    shadow (AsyFunc) or a 1-core body (MLS), so neither ever holds more cores than BATCH. Memory
    differs by design (a shadow adds its block's bytes, a second body a whole model): both are
    measured, as time averages of what the policy holds (sampled from /metrics every 0.5 s).
    *Prices*: every policy plans with the committed layer profile :data:`LAYERS`, measured on
    this machine by the wall clock in processes pinned to 1 and 2 cores while it was quiet. *SLO*
    250 ms, not the server's default (3x the whole model at (2 cores, batch 4): 92 ms here), which
    is below both a shadow's load as profiled (0.10-0.12 s for these blocks: Alg. 2 then never
    provisions one) and what the front end alone adds on these 2 shared cores under bursts. Shadow rows move
    between Ray actors, priced at the measured Ray hop (``jaxserve.launch.RAY_HOP_S``). *Load*:
    fractions of BATCH's Eq. 1 rate as the profile prices it, not a live measurement: the same
    definition the simulator uses, so the sim and live runs see the same offered load. The MLS
    period is 30 s (the paper's 60 s would act once per run). Every request's violation counts:
    late, evicted, refused and failed alike. *Live latency* is the server's (``meta.latency_ms``: arrival stamp to answer), what the
    simulator models; the client's (from each request's scheduled send: HTTP, the server's
    front end and the client's own share of the 2 cores added) and its violation rate against
    the same SLO are reported beside it. On 2 cores the pinned workers' compute and the front
    end compete, so the client's figures also show how far this machine is from the paper's
    setting, where the front end has cores of its own.
    """
    import asyncio
    import os

    from bench.common import scrape, table
    from bench.load import open_loop, start, stop
    from jaxserve import traces

    url = f"http://127.0.0.1:{args.port}"
    batch = planned("asyfunc-batch", 2)
    seq, slo_ms = batch.model.seq, batch.knobs.slo_s * 1e3
    rate = batch.r_max()
    blocks = {s.block.label() for s in batch.model.splits}
    texts = tweets_that_fit(seq)
    print(f"SLO {slo_ms:.0f} ms; BATCH's Eq. 1 rate {rate:.0f} req/s; MMPP {BASE:.2f}x / {BURST:.2f}x of it; "
          f"{len(texts)} tweets of <= {seq} tokens", flush=True)
    rng = np.random.default_rng(11)
    runs: dict[str, list[dict]] = {p: [] for p, _, _ in POLICIES}
    curves: dict[str, list] = {p: [] for p, _, _ in POLICIES}
    schedules = []
    for rnd in range(args.rounds):
        schedule = traces.mmpp_arrivals((BASE * rate, BURST * rate), MEANS, duration=args.seconds, seed=100 + rnd)
        schedules.append(schedule)
        sent = [texts[i] for i in rng.integers(0, len(texts), len(schedule))]
        order = POLICIES[rnd % len(POLICIES):] + POLICIES[:rnd % len(POLICIES)]
        for policy, label, cores in order:
            cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", MODEL, "--workers", "ray", "--policy",
                   policy, "--layer-profile", str(LAYERS), "--node-cores", str(NODE_CORES), "--instances", "1",
                   "--body-cores", str(cores), "--asyfunc-period-s", f"{PERIOD_S:g}", "--cache-dir", args.cache_dir,
                   "--max-queue", "1024", "--slo-ms", f"{SLO_MS:g}", "--port", str(args.port)]
            proc = start(cmd, url, log=args.log)
            try:
                with Sampler(url) as sampler:
                    res = asyncio.run(open_loop(url, schedule, sent, None))
                m = scrape(url, "jaxserve_policy_", "jaxserve_compilations_since_ready", "jaxserve_stage_load_seconds")
            finally:
                stop(proc)
            cores_mean, bytes_mean = sampler.means()
            sim = simulated(policy, cores, schedule)
            server = res.server_ms[np.isfinite(res.server_ms)]
            missed = res.late + res.evicted + res.rejected + res.errors
            row = {"round": rnd + 1, "sent": res.sent, "violation": missed / res.sent,
                   "client_violation": 1 - res.attainment(slo_ms), "client_mean_ms": float(res.latencies.mean() * 1e3),
                   "client_p98_ms": res.pct(98), "mean_ms": float(server.mean()),
                   "p98_ms": float(np.percentile(server, 98)), "cores": cores_mean,
                   "mb": bytes_mean / 1e6, "splits": m.get("jaxserve_policy_asyfunc_split_batches", 0.0),
                   "shadow_loads": shadow_loads(m, blocks), "late": res.late, "evicted": res.evicted,
                   "refused": res.rejected, "errors": res.errors,
                   "compiles": m.get("jaxserve_compilations_since_ready", 0.0), "sim": sim,
                   "prices": sampler.prices(), "reprices": m.get("jaxserve_policy_asyfunc_reprices", 0.0)}
            runs[policy].append(row)
            curves[policy].append((server / 1e3, sim))
            print(f"round {rnd + 1} {label}: sent {res.sent} ({res.sent / args.seconds:.0f}/s), violation "
                  f"{row['violation']:.4f} (sim {sim['violation']:.4f}, client {row['client_violation']:.4f}), "
                  f"client mean {row['client_mean_ms']:.1f} ms, mean {row['mean_ms']:.1f} ms (sim "
                  f"{sim['mean_ms']:.1f}), p98 {row['p98_ms']:.0f} ms (sim {sim['p98_ms']:.0f}), cores "
                  f"{cores_mean:.2f} (sim {sim['cores']:.2f}), MB {row['mb']:.0f} (sim {sim['mb']:.0f}), splits "
                  f"{row['splits']:.0f} (sim {sim['splits']}), shadow loads {row['shadow_loads']}, late {res.late}, "
                  f"evicted {res.evicted}, 429 {res.rejected}, errors {res.errors}, measured prices x"
                  f"{row['prices'][0]:.2f} + {row['prices'][1] * 1e3:.1f} ms/step ({row['reprices']:.0f} reprices)",
                  flush=True)
    # the simulator again, with measured prices held out: each round with the previous round's
    # (the first with the last's) of the same policy
    for policy, _, cores in POLICIES:
        for r in runs[policy]:
            held_out = runs[policy][(r["round"] - 2) % len(runs[policy])]["prices"]
            r["cal"] = simulated(policy, cores, schedules[r["round"] - 1], held_out, seed=r["round"])

    def med(policy: str, key: str, sim: bool | str = False) -> float:
        which = "sim" if sim is True else sim
        return float(np.median([(r[which] if which else r)[key] for r in runs[policy]]))

    summary = []
    for policy, label, cores in POLICIES:
        loads = [x for r in runs[policy] for x in r["shadow_loads"]]
        summary.append([label, f"{cores}", f"{med(policy, 'violation'):.4f}", f"{med(policy, 'violation', True):.4f}",
                        f"{med(policy, 'client_violation'):.4f}",
                        f"{med(policy, 'mean_ms'):.1f}", f"{med(policy, 'mean_ms', True):.1f}",
                        f"{med(policy, 'mean_ms', 'cal'):.1f}",
                        f"{med(policy, 'p98_ms'):.0f}", f"{med(policy, 'p98_ms', True):.0f}",
                        f"{med(policy, 'p98_ms', 'cal'):.0f}",
                        f"{med(policy, 'client_mean_ms'):.1f} / {med(policy, 'client_p98_ms'):.0f}",
                        f"{med(policy, 'cores'):.2f}", f"{med(policy, 'cores', True):.2f}",
                        f"{med(policy, 'mb'):.0f}", f"{med(policy, 'mb', True):.0f}",
                        f"{med(policy, 'splits'):.0f}", f"{med(policy, 'splits', True):.0f}",
                        f"{np.median(loads) * 1e3:.0f} ({len(loads)})" if loads else "—",
                        f"×{np.median([r['prices'][0] for r in runs[policy]]):.2f} + "
                        f"{np.median([r['prices'][1] for r in runs[policy]]) * 1e3:.1f}, σ "
                        f"{np.median([r['prices'][2] for r in runs[policy]]):.2f}",
                        f"{max(r['compiles'] for r in runs[policy]):.0f}"])
    per_round = []
    for policy, label, _ in POLICIES:
        for r in runs[policy]:
            b = runs["asyfunc-batch"][r["round"] - 1]
            per_round.append([str(r["round"]), label, f"{r['sent']:,}", f"{r['violation']:.4f}",
                              f"{r['violation'] - b['violation']:+.4f}", f"{r['cores'] / b['cores']:.2f}",
                              f"{r['mb'] / b['mb']:.2f}", f"{r['mean_ms'] / r['sim']['mean_ms']:.2f}",
                              f"{r['p98_ms'] / r['sim']['p98_ms']:.2f}",
                              f"{r['mean_ms'] / r['cal']['mean_ms']:.2f}",
                              f"{r['p98_ms'] / r['cal']['p98_ms']:.2f}", f"{r['cal']['violation']:.4f}",
                              f"{r['late']}/{r['evicted']}/{r['refused']}/{r['errors']}"])
    path = _plot(curves, slo_ms)
    body = (table(["policy", "body cores at start", "violation live", "violation sim", "violation client",
                   "mean ms live", "mean ms sim", "mean ms sim, measured prices", "p98 ms live", "p98 ms sim",
                   "p98 ms sim, measured prices", "client mean / p98 ms", "mean cores live",
                   "mean cores sim", "mean MB live", "mean MB sim", "split batches live", "split batches sim",
                   "shadow block load ms (n)", "measured prices: scale + ms per step, σ", "compiles after ready"],
                  summary)
            + "\n\nMedians over rounds. Per round (the same requests for the three policies within a round):\n\n"
            + table(["round", "policy", "requests", "violation", "minus BATCH's", "cores / BATCH's", "MB / BATCH's",
                     "mean live / sim", "p98 live / sim", "mean live / sim at measured prices",
                     "p98 live / sim at measured prices", "violation sim at measured prices",
                     "late/evicted/429/errors"], per_round)
            + f"\n\nCDF (live solid, simulated dashed): `bench/plots/{path.name}`")
    notes = reading(runs) + "\n\n" + (
        f"`jaxserve serve --model minilm-l6 --workers ray --policy P --layer-profile {LAYERS.relative_to(LAYERS.parents[2])} "
        f"--node-cores 2 --instances 1 --body-cores C --asyfunc-period-s 30 --slo-ms {slo_ms:.0f}` (C = 1, BATCH 2), a fresh server per run, "
        f"every executable warm before it is ready. Open loop, "
        f"{args.rounds} rounds of {args.seconds:.0f} s: MMPP between {BASE * rate:.0f} and {BURST * rate:.0f} req/s "
        f"(means {MEANS[0]:g} s / {MEANS[1]:g} s), real tweets of <= {seq} tokens to /v1/embeddings. The simulator "
        f"runs the same schedule with the policy the server builds (`bench/asyfunc_live.py` `simulated`). Load "
        f"average at the end {os.getloadavg()[0]:.1f} (the client shares the 2 cores).")
    print(body)
    print(notes)
    if args.write:
        from bench.common import record

        record("asyfunc_live", "AsyFunc live: body and shadow as Ray actors against BATCH and AsyFunc⁻, and the "
               "simulator on the same trace", body, notes)


def reading(runs: dict[str, list[dict]]) -> str:
    """The reading paragraph, from the runs' figures."""
    def med(policy, key, sim=False):
        return float(np.median([(r["sim"] if sim else r)[key] for r in runs[policy]]))

    a, b = "asyfunc", "asyfunc-batch"
    worse = sum(ra["violation"] > rb["violation"] for ra, rb in zip(runs[a], runs[b]))
    n = len(runs[a])
    agree = []
    for policy, label, _ in POLICIES:
        rm = [r["mean_ms"] / r["sim"]["mean_ms"] for r in runs[policy]]
        rp = [r["p98_ms"] / r["sim"]["p98_ms"] for r in runs[policy]]
        ok = all(abs(x - 1) <= 0.10 for x in rm + rp)
        agree.append(f"{label} {np.median(rm):.2f}x / {np.median(rp):.2f}x ({'within' if ok else 'not within'} 10%)")
    splits = med(a, "splits")
    acted = (f"AsyFunc's layer-level scaling acted: {splits:.0f} split batches per run (median), its shadow's block "
             f"loaded from the warm pool in the times the table shows" if splits else
             "AsyFunc's layer-level scaling did not act live (no split batch)")
    within = [label for policy, label, _ in POLICIES
              if all(abs(r[k] / r["sim"][k] - 1) <= 0.10 for r in runs[policy] for k in ("mean_ms", "p98_ms"))]
    cal = []
    for policy, label, _ in POLICIES:
        rm = [r["mean_ms"] / r["cal"]["mean_ms"] for r in runs[policy]]
        rp = [r["p98_ms"] / r["cal"]["p98_ms"] for r in runs[policy]]
        ok = all(abs(x - 1) <= 0.10 for x in rm + rp)
        scale = np.median([r["prices"][0] for r in runs[policy]])
        over = np.median([r["prices"][1] for r in runs[policy]]) * 1e3
        sigma = np.median([r["prices"][2] for r in runs[policy]])
        cal.append(f"{label} measured ×{scale:.2f} the profile's compute (σ {sigma:.2f}) and {over:.1f} ms per step, "
                   f"{np.median([r['reprices'] for r in runs[policy]]):.0f} reprices; live / sim "
                   f"{np.median(rm):.2f}x / {np.median(rp):.2f}x ({'within' if ok else 'not within'} 10% in every round)")
    cal_viol = {label: float(np.median([r["cal"]["violation"] for r in runs[policy]])) for policy, label, _ in POLICIES}
    blocks = sorted({f"{x * 1e3:.0f} ms" for r in runs[a] for x in r["shadow_loads"]})
    return (f"**Reading.** {acted} ({', '.join(blocks) or 'none'}). Its SLO violation rate was "
            f"{med(a, 'violation'):.4f} against BATCH's {med(b, 'violation'):.4f} (medians; worse than BATCH's in "
            f"{worse} of {n} rounds), holding {med(a, 'cores'):.2f} cores and {med(a, 'mb'):.0f} MB on average against "
            f"BATCH's {med(b, 'cores'):.2f} and {med(b, 'mb'):.0f}; AsyFunc⁻ {med('asyfunc-nolls', 'violation'):.4f} at "
            f"{med('asyfunc-nolls', 'cores'):.2f} cores. Live against simulated, mean / p98 (median of rounds): "
            f"{'; '.join(agree)}. Within 10% in every round: {', '.join(within) or 'none'}. The live policies plan "
            f"with what they measure (`AsyFuncPolicy.observe_step`): every step's compute against the profile and "
            f"each step's wall time beside it. The simulator with those prices, taken from the previous round of "
            f"the same policy (held out): {'; '.join(cal)}; its violation rates "
            f"{', '.join(f'{k} {v:.4f}' for k, v in cal_viol.items())}. What the profile does not hold: the front "
            f"end (HTTP, tokenizing and the engine, in the server's own process, unpinned) and the client share the "
            f"2 cores with the pinned workers; AsyFunc⁻'s one 1-core body leaves a core to them, while BATCH's 2-core "
            f"body and AsyFunc's body and shadow compute on both, and a split batch is 2 or 3 steps, each a Ray "
            f"call.")


def _plot(curves: dict, slo_ms: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.common import PLOTS, save_plot

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for (policy, label, _), color in zip(POLICIES, ("C0", "C1", "C2")):
        lat = np.sort(np.concatenate([live for live, _ in curves[policy]])) * 1e3
        ax.plot(lat, np.arange(1, len(lat) + 1) / max(1, len(lat)), color=color, label=f"{label} live")
        lat = np.sort(np.concatenate([sim["latencies"] for _, sim in curves[policy]])) * 1e3
        ax.plot(lat, np.arange(1, len(lat) + 1) / max(1, len(lat)), color=color, linestyle="--",
                label=f"{label} simulated")
    ax.axvline(slo_ms, color="grey", linestyle=":")
    ax.set_xscale("log")
    ax.set_xlabel("server latency, arrival to answer (ms, log)")
    ax.set_title("AsyFunc live, MiniLM-L6, 2 cores, MMPP bursts", fontsize=9)
    return save_plot(fig, ax, PLOTS / "asyfunc_live.png", legend_size=8, dpi=100)


def main() -> None:
    from bench.common import add_quick, apply_quick

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="seconds per (round, policy)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=8049)
    ap.add_argument("--cache-dir", default=str(CACHE))
    ap.add_argument("--log", default=None, help="append the servers' output to this file")
    ap.add_argument("--write", action="store_true")
    add_quick(ap, seconds=10.0, rounds=1)
    run(apply_quick(ap.parse_args()))


if __name__ == "__main__":
    main()
