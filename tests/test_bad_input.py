"""Bad requests fail alone, before scheduling, with a message naming the field and its limit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.model_runner import available_memory

GOOD_PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=40)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"max_tokens": 0}, ["max_tokens", "greater than or equal to 1"]),
        ({"temperature": -0.5}, ["temperature", "greater than or equal to 0"]),
        ({"temperature": float("inf")}, ["temperature", "finite"]),
        ({"top_p": 0.0}, ["top_p", "greater than 0"]),
        ({"top_p": 1.5}, ["top_p", "less than or equal to 1"]),
        ({"min_p": 2.0}, ["min_p", "less than or equal to 1"]),
        ({"top_k": -2}, ["top_k", "greater than or equal to -1"]),
        ({"min_tokens": 9, "max_tokens": 4}, ["min_tokens", "max_tokens"]),
        ({"stop": [""]}, ["stop"]),
        ({"best_of_everything": 3}, ["best_of_everything", "not permitted"]),
        # Checked in float32, as the sampler holds them: 5e-324 is 0 there, 1e39 infinite.
        ({"top_p": 5e-324}, ["top_p", "float32"]),
        ({"temperature": 1e39}, ["temperature", "float32"]),
        ({"repetition_penalty": 1e-300}, ["repetition_penalty", "greater than or equal to 0.01"]),
        ({"repetition_penalty": 1e6}, ["repetition_penalty", "less than or equal to 100"]),
        ({"top_k": 2**63}, ["top_k", "less than or equal to 2147483647"]),
        ({"seed": 2**64}, ["seed", "less than 9223372036854775808"]),
        ({"max_tokens": 2**63}, ["max_tokens"]),
        ({"stop": ["a"] * 65}, ["stop", "at most 64"]),
        ({"stop_token_ids": [1] * 1025}, ["stop_token_ids", "at most 1024"]),
        ({"stop": "\ud800"}, ["stop", "surrogate"]),
        ({"logit_bias": {5: 101}}, ["logit_bias", "bias 101.0 of token 5 is outside [-100, 100]"]),
        ({"logit_bias": {-1: 1}}, ["logit_bias", "token id -1 is not a token id"]),
        ({"logit_bias": {5: float("nan")}}, ["logit_bias", "finite"]),
        ({"logit_bias": dict.fromkeys(range(1025), 1.0)}, ["logit_bias", "at most 1024"]),
        ({"logit_bias": {"five": 1}}, ["logit_bias", "valid integer"]),
    ],
)
def test_sampling_field_errors_name_the_field(fields, expected):
    with pytest.raises(ValueError) as error:
        SamplingParams(**fields)
    for words in expected:
        assert words in str(error.value)


@pytest.mark.parametrize(
    ("prompt", "params", "expected"),
    [
        ("", None, ["prompt", "empty"]),
        ([], None, ["prompt_token_ids", "empty"]),
        ([5, 49152], None, ["prompt_token_ids", "49152"]),
        ([7] * 1024, None, ["prompt", "1024 tokens", "context is 1024"]),
        ([7] * 1000, SamplingParams(max_tokens=100), ["max_tokens", "context of 1024"]),
        ([7] * 600, SamplingParams(max_tokens=100), ["KV cache", "640 tokens"]),
        ([7] * 700, SamplingParams(max_tokens=None), ["700 tokens", "KV cache holds 640 tokens"]),
        (GOOD_PROMPT, SamplingParams(stop_token_ids=[49152], min_tokens=2), ["stop_token_ids"]),
        ({"prompt_token_ids": [1], "extra": 1}, None, ["extra"]),
        (GOOD_PROMPT, SamplingParams(top_k=49153), ["top_k", "vocabulary of 49152"]),
        (GOOD_PROMPT, SamplingParams(logit_bias={5: 1, 49152: -3}), ["logit_bias", "49152"]),
        ("Hello \ud800", None, ["prompt", "surrogate", "character 6"]),
        # 1024 tokens of at most 81 characters (the vocabulary's longest): refused untokenized.
        ("x" * 90_000, None, ["prompt", "90000 characters", "82944"]),
        ([7] * 10**6, None, ["prompt", "1000000 tokens"]),
        ([7] * 10, SamplingParams(max_tokens=None, min_tokens=700), ["min_tokens", "631"]),
    ],
)
def test_bad_request_fails_and_others_keep_going(llm, prompt, params, expected):
    engine = llm.engine
    good = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    good_id = engine.add_request(GOOD_PROMPT, good)
    engine.step()
    with pytest.raises(ValueError) as error:
        engine.add_request(prompt, params)
    for words in expected:
        assert words in str(error.value)
    assert len(engine.scheduler.waiting) + len(engine.scheduler.running) == 1

    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == good_id and output.finished:
                final = output.final
    alone = llm.generate([GOOD_PROMPT], good)[0]
    assert final.outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(final.outputs[0].token_ids) == 12
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_generate_validates_every_prompt_before_scheduling_any(llm):
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()


def test_engine_settings_are_checked(tiny_checkpoint):
    with pytest.raises(ValueError, match="scheduler must be one of"):
        LLM(str(tiny_checkpoint("llama")), scheduler="fastest")
    for size in ("lots", "1e400", ".."):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            LLM(str(tiny_checkpoint("llama")), kv_cache_memory=size)
    with pytest.raises(ValueError, match="packed_weight_dtype must be one of"):
        LLM(str(tiny_checkpoint("llama")), packed_weight_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(str(tiny_checkpoint("llama")), kv_cache_dtype="fp8")


def test_a_kv_cache_beyond_the_machines_memory_is_refused_before_it_is_allocated(tiny_checkpoint):
    """Allocated anyway, the cache's pages would be handed out lazily and the process killed
    once they ran out; the check reads the memory available from /proc/meminfo."""
    available = available_memory()
    assert available is not None
    too_much = f"{2 * available // 2**30}GiB"
    with pytest.raises(ValueError, match=rf"KV cache \(kv_cache_memory '{too_much}'\).*available"):
        LLM(str(tiny_checkpoint("llama")), kv_cache_memory=too_much)
    blocks = 2 * available // 8192  # the tiny llama's blocks are 8 KiB
    with pytest.raises(ValueError, match=rf"num_kv_blocks {blocks}\).*GiB available"):
        LLM(str(tiny_checkpoint("llama")), num_kv_blocks=blocks)


def test_a_gguf_tensor_in_a_type_that_cannot_be_loaded_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    # Two rows of two Q8_1 blocks (40 bytes each: a float32 scale and sum, 32 int8 values).
    q8_1 = gguf.GGMLQuantizationType.Q8_1
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((2, 80), np.uint8), raw_dtype=q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.attn_q\.weight' is stored as Q8_1"):
        LLM(str(path))


def test_missing_model_files_are_named(tmp_path, tiny_checkpoint):
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory"):
        LLM(str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        LLM(str(tmp_path))


def test_a_chat_template_that_refuses_the_messages_is_a_value_error(llm, monkeypatch):
    # As Mistral's and Llama 2's templates do when roles do not alternate.
    template = (
        "{% if messages | length > 1 %}{{ raise_exception('roles must alternate') }}{% endif %}"
        "{{ messages[0]['content'] }}"
    )
    monkeypatch.setattr(llm.get_tokenizer(), "chat_template", template)
    twice = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    with pytest.raises(ValueError, match="roles must alternate"):
        llm.chat(twice, SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()


def test_a_tiny_positive_temperature_samples_at_vllms_floor():
    assert SamplingParams(temperature=1e-9).temperature == 0.01
    assert SamplingParams(temperature=0).temperature == 0.0


def test_chat_content_must_be_valid_unicode(llm):
    messages = [{"role": "user", "content": "fine"}, {"role": "user", "content": "a\udc00"}]
    with pytest.raises(ValueError, match=r"messages\[1\]\.content.*surrogate"):
        llm.chat(messages, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="messages is 90000 characters"):
        llm.chat([{"role": "user", "content": "x" * 90_000}], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
