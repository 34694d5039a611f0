"""Builds OpenAI response bodies and stream chunks from the engine's outputs."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from pagedserve.outputs import Logprob, StepOutput

TokenLogprobs = list[dict[int, Logprob] | None]


@dataclass
class Choice:
    """One output (one sample of one prompt) being built from its streamed pieces."""

    index: int
    text: list[str] = field(default_factory=list)
    # With echo, the prompt's entries come first, None for its first token (first_token).
    logprobs: TokenLogprobs = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    echoed: bool = False
    first_token: str = ""
    prompt_logprobs: TokenLogprobs | None = None

    def add(self, output: StepOutput) -> None:
        self.text.append(output.new_text)
        self.logprobs.extend(output.new_logprobs or [])
        self.num_tokens += len(output.new_token_ids)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.finish_reason is not None:
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(choices: list[Choice], prompt_tokens: int) -> dict:
    completion_tokens = sum(c.num_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_fields(output: StepOutput | Choice) -> dict:
    return {"finish_reason": output.finish_reason, "stop_reason": output.stop_reason}


def envelope(request_id: str, kind: str, model: str, created: int) -> dict:
    return {"id": request_id, "object": kind, "created": created, "model": model}


def now_seconds() -> int:
    return int(time.time())


def completion_logprobs(
    entries: TokenLogprobs, text_offset: int, first_token: str = ""
) -> dict | None:
    """The completions API's column layout: tokens, token_logprobs, top_logprobs, text_offset.
    A None entry is an echoed prompt's first token (first_token), which has no logprob."""
    if not entries:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        if entry is None:
            token = first_token
            token_logprobs.append(None)
            top.append(None)
        else:
            chosen = _chosen(entry)
            token = chosen.decoded_token or ""
            token_logprobs.append(chosen.logprob)
            top.append({lp.decoded_token or "": lp.logprob for lp in entry.values()})
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def prompt_logprobs(entries: TokenLogprobs) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token, its entry by token id (None for the first)."""
    return [
        None
        if entry is None
        else {
            str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token, lp in entry.items()
        }
        for entry in entries
    ]


def chat_logprobs(entries: TokenLogprobs, top_logprobs: int) -> dict | None:
    """The chat API's layout: one object per token with its own top alternatives."""
    if not entries:
        return None
    content = []
    for entry in entries:
        chosen = _chosen(entry)
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)[:top_logprobs]
        content.append(
            {
                **_chat_token(chosen),
                "top_logprobs": [_chat_token(lp) for lp in ranked],
            }
        )
    return {"content": content}


def _chosen(entry: dict[int, Logprob]) -> Logprob:
    # The first entry is always the sampled token.
    return next(iter(entry.values()))


def _chat_token(lp: Logprob) -> dict:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}


def error_body_for_stream(message: str) -> dict:
    """A stream that has already begun with 200 reports a late failure as an error event."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": 500}}
