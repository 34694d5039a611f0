"""GGUF files' quantized maps packed from their own blocks: each type read as gguf dequantizes
it, multiplied by the C++ product of every format that holds it, chosen per map by auto, and a
model whose maps mix every type generating as transformers does on the same file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import reference_greedy, reference_greedy_with_margins, rounded_to_q8
from gguf_quantize import mixed_type, quantize, requantized_default_gguf
from transformers import AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.bench.kquants import copy_metadata
from pagedserve.model import gguf_blocks
from pagedserve.model.gguf_blocks import BLOCK_TYPES, FORMAT_HOLDS, GGUFPart
from pagedserve.model.kernels import cpu_kernels_available
from pagedserve.model.linear_method import PACKED_FORMATS, choose_format
from pagedserve.model.source import default_gguf_path


def _part(type_name: str, rows: int, inputs: int, seed: int) -> GGUFPart:
    weights = np.random.default_rng(seed).standard_normal((rows, inputs)) * 0.05
    return GGUFPart(type_name, quantize(weights, type_name))


def _reference(parts: list[GGUFPart]) -> torch.Tensor:
    """The parts' weights as gguf dequantizes them, one above the other (a fused map)."""
    return torch.cat(
        [
            torch.from_numpy(
                gguf.quants.dequantize(part.rows, gguf.GGMLQuantizationType[part.type])
            )
            for part in parts
        ]
    )


@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))
def test_each_type_reads_as_gguf_dequantizes_it(type_name):
    part = _part(type_name, 40, 512, seed=1)
    assert np.array_equal(gguf_blocks.dequantize(part), _reference([part]).numpy())


# Fused maps of parts in one type or several, each with every format that holds all of them.
FUSED = [
    *([type_name] for type_name in sorted(BLOCK_TYPES)),
    ["Q4_K", "Q4_K", "Q6_K"],  # a Q4_K_M file's query, key and value projections
    ["Q5_0", "Q5_0", "Q8_0"],  # the same where rows are not whole super-blocks
    ["Q4_0", "Q5_1"],
    ["Q5_0", "Q4_0"],
    ["Q5_1", "Q5_1", "Q8_0"],
    ["Q4_1", "Q8_0", "Q4_0"],
    ["Q5_K", "Q4_K"],
]


@pytest.mark.parametrize("types", FUSED, ids="+".join)
def test_every_format_that_holds_the_parts_multiplies_them(types):
    assert cpu_kernels_available()
    parts = [_part(type_name, 32 * (i + 1) + 8, 512, seed=i) for i, type_name in enumerate(types)]
    weight = _reference(parts).double()
    out_features = weight.shape[0]
    formats = [name for name, holds in FORMAT_HOLDS.items() if set(types) <= holds]
    assert formats
    for name in formats:
        panels = gguf_blocks.pack(name, parts)
        for rows in (1, 5, 64):  # one tile, a few rows, and panels widened once
            x = torch.randn(rows, 512)
            bias = torch.randn(out_features)
            if PACKED_FORMATS[name].rounds_inputs:  # q4_k_q8: the inputs as its kernel rounds them
                values, scales = rounded_to_q8(x)
                x = (values * scales).view(x.shape)
            expected = x.double() @ weight.T + bias.double()
            got = torch.ops.pagedserve.packed_linear(x, panels, out_features, bias, None)
            error = (got.double() - expected).abs().max() / expected.abs().max()
            assert error < 1e-5, (name, rows)


@pytest.mark.parametrize(
    "types", [["Q6_K"], ["Q4_K", "Q4_K", "Q6_K"], ["Q5_0", "Q8_0"]], ids="+".join
)
def test_packing_a_map_in_pieces_gives_the_panels_of_the_whole(types):
    """pack decodes and packs a long map a piece of rows at a time (its memory's peak): the
    pieces' panels, one after the other, are the whole map's, ragged last panel included."""
    assert cpu_kernels_available()
    last = len(types) - 1
    parts = [_part(t, 200 if i == last else 192, 512, seed=i) for i, t in enumerate(types)]
    for name in [name for name, holds in FORMAT_HOLDS.items() if set(types) <= holds]:
        whole = gguf_blocks._pack(name, parts)
        assert torch.equal(gguf_blocks.pack(name, parts, rows=64), whole), name


