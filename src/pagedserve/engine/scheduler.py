"""Iteration-level scheduling: the batch is decided again before every model step.

A step is a list of (sequence, number of its tokens to compute). Running sequences come first, in
admission order, so decodes and unfinished prefill chunks always go ahead of new prompts; then
waiting sequences are admitted first come, first served, while seats, the token budget and free
blocks allow. When a running sequence's next tokens do not fit in the cache, the sequence admitted
last is preempted: its blocks are freed and it waits at the head of the queue to be recomputed.

A waiting sequence first takes the longest run of its leading blocks found in the prefix cache,
and only the tokens after them are scheduled. A request for n samples runs as one sequence until
its prompt is computed; in that step it is forked into n sequences that share its blocks and each
sample their own first token from the prompt's logits. Its n seats are reserved on admission.

The `static` policy (static_scheduler.py) is request-level batching, kept as the baseline beside
this one.
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
    # Sequences whose prompt this step completes -> their new sibling samples, which sample
    # from the same logits row.
    forks: dict[Sequence, list[Sequence]] = field(default_factory=dict)
    # (source, destination) blocks to copy before the forward: copy on write of shared blocks.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Prefix cache lookups of the sequences admitted in this step, in tokens.
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0

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


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

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
        self._fork_completed_prompts(batch)
        batch.block_copies = self.block_manager.take_pending_copies()
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
        return [seq]

    def drop_held(self, seq: Sequence) -> None:
        """Forgets a finished sequence whose result is held back (its caller has gone); this
        policy holds none."""

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

    def _may_admit(self, seq: Sequence) -> bool:
        """Whether seq may take a seat now, given seats, budget and blocks (policy hook)."""
        return True

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        seats = self._seats_taken()
        bm = self.block_manager
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seats + self._seats(seq) > self.config.max_num_seqs:
                break
            if not self._may_admit(seq):
                break
            prefix = bm.find_cached_prefix(seq)
            num_new = seq.num_tokens - prefix.num_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if not bm.allocate(seq, num_new, prefix):
                break
            self.waiting.popleft()
            self.running.append(seq)
            seq.status = SequenceStatus.RUNNING
            batch.entries.append((seq, num_new))
            if bm.enable_caching:
                batch.prefix_queried_tokens += seq.num_tokens
                batch.prefix_hit_tokens += prefix.num_tokens
            budget -= num_new
            seats += self._seats(seq)

    @staticmethod
    def _seats(seq: Sequence) -> int:
        return 1 + seq.pending_forks

    def _seats_taken(self) -> int:
        return sum(self._seats(seq) for seq in self.running)

    def _fork_completed_prompts(self, batch: ScheduledBatch) -> None:
        for seq, num_new in batch.entries:
            if seq.pending_forks and seq.num_computed_tokens + num_new == seq.num_tokens:
                batch.forks[seq] = [self._fork(seq, num_new, i) for i in range(1, seq.params.n)]
                seq.pending_forks = 0

    def _fork(self, seq: Sequence, num_new: int, sample_index: int) -> Sequence:
        child = seq.fork(sample_index)
        # The child's part of this step is done by its parent, whose blocks it shares.
        child.num_computed_tokens += num_new
        self.block_manager.share(child)
        self.running.append(child)
        return child
