"""Structured outputs (xgrammar): JSON schemas, JSON objects, regexes, choices and grammars hold
on the default model, offline and through a real server driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import httpx
import openai
import pytest
from conftest import ServerProcess
from pydantic import BaseModel, ConfigDict, Field

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.validation import FieldError


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    languages: list[Literal["en", "fr", "de"]] = Field(max_length=3)


PHONE = r"\(\d{3}\) \d{3}-\d{4}"
COLOURS = ["red", "green", "blue", 'dark "navy" blue']
# Up to four words of lowercase letters, separated by commas.
GRAMMAR = 'root ::= word ("," word){0,3}\nword ::= [a-z]{1,8}'
PROMPT = "Describe a person as JSON with a name, an age and the languages they speak."
# Greedy, the default model closes a free JSON object for this prompt (for PROMPT it lists
# languages until max_tokens).
OBJECT_PROMPT = "A JSON object with a city and its country:"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=16)


def _holds(kind: str, text: str) -> bool:
    if kind == "json":
        return Person.model_validate_json(text) is not None
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(PHONE, text) is not None
    if kind == "choice":
        return text in COLOURS
    return re.fullmatch(r"[a-z]{1,8}(,[a-z]{1,8}){0,3}", text) is not None


CONSTRAINTS = {
    "json": {"json": Person.model_json_schema()},
    "json_object": {"json_object": True},
    "regex": {"regex": PHONE},
    "choice": {"choice": COLOURS},
    "grammar": {"grammar": GRAMMAR},
}


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_every_sample_holds_to_its_constraint(llm, kind):
    """n = 4 samples (each fork with its own matcher) end where the grammar ends, with reason
    stop, and hold to it. At temperature 1, except for a free JSON object, which a sampled
    small model may never close."""
    params = SamplingParams(
        n=4, temperature=0.0 if kind == "json_object" else 1.0, seed=7, max_tokens=120,
        structured_outputs=StructuredOutputsParams(**CONSTRAINTS[kind]),
    )  # fmt: skip
    [result] = llm.generate(OBJECT_PROMPT if kind == "json_object" else PROMPT, params)
    for sample in result.outputs:
        assert sample.finish_reason == "stop", sample.text
        assert _holds(kind, sample.text), sample.text


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(llm):
    """A request's tokens and logprobs are bit-identical alone and beside constrained ones."""
    plain = SamplingParams(temperature=0.8, seed=3, max_tokens=24, logprobs=2)
    alone = llm.generate(["Once upon a time", "The capital of France is"], plain)
    constrained = [
        SamplingParams(max_tokens=60, temperature=t, seed=1, structured_outputs=constraint)
        for t, constraint in ((0.0, {"json_object": True}), (1.0, {"regex": PHONE}))
    ]
    mixed = llm.generate(
        ["Once upon a time", OBJECT_PROMPT, "The capital of France is", "Call me at"],
        [plain, constrained[0], plain, constrained[1]],
    )
    for before, after in zip(alone, [mixed[0], mixed[2]], strict=True):
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
        assert after.outputs[0].logprobs == before.outputs[0].logprobs
    assert _holds("json_object", mixed[1].outputs[0].text)
    assert _holds("regex", mixed[3].outputs[0].text)


def test_preempted_constrained_samples_resume_their_grammar():
    """Preempted and recomputed, a constrained request generates what it does unpreempted."""
    params = SamplingParams(
        temperature=0.0, max_tokens=80,
        structured_outputs=StructuredOutputsParams(json=Person.model_json_schema()),
    )  # fmt: skip
    prompts = [f"{PROMPT} Person number {i}." for i in range(6)]
    roomy = LLM(max_num_seqs=16)
    expected = [[s.text for s in r.outputs] for r in roomy.generate(prompts, params)]
    del roomy
    tight = LLM(max_num_seqs=16, block_size=8, num_kv_blocks=16, max_num_batched_tokens=64)
    got = [[s.text for s in r.outputs] for r in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert all(_holds("json", text) for texts in got for text in texts)


BAD = [
    ({"json": {"type": "no-such-type"}}, "Unsupported type"),
    ({"json": "{not json"}, "Failed to parse JSON"),
    ({"regex": "(ab"}, "parenthesis is not closed"),
    ({"grammar": "root ::= missing"}, 'Rule "missing" is not defined'),
]


@pytest.mark.parametrize(("constraint", "message"), BAD)
def test_a_constraint_that_does_not_compile_is_refused_by_name(llm, constraint, message):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(FieldError, match=re.escape(message)) as raised:
        llm.generate("Hi", params)
    assert raised.value.field == "structured_outputs"
    assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_min_tokens_beyond_the_grammar_ends_the_sample_with_an_error(llm):
    """The grammar allows only a stop token where min_tokens bans it: no token is allowed, the
    one drawn is refused, and the sample ends with reason error; its neighbour runs on."""
    stuck = SamplingParams(
        min_tokens=4, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["red"])
    )
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results = llm.generate(["Pick a colour:", "Count: 1, 2,"], [stuck, plain])
    assert results[0].outputs[0].finish_reason == "error"
    assert results[1].outputs[0].finish_reason == "length"
    assert len(results[1].outputs[0].token_ids) == 8


