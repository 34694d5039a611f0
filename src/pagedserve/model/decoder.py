"""The decoder-only transformer shared by the Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma and
mixture-of-experts (Mixtral, Qwen2-MoE, Qwen3-MoE) families."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model import gguf_blocks
from pagedserve.model.attention import AttentionBatch, AttentionGroup, PagedAttention
from pagedserve.model.config import ModelConfig
from pagedserve.model.custom_op import CustomOp
from pagedserve.model.gguf_blocks import GGUFPart
from pagedserve.model.layers import GatedMLP, Linear, RMSNorm, SparseMoE
from pagedserve.model.parallel import TensorParallel
from pagedserve.model.rotary import RotaryAngles, RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        dtype: torch.dtype,
        parallel: TensorParallel | None = None,
    ):
        """config: the shapes this layer holds (a rank's share under tensor parallelism, whose
        row-parallel outputs parallel sums over the ranks)."""
        super().__init__()
        self.parallel = parallel
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, dtype)
        # The key of this layer's angles in DecoderModel.rotary.
        self.rotary_kind = config.layer_types[layer] if config.rope_per_layer_type else "all"
        self.self_attn = PagedAttention(config, layer, dtype)
        self.post_attention_layernorm = RMSNorm(size, eps, dtype)
        if config.moe_layers and config.moe_layers[layer]:
            self.mlp = SparseMoE(
                size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.norm_topk_prob,
                dtype,
                config.mlp_activation,
                config.shared_expert_intermediate_size,
            )
        else:
            self.mlp = GatedMLP(
                size, config.intermediate_size, config.mlp_bias, dtype, config.mlp_activation
            )
        # With sandwich norms (Gemma), post_attention_layernorm normalises the attention's output
        # before its residual add, and these two play its part for the MLP.
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(size, eps, dtype)
            self.post_feedforward_layernorm = RMSNorm(size, eps, dtype)

    def decode_weights(self) -> list[torch.Tensor | None]:
        """This layer's weights in the order csrc/decode_layers.cpp takes them: the two norms',
        then what each linear map's method hands over."""
        weights = [self.input_layernorm.weight, self.post_attention_layernorm.weight]
        for linear in (
            self.self_attn.qkv_proj,
            self.self_attn.o_proj,
            self.mlp.gate_up_proj,
            self.mlp.down_proj,
        ):
            weights += linear.method.decode_weights(linear)
        return weights

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        angles: RotaryAngles,
        batch: AttentionBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous layer's output, not yet added to residual (the residual stream);
        before the first layer, residual is None and hidden is the stream itself. Returns the same
        pair for the next layer, so that each add is done by the norm that follows it."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self._summed(self.self_attn(hidden, angles, batch))
        if self.pre_feedforward_layernorm is None:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self._summed(self.mlp(hidden)), residual
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self._summed(self.mlp(hidden))), residual

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel map's output summed over the ranks (model/parallel.py)."""
        return partial if self.parallel is None else self.parallel.all_reduce(partial)


