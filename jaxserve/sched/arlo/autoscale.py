"""Arlo's autoscaling (§4, "Resource scaling"): target tracking on the p98 latency of recently
completed requests. The thresholds and our cooldown are on :class:`TargetTrackingAutoscaler`;
who applies a decision is :class:`~jaxserve.sched.arlo.policy.ArloPolicy`'s concern
(``scale_pool``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from jaxserve.sched.arlo._common import _INF


@dataclass(frozen=True)
class ScaleDecision:
    """``"out"``: add an instance of ``runtime`` (the longest); ``"in"``: release one.

    For ``"in"`` the policy fills ``instance`` with its least busy instance.
    """

    time: float
    action: str
    runtime: int | None = None
    instance: int | None = None
    p98: float = math.nan


class TargetTrackingAutoscaler:
    """Target tracking on the p98 latency of recently completed requests (§4).

    Evaluated at most every ``interval`` seconds (calls in between return ``None``),
    on the completions of the last ``window`` seconds (p98 by nearest rank):

    * p98 ``>= scale_out_at * SLO`` (0.95) -> ``"out"`` (an instance of the longest
      runtime), then no further scale-out for ``cooldown`` seconds (our choice: the
      paper gives none, and without one every evaluation would add another instance
      before the first one could help).
    * p98 ``< scale_in_below * SLO`` (0.5) at *every* evaluation for
      ``scale_in_period`` seconds (60) -> ``"in"``; the 60 s then start again. An
      empty window (no completions) counts as below the target.
    * never below ``min_instances`` nor above ``max_instances``.
    """

    def __init__(
        self,
        slo: float,
        *,
        window: float = 10.0,
        interval: float = 1.0,
        scale_out_at: float = 0.95,
        scale_in_below: float = 0.5,
        scale_in_period: float = 60.0,
        cooldown: float = 10.0,
        min_instances: int = 1,
        max_instances: int | None = None,
        longest_runtime: int | None = None,
    ) -> None:
        self.slo = float(slo)
        self.window, self.interval = float(window), float(interval)
        self.scale_out_at, self.scale_in_below = float(scale_out_at), float(scale_in_below)
        self.scale_in_period, self.cooldown = float(scale_in_period), float(cooldown)
        self.min_instances, self.max_instances = int(min_instances), max_instances
        self.longest_runtime = longest_runtime
        self._obs: deque[tuple[float, float]] = deque()
        self._last_eval = -_INF
        self._last_out = -_INF
        self._below_since: float | None = None

    def observe(self, latency: float, now: float) -> None:
        self._obs.append((now, float(latency)))

    def p98(self, now: float) -> float | None:
        obs, horizon = self._obs, now - self.window
        while obs and obs[0][0] <= horizon:
            obs.popleft()
        if not obs:
            return None
        values = sorted(v for _, v in obs)
        return values[max(0, math.ceil(0.98 * len(values)) - 1)]

    def decide(self, now: float, instances: int) -> ScaleDecision | None:
        if now - self._last_eval < self.interval:
            return None
        self._last_eval = now
        p = self.p98(now)
        if p is not None and p >= self.scale_out_at * self.slo:
            self._below_since = None
            if now - self._last_out >= self.cooldown and (
                self.max_instances is None or instances < self.max_instances
            ):
                self._last_out = now
                return ScaleDecision(now, "out", self.longest_runtime, None, p)
            return None
        if p is None or p < self.scale_in_below * self.slo:
            if self._below_since is None:
                self._below_since = now
            if now - self._below_since >= self.scale_in_period and instances > self.min_instances:
                self._below_since = now
                return ScaleDecision(now, "in", None, None, math.nan if p is None else p)
            return None
        self._below_since = None
        return None
