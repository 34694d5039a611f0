"""Reads Hugging Face checkpoint weights and maps them onto the fused layout of DecoderModel."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pagedserve.model.config import ModelConfig
from pagedserve.model.decoder import DecoderModel
from pagedserve.model.source import gguf_tensor_types

# Checkpoint projections that DecoderModel keeps fused in one matrix, in concatenation order, by
# the last part of their module's name (an expert's MLP is fused as the dense one is).
_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# Mixtral's names for its router and experts' maps, and the Qwen-style names used here.
_MIXTRAL_NAMES = (
    (re.compile(r"^block_sparse_moe\.gate$"), "mlp.gate"),
    (re.compile(r"^block_sparse_moe\.experts\.(\d+)\.w1$"), r"mlp.experts.\1.gate_proj"),
    (re.compile(r"^block_sparse_moe\.experts\.(\d+)\.w2$"), r"mlp.experts.\1.down_proj"),
    (re.compile(r"^block_sparse_moe\.experts\.(\d+)\.w3$"), r"mlp.experts.\1.up_proj"),
)


def load_model(
    model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> DecoderModel:
    with torch.device(device):
        model = DecoderModel(config, dtype)
    state = _remap(dict(_read_tensors(model_dir)), config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {model_dir} does not match {config.architecture}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    return model.eval()


def weights_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    """What the checkpoint's tensors take as dtype, from the files' headers only."""
    total = 0
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                total += math.prod(handle.get_slice(name).get_shape())
    return total * dtype.itemsize


def stored_weight_types(model_dir: Path) -> tuple[frozenset[str], frozenset[str]]:
    """The types the checkpoint stores its linear maps' and its logits' weights in, e.g.
    ({"Q4_1"}, {"Q8_0"}) for a model converted from such a GGUF file: what
    linear_method.choose_formats keeps exactly. For safetensors, both are the dtypes of all its
    matrices (e.g. {"BF16"}), read from the files' headers only."""
    gguf_types = gguf_tensor_types(model_dir)
    if gguf_types is not None:
        return gguf_types.linear_maps, frozenset({gguf_types.logits})
    matrices = frozenset(_stored_matrix_dtypes(model_dir))
    return matrices, matrices


def _stored_matrix_dtypes(model_dir: Path) -> set[str]:
    dtypes = set()
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                stored = handle.get_slice(name)
                if len(stored.get_shape()) == 2:
                    dtypes.add(stored.get_dtype())
    return dtypes


def _weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {model_dir} has no *.safetensors weights")
    return files


def _read_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                yield name, handle.get_tensor(name)


def _remap(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    fused_parts: dict[str, dict[str, torch.Tensor]] = {}
    part_owner = {part: fused for fused, parts in _FUSED.items() for part in parts}

    def fused_module(module: str) -> str | None:
        prefix, _, last = module.rpartition(".")
        fused = part_owner.get(last)
        return None if fused is None else f"{prefix}.{fused}".lstrip(".")

    for name, tensor in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        match = _LAYER_KEY.match(name)
        if match is None:
            state[_top_level_name(name)] = tensor
            continue
        layer, module, kind = match.groups()
        for pattern, replacement in _MIXTRAL_NAMES:
            module = pattern.sub(replacement, module)
        fused = fused_module(module)
        if fused is None:
            state[f"layers.{layer}.{module}.{kind}"] = tensor
        else:
            fused_parts.setdefault(f"layers.{layer}.{fused}.{kind}", {})[module] = tensor
    for key, parts in fused_parts.items():
        module = key.split(".", 2)[2].rsplit(".", 1)[0]
        prefix, _, fused = module.rpartition(".")
        order = [f"{prefix}.{part}".lstrip(".") for part in _FUSED[fused]]
        if set(parts) != set(order):
            raise ValueError(f"checkpoint has only {sorted(parts)} of the parts of {key}")
        state[key] = torch.cat([parts[part] for part in order], dim=0)
    if config.norm_weight_offset:  # Gemma's norms multiply by (offset + weight)
        for key in state:
            if key.endswith("norm.weight"):
                state[key] = state[key].float() + config.norm_weight_offset
    if config.tie_word_embeddings and "embed_tokens" in state:
        state["lm_head.weight"] = state["embed_tokens"]  # the same parameter in DecoderModel
    return state


def _top_level_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "embed_tokens"
    return name.removeprefix("model.")
