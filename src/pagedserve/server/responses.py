"""Builds OpenAI response bodies and stream chunks from the engine's outputs."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from pagedserve.outputs import Logprob, RequestOutput, StepOutput

TokenLogprobs = list[dict[int, Logprob]]


@dataclass
class Choice:
    """One output being built: its streamed text so far and, once finished, its result."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: TokenLogprobs = field(default_factory=list)
    final: RequestOutput | None = None

    def add(self, output: StepOutput) -> None:
        self.text.append(output.new_text)
        self.logprobs.extend(output.new_logprobs or [])
        if output.final is not None:
            self.final = output.final


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(choices: list[Choice], prompt_tokens: int) -> dict:
    completion_tokens = sum(len(c.final.outputs[0].token_ids) for c in choices if c.final)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_fields(output: StepOutput | Choice) -> dict:
    final = output.final
    if final is None:
        return {"finish_reason": None, "stop_reason": None}
    completion = final.outputs[0]
    return {"finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}


def envelope(request_id: str, kind: str, model: str, created: int) -> dict:
    return {"id": request_id, "object": kind, "created": created, "model": model}


def now_seconds() -> int:
    return int(time.time())


def completion_logprobs(entries: TokenLogprobs, text_offset: int) -> dict | None:
    """The completions API's column layout: tokens, token_logprobs, top_logprobs, text_offset."""
    if not entries:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        chosen = _chosen(entry)
        token = chosen.decoded_token or ""
        tokens.append(token)
        token_logprobs.append(chosen.logprob)
        top.append({lp.decoded_token or "": lp.logprob for lp in entry.values()})
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


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
