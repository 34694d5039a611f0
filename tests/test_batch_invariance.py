"""Batch invariance on the default CPU path: a request's tokens and logprobs are bit-identical
whatever else is in its batch and wherever it sits, whether its prompt is prefilled in one piece
or in chunks, whether its prefix comes from the prefix cache, whether it is preempted and
recomputed, with n > 1 siblings or alone, offline or through the server."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from conftest import ServerProcess
from gguf_quantize import mixed_type, requantized_default_gguf

from pagedserve import LLM, SamplingParams

rng = np.random.default_rng(39)
TARGET = rng.integers(3, 49000, 11).tolist()
OTHERS = [rng.integers(3, 49000, int(n)).tolist() for n in rng.integers(3, 90, 15)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=24, logprobs=3,
                        ignore_eos=True)  # fmt: skip
# (batch size, the target's place in it)
BATCHES = [(1, 0), (3, 1), (8, 5), (16, 15), (16, 0)]
FORMATS = [
    "auto",
    "float32",
    "bfloat16",
    "bfloat16_bf16",
    "int8",
    "q8_0",
    "q4_1",
    "q4_1_q8",
    "q8_0_q8",
]
# (chunked prefill with a small budget, prefix caching); 20 blocks of 16 tokens force preemption
# in the batches of 16.
ENGINES = [(True, True), (False, True), (True, False)]


def _signature(completion) -> tuple:
    logprobs = [
        [(token, lp.logprob, lp.rank) for token, lp in entry.items()]
        for entry in completion.logprobs
    ]
    return completion.token_ids, logprobs


def _neighbour_params(index: int) -> SamplingParams:
    if index % 2:
        return SamplingParams(temperature=0, max_tokens=8 + 5 * index, ignore_eos=True)
    return SamplingParams(temperature=1.0, seed=index, max_tokens=30 - index, logprobs=1,
                          ignore_eos=True)  # fmt: skip


def _in_batch(llm: LLM, params: SamplingParams, size: int, place: int):
    prompts = OTHERS[: size - 1]
    prompts.insert(place, TARGET)
    all_params = [_neighbour_params(i) for i in range(size)]
    all_params[place] = params
    return llm.generate(prompts, all_params)[place].outputs[0]


def _assert_invariant(llm: LLM) -> None:
    """The target, greedy and seeded, alone, in every batch of BATCHES (preempting) and with
    two siblings, gives the same tokens and logprobs bit for bit."""
    for params in (GREEDY, SEEDED):
        alone = _signature(llm.generate([TARGET], params)[0].outputs[0])
        assert len(alone[0]) == 24
        preempted_before = llm.engine.scheduler.num_preemptions
        for size, place in BATCHES:
            assert _signature(_in_batch(llm, params, size, place)) == alone, (size, place)
        assert llm.engine.scheduler.num_preemptions > preempted_before
        siblings = llm.generate([TARGET], params.model_copy(update={"n": 3}))[0]
        assert _signature(siblings.outputs[0]) == alone


@pytest.mark.parametrize("packed", FORMATS)
@pytest.mark.parametrize(("chunked", "prefix"), ENGINES, ids=["chunked", "whole", "no-prefix"])
def test_a_request_is_bit_identical_whatever_shares_its_batch(
    tiny_checkpoint, packed, chunked, prefix
):
    # No dtype given: the path `auto` resolves to on this host, as a user gets it.
    llm = LLM(
        str(tiny_checkpoint("llama")),
        packed_weight_dtype=packed,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=32 if chunked else 2048,
        enable_prefix_caching=prefix,
        num_kv_blocks=20,
    )
    _assert_invariant(llm)


@pytest.mark.parametrize("architecture", ["qwen3-moe", "gemma3"])
def test_experts_and_per_layer_windows_keep_a_request_bit_identical(tiny_checkpoint, architecture):
    """A token's routing to its experts, and Gemma 3's sliding and global layers, depend on its
    sequence alone: chunked, beside others, preempted."""
    llm = LLM(
        str(tiny_checkpoint(architecture)),
        max_num_batched_tokens=32,
        num_kv_blocks=20,
    )
    for params in (GREEDY, SEEDED):
        alone = _signature(llm.generate([TARGET], params)[0].outputs[0])
        for size, place in BATCHES:
            assert _signature(_in_batch(llm, params, size, place)) == alone, (size, place)
    assert llm.engine.scheduler.num_preemptions > 0


def test_every_gguf_block_type_keeps_a_request_bit_identical(monkeypatch, tmp_path):
    """The K-quant and legacy block formats, packed from a GGUF file's own blocks, as a user
    gets them from such a file with every engine default but a small prefill budget."""
    path = requantized_default_gguf(tmp_path / "SmolLM2-135M-Instruct.mixed.gguf", mixed_type)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))  # its metadata, gone after
    llm = LLM(str(path), max_num_batched_tokens=32, num_kv_blocks=20)
    assert llm.engine.runner.packed_weight_dtypes == ("q4_1+q4_k+q5_0+q5_1+q5_k+q6_k+q8_0", "q8_0")
    _assert_invariant(llm)


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    process = ServerProcess("--model", str(tiny_checkpoint("llama")))  # every engine default
    yield process
    process.close()


def test_through_the_server_beside_eight_streams_as_offline_alone(server, tiny_checkpoint):
    alone = LLM(str(tiny_checkpoint("llama"))).generate([TARGET], SEEDED)[0].outputs[0]

    async def beside_others() -> dict:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:

            async def stream(prompt: list[int], index: int) -> None:
                body = {"prompt": prompt, "max_tokens": 40, "stream": True, "seed": index,
                        "temperature": 0.8, "ignore_eos": True}  # fmt: skip
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    async for _ in response.aiter_lines():
                        pass

            others = [asyncio.create_task(stream(p, i)) for i, p in enumerate(OTHERS[:8])]
            await asyncio.sleep(0.05)
            body = {"prompt": TARGET, "max_tokens": 24, "temperature": 0.9, "top_p": 0.95,
                    "seed": 5, "logprobs": 3, "ignore_eos": True}  # fmt: skip
            target = await http.post("/v1/completions", json=body)
            await asyncio.gather(*others)
            return target.json()

    served = asyncio.run(beside_others())["choices"][0]
    logprobs = served["logprobs"]
    assert served["text"] == alone.text
    chosen = zip(alone.token_ids, alone.logprobs, strict=True)
    assert logprobs["token_logprobs"] == [entry[token].logprob for token, entry in chosen]
