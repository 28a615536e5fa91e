"""Runtime groups: Arlo's allocation when an instance may run several runtimes (§3.3, adapted).

The paper gives each GPU exactly one runtime, because co-located runtimes interfere on a GPU
(§3.3, last paragraphs), and sizes the runtimes with Eq. 1-7, a fluid model that assumes every
runtime gets enough instances to absorb its share of the traffic. Neither holds for a user of
jaxserve: every executable of the grid is compiled and loaded on every worker (a switch costs
nothing), one worker runs one batch at a time (nothing to interfere with), and the serve default
is 2 instances for 9 runtimes. One runtime per instance then forces most requests onto a longer
runtime than their own (measured in bench/RESULTS.md, ``arlo_short``: 2.9-3.2x padding and a
fifth or more of the requests late at 30 % load).

So, deliberately unlike the paper, instances serve **runtime groups**: the runtimes are cut into
contiguous ranges of buckets, each range gets ``N_g >= 1`` instances, and an instance of a group
runs every runtime of its range, each batch in its own requests' bucket (no padding beyond the
bucket). Inside a group the requests wait in shared per-runtime queues and are batched by the
project's deadline-aware batching (:class:`~jaxserve.sched.batching.DeadlineBatching`); see
:class:`~jaxserve.sched.arlo.policy.ArloPolicy`. The allocation is still "instances per runtime" (:class:`~.allocation.Allocation`'s
``counts``): a group's instances sit on its *longest* runtime, and the deployed runtimes delimit
the groups (runtime ``i`` belongs to the first deployed runtime ``>= i``), so the replacement
plan (§4), Alg. 1's levels (§3.4: "demotion" is to the next group, and costs no padding) and
Eq. 7 (the longest runtime is always deployed: every length has a group) are unchanged. With one
runtime per group this *is* the paper's deployment.

Which groups, and how many instances each, minimises an estimate of the mean latency *with
queueing* (the paper's Eq. 1 sums the service latency only; Eq. 3 keeps runtimes under their
SLO capacity, which says nothing of the waiting at 2 instances). Per group of ``n`` instances and
request rates ``lambda_s`` (from the sliding window, per bucket ``s`` of the group):

* each instance sees ``lambda_s / n`` of bucket ``s`` and batches what is queued of one bucket;
  batches of ``a_s = clip(ceil(theta lambda_s / n), 1, B_s)`` requests, where ``theta`` (the
  time a batch accumulates) is chosen to minimise the estimate: more batching costs waiting to
  fill (``(a_s - 1) / (2 lambda_s / n)`` on average) and buys utilisation
  ``rho = sum_s (lambda_s / n) t(a_s, s) / a_s``;
* waiting for an instance: M/M/n with Sakasegawa's approximation,
  ``W = rho^(sqrt(2(n+1)) - 1) / (n (1 - rho)) * S`` (``S`` the mean batch time);
* latency = service ``sum_s p_s t(a_s, s)`` + filling + ``W``; a group that cannot keep
  ``rho < 1`` even at full batches costs ``SLO * (2 + rho)`` per request (finite and increasing,
  so the solver still spreads an overload rather than give up).

Pooling (one group, many instances: small ``W``) and concentration (one bucket's requests on few
instances: fuller batches) pull in opposite directions; the exact DP over contiguous ranges
(:func:`solve_groups`) decides. Measured: while the instances keep up it chooses one group of every
runtime (35 of the 36 cells of bench/RESULTS.md ``arlo_short``); it splits when a burst would overload
one group (real lengths, 10 instances, MMPP 85 %: two groups, Arlo's mean 5 % above the default's).
With one group, Arlo's deployment is the default batching's (every instance serves every runtime from
shared per-runtime queues), so on this machine Arlo matches the default batching and does not beat it:
the paper's gains come from partitioning GPUs that cannot hold every runtime. ``B_s``, the largest batch of runtime ``s``, comes from the profile
(:func:`profile_max_batch`): the paper's runtimes take a max batch (§3.3, ``L_i`` maps the batch
size to the latency) and fix it at 1 (§5); here it is as large as the SLO allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from jaxserve.sched.arlo._common import _INF
from jaxserve.sched.base import LatencyProfile, batch_size_for

_EPS = 1e-9  # cost of an instance in a group with no traffic: spares go where the traffic is


def profile_max_batch(profile: LatencyProfile, batch_sizes: Sequence[int], seq: int, slo: float) -> int:
    """``B``: the largest batch size of ``batch_sizes`` whose latency at ``seq`` is at most half the SLO.

    Half, because a request that arrives just after a batch of its runtime started waits for
    that batch and then runs in the next one: two batch times must fit in the SLO. At least the
    smallest batch size (a runtime slower than the SLO at batch 1 still serves, late).
    """
    sizes = sorted(batch_sizes)
    best = sizes[0]
    for b in sizes:
        if profile.latency_for(b, seq) <= slo / 2:
            best = b
    return best


@dataclass(frozen=True)
class GroupAllocation:
    """Runtime groups as instances per runtime (module docstring) and what the solver estimated."""

    counts: tuple[int, ...]  # instances per runtime; a group's instances sit on its longest runtime
    groups: tuple[tuple[int, int], ...]  # (first runtime, last runtime) of each group, in order
    objective: float  # estimated latency summed over one second of traffic (s per s)
    capacity: tuple[int, ...]  # M per runtime for Alg. 1: its group's, on the group's longest runtime


class GroupCostModel:
    """The latency estimate of the module docstring for any range of runtimes and instance count.

    ``batch_sizes`` are the grid's (a batch of ``k`` requests runs, padded, in the smallest one
    that holds it); ``latency[s][k]`` is then the time of ``k`` requests of runtime ``s``
    (``k = 1..B_s``).
    """

    THETAS = 16  # accumulation times tried: 0 and SLO / 2^j, j = 0..14

    def __init__(self, profile: LatencyProfile, buckets: Sequence[int], batch_sizes: Sequence[int],
                 max_batch: Sequence[int], slo: float) -> None:
        if len(max_batch) != len(buckets):
            raise ValueError("one max batch per runtime")
        self.buckets = tuple(buckets)
        self.max_batch = tuple(int(b) for b in max_batch)
        self.slo = float(slo)
        sizes = tuple(sorted(batch_sizes))
        self.latency = [np.array([0.0] + [profile.latency_for(batch_size_for(k, sizes), s)
                                          for k in range(1, b + 1)])
                        for s, b in zip(self.buckets, self.max_batch)]
        self.thetas = np.array([0.0] + [self.slo / 2 ** j for j in range(self.THETAS - 1)])

    def full_batch_capacity(self, rates: Sequence[float]) -> int:
        """``M`` of one instance serving these runtimes' mix: requests it drains within the SLO
        at full batches (Alg. 1's congestion ``P = load / M``); the mix is uniform if ``rates``
        are all 0."""
        r = np.asarray(rates, dtype=float)
        if r.sum() <= 0:
            r = np.ones(len(r))
        per = sum(p * self.latency[s][-1] / self.max_batch[s] for s, p in enumerate(r / r.sum()) if p > 0)
        return max(1, int(self.slo / per)) if per > 0 else 1

    def group_cost(self, first: int, rates: Sequence[float], instances: int) -> np.ndarray:
        """Estimated latency summed over one second of the group's traffic, for ``n = 0..instances``
        instances (``inf`` at 0), made nonincreasing in ``n``; runtimes ``first..first+len(rates)-1``."""
        lam = np.asarray(rates, dtype=float)
        total = float(lam.sum())
        n = np.arange(1, instances + 1, dtype=float)
        out = np.empty(instances + 1)
        out[0] = _INF
        if total <= 0:
            out[1:] = _EPS * n
            return out
        th = self.thetas[:, None]  # (theta, n)
        service = np.zeros((len(self.thetas), instances))
        busy = np.zeros_like(service)  # rho
        batches = np.zeros_like(service)  # batches per second per instance
        fill = np.zeros_like(service)
        for k, ls in enumerate(lam):
            if ls <= 0:
                continue
            s = first + k
            per_inst = ls / n[None, :]
            a = np.clip(np.ceil(th * per_inst - 1e-12), 1, self.max_batch[s]).astype(np.int64)
            t = self.latency[s][a]
            service += (ls / total) * t
            busy += per_inst * t / a
            batches += per_inst / a
            fill += (ls / total) * (a - 1) / (2 * per_inst)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            mean_batch = busy / batches
            wait = np.where(busy < 1, busy ** (np.sqrt(2 * (n[None, :] + 1)) - 1) * mean_batch
                            / (n[None, :] * (1 - busy)), _INF)
        latency = np.where(busy < 1, service + fill + wait, _INF)
        best = latency.min(axis=0)
        overloaded = ~np.isfinite(best)
        best[overloaded] = self.slo * (2 + busy.min(axis=0)[overloaded])
        out[1:] = np.minimum.accumulate(total * best)  # one more instance never has to be used
        return out


def solve_groups(model: GroupCostModel, rates: Sequence[float], instances: int) -> GroupAllocation:
    """Exact DP over contiguous runtime ranges: ``F_{k+1}(x) = min_{j<=k, n>=1} F_j(x - n) +
    cost(j..k, n)``, ``F_0 = [0, inf, ...]``; the answer is ``F_K(G)`` (Eq. 2: all ``G``
    instances are used; every runtime is in exactly one group, so Eq. 7 holds)."""
    from jaxserve.sched.arlo.allocation import _minplus

    rates = [float(r) for r in rates]
    k_rt = len(rates)
    if k_rt != len(model.buckets):
        raise ValueError("one rate per runtime")
    if instances < 1:
        raise ValueError("need at least one instance")
    g = instances
    start = np.full(g + 1, _INF)
    start[0] = 0.0
    f = [start]
    back: list[tuple[np.ndarray, np.ndarray]] = []  # per end k: (first j, n) per x
    for k in range(k_rt):
        best = np.full(g + 1, _INF)
        arg_j = np.full(g + 1, -1, dtype=np.int64)
        arg_n = np.zeros(g + 1, dtype=np.int64)
        for j in range(k + 1):
            if not np.isfinite(f[j]).any():
                continue
            cost = model.group_cost(j, rates[j:k + 1], g)
            out, kk = _minplus(f[j], cost)
            out, kk = out[:g + 1], kk[:g + 1]
            better = out < best
            best[better] = out[better]
            arg_j[better] = j
            arg_n[better] = kk[better]
        f.append(best)
        back.append((arg_j, arg_n))
    if not np.isfinite(f[k_rt][g]):
        raise RuntimeError("no grouping uses every instance")  # cannot happen: one group takes all
    counts = [0] * k_rt
    groups = []
    x, k = g, k_rt - 1
    while k >= 0:
        j, n = int(back[k][0][x]), int(back[k][1][x])
        counts[k] = n
        groups.append((j, k))
        x, k = x - n, j - 1
    groups.reverse()
    return GroupAllocation(tuple(counts), tuple(groups), float(f[k_rt][g]), group_capacity(model, rates, counts))


def groups_of(counts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The groups ``counts`` deploys: each deployed runtime closes the range that starts after
    the previous one (ValueError if the longest runtime is not deployed: Eq. 7)."""
    if not counts or counts[-1] < 1:
        raise ValueError("the longest runtime must be deployed (Eq. 7)")
    out, first = [], 0
    for k, c in enumerate(counts):
        if c > 0:
            out.append((first, k))
            first = k + 1
    return tuple(out)


def group_capacity(model: GroupCostModel, rates: Sequence[float], counts: Sequence[int]) -> tuple[int, ...]:
    """``M`` per runtime for Alg. 1: a deployed runtime gets its group's full-batch capacity
    (:meth:`GroupCostModel.full_batch_capacity`), an undeployed one its own."""
    cap = [model.full_batch_capacity([0.0] * k + [1.0] + [0.0] * (len(counts) - k - 1)) for k in range(len(counts))]
    for j, k in groups_of(counts):
        cap[k] = model.full_batch_capacity([0.0] * j + list(rates[j:k + 1]) + [0.0] * (len(counts) - k - 1))
    return tuple(cap)


def grouping_objective(model: GroupCostModel, rates: Sequence[float], counts: Sequence[int]) -> float:
    """The estimate of the module docstring for given instances per runtime (groups from ``counts``)."""
    total = 0.0
    for j, k in groups_of(counts):
        total += float(model.group_cost(j, rates[j:k + 1], counts[k])[counts[k]])
    return total
