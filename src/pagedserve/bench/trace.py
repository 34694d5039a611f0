"""What the engine holds after every step of a run: who is seated and how much KV cache is used.

The recorder wraps the engine's step for the length of a `with` block, so the run being traced is
LLM.generate itself, unchanged.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from pagedserve.bench.records import KvLayout, StepCounts
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.outputs import StepOutput
from pagedserve.timing import synchronize


@dataclass
class StepRecord:
    step: int
    time: float  # time.monotonic() after the step, the clock of the engine's request metrics
    seconds: float  # the step's own duration, the device synchronized at both ends
    running: list[str]  # request ids seated once the step is done
    produced: list[str]  # request ids that got a token from this step (finished ones included)
    first_tokens: int  # how many of them got their first token: their prefill ended here
    released: list[str]  # request ids whose results were handed back by this step
    kv_blocks_used: int
    # Tokens a contiguous allocator reserving prompt + max_tokens would hold for the seated.
    reserved_tokens: int


def kv_layout(engine: LLMEngine) -> KvLayout:
    runner = engine.runner
    return KvLayout(
        bytes_per_token=runner.model_config.kv_cache_bytes_per_token(
            runner.kv_cache_dtype.itemsize
        ),
        block_size=engine.block_manager.block_size,
        num_blocks=engine.block_manager.num_blocks,
        max_model_len=engine.max_model_len,
    )


@dataclass
class StepRecorder:
    engine: LLMEngine
    records: list[StepRecord] = field(default_factory=list)
    started: float = 0.0  # time.monotonic() when the block was entered
    _seen: set[str] = field(default_factory=set)

    def __enter__(self) -> StepRecorder:
        self.started = time.monotonic()
        self._step = self.engine.step
        self.engine.step = self._recorded_step  # an instance attribute shadows the method
        return self

    def __exit__(self, *exc_info: object) -> None:
        del self.engine.step

    def _recorded_step(self) -> list[StepOutput]:
        step_index = self.engine.step_index
        device = self.engine.runner.device
        synchronize(device)
        before = time.monotonic()
        outputs = self._step()
        synchronize(device)
        self.records.append(self._record(step_index, before, time.monotonic(), outputs))
        return outputs

    def _record(
        self, step_index: int, before: float, after: float, outputs: list[StepOutput]
    ) -> StepRecord:
        produced = [out.request_id for out in outputs if out.new_token_ids]
        first_tokens = len(set(produced) - self._seen)
        self._seen.update(produced)
        running = self.engine.scheduler.running
        manager = self.engine.block_manager
        return StepRecord(
            step=step_index,
            time=after,
            seconds=after - before,
            running=[seq.request_id for seq in running],
            produced=produced,
            first_tokens=first_tokens,
            released=[out.request_id for out in outputs if out.final is not None],
            kv_blocks_used=manager.num_blocks - manager.num_free_blocks,
            reserved_tokens=sum(seq.num_prompt_tokens + seq.max_tokens for seq in running),
        )


def release_steps(records: list[StepRecord]) -> list[int]:
    """For each request handed back during the run, how many steps had run by then: its E2E
    counted in steps instead of seconds."""
    return [count for count, r in enumerate(records, start=1) for _ in r.released]


def step_summary(records: list[StepRecord]) -> StepCounts:
    """How many steps ran, when the median request was handed back (counted in steps), and what
    a step cost with and without a prefill ending in it."""
    prefill = [r.seconds for r in records if r.first_tokens > 0]
    decode = [r.seconds for r in records if r.first_tokens == 0 and r.produced]
    released = release_steps(records)
    return StepCounts(
        steps=len(records),
        release_step_p50=statistics.median(released) if released else None,
        prefill_steps=len(prefill),
        prefill_step_mean_s=sum(prefill) / len(prefill) if prefill else None,
        decode_steps=len(decode),
        decode_step_mean_s=sum(decode) / len(decode) if decode else None,
        seconds_in_prefill_steps=sum(prefill),
    )
