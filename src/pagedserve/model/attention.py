"""Paged attention: new keys and values go into cache slots, old ones are read through block tables.

A step's tokens (prefill chunks and single decode tokens alike) are attended in a few batched calls
per layer, one per group of sequences with similar query lengths, so a long chunk never pads every
decode or short chunk to its length. Within a call the packed queries are scattered into a
[sequences, longest query] grid, each sequence's keys and values are gathered from its blocks, and
a mask enforces causality, each sequence's own length and the sliding window.

On the CPU every token skips the gather by default: the C++ kernel of pagedserve.model.kernels
reads its keys and values in place through the block tables, one row per token over its own
context, all of a step's tokens in one call. A token's attention then depends on its sequence
alone, never on how the step was batched or its prompt chunked (batch invariance). With
--batch-invariant false only single-token decodes go there, and prompts are attended by SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.model.config import ModelConfig
from pagedserve.model.custom_op import CustomOp
from pagedserve.model.layers import Linear, RMSNorm
from pagedserve.model.rotary import RotaryAngles

# More than any table's length in blocks can need (2**64 blocks).
_CONTEXT_BUCKETS = 64


def _padded_tables(block_tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """[sequences, longest table] int64, shorter tables padded with block 0."""
    width = max(len(table) for table in block_tables)
    padded = [table + [0] * (width - len(table)) for table in block_tables]
    return torch.tensor(padded, dtype=torch.long, device=device)


@dataclass
class AttentionGroup:
    """Sequences attended together in one padded call."""

    token_index: torch.Tensor | None  # [group tokens] rows of the packed step; None: all rows
    block_tables: torch.Tensor  # [sequences, blocks] padded with block 0, masked out
    query_slots: torch.Tensor | None  # [group tokens] index into the query grid; None: 1 each
    attn_mask: torch.Tensor | None  # [sequences, 1, longest query, keys] True where allowed
    max_query_len: int
    # Only for decodes read in place by the C++ kernel, which need no mask: [sequences] tokens
    # in each sequence's cache, the new one included.
    context_lens: torch.Tensor | None = None
    # attn_mask within the sliding window too, for the layers that have one (None: no window).
    window_mask: torch.Tensor | None = None

    def mask(self, sliding_window: int | None) -> torch.Tensor | None:
        return self.attn_mask if sliding_window is None else self.window_mask

    @property
    def in_place(self) -> bool:
        return self.context_lens is not None

    @classmethod
    def in_place_decodes(
        cls, context_lens: torch.Tensor, tables: torch.Tensor, token_index: torch.Tensor | None
    ) -> AttentionGroup:
        return cls(token_index, tables, None, None, 1, context_lens)

    @classmethod
    def decodes(
        cls,
        context_lens: torch.Tensor,
        tables: torch.Tensor,
        block_size: int,
        sliding_window: int | None,
    ) -> AttentionGroup:
        """One query per sequence, the last of its context: what build gives for such a group,
        computed by tensor operations alone (no value read back to the host), so that a CUDA
        graph can capture it."""
        key_positions = torch.arange(tables.shape[1] * block_size, device=tables.device)
        causal = key_positions < context_lens[:, None]
        window_mask = None
        if sliding_window is not None:
            in_window = causal & (key_positions >= context_lens[:, None] - sliding_window)
            window_mask = in_window[:, None, None, :]
        return cls(None, tables, None, causal[:, None, None, :], 1, window_mask=window_mask)

    @classmethod
    def build(
        cls,
        q_lens: torch.Tensor,
        first_positions: torch.Tensor,
        tables: torch.Tensor,
        block_size: int,
        sliding_window: int | None,
        token_index: torch.Tensor | None,
    ) -> AttentionGroup:
        device = q_lens.device
        max_query_len = int(q_lens.max())
        query_positions = first_positions[:, None] + torch.arange(max_query_len, device=device)
        key_positions = torch.arange(tables.shape[1] * block_size, device=device)
        causal = key_positions <= query_positions[:, :, None]
        # Padding rows of the query grid attend to everything so that softmax stays finite.
        padding_rows = (torch.arange(max_query_len, device=device) >= q_lens[:, None])[:, :, None]
        window_mask = None
        if sliding_window is not None:
            in_window = causal & (key_positions > query_positions[:, :, None] - sliding_window)
            window_mask = (in_window | padding_rows).unsqueeze(1)
        query_slots = None
        if max_query_len > 1:
            seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens), device=device), q_lens)
            starts = torch.cumsum(q_lens, 0) - q_lens
            offsets = torch.arange(len(seq_of_token), device=device) - starts[seq_of_token]
            query_slots = seq_of_token * max_query_len + offsets
        attn_mask = (causal | padding_rows).unsqueeze(1)
        return cls(
            token_index, tables, query_slots, attn_mask, max_query_len, window_mask=window_mask
        )


@dataclass
class AttentionBatch:
    """Where each token of a step sits, in tensors shared by every layer."""

    positions: torch.Tensor  # [tokens] position of each token in its sequence
    slot_mapping: torch.Tensor  # [tokens] cache slot (block * block_size + offset) to write
    groups: list[AttentionGroup]

    @property
    def in_place_decodes(self) -> AttentionGroup | None:
        """The step's one group when every token in it is read in place by the C++ kernel (a
        step of decodes, or any step when prompts are attended in place too), else None."""
        if len(self.groups) == 1 and self.groups[0].in_place:
            return self.groups[0]
        return None

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        sliding_window: int | None,
        device: torch.device,
        decode_in_place: bool = False,
        prefill_in_place: bool = False,
    ) -> AttentionBatch:
        """context_lens count each sequence's tokens after this step, the new ones included.
        decode_in_place: single-token decodes go to the C++ kernel, as one group. With
        prefill_in_place too, every token goes there, one row per token attending over its own
        context (its position and those before it), so a token's result is the same whether it
        is decoded, prefilled in one piece or in chunks, or recomputed after preemption, and
        whatever else is in the step; otherwise longer queries are attended by SDPA in groups."""
        if decode_in_place and max(query_lens) == 1:
            return cls._in_place_decodes(context_lens, block_tables, block_size, device)
        num_seqs = len(query_lens)
        q_lens = torch.tensor(query_lens, device=device)
        contexts = torch.tensor(context_lens, device=device)
        first_positions = contexts - q_lens
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)
        query_starts = torch.cumsum(q_lens, 0) - q_lens
        num_tokens = int(sum(query_lens))
        offset_in_query = torch.arange(num_tokens, device=device) - query_starts[seq_of_token]
        positions = first_positions[seq_of_token] + offset_in_query

        tables = _padded_tables(block_tables, device)
        slot_mapping = (
            tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        )
        if decode_in_place and prefill_in_place:
            rows = AttentionGroup.in_place_decodes(positions + 1, tables[seq_of_token], None)
            return cls(positions, slot_mapping, [rows])

        def group(rows: list[int], token_index: torch.Tensor | None) -> AttentionGroup:
            width = max(len(block_tables[row]) for row in rows)
            index = torch.tensor(rows, device=device)
            if decode_in_place and query_lens[rows[0]] == 1:
                return AttentionGroup.in_place_decodes(
                    contexts[index], tables[index, :width].contiguous(), token_index
                )
            return AttentionGroup.build(
                q_lens[index],
                first_positions[index],
                tables[index, :width],
                block_size,
                sliding_window,
                token_index,
            )

        # Sequences are grouped by query length and by context length in powers of two, so
        # padding at most doubles a group's query grid (single-token decodes are never padded)
        # or its keys: one long sequence would otherwise make every short one gather and attend
        # over its length. Contexts of up to 4 blocks share a group. In-place decodes pad nothing.
        buckets = [
            0
            if decode_in_place and n == 1
            else _CONTEXT_BUCKETS * (n - 1).bit_length() + max(0, (len(table) - 1).bit_length() - 2)
            for n, table in zip(query_lens, block_tables, strict=True)
        ]
        rows_by_bucket: dict[int, list[int]] = {}
        for row, bucket in enumerate(buckets):
            rows_by_bucket.setdefault(bucket, []).append(row)
        if len(rows_by_bucket) == 1:
            groups = [group(list(range(num_seqs)), None)]
        else:
            bucket_of_token = torch.tensor(buckets, device=device)[seq_of_token]
            groups = [
                group(rows, torch.nonzero(bucket_of_token == bucket).squeeze(1))
                for bucket, rows in rows_by_bucket.items()
            ]
        return cls(positions, slot_mapping, groups)

    @classmethod
    def padded_decodes(
        cls,
        context_lens: torch.Tensor,
        tables: torch.Tensor,
        block_size: int,
        sliding_window: int | None,
    ) -> AttentionBatch:
        """A step of single-token decodes from tensors of fixed shape (CUDA graphs): tables
        [sequences, width] padded with any block, context_lens [sequences]. Every tensor is
        computed on the device, none read back."""
        positions = context_lens - 1
        blocks = tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
        slot_mapping = blocks * block_size + positions % block_size
        group = AttentionGroup.decodes(context_lens, tables, block_size, sliding_window)
        return cls(positions, slot_mapping, [group])

    @classmethod
    def _in_place_decodes(
        cls,
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> AttentionBatch:
        """A step of single-token decodes only, the most common step: one token per sequence,
        at the end of its context, so none of build's per-token indexing or grouping is needed,
        which at batch 1 is as much work as the rest of the input preparation."""
        contexts = torch.tensor(context_lens, device=device)
        positions = contexts - 1
        tables = _padded_tables(block_tables, device)
        blocks = tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
        slot_mapping = blocks * block_size + positions % block_size
        group = AttentionGroup.in_place_decodes(contexts, tables, None)
        return cls(positions, slot_mapping, [group])


class PagedAttention(CustomOp):
    """The attention block: the QKV product, the rotation of query and key heads (after their
    norms, where the model has them), the cache write, attention over the paged cache and the
    output product. The C++ kernel (csrc/rotary_cache.cpp) rotates and writes the cache in one
    call, for models without query and key norms that rotate whole heads."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.sliding_window = config.layer_window(layer)
        # SDPA takes None as head_dim ** -0.5, computed its own way.
        self.sdpa_scale = config.attention_scale
        self.scale = config.attention_scale or self.head_dim**-0.5
        self.softcap = config.attn_logit_softcap
        self.partial_rotary = config.rotary_dim is not None  # the C++ rotation turns whole heads
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, dtype
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, config.output_bias, dtype)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
        # Set once the KV cache is allocated: [blocks, block_size, kv_heads, head_dim].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def supports_cpu_kernel(self) -> bool:
        return self.q_norm is None and not self.partial_rotary

    def forward_native(
        self, hidden: torch.Tensor, angles: RotaryAngles, batch: AttentionBatch
    ) -> torch.Tensor:
        q = self._rotate_and_cache(self.qkv_proj(hidden), angles, batch)
        return self.o_proj(self._attend(q, batch).reshape(hidden.shape[0], self.q_size))

    def forward_cpu(
        self, hidden: torch.Tensor, angles: RotaryAngles, batch: AttentionBatch
    ) -> torch.Tensor:
        q = torch.ops.pagedserve.rotary_and_cache(
            self.qkv_proj(hidden),
            angles.cos,
            angles.sin,
            self.k_cache,
            self.v_cache,
            batch.slot_mapping,
            self.num_heads,
            self.num_kv_heads,
        )
        return self.o_proj(self._attend(q, batch).reshape(hidden.shape[0], self.q_size))

    def _rotate_and_cache(
        self, qkv: torch.Tensor, angles: RotaryAngles, batch: AttentionBatch
    ) -> torch.Tensor:
        """Rotates the query and key heads and writes the keys and values into their cache slots;
        returns the queries, [tokens, heads, head_dim]."""
        num_tokens, qk_size = qkv.shape[0], self.q_size + self.kv_size
        heads = qkv[:, :qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # Query and key heads lie side by side in the product: one rotation covers both.
            q, k = angles.rotate(heads).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q, k = heads.split([self.num_heads, self.num_kv_heads], dim=1)
            q, k = angles.rotate(self.q_norm(q)), angles.rotate(self.k_norm(k))
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        slot_rows = (-1, self.num_kv_heads, self.head_dim)
        cache_dtype = self.k_cache.dtype
        self.k_cache.view(slot_rows).index_copy_(0, batch.slot_mapping, k.to(cache_dtype))
        self.v_cache.view(slot_rows).index_copy_(0, batch.slot_mapping, v.to(cache_dtype))
        return q

    def _attend(self, q: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        if len(batch.groups) == 1:
            return self._attend_group(q, batch.groups[0])
        out = torch.empty_like(q)
        for group in batch.groups:
            out.index_copy_(0, group.token_index, self._attend_group(q[group.token_index], group))
        return out

    def _attend_group(self, q: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        if group.in_place:
            # The kernel takes float32 queries against any cache, else the cache's dtype.
            query = q if q.dtype == torch.float32 else q.to(self.k_cache.dtype)
            return torch.ops.pagedserve.paged_decode_attention(
                query.contiguous(),
                self.k_cache,
                self.v_cache,
                group.block_tables,
                group.context_lens,
                self.scale,
                self.sliding_window or 0,
            ).to(q.dtype)
        num_seqs = group.block_tables.shape[0]
        keys, values = self._gather(self.k_cache, group), self._gather(self.v_cache, group)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        mask = group.mask(self.sliding_window)
        if self.softcap is not None:
            return self._attend_softcapped(q, keys, values, mask, group)
        if group.query_slots is None:
            # One query per sequence: each KV head's query heads become its query rows, so SDPA
            # needs no GQA expansion of the keys.
            group_size = self.num_heads // self.num_kv_heads
            rows = q.view(num_seqs, self.num_kv_heads, group_size, self.head_dim)
            out = F.scaled_dot_product_attention(
                rows, keys, values, attn_mask=mask, scale=self.sdpa_scale
            )
            return out.reshape(num_seqs, self.num_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            self._query_grid(q, group),
            keys,
            values,
            attn_mask=mask,
            scale=self.sdpa_scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        ).transpose(1, 2)
        return out.reshape(-1, self.num_heads, self.head_dim)[group.query_slots]

    def _query_grid(self, q: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        """[sequences, heads, longest query, dim]: each sequence's queries, zero-padded."""
        num_seqs = group.block_tables.shape[0]
        grid = q.new_zeros(num_seqs * group.max_query_len, self.num_heads, self.head_dim)
        grid.index_copy_(0, group.query_slots, q)
        return grid.view(num_seqs, group.max_query_len, self.num_heads, self.head_dim).transpose(
            1, 2
        )

    def _attend_softcapped(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        group: AttentionGroup,
    ) -> torch.Tensor:
        """Attention whose scores are capped (Gemma 2): cap * tanh(q.k * scale / cap), then the
        mask and a float32 softmax, which SDPA cannot do."""
        if group.query_slots is None:
            grid = q.view(-1, 1, self.num_heads, self.head_dim).transpose(1, 2)
        else:
            grid = self._query_grid(q, group)
        group_size = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(group_size, dim=1)
        values = values.repeat_interleave(group_size, dim=1)
        scores = grid @ keys.transpose(2, 3) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = (weights @ values).transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
        return out if group.query_slots is None else out[group.query_slots]

    def _gather(self, cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        """[seqs, kv_heads, keys, dim] copy of the group's cached blocks.

        index_select copies whole blocks as contiguous rows, where advanced indexing copies
        element by element.
        """
        num_seqs, width = group.block_tables.shape
        blocks = cache.index_select(0, group.block_tables.flatten())
        return blocks.view(num_seqs, width * cache.shape[1], *cache.shape[2:]).transpose(1, 2)
