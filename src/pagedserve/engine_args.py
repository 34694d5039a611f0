"""The engine's command-line flags, shared by `pagedserve` and `pagedserve bench`."""

from __future__ import annotations

import argparse
from dataclasses import fields

from pagedserve.config import (
    CHAT_CONTENT_MODES,
    CPU_BINDINGS,
    DISTRIBUTED_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    PACKED_WEIGHT_DTYPES,
    SCHEDULER_POLICIES,
    EngineConfig,
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=None,
        help="checkpoint dir, .gguf file or hub name org/name[@revision] (default: SmolLM2)",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file to use instead of the tokenizer's",
    )
    group.add_argument(
        "--chat-content-tokens",
        choices=CHAT_CONTENT_MODES,
        default=defaults["chat_content_tokens"],
        help="text: a control token spelled inside a chat message is tokenized as text, and "
        "only the template's own markers are control tokens; parse: as spelled",
    )
    group.add_argument("--dtype", choices=DTYPES, default=defaults["dtype"])
    group.add_argument("--device", default=defaults["device"], help="auto, cpu, cuda, cuda:1")
    group.add_argument("--block-size", type=int, default=defaults["block_size"])
    group.add_argument("--max-num-seqs", type=int, default=defaults["max_num_seqs"])
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=defaults["max_num_batched_tokens"]
    )
    group.add_argument("--kv-cache-memory", default=defaults["kv_cache_memory"])
    group.add_argument("--num-kv-blocks", type=int, default=None)
    group.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=defaults["kv_cache_dtype"],
        help="what cached keys and values are stored as (auto: the model's dtype); bfloat16 "
        "under a float32 model holds twice the tokens and halves what decode attention reads",
    )
    group.add_argument("--scheduler", choices=SCHEDULER_POLICIES, default=defaults["scheduler"])
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument(
        "--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false"
    )
    group.add_argument(
        "--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false"
    )
    group.add_argument(
        "--no-cpu-kernels",
        dest="cpu_kernels",
        action="store_false",
        help="float32 on CPU: F.linear on weights as loaded, and torch's RMSNorm, SiLU and "
        "rotation, instead of the C++ kernels (decode attention: --no-decode-kernel)",
    )
    group.add_argument(
        "--packed-weight-dtype",
        choices=PACKED_WEIGHT_DTYPES,
        default=defaults["packed_weight_dtype"],
        help="float32 on CPU: the format of the packed linear weights (docs/CPU_KERNELS.md); "
        "auto keeps a GGUF or bfloat16 checkpoint's own weights exactly, else float32",
    )
    group.add_argument(
        "--no-decode-kernel",
        dest="decode_kernel",
        action="store_false",
        help="on CPU, gather cached blocks for SDPA instead of the C++ decode attention",
    )
    group.add_argument(
        "--batch-invariant",
        type=_true_or_false,
        default=defaults["batch_invariant"],
        metavar="{true,false}",
        help="on CPU, results bit-identical whatever shares a request's batch (true); false "
        "attends prompts with SDPA, faster for long prompts",
    )
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run decode steps op by op instead of replaying captured CUDA graphs",
    )
    group.add_argument("--seed", type=int, default=defaults["seed"])
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=defaults["tensor_parallel_size"],
        help="processes the model's heads and MLP are cut across (CPU, gloo)",
    )
    group.add_argument(
        "--distributed-backend",
        choices=DISTRIBUTED_BACKENDS,
        default=defaults["distributed_backend"],
    )
    group.add_argument(
        "--cpu-binding",
        choices=CPU_BINDINGS,
        default=defaults["cpu_binding"],
        help="with --tensor-parallel-size: auto gives each process its own share of the cores; "
        "none lets them share",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{name: getattr(args, name) for name in names if hasattr(args, name)})


def _true_or_false(value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return value.lower() == "true"