class DecoderModel(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel | None = None
    ):
        """parallel: this process's rank of a tensor-parallel group, which holds its share of the
        heads and the MLP (self.config: those shapes)."""
        super().__init__()
        config = config if parallel is None else parallel.local_config(config)
        self.config, self.parallel = config, parallel
        # The token ids whose embeddings and logits this rank holds: all of them on one rank.
        self.vocab = range(config.vocab_size)
        if parallel is not None:
            self.vocab = parallel.vocab_range(config.vocab_size)
        self.embed_tokens = nn.Parameter(
            torch.empty(len(self.vocab), config.hidden_size, dtype=dtype)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, layer, dtype, parallel) for layer in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = Linear(config.hidden_size, len(self.vocab), False, dtype)
        if config.tie_word_embeddings:  # the logits' product reads the embeddings
            self.lm_head.weight = self.embed_tokens
        # One per layer type where each has its own RoPE (Gemma 3), else one for every layer.
        kinds = sorted(set(config.layer_types)) if config.rope_per_layer_type else ["all"]
        self.rotary = nn.ModuleDict(
            {kind: RotaryEmbedding.from_config(config, dtype, kind) for kind in kinds}
        )
        # Set by use_cpu_kernels where every layer runs its C++ kernels: the weights of the op
        # that runs a decode-only step's layers in one call (csrc/decode_layers.cpp).
        self.decode_weights: list[torch.Tensor | None] | None = None
        # Set by use_embedding_blocks: the GGUF blocks the lookup reads instead of embed_tokens.
        self.embedding_blocks: GGUFPart | None = None
        self.k_caches: list[torch.Tensor] = []  # each layer's, once attached
        self.v_caches: list[torch.Tensor] = []

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: AttentionBatch,
        long_prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids: [tokens], every scheduled token of the step packed together. long_prompts:
        see RotaryEmbedding.forward (longrope only)."""
        hidden, residual = self.embed(input_ids), None
        if self.config.embed_scale is not None:
            hidden = hidden * torch.tensor(self.config.embed_scale, dtype=hidden.dtype)
        angles = {
            kind: rotary(batch.positions, long_prompts) for kind, rotary in self.rotary.items()
        }
        decodes = batch.in_place_decodes
        if self.decode_weights is not None and decodes is not None:
            hidden, residual = self._decode_in_one_call(hidden, angles["all"], batch, decodes)
        else:
            for layer in self.layers:
                hidden, residual = layer(hidden, residual, angles[layer.rotary_kind], batch)
        return self.norm(hidden, residual)[0]

    def _decode_in_one_call(
        self,
        embeddings: torch.Tensor,
        angles: RotaryAngles,
        batch: AttentionBatch,
        decodes: AttentionGroup,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer in one C++ call, which calls the kernels the layers call, in the same
        order: a decode step at a few rows no longer waits on Python between them."""
        attention = self.layers[0].self_attn
        return torch.ops.pagedserve.decode_layers(
            embeddings,
            self.decode_weights,
            self.k_caches,
            self.v_caches,
            angles.cos,
            angles.sin,
            batch.slot_mapping,
            decodes.block_tables,
            decodes.context_lens,
            attention.num_heads,
            attention.num_kv_heads,
            self.config.rms_norm_eps,
            attention.scale,
            attention.sliding_window or 0,
        )

    @property
    def long_after(self) -> int | None:
        """longrope's original context (one RoPE for every layer), else None."""
        return next(iter(self.rotary.values())).long_after

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, hidden] -> [rows, vocab_size] float32 logits. Under tensor parallelism every
        rank calls it with the same rows: rank 0 gets the logits, the others None."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if self.parallel is None:
            return logits
        return self.parallel.gather_logits(logits, self.config.vocab_size)

    def use_cpu_kernels(self) -> None:
        """Switches every CustomOp layer that can to its C++ kernel and, where every attention
        layer did, runs decode-only steps' layers in one call. Called once the linear maps are
        packed for the C++ product (checkpoint.load_weights, with the packed formats'
        methods)."""
        for module in self.modules():
            if isinstance(module, CustomOp):
                module.use_cpu_kernel()
        if (
            self.config.llama_layers
            and self.parallel is None
            and all(layer.self_attn.uses_cpu_kernel for layer in self.layers)
        ):
            self.decode_weights = [
                weight for layer in self.layers for weight in layer.decode_weights()
            ]

    def use_embedding_blocks(self, part: GGUFPart) -> None:
        """Looks tokens up in a GGUF file's own blocks of the embeddings, held in memory (a
        fraction of a float table's bytes), each row read as gguf dequantizes it: the values
        transformers' float table holds."""
        self.embedding_blocks = GGUFPart(part.type, np.array(part.rows))
        self.embed_tokens = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[tokens] -> [tokens, hidden]: rows of the float table, or dequantized from the
        file's blocks (each row alone: batch-invariant). Under tensor parallelism a rank looks
        up the tokens of its share and gives zeros for the others; the sum over the ranks holds
        every token's row exactly."""
        if self.parallel is None:
            return self._lookup(input_ids)
        first, last = self.vocab.start, self.vocab.stop
        held = (input_ids >= first) & (input_ids < last)
        rows = self._lookup(torch.where(held, input_ids - first, 0))
        return self.parallel.all_reduce(rows.masked_fill_(~held[:, None], 0))

    def _lookup(self, rows: torch.Tensor) -> torch.Tensor:
        if self.embedding_blocks is None:
            return F.embedding(rows, self.embed_tokens)
        blocks = self.embedding_blocks
        part = GGUFPart(blocks.type, blocks.rows[rows.numpy()])
        return torch.from_numpy(gguf_blocks.dequantize(part)).to(self.norm.weight.dtype)

    def copy_blocks(self, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Copies whole KV blocks in every layer (copy on write of blocks shared by samples)."""
        for layer in self.layers:
            attention = layer.self_attn
            attention.k_cache[destinations] = attention.k_cache[sources]
            attention.v_cache[destinations] = attention.v_cache[sources]

    def attach_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        config = self.config
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        device = self.norm.weight.device
        for layer in self.layers:
            layer.self_attn.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            layer.self_attn.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.k_caches = [layer.self_attn.k_cache for layer in self.layers]
        self.v_caches = [layer.self_attn.v_cache for layer in self.layers]
