"""What the hardware allows: matmul FLOP/s, memory bandwidth, and the tokens/s they imply.

A decode step reads every weight once and does about 2 FLOPs per weight per token, so tokens/s is
bounded by compute (FLOP/s / FLOPs per token) and, for a batch of b, by bandwidth
(b * bytes/s / weight bytes). Attention over the context is left out: at these lengths it is a
few percent of the work.
"""

from __future__ import annotations

import os
import platform

import torch

from pagedserve.bench.records import Ceilings, Machine, ModelCost
from pagedserve.model.cpu_features import CpuFeatures
from pagedserve.model.decoder import DecoderModel
from pagedserve.model.kernels import can_use_cpu_kernels
from pagedserve.model.layers import Linear
from pagedserve.model.linear_method import PACKED_FORMATS
from pagedserve.timing import Stopwatch


def _best_seconds(
    work, device: torch.device, budget_s: float = 2.0, max_repeats: int = 10
) -> float:
    """The fastest of repeated runs (at least two, then until budget_s is spent): on a shared
    machine the fastest run is the one least disturbed by others."""
    work()  # the first call pays for allocation and kernel selection
    times: list[float] = []
    while len(times) < 2 or (sum(times) < budget_s and len(times) < max_repeats):
        with Stopwatch(device) as watch:
            work()
        times.append(watch.seconds)
    return min(times)


def matmul_gflops(dtype: torch.dtype, device: torch.device, size: int = 1024) -> float:
    """The best of several square float matmuls: the most a large batch's products could get.
    Where the engine multiplies with its own packed product (float32 on CPU), that is timed too
    and the faster of the two counts, so that no figure can beat its ceiling."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    seconds = _best_seconds(lambda: torch.mm(a, b), device)
    if can_use_cpu_kernels(device, dtype):
        packed = _packed_linear(b.T, str(dtype).removeprefix("torch."))  # a linear map's x @ W.T
        seconds = min(seconds, _best_seconds(lambda: packed(a), device))
    return 2 * size**3 / seconds / 1e9


def bandwidth_gbs(device: torch.device, num_bytes: int = 256 * 2**20) -> float:
    """Reading a buffer far larger than the caches, as a decode step reads the weights. Where the
    engine has its own packed product (float32 on CPU), one row through a float32 weight of that
    size is timed too and the faster read counts: it reads faster than torch's sum here."""
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    seconds = _best_seconds(lambda: buffer.sum(), device)
    if can_use_cpu_kernels(device, torch.float32):
        packed = _packed_linear(buffer.view(-1, 2048), "float32")
        row = torch.ones(1, 2048)
        seconds = min(seconds, _best_seconds(lambda: packed(row), device))
    return num_bytes / seconds / 1e9


def _packed_linear(weight: torch.Tensor, packed_format: str) -> Linear:
    """A Linear holding weight ([out, in]) in one of the packed formats."""
    linear = Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.float32)
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    linear.use_method(PACKED_FORMATS[packed_format])
    return linear


def small_product_us(threads: int, repeats: int = 300) -> float:
    """Mean time of one [8, 576] x [576, 1536] product, a decode step's size, on `threads` CPU
    threads. A mean, not a best: on a shared machine the waits for a descheduled thread are the
    point."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, weight = torch.randn(8, 576), torch.randn(1536, 576)
        torch.nn.functional.linear(x, weight)
        with Stopwatch("cpu") as watch:
            for _ in range(repeats):
                torch.nn.functional.linear(x, weight)
    finally:
        torch.set_num_threads(previous)
    return 1e6 * watch.seconds / repeats


def measure_ceilings(device: torch.device) -> Ceilings:
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    small = {}
    if device.type == "cpu":
        small = {n: small_product_us(n) for n in sorted({1, os.cpu_count() or 1})}
    return Ceilings(
        matmul_gflops={name: matmul_gflops(dtype, device) for name, dtype in dtypes.items()},
        bandwidth_gbs=bandwidth_gbs(device),
        threads=torch.get_num_threads(),
        small_product_us=small,
    )


def step_bytes(cost: ModelCost, packed_weight_dtype: str | None = None) -> float:
    """The bytes of weights a decode step reads, with the linear maps' weights packed as
    packed_weight_dtype when given (--packed-weight-dtype)."""
    if packed_weight_dtype is None:
        return cost.weight_bytes
    packed = PACKED_FORMATS[packed_weight_dtype]
    return (
        (cost.weight_elements - cost.packed_elements) * cost.element_size
        + (cost.packed_elements - cost.logits_elements) * packed.bytes_per_weight
        + cost.logits_elements * PACKED_FORMATS[packed.logits].bytes_per_weight
    )


def model_cost(model: DecoderModel) -> ModelCost:
    """From a loaded decoder: its weight bytes in checkpoint layout (whether or not the linear
    weights were packed since), and 2 FLOPs per weight that multiplies."""
    linears = [module for module in model.modules() if isinstance(module, Linear)]
    multiplied = sum(linear.in_features * linear.out_features for linear in linears)
    counted = {id(linear.weight) for linear in linears if linear.weight is not None}
    # The embeddings, whether a parameter or GGUF blocks (model.embedding_blocks), are counted
    # apart: tied, they are the output projection's weight as well (counted once, as multiplied).
    counted.add(id(model.embed_tokens))
    other_elements = sum(p.numel() for p in model.parameters() if id(p) not in counted)
    if not model.config.tie_word_embeddings:
        other_elements += model.config.vocab_size * model.config.hidden_size
    return ModelCost(
        weight_elements=multiplied + other_elements,
        element_size=model.norm.weight.element_size(),
        packed_elements=multiplied,
        logits_elements=model.lm_head.in_features * model.lm_head.out_features,
        flops_per_token=2.0 * multiplied,
    )


def this_machine() -> Machine:
    cpu = CpuFeatures.host()
    return Machine(
        cpu=cpu.describe(),
        kind=cpu.kind,
        cores=os.cpu_count() or 1,
        torch_threads=torch.get_num_threads(),
        native_bfloat16=cpu.native_bfloat16,
        torch=torch.__version__,
        python=platform.python_version(),
        cuda=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    )
