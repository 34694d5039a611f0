"""The offline entry point, named and shaped like vLLM's `LLM`."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from tqdm import tqdm

from pagedserve.config import EngineConfig
from pagedserve.engine.input_processor import Conversation, PromptInput
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))

    def close(self) -> None:
        """Stops the processes a tensor-parallel engine started (they also end with this one)."""
        self.engine.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | SequenceOf[PromptInput],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion and returns their outputs in input order.

        Every prompt is validated before any is scheduled, so one bad prompt fails the call alone.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        seqs = [
            self.engine.make_sequence(prompt, params)
            for prompt, params in zip(prompt_list, params_list, strict=True)
        ]
        results: dict[str, RequestOutput] = {}
        try:
            for seq in seqs:
                self.engine.submit(seq)
            with tqdm(total=len(seqs), disable=not use_tqdm, desc="generate") as progress:
                while len(results) < len(seqs):
                    for output in self.engine.step():
                        if output.final is not None:
                            results[output.request_id] = output.final
                            progress.update(1)
        finally:  # interrupted (Ctrl-C, an error): the next call must not step these again
            for seq in seqs:
                if seq.request_id not in results:
                    self.engine.abort_request(seq.request_id)
        return [results[seq.request_id] for seq in seqs]

    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.chat_token_ids(c)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_token_ids(self, conversation: Conversation) -> list[int]:
        return self.engine.chat_token_ids(conversation)


def _as_prompt_list(prompts) -> list[PromptInput]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]
    if not prompts:
        raise ValueError("prompts must not be empty")
    return prompts


def _as_params_list(params, count: int) -> list[SamplingParams | None]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} prompts")
    return params
