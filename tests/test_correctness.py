"""Greedy outputs of the engine equal transformers' own greedy generate, token for token."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from conftest import (
    TINY_ARCHITECTURES,
    greedy_references,
    reference_greedy,
    reference_greedy_with_margins,
    rounded_to_q8,
)
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pagedserve import LLM, SamplingParams
from pagedserve.model.attention import AttentionBatch
from pagedserve.model.cuda_graphs import DecodeGraphs, batch_buckets, width_buckets
from pagedserve.model.kernels import can_use_cpu_kernels

PROMPT_LENGTHS = (1, 5, 16, 17, 33, 48, 70, 130)
NEW_TOKENS = 40


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, 49152, n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def references(tiny_checkpoint):
    return greedy_references(tiny_checkpoint, _prompts(), NEW_TOKENS)


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params)
    return [out.outputs[0].token_ids for out in outputs]


@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
def test_batched_greedy_matches_transformers(architecture, tiny_checkpoint, references):
    llm = LLM(str(tiny_checkpoint(architecture)), dtype="float32")
    assert _generate(llm) == references(architecture)
    assert llm.engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
def test_greedy_matches_transformers_under_preemption(architecture, tiny_checkpoint, references):
    # 20 blocks of 8 tokens hold barely two of the longer requests at once.
    llm = LLM(
        str(tiny_checkpoint(architecture)),
        dtype="float32",
        block_size=8,
        num_kv_blocks=22,
        max_num_batched_tokens=64,
    )
    assert _generate(llm) == references(architecture)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 22


def test_chunked_prefill_changes_nothing(tiny_checkpoint, references):
    unchunked = LLM(str(tiny_checkpoint("llama")), dtype="float32", enable_chunked_prefill=False)
    chunked = LLM(str(tiny_checkpoint("llama")), dtype="float32", max_num_batched_tokens=16)
    assert _generate(unchunked) == references("llama")
    assert _generate(chunked) == references("llama")


@pytest.mark.cpu_only
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_cpu_kernels_and_torch_operators_match_transformers(
    architecture, tiny_checkpoint, references
):
    """Float32 on CPU runs packed linear maps (Qwen2: with biases), RMSNorm (Qwen3: on each
    head too), SwiGLU, and the rotation with the cache write in C++; --no-cpu-kernels runs them
    in torch."""
    with_kernels = LLM(str(tiny_checkpoint(architecture)), dtype="float32")
    plain = LLM(str(tiny_checkpoint(architecture)), dtype="float32", cpu_kernels=False)
    runner = with_kernels.engine.runner
    assert can_use_cpu_kernels(runner.device, runner.dtype)
    for model, on in ((runner.model, True), (plain.engine.runner.model, False)):
        layer = model.layers[0]
        assert (layer.self_attn.qkv_proj.weight is None) == on  # packed
        assert layer.input_layernorm.uses_cpu_kernel == layer.mlp.act.uses_cpu_kernel == on
        # Qwen3 normalises query and key heads before the rotation: that stays in torch.
        assert layer.self_attn.uses_cpu_kernel == (on and architecture != "qwen3")
        assert (model.decode_weights is not None) == (on and architecture != "qwen3")
    assert _generate(with_kernels) == references(architecture)
    assert _generate(plain) == references(architecture)


@pytest.mark.cpu_only
@pytest.mark.parametrize(
    ("architecture", "packed_dtype"),
    [("llama", "int8"), ("llama", "q4_1"), ("qwen2", "q4_1_q8"), ("qwen2", "float32")],
)
def test_decode_layers_in_one_call_equal_the_layers_op_by_op(
    architecture, packed_dtype, tiny_checkpoint
):
    """A decode-only step runs every layer in one C++ call (csrc/decode_layers.cpp) chaining the
    kernels that the layers otherwise call one by one: the hidden states and the cache writes are
    the same bits either way."""
    llm = LLM(str(tiny_checkpoint(architecture)), dtype="float32", packed_weight_dtype=packed_dtype)
    model, block_size = llm.engine.runner.model, llm.engine.runner.block_size
    generator = torch.Generator().manual_seed(0)
    for cache in model.k_caches + model.v_caches:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    before = [cache.clone() for cache in model.k_caches + model.v_caches]
    batch = AttentionBatch.build(
        query_lens=[1, 1, 1],
        context_lens=[1, 2 * block_size + 3, block_size],
        block_tables=[[4], [0, 7, 2], [5]],
        block_size=block_size,
        sliding_window=None,
        device=torch.device("cpu"),
        decode_in_place=True,
    )
    assert batch.in_place_decodes is not None
    input_ids = torch.tensor([17, 9000, 300])

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        for cache, saved in zip(model.k_caches + model.v_caches, before, strict=True):
            cache.copy_(saved)
        with torch.no_grad():
            hidden = model(input_ids, batch)
        return hidden, [cache.clone() for cache in model.k_caches + model.v_caches]

    fused_hidden, fused_caches = run()
    model.decode_weights = None
    plain_hidden, plain_caches = run()
    assert torch.equal(fused_hidden, plain_hidden)
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, plain_caches, strict=True))
    assert not torch.equal(fused_caches[0], before[0])  # the new keys were written


def _rounded_to_bfloat16(weight: torch.Tensor) -> torch.Tensor:
    return weight.bfloat16().float()


def _quantized_to_int8(weight: torch.Tensor) -> torch.Tensor:
    """Each output feature (row) scaled so that its largest magnitude is 127, rounded, scaled
    back."""
    scale = weight.abs().amax(dim=1, keepdim=True) / 127
    return (weight / scale).round().clamp(-127, 127) * scale


def _quantized_to_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q4_1: in groups of 32 inputs, the minimum maps to 0 and the maximum to 15,
    with the scale and minimum stored as float16; dequantized as scale * value + minimum."""
    groups = weight.view(weight.shape[0], -1, 32)
    minimum = groups.amin(dim=-1, keepdim=True).half().float()
    scale = ((groups.amax(dim=-1, keepdim=True) - minimum) / 15).half().float()
    values = ((groups - minimum) / scale).round().clamp(0, 15)
    return (values * scale + minimum).view(weight.shape)


