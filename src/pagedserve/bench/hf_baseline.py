"""The baseline: the same requests through transformers' generate, with request-level batching.

Requests are taken in order, batch_size at a time, left-padded to the batch's longest prompt, and
each batch runs until its longest output is done. Every request is credited with its own prompt
and output tokens only: the padding and the tokens generated past a request's own length are
work the baseline wastes. A request's E2E is the end of its batch, since generate hands the whole
batch back at once.
"""

from __future__ import annotations

import torch

from pagedserve.bench.datasets import BenchRequest
from pagedserve.bench.offline import WARM_UP, EngineSetup, OfflineRun
from pagedserve.timing import Stopwatch, device_clock


def run_transformers(
    requests: list[BenchRequest], batch_size: int, setup: EngineSetup
) -> OfflineRun:
    """The requests through transformers, on the model, dtype and device of setup."""
    from transformers import AutoModelForCausalLM

    device = setup.device
    if setup.gguf_path is None:
        model = AutoModelForCausalLM.from_pretrained(setup.model_dir, dtype=setup.dtype)
    else:  # transformers dequantizes the file's weights itself
        path = setup.gguf_path
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=setup.dtype
        )
    model = model.to(device).eval()
    # ignore_eos, as our runs have it: every request produces exactly its output length.
    model.generation_config.eos_token_id = None
    _generate(model, [WARM_UP], device)
    e2e: list[float] = []
    with Stopwatch(device) as watch:
        for start in range(0, len(requests), batch_size):
            _generate(model, requests[start : start + batch_size], device)
            batch_end = device_clock(device) - watch.started
            e2e += [batch_end] * len(requests[start : start + batch_size])
    return OfflineRun(
        name="transformers",
        batch_size=batch_size,
        duration_s=watch.seconds,
        prompt_tokens=sum(r.prompt_len for r in requests),
        output_tokens=sum(r.output_len for r in requests),
        e2e_s=e2e,
        setup=setup,
    )


@torch.inference_mode()
def _generate(model, batch: list[BenchRequest], device: torch.device) -> None:
    pad = 0  # masked out by the attention mask, so its value does not matter
    width = max(r.prompt_len for r in batch)
    input_ids = torch.tensor(
        [[pad] * (width - r.prompt_len) + r.prompt_token_ids for r in batch], device=device
    )
    attention_mask = torch.tensor(
        [[0] * (width - r.prompt_len) + [1] * r.prompt_len for r in batch], device=device
    )
    longest = max(r.output_len for r in batch)
    model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=longest,
        min_new_tokens=longest,
        do_sample=False,
        pad_token_id=pad,
    )
