"""Tabi (EuroSys'23): a multi-level cascade of text encoders with calibrated confidence,
probabilistic rerouting, attention-based word pruning and a weighted ensemble.

Every request of a task runs on its *candidate*'s first (smallest) model. Its calibrated
confidence ``con`` (the top probability of the temperature-scaled head, Eq. 3: the heads
carry their temperature, fitted by NLL on validation) decides whether it returns there or
goes on to the next level (Eq. 4)::

    P_reroute(con) = 1                                  if con <= c
                   = 1 / (1 + exp(k * norm(con)))       otherwise,
    norm(con)      = (con - c) / (1 - c) - 1/2

A request that goes on is given the next model's input pruned to the words its small model
attended to (Eq. 5, computed by the runtime from the small model's own executable, which
outputs the importance vector), and its answer is the weighted ensemble (Eq. 6) of the
probabilities of every level it ran.

Decisions where the paper is silent or loose (each is tested in tests/unit/test_tabi.py):

* **The draw is seeded per request.** A request's uniform draw at level ``i`` is a hash of
  (policy seed, ``Request.seed``, ``i``): the same request (the server seeds it with its
  text's CRC32 unless the client sends ``seed``) is routed the same way every time, so an
  answer can be reproduced; the policy keeps no random state.
* **Profiling uses the expectation, not a sample.** :func:`evaluate` scores a candidate by
  the exact expected accuracy and cost over the rerouting probabilities, so selection is
  deterministic and not noisy at 2,000 validation items.
* **k.** The paper leaves the sigmoid's slope open. It is part of the candidate: profiling
  sweeps ``K_GRID`` and selection keeps the cheapest (c, k) meeting the target. Large k
  makes the rule a hard threshold at (1 + c) / 2; small k returns about half of the
  confident requests at random.
* **The c sweep.** c goes down from 0.95 in steps of 0.05 (per non-final level for three
  levels) and, as in §5, stops when the combined accuracy falls below the mean of the
  models used.
* **Selection guards against the winner's curse.** §5 picks the cheapest candidate whose
  profiled accuracy meets the target. With thousands of (c, k) combinations scored on 2,000
  validation items, the cheapest to pass is the one whose validation luck was best: on R8 the
  plain rule chose a cascade 2.1 points below MPNet on test for a 0.5-point target. So every
  candidate carries ``accuracy_se``, the standard error of its paired per-item difference in
  (expected) correctness from the reference model (the task's largest), and :func:`select`
  asks the target of ``accuracy - SELECT_Z * accuracy_se`` (:attr:`Candidate.assured`,
  ``SELECT_Z`` = 2): a candidate that agrees with the large model item for item pays nothing,
  one that differs on many items pays for the noise in its estimate.
* **Ensemble weights** (§4.3: "proportional to the accuracy on the rerouted data"): for the
  requests that exit at level ``j``, level ``l <= j`` gets weight proportional to its
  accuracy on the validation items that reached level ``j`` (computed with the expected
  routing). A request that exits at level 0 gets the first model's answer alone.
* **All steps are non-final.** A model can be the last level of one task's candidate and
  a middle level of another's, and batches mix tasks, so every step holds its requests
  and the policy finishes each with ``Plan.finish`` once it is done with it (the engine
  answers from the last step's outputs; :meth:`TabiPolicy.describe_request` replaces the
  probabilities and label by the ensemble's).
* **Batching.** Each level batches into its polymorph cells with the default deadline
  batching (:class:`~jaxserve.sched.batching.DeadlineBatching`): a rerouted request joins
  the next model's queue with its original arrival and deadline and the length of its
  pruned input, so it lands in a smaller bucket when pruning shortened it.

Pure: no JAX, no clock, no threads (DESIGN.md, "jaxserve/sched/").
"""

from __future__ import annotations

import hashlib
import itertools
import math
import struct
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence

import numpy as np

from jaxserve.sched.base import Batch, CostModel, Plan, Policy, Request, ShapeGrid, StepSummary
from jaxserve.sched.batching import DeadlineBatching

