"""QUART (pipelined models, key-stage scaling, a host-memory parameter cache) and its baselines.

A model is served as a pipeline of layer-range stages (:class:`~jaxserve.sched.base.Stage`),
each held by one or more workers (its *replicas*); a worker sits on a *server* with a fixed
number of accelerators, one worker per accelerator. Steps are batched stage by stage exactly as
:class:`~jaxserve.sched.pipeline.PipelineBatching` does (FIFO per stage, deepest stage first);
within a stage the idle replica that has been idle longest takes the next step, which is the
per-stage load balancer. On top of that, every ``period`` seconds a *controller* decides how
many replicas each stage should have and where new ones go, and the policy carries it out with
:class:`~jaxserve.sched.base.PlacementChange`: ``add_worker`` on a server with a free
accelerator, then ``load`` of the stage once the worker is up, or ``remove_worker``.

Pure: no JAX, no clock, no threads (DESIGN.md, ``jaxserve/sched/``). Where the parameters of
a new replica come from (the host cache, the page cache, a cold disk) decides how long its
load takes; the policy knows it (:class:`ParameterCache`, :class:`LoadModel`) and the
simulator asks it through :meth:`ScalingPipeline.planned_load_seconds` (pass it as
``simulate(load_time=...)``).

The controllers (one class each, sharing :class:`ScalingPipeline`):

* :class:`QuartPolicy` — the paper's Corrector (§5.1: M/M/c delay per stage, a PID on
  ``T_i - T_target``), Smoother (§5.2: predicted CV per stage, Eq. 7 with the factor β),
  CPU compensator (§5.3: a linear regression of cores per instance), the key-stage cache
  (§6.1, modelled: :class:`ParameterCache`) and the dispersed KL placement (§6.2).
* :class:`InflessLike`, :class:`InferlineLike`, :class:`CocktailLike` — the paper's three
  baselines as we read them (each class docstring says how).

Where we differ from the paper (each also said where it is implemented):

* Eq. 1 is not the M/M/c delay: it uses ``P_0`` where the Erlang-C probability of waiting
  belongs, and its denominator is not that of M/M/c. :func:`mmc_delay` is the textbook
  M/M/c mean response time ``C(c, a) / (c mu - lambda) + 1 / mu``.
* Algorithm 1 writes ``e(t) = T_target - T_i(t)`` and ``r' = r + Δr``: with positive gains
  that *removes* replicas when the delay grows. We use ``e = (T_i - T_target) / T_target``
  (normalised, so the gains are unitless): more delay, more replicas (:class:`PID`).
* The paper's CV propagation predictor is a graph-attention network (Eqs. 4-6). We fit a
  small linear model on the QNA departure-variability features (Whitt's linking equation)
  on simulated runs of our own pipeline (:class:`CvPropagation`); the attention model is
  not implemented.
* β(CV) is not given. We use ``β = CV / (1 + CV)`` (:func:`smoothing_beta`): a bursty stage
  keeps its own allocation, a smooth one moves toward its neighbours' mean.
* §6.2 minimises KL by gradient descent over a relaxed placement matrix. We place one
  replica at a time on the server whose choice gives the smallest exact KL divergence of the
  stage's replica distribution from the uniform one (= the most dispersed), preferring a
  server whose cache holds the stage when its KL is within ``kl_slack`` of the best
  (:func:`choose_server`).
* The M/M/c steady state says nothing about a backlog present now: a stage's delay is the
  larger of the M/M/c value and the time to drain its current queue (:meth:`QuartPolicy._delay`).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from jaxserve.sched.base import (Batch, CostModel, LatencyProfile, PlacementChange, Plan, Request, ShapeGrid, Stage, StepSummary,
                                 WorkerView)
from jaxserve.sched.pipeline import PipelineBatching

__all__ = [
    "cut_stages", "profile_layer_costs", "erlang_c", "mmc_delay", "mmc_wait", "replicas_for", "PID", "CvPropagation", "smoothing_beta",
    "smooth_allocation", "fit_linear", "CpuCompensator", "Server", "LoadModel", "ParameterCache", "kl_to_uniform",
    "choose_server", "ScalingPipeline", "StageTotals", "QuartPolicy", "InflessLike", "InferlineLike", "CocktailLike",
    "stage_cost_model",
]


# -- stage cutting ---------------------------------------------------------------------------

def cut_stages(model: str, layer_costs: Sequence[float], max_stages: int = 8,
               tolerance: float = 0.0) -> tuple[Stage, ...]:
    """Cut ``model`` (one cost per layer, in any unit) into at most ``max_stages`` contiguous
    stages minimising the most expensive stage (the pipeline's bottleneck), by dynamic
    programming over cut points; among equal bottlenecks, fewer stages are never preferred
    over ``max_stages`` (every layer count allows ``min(max_stages, L)`` stages, all used).
    The paper cuts evenly by layer count (DeepSpeed); with equal layer costs this is that.

    ``tolerance`` > 0: of the cuts whose bottleneck is within ``(1 + tolerance)`` of the least,
    the one whose largest stage has the fewest layers (the most even by layer count). A measured
    profile of identical layers differs layer to layer by its noise, and the least bottleneck
    alone would then cut unevenly on noise; a tolerance of about that noise keeps the even cut
    unless the profile's differences are larger than it."""
    costs = [float(c) for c in layer_costs]
    n = len(costs)
    if n == 0 or any(c < 0 for c in costs):
        raise ValueError("need one non-negative cost per layer")
    if tolerance < 0:
        raise ValueError("tolerance must be >= 0")
    k = max(1, min(max_stages, n))
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def solve(size, cap):
        """best[j][i]: the least max ``size(p, i)`` of layers [0, i) in j stages, each stage's
        cost within ``cap``; cut[j][i]: its last cut."""
        best = [[math.inf] * (n + 1) for _ in range(k + 1)]
        cut = [[0] * (n + 1) for _ in range(k + 1)]
        best[0][0] = 0.0
        for j in range(1, k + 1):
            for i in range(j, n + 1):
                for p in range(j - 1, i):
                    if prefix[i] - prefix[p] > cap:
                        continue
                    v = max(best[j - 1][p], size(p, i))
                    if v < best[j][i] - 1e-15:
                        best[j][i], cut[j][i] = v, p
        return best, cut

    best, cut = solve(lambda p, i: prefix[i] - prefix[p], math.inf)
    if tolerance > 0:
        cap = best[k][n] * (1 + tolerance) + 1e-12
        _, cut = solve(lambda p, i: float(i - p), cap)
    bounds, i = [], n
    for j in range(k, 0, -1):
        p = cut[j][i]
        bounds.append((p, i))
        i = p
    return tuple(Stage(model, a, b, n) for a, b in reversed(bounds))


def profile_layer_costs(profile: Mapping, batch: int, cores: int | None = None) -> tuple[list[float], int, int]:
    """One cost per layer from a model's layer profile (the ``models[name]`` entry of
    ``jaxserve profile --layers``'s file, :mod:`jaxserve.layer_profile`): layer k's units'
    (``L{k}.attn``, ``L{k}.mlp``) latencies at ``batch``, the units before the layers
    (embeddings, patch embedding) on layer 0 and those after them (pooling, head) on the last,
    as the engine's stages hold them. The batch is the largest profiled one <= ``batch`` (else
    the smallest), the core count the largest profiled one <= ``cores`` (None: the most; else
    the smallest). Returns (costs, the batch, the cores used). KeyError if it has no units."""
    by_cores = {int(c): us for c, us in (profile.get("units_by_cores") or {}).items()}
    if not by_cores:
        if not profile.get("units"):
            raise KeyError("the layer profile has no units")
        by_cores = {0: profile["units"]}
    fit = [c for c in by_cores if cores is None or c <= cores]
    c = max(fit) if fit else min(by_cores)
    units = by_cores[c]
    batches = sorted({int(b) for u in units for b in u["latency"]})
    fit_b = [b for b in batches if b <= batch]
    b = max(fit_b) if fit_b else batches[0]
    n = int(profile["num_layers"])
    costs = [0.0] * n
    for u in units:
        costs[min(max(int(u["layer"]), 0), n - 1)] += float(u["latency"][str(b)])
    return costs, b, c


# -- queueing (§5.1) -------------------------------------------------------------------------

def erlang_c(servers: int, offered: float) -> float:
    """The Erlang-C probability that an arrival waits in an M/M/c queue with ``servers``
    servers and offered load ``offered = lambda / mu`` (Erlangs); 1.0 when unstable."""
    c = int(servers)
    if c < 1:
        raise ValueError("need at least one server")
    a = float(offered)
    if a <= 0:
        return 0.0
    if a >= c:
        return 1.0
    # Erlang B by its stable recursion, then C = B / (1 - rho (1 - B))
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    rho = a / c
    return b / (1.0 - rho * (1.0 - b))


def mmc_wait(arrival_rate: float, service_rate: float, servers: int) -> float:
    """Mean time in queue (before service) of M/M/c: ``C(c, a) / (c mu - lambda)``; inf if
    ``lambda >= c mu``."""
    lam, mu, c = float(arrival_rate), float(service_rate), int(servers)
    if mu <= 0:
        raise ValueError("service rate must be > 0")
    if lam <= 0:
        return 0.0
    if lam >= c * mu:
        return math.inf
    return erlang_c(c, lam / mu) / (c * mu - lam)


def mmc_delay(arrival_rate: float, service_rate: float, servers: int) -> float:
    """Mean response time (queueing + service) of M/M/c: ``C(c, a) / (c mu - lambda) + 1/mu``.

    This is what the paper's Eq. 1 means to compute, not what it prints: Eq. 1 has the idle
    probability ``P_0`` in place of the Erlang-C probability of waiting and a denominator
    ``r mu (mu - lambda / r)`` that is not ``c mu - lambda``."""
    return mmc_wait(arrival_rate, service_rate, servers) + 1.0 / float(service_rate)


def replicas_for(arrival_rate: float, service_rate: float, target: float, cv_arrival: float = 1.0,
                 cv_service: float = 1.0, limit: int = 4096) -> int:
    """The fewest replicas whose G/G/c delay meets ``target`` seconds, by the Allen-Cunneen
    approximation ``W_q = W_q(M/M/c) (ca^2 + cs^2) / 2`` (Algorithm 1's "replicas from CV_i
    and QPS"); ``limit`` if none does (or ``target`` is below one service time)."""
    if arrival_rate <= 0:
        return 1
    factor = (cv_arrival ** 2 + cv_service ** 2) / 2.0
    c = max(1, math.ceil(arrival_rate / service_rate - 1e-12))
    while c < limit:
        w = mmc_wait(arrival_rate, service_rate, c)
        if w * factor + 1.0 / service_rate <= target:
            return c
        c += 1
    return limit


class PID:
    """A PID controller on the error ``e = (T_i - T_target) / T_target``: its output is the
    number of replicas to add (Eq. 3). The sign is the fix to Algorithm 1 (module
    docstring): a delay above target gives a positive output. The integral is clamped to
    ``[0, integral_limit]`` (no wind-up while the stage is below target, none below zero, so
    a long quiet spell does not hold back the next burst)."""

    def __init__(self, kp: float = 1.0, ki: float = 0.2, kd: float = 0.2, integral_limit: float = 10.0) -> None:
        self.kp, self.ki, self.kd, self.integral_limit = kp, ki, kd, integral_limit
        self.integral = 0.0
        self.previous: float | None = None

    def update(self, error: float, dt: float) -> float:
        if dt <= 0:
            raise ValueError("dt must be > 0")
        self.integral = min(self.integral_limit, max(0.0, self.integral + error * dt))
        derivative = 0.0 if self.previous is None else (error - self.previous) / dt
        self.previous = error
        return self.kp * error + self.ki * self.integral + self.kd * derivative

    def reset(self) -> None:
        self.integral, self.previous = 0.0, None


# -- CV propagation and smoothing (§5.2) ------------------------------------------------------

@dataclass(frozen=True)
class CvPropagation:
    """Predicts a stage's arrival CV from its upstream stage's arrival CV and utilisation.

    A stage's arrivals are its upstream stage's departures. Whitt's QNA linking equation
    gives their squared CV as ``1 + (1 - rho^2)(ca^2 - 1) + rho^2 (cs^2 - 1) / sqrt(c)``; we
    fit ``cv_out^2 = w0 + w1 (1 - rho^2) ca^2 + w2 rho^2 / sqrt(c)`` by least squares
    (:meth:`fit`), because batching (departures come in batches) and the finite windows CV is
    measured on bend the equation. The defaults are QNA's own form for one replica with a
    service CV of 0.5 (``w0 = 0, w1 = 1, w2 = cs^2 = 0.25``: for ``c = 1`` the constants cancel).
    ``python -m bench.quart_sim`` fits the weights on simulated runs of our 8-stage BERT-base
    pipeline (bench/profiles/bert-base-cpu.json cut evenly, batch sizes 1/2/4, sequence 128,
    one replica per stage, no scaling; gamma arrivals with CV 0.1-8 at 30-90% of the slowest
    stage's capacity), hands the fit to QUART, and reports its coefficients and error in
    bench/RESULTS.md (section quart_sim). The paper fits a graph-attention model instead.
    """

    w0: float = 0.0
    w1: float = 1.0
    w2: float = 0.25

    def predict(self, cv_upstream: float, rho_upstream: float, replicas_upstream: int = 1) -> float:
        rho = min(max(rho_upstream, 0.0), 1.0)
        sq = self.w0 + self.w1 * (1 - rho * rho) * cv_upstream ** 2 + self.w2 * rho * rho / math.sqrt(
            max(1, replicas_upstream))
        return math.sqrt(max(sq, 0.0))

    def chain(self, cv_in: float, rhos: Sequence[float], replicas: Sequence[int]) -> tuple[float, ...]:
        """Every stage's predicted arrival CV, the first stage's being ``cv_in``."""
        out = [cv_in]
        for rho, r in zip(rhos[:-1], replicas[:-1]):
            out.append(self.predict(out[-1], rho, r))
        return tuple(out)

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float, int, float]]) -> "CvPropagation":
        """Least squares over ``(cv_upstream, rho_upstream, replicas_upstream, cv_measured)``."""
        rows, ys = [], []
        for cv, rho, r, out in samples:
            rho = min(max(rho, 0.0), 1.0)
            rows.append((1.0, (1 - rho * rho) * cv * cv, rho * rho / math.sqrt(max(1, r))))
            ys.append(out * out)
        w = fit_linear(rows, ys)
        return cls(*w)


