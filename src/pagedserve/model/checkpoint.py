"""Reads Hugging Face checkpoint weights and maps them onto the fused layout of DecoderModel."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pagedserve.model import gguf_blocks
from pagedserve.model.config import ModelConfig
from pagedserve.model.decoder import DecoderModel
from pagedserve.model.gguf_blocks import GGUFPart
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
    linear_method.choose_format keeps exactly. For safetensors, both are the dtypes of all its
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
    fused_parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        target = _target(name, config)
        if target is None:
            continue
        key, part = target
        if part is None:
            state[key] = tensor
        else:
            fused_parts.setdefault(key, {})[part] = tensor
    for key, parts in fused_parts.items():
        state[key] = torch.cat(_in_order(key, parts), dim=0)
    if config.norm_weight_offset:  # Gemma's norms multiply by (offset + weight)
        for key in state:
            if key.endswith("norm.weight"):
                state[key] = state[key].float() + config.norm_weight_offset
    if config.tie_word_embeddings and "embed_tokens" in state:
        state["lm_head.weight"] = state["embed_tokens"]  # the same parameter in DecoderModel
    return state


def _target(name: str, config: ModelConfig) -> tuple[str, int | None] | None:
    """Where a checkpoint tensor goes in DecoderModel: (its key, and its place among a fused
    map's parts, or None), or None for a tensor DecoderModel does not keep."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return None
    match = _LAYER_KEY.match(name)
    if match is None:
        return _top_level_name(name), None
    layer, module, kind = match.groups()
    for pattern, replacement in _MIXTRAL_NAMES:
        module = pattern.sub(replacement, module)
    prefix, _, last = module.rpartition(".")
    for fused, parts in _FUSED.items():
        if last in parts:
            module = f"{prefix}.{fused}".lstrip(".")
            return f"layers.{layer}.{module}.{kind}", parts.index(last)
    return f"layers.{layer}.{module}.{kind}", None


def _in_order(key: str, parts: dict[int, object]) -> list:
    """A fused map's parts in concatenation order, all of them."""
    names = _FUSED[key.rsplit(".", 2)[-2]]
    if set(parts) != set(range(len(names))):
        have = sorted(names[index] for index in parts)
        raise ValueError(f"checkpoint has only {have} of the parts of {key}")
    return [parts[index] for index in range(len(names))]


def gguf_linear_parts(
    gguf_path: Path, model_dir: Path, config: ModelConfig
) -> dict[str, list[GGUFPart]]:
    """The GGUF file's own blocks of each linear map of DecoderModel stored in a block type, by
    module name (e.g. "layers.0.self_attn.qkv_proj", "lm_head"), a fused map's parts in order;
    model_dir: the file's conversion, which records where its blocks lie. A fused map with a
    part stored otherwise (e.g. as F16) has none."""
    parts: dict[str, dict[int, GGUFPart]] = {}
    whole: dict[str, list[GGUFPart]] = {}
    types = gguf_tensor_types(model_dir)
    if types is None:
        return whole
    for name, part in gguf_blocks.linear_parts(
        gguf_path, types, config.transformers_config
    ).items():
        if name == "model.embed_tokens.weight":  # the output projection too, when tied
            if config.tie_word_embeddings:
                whole.setdefault("lm_head", [part])
            continue
        target = _target(name, config)
        if target is None or not target[0].endswith(".weight"):
            continue
        key, index = target
        module = key.removesuffix(".weight")
        if index is None:
            whole[module] = [part]
        else:
            parts.setdefault(module, {})[index] = part
    for module, fused in parts.items():
        if set(fused) == set(range(len(_FUSED[module.rsplit(".", 1)[-1]]))):
            whole[module] = _in_order(f"{module}.weight", fused)
    return whole


def _top_level_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "embed_tokens"
    return name.removeprefix("model.")
