"""Penalties and logprobs, checked against transformers' model run outside the engine."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import _TINY_SHAPE, _TOKENIZER_FILES, reference_greedy
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedserve import LLM, SamplingParams
from pagedserve.engine.sampling_state import SamplingState

VOCAB = 256
PROMPT_LENGTHS = (3, 17, 40)
NEW_TOKENS = 20
TOLERANCE = 1e-4


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, VOCAB, n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_model_dir) -> Path:
    """conftest's tiny random llama over only 256 token ids: over its usual 49152 the greedy
    outputs never repeat a token (nor one of the prompt's), so no penalty would change them."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, **_TINY_SHAPE)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    target = tmp_path_factory.mktemp("tiny-llama-small-vocab")
    model.save_pretrained(target)
    for name in _TOKENIZER_FILES:
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, target / name)
    return target


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(str(checkpoint), dtype="float32")


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **kwargs)


def _run(llm: LLM, params: list[SamplingParams]):
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    return [out.outputs[0] for out in llm.generate(prompts, params)]


def reference_repetition(
    model, prompt: list[int], penalty: float
) -> tuple[list[int], list[torch.Tensor]]:
    """conftest's reference_greedy with transformers' own repetition penalty; also returns the
    log-softmax of the penalised scores of each step."""
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            repetition_penalty=penalty,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_scores=True,
        )
    scores = [step[0].log_softmax(dim=-1) for step in out.scores]
    return out.sequences[0, len(prompt) :].tolist(), scores


