"""`pagedserve` with a fault planted in the model runner, for the fail-fast test: a step that holds
a request whose prompt starts with TRIGGER raises once that request has 3 output tokens, as a bug
in a kernel or the sampler would. Run as `python tests/faulty_engine.py serve ...`."""

from __future__ import annotations

import sys

from pagedserve import cli
from pagedserve.engine.model_runner import ModelRunner

TRIGGER = [4242, 4243, 4244]
_run = ModelRunner.run


def _faulty_run(self, batch, timer):
    for seq, _ in batch.entries:
        if seq.prompt_token_ids[: len(TRIGGER)] == TRIGGER and seq.num_output_tokens >= 3:
            raise RuntimeError("a fault planted by the test")
    return _run(self, batch, timer)


ModelRunner.run = _faulty_run

if __name__ == "__main__":
    cli.main(sys.argv[1:])
