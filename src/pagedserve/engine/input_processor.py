"""Input processing: what a caller sends becomes a Sequence the scheduler can take.

A text prompt is tokenized, a conversation goes through the model's chat template, and every value
that depends on the model is checked here, before any scheduling: token ids within the vocabulary,
the prompt and max_tokens within the context and the KV cache, top_k within the vocabulary. A text
longer in characters than the context can hold is refused without being tokenized. Everything
refused raises ValueError (a FieldError naming the request field at fault), so one bad request
fails alone and nothing accepted can fail later in a step.
"""

from __future__ import annotations

import random
import time
from typing import Any

from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.chat_content import ChatTokenizer
from pagedserve.engine.sequence import Sequence
from pagedserve.engine.structured_output import GrammarCompiler
from pagedserve.outputs import RequestMetrics
from pagedserve.sampling_params import SamplingParams
from pagedserve.validation import FieldError, check_unicode

PromptInput = str | list[int] | dict
Conversation = list[dict[str, Any]]  # chat messages: role, content, tool calls


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        max_num_seqs: int,
        kv_cache: BlockManager,
        seed: int | None,
        grammars: GrammarCompiler,
        chat_content_tokens: str = "text",
    ):
        self.tokenizer = tokenizer
        self.chat = ChatTokenizer(tokenizer, chat_content_tokens)
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.kv_cache = kv_cache  # read for its capacity only
        # No token covers more characters than the vocabulary's longest, so a text longer than
        # this cannot fit the context.
        self.max_prompt_chars = max_model_len * max(map(len, tokenizer.get_vocab()))
        self._seed_source = random.Random(seed)

    def make_sequence(
        self, prompt: PromptInput, params: SamplingParams | None, request_id: str
    ) -> Sequence:
        """Validates a request and builds its sequence (the first of its n samples); raises
        ValueError (a FieldError where one field is at fault) before any scheduling."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        if params.n > self.max_num_seqs:
            raise FieldError(
                "n",
                f"n {params.n} exceeds max_num_seqs {self.max_num_seqs}, the samples "
                "that can run at once",
            )
        if params.top_k > self.vocab_size:
            raise FieldError(
                "top_k", f"top_k {params.top_k} exceeds the vocabulary of {self.vocab_size}"
            )
        # The sampler bans stop ids by index while a request is short of its min_tokens.
        self._check_in_vocabulary("stop_token_ids", params.stop_token_ids)
        self._check_in_vocabulary("logit_bias", list(params.logit_bias or ()))
        text, token_ids = self._tokenize(prompt)
        max_tokens = self._check_lengths(len(token_ids), params)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammars.matcher(params.structured_outputs)
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        return Sequence(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            seed=seed,
            max_tokens=max_tokens,
            metrics=RequestMetrics(arrival_time=time.monotonic()),
            pending_forks=params.n - 1,
            grammar=grammar,
        )

    def chat_token_ids(
        self,
        conversation: Conversation,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """The conversation through the model's chat template, up to the assistant's turn to
        come (or not, without add_generation_prompt), with the tools the template shows the
        model (OpenAI's shape); ValueError when the model has no template or its template
        refuses the conversation (some raise on roles that do not alternate)."""
        if self.tokenizer.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        chars = 0
        for index, message in enumerate(conversation):
            content = message.get("content")
            if isinstance(content, str):
                check_unicode(f"messages[{index}].content", content)
                chars += len(content)
        self._check_prompt_chars("messages", chars)
        return self.chat.token_ids(conversation, add_generation_prompt, tools)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's token ids; FieldError naming prompt for an empty, invalid or
        overlong text."""
        if not text:
            raise FieldError("prompt", "prompt must not be empty")
        check_unicode("prompt", text)
        self._check_prompt_chars("prompt", len(text))
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def detokenize(self, token_ids: list[int]) -> str:
        self._check_in_vocabulary("tokens", token_ids)
        return self.tokenizer.decode(token_ids)

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt_token_ids", "prompt"}
            if unknown:
                raise ValueError(f"prompt dict has unknown keys {sorted(unknown)}")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt)
        return None, self._check_token_ids(prompt)

    def _check_prompt_chars(self, field: str, num_chars: int) -> None:
        if num_chars > self.max_prompt_chars:
            raise FieldError(
                field,
                f"{field} is {num_chars} characters; the model's context of "
                f"{self.max_model_len} tokens holds at most {self.max_prompt_chars} characters "
                "of this tokenizer's text",
            )

    def _check_token_ids(self, token_ids: object) -> list[int]:
        if not isinstance(token_ids, list | tuple):
            raise FieldError("prompt", "prompt_token_ids must be a list of integers")
        if not token_ids:
            raise FieldError("prompt", "prompt_token_ids must not be empty")
        self._check_within_context(len(token_ids))  # before looking at each id of a long list
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            raise FieldError("prompt", "prompt_token_ids must be a list of integers")
        self._check_in_vocabulary("prompt_token_ids", token_ids)
        return list(token_ids)

    def _check_in_vocabulary(self, field: str, token_ids: list[int]) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise FieldError(
                field, f"{field} holds {bad}, outside the vocabulary [0, {self.vocab_size})"
            )

    def _check_within_context(self, prompt_len: int) -> None:
        if prompt_len >= self.max_model_len:
            raise FieldError(
                "prompt",
                f"prompt is {prompt_len} tokens; the model's context is {self.max_model_len} "
                "tokens, which must leave room for at least one new token",
            )

    def _check_lengths(self, prompt_len: int, params: SamplingParams) -> int:
        self._check_within_context(prompt_len)
        # The last generated token is never written to the cache, hence the + 1.
        capacity = self.kv_cache.capacity_tokens + 1
        limit = min(self.max_model_len, capacity)
        max_tokens = params.max_tokens or limit - prompt_len
        if prompt_len + max_tokens > self.max_model_len:
            raise FieldError(
                "max_tokens",
                f"max_tokens {max_tokens} plus the prompt's {prompt_len} tokens exceeds the "
                f"model's context of {self.max_model_len} tokens",
            )
        if prompt_len >= capacity:
            raise FieldError(
                "prompt",
                f"prompt is {prompt_len} tokens; the KV cache holds "
                f"{self.kv_cache.capacity_tokens} tokens, which must leave room for at least "
                "one new token",
            )
        if prompt_len + max_tokens > capacity:
            raise FieldError(
                "max_tokens",
                f"a request of {prompt_len} prompt tokens and max_tokens {max_tokens} can never "
                f"fit in the KV cache of {self.kv_cache.capacity_tokens} tokens "
                f"({self.kv_cache.num_blocks} blocks of {self.kv_cache.block_size})",
            )
        if params.min_tokens > max_tokens:
            raise FieldError(
                "min_tokens",
                f"min_tokens {params.min_tokens} exceeds the {max_tokens} tokens this request "
                "can generate",
            )
        return max_tokens