@pytest.mark.parametrize(
    ("type_name", "name"),
    [
        ("Q4_K", "q4_k"),
        ("Q6_K", "q6_k"),
        ("Q4_K", "q6_k"),
        ("Q4_K", "q4_k_q8"),
        ("Q6_K", "q6_k_q8"),
        ("Q4_K", "q6_k_q8"),
    ],
)
def test_k_quants_packed_straight_from_the_file_give_the_decoded_panels(type_name, name):
    """Q4_K and Q6_K maps are packed from the file's bytes by one C++ pass (q4_k_q8's and
    q6_k_q8's blocks too): the same panels as the blocks decoded into integers first, for a
    ragged last panel, a fused map (Q4_K beside Q6_K too), and blocks of arbitrary bits (every
    6-bit scale and high bit)."""
    assert cpu_kernels_available()
    ragged = _part(type_name, 37, 512, seed=3)
    last = "Q6_K" if name.startswith("q6_k") else type_name
    fused = [_part(type_name, 64, 512, seed=4), _part(type_name, 128, 512, seed=5)]
    fused.append(_part(last, 40, 512, seed=7))
    block_bytes = {"Q4_K": 144, "Q6_K": 210}[type_name]
    noise = np.random.default_rng(6).integers(0, 256, (50, 2, block_bytes), dtype=np.uint8)
    small_d = np.float16(0.01) * np.ones((50, 2), np.float16)
    for at in (0, 2) if type_name == "Q4_K" else (208,):
        noise[..., at : at + 2] = small_d.view(np.uint8).reshape(50, 2, 2)
    for parts in ([ragged], fused, [GGUFPart(type_name, noise.reshape(50, -1))]):
        assert torch.equal(gguf_blocks.pack(name, parts), gguf_blocks._pack(name, parts))
    with pytest.raises(RuntimeError, match="no packing of GGUF Q6_K blocks as q4_k"):
        torch.ops.pagedserve.pack_k_quant_blocks([torch.from_numpy(noise[0])], ["Q6_K"], "q4_k")
    halves = [torch.from_numpy(fused[0].rows), torch.from_numpy(noise[:, 0].copy())]
    with pytest.raises(RuntimeError, match="part 1 has 1 blocks a row, the first part 2"):
        torch.ops.pagedserve.pack_k_quant_blocks(halves, [type_name] * 2, name)
    if not name.endswith("_q8"):  # the integer formats' strips take the parts' rows together
        ragged_first = [torch.from_numpy(ragged.rows), torch.from_numpy(fused[0].rows)]
        with pytest.raises(RuntimeError, match="part 0 has 37 rows, not whole panels"):
            torch.ops.pagedserve.pack_k_quant_blocks(ragged_first, [type_name] * 2, name)


def test_a_format_refuses_parts_it_does_not_hold():
    with pytest.raises(ValueError, match="q4_k does not hold GGUF Q6_K"):
        gguf_blocks.pack("q4_k", [_part("Q4_K", 32, 256, 0), _part("Q6_K", 32, 256, 1)])


@pytest.mark.parametrize(
    ("types", "from_blocks", "expected"),
    [
        ({"Q4_K"}, True, "q4_k"),
        ({"Q4_K", "Q6_K"}, True, "q6_k"),
        ({"Q5_K"}, True, "q5_k"),
        ({"Q4_0"}, True, "q4_1"),
        ({"Q5_0"}, True, "q5_0"),
        ({"Q4_0", "Q5_0"}, True, "q5_0"),
        ({"Q5_0", "Q8_0"}, True, "q8_0"),
        ({"Q5_1", "Q8_0"}, True, "q8_min"),  # a Q5_K_M file's queries, keys and values
        ({"Q4_K", "Q8_0"}, True, "float32"),  # no block format holds both
        ({"Q4_0"}, False, "float32"),  # Q4_1 blocks made again from its weights could differ
        ({"Q4_1"}, False, "q4_1"),
    ],
)
def test_auto_packs_each_map_in_the_smallest_format_that_holds_its_parts(
    types, from_blocks, expected
):
    assert choose_format("auto", types, logits=False, from_blocks=from_blocks) == expected
    exact = [m for m in PACKED_FORMATS.values() if not m.rounds_inputs]
    holders = [m for m in exact if types <= m.holds and from_blocks]
    assert all(PACKED_FORMATS[expected].bytes_per_weight <= m.bytes_per_weight for m in holders)


@pytest.mark.parametrize(
    ("types", "logits", "expected"),
    [
        ({"Q4_K"}, False, "q4_k_q8"),
        ({"Q4_K"}, True, "q4_k_q8"),
        ({"Q4_K", "Q6_K"}, False, "q6_k_q8"),  # held by q6_k, as auto holds them
        ({"Q6_K"}, True, "q6_k_q8"),
        ({"Q5_K"}, False, "q5_k"),
        ({"Q5_0"}, False, "q5_0_q8"),
        ({"Q5_0", "Q8_0"}, False, "q8_0_q8"),
        ({"Q5_1", "Q8_0"}, False, "q8_min"),
    ],
)
def test_q4_k_q8_takes_a_k_quant_files_maps_in_integers_and_the_others_as_auto(
    types, logits, expected
):
    assert choose_format("q4_k_q8", types, logits=logits, from_blocks=True) == expected
    assert choose_format("auto", types, logits=logits, from_blocks=True) != "q4_k_q8"


