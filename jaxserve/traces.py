"""Workload traces: when requests arrive, how long they are, and what they ask for.

A :class:`Trace` is columnar (one numpy array per field) so that a million-request
trace costs megabytes, not a million Python objects; indexing or iterating it
yields frozen :class:`TraceRequest` records. Every generator takes an explicit
``seed`` (an int or a ``numpy.random.Generator``) and is bounded by a request count
``n``, a ``duration`` in seconds, or both (whichever ends first).

Composition is explicit, one step per question::

    arrivals = gamma_arrivals(rate=200, cv=4, n=20_000, seed=1)          # when
    lengths = sample_lengths(tweet_lengths, len(arrivals), seed=2)       # how long
    trace = make_trace(arrivals, model="bert", length=lengths, slo_s=0.1)
    save_trace("trace.csv", trace)

The CSV format (replay of recorded traces) has the header
``arrival,length,slo_ms,utility[,model,task]``; arrival is in seconds.
"""

from __future__ import annotations

import csv
import math
import os
from decimal import Decimal
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence, Union

import numpy as np

__all__ = [
    "TraceRequest",
    "Trace",
    "make_trace",
    "merge_traces",
    "poisson_arrivals",
    "gamma_arrivals",
    "mmpp_arrivals",
    "fluctuating_poisson_arrivals",
    "sample_lengths",
    "save_trace",
    "load_trace",
]

Seed = Union[int, np.random.Generator, None]
_CHUNK = 8192


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace. ``slo_s`` is relative to arrival (``inf``: none)."""

    arrival: float
    length: int = 0
    slo_s: float = math.inf
    utility: float = 1.0
    model: str = ""
    task: str = ""

    @property
    def deadline(self) -> float:
        return self.arrival + self.slo_s


@dataclass(frozen=True, eq=False)
class Trace:
    """A workload, one read-only array per :class:`TraceRequest` field.

    Request ``i`` of a trace is request id ``i`` in the simulator. Arrivals are
    sorted (ties keep their order).
    """

    arrival: np.ndarray
    length: np.ndarray
    slo_s: np.ndarray
    utility: np.ndarray
    model: np.ndarray
    task: np.ndarray

    def __post_init__(self) -> None:
        n = len(np.asarray(self.arrival))
        cols = {
            "arrival": np.asarray(self.arrival, dtype=np.float64),
            "length": np.asarray(self.length, dtype=np.int64),
            "slo_s": np.asarray(self.slo_s, dtype=np.float64),
            "utility": np.asarray(self.utility, dtype=np.float64),
            "model": np.asarray(self.model, dtype=str),
            "task": np.asarray(self.task, dtype=str),
        }
        for name, col in cols.items():
            if col.shape != (n,):
                raise ValueError(f"column {name} has shape {col.shape}, expected ({n},)")
            col = col.copy() if col.flags.writeable else col
            col.setflags(write=False)
            object.__setattr__(self, name, col)
        a = self.arrival
        if n and (not np.all(np.isfinite(a)) or np.any(np.diff(a) < 0)):
            raise ValueError("arrivals must be finite and sorted")
        if np.any(self.length < 0):
            raise ValueError("lengths must be >= 0")
        if np.any(~(self.slo_s > 0)):
            raise ValueError("slo_s must be > 0 (inf for none)")

    @classmethod
    def from_requests(cls, requests: Sequence[TraceRequest]) -> "Trace":
        requests = sorted(requests, key=lambda r: r.arrival)
        return cls(
            arrival=np.array([r.arrival for r in requests], dtype=np.float64),
            length=np.array([r.length for r in requests], dtype=np.int64),
            slo_s=np.array([r.slo_s for r in requests], dtype=np.float64),
            utility=np.array([r.utility for r in requests], dtype=np.float64),
            model=np.array([r.model for r in requests] or [""], dtype=str)[: len(requests)],
            task=np.array([r.task for r in requests] or [""], dtype=str)[: len(requests)],
        )

    def __len__(self) -> int:
        return len(self.arrival)

    def __getitem__(self, i: int) -> TraceRequest:
        return TraceRequest(
            float(self.arrival[i]),
            int(self.length[i]),
            float(self.slo_s[i]),
            float(self.utility[i]),
            str(self.model[i]),
            str(self.task[i]),
        )

    def __iter__(self) -> Iterator[TraceRequest]:
        cols = (self.arrival, self.length, self.slo_s, self.utility, self.model, self.task)
        for row in zip(*(c.tolist() for c in cols)):
            yield TraceRequest(*row)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        return all(
            np.array_equal(getattr(self, f), getattr(other, f))
            for f in ("arrival", "length", "slo_s", "utility", "model", "task")
        )

    __hash__ = None  # type: ignore[assignment]

    @property
    def deadline(self) -> np.ndarray:
        return self.arrival + self.slo_s

    @property
    def duration(self) -> float:
        """Time from 0 to the last arrival."""
        return float(self.arrival[-1]) if len(self) else 0.0

    def mean_rate(self) -> float:
        """Requests per second over the trace's duration."""
        return len(self) / self.duration if len(self) and self.duration > 0 else 0.0