def smoothing_beta(cv: float) -> float:
    """β(CV) of Eq. 7: how much of its own allocation a stage keeps. The paper leaves it
    open; ours is ``CV / (1 + CV)`` (0 for a perfectly smooth stage, toward 1 for bursts)."""
    cv = max(0.0, cv)
    return cv / (1.0 + cv)


def smooth_allocation(allocations: Sequence[float], cvs: Sequence[float]) -> tuple[float, ...]:
    """Eq. 7 along a chain: ``y'_i = β(CV_i) y_i + (1 - β(CV_i)) mean(y_j, j neighbour of i)``,
    the neighbours of a stage being the stages before and after it."""
    n = len(allocations)
    out = []
    for i in range(n):
        nb = [allocations[j] for j in (i - 1, i + 1) if 0 <= j < n]
        beta = smoothing_beta(cvs[i])
        mean = sum(nb) / len(nb) if nb else allocations[i]
        out.append(beta * allocations[i] + (1 - beta) * mean)
    return tuple(out)


# -- CPU compensation (§5.3) ------------------------------------------------------------------

def fit_linear(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> tuple[float, ...]:
    """Ordinary least squares (normal equations, Gaussian elimination with partial
    pivoting; a tiny ridge keeps a degenerate design solvable): the weights ``w`` minimising
    ``sum (rows[k] . w - ys[k])^2``."""
    if not rows or len(rows) != len(ys):
        raise ValueError("need as many targets as rows, at least one")
    m = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) + (1e-9 if i == j else 0.0) for j in range(m)] for i in range(m)]
    b = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(m)]
    for col in range(m):
        piv = max(range(col, m), key=lambda k: abs(a[k][col]))
        a[col], a[piv], b[col], b[piv] = a[piv], a[col], b[piv], b[col]
        for k in range(col + 1, m):
            f = a[k][col] / a[col][col]
            for j in range(col, m):
                a[k][j] -= f * a[col][j]
            b[k] -= f * b[col]
    w = [0.0] * m
    for i in range(m - 1, -1, -1):
        w[i] = (b[i] - sum(a[i][j] * w[j] for j in range(i + 1, m))) / a[i][i]
    return tuple(w)


