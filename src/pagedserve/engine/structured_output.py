"""Structured outputs: a constraint compiled to a grammar, one matcher per sample, a mask per step.

A request's StructuredOutputsParams is compiled by xgrammar when the request arrives, against the
tokenizer's vocabulary (the model's vocabulary size, the engine's stop tokens); xgrammar's
compiler caches compiled grammars by their text, so a schema sent again costs nothing. Each sample
holds its own matcher, which has accepted exactly the sample's output tokens: the engine feeds it
every token it appends, a fork copies its parent's matcher, and a preempted sample keeps its
matcher (recomputation keeps the sample's tokens, so the state still holds). Before a step samples,
the constrained rows' matchers fill one bitmask in a single xgrammar call; the sampler sets every
logit the mask excludes to -inf before any other choice is made.

Invariant: a matcher that has accepted a stop token (terminated) is never asked for a mask: its
sample finishes on that token. A row where no token is allowed (the grammar admits none, or
min_tokens bans the only ones it admits) still draws one, from logits that are all -inf; the
matcher refuses it and the sample finishes with reason "error", so no constraint can stall the
engine.

xgrammar is imported on the first constrained request: a server that never sees one never loads it.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Sequence as SequenceOf
from types import ModuleType
from typing import Any

import torch

from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.validation import FieldError

FIELD = "structured_outputs"
# xgrammar's errors begin with "[time] /path/file.cc:line: "; the rest is the message.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


@functools.cache
def _xgrammar() -> ModuleType:
    import xgrammar

    return xgrammar


class GrammarCompiler:
    """Compiles constraints into matchers; safe to call from several threads."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: SequenceOf[int]):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()

    def matcher(self, constraint: StructuredOutputsParams):
        """A fresh matcher (xgrammar.GrammarMatcher) for one sample of this constraint; a
        FieldError naming structured_outputs, with xgrammar's message, when it does not compile."""
        compiler = self._get()
        try:
            compiled = _compile(compiler, constraint)
        except RuntimeError as error:
            message = _LOCATION.sub("", str(error).strip())
            raise FieldError(
                FIELD, f"{FIELD}: {_kind(constraint)} does not compile: {message}"
            ) from None
        return _xgrammar().GrammarMatcher(compiled)

    def _get(self):
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler


def _kind(constraint: StructuredOutputsParams) -> str:
    names = {"json_": "the JSON schema", "json_object": "JSON", "regex": "the regex",
             "choice": "the choice", "grammar": "the grammar"}  # fmt: skip
    return next(text for name, text in names.items() if getattr(constraint, name))


def _compile(compiler, constraint: StructuredOutputsParams):
    # JSON without free whitespace between tokens: a small model allowed any whitespace can
    # spend its whole budget on it, and the compact form is what OpenAI's API returns.
    if constraint.json_ is not None:
        schema = constraint.json_
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return compiler.compile_json_schema(text, any_whitespace=False)
    if constraint.json_object:
        # Any object: strict mode would admit only the properties the schema names (none).
        return compiler.compile_json_schema(
            '{"type": "object"}', any_whitespace=False, strict_mode=False
        )
    if constraint.regex is not None:
        return compiler.compile_regex(constraint.regex)
    if constraint.choice is not None:
        return compiler.compile_grammar(choice_grammar(constraint.choice))
    return compiler.compile_grammar(constraint.grammar)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar admitting exactly one of the strings. JSON's string escapes are the
    grammar's (\\", \\\\, \\n, \\uXXXX), and non-ASCII text stays as it is."""
    return "root ::= " + " | ".join(json.dumps(text, ensure_ascii=False) for text in choices)


class TokenMasks:
    """The allowed tokens of a batch's constrained rows, filled afresh for every step."""

    def __init__(self, matchers: list[tuple[int, Any]], num_rows: int, vocab_size: int):
        xgr = _xgrammar()
        self.rows = [row for row, _ in matchers]
        self._matchers = [matcher for _, matcher in matchers]
        self.bitmask = xgr.allocate_token_bitmask(num_rows, vocab_size)

    def fill(self) -> tuple[list[int], torch.Tensor]:
        """(rows, bitmask): bit t of row r's words is 1 where token t may follow."""
        _batch_matcher().batch_fill_next_token_bitmask(self._matchers, self.bitmask, self.rows)
        return self.rows, self.bitmask


@functools.cache
def _batch_matcher():
    return _xgrammar().BatchGrammarMatcher(max_threads=1)
