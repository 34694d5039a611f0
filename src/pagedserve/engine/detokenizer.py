"""Incremental detokenization and stop-string matching for one request.

Text is decoded over a short sliding window of tokens so that each step costs the same however
long the output grows, and a piece is only emitted once it no longer ends in a partial UTF-8
character. Text that could still turn out to be the start of a stop string is held back, so a
stream never shows a stop string and the streamed pieces add up to the final text.
"""

from __future__ import annotations

from dataclasses import dataclass

# Prompt tokens decoded before the first output token, so that tokenizers which drop a leading
# space at the start of a decode see the same context as in the full text.
_CONTEXT_TOKENS = 5


@dataclass
class DetokenizedPiece:
    text: str
    stop_string: str | None = None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special: bool):
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.stop = stop
        self.skip_special = skip_special
        self.text = ""  # all decoded output text, the held-back tail included
        self.emitted = 0  # how much of self.text has been handed out
        self.hold_back = max((len(s) for s in stop), default=1) - 1

    def add_token(self, token_id: int, check_stop: bool) -> DetokenizedPiece:
        self.token_ids.append(token_id)
        self.text += self._decode_new()
        if check_stop:
            stop_string, cut = self._find_stop()
            if stop_string is not None:
                self.text = self.text[:cut]
                return DetokenizedPiece(self._take(len(self.text)), stop_string)
        return DetokenizedPiece(self._take(len(self.text) - self.hold_back))

    def flush(self) -> str:
        """Everything not yet handed out, once the request has finished."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        end = max(end, self.emitted)
        piece = self.text[self.emitted : end]
        self.emitted = end
        return piece

    def _decode_new(self) -> str:
        decode = self.tokenizer.decode
        prefix = decode(
            self.token_ids[self.prefix_offset : self.read_offset],
            skip_special_tokens=self.skip_special,
        )
        full = decode(self.token_ids[self.prefix_offset :], skip_special_tokens=self.skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full[len(prefix) :]

    def _find_stop(self) -> tuple[str | None, int]:
        # A match starting in text already handed out would have been found at an earlier step.
        found: tuple[int, str] | None = None
        for stop_string in self.stop:
            position = self.text.find(stop_string, self.emitted)
            if position != -1 and (found is None or position < found[0]):
                found = (position, stop_string)
        if found is None:
            return None, len(self.text)
        return found[1], found[0]