@dataclass
class CpuCompensator:
    """Predicts the CPU cores a stage instance needs (§5.3) with a linear regression on its
    load per replica, ``cores = w0 + w1 * lambda / (r mu)``.

    How cores act on a step is modelled, not measured here: a share ``cpu_share`` of a step
    is CPU-side work (serialisation, transfer, control flow) that scales as
    ``base_cores / cores``; the rest is the accelerator's. The paper reports the median
    latency 33% lower with 4 cores than with 2 on its HTTP/TCP pipeline (Fig. 3b); our
    default share of 0.2 is a guess for a Ray-object-store pipeline (bench/RESULTS.md says
    what the experiment used). :meth:`fit` builds the regression's samples from the M/M/c
    model (the fewest cores meeting ``target`` at each load) as the paper builds them from
    offline profiling."""

    cpu_share: float = 0.2
    base_cores: int = 2
    max_cores: int = 8
    weights: tuple[float, float] = (2.0, 0.0)

    def factor(self, cores: int) -> float:
        """A step's time with ``cores`` cores relative to ``base_cores``."""
        return 1.0 - self.cpu_share + self.cpu_share * self.base_cores / max(1, cores)

    def fit(self, service_rate: float, target: float, replicas: int = 1, points: int = 40) -> "CpuCompensator":
        rows, ys = [], []
        for k in range(1, points + 1):
            u = 0.98 * k / points  # load per replica at base cores
            lam = u * replicas * service_rate
            need = self.max_cores
            for cores in range(self.base_cores, self.max_cores + 1):
                mu = service_rate / self.factor(cores)
                if lam < replicas * mu and mmc_delay(lam, mu, replicas) <= target:
                    need = cores
                    break
            rows.append((1.0, u))
            ys.append(float(need))
        self.weights = tuple(fit_linear(rows, ys))  # type: ignore[assignment]
        return self

    def cores(self, arrival_rate: float, service_rate: float, replicas: int) -> int:
        u = arrival_rate / (max(1, replicas) * service_rate) if service_rate > 0 else 0.0
        c = math.ceil(self.weights[0] + self.weights[1] * u - 1e-9)
        return int(min(self.max_cores, max(self.base_cores, c)))


# -- servers, the parameter cache and placement (§6) -----------------------------------------

@dataclass(frozen=True)
class Server:
    """A host: ``accelerators`` workers at most; ``cache_mb`` of host memory the
    KeysManager may fill with stage parameters (evicting past ``cache_high_water`` of it)."""

    id: int
    accelerators: int
    cache_mb: float = math.inf
    cache_high_water: float = 0.85


@dataclass(frozen=True)
class LoadModel:
    """Seconds until a new replica of a stage is ready, by where its parameters come from.

    ``cache``: the host's parameter cache (the KeysManager keeps the stage warm on the host,
    the analogue of the paper's forked process: only the copy of the parameters is paid,
    ``36.3 ms per 92 MB``, a lease, ``ray.get`` from the object store and the replica's private
    copy onto its device, plus ``cache_fixed_s`` to hand the warm process an accelerator, an
    assumption). ``page``: from disk through the page cache (``249 ms per 92 MB``, an orbax
    restore of the stage's checkpoint), plus a new worker's start (``actor_start_s``, an empty
    Ray actor measured at 2.57 s) and its executables (``executables_s``: 5.34 s of loading a
    stage in an actor minus its weights). ``cold``: the same from a cold disk at
    ``cold_disk_mb_per_s`` (an assumption, 200 MB/s: a cloud block device; the paper's 45 s for
    43 GB is ~1 GB/s; dropping this VM's page cache does not reach its host's, so it was not
    measured here). The cache and restore rates are bench/RESULTS.md's ``quart_cache`` (the
    KeysManager on this machine, per 92 MB over BERT-base's and MPNet's stages); the actor
    numbers its "Ray actors against thread workers"."""

    cache_s_per_mb: float = 0.0363 / 92
    cache_fixed_s: float = 0.05
    page_s_per_mb: float = 0.2488 / 92
    cold_disk_mb_per_s: float = 200.0
    actor_start_s: float = 2.57
    executables_s: float = 2.77

    def seconds(self, megabytes: float, source: str) -> float:
        if source == "cache":
            return self.cache_fixed_s + megabytes * self.cache_s_per_mb
        start = self.actor_start_s + self.executables_s
        if source == "page":
            return start + megabytes * self.page_s_per_mb
        if source == "cold":
            return start + megabytes / self.cold_disk_mb_per_s
        raise ValueError(f"unknown parameter source {source!r}")


