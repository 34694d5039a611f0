"""The engine core: admit requests, run one scheduled step at a time, hand back what came out.

A request passes through three parts: the InputProcessor (tokenize, chat template, validation)
turns it into a Sequence; each step the scheduler decides the batch, the ModelRunner computes it
and samples one token per sequence, and the OutputProcessor turns the tokens into text, stop
decisions and, once every sample of a request has finished, its RequestOutput.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pagedserve.config import EngineConfig
from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.input_processor import Conversation, InputProcessor, PromptInput
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.scheduler import Scheduler, SchedulerConfig
from pagedserve.engine.sequence import Sequence
from pagedserve.engine.static_scheduler import StaticScheduler
from pagedserve.engine.structured_output import GrammarCompiler
from pagedserve.model.config import ModelConfig
from pagedserve.model.source import gguf_file, gguf_tokenizer_class, resolve_model_dir
from pagedserve.outputs import StepOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.timing import PhaseTimer

logger = logging.getLogger(__name__)
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
class ModelFiles:
    """What the engine reads from a model besides its weights: config, tokenizer, stop ids."""

    model_dir: Path
    model_config: ModelConfig
    tokenizer: object
    eos_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, config: EngineConfig) -> ModelFiles:
        model_dir = resolve_model_dir(config.model)
        model_config = ModelConfig.from_dir(model_dir)
        tokenizer = _load_tokenizer(model_dir)
        if config.chat_template is not None:
            tokenizer.chat_template = _read_chat_template(config.chat_template)
        return cls(
            model_dir, model_config, tokenizer, _eos_token_ids(model_dir, model_config, tokenizer)
        )

    def input_processor(
        self, config: EngineConfig, max_model_len: int, kv_cache: BlockManager
    ) -> InputProcessor:
        """Tokenization and validation against this model and a KV cache of kv_cache's size."""
        vocab_size = self.model_config.vocab_size
        return InputProcessor(
            self.tokenizer,
            vocab_size,
            max_model_len,
            config.max_num_seqs,
            kv_cache,
            config.seed,
            GrammarCompiler(self.tokenizer, vocab_size, self.eos_token_ids),
            config.chat_content_tokens,
        )


