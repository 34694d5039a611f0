"""Turns a scheduled step into tensors, runs the model on it and samples the next tokens."""

from __future__ import annotations

import functools
import logging
import platform
import time
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.sampling_state import SamplingState
from pagedserve.engine.scheduler import ScheduledBatch
from pagedserve.engine.sequence import Sequence
from pagedserve.engine.tensor_parallel import Limits, StepInputs, Workers
from pagedserve.model.attention import AttentionBatch
from pagedserve.model.checkpoint import (
    gguf_linear_parts,
    load_weights,
    stored_weight_types,
    weights_bytes,
)
from pagedserve.model.config import ModelConfig
from pagedserve.model.cpu_features import CpuFeatures
from pagedserve.model.cuda_graphs import DecodeGraphs
from pagedserve.model.decoder import DecoderModel
from pagedserve.model.gguf_blocks import GGUFPart
from pagedserve.model.kernels import can_use_cpu_kernels, cpu_kernels_available
from pagedserve.model.layers import Linear
from pagedserve.model.linear_method import PACKED_FORMATS, PackedFormats, choose_format
from pagedserve.model.parallel import TensorParallel, check_divides
from pagedserve.model.sampler import (
    LogprobsRequest,
    LogprobsTensors,
    RowArgmax,
    compute_logprobs,
    sample,
    torch_row_argmax,
)
from pagedserve.outputs import Logprob, SampleLogprobs
from pagedserve.timing import PhaseTimer

logger = logging.getLogger(__name__)


class Sampled(NamedTuple):
    seq: Sequence
    token: int
    logprobs: SampleLogprobs | None  # decoded_token left for the engine, which holds the tokenizer


class PromptLogprobs(NamedTuple):
    """The logprobs of prompt tokens this step's positions predict, in prompt order."""

    seq: Sequence
    entries: list[SampleLogprobs]


# Prompt positions whose logits are computed at once for prompt logprobs: a row of logits holds
# the whole vocabulary, so a long prompt's would not fit in memory together.
_PROMPT_LOGITS_ROWS = 256


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def available_memory() -> int | None:
    """Bytes the kernel reckons it can give without swapping (MemAvailable); None where
    /proc/meminfo does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_memory(weights: int, kv_cache: int, config: EngineConfig) -> None:
    """Refuses, before anything is allocated, a model whose weights (as loaded) and KV cache
    cannot both fit in the memory this machine has available: allocated anyway, pages would be
    handed out lazily and the process killed mid-request when they run out."""
    available = available_memory()
    gib = 2**30
    logger.info(
        "memory: weights %.2f GiB, KV cache %.2f GiB, available %s",
        weights / gib,
        kv_cache / gib,
        "unknown" if available is None else f"{available / gib:.2f} GiB",
    )
    if available is None or weights + kv_cache <= available:
        return
    kv_setting = (
        f"num_kv_blocks {config.num_kv_blocks}"
        if config.num_kv_blocks
        else f"kv_cache_memory {config.kv_cache_memory!r}"
    )
    raise ValueError(
        f"the model needs at least {weights / gib:.2f} GiB for its weights and "
        f"{kv_cache / gib:.2f} GiB for the KV cache ({kv_setting}), but this machine has "
        f"{available / gib:.2f} GiB available; lower --kv-cache-memory or serve a smaller model"
    )


def resolve_dtype(
    name: str, device: torch.device, cpu_kernels: bool, cpu: CpuFeatures
) -> torch.dtype:
    """The model's dtype for --dtype name. auto: bfloat16 on CUDA. On a CPU, float32 wherever
    the C++ kernels run, whatever the CPU's bfloat16 support: they compute in float32 from the
    checkpoint's own weights packed in their own format (q4_1, q8_0, bfloat16), which is exact,
    batch-invariant and the fastest path on AVX2 and AVX-512 BF16 hosts alike. Without them,
    bfloat16 where the CPU multiplies it in hardware (AVX-512 BF16, AMX); elsewhere it is
    emulated, several times slower than float32."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    if cpu_kernels:
        return torch.float32
    return torch.bfloat16 if cpu.native_bfloat16 else torch.float32


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _linear_formats(
    model: DecoderModel,
    name: str,
    stored: tuple[frozenset[str], frozenset[str]],
    parts: Mapping[str, list[GGUFPart]],
) -> dict[str, str]:
    """The packed format of each linear map, by module name, for --packed-weight-dtype name:
    choose_format on the types of the map's GGUF blocks where parts has them, else on the types
    the checkpoint stores its maps (stored[0]) or its output projection (stored[1]) in."""
    formats = {}
    for module_name, module in model.named_modules():
        if isinstance(module, Linear):
            logits = module is model.lm_head
            blocks = parts.get(module_name)
            types = {part.type for part in blocks} if blocks else stored[logits]
            formats[module_name] = choose_format(name, types, logits, from_blocks=bool(blocks))
    return formats


