"""Tensor parallelism: the model cut across processes joined by gloo gives, token for token, what
one process gives, on every architecture's tiny checkpoint, and on the default model's GGUF file
with its blocks cut as they are stored."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import openai
import pytest
from conftest import ServerProcess
from gguf_quantize import mixed_type, requantized_default_gguf

from pagedserve import LLM, SamplingParams
from pagedserve.engine.tensor_parallel import core_shares
from pagedserve.model.parallel import TensorParallel

PROMPT_LENGTHS = (1, 5, 16, 17, 33, 48, 70, 130)
NEW_TOKENS = 32


def _generate(llm: LLM, prompts: list) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    try:
        return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    finally:
        llm.close()


def _token_prompts() -> list[dict]:
    rng = np.random.default_rng(3)
    # Two share their first 32 tokens, so that the second finds them in the prefix cache.
    shared = rng.integers(3, 49152, 32).tolist()
    prompts = [rng.integers(3, 49152, n).tolist() for n in PROMPT_LENGTHS]
    prompts += [shared + prompts[2], shared + prompts[3]]
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.mark.parametrize(
    ("architecture", "backend"),
    [("llama", "shm"), ("llama", "gloo"), ("qwen2", "auto"), ("qwen3", "auto"),
     ("phi3", "auto"), ("gemma2", "auto")],
)  # fmt: skip
def test_two_ranks_generate_what_one_does(architecture, backend, tiny_checkpoint):
    # 22 blocks of 8 tokens hold barely two of the longer requests: preemption and recompute.
    args = dict(dtype="float32", block_size=8, num_kv_blocks=22, max_num_batched_tokens=64)
    path = str(tiny_checkpoint(architecture))
    prompts = _token_prompts()
    one = LLM(path, **args)
    expected = _generate(one, prompts)
    two = LLM(path, tensor_parallel_size=2, distributed_backend=backend, **args)
    model = two.engine.runner.model
    parallel = model.config
    assert (parallel.num_heads, parallel.num_kv_heads, parallel.intermediate_size) == (2, 1, 64)
    assert model.vocab == range(24576)  # rank 0's half of the embeddings and logits
    assert model.embed_tokens.shape[0] == 24576
    assert _generate(two, prompts) == expected
    assert two.engine.scheduler.num_preemptions > 0
    assert two.engine.stats.prefix_cache_hits > 0


def test_three_ranks_cut_every_gguf_block_type_as_stored(tmp_path, monkeypatch):
    # The default model's 9 heads, 3 KV heads and 1536 MLP features cut in 3; its maps stored in
    # every block type, the row-parallel ones cut between blocks.
    path = requantized_default_gguf(tmp_path / "SmolLM2-135M-Instruct.mixed.gguf", mixed_type)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    prompts = ["The history of the Roman Empire", "def fibonacci(n):", "Photosynthesis is"]
    expected = _generate(LLM(str(path), dtype="float32"), prompts)
    three = LLM(str(path), dtype="float32", tensor_parallel_size=3, cpu_binding="none")
    runner = three.engine.runner
    assert runner.packed_weight_dtypes == ("q4_1+q4_k+q5_0+q5_1+q5_k+q6_k+q8_0", "q8_0")
    assert runner.model.layers[0].mlp.down_proj.weight is None  # packed from the blocks
    # The tied embeddings' blocks: a third of the vocabulary's rows, looked up and packed.
    assert runner.model.embedding_blocks.rows.shape[0] == 49152 // 3
    assert _generate(three, prompts) == expected


def test_logprobs_gathered_from_the_ranks_shares_of_the_vocabulary(tiny_checkpoint):
    # Prompt logprobs over 130 rows and 4 sampled rows: logits gathered in parts, the rows of
    # shared memory's slot (64 tokens of 64 floats) holding one row of 24576 logits at a time.
    args = dict(dtype="float32", max_num_batched_tokens=64, cpu_binding="none")
    path = str(tiny_checkpoint("llama"))
    prompts = _token_prompts()[4:8]
    params = SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )

    def run(llm: LLM) -> list:
        try:
            return llm.generate(prompts, params)
        finally:
            llm.close()

    one, two = run(LLM(path, **args)), run(LLM(path, tensor_parallel_size=2, **args))
    for alone, parallel in zip(one, two, strict=True):
        assert parallel.outputs[0].token_ids == alone.outputs[0].token_ids
        pairs = [*zip(alone.prompt_logprobs[1:], parallel.prompt_logprobs[1:], strict=True)]
        pairs += [*zip(alone.outputs[0].logprobs, parallel.outputs[0].logprobs, strict=True)]
        for expected, got in pairs:
            assert got.keys() == expected.keys()
            for token, entry in expected.items():
                assert got[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
                # A prompt token far down the list may swap places with one within 1e-6 of it.
                assert abs(got[token].rank - entry.rank) <= (entry.rank > 3)


def test_the_vocabulary_is_cut_in_consecutive_shares_that_differ_by_one_at_most():
    shares = [TensorParallel(rank, 3).vocab_range(49153) for rank in range(3)]
    assert shares == [range(0, 16384), range(16384, 32768), range(32768, 49153)]
    assert TensorParallel(0, 3).vocab_widths(10) == [3, 3, 4]


def test_a_size_that_does_not_divide_the_heads_is_refused_before_loading(tiny_checkpoint):
    with pytest.raises(
        ValueError, match="tensor_parallel_size 3 must divide the model's num_heads"
    ):
        LLM(str(tiny_checkpoint("llama")), tensor_parallel_size=3, cpu_binding="none")


def test_ranks_get_their_own_cores_or_share_them():
    cores = sorted(os.sched_getaffinity(0))
    assert core_shares(len(cores), "auto") == [[core] for core in cores]
    assert core_shares(2, "none") == [None, None]
    with pytest.raises(ValueError, match="more than this machine's"):
        core_shares(len(cores) + 1, "auto")


def test_bad_tensor_parallel_settings_name_the_field():
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer"):
        LLM(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_backend must be one of"):
        LLM(distributed_backend="mpi")
    with pytest.raises(ValueError, match="cpu_binding must be one of"):
        LLM(cpu_binding="numa")


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_the_default_model_serves_over_http_on_three_ranks_until_one_dies(default_model_dir):
    prompt = "The history of the Roman Empire"
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = LLM(dtype="float32").generate([prompt], params)[0].outputs[0].text
    server = ServerProcess(
        "--tensor-parallel-size", "3", "--cpu-binding", "none", "--served-model-name", "default"
    )
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)
        completion = client.completions.create(
            model="default", prompt=prompt, max_tokens=16, temperature=0
        )
        assert completion.choices[0].text == expected
        workers = _children(server.process.pid)
        assert len(workers) >= 2
        os.kill(workers[-1], signal.SIGKILL)
        time.sleep(1)
        # The next step finds a rank gone: the request gets a 503, not a hang, and the engine
        # (and with it the server) stops, naming the rank.
        with pytest.raises(openai.APIStatusError) as failed:
            client.with_options(timeout=60).completions.create(
                model="default", prompt=prompt, max_tokens=16
            )
        assert failed.value.status_code == 503 and "tensor-parallel rank" in str(failed.value)
        assert server.process.wait(timeout=60) != 0
        assert "tensor-parallel rank" in server.log_tail(20000)
    finally:
        server.close()
