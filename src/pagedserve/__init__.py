"""pagedserve: continuous batching over a paged KV cache, with vLLM's offline API."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from pagedserve.llm import LLM
    from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
    from pagedserve.sampling_params import SamplingParams


def __getattr__(name: str):
    # Lazy, so that the torch-free parts (scheduler, block manager) import without torch.
    if name == "LLM":
        from pagedserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pagedserve.sampling_params import SamplingParams

        return SamplingParams
    if name in ("CompletionOutput", "Logprob", "RequestOutput"):
        import pagedserve.outputs

        return getattr(pagedserve.outputs, name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