def _quantized_to_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q8_0: in groups of 32 inputs, the largest magnitude maps to 127, with the
    scale stored as float16."""
    groups = weight.view(weight.shape[0], -1, 32)
    scale = (groups.abs().amax(dim=-1, keepdim=True) / 127).half().float()
    return ((groups / scale).round().clamp(-127, 127) * scale).view(weight.shape)


def _inputs_rounded_to_q8(module: torch.nn.Module, args: tuple) -> tuple:
    """A linear map's input read back as q4_1_q8 rounds it (scale * value, in float32)."""
    (x,) = args
    values, scales = rounded_to_q8(x)
    return ((values * scales).view(x.shape),)


_PANEL_DTYPES = {
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "q8_0": torch.uint8,
    "q4_1": torch.uint8,
}


@pytest.mark.cpu_only
@pytest.mark.parametrize(
    ("packed_dtype", "stand_in", "logits_stand_in"),
    [
        ("bfloat16", _rounded_to_bfloat16, _rounded_to_bfloat16),
        ("int8", _quantized_to_int8, _quantized_to_int8),
        ("q8_0", _quantized_to_q8_0, _quantized_to_q8_0),
        ("q4_1", _quantized_to_q4_1, _quantized_to_q8_0),
    ],
)
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_narrow_packed_weights_match_transformers_on_the_weights_they_hold(
    architecture, packed_dtype, stand_in, logits_stand_in, tiny_checkpoint
):
    """Narrow panels with float32 arithmetic compute what float32 computes from the weights they
    hold (rounded, or quantized; q4_1 keeps the logits' weights as q8_0), so transformers with its
    linear weights (tied logits included, not the embedding lookup) replaced by those is the
    reference."""
    llm = LLM(str(tiny_checkpoint(architecture)), dtype="float32", packed_weight_dtype=packed_dtype)
    panels = llm.engine.runner.model.layers[0].mlp.down_proj.panels
    assert panels.dtype == _PANEL_DTYPES[packed_dtype]
    model = _with_weights_held(tiny_checkpoint(architecture), stand_in, logits_stand_in)
    expected = [reference_greedy(model, p, NEW_TOKENS) for p in _prompts()]
    assert _generate(llm) == expected


@pytest.mark.cpu_only
def test_auto_packs_a_bfloat16_checkpoint_as_bfloat16_with_greedy_equal_to_transformers(
    tiny_checkpoint, tmp_path
):
    """A checkpoint stored in bfloat16 is packed as bfloat16, which holds its weights exactly:
    the greedy outputs are float32's on those weights."""
    shutil.copytree(tiny_checkpoint("llama"), tmp_path, dirs_exist_ok=True)  # tokenizer files
    stored = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=torch.bfloat16)
    stored.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.engine.runner.packed_weight_dtypes == ("bfloat16", "bfloat16")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert _generate(llm) == [reference_greedy(model, p, NEW_TOKENS) for p in _prompts()]


