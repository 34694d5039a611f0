"""Per-request generation settings, with vLLM's field names and validation that names the field.

Every value accepted here is one the sampler computes with safely: floats are checked as the
float32 the engine's tensors hold them in (5e-324 is positive as a Python float and 0 in float32),
integers fit the tensors they go into, and lists are bounded. What depends on the model (the
vocabulary, the context) is checked by the engine when the request arrives.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pagedserve.validation import as_float32, check_unicode

MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # token ids one request may bias
MAX_BIAS = 100.0  # OpenAI's range for a bias, either way
MAX_CHOICES = 1024  # strings one choice constraint may list
# Nesting of a JSON schema's document (its objects and arrays; a nested object property costs
# two levels): xgrammar's compile time grows steeply with it, 0.03 s at 100 levels, 7 s at 800,
# minutes at 4,000.
MAX_SCHEMA_DEPTH = 64
# vLLM's floor: a positive temperature below it would scale logits past float32's range.
MIN_TEMPERATURE = 0.01
_INT32_MAX = 2**31 - 1


class StructuredOutputsParams(BaseModel):
    """A constraint on the output, in vLLM's names: exactly one of a JSON schema (`json`), any
    JSON object (`json_object`), a regular expression, a list of strings to choose from, or a
    grammar in EBNF (GBNF, as llama.cpp writes it). The engine compiles it with xgrammar when the
    request arrives; a constraint xgrammar refuses is a FieldError naming structured_outputs.
    The schema is given as `json` and read as `json_` (BaseModel has a method named json)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: str | None = None

    @field_validator("json_", "regex", "grammar", "choice")
    @classmethod
    def _valid_unicode(cls, value, info: ValidationInfo):
        texts = value if isinstance(value, list) else [value]
        for text in texts:
            if isinstance(text, str):
                check_unicode(info.field_name.rstrip("_"), text)
        return value

    @field_validator("json_")
    @classmethod
    def _schema_not_too_deep(cls, value: str | dict[str, Any] | None):
        if value is not None:
            depth = json_depth(value)
            if depth > MAX_SCHEMA_DEPTH:
                shown = "more than 1,000" if depth == sys.maxsize else str(depth)
                raise ValueError(
                    f"the schema nests {shown} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed"
                )
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsParams:
        given = [
            field.alias or name
            for name, field in type(self).model_fields.items()
            if getattr(self, name) not in (None, False)
        ]
        if len(given) != 1:
            named = ", ".join(given) if given else "none"
            raise ValueError(
                "exactly one of json, json_object, regex, choice or grammar must be given "
                f"(given: {named})"
            )
        return self


def json_depth(value: str | dict | list) -> int:
    """How deeply objects and arrays nest in a JSON document or its text (0 for text that is not
    JSON; a very large number for text too deep for Python's parser)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except RecursionError:
            return sys.maxsize
        except ValueError:
            return 0
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            children = item.values() if isinstance(item, dict) else item
            pending += [(child, depth + 1) for child in children]
    return deepest


class SamplingParams(BaseModel):
    """Unknown fields and out-of-range values raise a ValueError (pydantic's ValidationError)."""

    # Non-finite values are refused: an infinite temperature turns banned logits into NaN.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    n: int = Field(1, ge=1, le=_INT32_MAX, description="samples of the prompt, sharing its KV")
    temperature: float = Field(
        1.0, ge=0.0, description=f"0 means greedy; a positive value below {MIN_TEMPERATURE} "
        "samples at that floor, as vLLM does",
    )  # fmt: skip
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=_INT32_MAX, description="0 or -1: no limit")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's, on output tokens")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's, per occurrence")
    # Bounded so that a penalised logit stays finite in float32 at the lowest temperature.
    repetition_penalty: float = Field(
        1.0, ge=0.01, le=100.0, description="HF's, on prompt and output tokens"
    )
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    max_tokens: int | None = Field(
        16, ge=1, le=_INT32_MAX, description="None: up to the model's context"
    )
    min_tokens: int = Field(0, ge=0, le=_INT32_MAX)
    stop: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] = Field(default_factory=list)
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] = Field(
        default_factory=list
    )
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="top alternatives per token"
    )
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description="top alternatives per prompt token (vLLM's); the first token has none",
    )  # fmt: skip
    logit_bias: Annotated[dict[int, float], Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="token id -> added to its logit before sampling, -100 to 100"
    )
    structured_outputs: StructuredOutputsParams | None = None

    @field_validator("logit_bias")
    @classmethod
    def _biases_in_range(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if not value:
            return None
        for token, bias in value.items():
            if not 0 <= token <= _INT32_MAX:
                raise ValueError(f"token id {token} is not a token id")
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise ValueError(f"bias {bias} of token {token} is outside [-100, 100]")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: str | list[str] | None) -> list[str]:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str]) -> list[str]:
        if any(not text for text in value):
            raise ValueError("stop strings must not be empty")
        for text in value:
            check_unicode("stop", text)
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature_floor(cls, value: float) -> float:
        as_float32("temperature", value)
        return max(value, MIN_TEMPERATURE) if value > 0 else value

    @field_validator("top_p")
    @classmethod
    def _top_p_positive_in_float32(cls, value: float) -> float:
        # The sampler keeps tokens whose preceding mass is below top_p; at 0 it would keep none.
        if as_float32("top_p", value) == 0.0:
            raise ValueError(f"top_p {value} is 0 in float32, the precision the sampler uses")
        return value

    @field_validator("min_tokens")
    @classmethod
    def _min_within_max(cls, value: int, info: ValidationInfo) -> int:
        # max_tokens is declared, so validated, first: the error then names min_tokens.
        max_tokens = info.data.get("max_tokens")
        if max_tokens is not None and value > max_tokens:
            raise ValueError(f"min_tokens ({value}) must not exceed max_tokens ({max_tokens})")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
