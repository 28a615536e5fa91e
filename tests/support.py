"""What several test modules share (besides conftest's fixtures): policies used by both the
simulator's tests and the live engine's, so the same objects run in both."""

from __future__ import annotations

from jaxserve.sched.base import Batch, Cell, Plan, Policy


class SmallThenBig(Policy):
    """A two-model cascade for tests (Tabi's is the real one): every request runs on
    ``"small"`` first (a non-final step); those whose top probability reaches ``threshold``
    are finished with the small model's answer, the rest go on to ``"big"`` (final). FIFO,
    ``batch`` requests per step, the big model's work first."""

    def __init__(self, threshold: float, batch: int = 1):
        self.threshold = threshold
        self.batch = batch
        self.queue: list[int] = []
        self.next: list[int] = []
        self.done: list[int] = []
        self.escalated: list[int] = []  # every request sent on to "big", in order
        self.summaries: dict = {}  # the small model's summary of each request

    def on_arrival(self, request, now):
        self.queue.append(request.id)

    def queue_depth(self):
        return len(self.queue)

    def on_completion(self, batch, now, summaries=None):
        if batch.model == "small" and summaries:
            self.summaries.update(summaries)
            for rid, s in summaries.items():
                if s.top_probability >= self.threshold:
                    self.done.append(rid)
                else:
                    self.next.append(rid)
                    self.escalated.append(rid)

    def plan(self, now, idle):
        idle = list(idle)
        batches = []
        if self.next and idle:
            ids, self.next = self.next[:self.batch], self.next[self.batch:]
            batches.append(Batch(tuple(ids), "big", Cell(self.batch), idle.pop(0), final=True))
        if self.queue and idle:
            ids, self.queue = self.queue[:self.batch], self.queue[self.batch:]
            batches.append(Batch(tuple(ids), "small", Cell(self.batch), idle.pop(0), final=False))
        finish, self.done = tuple(self.done), []
        return Plan(tuple(batches), finish=finish)
