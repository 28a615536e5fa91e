"""Pipelined batching over layer-range stages: each request runs its model's stages in order.

A model cut into stages ``[0:k1), [k1:k2), ... [kn:L)`` is served by workers that each
hold some of them (the placement the engine reports through ``on_workers``). A request
is queued at the first stage; a batch formed there runs stage by stage, and after
each non-final step its requests move on to the next stage's queue, where they are
batched again with whatever waits there (the same cell's sequence bucket: activations
keep their shape). FIFO within a stage, oldest stage first (the deepest stage drains
first, so work in flight finishes before new work starts), on the idle worker holding
the stage that has been idle longest.

This is the plain pipeline that QUART's key-stage scaling (its §3) builds on; it makes
no scaling decisions itself. Requests whose deadline has passed are evicted where they
wait, at any stage.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Mapping, Sequence

from jaxserve.sched.base import (Batch, Cell, Plan, Policy, Request, ShapeGrid, Stage, StepSummary,
                                 WorkerView, batch_size_for, bucket_for_length)


class PipelineBatching(Policy):
    """FIFO batching through each model's stage chain.

    Args:
        chains: per model, its stages in order (``Stage`` ranges covering all layers).
        grids: per model, the shape grid every stage of it was compiled over.
        max_queue: admission bound on queued (first-stage) requests per model.
    """

    def __init__(self, chains: Mapping[str, Sequence[Stage]], grids: Mapping[str, ShapeGrid],
                 max_queue: int = 1024) -> None:
        for model, chain in chains.items():
            chain = tuple(chain)
            if not chain or not chain[0].first or not chain[-1].last or any(
                    a.stop != b.start or a.model != model or b.model != model for a, b in zip(chain, chain[1:])):
                raise ValueError(f"{model}: stages must cover its layers in order, got "
                                 f"{[s.label() for s in chain]}")
        self.chains = {m: tuple(c) for m, c in chains.items()}
        self.grids = dict(grids)
        self.max_queue = max_queue
        self._next = {s: (c[i + 1] if i + 1 < len(c) else None) for c in self.chains.values()
                      for i, s in enumerate(c)}
        # stage -> queue of (request, seq bucket); one FIFO per (stage, seq) keeps shapes equal
        self._waiting: dict[tuple[Stage, int], deque[Request]] = {}
        self._where: dict[int, tuple[Stage, int]] = {}
        self._queued_first = {m: 0 for m in self.chains}
        self._holders: dict[Stage, list[int]] = {}
        self._requests: dict[int, Request] = {}  # running a step
        self._idle_since: dict[int, float] = {}
        self.summaries: dict[int, StepSummary] = {}  # the last step's summary per request (for inspection)

    # -- the engine's view ---------------------------------------------------------
    def on_workers(self, workers: Sequence[WorkerView], now: float) -> None:
        self._holders = {}
        for w in workers:
            for stage in w.stages:
                self._holders.setdefault(stage, []).append(w.id)
            self._idle_since.setdefault(w.id, now)

    def admits(self, model: str) -> bool:
        return self._queued_first[model] < self.max_queue

    def queue_depth(self) -> int:
        return sum(self._queued_first.values())

    def on_arrival(self, request: Request, now: float) -> None:
        chain = self.chains[request.model]  # KeyError: a model this policy does not serve
        if self._queued_first[request.model] >= self.max_queue:
            raise OverflowError(f"queue of {request.model!r} is full ({self.max_queue})")
        grid = self.grids[request.model]
        seq = bucket_for_length(request.length, grid.seq_buckets) if grid.seq_buckets else 0
        self._enqueue(chain[0], seq, request)
        self._queued_first[request.model] += 1

    def _enqueue(self, stage: Stage, seq: int, request: Request) -> None:
        self._waiting.setdefault((stage, seq), deque()).append(request)
        self._where[request.id] = (stage, seq)

    def on_completion(self, batch: Batch, now: float, summaries: Mapping[int, StepSummary] | None = None) -> None:
        self._idle_since[batch.instance] = now
        if summaries:
            self.summaries.update(summaries)
        nxt = self._next[batch.stage]
        for rid in batch.request_ids:
            r = self._requests.pop(rid)
            if batch.final or summaries is None:  # answered, or failed: nothing comes next
                self.summaries.pop(rid, None)
            else:
                self._enqueue(nxt, batch.cell.seq, r)

    def withdraw(self, request_id: int, now: float) -> bool:
        where = self._where.pop(request_id, None)
        if where is None:
            return False
        queue = self._waiting[where]
        for r in queue:
            if r.id == request_id:
                queue.remove(r)
                if where[0].first:
                    self._queued_first[r.model] -= 1
                return True
        return False  # pragma: no cover - _where and the queues agree

    # -- planning ------------------------------------------------------------------
    def plan(self, now: float, idle_instances: Sequence[int]) -> Plan:
        idle = sorted(idle_instances, key=lambda w: self._idle_since.get(w, -math.inf))
        batches: list[Batch] = []
        evict: list[int] = []
        wake = math.inf
        # deepest stages first: finish what is in flight before starting more
        keys = sorted(self._waiting, key=lambda k: (-k[0].start, k[1]))
        for stage, seq in keys:
            queue = self._waiting[(stage, seq)]
            while queue and queue[0].deadline < now:  # at any stage: its answer can no longer be on time
                r = queue.popleft()
                self._drop(r, stage)
                evict.append(r.id)
            if queue and queue[0].deadline < math.inf:
                wake = min(wake, math.nextafter(queue[0].deadline, math.inf))
            while queue:
                worker = next((w for w in idle if w in self._holders.get(stage, ())), None)
                if worker is None:
                    break
                idle.remove(worker)
                grid = self.grids[stage.model]
                count = min(len(queue), grid.max_batch)
                taken = [queue.popleft() for _ in range(count)]
                for r in taken:
                    self._drop(r, stage)
                    self._requests[r.id] = r
                cell = Cell(batch_size_for(count, grid.batch_sizes), seq, 0)
                batches.append(Batch(tuple(r.id for r in taken), stage.model, cell, worker, stage,
                                     final=stage.last))
        return Plan(tuple(batches), tuple(evict), wake)

    def _drop(self, r: Request, stage: Stage) -> None:
        self._where.pop(r.id, None)
        if stage.first:
            self._queued_first[r.model] -= 1