class ModelRunner:
    def __init__(
        self,
        model_dir: Path,
        model_config: ModelConfig,
        config: EngineConfig,
        eos_token_ids: tuple[int, ...],
        gguf_path: Path | None = None,
        parallel: TensorParallel | None = None,
    ):
        """gguf_path: the GGUF file whose metadata model_dir holds: its tensors are read in
        place, and the linear maps packed from its own blocks where a format holds them.
        parallel: a tensor-parallel worker's rank (engine/tensor_parallel.py); with
        config.tensor_parallel_size > 1 and none given, this runner is rank 0 and starts the
        others."""
        self.device = resolve_device(config.device)
        self.workers: Workers | None = None
        if parallel is None and config.tensor_parallel_size > 1:
            make_runner = functools.partial(
                _worker_runner, model_dir, model_config, config, eos_token_ids, gguf_path
            )
            parallel = self._start_workers(model_config, config, make_runner)
        self.parallel = parallel
        try:
            self._load(model_dir, model_config, config, eos_token_ids, gguf_path, parallel)
            if self.workers is not None:
                self.workers.wait_until_loaded()
        except BaseException:
            self.close()  # the workers too
            raise

    def _load(
        self,
        model_dir: Path,
        model_config: ModelConfig,
        config: EngineConfig,
        eos_token_ids: tuple[int, ...],
        gguf_path: Path | None,
        parallel: TensorParallel | None,
    ) -> None:
        """This rank's model, packed as config asks, with its KV cache."""
        kernels = config.cpu_kernels and self.device.type == "cpu" and cpu_kernels_available()
        self.dtype = resolve_dtype(config.dtype, self.device, kernels, CpuFeatures.host())
        self.block_size = config.block_size
        self.model_config = model_config
        self.kv_cache_dtype = (
            self.dtype if config.kv_cache_dtype == "auto" else getattr(torch, config.kv_cache_dtype)
        )
        bytes_per_token = self.model_config.kv_cache_bytes_per_token(self.kv_cache_dtype.itemsize)
        bytes_per_block = bytes_per_token * config.block_size
        self.num_blocks = config.num_kv_blocks or config.kv_cache_bytes // bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory {config.kv_cache_memory!r} holds no block of "
                f"{bytes_per_block} bytes"
            )
        # Every rank holds the same blocks, each with its share of the heads.
        self.kv_cache_bytes = self.num_blocks * bytes_per_block // config.tensor_parallel_size
        packed = config.cpu_kernels and can_use_cpu_kernels(self.device, self.dtype)
        if self.device.type == "cpu":
            packed_format = config.packed_weight_dtype if packed else None
            weights = weights_bytes(model_dir, self.dtype, packed_format)
            _check_memory(weights, self.kv_cache_bytes, config)
        with torch.device(self.device):
            self.model = DecoderModel(model_config, self.dtype, parallel)
        shard = None if parallel is None else functools.partial(parallel.shard, config=model_config)
        # None: the linear weights are used as loaded, by F.linear.
        self.packed_weight_dtypes: PackedFormats | None = None
        if packed:
            parts = {}
            if gguf_path is not None:
                parts = gguf_linear_parts(gguf_path, model_dir, model_config)
            if parallel is not None:
                cuts = {
                    name: parallel.shard_parts(name, p, model_config) for name, p in parts.items()
                }
                parts = {name: cut for name, cut in cuts.items() if cut is not None}
            formats = _linear_formats(
                self.model, config.packed_weight_dtype, stored_weight_types(model_dir), parts
            )
            methods = {name: PACKED_FORMATS[format_name] for name, format_name in formats.items()}
            load_weights(self.model, model_dir, gguf_path, methods, parts, shard)
            self.model.use_cpu_kernels()
            self.packed_weight_dtypes = PackedFormats(
                "+".join(sorted({f for name, f in formats.items() if name != "lm_head"})),
                formats["lm_head"],
            )
        else:
            load_weights(self.model, model_dir, gguf_path, shard=shard)
        if config.packed_weight_dtype not in ("auto", "float32") and not packed:
            logger.warning(
                "packed_weight_dtype %s ignored: weights are packed for float32 on CPU only, "
                "with the C++ kernels",
                config.packed_weight_dtype,
            )
        self.row_argmax: RowArgmax = torch_row_argmax
        if self.packed_weight_dtypes is not None:  # float32 logits, with the C++ kernels
            self.row_argmax = torch.ops.pagedserve.row_argmax
        # The C++ attention computes a plain softmax: not Gemma 2's capped scores.
        self.decode_in_place = (
            config.decode_kernel
            and self.device.type == "cpu"
            and self.model_config.attn_logit_softcap is None
            and cpu_kernels_available()
        )
        # Every token read in place, so that results are batch-invariant (AttentionBatch.build).
        self.prefill_in_place = self.decode_in_place and config.batch_invariant
        self.max_model_len = config.served_length(model_config.max_position_embeddings)
        # CUDA graphs replay decode steps (model/cuda_graphs.py), except where a step's work
        # depends on its values: experts chosen per token, longrope's per-prompt factors.
        self.decode_graphs: DecodeGraphs | None = None
        graphs = (
            self.device.type == "cuda"
            and not config.enforce_eager
            and not any(model_config.moe_layers)
            and self.model.long_after is None
        )
        # With graphs, one block past the block manager's is the padded rows' scratch block.
        self.model.attach_kv_cache(self.num_blocks + graphs, config.block_size, self.kv_cache_dtype)
        if graphs:
            self.decode_graphs = DecodeGraphs(
                self.model,
                self.block_size,
                max_batch=config.max_num_seqs,
                max_blocks=-(-self.max_model_len // self.block_size),
                scratch_block=self.num_blocks,
                capture=True,
            )
            started = time.perf_counter()
            self.decode_graphs.capture_all()
            logger.info(
                "captured %d CUDA graphs of decode steps (batch sizes %s, table widths %s "
                "blocks) in %.1f s",
                len(self.decode_graphs.graphs),
                self.decode_graphs.batch_sizes,
                self.decode_graphs.widths,
                time.perf_counter() - started,
            )
        self.sampling = SamplingState(self.device, self.model_config.vocab_size, eos_token_ids)
        if self.device.type == "cpu":
            path = "C++ kernels" if self.packed_weight_dtypes is not None else "torch operators"
            logger.info(
                "CPU: %s; path: %s in %s (--dtype %s)",
                CpuFeatures.host().describe(),
                path,
                _dtype_name(self.dtype),
                config.dtype,
            )

    def _start_workers(
        self, model_config: ModelConfig, config: EngineConfig, make_runner
    ) -> TensorParallel:
        """Starts ranks 1 to N - 1 of a tensor-parallel engine, each loading its share of the
        model as this one does (make_runner(parallel): its ModelRunner); returns rank 0's place
        in their group."""
        size = config.tensor_parallel_size
        check_divides(model_config, size)
        if self.device.type != "cpu":
            raise ValueError(f"tensor_parallel_size {size}: tensor parallelism runs on CPU only")
        max_len = config.served_length(model_config.max_position_embeddings)
        limits = Limits(
            tokens=max(config.token_budget(max_len), config.max_num_seqs),
            hidden_size=model_config.hidden_size,
            sequences=config.max_num_seqs,
            blocks_per_sequence=-(-max_len // config.block_size) + 1,
            vocab_share=-(-model_config.vocab_size // size),
        )
        backend = config.distributed_backend
        if backend == "auto":
            backend = "shm" if platform.machine() in ("x86_64", "AMD64") else "gloo"
        self.workers = Workers(size, backend, config.cpu_binding, limits, make_runner)
        channel = self.workers.channel
        return TensorParallel(0, size, channel.all_reduce, channel.gather)

    def close(self) -> None:
        """Stops a tensor-parallel engine's workers."""
        if self.workers is not None:
            self.workers.close()

    def weights_summary(self) -> str:
        """For the start-up log, e.g. "float32 on cpu, linear weights packed as bfloat16"."""
        summary = f"{_dtype_name(self.dtype)} on {self.device}"
        if self.packed_weight_dtypes is not None:
            maps, logits = self.packed_weight_dtypes
            summary += f", linear weights packed as {maps}"
            if logits != maps:
                summary += f", the logits' as {logits}"
        if self.kv_cache_dtype != self.dtype:
            summary += f", KV cache {_dtype_name(self.kv_cache_dtype)}"
        return summary

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, timer: PhaseTimer
    ) -> tuple[list[Sampled], list[PromptLogprobs]]:
        """Computes every scheduled token; returns the new token (and logprobs when asked for) of
        each sequence whose pending tokens are all computed by this step, and of its new forks,
        which sample from the same logits, in the order of the entries; and the prompt logprobs
        of the prompt positions computed, for sequences that ask for them."""
        input_ids: list[int] = []
        query_lens, context_lens, block_tables = [], [], []
        sampling_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        long_after = self.model.long_after  # longrope's original context, else None
        long_prompts: list[bool] = []
        prompt_rows: list[int] = []  # hidden rows whose logits give prompt logprobs
        prompt_seqs: list[tuple[Sequence, int, int]] = []  # (seq, first position, positions)
        for seq, num_new in batch.entries:
            start = seq.num_computed_tokens
            if seq.prompt_logprobs is not None:
                # Position p predicts prompt token p + 1; those already recorded are skipped.
                first = max(start, len(seq.prompt_logprobs) - 1)
                end = min(start + num_new, seq.num_prompt_tokens - 1)
                if first < end:
                    offset = len(input_ids) - start
                    prompt_rows += range(offset + first, offset + end)
                    prompt_seqs.append((seq, first, end - first))
            input_ids.extend(seq.token_ids[start : start + num_new])
            if long_after is not None:
                long_prompts += [seq.num_prompt_tokens > long_after] * num_new
            query_lens.append(num_new)
            context_lens.append(start + num_new)
            block_tables.append(seq.block_table)
            if start + num_new == seq.num_tokens:
                samplers = [seq, *batch.forks.get(seq, ())]
                sampling_rows += [len(input_ids) - 1] * len(samplers)
                sampling_seqs += samplers
        if (
            self.decode_graphs is not None
            and len(input_ids) == len(query_lens)
            and not prompt_seqs
            and self.decode_graphs.fits(len(input_ids), max(map(len, block_tables)))
        ):
            self._copy_blocks(batch.block_copies)
            timer.lap("prepare")
            hidden = self.decode_graphs.run(input_ids, context_lens, block_tables)
            return self._finish(hidden, sampling_rows, sampling_seqs, [], timer)
        prompt_parts = [
            prompt_rows[begin : begin + _PROMPT_LOGITS_ROWS]
            for begin in range(0, len(prompt_rows), _PROMPT_LOGITS_ROWS)
        ]
        step = StepInputs(
            batch.block_copies,
            input_ids,
            query_lens,
            context_lens,
            block_tables,
            long_prompts,
            prompt_parts + ([sampling_rows] if sampling_rows else []),
        )
        if self.workers is not None:
            self.workers.send(step)
        hidden = self.forward(step, timer)
        prompt = self._prompt_logprobs(hidden, prompt_parts, prompt_seqs) if prompt_seqs else []
        return self._finish(hidden, sampling_rows, sampling_seqs, prompt, timer)

    @torch.inference_mode()
    def follow(self, step: StepInputs) -> None:
        """A tensor-parallel worker's part of a step: the forward pass, then its share of the
        logits of each of the driver's logits rows, in the driver's order."""
        hidden = self.forward(step)
        for rows in step.logits_rows:
            self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])

    @torch.inference_mode()
    def forward(self, step: StepInputs, timer: PhaseTimer | None = None) -> torch.Tensor:
        """The hidden states of every token of a step: what each rank of a tensor-parallel
        engine runs on the inputs rank 0 sent it."""
        self._copy_blocks(step.block_copies)
        attention = AttentionBatch.build(
            step.query_lens,
            step.context_lens,
            step.block_tables,
            self.block_size,
            self.model_config.sliding_window,
            self.device,
            self.decode_in_place,
            self.prefill_in_place,
        )
        input_tensor = torch.tensor(step.input_ids, device=self.device)
        if timer is not None:
            timer.lap("prepare")
        long_prompts = step.long_prompts
        long_tensor = torch.tensor(long_prompts, device=self.device) if long_prompts else None
        return self.model(input_tensor, attention, long_tensor)

    def _copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        if block_copies:
            sources, destinations = zip(*block_copies, strict=True)
            self.model.copy_blocks(
                torch.tensor(sources, device=self.device),
                torch.tensor(destinations, device=self.device),
            )

    def _finish(
        self,
        hidden: torch.Tensor,
        sampling_rows: list[int],
        sampling_seqs: list[Sequence],
        prompt: list[PromptLogprobs],
        timer: PhaseTimer,
    ) -> tuple[list[Sampled], list[PromptLogprobs]]:
        """The logits of the sampling rows of the step's hidden states, and the tokens drawn."""
        if not sampling_seqs:
            timer.lap("forward")
            return [], prompt
        rows = torch.tensor(sampling_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        timer.lap("forward")
        sampled = self._sample(logits, sampling_seqs)
        timer.lap("sample")
        return sampled, prompt

    def _prompt_logprobs(
        self, hidden: torch.Tensor, parts: list[list[int]], seqs: list[tuple[Sequence, int, int]]
    ) -> list[PromptLogprobs]:
        """Log-softmax of the model's logits at each row (no sampling setting applies), for the
        prompt token that follows, with each sequence's top prompt_logprobs alternatives. parts:
        the rows, in parts of _PROMPT_LOGITS_ROWS."""
        targets, num_tops = [], []
        for seq, first, count in seqs:
            targets += seq.token_ids[first + 1 : first + 1 + count]
            num_tops += [seq.params.prompt_logprobs] * count
        entries: list[SampleLogprobs] = []
        widest = max(num_tops)
        begin = 0
        for rows in parts:
            part = slice(begin, begin + len(rows))
            begin += len(rows)
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
            tokens = torch.tensor(targets[part], device=self.device)
            everyone = LogprobsRequest(torch.arange(len(tokens), device=self.device), widest)
            tensors = compute_logprobs(logits.float(), tokens, everyone)
            entries += _logprob_dicts(tensors, targets[part], num_tops[part])
        found, begin = [], 0
        for seq, _, count in seqs:
            found.append(PromptLogprobs(seq, entries[begin : begin + count]))
            begin += count
        return found

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Sampled]:
        batch = self.sampling.batch(seqs)
        result = sample(logits, batch, self.row_argmax)
        self.sampling.drawn(result.tokens)
        tokens = result.tokens.tolist()
        logprobs: list[SampleLogprobs | None] = [None] * len(seqs)
        if result.logprobs is not None:
            rows = batch.logprobs.rows.tolist()
            num_tops = [seqs[row].params.logprobs for row in rows]
            entries = _logprob_dicts(result.logprobs, [tokens[row] for row in rows], num_tops)
            for row, entry in zip(rows, entries, strict=True):
                logprobs[row] = entry
        return [Sampled(*item) for item in zip(seqs, tokens, logprobs, strict=True)]