def reference_openai_penalties(
    model, prompt: list[int], presence: float, frequency: float, repetition: float
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding by full forwards on the growing sequence, with HF's repetition rule and
    then OpenAI's formula applied to the logits; returns the tokens and the log-softmax of the
    penalised logits of each step."""
    ids, tokens, logprobs = list(prompt), [], []
    vocab = model.config.vocab_size
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1]
            seen = torch.tensor(sorted(set(ids)))
            seen_logits = logits[seen]
            logits[seen] = torch.where(
                seen_logits > 0, seen_logits / repetition, seen_logits * repetition
            )
            counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=vocab)
            logits = logits - frequency * counts - presence * (counts > 0).float()
            tokens.append(int(logits.argmax()))
            logprobs.append(logits.log_softmax(dim=-1))
            ids.append(tokens[-1])
    return tokens, logprobs


def _teacher_forced_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: the log-softmax that predicted each output token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    return logits[len(prompt) - 1 : -1].log_softmax(dim=-1)


def test_repetition_penalty_matches_transformers(llm, hf_model):
    # The last row has no penalty, so the batch mixes penalised and plain rows.
    params = [_greedy(repetition_penalty=1.3, logprobs=0)] * 2 + [_greedy()]
    outputs = _run(llm, params)
    prompts = _prompts()
    for prompt, output in zip(prompts[:2], outputs[:2], strict=True):
        tokens, scores = reference_repetition(hf_model, prompt, 1.3)
        assert output.token_ids == tokens
        # The penalty must change the tokens, or the comparison above proves nothing.
        assert tokens != reference_greedy(hf_model, prompt, NEW_TOKENS)
        # The log-softmax normaliser sees every penalised logit, negative ones included.
        for token, entry, score in zip(tokens, output.logprobs, scores, strict=True):
            assert entry[token].logprob == pytest.approx(float(score[token]), abs=TOLERANCE)
    assert outputs[2].token_ids == reference_greedy(hf_model, prompts[2], NEW_TOKENS)


# (presence, frequency, repetition), one per prompt; the last mixes in the repetition penalty,
# which counts prompt tokens where the other two must not.
PENALTIES = ((1.5, 0.0, 1.0), (0.0, 1.2, 1.0), (-0.5, 2.0, 1.2))


def test_presence_and_frequency_penalties_match_reference(llm, hf_model):
    params = [
        _greedy(
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            logprobs=2,
        )
        for presence, frequency, repetition in PENALTIES
    ]
    outputs = _run(llm, params)
    for prompt, output, penalties in zip(_prompts(), outputs, PENALTIES, strict=True):
        tokens, ref_logprobs = reference_openai_penalties(hf_model, prompt, *penalties)
        assert output.token_ids == tokens
        assert tokens != reference_greedy(hf_model, prompt, NEW_TOKENS)
        # Logprobs come from the logits after the penalties.
        for token, entry, ref in zip(tokens, output.logprobs, ref_logprobs, strict=True):
            assert entry[token].logprob == pytest.approx(float(ref[token]), abs=TOLERANCE)


def test_greedy_logprobs_match_transformers(llm, hf_model):
    widths = (5, 0, 3)
    outputs = _run(llm, [_greedy(logprobs=k) for k in widths])
    tokenizer = llm.get_tokenizer()
    for prompt, output, k in zip(_prompts(), outputs, widths, strict=True):
        assert len(output.logprobs) == len(output.token_ids) == NEW_TOKENS
        reference = _teacher_forced_logprobs(hf_model, prompt, output.token_ids)
        for token, entry, ref in zip(output.token_ids, output.logprobs, reference, strict=True):
            assert entry[token].logprob == pytest.approx(float(ref[token]), abs=TOLERANCE)
            assert entry[token].rank == 1
            assert entry[token].decoded_token == tokenizer.decode([token])
            assert len(entry) == max(k, 1)
            ranked = sorted(entry.values(), key=lambda lp: lp.rank)
            assert [lp.rank for lp in ranked] == list(range(1, len(entry) + 1))
            ref_top = ref.topk(len(entry)).values.tolist()
            assert [lp.logprob for lp in ranked] == pytest.approx(ref_top, abs=TOLERANCE)


def test_sampled_logprobs_are_before_temperature(llm, hf_model):
    params = [
        SamplingParams(temperature=1.5, seed=s, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
        for s in range(3)
    ]
    outputs = _run(llm, params)
    ranks = []
    for prompt, output in zip(_prompts(), outputs, strict=True):
        reference = _teacher_forced_logprobs(hf_model, prompt, output.token_ids)
        for token, entry, ref in zip(output.token_ids, output.logprobs, reference, strict=True):
            chosen = entry[token]
            assert chosen.logprob == pytest.approx(float(ref[token]), abs=TOLERANCE)
            assert chosen.rank == int((ref >= ref[token]).sum())
            # The top token, plus the chosen one when it is not the top.
            assert len(entry) == (1 if chosen.rank == 1 else 2)
            top = next(lp for lp in entry.values() if lp.rank == 1)
            assert top.logprob == pytest.approx(float(ref.max()), abs=TOLERANCE)
            ranks.append(chosen.rank)
    assert max(ranks) > 1  # the k + 1 case was exercised


def _prompt_logprobs_reference(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: the log-softmax that predicted each prompt token but the first."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, :-1].log_softmax(dim=-1)


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"max_num_batched_tokens": 16}, {"block_size": 8, "num_kv_blocks": 12}],
    ids=["whole", "chunked", "preempted"],
)
def test_prompt_logprobs_match_transformers(checkpoint, hf_model, engine_args):
    """Every prompt token after the first gets the log-softmax that predicted it, with its rank
    and the top prompt_logprobs alternatives; a prompt computed in chunks, recomputed after
    preemption, or already in the prefix cache gets the same, once per position."""
    llm = LLM(str(checkpoint), dtype="float32", **engine_args)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    widths = (2, 0, 4)
    params = [_greedy(prompt_logprobs=k) for k in widths]
    first = llm.generate(prompts, params)
    again = llm.generate(prompts[2], params[2])[0]  # its blocks are cached now
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0
    tokenizer = llm.get_tokenizer()
    for prompt, result, k in zip(_prompts(), first, widths, strict=True):
        entries = result.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        reference = _prompt_logprobs_reference(hf_model, prompt)
        for token, entry, ref in zip(prompt[1:], entries[1:], reference, strict=True):
            assert entry[token].logprob == pytest.approx(float(ref[token]), abs=TOLERANCE)
            assert entry[token].rank == int((ref >= ref[token]).sum())
            assert entry[token].decoded_token == tokenizer.decode([token])
            ranked = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)
            assert [lp.logprob for lp in ranked] == pytest.approx(
                ref.topk(k).values.tolist(), abs=TOLERANCE
            )
        assert result.outputs[0].token_ids == reference_greedy(hf_model, prompt, NEW_TOKENS)
    assert again.prompt_logprobs == first[2].prompt_logprobs


def test_logprobs_off_and_streamed(llm):
    prompt = {"prompt_token_ids": _prompts()[1]}
    (plain,) = llm.generate(prompt, _greedy())
    assert plain.outputs[0].logprobs is None
    steps = list(llm.engine.stream(prompt, _greedy(logprobs=2)))
    streamed = [entry for step in steps for entry in step.new_logprobs]
    assert [t for step in steps for t in step.new_token_ids] == plain.outputs[0].token_ids
    assert streamed == steps[-1].final.outputs[0].logprobs
    assert all(step.new_logprobs is None for step in llm.engine.stream(prompt, _greedy()))


def test_plain_batches_build_no_penalty_or_logprob_tensors(llm):
    engine = llm.engine
    seqs = [engine.make_sequence({"prompt_token_ids": p}, _greedy()) for p in _prompts()]
    batch = engine.runner.sampling.batch(seqs)
    assert batch.penalties is None and batch.logprobs is None and batch.random is None
    seqs[1] = engine.make_sequence({"prompt_token_ids": [5, 6]}, _greedy(frequency_penalty=1))
    assert engine.runner.sampling.batch(seqs).penalties is not None


def test_a_kept_batch_steps_to_what_a_fresh_upload_gives(llm):
    """While the same rows sample, a step only adds each row's drawn token and output index;
    after every step the kept tensors equal those built from scratch for the same rows."""
    engine = llm.engine
    settings = [
        _greedy(repetition_penalty=1.3, min_tokens=3, logprobs=2),
        SamplingParams(temperature=0.8, top_k=5, seed=3, frequency_penalty=0.5, max_tokens=8),
        _greedy(presence_penalty=0.7, stop_token_ids=[7], min_tokens=5),
        _greedy(),
    ]
    seqs = [
        engine.make_sequence({"prompt_token_ids": prompt}, params)
        for prompt, params in zip([*_prompts(), [4, 5, 6]], settings, strict=True)
    ]
    for seq in seqs:
        seq.token_ids += [9, 9]  # outputs already drawn: they count in the penalties
    kept = engine.runner.sampling
    for step in range(6):
        batch = kept.batch(seqs)
        fresh = SamplingState(engine.runner.device, engine.vocab_size, engine.eos_token_ids)
        expected = fresh.batch(seqs)
        for name in ("seen", "counts", "presence", "frequency", "repetition"):
            assert torch.equal(getattr(batch.penalties, name), getattr(expected.penalties, name))
        assert torch.equal(batch.random.output_index, expected.random.output_index)
        assert torch.equal(batch.random.seeds, expected.random.seeds)
        assert torch.equal(batch.logprobs.rows, expected.logprobs.rows)
        if expected.banned is None:
            assert batch.banned is None, step
        else:
            assert all(map(torch.equal, batch.banned, expected.banned)), step
        drawn = torch.tensor([11 + step, 12, 13 + step % 2, 14])
        kept.drawn(drawn)
        for seq, token in zip(seqs, drawn.tolist(), strict=True):
            seq.token_ids.append(token)
    assert expected.banned is None  # every row is past its min_tokens by now
    assert kept.batch(seqs[:3]) is not batch  # other rows: built again


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 3),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 2.1),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("logprobs", 21),
        ("logprobs", -1),
    ],
)
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
