"""Per-request generation settings, with vLLM's field names and validation that names the field.

Every value accepted here is one the sampler computes with safely: floats are checked as the
float32 the engine's tensors hold them in (5e-324 is positive as a Python float and 0 in float32),
integers fit the tensors they go into, and lists are bounded. What depends on the model (the
vocabulary, the context) is checked by the engine when the request arrives.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from pagedserve.validation import as_float32, check_unicode

MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # token ids one request may bias
MAX_BIAS = 100.0  # OpenAI's range for a bias, either way
# vLLM's floor: a positive temperature below it would scale logits past float32's range.
MIN_TEMPERATURE = 0.01
_INT32_MAX = 2**31 - 1


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
    logit_bias: Annotated[dict[int, float], Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="token id -> added to its logit before sampling, -100 to 100"
    )

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