class ParameterCache:
    """Which server's host memory holds which stage's parameters (the KeysManager's table,
    §6.1), as data the policy is told about and keeps up to date as it loads stages. Entries
    are LRU per server: inserting past ``cache_high_water`` of ``cache_mb`` evicts the least
    recently used ones. ``page`` remembers which stages a server read from disk (its page
    cache), so a second disk load there is warm. The live cache (Ray's object store) is
    another component; this is the model of it that placement and the simulator use."""

    def __init__(self, servers: Iterable[Server]) -> None:
        self.servers = {s.id: s for s in servers}
        self._entries: dict[int, OrderedDict[Stage, float]] = {s: OrderedDict() for s in self.servers}
        self.page: dict[int, set[Stage]] = {s: set() for s in self.servers}

    def holds(self, server: int, stage: Stage) -> bool:
        return stage in self._entries[server]

    def stages(self, server: int) -> tuple[Stage, ...]:
        return tuple(self._entries[server])

    def used_mb(self, server: int) -> float:
        return sum(self._entries[server].values())

    def touch(self, server: int, stage: Stage) -> None:
        if stage in self._entries[server]:
            self._entries[server].move_to_end(stage)

    def insert(self, server: int, stage: Stage, megabytes: float) -> tuple[Stage, ...]:
        """Cache ``stage`` on ``server``; the entries evicted to stay under the high-water
        mark (a stage larger than that is not cached)."""
        entries, s = self._entries[server], self.servers[server]
        limit = s.cache_mb * s.cache_high_water
        if megabytes > limit:
            return ()
        entries[stage] = megabytes
        entries.move_to_end(stage)
        evicted = []
        while sum(entries.values()) > limit:
            old, _ = entries.popitem(last=False)
            evicted.append(old)
        return tuple(evicted)

    def invalidate(self, stage: Stage) -> None:
        """Forget ``stage`` everywhere (its checkpoint changed)."""
        for entries in self._entries.values():
            entries.pop(stage, None)
        for page in self.page.values():
            page.discard(stage)

    def source(self, server: int, stage: Stage, use_cache: bool = True) -> str:
        if use_cache and self.holds(server, stage):
            return "cache"
        return "page" if stage in self.page[server] else "cold"


def kl_to_uniform(counts: Sequence[float], eps: float = 1e-3) -> float:
    """``D_KL(P || Q)`` of Eq. 8 for one stage: ``P`` its replicas' share per server
    (smoothed by ``eps`` so empty servers count), ``Q`` uniform over the servers."""
    m = len(counts)
    total = sum(counts) + eps * m
    q = 1.0 / m
    out = 0.0
    for c in counts:
        p = (c + eps) / total
        out += p * math.log(p / q)
    return out


def choose_server(stage_counts: Mapping[int, int], free: Mapping[int, int], cached: Iterable[int],
                  kl_slack: float = 0.75) -> int | None:
    """Where the next replica of a key stage goes (§6.2): among servers with a free
    accelerator, the one whose choice leaves the stage's replica distribution closest to
    uniform (smallest KL, Eq. 8), except that a server caching the stage wins when its KL is
    within ``kl_slack`` nats of the best (so a cached copy is used unless that would
    concentrate the stage); ties go to the server with more free accelerators, then the
    lower id. None if no server has a free accelerator. ``stage_counts``: the stage's
    replicas per server over every server of the cluster."""
    servers = sorted(stage_counts)
    cached = set(cached)
    scored = []
    for s in servers:
        if free.get(s, 0) <= 0:
            continue
        counts = [stage_counts[t] + (1 if t == s else 0) for t in servers]
        scored.append((kl_to_uniform(counts), -free[s], s))
    if not scored:
        return None
    scored.sort()
    best = scored[0][0]
    for kl, _, s in scored:
        if s in cached and kl <= best + kl_slack:
            return s
    return scored[0][2]


# -- the scaling pipeline -----------------------------------------------------------------------

@dataclass
class _StageStats:
    arrivals: int = 0
    completed: int = 0
    busy_s: float = 0.0


@dataclass
class StageTotals:
    """A stage's steps since the start: how many, the seconds its replicas were busy with them
    (dispatch to completion, as the engine or simulator reports it: compute, the call and the
    hand-off) and what the cost model prices them at. Their ratio is how far live steps are
    from the profile (a simulator calibrates on it: bench/quart_live.py)."""

    steps: int = 0
    busy_s: float = 0.0
    priced_s: float = 0.0


