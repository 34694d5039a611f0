"""transformers' config of a GGUF file, from metadata read without decoding its vocabulary.

transformers builds a GGUF file's config (AutoConfig.from_pretrained(gguf_file=...)) by reading
every metadata value with gguf's GGUFReader, which takes seconds for a vocabulary of 50,000
strings and their merges (the config needs none of them), and AutoTokenizer reads it again to
learn the config's class. Here the metadata comes from transformers' own fast header reader,
which steps over string arrays (read_gguf_metadata), and becomes a config by transformers' own
tables (GGUF_TO_TRANSFORMERS_MAPPING, GGUF_CONFIG_DEFAULTS_MAPPING), the steps of its
load_gguf_checkpoint applied to the architectures pagedserve runs. The tests hold the result
equal to load_gguf_checkpoint's config on every GGUF architecture they write.
"""

from __future__ import annotations

from pathlib import Path

# GGUF architectures whose transformers model_type differs from their name.
_MODEL_TYPE_OF = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# Text-only model types of GGUF files holding a multimodal model's text backbone.
_TEXT_MODEL_TYPE = {"gemma3": "gemma3_text"}


def gguf_config_dict(gguf_path: Path) -> dict:
    """The settings transformers' load_gguf_checkpoint(gguf_path)["config"] holds, for a file of
    an architecture pagedserve runs; a ValueError naming any other."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING
    from transformers.integrations.gguf import read_gguf_metadata
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    from pagedserve.model.config import MODEL_TYPES

    metadata, tensor_names = read_gguf_metadata(str(gguf_path))
    architecture = metadata["general.architecture"]
    # As transformers: a llama file named exactly "mistral" is Mistral.
    model_type = _MODEL_TYPE_OF.get(architecture, architecture)
    if architecture == "llama" and metadata.get("general.name") == "mistral":
        model_type = "mistral"
    # The steps below are load_gguf_checkpoint's for these architectures only (others have steps
    # of their own there: gemma4's end-of-turn ids, falcon's tied embeddings, ...).
    if _TEXT_MODEL_TYPE.get(model_type, model_type) not in MODEL_TYPES.values():
        raise ValueError(
            f"{gguf_path}: unsupported GGUF architecture {architecture!r}; pagedserve runs "
            f"{', '.join(sorted(set(MODEL_TYPES.values())))}"
        )
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    config: dict = {"tie_word_embeddings": "output.weight" not in tensor_names}
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING
    for key, value in (defaults.get(model_type, defaults.get(architecture)) or {}).items():
        config.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, setting = key.replace(architecture, model_type).partition(".")
        name = renames.get(prefix, {}).get(setting)
        if name is None:
            continue
        if isinstance(value, list) and len(value) == 1:  # transformers unwraps a one-value array
            value = value[0]
        if isinstance(value, str):
            value = value.replace(architecture, model_type)
        config[name] = value
    config["model_type"] = _TEXT_MODEL_TYPE.get(config["model_type"], config["model_type"])
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in metadata:
        # read_gguf_metadata gives a string array's length, not its strings.
        config["vocab_size"] = metadata["tokenizer.ggml.tokens"]
    return config
