"""The engine loop: admit requests, run one scheduled step at a time, hand back what came out."""

from __future__ import annotations

import itertools
import json
import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateError
from transformers import AutoTokenizer

from pagedserve.config import EngineConfig
from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.scheduler import Scheduler, SchedulerConfig
from pagedserve.engine.sequence import Sequence
from pagedserve.model.config import ModelConfig
from pagedserve.model.source import resolve_model_dir
from pagedserve.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
    StepOutput,
)
from pagedserve.sampling_params import SamplingParams
from pagedserve.timing import PhaseTimer
from pagedserve.validation import FieldError, check_unicode

logger = logging.getLogger(__name__)
PromptInput = str | list[int] | dict
Conversation = list[dict[str, str]]  # chat messages: role and content
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # Tokens of admitted sequences looked up in the prefix cache, and those found there.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass
class _Request:
    """A request's samples: its first sequence, then the forks made once the prompt is computed."""

    samples: list[Sequence]
    num_released: int = 0

    @property
    def num_samples(self) -> int:
        return self.samples[0].params.n


class LLMEngine:
    def __init__(self, config: EngineConfig):
        started = time.monotonic()
        self.config = config
        model_dir = resolve_model_dir(config.model)
        self.model_dir = model_dir
        model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = _load_tokenizer(model_dir)
        self.eos_token_ids = _eos_token_ids(model_dir, model_config, self.tokenizer)
        self.runner = ModelRunner(model_dir, config, self.eos_token_ids)
        self.vocab_size = model_config.vocab_size
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings,
            model_config.max_position_embeddings,
        )
        # No token covers more characters than the vocabulary's longest, so a text longer than
        # this cannot fit the context: it is refused without being tokenized.
        self.max_prompt_chars = self.max_model_len * max(map(len, self.tokenizer.get_vocab()))
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        token_budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            # Without chunking a whole prompt (or a preempted request's recompute) runs in one step.
            token_budget = max(token_budget, self.max_model_len)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=token_budget,
                enable_chunked_prefill=config.enable_chunked_prefill,
                policy=config.scheduler,
            ),
            self.block_manager,
        )
        self.stats = EngineStats()
        # The engine's own step profile: seconds per phase, summed over every step.
        self.phase_timer = PhaseTimer(self.runner.device)
        runner = self.runner
        logger.info(
            "loaded %s (%s, %s) in %.1f s; KV cache: %d blocks of %d tokens = %d tokens, "
            "%.2f GiB; max_model_len %d",
            model_dir.name,
            model_config.architecture,
            runner.weights_summary(),
            time.monotonic() - started,
            runner.num_blocks,
            config.block_size,
            self.block_manager.capacity_tokens,
            runner.kv_cache_bytes / 2**30,
            self.max_model_len,
        )
        self.step_index = 0
        # The requests of the step running now, for the log when a step fails; empty between.
        self.step_request_ids: list[str] = []
        self._requests: dict[str, _Request] = {}
        self._detokenizers: dict[Sequence, IncrementalDetokenizer] = {}
        self._released_outside_step: list[Sequence] = []
        self._seed_source = random.Random(config.seed)
        self._request_counter = itertools.count()

    # Requests in and out.

    def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        seq = self.make_sequence(prompt, params, request_id)
        self.submit(seq)
        return seq.request_id

    def make_sequence(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Sequence:
        """Validates a request and builds its sequence (the first of its n samples); raises
        ValueError before any scheduling."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        if params.n > self.config.max_num_seqs:
            raise FieldError(
                "n",
                f"n {params.n} exceeds max_num_seqs {self.config.max_num_seqs}, the samples "
                "that can run at once",
            )
        if params.top_k > self.vocab_size:
            raise FieldError(
                "top_k", f"top_k {params.top_k} exceeds the vocabulary of {self.vocab_size}"
            )
        # The sampler bans stop ids by index while a request is short of its min_tokens.
        self._check_in_vocabulary("stop_token_ids", params.stop_token_ids)
        text, token_ids = self._tokenize(prompt)
        max_tokens = self._check_lengths(len(token_ids), params)
        request_id = request_id or f"req-{next(self._request_counter)}"
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
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
        )

    def submit(self, seq: Sequence) -> None:
        self._requests[seq.request_id] = _Request([seq])
        self._add_detokenizer(seq)
        self.scheduler.add(seq)
        self.stats.num_prompt_tokens += seq.num_prompt_tokens

    def _add_detokenizer(self, seq: Sequence) -> None:
        self._detokenizers[seq] = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, seq.params.stop, seq.params.skip_special_tokens
        )

    def abort_request(self, request_id: str) -> bool:
        """Stops a request (all its samples) at once and frees its blocks; False if it was not
        in the engine."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        released: list[Sequence] = []
        for seq in request.samples:
            self._detokenizers.pop(seq, None)
            if seq.is_finished:
                self.scheduler.drop_held(seq)
            else:
                released += self.scheduler.finish(seq, "abort")
        self._released_outside_step += [s for s in released if s.request_id != request_id]
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._released_outside_step)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def stream(
        self, prompt: PromptInput, params: SamplingParams | None = None
    ) -> Iterator[StepOutput]:
        """Submits one request and steps the engine, yielding that request's pieces as they come.
        Closing the iterator early aborts the request, which would otherwise keep its blocks."""
        request_id = self.add_request(prompt, params)
        finished = False
        try:
            while not finished:
                for output in self.step():
                    if output.request_id == request_id and not finished:
                        finished = output.finished
                        yield output
        finally:
            if not finished:
                self.abort_request(request_id)

    # The step.

    def step(self) -> list[StepOutput]:
        """Runs one step; returns a piece per sample that got a token, and a request's final
        result on the last of its pieces."""
        outputs: dict[tuple[str, int], StepOutput] = {}
        released, self._released_outside_step = self._released_outside_step, []
        timer = self.phase_timer
        timer.start()
        scheduled = self.scheduler.schedule()
        timer.lap("schedule")
        self.step_request_ids = [seq.request_id for seq, _ in scheduled.entries]
        self.stats.prefix_cache_queries += scheduled.prefix_queried_tokens
        self.stats.prefix_cache_hits += scheduled.prefix_hit_tokens
        if scheduled:
            started = time.monotonic()
            for seq, _ in scheduled.entries:
                if seq.metrics.first_scheduled_time is None:
                    seq.metrics.first_scheduled_time = started
            self._adopt_forks(scheduled.forks)
            sampled = self.runner.run(scheduled, timer)
            for seq, num_new in scheduled.entries:
                seq.num_computed_tokens += num_new
            now = time.monotonic()
            for seq, token, logprobs in sampled:
                output = StepOutput(seq.request_id, [token], index=seq.sample_index)
                outputs[seq.request_id, seq.sample_index] = output
                if logprobs is not None:
                    self._record_logprobs(seq, logprobs, output)
                released += self._append_token(seq, token, output, now)
            self.stats.num_steps += 1
        now = time.monotonic()
        for seq in released:
            self._release_sample(seq, outputs, now)
        self.step_index += 1
        self.step_request_ids = []
        timer.lap("output")
        return list(outputs.values())

    def _adopt_forks(self, forks: dict[Sequence, list[Sequence]]) -> None:
        for parent, children in forks.items():
            self._requests[parent.request_id].samples += children
            for child in children:
                self._add_detokenizer(child)

    def _release_sample(
        self, seq: Sequence, outputs: dict[tuple[str, int], StepOutput], now: float
    ) -> None:
        """Counts seq's result as released; once all the request's samples are, attaches the
        request's result to a piece that goes last among the request's pieces of this step."""
        request = self._requests.get(seq.request_id)
        if request is None:  # aborted after its release was decided
            return
        request.num_released += 1
        if request.num_released < request.num_samples:
            return
        key = (seq.request_id, seq.sample_index)
        output = outputs.pop(key, None) or StepOutput(seq.request_id, index=seq.sample_index)
        output.final = self._release(request, now)
        outputs[key] = output

    def _record_logprobs(self, seq: Sequence, logprobs: SampleLogprobs, output: StepOutput) -> None:
        # Each candidate decoded alone, special tokens kept: a candidate has no text context, and
        # a client reading alternatives needs to see e.g. that the end-of-sequence was likely.
        texts = self.tokenizer.batch_decode([[token] for token in logprobs])
        for logprob, text in zip(logprobs.values(), texts, strict=True):
            logprob.decoded_token = text
        seq.logprobs.append(logprobs)
        output.new_logprobs = [logprobs]

    def _append_token(
        self, seq: Sequence, token: int, output: StepOutput, now: float
    ) -> list[Sequence]:
        seq.token_ids.append(token)
        self.stats.num_generation_tokens += 1
        metrics = seq.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            metrics.first_token_step = self.step_index
        metrics.last_token_time = now
        params = seq.params
        detokenizer = self._detokenizers[seq]
        reason: str | None = None
        stop_reason: int | str | None = None
        if token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos:
            reason = "stop"
        else:
            piece = detokenizer.add_token(token, seq.num_output_tokens >= params.min_tokens)
            output.new_text = piece.text
            if piece.stop_string is not None:
                reason, stop_reason = "stop", piece.stop_string
        if reason is None and (
            seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is None:
            return []
        output.new_text += detokenizer.flush()
        output.finish_reason, output.stop_reason = reason, stop_reason
        return self.scheduler.finish(seq, reason, stop_reason)

    def _release(self, request: _Request, now: float) -> RequestOutput:
        first = request.samples[0]
        first.metrics.finished_time = now
        first.metrics.finished_step = self.step_index
        self._requests.pop(first.request_id)
        completions = []
        for seq in sorted(request.samples, key=lambda s: s.sample_index):
            completions.append(
                CompletionOutput(
                    index=seq.sample_index,
                    text=self._detokenizers.pop(seq).text,
                    token_ids=seq.output_token_ids,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=seq.logprobs,
                )
            )
        return RequestOutput(
            request_id=first.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=True,
            metrics=first.metrics,
        )

    def chat_token_ids(self, conversation: Conversation) -> list[int]:
        """The conversation through the model's chat template, up to the assistant's turn to
        come; ValueError when the model has no template or its template refuses the conversation
        (some raise on roles that do not alternate)."""
        if self.tokenizer.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        chars = 0
        for index, message in enumerate(conversation):
            content = message.get("content")
            if isinstance(content, str):
                check_unicode(f"messages[{index}].content", content)
                chars += len(content)
        self._check_prompt_chars("messages", chars)
        try:
            token_ids = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except TemplateError as error:
            raise ValueError(f"the model's chat template refused the messages: {error}") from None
        return list(token_ids)

    # Validation.

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt_token_ids", "prompt"}
            if unknown:
                raise ValueError(f"prompt dict has unknown keys {sorted(unknown)}")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            if not prompt:
                raise FieldError("prompt", "prompt must not be empty")
            check_unicode("prompt", prompt)
            self._check_prompt_chars("prompt", len(prompt))
            return prompt, self.tokenizer(prompt).input_ids
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
        capacity = self.block_manager.capacity_tokens + 1
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
                f"{self.block_manager.capacity_tokens} tokens, which must leave room for at least "
                "one new token",
            )
        if prompt_len + max_tokens > capacity:
            raise FieldError(
                "max_tokens",
                f"a request of {prompt_len} prompt tokens and max_tokens {max_tokens} can never "
                f"fit in the KV cache of {self.block_manager.capacity_tokens} tokens "
                f"({self.block_manager.num_blocks} blocks of {self.block_manager.block_size})",
            )
        if params.min_tokens > max_tokens:
            raise FieldError(
                "min_tokens",
                f"min_tokens {params.min_tokens} exceeds the {max_tokens} tokens this request "
                "can generate",
            )
        return max_tokens


def _load_tokenizer(model_dir: Path):
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"model directory {model_dir} has no tokenizer ({' or '.join(_TOKENIZER_FILES)})"
        )
    return AutoTokenizer.from_pretrained(model_dir)


def _eos_token_ids(model_dir: Path, config: ModelConfig, tokenizer) -> tuple[int, ...]:
    ids = set(config.eos_token_ids)
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
