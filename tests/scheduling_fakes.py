"""Real sequences and schedulers for the torch-free tests, with a fake model step."""

from __future__ import annotations

from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from pagedserve.engine.sequence import Sequence
from pagedserve.engine.static_scheduler import StaticScheduler
from pagedserve.outputs import RequestMetrics
from pagedserve.sampling_params import SamplingParams

FAKE_TOKEN = 7


def make_seq(request_id: str, prompt_len: int, max_tokens: int = 4) -> Sequence:
    return Sequence(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        params=SamplingParams(max_tokens=max_tokens),
        seed=0,
        max_tokens=max_tokens,
        metrics=RequestMetrics(arrival_time=0.0),
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    chunked: bool = True,
    policy: str = "continuous",
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, chunked)
    scheduler = StaticScheduler if policy == "static" else Scheduler
    return scheduler(config, BlockManager(num_blocks, block_size))


def fake_model_step(batch: ScheduledBatch) -> list[Sequence]:
    """Does what the engine does with a step's results; returns the sequences that sampled."""
    sampled = []
    for seq, num_new in batch.entries:
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(FAKE_TOKEN)
            sampled.append(seq)
    return sampled
