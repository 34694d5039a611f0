"""Request-level (static) batching, the baseline continuous batching is measured against.

A batch is fixed when it forms, from the head of the queue as far as seats allow; nothing joins
it until every member has finished, and finished members are held back and released together
when the last one finishes. An aborted member has nobody waiting for it: it is released at once,
and the batch goes on without it. Within a batch, steps are computed as the continuous scheduler
computes them (chunked prefill, preemption, prefix caching and forks alike).
"""

from __future__ import annotations

from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from pagedserve.engine.sequence import Sequence


class StaticScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        super().__init__(config, block_manager)
        self._batch: set[Sequence] = set()  # the members of the batch in flight
        self._held: list[Sequence] = []  # members finished, their results held back

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or bool(self._held)

    def finish(
        self, seq: Sequence, reason: str, stop_reason: int | str | None = None
    ) -> list[Sequence]:
        super().finish(seq, reason, stop_reason)
        released_now = [seq] if reason == "abort" else []
        if reason != "abort":
            self._held.append(seq)
        self._batch.discard(seq)
        if self._batch:
            return released_now
        released, self._held = self._held, []
        return released_now + released

    def drop_held(self, seq: Sequence) -> None:
        if seq in self._held:
            self._held.remove(seq)

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        if not self._batch:
            self._batch = set(self._next_batch())
        super()._admit(batch, budget)

    def _may_admit(self, seq: Sequence) -> bool:
        return seq in self._batch

    def _next_batch(self) -> list[Sequence]:
        members, seats = [], 0
        for seq in self.waiting:
            seats += self._seats(seq)
            if seats > self.config.max_num_seqs:
                break
            members.append(seq)
        return members

    def _fork(self, seq: Sequence, num_new: int, sample_index: int) -> Sequence:
        child = super()._fork(seq, num_new, sample_index)
        self._batch.add(child)
        return child
