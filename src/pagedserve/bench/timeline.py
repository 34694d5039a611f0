"""The seed scenario, step by step: two seats; A needs 8 tokens, B 64, and C waits for a seat.

Under continuous batching A's seat goes to C at the step after A finishes; under static batching
A's finished result is held with its seat until B is done too, and only then does C start.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.bench.datasets import BenchRequest
from pagedserve.bench.offline import greedy_params, with_fresh_llm
from pagedserve.bench.trace import StepRecord, StepRecorder

SEED_SCENARIO = {
    "A": BenchRequest([11, 12, 13, 14], 8),
    "B": BenchRequest([21, 22, 23, 24, 25, 26], 64),
    "C": BenchRequest([31, 32, 33], 8),
}
RUNNING, HELD = "running", "held"


@dataclass
class Segment:
    seat: int
    request: str
    state: str  # RUNNING: computing; HELD: finished, its result (and seat) not yet released
    first_step: int
    last_step: int


def run_seed_scenario(engine_args: dict, policy: str) -> list[Segment]:
    return with_fresh_llm(engine_args, _segments, max_num_seqs=2, scheduler=policy)


def _segments(llm) -> list[Segment]:
    requests = list(SEED_SCENARIO.values())
    prompts = [r.engine_prompt for r in requests]
    with StepRecorder(llm.engine) as recorder:
        outputs = llm.generate(prompts, greedy_params(requests))
    names = {out.request_id: name for out, name in zip(outputs, SEED_SCENARIO, strict=True)}
    return seat_segments(recorder.records, names)


def seat_segments(records: list[StepRecord], names: dict[str, str]) -> list[Segment]:
    """Who holds which seat at each step, merged into runs of equal (request, state).

    A request takes the lowest free seat when it first runs and gives it up when its result is
    released; it runs at a step where it computed a token or still holds a running slot after."""
    seats: dict[str, int] = {}
    segments: list[Segment] = []
    for record in records:
        computed = record.running + record.produced
        for request_id in computed:
            if request_id not in seats:
                taken = set(seats.values())
                seats[request_id] = min(s for s in range(len(seats) + 1) if s not in taken)
        for request_id, seat in seats.items():
            state = RUNNING if request_id in computed else HELD
            _extend(segments, Segment(seat, names[request_id], state, record.step, record.step))
        for request_id in record.released:
            seats.pop(request_id, None)
    return segments


def _extend(segments: list[Segment], new: Segment) -> None:
    for segment in reversed(segments):
        if segment.seat == new.seat:
            same = (segment.request, segment.state) == (new.request, new.state)
            if same and segment.last_step == new.first_step - 1:
                segment.last_step = new.last_step
                return
            break
    segments.append(new)
