"""Arlo's Request Scheduler (§3.4, Alg. 1) and the dispatch baselines of its ablation (§5.2.3).

:class:`MultiLevelDispatcher` is Alg. 1 (where Alg. 1 is ambiguous, the class says what we
chose); ILB (:class:`IntraGroupBalance`) and IG (:class:`InterGroupGreedy`, and
:class:`InterGroupGreedyByLoad`, IG read literally) replace it in §5.2.3. :data:`DISPATCHERS`
maps the names ``ArloPolicy(dispatcher=...)`` accepts to these classes.
"""

from __future__ import annotations

from bisect import bisect_left
from heapq import heapify, heappop, heappush, heapreplace
from typing import Iterable, Sequence

from jaxserve.sched.arlo._common import _INF

_SHIFT = 32
_MASK = (1 << _SHIFT) - 1
_ONE = 1 << _SHIFT


class MultiLevelDispatcher:
    """Alg. 1: a multi-level queue of instances, one min-heap per runtime (level).

    An instance's *load* is its number of outstanding requests (queued + running),
    as in the paper (Fig. 5 labels "outstanding / max capacity"); its congestion is
    ``P = load / M`` with ``M`` the runtime's capacity within the SLO. Each heap
    holds ``load << 32 | id`` integers, so the head is the least loaded instance
    (ties: lowest id); completions push a fresh key and stale keys are dropped
    lazily when they surface (the heap is rebuilt if it grows past twice its
    members).

    Decisions where Alg. 1 is ambiguous:

    * Candidates (line 2) are the *deployed* runtimes (>= 1 instance) whose bucket
      holds the request, shortest first; empty runtimes are skipped before TOPK,
      so ``L`` counts levels that can actually take the request.
    * Line 10 is ``P < lambda`` (strict, "less than" in the text), evaluated as
      ``load < lambda * M`` with the products precomputed; ``lambda``
      starts at its initial value for every request and is multiplied by ``alpha``
      after each failing level (line 15), so level ``k`` (0-based) of the
      candidates is tested against ``lambda * alpha**k``.
    * If no level passes, the request goes to the head of the first candidate
      (lines 18-19), even though it is congested.
    * UPDATE (line 22) adds one outstanding request to the chosen instance.
    * No deployed runtime fits: :meth:`dispatch` returns ``None`` (the caller holds
      the request); a length above every bucket raises ``ValueError``.
    """

    name = "arlo"

    def __init__(
        self,
        buckets: Sequence[int],
        capacity: Sequence[int],
        *,
        lam: float = 0.85,
        alpha: float = 0.9,
        peek: int = 6,
    ) -> None:
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError("buckets must be strictly increasing")
        if len(capacity) != len(buckets) or min(capacity) <= 0:
            raise ValueError("one positive capacity per bucket")
        if peek < 1:
            raise ValueError("peek (L) must be >= 1")
        self.buckets = tuple(buckets)
        self.capacity = tuple(float(c) for c in capacity)
        self.lam, self.alpha, self.peek = float(lam), float(alpha), int(peek)
        k = len(buckets)
        # level of the smallest bucket >= length, for every length
        self._level_of = [bisect_left(self.buckets, n) for n in range(self.buckets[-1] + 1)]
        self._heaps: list[list[int]] = [[] for _ in range(k)]
        self._members: list[set[int]] = [set() for _ in range(k)]
        self._key: dict[int, int] = {}  # instance -> load << 32 | id
        self._level: dict[int, int] = {}
        self._next = [-1] * (k + 1)  # first deployed level >= j (sentinel at k)
        # thresholds lambda * alpha**k * M_j, precomputed per (position, level)
        self._thresh = [[self.lam * self.alpha**p * c for c in self.capacity] for p in range(self.peek)]

    def set_capacity(self, capacity: Sequence[int]) -> None:
        """New ``M`` per level (runtime groups change with each allocation: ``arlo.groups``)."""
        if len(capacity) != len(self.buckets) or min(capacity) <= 0:
            raise ValueError("one positive capacity per bucket")
        self.capacity = tuple(float(c) for c in capacity)
        self._thresh = [[self.lam * self.alpha**p * c for c in self.capacity] for p in range(self.peek)]

    # -- instances ---------------------------------------------------------------
    def _refresh(self) -> None:
        nxt = -1
        for j in range(len(self.buckets) - 1, -1, -1):
            if self._members[j]:
                nxt = j
            self._next[j] = nxt

    def add_instance(self, instance: int, level: int, load: int = 0) -> None:
        if not 0 <= instance <= _MASK:
            raise ValueError("instance ids must fit in 32 bits")
        if instance in self._key:
            raise ValueError(f"instance {instance} already present")
        key = (load << _SHIFT) | instance
        self._key[instance] = key
        self._level[instance] = level
        self._members[level].add(instance)
        heappush(self._heaps[level], key)
        self._refresh()

    def remove_instance(self, instance: int) -> int:
        """Forget an instance; returns its outstanding load."""
        key = self._key.pop(instance)
        level = self._level.pop(instance)
        self._members[level].discard(instance)
        self._rebuild(level)
        self._refresh()
        return key >> _SHIFT

    def move_instance(self, instance: int, level: int, load: int | None = None) -> None:
        old = self.remove_instance(instance)
        self.add_instance(instance, level, old if load is None else load)

    def _rebuild(self, level: int) -> None:
        heap = [self._key[i] for i in self._members[level]]
        heapify(heap)
        self._heaps[level] = heap

    def level_of(self, instance: int) -> int:
        return self._level[instance]

    def load(self, instance: int) -> int:
        return self._key[instance] >> _SHIFT

    def loads(self) -> dict[int, int]:
        return {i: k >> _SHIFT for i, k in self._key.items()}

    def instances(self) -> tuple[int, ...]:
        return tuple(self._key)

    def instances_per_level(self) -> tuple[int, ...]:
        return tuple(len(s) for s in self._members)

    def fitting_level(self, length: int) -> int:
        if length < 0 or length >= len(self._level_of):
            raise ValueError(f"length {length} exceeds the largest bucket {self.buckets[-1]}")
        return self._level_of[length]

    def deployed_level(self, length: int) -> int:
        """The first deployed level that holds ``length`` (``-1``: none): the request's own
        runtime group (``arlo.groups``); Alg. 1 tries it first."""
        return self._next[self.fitting_level(length)]

    def members(self, level: int) -> frozenset[int]:
        """The instances of ``level``."""
        return frozenset(self._members[level])

    # -- load updates ------------------------------------------------------------
    def charge(self, instance: int, count: int = 1) -> None:
        """``count`` more outstanding requests on ``instance`` (a runtime group's instance runs
        requests that Alg. 1 charged to another instance of the group: ``ArloPolicy``)."""
        key = self._key[instance] + (count << _SHIFT)
        self._key[instance] = key
        level = self._level[instance]
        heappush(self._heaps[level], key)
        if len(self._heaps[level]) > 2 * len(self._members[level]) + 16:
            self._rebuild(level)

    def complete(self, instance: int, count: int = 1) -> None:
        """``count`` outstanding requests of ``instance`` finished (or left it)."""
        key = self._key.get(instance)
        if key is None:
            return
        key -= count << _SHIFT
        if key < 0:
            raise ValueError(f"instance {instance} has fewer than {count} outstanding requests")
        self._key[instance] = key
        level = self._level[instance]
        heap = self._heaps[level]
        heappush(heap, key)
        if len(heap) > 2 * len(self._members[level]) + 16:
            self._rebuild(level)

    # -- Alg. 1 --------------------------------------------------------------------
    def _head(self, level: int) -> int:
        heap, keys = self._heaps[level], self._key
        e = heap[0]
        while keys.get(e & _MASK) != e:
            heappop(heap)
            e = heap[0]
        return e

    def choose_level(self, length: int) -> int:
        """Lines 1-20 of Alg. 1: the runtime level for a request (``-1``: none deployed)."""
        nxt = self._next
        first = nxt[self.fitting_level(length)]
        if first < 0:
            return -1
        j, p, peek, thresh = first, 0, self.peek, self._thresh
        while True:
            if (self._head(j) >> _SHIFT) < thresh[p][j]:
                return j
            p += 1
            if p >= peek:
                return first
            j = nxt[j + 1]
            if j < 0:
                return first

    def dispatch(self, length: int) -> int | None:
        """Alg. 1: the instance for one request of ``length`` tokens (its load +1)."""
        j = self.choose_level(length)
        if j < 0:
            return None
        heap = self._heaps[j]
        e = self._head(j)
        self._key[e & _MASK] = e + _ONE
        heapreplace(heap, e + _ONE)
        return e & _MASK

    def dispatch_many(self, lengths: Iterable[int]) -> list[int | None]:
        """:meth:`dispatch` for a burst, in order: Alg. 1 with the loop inlined (hot path),
        or, for a subclass with its own :meth:`choose_level`, one :meth:`dispatch` each."""
        if type(self).choose_level is not MultiLevelDispatcher.choose_level:
            return [self.dispatch(n) for n in lengths]
        level_of, nxt, heaps, keys, thresh = self._level_of, self._next, self._heaps, self._key, self._thresh
        peek, mask, one, shift = self.peek, _MASK, _ONE, _SHIFT
        get, top = keys.get, len(level_of) - 1
        out: list[int | None] = []
        append = out.append
        for length in lengths:
            if not 0 <= length <= top:
                raise ValueError(f"length {length} exceeds the largest bucket {self.buckets[-1]}")
            first = nxt[level_of[length]]
            if first < 0:
                append(None)
                continue
            j, p = first, 0
            while True:
                heap = heaps[j]
                e = heap[0]
                while get(e & mask) != e:
                    heappop(heap)
                    e = heap[0]
                if (e >> shift) < thresh[p][j]:
                    break
                p += 1
                if p >= peek:
                    j = first
                    break
                j = nxt[j + 1]
                if j < 0:
                    j = first
                    break
            heap = heaps[j]
            e = heap[0]
            while get(e & mask) != e:
                heappop(heap)
                e = heap[0]
            keys[e & mask] = e + one
            heapreplace(heap, e + one)
            append(e & mask)
        return out


