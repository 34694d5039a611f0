"""Tensor parallelism in Megatron's layout: what each of N ranks holds of the model, and the sum
over ranks that makes whole what they compute apart.

Rank r of N holds
- its share of the attention heads, num_heads / N queries and num_kv_heads / N keys and values
  (and so 1/N of every KV cache block): qkv_proj keeps those heads' rows (column parallel), o_proj
  their columns (row parallel);
- 1/N of the MLP's intermediate features: gate_up_proj's rows of each half, down_proj's columns;
- 1/N of the vocabulary (vocab_range: consecutive token ids, shares differing by one at most):
  those rows of the embeddings and of the output projection;
- the norms whole.
A row-parallel map's output is a partial sum over its inputs; DecoderLayer sums it over the ranks
(all-reduce) before the residual add, and its bias is held by rank 0 alone, so that it is added
once. The embedding lookup is such a sum too: a rank gives the rows of its own tokens and zeros
for the others'. Each rank then holds the same hidden states and computes the logits of its
share of the vocabulary; rank 0 gathers them side by side (gather_logits) and samples.

The same cuts apply to a GGUF file's blocks (shard_parts), so that a rank packs its share of the
file's own blocks, as one process packs the whole."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from pagedserve.model.config import ModelConfig
from pagedserve.model.gguf_blocks import GGUFPart


@dataclass
class TensorParallel:
    rank: int
    size: int
    # Sums a tensor over the ranks in place, every rank getting the same sum: the channel of
    # engine/tensor_parallel.py that joins them (shared memory, or gloo).
    reduce: Callable[[torch.Tensor], None] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )
    # Concatenates along columns every rank's [rows, its width] tensor, widths in rank order:
    # the whole on rank 0, None on the others.
    gather: Callable[[torch.Tensor, list[int]], torch.Tensor | None] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )
    # Wall time this rank has spent in all_reduce, waiting for the others included.
    seconds_in_all_reduce: float = dataclasses.field(default=0.0, compare=False)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shapes this rank holds: its heads and its share of the MLP."""
        check_divides(config, self.size)
        return dataclasses.replace(
            config,
            num_heads=config.num_heads // self.size,
            num_kv_heads=config.num_kv_heads // self.size,
            intermediate_size=config.intermediate_size // self.size,
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place: every rank gets the same sum."""
        started = time.perf_counter()
        self.reduce(x)
        self.seconds_in_all_reduce += time.perf_counter() - started
        return x

    def vocab_range(self, vocab_size: int) -> range:
        """The token ids whose embeddings and logits this rank holds."""
        return range(self.rank * vocab_size // self.size, (self.rank + 1) * vocab_size // self.size)

    def vocab_widths(self, vocab_size: int) -> list[int]:
        """Every rank's share of the vocabulary, in rank order."""
        return [
            len(TensorParallel(rank, self.size).vocab_range(vocab_size))
            for rank in range(self.size)
        ]

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """This rank's [rows, its share] logits joined with the others': [rows, vocab_size]
        on rank 0, None on the others. Every rank calls it with the same rows."""
        return self.gather(logits.contiguous(), self.vocab_widths(vocab_size))

    def shard(self, key: str, index: int | None, tensor: torch.Tensor, config: ModelConfig):
        """This rank's part of a checkpoint tensor going to key (index: its place among a fused
        map's parts, None for a tensor whole on disk). config: the whole model's."""
        if key in ("embed_tokens", "lm_head.weight"):
            return tensor[self._vocab_slice(config)]
        module, _, kind = key.rpartition(".")
        last = module.rsplit(".", 1)[-1]
        sections = _sections(last, index, config)
        if sections is not None:
            return torch.cat([self._rows(part) for part in tensor.split(sections, dim=0)])
        if last in ("o_proj", "down_proj"):
            if kind == "bias":
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            return self._rows(tensor.T).T
        return tensor

    def shard_parts(
        self, module: str, parts: Sequence[GGUFPart], config: ModelConfig
    ) -> list[GGUFPart] | None:
        """This rank's part of a linear map's GGUF blocks (each part's rows: [out, bytes]);
        None where the cut falls inside a block, and the map is read as floats and cut."""
        last = module.rsplit(".", 1)[-1]
        if last in ("embed_tokens", "lm_head"):
            rows = self._vocab_slice(config)
            return [GGUFPart(part.type, part.rows[rows]) for part in parts]
        if last in ("qkv_proj", "gate_up_proj"):
            cut = []
            for index, part in enumerate(parts):
                sections = _sections(last, index if len(parts) > 1 else None, config)
                offsets = np.cumsum([0, *sections])
                rows = [
                    self._rows(part.rows[begin:end]) for begin, end in itertools.pairwise(offsets)
                ]
                cut.append(GGUFPart(part.type, np.concatenate(rows)))
            return cut
        if last in ("o_proj", "down_proj"):
            cut = []
            for part in parts:
                _, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[part.type]]
                blocks = part.rows.shape[1] // nbytes
                if blocks % self.size:
                    return None
                share = blocks // self.size * nbytes
                rows = part.rows[:, self.rank * share : (self.rank + 1) * share]
                cut.append(GGUFPart(part.type, np.ascontiguousarray(rows)))
            return cut
        return list(parts)

    def _vocab_slice(self, config: ModelConfig) -> slice:
        share = self.vocab_range(config.vocab_size)
        return slice(share.start, share.stop)

    def _rows(self, tensor):
        """This rank's 1/N of tensor's rows, in order."""
        share = tensor.shape[0] // self.size
        return tensor[self.rank * share : (self.rank + 1) * share]


def _sections(last: str, index: int | None, config: ModelConfig) -> list[int] | None:
    """The row sections of a column-parallel map's tensor, each cut in N apart: a fused map's
    part is one section; a map fused on disk (Phi-3) holds all of them."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    if last == "qkv_proj":
        whole = [q, kv, kv]
    elif last == "gate_up_proj":
        whole = [config.intermediate_size] * 2
    else:
        return None
    return whole if index is None else [whole[index]]


def check_divides(config: ModelConfig, size: int) -> None:
    """Refuses, before anything is loaded, a model whose heads or MLP cannot be cut in size."""
    if any(config.moe_layers):
        raise ValueError(
            f"tensor_parallel_size {size}: mixture-of-experts models ({config.architecture}) "
            "run on one rank only"
        )
    if config.vocab_size < size:
        raise ValueError(
            f"tensor_parallel_size {size} is more than the model's vocab_size ({config.vocab_size})"
        )
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % size:
            raise ValueError(
                f"tensor_parallel_size {size} must divide the model's {name} ({value})"
            )