# The server: the official openai client against a real process serving the default model.


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--served-model-name", "smol", "--max-num-seqs", "24")
    yield process
    process.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def test_parse_into_a_pydantic_model_for_twenty_seeds(server):
    """openai's chat.completions.parse sends the model's schema as a strict json_schema response
    format; at temperature 1 every seed's answer parses into the model."""
    aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none")

    async def one(seed: int):
        completion = await aclient.chat.completions.parse(
            model="smol",
            messages=[{"role": "user", "content": PROMPT}],
            response_format=Person,
            temperature=1.0,
            seed=seed,
            max_tokens=120,
        )
        return completion.choices[0]

    async def all_seeds():
        return await asyncio.gather(*(one(seed) for seed in range(20)))

    choices = asyncio.run(all_seeds())
    for choice in choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)
    assert len({choice.message.content for choice in choices}) > 10


def test_each_spelling_of_a_constraint_holds(client):
    chat = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": OBJECT_PROMPT}], max_tokens=120,
        response_format={"type": "json_object"}, temperature=0.0,
    )  # fmt: skip
    assert _holds("json_object", chat.choices[0].message.content)
    completions = {
        "regex": {"structured_outputs": {"regex": PHONE}},
        "choice": {"guided_choice": COLOURS},
        "grammar": {"guided_grammar": GRAMMAR},
        "json": {"guided_json": Person.model_json_schema()},
    }
    for kind, body in completions.items():
        result = client.completions.create(
            model="smol", prompt=PROMPT, max_tokens=120, n=3, temperature=1.0, seed=2,
            extra_body=body,
        )  # fmt: skip
        for choice in result.choices:
            assert choice.finish_reason == "stop"
            assert _holds(kind, choice.text), (kind, choice.text)


def test_streamed_and_whole_answers_are_the_same(client):
    schema = {"name": "person", "schema": Person.model_json_schema(), "strict": True}
    request = dict(
        model="smol", messages=[{"role": "user", "content": PROMPT}], max_tokens=120, n=4,
        temperature=1.0, seed=9, response_format={"type": "json_schema", "json_schema": schema},
    )  # fmt: skip
    whole = client.chat.completions.create(**request)
    texts = ["", "", "", ""]
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [choice.message.content for choice in whole.choices]
    assert all(_holds("json", text) for text in texts)


BAD_REQUESTS = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
            }
        },
        "response_format",
        "Unsupported type",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "type"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "not closed"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "regexp"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "missing"),
    ({"guided_choice": []}, "guided_choice", "at least 1"),
    ({"guided_regex": "a", "guided_json": {}}, "guided_json", "one output constraint"),
    ({"guided_json": "[" * 65 + "]" * 65}, "guided_json", "65 levels deep; at most 64"),
]


@pytest.mark.parametrize(("change", "param", "said"), BAD_REQUESTS)
def test_bad_constraints_are_400s_naming_the_field_while_others_complete(
    server, change, param, said
):
    async def bad_beside_good() -> tuple[httpx.Response, httpx.Response]:
        good = {"prompt": "Name a colour:", "max_tokens": 8,
                "structured_outputs": {"choice": COLOURS}}  # fmt: skip
        bad = {"prompt": "Name a colour:", "max_tokens": 8, **change}
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            good_call = asyncio.create_task(http.post("/v1/completions", json=good))
            bad_response = await http.post("/v1/completions", json=bad)
            return bad_response, await good_call

    bad, good = asyncio.run(bad_beside_good())
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["param"].split(".")[0] == param
    assert said in error["message"]
    assert good.status_code == 200
    assert good.json()["choices"][0]["text"] in COLOURS