def _with_weights_held(checkpoint, stand_in, logits_stand_in):
    """transformers' model with its linear weights replaced by what stand_in makes of them
    (logits_stand_in for the logits' weights)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            to_hold = logits_stand_in if name == "lm_head" else stand_in
            held = to_hold(module.weight.detach())
            module.weight = torch.nn.Parameter(held, requires_grad=False)
    return model


# A gap between the reference's top two logits that the rounding of the integer products' inputs
# cannot close: float noise moves a few inputs across a rounding boundary at most, and the tiny
# models' gaps then differ from the reference's by up to about 0.04 (the logits' inputs rounded
# too).
_NEAR_TIE = 0.05


@pytest.mark.cpu_only
@pytest.mark.parametrize(
    ("architecture", "packed_dtype", "stand_in", "block_bytes"),
    [
        # pack_q4_1_q8's blocks: 8 features' float16 scales and minima, their 32 4-bit values
        ("llama", "q4_1_q8", _quantized_to_q4_1, 2 * 8 * 2 + 8 * 32 // 2),
        ("qwen2", "q4_1_q8", _quantized_to_q4_1, 2 * 8 * 2 + 8 * 32 // 2),
        # pack_q8_0_q8's: 8 features' float16 scales, their 32 8-bit values
        ("llama", "q8_0_q8", _quantized_to_q8_0, 8 * 2 + 8 * 32),
    ],
)
def test_integer_products_match_transformers_on_inputs_rounded_as_they_round_them(
    architecture, packed_dtype, stand_in, block_bytes, tiny_checkpoint
):
    """q4_1_q8's and q8_0_q8's integer products are float32's on the Q4_1 or Q8_0 weights (the
    logits' Q8_0) with each linear map's inputs rounded to 8 bits per group of 32: equal to
    transformers' so computed up to near ties."""
    checkpoint = tiny_checkpoint(architecture)
    llm = LLM(str(checkpoint), dtype="float32", packed_weight_dtype=packed_dtype)
    panels = llm.engine.runner.model.layers[0].mlp.down_proj.panels
    assert panels.dtype == torch.uint8 and panels.shape[-1] == block_bytes
    logits_panels = llm.engine.runner.model.lm_head.panels
    assert logits_panels.dtype == torch.uint8 and logits_panels.shape[-1] == 8 * 2 + 8 * 32
    model = _with_weights_held(checkpoint, stand_in, _quantized_to_q8_0)
    _assert_greedy_matches_up_to_near_ties(llm, model, _inputs_rounded_to_q8)


@pytest.mark.cpu_only
def test_q4_k_q8_matches_transformers_on_a_k_quant_gguf_with_inputs_rounded(monkeypatch, tmp_path):
    """q4_k_q8 multiplies a GGUF file's Q4_K, Q6_K and Q5_0 blocks in integers against each map's
    inputs rounded to 8 bits per group of 32: transformers reading the same file, its maps' inputs
    so rounded, up to near ties. The file is laid out as llama.cpp's Q4_K_M: Q4_K, but Q6_K for
    the values' and down projections and the output projection, so that the fused query, key and
    value map holds Q4_K parts beside a Q6_K one; and Q5_0 for the attention's output projection,
    as llama.cpp falls back to where rows are not whole super-blocks."""
    import gguf
    from gguf_quantize import quantize

    from pagedserve.bench.kquants import rewrite_gguf
    from pagedserve.bench.load import Shape, write_f16_gguf

    shape = Shape(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2)
    f16 = write_f16_gguf(tmp_path / "random-llama-tiny.F16.gguf", shape, spread=0.2)
    path = tmp_path / "random-llama-tiny.Q4_K_M.gguf"

    def as_k_quants(tensor):
        if tensor.tensor_type != gguf.GGMLQuantizationType.F16:
            return tensor.data, tensor.tensor_type
        six_bits = tensor.name == "output.weight" or any(
            part in tensor.name for part in ("attn_v", "ffn_down")
        )
        type_name = "Q6_K" if six_bits else "Q5_0" if "attn_output" in tensor.name else "Q4_K"
        weights = tensor.data.astype(np.float32)
        return quantize(weights, type_name), gguf.GGMLQuantizationType[type_name]

    rewrite_gguf(f16, path, as_k_quants)
    f16.unlink()
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    llm = LLM(str(path), dtype="float32", packed_weight_dtype="q4_k_q8")
    assert llm.engine.runner.packed_weight_dtypes == ("q4_k_q8+q5_0_q8+q6_k_q8", "q6_k_q8")
    model = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    _assert_teacher_forced_matches(llm, model, _inputs_rounded_to_q8)