class ScalingPipeline(PipelineBatching):
    """:class:`PipelineBatching` whose replicas per stage a controller changes every
    ``period`` seconds (:meth:`desired`, overridden by each policy).

    Args:
        chains, grids, max_queue: as :class:`PipelineBatching`.
        cost: prices steps (profile ``stage.label()``, or the model's for a whole stage).
        servers: the hosts; ``worker_server`` puts each initial worker on one.
        stage_mb: parameter megabytes per stage (what a load moves).
        load_model, cache: how long a load takes, and from where.
        use_cache: False for policies without a parameter cache (the baselines).
        cold_always: every load from a cold disk (INFless's cold starts).
        period: seconds between control decisions.
        max_replicas: per stage, at most this many.
        record_arrivals: keep each stage's arrival times (to measure CV per stage).

    Worker ids for new workers count up from the largest initial id. Removed workers are
    never planned on again; a worker being added or loading is counted as a replica of its
    stage (so the controller does not add it twice).
    """

    def __init__(self, chains: Mapping[str, Sequence[Stage]], grids: Mapping[str, ShapeGrid], cost: CostModel,
                 servers: Sequence[Server], worker_server: Mapping[int, int], stage_mb: Mapping[Stage, float],
                 *, load_model: LoadModel | None = None, cache: ParameterCache | None = None,
                 use_cache: bool = True, cold_always: bool = False, period: float = 1.0,
                 max_replicas: int = 64, max_queue: int = 1 << 30, record_arrivals: bool = False) -> None:
        super().__init__(chains, grids, max_queue=max_queue)
        self.cost = cost
        self.servers = {s.id: s for s in servers}
        self.worker_server = dict(worker_server)
        self.stage_mb = dict(stage_mb)
        self.load_model = load_model or LoadModel()
        self.cache = cache if cache is not None else ParameterCache(servers)
        self.use_cache = use_cache
        self.cold_always = cold_always
        self.period = period
        self.max_replicas = max_replicas
        self.stages = [s for c in self.chains.values() for s in c]
        self._next_control = 0.0
        self._last_control: float | None = None
        self._stats = {s: _StageStats() for s in self.stages}
        self.totals = {s: StageTotals() for s in self.stages}
        self._running_since: dict[int, float] = {}
        self._worker_stage: dict[int, Stage] = {}  # every live or coming worker -> its stage
        self._pending_load: dict[int, Stage] = {}  # added, not up yet, or up and to load
        self._loading: set[int] = set()
        self._removed: set[int] = set()
        self._next_id = max(self.worker_server, default=-1) + 1
        self._planned_loads: dict[Stage, deque[float]] = {}
        self._last_load_s: dict[Stage, float] = {}
        self.arrival_times: dict[Stage, list[float]] | None = {s: [] for s in self.stages} if record_arrivals else None
        self.events: list[tuple[float, str, int, str, str]] = []  # (time, action, worker, stage, source)
        self.replica_log: list[tuple[float, tuple[int, ...]]] = []  # (time, replicas per stage)
        self.queue_log: list[tuple[float, tuple[int, ...]]] = []  # (time, queued per stage)
        self.cores: dict[Stage, int] = {}
        self._seq: dict[Stage, int] = {}

    # -- what the engine tells us ---------------------------------------------------------
    def on_workers(self, workers: Sequence[WorkerView], now: float) -> None:
        live = [w for w in workers if w.id not in self._removed]
        super().on_workers(live, now)
        for w in live:
            for st in w.stages:
                self._worker_stage.setdefault(w.id, st)

    def on_placement(self, change: PlacementChange, ok: bool, seconds: float, now: float) -> None:
        if change.action == "load":
            self._loading.discard(change.worker)
            self._pending_load.pop(change.worker, None)
            server = self.worker_server[change.worker]
            self.cache.page[server].add(change.stage)
            self._loaded(server, change.stage, now)

    def _loaded(self, server: int, stage: Stage, now: float) -> None:
        """A load of ``stage`` on ``server`` is done (QUART caches key stages there)."""

    def _enqueue(self, stage: Stage, seq: int, request: Request) -> None:
        super()._enqueue(stage, seq, request)
        self._stats[stage].arrivals += 1
        if self.arrival_times is not None:
            self.arrival_times[stage].append(request.arrival if stage.first else self._now)

    _now = 0.0

    def on_arrival(self, request: Request, now: float) -> None:
        self._now = now
        super().on_arrival(request, now)

    def on_completion(self, batch: Batch, now: float, summaries: Mapping[int, StepSummary] | None = None) -> None:
        self._now = now
        started = self._running_since.pop(batch.instance, now)
        st = self._stats[batch.stage]
        self._seq[batch.stage] = batch.cell.seq
        st.completed += len(batch.request_ids)
        st.busy_s += now - started
        total = self.totals[batch.stage]
        total.steps += 1
        total.busy_s += now - started
        total.priced_s += self.profile(batch.stage).latency(batch.cell)
        super().on_completion(batch, now, summaries)

    # -- the simulator's binding ------------------------------------------------------------
    def planned_load_seconds(self, stage: Stage) -> float:
        """How long the load of ``stage`` just planned takes (pass as ``simulate(load_time=)``):
        the loads of one plan are answered in the order they were planned; asked again when
        none is pending, the last one's time."""
        q = self._planned_loads.get(stage)
        if q:
            self._last_load_s[stage] = q.popleft()
        return self._last_load_s.get(stage, 0.0)

    # -- measurements ------------------------------------------------------------------------
    def profile(self, stage: Stage) -> LatencyProfile:
        """The cost model's profile of ``stage``'s steps (the model's for a whole stage)."""
        return self.cost.latency[stage.model if stage.whole else stage.label()]

    def metrics(self):
        """Per stage: replicas (live, loading and coming), ready replicas, queued requests and
        its :class:`StageTotals`; the loads planned so far by where the policy expects the
        parameters from (``cache``, ``page``, ``cold``: :meth:`ParameterCache.source`)."""
        for s in self.stages:
            label = {"stage": s.label()}
            yield "quart_replicas", label, float(self.replicas(s))
            yield "quart_ready_replicas", label, float(len(self.ready_replicas(s)))
            yield "quart_queued", label, float(self.queued(s))
            total = self.totals[s]
            yield "quart_stage_steps", label, float(total.steps)
            yield "quart_stage_busy_seconds", label, total.busy_s
            yield "quart_stage_priced_seconds", label, total.priced_s
        planned = {"cache": 0, "page": 0, "cold": 0}
        for _, action, _, _, source in self.events:
            if action == "load":
                planned[source] = planned.get(source, 0) + 1
        for source, n in planned.items():
            yield "quart_loads", {"source": source}, float(n)

    def replicas(self, stage: Stage) -> int:
        """Live, loading and coming replicas of ``stage``."""
        return sum(1 for w, s in self._worker_stage.items() if s == stage and w not in self._removed)

    def ready_replicas(self, stage: Stage) -> list[int]:
        return [w for w in self._holders.get(stage, ()) if w not in self._removed]

    def queued(self, stage: Stage) -> int:
        return sum(len(q) for (s, _), q in self._waiting.items() if s == stage)

    def profiled_rate(self, stage: Stage, batch: int | None = None) -> float:
        """Requests per second one replica of ``stage`` serves at ``batch`` (default 1), by
        the cost model, at the sequence bucket its steps last ran with (at first the
        largest)."""
        prof = self.profile(stage)
        grid = self.grids[stage.model]
        seq = self._seq.get(stage, grid.max_length)
        b = batch or 1
        return b / prof.latency_for(b, seq)

    def service_rate(self, stage: Stage) -> float:
        """μ_i: requests per second one replica served over the last period (busy time
        only, so batching counts), or the batch-1 profile when it was busy too little."""
        st = self._stats[stage]
        if st.busy_s >= 0.2 * self.period and st.completed:
            return max(st.completed / st.busy_s, self.profiled_rate(stage))
        return self.profiled_rate(stage)

    def free_accelerators(self) -> dict[int, int]:
        used = {s: 0 for s in self.servers}
        for w in self._worker_stage:
            if w not in self._removed:
                used[self.worker_server[w]] += 1
        return {s: self.servers[s].accelerators - used[s] for s in self.servers}

    # -- control -----------------------------------------------------------------------------
    def desired(self, now: float, dt: float, rates: Mapping[Stage, float]) -> dict[Stage, int]:
        """Replicas each stage should have now (the controller). Default: as it is."""
        return {s: self.replicas(s) for s in self.stages}

    def priority(self, stage: Stage) -> float:
        """Order in which stages get free accelerators (smaller first). Default: chain order."""
        return float(self.stages.index(stage))

    def place(self, stage: Stage, free: Mapping[int, int]) -> int | None:
        """The server for a new replica of ``stage``. Default: the most free accelerators."""
        best = max(free, key=lambda s: (free[s], -s))
        return best if free[best] > 0 else None

    def pick_removals(self, stage: Stage, count: int) -> list[int]:
        """Which replicas of ``stage`` to remove: loading ones never, idle ones first, the
        newest first."""
        ws = [w for w, s in self._worker_stage.items()
              if s == stage and w not in self._removed and w not in self._loading and w not in self._pending_load]
        ws.sort(key=lambda w: (w in self._running_since, -w))
        return ws[:count]

    def _remove(self, w: int, now: float, changes: list[PlacementChange]) -> None:
        stage = self._worker_stage.pop(w)
        self._removed.add(w)
        changes.append(PlacementChange("remove_worker", w))
        self.events.append((now, "remove", w, stage.label(), ""))

    def _reclaim_for(self, stage: Stage, free: dict[int, int], want: dict[Stage, int], now: float,
                     changes: list[PlacementChange]) -> int | None:
        """No accelerator is free for a replica ``stage`` needs: free one from another stage
        and return its server, or None (the default: a full cluster makes a stage wait)."""
        return None

    def _control(self, now: float) -> list[PlacementChange]:
        dt = self.period if self._last_control is None else max(1e-9, now - self._last_control)
        self._last_control = now
        rates = {s: self._stats[s].arrivals / dt for s in self.stages}
        want = self.desired(now, dt, rates)  # before the stats are reset: it reads service rates
        changes: list[PlacementChange] = []
        free = self.free_accelerators()
        for stage in sorted(self.stages, key=self.priority):  # scarce accelerators go to the first
            have = self.replicas(stage)
            target = max(1, min(self.max_replicas, want.get(stage, have)))
            for _ in range(target - have):
                server = self.place(stage, free)
                if server is None:
                    server = self._reclaim_for(stage, free, want, now, changes)
                if server is None:
                    break
                w = self._next_id
                self._next_id += 1
                free[server] -= 1
                self.worker_server[w] = server
                self._worker_stage[w] = stage
                self._pending_load[w] = stage
                changes.append(PlacementChange("add_worker", w))
            if target < have:
                for w in self.pick_removals(stage, have - target):
                    self._remove(w, now, changes)
        self._stats = {s: _StageStats() for s in self.stages}
        self.replica_log.append((now, tuple(self.replicas(s) for s in self.stages)))
        self.queue_log.append((now, tuple(self.queued(s) for s in self.stages)))
        return changes

    def plan(self, now: float, idle_instances: Sequence[int]) -> Plan:
        self._now = now
        changes: list[PlacementChange] = []
        if now >= self._next_control:
            changes += self._control(now)
            self._next_control = now + self.period
        idle = []
        for w in idle_instances:
            if w in self._removed:
                continue
            stage = self._pending_load.get(w)
            if stage is not None and w not in self._loading:  # up: load its stage
                self._loading.add(w)
                server = self.worker_server[w]
                source = "cold" if self.cold_always else self.cache.source(server, stage, self.use_cache)
                if source == "cache":
                    self.cache.touch(server, stage)
                seconds = self.load_model.seconds(self.stage_mb[stage], source)
                self._planned_loads.setdefault(stage, deque()).append(seconds)
                changes.append(PlacementChange("load", w, stage))
                self.events.append((now, "load", w, stage.label(), source))
                continue
            if stage is None:
                idle.append(w)
        p = super().plan(now, idle)
        for b in p.batches:
            self._running_since[b.instance] = now
        busy_removed = [c.worker for c in changes if c.action == "remove_worker"]
        if busy_removed:
            self._holders = {s: [w for w in ws if w not in self._removed] for s, ws in self._holders.items()}
        # wake for the next control step only while there is work: an idle system waits
        # for the next arrival (which runs the control step that is due), so a run ends
        busy = self._requests or self._pending_load or any(self._waiting.values())
        wake = min(p.wake_at, self._next_control) if busy else p.wake_at
        return Plan(p.batches, p.evict, wake, p.finish, tuple(changes))

    def service_time(self, batch: Batch) -> float | None:
        cores = self.cores.get(batch.stage)
        comp = getattr(self, "cpu", None)
        if cores is None or comp is None:
            return None
        prof = self.profile(batch.stage)
        return prof.latency(batch.cell) * comp.factor(cores)


