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

# Checkpoint projections that DecoderModel keeps fused in one matrix, in concatenation order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> DecoderModel:
    config = ModelConfig.from_dir(model_dir)
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
        fused = part_owner.get(module)
        if fused is None:
            state[f"layers.{layer}.{module}.{kind}"] = tensor
        else:
            fused_parts.setdefault(f"layers.{layer}.{fused}.{kind}", {})[module] = tensor
    for key, parts in fused_parts.items():
        fused = key.split(".", 2)[2].rsplit(".", 1)[0]
        order = _FUSED[fused]
        if set(parts) != set(order):
            raise ValueError(f"checkpoint has only {sorted(parts)} of the parts of {key}")
        state[key] = torch.cat([parts[part] for part in order], dim=0)
    if config.tie_word_embeddings and "embed_tokens" in state:
        state["lm_head.weight"] = state["embed_tokens"]  # the same parameter in DecoderModel
    return state


def _top_level_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "embed_tokens"
    return name.removeprefix("model.")
