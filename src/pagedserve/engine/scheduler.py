"""Iteration-level scheduling: the batch is decided again before every model step.

A step is a list of (sequence, number of its tokens to compute). Running sequences come first, in
admission order, so decodes and unfinished prefill chunks always go ahead of new prompts; then
waiting sequences are admitted first come, first served, while seats, the token budget and free
blocks allow. When a running sequence's next tokens do not fit in the cache, the sequence admitted
last is preempted: its blocks are freed and it waits at the head of the queue to be recomputed.

The `static` policy is request-level batching, kept as the baseline: a batch is fixed when it
forms, nothing joins it until every member has finished, and finished members are released
together at the end.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(num_new for _, num_new in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True
    policy: str = "continuous"


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Under `static`: the members of the batch in flight, and those finished but held back.
        self._batch: set[str] = set()
        self._held: list[Sequence] = []

    @property
    def static(self) -> bool:
        return self.config.policy == "static"

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._held)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._allocate_or_preempt(seq, num_new, batch):
                break
            batch.entries.append((seq, num_new))
            budget -= num_new
            index += 1
        # Admitting while the cache is short would only preempt someone again next step.
        if not batch.preempted:
            self._admit(batch, budget)
        return batch

    def finish(
        self, seq: Sequence, reason: str, stop_reason: int | str | None = None
    ) -> list[Sequence]:
        """Ends seq, frees its blocks; returns the sequences whose results may now be released."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        if not self.static:
            return [seq]
        # An aborted request has nobody waiting for it, so it is never held back.
        released_now = [seq] if reason == "abort" else []
        if reason != "abort":
            self._held.append(seq)
        self._batch.discard(seq.request_id)
        if self._batch:
            return released_now
        released, self._held = self._held, []
        return released_now + released

    def drop_held(self, seq: Sequence) -> None:
        """Forgets a finished sequence still held back under `static` (its caller has gone)."""
        if seq in self._held:
            self._held.remove(seq)

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> bool:
        while not self.block_manager.allocate(seq, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        if self.static and not self._batch:
            members = list(self.waiting)[: self.config.max_num_seqs]
            self._batch = {seq.request_id for seq in members}
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self.static and seq.request_id not in self._batch:
                break
            num_new = seq.num_uncomputed_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.block_manager.allocate(seq, num_new):
                break
            self.waiting.popleft()
            self.running.append(seq)
            seq.status = SequenceStatus.RUNNING
            batch.entries.append((seq, num_new))
            budget -= num_new
