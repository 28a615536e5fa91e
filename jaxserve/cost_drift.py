"""Measured against profiled prices: the live engine's running correction of the cost model.

The cost model is profiled once (at a server's first start, or by ``jaxserve profile``) and
kept. When that profile was taken while other jobs ran, or the machine's state has changed
since (another load, other clocks, a busy HTTP path beside the workers), every policy plans
with wrong prices: measured here, a first-start profile taken under load came out a median
2.17x slower than a quiet one, and one taken on a quiet machine prices a live MiniLM batch of 1
at 7 ms where the server's workers take 12 ms beside the HTTP path.

:class:`CostDrift` keeps, per (model, cell), an exponentially weighted mean of
``log(measured / profiled)`` over the steps the engine runs, and per model the same over all
its cells. The correction of a cell is its own ratio once it has ``min_samples`` steps, else
its model's ratio once *that* has ``min_samples``, else 1 (no evidence: the profile stands).
:meth:`CostDrift.corrected` is the profile with every cell times its correction: what the
engine hands a policy through ``Policy.reprice`` whenever a correction has moved by more than
``reprice_step`` (relative) since the last hand-over, so policies plan with prices measured
where they serve, and a few noisy steps do not make them rebuild their tables.

Decisions:

* Log-space mean: a ratio of 2 and one of 0.5 cancel; an outlier step (a GC pause) moves the
  mean by ``alpha`` of its log, not of its size.
* ``alpha`` 0.05 (the last ~20 steps of a cell dominate): drift is slow (load, thermal state),
  and a correction that chased each step would make the policies' plans jitter.
* Only whole-model steps of policies that price batches by the cost model are measured (the
  engine's choice, see :class:`jaxserve.engine.Engine`): a layer range's step is not a profiled
  cell, and DT emulates its own price (``Policy.service_time``).
* The simulator never corrects: it replays the cost model it is given, as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxserve.sched.base import Cell, CostModel, LatencyProfile

WARN_RATIO = 1.3  # a model's measured/profiled ratio beyond 1.3 (or below 1/1.3) is logged as a warning


@dataclass
class RunningMean:
    """Exponentially weighted mean (here of log ratios; AsyFunc's PriceTracker also of
    seconds), with the number of samples seen. The first samples weigh 1/n, a plain mean,
    until 1/n falls below ``alpha``: the first sample is taken in full, with no bias toward
    the starting 0."""

    mean: float = 0.0
    n: int = 0

    def add(self, value: float, alpha: float) -> None:
        self.n += 1
        w = max(alpha, 1.0 / self.n)
        self.mean += w * (value - self.mean)


class CostDrift:
    """Running measured/profiled ratios of a cost model's cells (see the module docstring)."""

    def __init__(self, cost_model: CostModel, alpha: float = 0.05, min_samples: int = 8,
                 reprice_step: float = 0.05) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples!r}")
        self.cost_model = cost_model
        self.alpha = float(alpha)
        self.min_samples = int(min_samples)
        self.reprice_step = float(reprice_step)
        self._cells: dict[tuple[str, Cell], RunningMean] = {}
        self._models: dict[str, RunningMean] = {}
        self._pushed: dict[tuple[str, Cell | None], float] = {}  # the corrections last handed over
        self.reprices = 0

    def observe(self, model: str, cell: Cell, measured_s: float) -> bool:
        """Record one step of ``cell`` that took ``measured_s``; False (nothing recorded) if the
        cell is not profiled or the time is not a positive number."""
        profile = self.cost_model.latency.get(model)
        profiled = None if profile is None else profile.seconds.get(cell)
        if not profiled or not (measured_s > 0 and math.isfinite(measured_s)):
            return False
        value = math.log(measured_s / profiled)
        self._cells.setdefault((model, cell), RunningMean()).add(value, self.alpha)
        self._models.setdefault(model, RunningMean()).add(value, self.alpha)
        return True

    def model_ratio(self, model: str) -> float:
        """``model``'s measured/profiled ratio over all its cells; 1 before ``min_samples`` steps."""
        m = self._models.get(model)
        return math.exp(m.mean) if m is not None and m.n >= self.min_samples else 1.0

    def ratio(self, model: str, cell: Cell) -> float:
        """The correction of one cell: its own ratio, else its model's, else 1."""
        m = self._cells.get((model, cell))
        if m is not None and m.n >= self.min_samples:
            return math.exp(m.mean)
        return self.model_ratio(model)

    def samples(self, model: str, cell: Cell | None = None) -> int:
        m = self._models.get(model) if cell is None else self._cells.get((model, cell))
        return 0 if m is None else m.n

    def corrected(self) -> CostModel:
        """The cost model with every cell's latency times :meth:`ratio` (accuracy unchanged)."""
        latency = {name: LatencyProfile(name, {c: t * self.ratio(name, c) for c, t in p.seconds.items()})
                   for name, p in self.cost_model.latency.items()}
        return CostModel(latency=latency, accuracy=self.cost_model.accuracy, machine=self.cost_model.machine)

    def due(self, model: str, cell: Cell) -> bool:
        """Whether the corrections of ``cell`` or of its model moved by more than ``reprice_step``
        (relative) since the last :meth:`mark_pushed`: time to hand the policy new prices."""
        # a cell first measured after a push was given its model's pushed ratio then (its fallback)
        model_pushed = self._pushed.get((model, None), 1.0)
        for key, now in (((model, cell), self.ratio(model, cell)), ((model, None), self.model_ratio(model))):
            last = self._pushed.get(key, model_pushed)
            if abs(now / last - 1.0) > self.reprice_step:
                return True
        return False

    def mark_pushed(self) -> None:
        """The policy now plans with :meth:`corrected`: remember what it was given."""
        self.reprices += 1
        for (model, cell) in self._cells:
            self._pushed[(model, cell)] = self.ratio(model, cell)
        for model in self._models:
            self._pushed[(model, None)] = self.model_ratio(model)

    def outside(self, model: str, bound: float = WARN_RATIO) -> bool:
        """Whether ``model``'s ratio lies beyond ``bound`` either way (the warning's test)."""
        r = self.model_ratio(model)
        return r > bound or r < 1.0 / bound

    def rows(self):
        """``(model, cell, ratio, samples)`` for every measured cell (metrics)."""
        for (model, cell), m in sorted(self._cells.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            yield model, cell, self.ratio(model, cell), m.n