def _logprob_dicts(
    tensors: LogprobsTensors, chosen: list[int], num_tops: list[int]
) -> list[SampleLogprobs]:
    """One dict per row that asked: the chosen token first, then the row's own top ones (the
    batch fetched as many as its widest row wanted)."""
    chosen_logprobs = tensors.chosen_logprob.tolist()
    chosen_ranks = tensors.chosen_rank.tolist()
    top_ids = tensors.top_ids.tolist()
    top_logprobs = tensors.top_logprobs.tolist()
    entries = []
    for i, num_top in enumerate(num_tops):
        entry = {chosen[i]: Logprob(chosen_logprobs[i], chosen_ranks[i])}
        top = zip(top_ids[i][:num_top], top_logprobs[i][:num_top], strict=True)
        for rank, (token, logprob) in enumerate(top, start=1):
            entry.setdefault(token, Logprob(logprob, rank))
        entries.append(entry)
    return entries


def _worker_runner(
    model_dir: Path,
    model_config: ModelConfig,
    config: EngineConfig,
    eos_token_ids: tuple[int, ...],
    gguf_path: Path | None,
    parallel: TensorParallel,
) -> ModelRunner:
    """A tensor-parallel worker's runner (a module-level function: spawn pickles it)."""
    return ModelRunner(model_dir, model_config, config, eos_token_ids, gguf_path, parallel)
