"""Engine settings, validated up front so that a bad value fails before any model is loaded."""

from __future__ import annotations

import re
from dataclasses import dataclass

SCHEDULER_POLICIES = ("continuous", "static")
# How a conversation's strings are tokenized (engine/chat_content.py): as text, or with the control
# tokens they spell parsed as the template's own.
CHAT_CONTENT_MODES = ("text", "parse")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = DTYPES  # auto: the model's dtype
PACKED_WEIGHT_DTYPES = (
    "auto",
    "float32",
    "bfloat16",
    "float16",
    "bfloat16_bf16",
    "int8",
    "q8_0",
    "q8_0_q8",
    "q4_1",
    "q4_1_q8",
    "q5_0",
    "q5_1",
    "q8_min",
    "q4_k",
    "q5_k",
    "q6_k",
    "q4_k_q8",
    "q6_k_q8",
    "q5_0_q8",
)
# auto: shm on x86-64 (its stores are seen in order, which the shared-memory all-reduce relies
# on), else gloo.
DISTRIBUTED_BACKENDS = ("auto", "shm", "gloo")
CPU_BINDINGS = ("auto", "none")
# How `pagedserve serve` runs engines: mp, one in the server's process (its tensor-parallel ranks
# as processes); ray, every data-parallel replica a Ray actor (engine/replicas.py).
EXECUTOR_BACKENDS = ("mp", "ray")
_MEMORY_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9}
_MEMORY_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30}


@dataclass
class EngineConfig:
    # A checkpoint directory, a .gguf file or a hub name (org/name[@revision]); None: the
    # embedded SmolLM2-135M-Instruct.
    model: str | None = None
    # A Jinja chat template (a file, or the template itself) used instead of the tokenizer's.
    chat_template: str | None = None
    # "text": a control token spelled inside a message stays text; "parse": it becomes the token.
    chat_content_tokens: str = "text"
    dtype: str = "auto"  # auto: bfloat16 on CUDA; float32 on a CPU (model_runner.resolve_dtype)
    device: str = "auto"  # auto: cuda when present, else cpu
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    kv_cache_memory: str | int = "1GiB"
    # What keys and values are stored as (auto: the model's dtype). bfloat16 under a float32 model
    # holds twice the tokens in the same memory, and halves the bytes decode attention reads; the
    # arithmetic stays float32.
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set
    scheduler: str = "continuous"
    max_model_len: int | None = None  # None: the model's own context length
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # Float32 on CPU: linear weights reordered once into panels for the C++ product, and C++
    # RMSNorm, SwiGLU and rotation with the cache write (pagedserve.model.kernels).
    cpu_kernels: bool = True
    # What those packed weights are stored as (docs/CPU_KERNELS.md has the formats); auto keeps
    # the checkpoint's own weights exactly (model/linear_method.choose_format).
    packed_weight_dtype: str = "auto"
    # CPU: decode attention reads the paged cache in place, in C++ (pagedserve.model.kernels).
    decode_kernel: bool = True
    # CPU, with decode_kernel: prompts' tokens are attended in place too, one row per token, so
    # a request's results never depend on what shares its batch; False attends prompts with
    # SDPA in groups, faster for long prompts and batch-dependent in the last bits.
    batch_invariant: bool = True
    # CUDA: decode steps run op by op instead of being replayed from captured CUDA graphs.
    enforce_eager: bool = False
    seed: int = 0
    # Processes the model is cut across (engine/tensor_parallel.py, model/parallel.py), joined
    # through shared memory ("shm") or torch.distributed's gloo; on CPU each computes on its own
    # share of the cores (cpu_binding "auto") or all share them ("none").
    tensor_parallel_size: int = 1
    distributed_backend: str = "auto"
    cpu_binding: str = "auto"

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be an integer of at least 1, "
                f"got {self.tensor_parallel_size!r}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        choices = {
            "scheduler": SCHEDULER_POLICIES,
            "chat_content_tokens": CHAT_CONTENT_MODES,
            "dtype": DTYPES,
            "kv_cache_dtype": KV_CACHE_DTYPES,
            "packed_weight_dtype": PACKED_WEIGHT_DTYPES,
            "distributed_backend": DISTRIBUTED_BACKENDS,
            "cpu_binding": CPU_BINDINGS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "cpu_kernels",
                     "decode_kernel", "batch_invariant", "enforce_eager"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        parse_memory(self.kv_cache_memory)

    @property
    def kv_cache_bytes(self) -> int:
        return parse_memory(self.kv_cache_memory)

    def served_length(self, max_position_embeddings: int) -> int:
        """The context served: max_model_len, at most the model's own."""
        return min(self.max_model_len or max_position_embeddings, max_position_embeddings)

    def token_budget(self, max_model_len: int) -> int:
        """The most tokens one step computes: without chunked prefill, a whole prompt (or a
        preempted request's recompute) runs in one step."""
        if self.enable_chunked_prefill:
            return self.max_num_batched_tokens
        return max(self.max_num_batched_tokens, max_model_len)


def parse_memory(value: str | int) -> int:
    """'2GiB', '512MB', '1e9' or a plain byte count."""
    if isinstance(value, int):
        amount = value
    else:
        not_a_size = ValueError(f"kv_cache_memory {value!r} is not a size like '2GiB' or '512MB'")
        match = re.fullmatch(r"\s*([0-9.e+]+)\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _MEMORY_UNITS:
            raise not_a_size
        try:
            amount = int(float(match.group(1)) * _MEMORY_UNITS[unit])
        except (ValueError, OverflowError):  # "1e", "..", "1e400"
            raise not_a_size from None
    if amount <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {value!r}")
    return amount