def test_a_gguf_mixing_every_type_generates_as_transformers_reads_it(monkeypatch, tmp_path):
    path = requantized_default_gguf(tmp_path / "SmolLM2-135M-Instruct.mixed.gguf", mixed_type)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))  # its metadata, gone after
    llm = LLM(str(path), dtype="float32")
    runner = llm.engine.runner
    assert runner.packed_weight_dtypes == ("q4_1+q4_k+q5_0+q5_1+q5_k+q6_k+q8_0", "q8_0")
    qkv = runner.model.layers[1].self_attn.qkv_proj  # Q5_0, Q5_0 and Q8_0: held by q8_0
    assert qkv.method.name == "q8_0" and qkv.weight is None
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    prompts = ["The history of the Roman Empire", "def fibonacci(n):", "Photosynthesis is"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for output in llm.generate(prompts, params):
        assert output.outputs[0].token_ids == reference_greedy(model, output.prompt_token_ids, 32)


def _moe_gguf(path, architecture: str):
    """A tiny random mixture of experts written as llama.cpp lays it out: each layer's experts
    stacked in one tensor a projection, Q8_0; the default model's tokenizer. qwen3moe: its
    expert width is 768, what transformers' GGUF reader assumes for qwen3moe files (it reads no
    expert_feed_forward_length). qwen2moe: biased query, key and value projections and a shared
    expert behind a sigmoid gate, at the widths transformers' reader assumes (1408, 5632)."""
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rope_theta=1e6, rms_norm_eps=1e-6, initializer_range=0.2,
        tie_word_embeddings=False,
    )  # fmt: skip
    if architecture == "qwen3moe":
        config = Qwen3MoeConfig(**common, moe_intermediate_size=768, head_dim=16)
    else:
        config = Qwen2MoeConfig(**common)
    expert_width = config.moe_intermediate_size
    torch.manual_seed(0)
    weights = AutoModelForCausalLM.from_config(config, dtype=torch.float32).state_dict()
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_context_length(1024)
    writer.add_block_count(2)
    writer.add_feed_forward_length(128)
    writer.add_expert_feed_forward_length(expert_width)
    writer.add_embedding_length(64)
    writer.add_rope_freq_base(1e6)
    writer.add_key_length(16)
    writer.add_value_length(16)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    copy_metadata(
        gguf.GGUFReader(default_gguf_path()), writer, lambda name: name.startswith("tokenizer.")
    )

    def add(name: str, tensor: torch.Tensor, type_name: str = "Q8_0") -> None:
        values = tensor.detach().float().numpy()
        if type_name == "F32":
            writer.add_tensor(name, values)
            return
        blocks = quantize(values.reshape(-1, values.shape[-1]), type_name)
        stored = gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(name, blocks.reshape(*values.shape[:-1], -1), raw_dtype=stored)

    add("token_embd.weight", weights["model.embed_tokens.weight"])
    add("output_norm.weight", weights["model.norm.weight"], "F32")
    add("output.weight", weights["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
             "mlp.shared_expert.up_proj": "ffn_up_shexp",
             "mlp.shared_expert.down_proj": "ffn_down_shexp"}  # fmt: skip
    for layer in range(2):
        prefix = f"model.layers.{layer}"
        for hf_name, gguf_name in names.items():
            small = "norm" in hf_name or hf_name == "mlp.gate"
            for kind in ("weight", "bias"):
                tensor = weights.get(f"{prefix}.{hf_name}.{kind}")
                if tensor is not None:
                    stored = "F32" if small or kind == "bias" else "Q8_0"
                    add(f"blk.{layer}.{gguf_name}.{kind}", tensor, stored)
        shared_gate = weights.get(f"{prefix}.mlp.shared_expert_gate.weight")  # [1, 64]
        if shared_gate is not None:  # stored as a vector, as llama.cpp writes it
            add(f"blk.{layer}.ffn_gate_inp_shexp.weight", shared_gate[0], "F32")
        gate_up = weights[f"{prefix}.mlp.experts.gate_up_proj"]  # [experts, 2 * width, 64]
        add(f"blk.{layer}.ffn_gate_exps.weight", gate_up[:, :expert_width])
        add(f"blk.{layer}.ffn_up_exps.weight", gate_up[:, expert_width:])
        add(f"blk.{layer}.ffn_down_exps.weight", weights[f"{prefix}.mlp.experts.down_proj"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("architecture", ["qwen3moe", "qwen2moe"])
def test_a_mixture_of_experts_gguf_generates_as_transformers_reads_it(
    architecture, monkeypatch, tmp_path
):
    path = _moe_gguf(tmp_path / f"tiny-{architecture}.Q8_0.gguf", architecture)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    llm = LLM(str(path), dtype="float32")
    moe = llm.engine.runner.model.layers[1].mlp
    experts = moe.experts
    assert len(experts) == 4 and experts[3].down_proj.method.name == "q8_0"
    assert experts[3].down_proj.weight is None  # packed from the file's own blocks
    assert (moe.shared_expert is not None) == (architecture == "qwen2moe")
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    # A tiny random model's top two logits come within a few hundredths now and then, where
    # summing the same products in another order may pick the other: each output must equal
    # transformers' for its first 12 tokens, and after them up to such a near tie.
    prompts = ["The history of the Roman Empire", "def fibonacci(n):", "Photosynthesis is"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for output in llm.generate(prompts, params):
        ours = output.outputs[0].token_ids
        expected, margins = reference_greedy_with_margins(model, output.prompt_token_ids, 24)
        differs = [i for i, (a, b) in enumerate(zip(ours, expected, strict=True)) if a != b]
        if differs:
            assert differs[0] >= 12 and margins[differs[0]] < 0.1, (differs[0], margins)