def make_trace(
    arrivals: np.ndarray,
    *,
    model: str | Sequence[str] = "",
    task: str | Sequence[str] = "",
    length: int | Sequence[int] = 0,
    slo_s: float | Sequence[float] = math.inf,
    utility: float | Sequence[float] = 1.0,
) -> Trace:
    """A trace from arrival times; each other field is one value or one per request."""
    arrivals = np.asarray(arrivals, dtype=np.float64)
    n = len(arrivals)

    def column(value, dtype):
        arr = np.asarray(value, dtype=dtype)
        return np.full(n, arr, dtype=arr.dtype) if arr.ndim == 0 else arr

    return Trace(
        arrival=arrivals,
        length=column(length, np.int64),
        slo_s=column(slo_s, np.float64),
        utility=column(utility, np.float64),
        model=column(model, str),
        task=column(task, str),
    )


def merge_traces(*traces: Trace) -> Trace:
    """One trace with every request of ``traces`` (e.g. one per model), by arrival.

    The sort is stable, so equal arrivals keep the order of ``traces``.
    """
    fields = ("arrival", "length", "slo_s", "utility", "model", "task")
    cols = {f: np.concatenate([getattr(t, f) for t in traces]) for f in fields}
    order = np.argsort(cols["arrival"], kind="stable")
    return Trace(**{f: c[order] for f, c in cols.items()})


# -- arrival processes -----------------------------------------------------------


def _check_bounds(n: int | None, duration: float | None) -> None:
    if n is None and duration is None:
        raise ValueError("give n, duration or both: a trace must be bounded")
    if n is not None and n < 0:
        raise ValueError("n must be >= 0")
    if duration is not None and not duration >= 0:
        raise ValueError("duration must be >= 0")


def _bounded(times: np.ndarray, n: int | None, duration: float | None) -> np.ndarray:
    if duration is not None:
        times = times[: np.searchsorted(times, duration, side="left")]
    if n is not None:
        times = times[:n]
    return times


def _renewal(
    draw: Callable[[int], np.ndarray], mean_gap: float, n: int | None, duration: float | None
) -> np.ndarray:
    """Arrival times whose gaps are i.i.d. draws, starting at time 0."""
    _check_bounds(n, duration)
    if n is not None:
        wanted = n if duration is None else min(n, int(duration / mean_gap * 1.1) + 64)
    else:
        wanted = int(duration / mean_gap * 1.1) + 64
    chunks, t, count = [], 0.0, 0
    while True:
        times = t + np.cumsum(draw(max(wanted - count, _CHUNK)))
        chunks.append(times)
        count += len(times)
        t = float(times[-1])
        if (n is not None and count >= n) or (duration is not None and t >= duration):
            break
    return _bounded(np.concatenate(chunks), n, duration)