class LLMEngine:
    def __init__(self, config: EngineConfig):
        started = time.monotonic()
        self.config = config
        files = ModelFiles.load(config)
        self.model_dir, model_config = files.model_dir, files.model_config
        self.tokenizer, self.eos_token_ids = files.tokenizer, files.eos_token_ids
        self.runner = ModelRunner(
            files.model_dir, model_config, config, self.eos_token_ids, gguf_file(config.model)
        )
        self.vocab_size = model_config.vocab_size
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        token_budget = config.token_budget(self.max_model_len)
        scheduler = StaticScheduler if config.scheduler == "static" else Scheduler
        self.scheduler = scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=token_budget,
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.block_manager,
        )
        self.inputs = files.input_processor(config, self.max_model_len, self.block_manager)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.stats = EngineStats()
        # The engine's own step profile: seconds per phase, summed over every step.
        self.phase_timer = PhaseTimer(self.runner.device)
        runner = self.runner
        logger.info(
            "loaded %s (%s, %s) in %.1f s; KV cache: %d blocks of %d tokens = %d tokens, "
            "%.2f GiB; max_model_len %d",
            files.model_dir.name,
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
        self.last_scheduled = None
        # The requests of the step running now, for the log when a step fails; empty between.
        self.step_request_ids: list[str] = []
        self._released_outside_step: list[Sequence] = []
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
        request_id = request_id or f"req-{next(self._request_counter)}"
        if self.outputs.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        return self.inputs.make_sequence(prompt, params, request_id)

    def chat_token_ids(
        self,
        conversation: Conversation,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """The conversation (and tools) through the model's chat template (up to the
        assistant's turn)."""
        return self.inputs.chat_token_ids(conversation, add_generation_prompt, tools)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids, as a completion's prompt is tokenized (ValueError as there)."""
        return self.inputs.tokenize(text, add_special_tokens)

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of token ids in the vocabulary (a FieldError naming tokens otherwise)."""
        return self.inputs.detokenize(token_ids)

    def submit(self, seq: Sequence) -> None:
        self.outputs.add_request(seq)
        self.scheduler.add(seq)
        self.stats.num_prompt_tokens += seq.num_prompt_tokens

    def abort_request(self, request_id: str) -> bool:
        """Stops a request (all its samples) at once and frees its blocks; False if it was not
        in the engine."""
        samples = self.outputs.abort_request(request_id)
        if samples is None:
            return False
        released: list[Sequence] = []
        for seq in samples:
            if seq.is_finished:
                self.scheduler.drop_held(seq)
            else:
                released += self.scheduler.finish(seq, "abort")
        self._released_outside_step += [s for s in released if s.request_id != request_id]
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._released_outside_step)

    def has_request(self, request_id: str) -> bool:
        return self.outputs.has_request(request_id)

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

    # The step: schedule, execute, update.

    def close(self) -> None:
        """Stops what the engine started beside itself (a tensor-parallel engine's workers)."""
        self.runner.close()

    def step(self) -> list[StepOutput]:
        """Runs one step; returns a piece per sample that got a token, and a request's final
        result on the last of its pieces."""
        outputs: dict[tuple[str, int], StepOutput] = {}
        released, self._released_outside_step = self._released_outside_step, []
        timer = self.phase_timer
        timer.start()
        scheduled = self.scheduler.schedule()
        self.last_scheduled = scheduled  # read by step observers (the server's live page)
        timer.lap("schedule")
        self.step_request_ids = [seq.request_id for seq, _ in scheduled.entries]
        self.stats.prefix_cache_queries += scheduled.prefix_queried_tokens
        self.stats.prefix_cache_hits += scheduled.prefix_hit_tokens
        if scheduled:
            started = time.monotonic()
            for seq, _ in scheduled.entries:
                if seq.metrics.first_scheduled_time is None:
                    seq.metrics.first_scheduled_time = started
            self.outputs.add_forks(scheduled.forks)
            sampled, prompt_logprobs = self.runner.run(scheduled, timer)
            for seq, entries in prompt_logprobs:
                self.outputs.record_prompt_logprobs(seq, entries)
            for seq, num_new in scheduled.entries:
                seq.num_computed_tokens += num_new
            now = time.monotonic()
            for seq, token, logprobs in sampled:
                output = StepOutput(seq.request_id, [token], index=seq.sample_index)
                if seq.num_output_tokens == 0:
                    output.prompt_logprobs = seq.prompt_logprobs
                outputs[seq.request_id, seq.sample_index] = output
                if logprobs is not None:
                    self.outputs.record_logprobs(seq, logprobs, output)
                self._append_token(seq, token, now)
                finish = self.outputs.process_token(seq, token, output)
                if finish is not None:
                    released += self.scheduler.finish(seq, *finish)
            self.stats.num_steps += 1
        now = time.monotonic()
        for seq in released:
            self.outputs.release_sample(seq, outputs, now, self.step_index)
        self.step_index += 1
        self.step_request_ids = []
        timer.lap("output")
        return list(outputs.values())

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        seq.token_ids.append(token)
        self.stats.num_generation_tokens += 1
        metrics = seq.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            metrics.first_token_step = self.step_index
        metrics.last_token_time = now


def _load_tokenizer(model_dir: Path):
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"model directory {model_dir} has no tokenizer ({' or '.join(_TOKENIZER_FILES)})"
        )
    recorded = gguf_tokenizer_class(model_dir)
    if recorded is not None:
        return recorded.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _read_chat_template(template: str) -> str:
    """chat_template: a Jinja file, or the template's own text (it holds "{{" or "{%")."""
    if "{{" in template or "{%" in template:
        return template
    path = Path(template).expanduser()
    if not path.is_file():
        raise ValueError(f"chat_template {template!r} is neither a file nor a Jinja template")
    return path.read_text()


def _eos_token_ids(model_dir: Path, config: ModelConfig, tokenizer) -> tuple[int, ...]:
    ids = set(config.eos_token_ids)
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
