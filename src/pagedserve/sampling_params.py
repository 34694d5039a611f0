"""Per-request generation settings, with vLLM's field names and validation that names the field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SamplingParams(BaseModel):
    """Unknown fields and out-of-range values raise a ValueError (pydantic's ValidationError)."""

    # Non-finite values are refused: an infinite temperature turns banned logits into NaN.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    n: int = Field(1, ge=1, description="samples of the prompt, sharing its KV blocks")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1: no limit")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's, on output tokens")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's, per occurrence")
    repetition_penalty: float = Field(1.0, gt=0.0, description="HF's, on prompt and output tokens")
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    max_tokens: int | None = Field(16, ge=1, description="None: up to the model's context")
    min_tokens: int = Field(0, ge=0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = Field(None, ge=0, le=20, description="top alternatives per token")

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
        return value

    @model_validator(mode="after")
    def _min_within_max(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        return self

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