def poisson_arrivals(
    rate: float, *, seed: Seed, n: int | None = None, duration: float | None = None
) -> np.ndarray:
    """A Poisson process of ``rate`` requests per second (exponential gaps)."""
    if not rate > 0:
        raise ValueError("rate must be > 0")
    rng = np.random.default_rng(seed)
    return _renewal(lambda m: rng.exponential(1.0 / rate, m), 1.0 / rate, n, duration)


def gamma_arrivals(
    rate: float, cv: float, *, seed: Seed, n: int | None = None, duration: float | None = None
) -> np.ndarray:
    """Gamma-distributed gaps with mean ``1/rate`` and coefficient of variation ``cv``.

    ``cv = 1`` is Poisson, ``cv > 1`` bursty (the usual serving-paper knob, e.g.
    Clipper/INFaaS/Nexus use CV up to 4-8), ``cv = 0`` evenly spaced.
    """
    if not rate > 0 or not cv >= 0:
        raise ValueError("rate must be > 0 and cv >= 0")
    rng = np.random.default_rng(seed)
    if cv == 0:
        return _renewal(lambda m: np.full(m, 1.0 / rate), 1.0 / rate, n, duration)
    shape = 1.0 / (cv * cv)
    scale = cv * cv / rate
    return _renewal(lambda m: rng.gamma(shape, scale, m), 1.0 / rate, n, duration)


def _modulated(
    rng: np.random.Generator,
    segments: Callable[[], tuple[np.ndarray, np.ndarray]],
    n: int | None,
    duration: float | None,
) -> np.ndarray:
    """A Poisson process whose rate is constant on consecutive segments.

    ``segments()`` returns the next chunk of (rates, lengths in seconds). Given its
    count, a homogeneous Poisson process places its points uniformly, so each
    segment gets ``Poisson(rate * length)`` uniform points; segments are disjoint
    and ordered, so sorting a chunk sorts the trace.
    """
    _check_bounds(n, duration)
    chunks, t, count = [], 0.0, 0
    while True:
        rates, lengths = segments()
        ends = t + np.cumsum(lengths)
        starts = ends - lengths
        counts = rng.poisson(rates * lengths)
        times = np.repeat(starts, counts) + rng.random(int(counts.sum())) * np.repeat(lengths, counts)
        times.sort()
        chunks.append(times)
        count += len(times)
        t = float(ends[-1])
        if (n is not None and count >= n) or (duration is not None and t >= duration):
            break
    return _bounded(np.concatenate(chunks), n, duration)


def mmpp_arrivals(
    rates: Sequence[float],
    mean_durations: Sequence[float],
    *,
    seed: Seed,
    n: int | None = None,
    duration: float | None = None,
    start_state: int | None = None,
) -> np.ndarray:
    """A 2-state Markov-modulated Poisson process (bursty traffic).

    The process alternates between states 0 and 1; it stays in state ``i`` for an
    exponential time of mean ``mean_durations[i]`` seconds, arriving at
    ``rates[i]`` per second meanwhile. Long-run rate:
    ``(r0*T0 + r1*T1) / (T0 + T1)``. The first state is drawn from the stationary
    distribution (``T_i / (T0 + T1)``) unless ``start_state`` is given.
    """
    r = np.asarray(rates, dtype=np.float64)
    d = np.asarray(mean_durations, dtype=np.float64)
    if r.shape != (2,) or d.shape != (2,) or np.any(r < 0) or np.any(d <= 0) or not r.max() > 0:
        raise ValueError("need two rates >= 0 (one > 0) and two mean durations > 0")
    rng = np.random.default_rng(seed)
    state = int(rng.random() < d[1] / d.sum()) if start_state is None else int(start_state)
    alternating = (np.arange(1024) % 2).astype(np.int64)

    def segments():
        nonlocal state
        states = (alternating + state) % 2
        state = (state + len(states)) % 2
        return r[states], rng.exponential(d[states])

    return _modulated(rng, segments, n, duration)