class _GapCv:
    """The CV of inter-arrival gaps, exponentially weighted over about ``span`` gaps."""

    def __init__(self, span: float = 400.0) -> None:
        self.alpha = 1.0 / span
        self.last: float | None = None
        self.m1 = self.m2 = 0.0
        self.n = 0

    def add(self, t: float) -> None:
        if self.last is not None:
            g = t - self.last
            a = max(self.alpha, 1.0 / (self.n + 1))
            self.m1 += a * (g - self.m1)
            self.m2 += a * (g * g - self.m2)
            self.n += 1
        self.last = t

    def cv(self, default: float = 1.0) -> float:
        if self.n < 10 or self.m1 <= 0:
            return default
        return math.sqrt(max(self.m2 - self.m1 * self.m1, 0.0)) / self.m1


class QuartPolicy(ScalingPipeline):
    """QUART (§5-§6): key stages found by their queueing delay get replicas first, from the
    host cache; surplus replicas are reclaimed by CV-based smoothing.

    Every ``period`` seconds, per stage ``i`` of each model's chain:

    1. **Corrector (§5.1).** ``T_i`` = the larger of the M/M/c response time
       (:func:`mmc_delay`, from the period's arrival rate ``λ_i``, the measured service rate
       ``μ_i`` and the replicas ``r_i``) and the time to drain the stage's queue now
       (``q_i / (r_i μ_i) + 1/μ_i``; capped at 20 targets). ``T_target,i`` is the stage's
       share of ``target_fraction`` of the SLO (the paper says only "based on the SLO"):
       ``f (slo_s - hops * hop_s) * cost_i / cost_chain``, at least 1.05 of the stage's
       batch-1 step. Mean delays at the whole SLO put half the requests past it, so
       ``f = 0.5`` by default. A PID on
       ``(T_i - T_target,i) / T_target,i`` gives ``Δr``; ``floor(Δr)`` replicas are added when
       it is at least 1 (at most doubling the stage per period: a rate limit the paper does
       not have, against the overshoot of a 20-target error), and the stage becomes a
       *key stage* (§6.1).
    2. **Smoother (§5.2).** A stage that got no replica for ``reclaim_after`` seconds may
       lose one per period down to ``max(1, ceil(1.1 λ_i / μ_i), ceil(y'_i))``: ``y'_i`` is
       Eq. 7 (:func:`smooth_allocation`) applied to every stage's CV-based demand ``ŷ_j``,
       the fewest replicas meeting its target at its predicted CV (:func:`replicas_for`, the
       CV from :class:`CvPropagation` along the chain from the first stage's measured
       arrival CV). The paper's ``ŷ`` is "the allocation after expansion"; smoothing the
       allocation itself never lets a uniformly grown pipeline shrink, so we smooth the
       demand (Algorithm 1, line 8).
    3. **CPU compensation (§5.3).** A stage that loses a replica gets the cores
       :class:`CpuCompensator` predicts for its remaining ones (its steps are priced with
       them: :meth:`service_time`).
    4. **Placement (§6.2).** A new replica of a key stage goes where :func:`choose_server`
       says (dispersed, cached servers preferred); its load comes from the cache when its
       server holds the stage (:class:`LoadModel`), and a key stage loaded on a server is
       cached there (the KeysManager keeps it after the replica goes).
    5. **A full cluster (our decision; the paper assumes free accelerators).** When a key
       stage needs a replica and no accelerator is free, one is taken at once from the stage
       with the most surplus: ready replicas beyond the Smoother's floor for it
       (``max(1, ceil(1.1 λ_j / μ_j), ceil(y'_j))``), its delay within its target and nothing
       queued. The replica it gives up is one on a server whose cache holds the key stage
       (idle ones first, then the newest), so the new replica loads from the cache; a move
       whose replica would load from disk (seconds, with both stages short meanwhile) is not
       made, and without a cache (``use_cache=False``) none is. Without this, surplus waits
       for the Smoother's ``reclaim_after`` while the key stage's queue grows, and which stage
       starves decides the mean (bench/RESULTS.md, quart_sim, has what this changed;
       ``tests/unit/test_quart.py`` has the case).
    """

    def __init__(self, chains, grids, cost, servers, worker_server, stage_mb, *, slo_s: float,
                 hop_s: float = 0.0, pid: tuple[float, float, float] = (1.0, 0.2, 0.2),
                 cv_model: CvPropagation | None = None, cpu: CpuCompensator | None = None,
                 reclaim_after: float = 5.0, kl_slack: float = 0.75, target_fraction: float = 0.5,
                 **kw) -> None:
        super().__init__(chains, grids, cost, servers, worker_server, stage_mb, **kw)
        self.slo_s = slo_s
        self.cv_model = cv_model or CvPropagation()
        self.cpu = cpu
        self.reclaim_after = reclaim_after
        self.kl_slack = kl_slack
        self.pids = {s: PID(*pid) for s in self.stages}
        self.key_stages: dict[Stage, float] = {}  # stage -> when it last got a replica
        self._cv_in = {m: _GapCv() for m in self.chains}
        self.targets: dict[Stage, float] = {}
        for model, chain in self.chains.items():
            costs = [1.0 / self.profiled_rate(s) for s in chain]
            budget = max(slo_s - (len(chain) - 1) * hop_s, 1e-6)
            for s, c in zip(chain, costs):
                self.targets[s] = max(target_fraction * budget * c / sum(costs), 1.05 * c)
        if cpu is not None:
            self.cores = {s: cpu.base_cores for s in self.stages}
        self.last_delay: dict[Stage, float] = {}
        self.last_cv: dict[Stage, float] = {}
        self.reclaimed_for_key = 0  # replicas taken from a surplus stage for a key stage (point 5)
        # this period's arrival and service rates and Smoother floors per stage (set by desired)
        self._rates: dict[Stage, float] = {}
        self._mus: dict[Stage, float] = {}
        self._needed: dict[Stage, int] = {}

    def on_arrival(self, request: Request, now: float) -> None:
        super().on_arrival(request, now)
        self._cv_in[request.model].add(now)

    def metrics(self):
        """:meth:`ScalingPipeline.metrics`, and per stage whether it is a key stage, its target
        delay and its last estimated delay (the Corrector's), and the replicas taken from a
        surplus stage for a key stage (point 5)."""
        yield from super().metrics()
        for s in self.stages:
            label = {"stage": s.label()}
            yield "quart_key_stage", label, 1.0 if s in self.key_stages else 0.0
            yield "quart_target_seconds", label, float(self.targets[s])
            if s in self.last_delay:
                yield "quart_delay_seconds", label, float(self.last_delay[s])
        yield "quart_reclaimed_for_key", {}, float(self.reclaimed_for_key)

    def _delay(self, stage: Stage, lam: float, mu: float, r: int) -> float:
        target = self.targets[stage]
        r = max(1, r)
        backlog = self.queued(stage) / (r * mu) + 1.0 / mu
        return min(max(mmc_delay(lam, mu, r), backlog), 20.0 * target)

    def desired(self, now, dt, rates):
        want: dict[Stage, int] = {}
        self._rates = dict(rates)
        self._mus, self._needed = {}, {}
        for model, chain in self.chains.items():
            mus = [self.service_rate(s) for s in chain]
            self._mus.update(zip(chain, mus))
            live = [max(1, len(self.ready_replicas(s))) for s in chain]
            rhos = [rates[s] / (r * mu) for s, r, mu in zip(chain, live, mus)]
            cvs = self.cv_model.chain(self._cv_in[model].cv(), rhos, live)
            alloc = []
            for s, mu, r_live in zip(chain, mus, live):
                r = self.replicas(s)
                t = self._delay(s, rates[s], mu, r_live)
                self.last_delay[s] = t
                target = self.targets[s]
                dr = self.pids[s].update((t - target) / target, dt)
                add = min(int(math.floor(dr)), max(1, r)) if dr >= 1 else 0  # at most double per period
                if add and r > r_live:  # replicas still coming count against the correction
                    add = max(0, add - (r - r_live))
                if add:
                    self.key_stages[s] = now
                want[s] = r + add
                alloc.append(float(want[s]))
            needs = [float(replicas_for(rates[s], mu, self.targets[s], cv, 0.3, limit=self.max_replicas))
                     for s, mu, cv in zip(chain, mus, cvs)]
            smooth = smooth_allocation(needs, cvs)
            for s, mu, cv, y in zip(chain, mus, cvs, smooth):
                self.last_cv[s] = cv
                r = want[s]
                stable = math.ceil(1.1 * rates[s] / mu - 1e-9)
                floor_ = self._needed[s] = max(1, stable, math.ceil(y - 1e-9))
                if r <= 1 or now - self.key_stages.get(s, -math.inf) < self.reclaim_after:
                    continue
                if r > len(self.ready_replicas(s)):
                    continue  # do not reclaim while replicas are still coming up
                if floor_ < r:
                    want[s] = r - 1
                    self.pids[s].reset()
                    if self.cpu is not None:
                        self.cores[s] = self.cpu.cores(rates[s], mu, r - 1)
                elif self.cpu is not None and rates[s] < 0.5 * (r * mu):
                    self.cores[s] = self.cpu.base_cores
        return want

    def _reclaim_for(self, stage, free, want, now, changes):
        if not self.use_cache:
            return None
        rates, mus, needed = self._rates, self._mus, self._needed
        best = None  # (-surplus, chain position, worker)
        for i, s in enumerate(self.stages):
            if s == stage or s not in needed or self.queued(s) or self.last_delay.get(s, 0.0) > self.targets[s]:
                continue
            ready = len(self.ready_replicas(s))
            if ready < self.replicas(s):
                continue  # replicas still coming up: its need is not settled
            surplus = min(ready, want.get(s, ready)) - needed[s]
            if surplus <= 0:
                continue
            w = next((w for w in self.pick_removals(s, ready) if self.cache.holds(self.worker_server[w], stage)), None)
            if w is not None and (best is None or (-surplus, i) < best[:2]):
                best = (-surplus, i, w)
        if best is None:
            return None
        w = best[2]
        donor, server = self._worker_stage[w], self.worker_server[w]
        self._remove(w, now, changes)
        want[donor] = self.replicas(donor)
        self.pids[donor].reset()
        if self.cpu is not None:
            self.cores[donor] = self.cpu.cores(rates[donor], mus[donor], want[donor])
        free[server] += 1
        self.reclaimed_for_key += 1
        return server

    def priority(self, stage):
        """Key stages first: the largest normalised excess delay gets accelerators first."""
        t = self.last_delay.get(stage)
        return 0.0 if t is None else -(t - self.targets[stage]) / self.targets[stage]

    def place(self, stage, free):
        counts = {srv: 0 for srv in self.servers}
        for w, s in self._worker_stage.items():
            if s == stage and w not in self._removed:
                counts[self.worker_server[w]] += 1
        cached = [srv for srv in self.servers if self.cache.holds(srv, stage)] if self.use_cache else []
        return choose_server(counts, free, cached, self.kl_slack)

    def _loaded(self, server, stage, now):
        if self.use_cache and stage in self.key_stages:
            self.cache.insert(server, stage, self.stage_mb[stage])


