"""What the hardware allows: matmul FLOP/s, memory bandwidth, and the tokens/s they imply.

A decode step reads every weight once and does about 2 FLOPs per weight per token, so tokens/s is
bounded by compute (FLOP/s / FLOPs per token) and, for a batch of b, by bandwidth
(b * bytes/s / weight bytes). Attention over the context is left out: at these lengths it is a
few percent of the work.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field

import torch

from pagedserve.model.cpu_features import CpuFeatures
from pagedserve.model.decoder import DecoderModel
from pagedserve.model.layers import Linear, PackedWeight, can_use_cpu_kernels
from pagedserve.model.quantization import BYTES_PER_WEIGHT, logits_weight_dtype
from pagedserve.timing import Stopwatch


@dataclass
class Ceilings:
    matmul_gflops: dict[str, float]  # by dtype name
    bandwidth_gbs: float  # bytes read per second, in 1e9
    threads: int  # torch's intra-op threads while these were measured
    # Mean microseconds of a decode-sized product, by thread count (CPU only).
    small_product_us: dict[int, float] = field(default_factory=dict)
    # The rates of each measurement these are the best of (see best_of), in the order measured.
    measurements: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def best_of(measured: list[Ceilings]) -> Ceilings:
        """The highest of each rate over measurements of one machine at different times: a busy
        spell on a shared machine only slows a measurement down. The decode-sized product's
        times are the first measurement's."""
        first = measured[0]
        return Ceilings(
            matmul_gflops={
                name: max(c.matmul_gflops[name] for c in measured) for name in first.matmul_gflops
            },
            bandwidth_gbs=max(c.bandwidth_gbs for c in measured),
            threads=first.threads,
            small_product_us=first.small_product_us,
            measurements=[
                {"matmul_gflops": c.matmul_gflops, "bandwidth_gbs": c.bandwidth_gbs}
                for c in measured
            ],
        )


@dataclass
class ModelCost:
    weight_elements: int  # every weight, read once per decode step
    element_size: int  # bytes per weight, in the model's dtype
    packed_elements: int  # of those, the linear maps' (the tied output projection included)
    logits_elements: int  # of those, the output projection's
    flops_per_token: float

    @property
    def weight_bytes(self) -> int:
        return self.weight_elements * self.element_size

    def step_bytes(self, packed_weight_dtype: str | None = None) -> float:
        """The bytes of weights a decode step reads, with the linear maps' weights packed as
        packed_weight_dtype when given (--packed-weight-dtype)."""
        if packed_weight_dtype is None:
            return self.weight_bytes
        logits_size = BYTES_PER_WEIGHT[logits_weight_dtype(packed_weight_dtype)]
        return (
            (self.weight_elements - self.packed_elements) * self.element_size
            + (self.packed_elements - self.logits_elements) * BYTES_PER_WEIGHT[packed_weight_dtype]
            + self.logits_elements * logits_size
        )

    def compute_bound_tokens_per_s(self, ceilings: Ceilings, dtype: str) -> float:
        return 1e9 * ceilings.matmul_gflops[dtype] / self.flops_per_token

    def bandwidth_bound_tokens_per_s(
        self, ceilings: Ceilings, packed_weight_dtype: str | None = None
    ) -> float:
        """Tokens/s of one stream that reads every weight once per token (see step_bytes)."""
        return 1e9 * ceilings.bandwidth_gbs / self.step_bytes(packed_weight_dtype)

    def ideal_tokens_per_s(self, ceilings: Ceilings, dtype: str, batch: int) -> float:
        return min(
            self.compute_bound_tokens_per_s(ceilings, dtype),
            batch * self.bandwidth_bound_tokens_per_s(ceilings),
        )


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
        # a linear map multiplies by its transpose
        packed = PackedWeight.pack(b.T, str(dtype).removeprefix("torch."))
        seconds = min(seconds, _best_seconds(lambda: packed(a), device))
    return 2 * size**3 / seconds / 1e9


def bandwidth_gbs(device: torch.device, num_bytes: int = 256 * 2**20) -> float:
    """Reading a buffer far larger than the caches, as a decode step reads the weights. Where the
    engine has its own packed product (float32 on CPU), one row through a float32 weight of that
    size is timed too and the faster read counts: it reads faster than torch's sum here."""
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    seconds = _best_seconds(lambda: buffer.sum(), device)
    if can_use_cpu_kernels(device, torch.float32):
        packed = PackedWeight.pack(buffer.view(-1, 2048), "float32")
        row = torch.ones(1, 2048)
        seconds = min(seconds, _best_seconds(lambda: packed(row), device))
    return num_bytes / seconds / 1e9


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


def model_cost(model: DecoderModel) -> ModelCost:
    """From a loaded decoder: its weight bytes in checkpoint layout (whether or not the linear
    weights were packed since), and 2 FLOPs per weight that multiplies."""
    linears = [module for module in model.modules() if isinstance(module, Linear)]
    linear_elements = sum(linear.in_features * linear.out_features for linear in linears)
    plain_linear_weights = {id(linear.weight) for linear in linears if linear.weight is not None}
    other_elements = sum(p.numel() for p in model.parameters() if id(p) not in plain_linear_weights)
    multiplied = linear_elements
    # Tied embeddings are also the output projection; untied ones are only looked up.
    if model.lm_head is None:
        multiplied += model.embed_tokens.numel()
        logits_elements = model.embed_tokens.numel()
    else:
        logits_elements = model.lm_head.in_features * model.lm_head.out_features
    return ModelCost(
        linear_elements + other_elements,
        model.embed_tokens.element_size(),
        multiplied,
        logits_elements,
        2.0 * multiplied,
    )


def machine_description() -> dict:
    return {
        "cpu": CpuFeatures.host().describe(),  # model, family/model and instruction sets
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "native_bfloat16": CpuFeatures.host().native_bfloat16,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
