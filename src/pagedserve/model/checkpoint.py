"""Reads Hugging Face checkpoint weights and maps them onto the fused layout of DecoderModel."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from pagedserve.model import gguf_blocks
from pagedserve.model.config import ModelConfig
from pagedserve.model.decoder import DecoderModel
from pagedserve.model.gguf_blocks import BLOCK_TYPES, FORMAT_HOLDS, GGUFPart
from pagedserve.model.layers import Linear
from pagedserve.model.linear_method import INTEGER_OF, PACKED_FORMATS, LinearMethod
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


def load_weights(
    model: DecoderModel,
    model_dir: Path,
    gguf_path: Path | None = None,
    methods: Mapping[str, LinearMethod] | None = None,
    parts: dict[str, Sequence[GGUFPart]] | None = None,
    shard: Callable[[str, int | None, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Reads the checkpoint's tensors into model one at a time: a safetensors checkpoint's (of
    every shard) or the GGUF file's (model_dir then holds its metadata), in place. Each linear
    map is handed to its method (methods, by module name; else kept as loaded) as soon as its
    weights are in, so that one map's float weights at most are held beside the packed ones;
    a map whose method packs the GGUF file's own blocks (parts) reads no float weight at all,
    and its entry of parts is dropped once packed, unmapping the file's pages it read. With
    packed maps, the embeddings are looked up in the file's blocks (parts["embed_tokens"])
    where it has them, unless the output projection needs their float table (tied and not
    packed from the blocks).

    The parameters of a fused map (qkv_proj, gate_up_proj) are filled when all their parts have
    been read; Gemma's norms get their offset folded in; tied embeddings are the output
    projection's weight.

    shard(key, index, tensor): the part of each tensor (going to key, at index among a fused map's
    parts) this process holds, under tensor parallelism (model/parallel.py)."""
    config = model.config
    methods, parts = methods or {}, parts if parts is not None else {}
    from_blocks = {name for name, method in methods.items() if method.takes(parts.get(name, ()))}
    embedding = parts.pop("embed_tokens", None)
    table_needed = config.tie_word_embeddings and "lm_head" not in from_blocks
    if embedding and methods and not table_needed:
        model.use_embedding_blocks(embedding[0])
    params = dict(model.named_parameters())  # the tied output projection's weight is not apart
    expected = set(params)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    needs: dict[str, set[str]] = {}  # a linear map's parameters still to read
    for name, module in linears.items():
        weight = "embed_tokens" if module.weight is model.embed_tokens else f"{name}.weight"
        needs[name] = set() if name in from_blocks else {weight}
        if module.bias is not None:
            needs[name].add(f"{name}.bias")
    skipped = {f"{name}.weight" for name in from_blocks} & expected
    fused_parts: dict[str, dict[int, torch.Tensor]] = {}
    unexpected = []

    def finish(name: str) -> None:
        if name in methods:
            linears[name].use_method(methods[name], parts.pop(name, ()))
        for key in (f"{name}.weight", f"{name}.bias"):
            params.pop(key, None)  # a packed map's float weight is freed with it
        _return_freed_memory()

    for name in [name for name, keys in needs.items() if not keys]:
        finish(name)
    for name, read in _checkpoint_tensors(model_dir, gguf_path, config):
        target = _target(name, config)
        if target is None or target[0] in skipped:
            continue
        if target[0] == "embed_tokens" and model.embed_tokens is None:
            continue  # looked up in the file's blocks
        key, index = target
        if key not in expected:
            unexpected.append(name)
            continue
        tensor = read() if shard is None else shard(key, index, read())
        if index is not None:
            fused = fused_parts.setdefault(key, {})
            fused[index] = tensor
            if len(fused) < len(_FUSED[key.rsplit(".", 2)[-2]]):
                continue
            tensor = torch.cat(_in_order(key, fused_parts.pop(key)), dim=0)
        if config.norm_weight_offset and key.endswith("norm.weight"):
            tensor = tensor.float() + config.norm_weight_offset  # Gemma's (offset + weight)
        _copy_into(params[key], tensor, key, name)
        expected.discard(key)
        for module, keys in needs.items():
            if key in keys:
                keys.discard(key)
                if not keys:
                    finish(module)
    for key, fused in fused_parts.items():
        _in_order(key, fused)  # raises: a fused map with parts missing
    missing = expected - skipped
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {gguf_path or model_dir} does not match {config.architecture}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    _return_freed_memory()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator keeps its own counsel
        return None