def _keep_alive_target(high_since: dict, keep_alive: float, now: float, stage: Stage, replicas: int,
                       need: int) -> int:
    """The baselines' scaling rule: up to ``need`` at once; down one replica per period only after
    the demand has stayed below the current count for ``keep_alive`` seconds."""
    if need >= replicas:
        high_since[stage] = now
        return need
    if now - high_since.get(stage, -math.inf) >= keep_alive:
        return replicas - 1
    return replicas


class InflessLike(ScalingPipeline):
    """Our reading of INFless (ASPLOS'22) as the QUART paper uses it: whole-model replicas
    (one stage per model), autoscaled on QPS: every period ``ceil(λ / (util * μ_max))``
    replicas, ``μ_max`` the profiled throughput of one replica at its largest batch (INFless
    batches, and sizes instances from the profile); scale-out at once, scale-in one replica
    per period after the demand stayed lower for ``keep_alive`` seconds; every new replica
    is a cold start from disk (no parameter cache). INFless's operator fusion and its
    CPU/GPU instance mix are not modelled."""

    def __init__(self, chains, grids, cost, servers, worker_server, stage_mb, *, util: float = 0.8,
                 keep_alive: float = 10.0, **kw) -> None:
        kw.setdefault("use_cache", False)
        kw.setdefault("cold_always", True)
        super().__init__(chains, grids, cost, servers, worker_server, stage_mb, **kw)
        self.util, self.keep_alive = util, keep_alive
        self._high_since: dict[Stage, float] = {}

    def demand(self, now: float, stage: Stage, rate: float) -> float:
        return rate

    def desired(self, now, dt, rates):
        want = {}
        for s in self.stages:
            r = self.replicas(s)
            mu = self.profiled_rate(s, self.grids[s.model].max_batch)
            need = max(1, math.ceil(self.demand(now, s, rates[s]) / (self.util * mu) - 1e-9))
            want[s] = _keep_alive_target(self._high_since, self.keep_alive, now, s, r, need)
        return want


