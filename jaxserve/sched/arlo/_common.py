"""Helpers shared by the Arlo modules; it imports none of them, so they never import in a circle.

``_capacity`` is ``M = max{b : L(b) <= SLO}``, one instance's capacity in Eq. 3 (§3.3): the
allocation problem, the Runtime Scheduler and the INFaaS-like baseline all size with it.
"""

from __future__ import annotations

import math
from typing import Callable

_INF = math.inf


def _capacity(latency: Callable[[int], float], slo: float) -> int:
    """``max{b >= 1 : L(b) <= slo}`` (1 if even one request misses it); ``L`` is nondecreasing.
    ``<=`` holds within a relative 1e-9, so an SLO that is an exact multiple of the latency
    is met by that many requests (9 ms at 1 ms each is 9) despite ``l * b`` rounding above it."""
    slo = slo * (1.0 + 1e-9)
    lo, hi = 1, 2
    while latency(hi) <= slo:  # doubling, then bisection
        lo, hi = hi, hi * 2
        if hi > 1 << 40:
            raise ValueError("latency never exceeds the SLO")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if latency(mid) <= slo:
            lo = mid
        else:
            hi = mid
    return lo
