"""Decode steps replayed from captured CUDA graphs.

On a GPU a decode step at serving batch sizes is a few hundred small kernels, and the step's time
is the host launching them one by one. A CUDA graph records one step's launches once and replays
them with a single call. A graph replays fixed shapes at fixed addresses, so:

- a step's inputs are copied into static buffers (token ids, context lengths, block tables) that
  every replay reads, and the model's output lands in a static tensor that the caller reads
  before the next replay;
- one graph is captured per bucket: the batch size rounded up to the next of `batch_sizes`, the
  block tables' width to the next power of two (attention gathers every block of the width, so
  the widest table decides what a step reads). All are captured at start-up, largest first, in
  one memory pool: a step is replayed by exactly one graph, so their intermediates can share it;
- rows that only pad a step up to its bucket decode a token of their own in a scratch block that
  the block manager never hands out, and their output is dropped. Table columns past a sequence's
  own blocks point at the scratch block too; the mask keeps every row to its own context.

Without capture (capture=False, e.g. on a CPU) the same padded step runs eagerly: the tests check
the padding and masking there against transformers.
"""

from __future__ import annotations

import torch

from pagedserve.model.attention import AttentionBatch
from pagedserve.model.decoder import DecoderModel

_SMALL_BATCHES = (1, 2, 4, 8)
_BATCH_STEP = 16  # above 8 rows, buckets every 16 rows: at most 15 padded rows a step
_NARROWEST = 4  # blocks: narrower tables cost no less to attend over


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every multiple of 16 up to max_batch (and
    max_batch itself)."""
    sizes = [size for size in _SMALL_BATCHES if size < max_batch]
    sizes += range(_BATCH_STEP, max_batch, _BATCH_STEP)
    return [*sizes, max_batch]


def width_buckets(max_blocks: int) -> list[int]:
    """The table widths captured: powers of two from _NARROWEST blocks up to max_blocks, and
    max_blocks."""
    first = _NARROWEST.bit_length() - 1
    widths = [1 << bits for bits in range(first, max_blocks.bit_length()) if 1 << bits < max_blocks]
    return [*widths, max_blocks]


class DecodeGraphs:
    def __init__(
        self,
        model: DecoderModel,
        block_size: int,
        max_batch: int,
        max_blocks: int,
        scratch_block: int,
        capture: bool,
    ):
        self.model = model
        self.block_size = block_size
        self.batch_sizes = batch_buckets(max_batch)
        self.widths = width_buckets(max_blocks)
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.capture = capture
        device = model.norm.weight.device
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.context_lens = torch.ones(max_batch, dtype=torch.long, device=device)
        self.tables = torch.full(
            (max_batch, max_blocks), scratch_block, dtype=torch.long, device=device
        )
        # (batch, width) -> (graph, its output [batch, hidden])
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def fits(self, batch_size: int, longest_table: int) -> bool:
        return batch_size <= self.batch_sizes[-1] and longest_table <= self.max_blocks

    def run(
        self, input_ids: list[int], context_lens: list[int], block_tables: list[list[int]]
    ) -> torch.Tensor:
        """The final hidden states [len(input_ids), hidden] of a step of single-token decodes:
        input_ids[i] is the last token of a sequence with context_lens[i] tokens (it included)
        whose cache blocks are block_tables[i]."""
        rows = len(input_ids)
        batch = next(size for size in self.batch_sizes if size >= rows)
        longest = max(map(len, block_tables))
        width = next(width for width in self.widths if width >= longest)
        padding = batch - rows
        tables = [table + [self.scratch_block] * (width - len(table)) for table in block_tables]
        tables += [[self.scratch_block] * width] * padding
        self.input_ids[:batch].copy_(torch.tensor(input_ids + [0] * padding))
        self.context_lens[:batch].copy_(torch.tensor(context_lens + [1] * padding))
        self.tables[:batch, :width].copy_(torch.tensor(tables))
        if not self.capture:
            return self._forward(batch, width)[:rows]
        graph, output = self.graphs[batch, width]
        graph.replay()
        return output[:rows]

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Captures every bucket's graph, largest first, so that the first capture sizes the
        shared pool. The buffers hold padding meanwhile: captures write the scratch block only."""
        for batch in reversed(self.batch_sizes):
            for width in reversed(self.widths):
                self._capture(batch, width)
        torch.cuda.synchronize()

    def _forward(self, batch: int, width: int) -> torch.Tensor:
        attention = AttentionBatch.padded_decodes(
            self.context_lens[:batch],
            self.tables[:batch, :width],
            self.block_size,
            self.model.config.sliding_window,
        )
        return self.model(self.input_ids[:batch], attention)

    def _capture(self, batch: int, width: int) -> None:
        # A first run outside the graph initialises what the kernels set up once (cuBLAS
        # handles and workspaces), on a side stream as capture requires.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(batch, width)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = self._forward(batch, width)
        self.pool = graph.pool()
        self.graphs[batch, width] = graph, output