def fluctuating_poisson_arrivals(
    rates: Sequence[float],
    segment_s: float | Sequence[float],
    *,
    seed: Seed,
    n: int | None = None,
    duration: float | None = None,
) -> np.ndarray:
    """Poisson arrivals whose rate steps through ``rates`` (cycling), one per segment.

    ``segment_s`` is every segment's length or one length per rate. This is the
    "fluctuating workload" of the OTAS experiments: e.g. ``rates=[50, 200, 100]``,
    ``segment_s=60`` holds each rate for a minute, then starts over.
    """
    r = np.asarray(rates, dtype=np.float64)
    lengths = np.broadcast_to(np.asarray(segment_s, dtype=np.float64), r.shape).copy()
    if r.ndim != 1 or not len(r) or np.any(r < 0) or np.any(lengths <= 0) or not r.max() > 0:
        raise ValueError("need rates >= 0 (one > 0) and segment lengths > 0")
    rng = np.random.default_rng(seed)
    reps = max(1, 1024 // len(r))
    chunk_rates, chunk_lengths = np.tile(r, reps), np.tile(lengths, reps)
    return _modulated(rng, lambda: (chunk_rates, chunk_lengths), n, duration)


def sample_lengths(source: int | Sequence[int], n: int, *, seed: Seed) -> np.ndarray:
    """``n`` request lengths: a fixed length, or drawn with replacement from ``source``.

    ``source`` is typically an empirical sample (e.g. the token counts of real
    tweets), so the trace follows that distribution exactly in the limit.
    """
    values = np.asarray(source, dtype=np.int64)
    if values.ndim == 0:
        return np.full(n, int(values), dtype=np.int64)
    if not len(values):
        raise ValueError("empty length sample")
    rng = np.random.default_rng(seed)
    return values[rng.integers(0, len(values), n)]


# -- replay ------------------------------------------------------------------------

_REQUIRED = ("arrival", "length", "slo_ms", "utility")


def _ms_text(slo_s: float) -> str:
    """``slo_s`` in milliseconds, as the shortest decimal of ``slo_s`` with its
    point moved three places, so :func:`_ms_to_s` gives ``slo_s`` back bit-exactly."""
    if math.isinf(slo_s):
        return "inf"
    ms = Decimal(repr(slo_s)).scaleb(3).normalize()
    return format(ms, "f") if -20 < ms.adjusted() < 20 else str(ms)


def _ms_to_s(text: str) -> float:
    """Milliseconds text to seconds, correctly rounded (scaling a Decimal is exact)."""
    return float(Decimal(text.strip()).scaleb(-3))


def save_trace(path: str | os.PathLike, trace: Trace) -> None:
    """Write ``trace`` as CSV; floats are written in shortest round-trip form."""
    named = bool(np.any(trace.model != "") or np.any(trace.task != ""))
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(_REQUIRED + (("model", "task") if named else ()))
        cols = (trace.arrival, trace.length, trace.slo_s, trace.utility, trace.model, trace.task)
        for a, n, s, u, m, t in zip(*(c.tolist() for c in cols)):
            row = [repr(a), str(n), _ms_text(s), repr(u)]
            writer.writerow(row + [m, t] if named else row)


def load_trace(path: str | os.PathLike) -> Trace:
    """Read a trace written by :func:`save_trace` or recorded elsewhere.

    Rows need not be sorted; they are sorted by arrival (stably).
    """
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in _REQUIRED if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}")
        rows = list(reader)
    arrival = np.array([float(r["arrival"]) for r in rows], dtype=np.float64)
    order = np.argsort(arrival, kind="stable")
    cols = dict(
        arrival=arrival,
        length=np.array([int(r["length"]) for r in rows], dtype=np.int64),
        slo_s=np.array([_ms_to_s(r["slo_ms"]) for r in rows], dtype=np.float64),
        utility=np.array([float(r["utility"]) for r in rows], dtype=np.float64),
        model=np.array([r.get("model") or "" for r in rows] or [""], dtype=str)[: len(rows)],
        task=np.array([r.get("task") or "" for r in rows] or [""], dtype=str)[: len(rows)],
    )
    return Trace(**{k: v[order] for k, v in cols.items()})