def _assert_teacher_forced_matches(llm, model, round_inputs) -> None:
    """This random model's top logits are often within 0.01 of each other, and a rounding step
    taken on one side only moves its log-probabilities by up to 0.1 (measured, with every matrix
    Q4_K too), so greedy sequences part at near ties too often to compare whole. Instead the
    reference reads our own tokens: its log-probability of each is ours to 1e-4 at the median step
    (1e-6 is typical; a swapped scale gives 0.1 and more), and each is within 0.15 of the
    reference's best."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(round_inputs)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params)
    differences = []
    for prompt, output in zip(_prompts(), outputs, strict=True):
        tokens = list(output.outputs[0].token_ids)
        ours = torch.tensor(
            [step[t].logprob for t, step in zip(tokens, output.outputs[0].logprobs, strict=True)]
        )
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        reference = torch.log_softmax(logits.double(), dim=-1)
        chosen = reference[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert (reference.max(dim=-1).values - chosen).max() < 0.15
        differences.append((ours.double() - chosen).abs())
    assert torch.cat(differences).median() < 1e-4


def _inputs_rounded_to_bfloat16(module: torch.nn.Module, args: tuple) -> tuple:
    (x,) = args
    return (x.bfloat16().float(),)


@pytest.mark.cpu_only
def test_bfloat16_pairs_match_transformers_on_inputs_rounded_to_bfloat16(tiny_checkpoint):
    """bfloat16_bf16 is float32's product of the weights rounded to bfloat16 with each linear
    map's inputs rounded to bfloat16 (AVX-512 BF16's vdpbf16ps where the CPU has it): up to near
    ties, as for the integer products."""
    checkpoint = tiny_checkpoint("llama")
    llm = LLM(str(checkpoint), dtype="float32", packed_weight_dtype="bfloat16_bf16")
    for layer in (llm.engine.runner.model.layers[0].mlp.down_proj, llm.engine.runner.model.lm_head):
        assert layer.panels.dtype == torch.bfloat16 and layer.panels.shape[2:] == (64, 2)
    model = _with_weights_held(checkpoint, _rounded_to_bfloat16, _rounded_to_bfloat16)
    _assert_greedy_matches_up_to_near_ties(llm, model, _inputs_rounded_to_bfloat16)


def _rounded_to_bfloat16(weight: torch.Tensor) -> torch.Tensor:
    return weight.bfloat16().float()


def _assert_greedy_matches_up_to_near_ties(
    llm, model, round_inputs, near_tie: float = _NEAR_TIE
) -> None:
    """Rounding is a step function, so float noise upstream can move an input across a boundary
    where transformers' does not: each sequence must equal the reference (its linear maps' inputs
    rounded by round_inputs) up to a step at which the reference's top two logits are within
    near_tie, and at least three quarters of all tokens must match."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(round_inputs)
    matched = 0
    for prompt, ours in zip(_prompts(), _generate(llm), strict=True):
        expected, margins = reference_greedy_with_margins(model, prompt, NEW_TOKENS)
        differs = [i for i, (a, b) in enumerate(zip(ours, expected, strict=True)) if a != b]
        if differs:
            assert margins[differs[0]] < near_tie, f"differs at step {differs[0]}, not a near tie"
        matched += differs[0] if differs else NEW_TOKENS
    assert matched >= len(PROMPT_LENGTHS) * NEW_TOKENS * 3 // 4