class CocktailLike(InflessLike):
    """Our reading of Cocktail (NSDI'22) as the QUART paper uses it: whole-model replicas
    with *predictive* autoscaling. Every period it forecasts the rate ``horizon`` seconds
    ahead (the time a new replica takes to come up) by a least-squares line through the
    last ``history`` periods' rates, and provisions for the larger of the forecast and the
    current rate, at ``util`` (its weighted-ensemble predictor and model selection are not
    modelled: one model). New replicas load from disk through the page cache (warm, no
    parameter cache); scale-in as INFless-like."""

    def __init__(self, *args, horizon: float = 6.0, history: int = 10, **kw) -> None:
        kw.setdefault("cold_always", False)
        super().__init__(*args, **kw)
        self.horizon, self.history = horizon, history
        self._rates: dict[Stage, deque[tuple[float, float]]] = {s: deque(maxlen=history) for s in self.stages}

    def demand(self, now, stage, rate):
        hist = self._rates[stage]
        hist.append((now, rate))
        if len(hist) < 3:
            return rate
        t0 = hist[0][0]
        a, b = fit_linear([(1.0, t - t0) for t, _ in hist], [r for _, r in hist])
        return max(rate, a + b * (now + self.horizon - t0))


class InferlineLike(ScalingPipeline):
    """Our reading of InferLine (SoCC'20) as the QUART paper uses it: the same stage
    pipeline, provisioned per stage. Its *planner* sizes every stage once from the profile
    for a planning workload (``planned_rate`` and ``planned_cv``, as InferLine plans from a
    sample trace): the fewest replicas meeting the stage's share of the SLO
    (:func:`replicas_for`). Its *tuner* then reacts per stage to the measured arrival rate
    (the largest over the last ``envelope`` periods, InferLine's traffic envelope):
    ``ceil(λ / (util * μ))`` replicas when above the plan, back down one per period after
    ``keep_alive`` seconds. No parameter cache: loads come from disk through the page cache;
    no key stages, no CV propagation, placement on the server with most free accelerators."""

    def __init__(self, chains, grids, cost, servers, worker_server, stage_mb, *, slo_s: float,
                 planned_rate: float, planned_cv: float = 1.0, hop_s: float = 0.0, util: float = 0.8,
                 envelope: int = 5, keep_alive: float = 10.0, **kw) -> None:
        kw.setdefault("use_cache", False)
        super().__init__(chains, grids, cost, servers, worker_server, stage_mb, **kw)
        self.util, self.keep_alive = util, keep_alive
        self._recent: dict[Stage, deque[float]] = {s: deque(maxlen=envelope) for s in self.stages}
        self._high_since: dict[Stage, float] = {}
        self.planned: dict[Stage, int] = {}
        for model, chain in self.chains.items():
            costs = [1.0 / self.profiled_rate(s) for s in chain]
            budget = max(slo_s - (len(chain) - 1) * hop_s, 1e-6)
            for s, c in zip(chain, costs):
                target = budget * c / sum(costs)
                self.planned[s] = replicas_for(planned_rate, self.profiled_rate(s), target, planned_cv, 0.3,
                                               limit=self.max_replicas)

    def desired(self, now, dt, rates):
        want = {}
        for s in self.stages:
            self._recent[s].append(rates[s])
            r = self.replicas(s)
            need = max(self.planned[s],
                       math.ceil(max(self._recent[s]) / (self.util * self.profiled_rate(s)) - 1e-9))
            want[s] = _keep_alive_target(self._high_since, self.keep_alive, now, s, r, need)
        return want


def stage_cost_model(cost: CostModel, model: str, stages: Sequence[Stage],
                     layer_costs: Sequence[float] | None = None) -> CostModel:
    """``cost`` plus a profile per stage (named ``stage.label()``): each cell of ``model``'s
    profile times the stage's share of the per-layer costs (default: equal layers, as for
    BERT's identical encoder layers; embeddings and pooling are then inside the layers'
    share). A stand-in for stage profiles measured one by one."""
    whole = cost.latency[model]
    n = stages[0].num_layers
    costs = list(layer_costs) if layer_costs is not None else [1.0] * n
    total = sum(costs)
    lat = dict(cost.latency)
    for s in stages:
        share = sum(costs[s.start:s.stop]) / total
        lat[s.label()] = LatencyProfile(s.label(), {c: t * share for c, t in whole.seconds.items()})
    return CostModel(lat, cost.accuracy, cost.machine)