def _return_freed_memory() -> None:
    """Hands the pages of the buffers freed since back to the system, once a map is packed.
    glibc's malloc serves buffers under its (rising) mmap threshold from its heap and keeps
    their pages once they are freed, between the panels allocated meanwhile: the float copy of
    each map read and the integers decoded from its blocks would otherwise pile up to a third
    of the model's size by the end of loading, and stay resident."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _copy_into(param: torch.Tensor, tensor: torch.Tensor, key: str, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name} has shape {tuple(tensor.shape)}; "
            f"{key} takes {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)


def _checkpoint_tensors(
    model_dir: Path, gguf_path: Path | None, config: ModelConfig
) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(transformers' name, a function reading the tensor) for each tensor of the checkpoint."""
    if gguf_path is not None:
        types = gguf_tensor_types(model_dir)
        names = gguf_blocks.GGUFNames(types, config.raw)
        yield from gguf_blocks.float_tensors(gguf_path, types, names)
        return
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            names = list(handle.keys())
        for name in names:
            yield name, functools.partial(_read_safetensor, path, name)


def _read_safetensor(path: Path, name: str) -> torch.Tensor:
    """One tensor of the file, which is mapped only while it is read: a shard mapped throughout
    would keep every page read so far resident (a gigabyte a shard)."""
    with safe_open(str(path), framework="pt") as handle:
        return handle.get_tensor(name)


# Packed weight dtypes that hold every map as the checkpoint stores it (q4_k_q8 as auto, its
# Q4_K and Q6_K maps computed in integers).
_AS_STORED = ("auto", *INTEGER_OF)


def weights_bytes(model_dir: Path, dtype: torch.dtype, packed_format: str | None) -> int:
    """What the checkpoint's weights take once loaded, from the files' headers only: each
    tensor as dtype, but the linear maps as packed_format holds them where they are packed (the
    C++ kernels' path; "auto": as the checkpoint stores them, a GGUF file's blocks or a
    safetensors file's dtype). A GGUF file's embeddings stored in a block type are looked up in
    those blocks, and when tied they are packed once more for the logits."""

    def matrix(elements: int, stored_bytes: int) -> int:
        if packed_format is None:
            return elements * dtype.itemsize
        if packed_format in _AS_STORED:
            return stored_bytes
        return math.ceil(elements * PACKED_FORMATS[packed_format].bytes_per_weight)

    gguf_types = gguf_tensor_types(model_dir)
    total = 0
    if gguf_types is not None:
        for name, tensor in gguf_types.tensors.items():
            elements = math.prod(tensor.shape)
            if name == "token_embd.weight":
                tied = "output.weight" not in gguf_types.tensors
                # Looked up in its blocks unless tied logits packed otherwise need a float table.
                held = packed_format in (*_AS_STORED, None) or tensor.type in FORMAT_HOLDS.get(
                    packed_format, ()
                )
                in_blocks = packed_format is not None and tensor.type in BLOCK_TYPES
                in_blocks = in_blocks and (held or not tied)
                total += tensor.nbytes if in_blocks else elements * dtype.itemsize
                if tied:  # the logits' panels too
                    total += matrix(elements, tensor.nbytes)
            elif len(tensor.shape) == 2:
                total += matrix(elements, tensor.nbytes)
            else:
                total += elements * dtype.itemsize
        return total
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                stored = handle.get_slice(name)
                elements = math.prod(stored.get_shape())
                itemsize = _DTYPE_BYTES.get(stored.get_dtype(), 4)
                if len(stored.get_shape()) == 2 and "embed_tokens" not in name:
                    total += matrix(elements, elements * itemsize)
                else:
                    total += elements * dtype.itemsize
    return total


_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I8": 1, "U8": 1}


def stored_weight_types(model_dir: Path) -> tuple[frozenset[str], frozenset[str]]:
    """The types the checkpoint stores its linear maps' and its logits' weights in, e.g.
    ({"Q4_1"}, {"Q8_0"}) for such a GGUF file (model_dir: its metadata): what
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
    """The checkpoint's safetensors files: the shards its index names where it has one (a
    repository may hold other weight files beside them, e.g. Mistral's consolidated.safetensors
    in its own names), else every one."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        return [model_dir / name for name in sorted(shards)]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {model_dir} has no *.safetensors weights")
    return files


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
    module name (e.g. "layers.0.self_attn.qkv_proj", "lm_head"; "embed_tokens" for the
    embeddings' lookup table), a fused map's parts in order;
    model_dir: the file's metadata, which records where its blocks lie. A fused map with a
    part stored otherwise (e.g. as F16) has none."""
    parts: dict[str, dict[int, GGUFPart]] = {}
    whole: dict[str, list[GGUFPart]] = {}
    types = gguf_tensor_types(model_dir)
    if types is None:
        return whole
    names = gguf_blocks.GGUFNames(types, config.raw)
    for name, part in gguf_blocks.linear_parts(gguf_path, types, names).items():
        if name == "model.embed_tokens.weight":  # the output projection too, when tied
            whole["embed_tokens"] = [part]
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