@pytest.mark.cpu_only
@pytest.mark.parametrize("architecture", ["mistral", "qwen3"])
def test_every_attention_path_matches_transformers(architecture, tiny_checkpoint, references):
    """On CPU every token reads the cache in place in C++ (batch-invariant, the default); with
    --batch-invariant false prompts are attended by SDPA and decodes in place; elsewhere (and
    with --no-decode-kernel) all gather blocks for SDPA. Mistral's sliding window and Qwen3's
    head_dim of 24 test them."""
    checkpoint = str(tiny_checkpoint(architecture))
    in_place = LLM(checkpoint, dtype="float32")
    decodes_in_place = LLM(checkpoint, dtype="float32", batch_invariant=False)
    gathered = LLM(checkpoint, dtype="float32", decode_kernel=False)
    assert in_place.engine.runner.prefill_in_place
    assert decodes_in_place.engine.runner.decode_in_place
    assert not decodes_in_place.engine.runner.prefill_in_place
    assert not gathered.engine.runner.decode_in_place
    for llm in (in_place, decodes_in_place, gathered):
        assert _generate(llm) == references(architecture)


def _attention_on_rounded_cache(module, query, key, value, *args, **kwargs):
    """transformers' SDPA attention over keys and values rounded to bfloat16, as a bfloat16 KV
    cache holds them (rounding is idempotent, so the cached ones round to themselves)."""
    key, value = key.bfloat16().float(), value.bfloat16().float()
    return sdpa_attention_forward(module, query, key, value, *args, **kwargs)


@pytest.mark.parametrize("decode_kernel", [True, False])
@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_bfloat16_kv_cache_matches_transformers_on_the_values_it_holds(
    architecture, decode_kernel, tiny_checkpoint, references
):
    """--kv-cache-dtype bfloat16 under a float32 model stores each key and value rounded once and
    computes in float32 (the C++ decode attention, or SDPA over gathered blocks), so transformers
    attending over rounded keys and values is the reference. The same memory holds twice the
    blocks."""
    checkpoint = str(tiny_checkpoint(architecture))
    llm = LLM(checkpoint, dtype="float32", kv_cache_dtype="bfloat16", decode_kernel=decode_kernel)
    full = LLM(checkpoint, dtype="float32")
    runner = llm.engine.runner
    assert runner.model.k_caches[0].dtype == torch.bfloat16 and runner.dtype == torch.float32
    assert runner.num_blocks == 2 * full.engine.runner.num_blocks
    AttentionInterface.register("sdpa_on_bfloat16_cache", _attention_on_rounded_cache)
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="sdpa_on_bfloat16_cache"
    )
    expected = [reference_greedy(model, p, NEW_TOKENS) for p in _prompts()]
    assert expected != references(architecture)  # the rounding changes outputs here
    assert _generate(llm) == expected


@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen3"])
def test_padded_decode_steps_of_cuda_graphs_match_transformers(
    architecture, tiny_checkpoint, references
):
    """A CUDA graph replays decode steps padded to its bucket: padded rows decode into a scratch
    block, tables are padded to a power-of-two width with it, and masks are computed on the
    device. The same padded steps, run eagerly here on the CPU (as on a GPU before capture),
    give transformers' greedy tokens while the batch shrinks through unpadded and padded sizes
    (Mistral: past its sliding window; Qwen3: with q and k norms)."""
    llm = LLM(
        str(tiny_checkpoint(architecture)),
        dtype="float32",
        cpu_kernels=False,
        decode_kernel=False,
        block_size=8,
    )
    runner = llm.engine.runner
    runner.model.attach_kv_cache(runner.num_blocks + 1, runner.block_size, runner.kv_cache_dtype)
    runner.decode_graphs = DecodeGraphs(
        runner.model,
        runner.block_size,
        max_batch=16,
        max_blocks=-(-runner.max_model_len // runner.block_size),
        scratch_block=runner.num_blocks,
        capture=False,
    )
    # Requests end one after another, so decode steps run 8, 7, ..., 1 rows (buckets 1-16).
    lengths = [NEW_TOKENS - 4 * i for i in range(len(PROMPT_LENGTHS))]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in _prompts()],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths],
    )
    expected = [tokens[:n] for tokens, n in zip(references(architecture), lengths, strict=True)]
    assert [out.outputs[0].token_ids for out in outputs] == expected
    scratch = runner.model.k_caches[0][runner.num_blocks]
    assert scratch.abs().sum() > 0  # padded rows ran, and wrote their keys there alone


def test_decode_graph_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(70) == [1, 2, 4, 8, 16, 32, 48, 64, 70]
    assert width_buckets(3) == [3]
    assert width_buckets(4) == [4]
    assert width_buckets(64) == [4, 8, 16, 32, 64]
    assert width_buckets(100) == [4, 8, 16, 32, 64, 100]