C_START, C_STEP = 0.95, 0.05  # the paper's sweep of the cut-off c (§5)
K_GRID = (2.0, 5.0, 10.0, 20.0, 50.0)  # slopes profiled (the paper leaves k open)
SELECT_Z = 2.0  # selection asks the target of accuracy - SELECT_Z * accuracy_se (see the module docstring)


def reroute_probability(con: float, c: float, k: float) -> float:
    """Eq. 4: the probability that a request of calibrated confidence ``con`` goes on."""
    if con <= c:
        return 1.0
    if c >= 1.0:
        return 0.0
    norm = (con - c) / (1.0 - c) - 0.5
    z = k * norm
    if z > 700:
        return 0.0
    return 1.0 / (1.0 + math.exp(z))


def reroute_probabilities(con: np.ndarray, c: float, k: float) -> np.ndarray:
    """:func:`reroute_probability` over an array of confidences."""
    con = np.asarray(con, np.float64)
    if c >= 1.0:
        return np.where(con <= c, 1.0, 0.0)
    norm = (con - c) / (1.0 - c) - 0.5
    p = 1.0 / (1.0 + np.exp(np.clip(k * norm, -700, 700)))
    return np.where(con <= c, 1.0, p)


def route_draw(policy_seed: int, request_seed: int, level: int) -> float:
    """The request's uniform draw in [0, 1) at ``level``: a hash, so reproducible."""
    digest = hashlib.blake2b(struct.pack("<qqq", policy_seed, request_seed, level), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def ensemble(probabilities: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Eq. 6 generalised: the weighted mean of the levels' probability vectors."""
    w = np.asarray(weights, np.float64)
    if len(w) != len(probabilities) or not (w >= 0).all() or w.sum() <= 0:
        raise ValueError(f"{len(probabilities)} levels need as many non-negative weights, not all 0; got {weights}")
    stacked = np.stack([np.asarray(p, np.float64) for p in probabilities])
    return np.tensordot(w, stacked, axes=1) / w.sum()


@dataclass(frozen=True)
class Candidate:
    """One Tabi configuration for a task (§5): its models from small to large, the cut-off
    c of every level but the last, the sigmoid slope k, the pruning degree alpha (None: no
    pruning) and, per exit level j, the ensemble weights of levels 0..j. ``accuracy`` and
    ``cost`` (mean seconds per request, batch 1) are what profiling measured."""

    task: str
    levels: tuple[str, ...]
    thresholds: tuple[float, ...] = ()
    k: float = 10.0
    alpha: float | None = None
    weights: tuple[tuple[float, ...], ...] = ()
    accuracy: float = float("nan")
    cost: float = float("nan")
    exit_shares: tuple[float, ...] = ()
    accuracy_se: float = 0.0  # of the paired difference from the reference model, on the profiling split

    @property
    def assured(self) -> float:
        """The accuracy selection holds against the target: ``accuracy - SELECT_Z * accuracy_se``."""
        return self.accuracy - SELECT_Z * self.accuracy_se

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("a candidate has at least one model")
        if len(self.thresholds) != len(self.levels) - 1:
            raise ValueError(f"{len(self.levels)} levels need {len(self.levels) - 1} cut-offs, "
                             f"got {len(self.thresholds)}")
        if any(not 0.0 <= c <= 1.0 for c in self.thresholds):
            raise ValueError(f"cut-offs must lie in [0, 1]: {self.thresholds}")
        weights = self.weights or tuple((1.0,) * (j + 1) for j in range(len(self.levels)))
        if len(weights) != len(self.levels) or any(len(w) != j + 1 for j, w in enumerate(weights)):
            raise ValueError("weights: one tuple per exit level j, of j + 1 weights")
        object.__setattr__(self, "weights", tuple(tuple(float(x) for x in w) for w in weights))
        if self.alpha is not None and self.alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")

    def name(self) -> str:
        chain = ">".join(self.levels)
        cuts = ",".join(f"{c:.2f}" for c in self.thresholds)
        prune = "" if self.alpha is None else f" alpha={self.alpha:.1f}"
        return chain + (f" c={cuts} k={self.k:g}" if cuts else "") + prune

    def to_json(self) -> dict:
        return {"task": self.task, "levels": list(self.levels), "thresholds": list(self.thresholds), "k": self.k,
                "alpha": self.alpha, "weights": [list(w) for w in self.weights], "accuracy": self.accuracy,
                "cost": self.cost, "exit_shares": list(self.exit_shares), "accuracy_se": self.accuracy_se}

    @classmethod
    def from_json(cls, raw: Mapping) -> "Candidate":
        return cls(task=raw["task"], levels=tuple(raw["levels"]), thresholds=tuple(raw["thresholds"]),
                   k=float(raw["k"]), alpha=raw.get("alpha"), weights=tuple(tuple(w) for w in raw["weights"]),
                   accuracy=float(raw.get("accuracy", "nan")), cost=float(raw.get("cost", "nan")),
                   exit_shares=tuple(raw.get("exit_shares", ())), accuracy_se=float(raw.get("accuracy_se", 0.0)))


# -- offline profiling and selection (§5) ------------------------------------------------------


@dataclass(frozen=True)
class LevelData:
    """What profiling saved of one model on one split of a task: calibrated probabilities
    [N, C] of the full input, and (for a model that may come after another) the
    probabilities on pruned inputs, per alpha. ``cost``: mean seconds per request at batch
    1 on full inputs; ``pruned_cost``: per alpha."""

    probabilities: np.ndarray
    cost: float
    pruned_probabilities: Mapping[float, np.ndarray] = field(default_factory=dict)
    pruned_cost: Mapping[float, float] = field(default_factory=dict)


def reach_probabilities(levels: Sequence[str], thresholds: Sequence[float], k: float,
           data: Mapping[str, LevelData]) -> list[np.ndarray]:
    """Per level j, each item's probability of reaching it (expected routing)."""
    reach = [np.ones(len(data[levels[0]].probabilities))]
    for j, c in enumerate(thresholds):
        con = data[levels[j]].probabilities.max(axis=1)
        reach.append(reach[-1] * reroute_probabilities(con, c, k))
    return reach


def evaluate(levels: Sequence[str], thresholds: Sequence[float], k: float, alpha: float | None,
             data: Mapping[str, LevelData], labels: np.ndarray,
             weights: Sequence[Sequence[float]] | None = None) -> dict:
    """Expected accuracy, mean cost and exit shares of a cascade on one split, and the
    ensemble weights §4.3 derives from it (when ``weights`` is None). Levels after the first
    see pruned inputs when ``alpha`` is set (their ``pruned_probabilities[alpha]``)."""
    labels = np.asarray(labels)
    probs = [data[levels[0]].probabilities]
    costs = [data[levels[0]].cost]
    for m in levels[1:]:
        if alpha is None:
            probs.append(data[m].probabilities)
            costs.append(data[m].cost)
        else:
            probs.append(data[m].pruned_probabilities[alpha])
            costs.append(data[m].pruned_cost[alpha])
    reach = reach_probabilities(levels, thresholds, k, {m: LevelData(p, 0.0) for m, p in zip(levels, probs)})
    n_levels = len(levels)
    exit_p = [reach[j] - (reach[j + 1] if j + 1 < n_levels else 0.0) for j in range(n_levels)]
    correct = [(p.argmax(axis=1) == labels).astype(np.float64) for p in probs]
    if weights is None:
        derived = []
        for j in range(n_levels):
            w = exit_p[j]
            if w.sum() <= 0:
                derived.append((1.0,) * (j + 1))
                continue
            accs = [float((w * correct[l]).sum() / w.sum()) for l in range(j + 1)]
            derived.append(tuple(a if a > 0 else 1e-6 for a in accs) if j > 0 else (1.0,))
        weights = derived
    item_correct = np.zeros(len(labels))
    for j in range(n_levels):
        mix = ensemble(probs[: j + 1], weights[j]) if j > 0 else probs[0]
        item_correct += exit_p[j] * (mix.argmax(axis=1) == labels)
    accuracy = float(item_correct.mean())
    cost = float(sum(costs[j] * reach[j].mean() for j in range(n_levels)))
    return {"accuracy": accuracy, "cost": cost, "exit_shares": tuple(float(e.mean()) for e in exit_p),
            "weights": tuple(tuple(float(x) for x in w) for w in weights), "item_correct": item_correct}


def paired_se(item_correct: np.ndarray, reference_correct: np.ndarray) -> float:
    """Standard error of the mean of the per-item difference in (expected) correctness."""
    d = np.asarray(item_correct, np.float64) - np.asarray(reference_correct, np.float64)
    return float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else 0.0


def profile_candidates(task: str, chains: Iterable[Sequence[str]], data: Mapping[str, LevelData],
                       labels: np.ndarray, alphas: Sequence[float | None] = (None,),
                       k_grid: Sequence[float] = K_GRID, reference: str | None = None) -> list[Candidate]:
    """Every candidate §5 profiles for ``task`` on a validation split: each chain (a single
    model is a chain of one) over its cut-offs (swept down from 0.95 by 0.05 per non-final
    level until the combined accuracy falls below the mean of its models'), each k and
    each alpha the data has. ``accuracy_se`` is taken against ``reference`` (default: the most
    accurate single model of ``data``)."""
    labels = np.asarray(labels)
    correct = {m: (d.probabilities.argmax(axis=1) == labels).astype(np.float64) for m, d in data.items()}
    single = {m: float(c.mean()) for m, c in correct.items()}
    ref = correct[reference or max(single, key=single.get)]
    out = []
    for chain in chains:
        chain = tuple(chain)
        if len(chain) == 1:
            out.append(Candidate(task, chain, accuracy=single[chain[0]], cost=data[chain[0]].cost,
                                 exit_shares=(1.0,), accuracy_se=paired_se(correct[chain[0]], ref)))
            continue
        floor = float(np.mean([single[m] for m in chain]))
        cuts = [round(C_START - C_STEP * i, 2) for i in range(int(C_START / C_STEP) + 1)]
        for alpha in alphas:
            if alpha is not None and any(alpha not in data[m].pruned_probabilities for m in chain[1:]):
                continue
            for k in k_grid:
                for thresholds in itertools.product(cuts, repeat=len(chain) - 1):
                    ev = evaluate(chain, thresholds, k, alpha, data, labels)
                    if ev["accuracy"] < floor:
                        continue  # the paper's early stop, applied per combination
                    out.append(Candidate(task, chain, tuple(thresholds), k, alpha, ev["weights"], ev["accuracy"],
                                         ev["cost"], ev["exit_shares"], paired_se(ev["item_correct"], ref)))
    return out


def pareto(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates no other one beats on both assured accuracy and cost (ties kept once, by
    name), plus every single model (the baselines choose among those). :func:`select` always
    picks from this set, so a profile keeps only it."""
    out, best = [], -math.inf
    for c in sorted(candidates, key=lambda c: (c.cost, -c.assured, -c.accuracy, c.name())):
        if c.assured > best:
            out.append(c)
            best = c.assured
    singles = [c for c in candidates if len(c.levels) == 1 and c not in out]
    return out + singles


def select(candidates: Sequence[Candidate], target_accuracy: float, max_cost: float = math.inf) -> Candidate:
    """The cheapest candidate whose assured accuracy (:attr:`Candidate.assured`) meets the
    target, within the latency bound (§5's online selection, guarded as the module docstring
    says); when none meets it, the one of highest assured accuracy within the bound."""
    fits = [c for c in candidates if c.cost <= max_cost]
    if not fits:
        raise ValueError(f"no candidate's mean cost is within {max_cost * 1e3:.1f} ms")
    meeting = [c for c in fits if c.assured >= target_accuracy]
    if meeting:
        return min(meeting, key=lambda c: (c.cost, -c.assured, len(c.levels)))
    return max(fits, key=lambda c: (c.assured, -c.cost))


# -- the serving policy -----------------------------------------------------------------------


@dataclass
class _Route:
    task: str
    seed: int
    arrival: float
    deadline: float
    level: int = 0
    probabilities: list = field(default_factory=list)  # per level run
    confidences: list = field(default_factory=list)
    pruned_tokens: int = 0
    done: bool = False


class TabiPolicy(Policy):
    """Serves each task with its :class:`Candidate` (see the module docstring).

    Args:
        candidates: per task, its cascade.
        grids: every model's shape grid (each level batches into its cells).
        cost_model: the models' profiled cell latencies.
        labels: per task, its head's label names, in the order of the probabilities.
        seed: the policy's part of every routing draw.
    """

    def __init__(self, candidates: Mapping[str, Candidate], grids: Mapping[str, ShapeGrid], cost_model: CostModel,
                 labels: Mapping[str, Sequence[str]], max_queue: int = 1024, max_wait: float = 0.005,
                 seed: int = 0) -> None:
        for task, cand in candidates.items():
            if cand.task != task:
                raise ValueError(f"candidate for {task!r} says it serves {cand.task!r}")
            missing = [m for m in cand.levels if m not in grids]
            if missing:
                raise ValueError(f"task {task!r}: its cascade needs {missing}, which are not served")
            if task not in labels:
                raise ValueError(f"task {task!r} has no label names")
        self.candidates = dict(candidates)
        self.labels = {t: tuple(v) for t, v in labels.items()}
        self.seed = int(seed)
        self.batching = DeadlineBatching(grids, cost_model, max_queue=max_queue, max_wait=max_wait)
        self._routes: dict[int, _Route] = {}
        self._finish: list[int] = []
        self._requests: dict[int, Request] = {}
        self.exits: dict[str, list[int]] = {t: [0] * len(c.levels) for t, c in candidates.items()}
        self.tokens_in = 0  # tokens of the rerouted requests' inputs before and after pruning
        self.tokens_pruned = 0

    def reprice(self, cost_model: CostModel, now: float) -> None:
        """Every level's batching plans with the engine's measured prices from now on (the
        cascade's choice, made from the cascade profile at start, stays)."""
        self.batching.reprice(cost_model, now)

    def first_model(self, task: str) -> str:
        return self.candidate(task).levels[0]

    def candidate(self, task: str) -> Candidate:
        try:
            return self.candidates[task]
        except KeyError:
            raise KeyError(f"unknown task {task!r}; the cascade serves {sorted(self.candidates)}") from None

    def admits(self, model: str) -> bool:
        return self.batching.admits(model)

    def queue_depth(self) -> int:
        return self.batching.queue_depth()

    def on_arrival(self, request: Request, now: float) -> None:
        cand = self.candidate(request.task)
        if request.model != cand.levels[0]:
            raise ValueError(f"task {request.task!r} starts on {cand.levels[0]!r}, not {request.model!r}")
        self.batching.on_arrival(request, now)
        self._routes[request.id] = _Route(request.task, request.seed, request.arrival, request.deadline)
        self._requests[request.id] = request

    def withdraw(self, request_id: int, now: float) -> bool:
        if self.batching.withdraw(request_id, now) or request_id in self._finish:
            if request_id in self._finish:
                self._finish.remove(request_id)
            self._forget(request_id)
            return True
        return False

    def _forget(self, request_id: int) -> None:
        self._routes.pop(request_id, None)
        self._requests.pop(request_id, None)

    def on_completion(self, batch: Batch, now: float, summaries: Mapping[int, StepSummary] | None = None) -> None:
        for rid in batch.request_ids:
            route = self._routes.get(rid)
            if route is None:
                continue
            summary = None if summaries is None else summaries.get(rid)
            if summary is None or summary.probabilities is None:  # the step failed: the engine answered it
                self._forget(rid)
                continue
            cand = self.candidates[route.task]
            probs = np.asarray(summary.probabilities, np.float64)
            route.probabilities.append(probs)
            route.confidences.append(float(probs.max()))
            level = route.level
            last = level == len(cand.levels) - 1
            go_on = not last and route_draw(self.seed, route.seed, level) < reroute_probability(
                route.confidences[-1], cand.thresholds[level], cand.k)
            if not go_on:
                self.exits[route.task][level] += 1
                self._finish.append(rid)
                continue
            nxt = cand.levels[level + 1]
            request = self._requests[rid]
            length = dict(summary.next_lengths).get(nxt, request.length)
            if level == 0:
                self.tokens_in += length + summary.pruned_tokens
                self.tokens_pruned += summary.pruned_tokens
                route.pruned_tokens = summary.pruned_tokens
            route.level += 1
            moved = replace(request, model=nxt, length=length)
            self._requests[rid] = moved
            self.batching.on_arrival(moved, now)

    def plan(self, now: float, idle_instances: Sequence[int]) -> Plan:
        inner = self.batching.plan(now, idle_instances)
        batches = tuple(replace(b, final=False) for b in inner.batches)
        for rid in inner.evict:
            self._forget(rid)
        finish, self._finish = tuple(self._finish), []
        return Plan(batches, inner.evict, inner.wake_at, finish)

    def describe_request(self, request_id: int) -> dict:
        """The answer's cascade part: the ensemble's probabilities and label, the models that
        ran, each level's calibrated confidence and the tokens pruned from the input the
        next level got. Called once, when the request is answered."""
        route = self._routes.get(request_id)
        if route is None or not route.probabilities:
            return {}
        self._forget(request_id)
        cand = self.candidates[route.task]
        ran = len(route.probabilities)
        mix = route.probabilities[0] if ran == 1 else ensemble(route.probabilities, cand.weights[ran - 1])
        names = self.labels[route.task]
        top = int(np.argmax(mix[: len(names)]))
        return {"label": names[top], "probabilities": [float(x) for x in mix[: len(names)]],
                "levels": list(cand.levels[:ran]), "confidence": route.confidences[-1],
                "confidences": route.confidences, "pruned_tokens": route.pruned_tokens}

    def metrics(self):
        for task, counts in self.exits.items():
            total = sum(counts)
            for level, n in enumerate(counts):
                model = self.candidates[task].levels[level]
                yield ("exit_share", {"task": task, "level": str(level), "model": model}, n / total if total else 0.0)
        yield ("pruned_token_share", {}, self.tokens_pruned / self.tokens_in if self.tokens_in else 0.0)


# -- what a server or a simulation serves: the cascade profile, and each policy's choice --------


@dataclass(frozen=True)
class TaskProfile:
    """One task of a cascade profile: its label names, the default accuracy target (the
    largest model's validation accuracy minus 0.5 points) and every candidate profiled on
    validation (each with its test-split figures in ``test``, when measured)."""

    labels: tuple[str, ...]
    target_accuracy: float
    candidates: tuple[Candidate, ...]
    test: Mapping[str, Mapping] = field(default_factory=dict)


def load_cascade_profile(path) -> dict[str, TaskProfile]:
    """The tasks of a cascade profile file (``jaxserve profile --cascade`` writes it)."""
    import json
    from pathlib import Path

    raw = json.loads(Path(path).read_text())
    return {task: TaskProfile(tuple(t["labels"]), float(t["target_accuracy"]),
                              tuple(Candidate.from_json(c) for c in t["candidates"]), t.get("test", {}))
            for task, t in raw["tasks"].items()}


def choose(policy: str, task: TaskProfile, target_accuracy: float | None = None,
           max_cost: float = math.inf) -> Candidate:
    """The candidate ``policy`` serves a task with: ``tabi`` the cheapest meeting the target
    (§5); ``tabi-small`` / ``tabi-large`` the first / last model of Tabi's choice alone;
    ``tabi-infaas`` the cheapest single model meeting the target (INFaaS' selection, one
    variant per accuracy target and SLO); ``tabi-cocktail`` every profiled model on every
    request (:func:`cocktail`; it ignores the target and ``max_cost``)."""
    target = task.target_accuracy if target_accuracy is None else target_accuracy
    singles = [c for c in task.candidates if len(c.levels) == 1]
    if policy == "tabi-infaas":
        return select(singles, target, max_cost)
    if policy == "tabi-cocktail":
        return cocktail(singles)
    chosen = select(task.candidates, target, max_cost)
    if policy == "tabi":
        return chosen
    model = {"tabi-small": chosen.levels[0], "tabi-large": chosen.levels[-1]}.get(policy)
    if model is None:
        raise ValueError(f"unknown cascade policy {policy!r}")
    return next(c for c in singles if c.levels == (model,))


def cocktail(singles: Sequence[Candidate]) -> Candidate:
    """The Cocktail-like baseline (NSDI'22 as the Tabi paper compares against it): an ensemble
    of every model on every request, weighted by each model's validation accuracy.

    Decision: it is a :class:`Candidate` whose cut-offs are all 1.0 (Eq. 4 then reroutes
    every request with probability 1), without pruning, its models ordered by cost and its
    last exit's weights their accuracies. It therefore runs on this engine, live and in
    simulation, like any cascade: the models run **one after the other** on a request.
    Cocktail runs them in parallel, one instance per model; a request's latency is then its
    slowest model's, at the price of one instance per model. On one CPU instance the same
    work in parallel would share the cores, so the sequential form is what this hardware
    buys; ``bench/tabi_sim.py`` also reports the parallel reading (latency = the slowest
    model's) beside it. ``accuracy`` is the mean of the models' (the ensemble's own is what
    serving or simulation measures) and ``cost`` the sum of theirs."""
    models = sorted(singles, key=lambda c: (c.cost, c.levels[0]))
    if not models:
        raise ValueError("the Cocktail-like ensemble needs at least one profiled single model")
    n = len(models)
    weights = tuple((1.0,) * (j + 1) for j in range(n - 1)) + (tuple(max(c.accuracy, 1e-6) for c in models),)
    return Candidate(models[0].task, tuple(c.levels[0] for c in models), (1.0,) * (n - 1), alpha=None,
                     weights=weights, accuracy=float(np.mean([c.accuracy for c in models])),
                     cost=float(sum(c.cost for c in models)), exit_shares=(0.0,) * (n - 1) + (1.0,))


class Replay:
    """The outputs a simulated cascade step gets (``simulate(..., summary_of=...)``), replayed
    from real ones: per test item, every model's calibrated probabilities on the full text and
    (for the models after a first level) on that first level's pruned text, and the token
    lengths (``training/profile_cascade.py`` writes them, ``<task>-replay.npz``). Request ``r``
    of a simulated trace is test item ``items[r]``."""

    def __init__(self, arrays: Mapping[str, np.ndarray], candidate: Candidate, items: np.ndarray):
        self.arrays = arrays
        self.candidate = candidate
        self.items = np.asarray(items)
        self.labels = np.asarray(arrays["labels"])
        self._first = candidate.levels[0]

    @classmethod
    def load(cls, path, candidate: Candidate, items: np.ndarray) -> "Replay":
        with np.load(path) as z:
            return cls({k: z[k] for k in z.files}, candidate, items)

    def _key(self, kind: str, model: str) -> str:
        pruned = f"{kind}/{model}|pruned-by|{self._first}"
        if model != self._first and self.candidate.alpha is not None and pruned in self.arrays:
            return pruned
        return f"{kind}/{model}"

    def length(self, model: str, item: int) -> int:
        return int(self.arrays[self._key("length", model)][item])

    def first_lengths(self) -> np.ndarray:
        """The first level's token lengths of the trace's requests."""
        return self.arrays[f"length/{self._first}"][self.items].astype(np.int64)

    def __call__(self, request_id: int, batch) -> StepSummary:
        item = int(self.items[request_id])
        probs = tuple(float(x) for x in self.arrays[self._key("probs", batch.model)][item])
        levels = self.candidate.levels
        at = levels.index(batch.model)
        nxt, pruned = (), 0
        if at + 1 < len(levels):
            m = levels[at + 1]
            n = self.length(m, item)
            nxt = ((m, n),)
            if at == 0:
                pruned = max(0, int(self.arrays[f"length/{m}"][item]) - n)
        return StepSummary(max(probs), None, probs, nxt, pruned)