class IntraGroupBalance(MultiLevelDispatcher):
    """ILB (§5.2.3): the runtime with the least padding, least loaded instance of it.

    Exactly Alg. 1 with ``L = 1`` (a request never leaves its own runtime; if that
    runtime has no instance, the next deployed longer one is its "own").
    """

    name = "ilb"

    def __init__(self, buckets: Sequence[int], capacity: Sequence[int], **_: float) -> None:
        super().__init__(buckets, capacity, peek=1)

    def choose_level(self, length: int) -> int:
        return self._next[self.fitting_level(length)]


class InterGroupGreedy(MultiLevelDispatcher):
    """IG (§5.2.3): the least busy instance among *all* candidate runtimes.

    "Busy" is the congestion ``P = load / M`` Alg. 1 uses (so runtimes with
    different capacities compare fairly); ties go to the shorter runtime.
    """

    name = "ig"

    def __init__(self, buckets: Sequence[int], capacity: Sequence[int], **_: float) -> None:
        super().__init__(buckets, capacity, peek=len(buckets))

    def choose_level(self, length: int) -> int:
        nxt, cap = self._next, self.capacity
        j = nxt[self.fitting_level(length)]
        best, best_p = -1, _INF
        while j >= 0:
            p = (self._head(j) >> _SHIFT) / cap[j]
            if p < best_p:
                best, best_p = j, p
            j = nxt[j + 1]
        return best


class InterGroupGreedyByLoad(InterGroupGreedy):
    """IG read literally: the instance with the fewest outstanding requests among all
    candidate runtimes (ties: the shorter runtime), whatever their capacities.

    The paper's "least busy instance" does not say whether busy is relative to the
    capacity; :class:`InterGroupGreedy` compares ``load / M``, this compares ``load``,
    which lets short requests seize the longer runtimes' (emptier, slower) instances
    — the behaviour the paper blames for IG's tail (§5.2.3).
    """

    name = "ig-load"

    def choose_level(self, length: int) -> int:
        nxt = self._next
        j = nxt[self.fitting_level(length)]
        best, best_load = -1, _INF
        while j >= 0:
            load = self._head(j) >> _SHIFT
            if load < best_load:
                best, best_load = j, load
            j = nxt[j + 1]
        return best


DISPATCHERS = {"arlo": MultiLevelDispatcher, "ilb": IntraGroupBalance, "ig": InterGroupGreedy,
               "ig-load": InterGroupGreedyByLoad}
